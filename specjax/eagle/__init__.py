"""EAGLE-3: a draft head over the target's fused features, trained with TTT."""

from specjax.eagle.head import Eagle3Head, HeadConfig
from specjax.eagle.ttt import TTTBatch, dense_mask, target_batch, ttt_loss
from specjax.eagle.vocab import DraftVocab, build_draft_vocab

__all__ = ["DraftVocab", "Eagle3Head", "HeadConfig", "TTTBatch",
           "build_draft_vocab", "dense_mask", "target_batch", "ttt_loss"]
