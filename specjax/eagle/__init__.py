"""EAGLE-3 (and the EAGLE-1 baseline): draft heads over the target's hidden
states, trained with the training-time test, drafting inside the engine."""

from specjax.eagle.drafter import EagleDrafter, EagleParams
from specjax.eagle.evaluate import expected_tau, heldout_accuracy
from specjax.eagle.export import load_head, save_head
from specjax.eagle.head import Eagle1Head, Eagle3Head, HeadConfig, head_module
from specjax.eagle.ttt import TTTBatch, dense_mask, target_batch, ttt_loss
from specjax.eagle.vocab import DraftVocab, build_draft_vocab

__all__ = ["DraftVocab", "Eagle1Head", "Eagle3Head", "EagleDrafter",
           "EagleParams", "HeadConfig", "TTTBatch", "build_draft_vocab",
           "dense_mask", "expected_tau", "head_module", "heldout_accuracy",
           "load_head", "save_head",
           "target_batch", "ttt_loss"]
