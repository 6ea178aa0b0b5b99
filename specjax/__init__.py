"""specjax: speculative decoding for LLMs as jitted pure JAX functions.

Axis vocabulary, used in names (``logits_BTV``) and einsum strings everywhere:

  B batch · T new tokens this step · S cache capacity (slots) · L layers ·
  D model width · N query heads · G kv heads · R = N/G heads per kv head ·
  J = R + 2 fused q/k/v heads per kv head · H head dim · F MLP width ·
  V vocab · Vd draft vocab · K draft length (a tree's depth) · M tree
  nodes · C tree candidates · W tree width · P positions picked for logits.

Public API (everything else is an implementation detail):
"""

from specjax.core.bucketing import bucket_length, capacity_for, pad_prompts
from specjax.core.cache import KVCache
from specjax.core.engine import (DecodeConfig, DecodeState, generate,
                                 generate_jit, prefill, prefill_jit, step,
                                 step_jit, stream)
from specjax.core.runner import BatchResult, RowResult, generate_ids
from specjax.core.sampling import (RowSampling, SamplingParams, sample_logits,
                                   warp)
from specjax.core.sharding import make_mesh, on_mesh, shard_params
from specjax.core.tree import Tree, TreeResult, verify_tree
from specjax.core.verify import ChainResult, verify_chain
from specjax.drafters import (AR, Context, Datastore, DraftModelDrafter,
                              Drafter, LayerSkipDrafter, Method, NGramDrafter,
                              Proposal, RetrievalDrafter, build_datastore,
                              sharegpt_datastore)
from specjax.drafters.methods import MethodSpec
from specjax.drafters.methods import build as build_method
from specjax.models.config import ModelConfig, RopeScaling
from specjax.models.decoder import Decoder, pack_params
from specjax.models.registry import Model, load_model
from specjax.models.target import ForwardOutput, Target
from specjax.models.tokenizer import StreamDecoder, Tokenizer

__version__ = "0.1.0"

__all__ = [
    "AR", "BatchResult", "ChainResult", "Context", "Datastore",
    "DecodeConfig", "DecodeState", "Decoder", "DraftModelDrafter", "Drafter",
    "ForwardOutput", "KVCache", "LayerSkipDrafter", "Method", "MethodSpec",
    "NGramDrafter", "Proposal",
    "RetrievalDrafter", "Model", "ModelConfig", "RopeScaling", "RowResult",
    "RowSampling", "SamplingParams", "StreamDecoder", "Tokenizer", "bucket_length",
    "build_datastore", "build_method", "capacity_for", "generate",
    "generate_ids", "generate_jit",
    "load_model", "make_mesh", "on_mesh", "pack_params", "pad_prompts",
    "prefill",
    "prefill_jit", "shard_params",
    "sample_logits", "sharegpt_datastore", "step", "step_jit", "stream",
    "Target", "Tree", "TreeResult", "verify_chain", "verify_tree", "warp",
]
