"""Static configuration of a decoder (hashable: safe as a jit static arg).

One ``ModelConfig`` describes every architecture ``specjax.models.decoder``
runs: Llama 1/2/3, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 (text) and Phi-3
differ only in the fields below (``hf_loader`` reads them from a checkpoint's
config.json and refuses any it cannot honour).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from specjax.models.layers import ACTIVATIONS, RopeScaling

__all__ = ["ModelConfig", "RopeScaling", "FULL", "SLIDING"]

FULL, SLIDING = "full", "sliding"  # ``ModelConfig.layer_types``


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes and numerics of a decoder.

  Attributes:
    vocab_size: V.
    dim: D, the residual width.
    num_layers: L.
    num_heads: N query heads.
    num_kv_heads: G key/value heads (GQA when G < N).
    head_dim: H.
    ffn_dim: F, width of the gated MLP.
    rope_theta: RoPE base frequency (of the full-attention layers).
    norm_eps: RMSNorm epsilon.
    tie_embeddings: the LM head is the token embedding.
    qkv_bias: q/k/v projections carry a bias (Qwen2, Llama's
      ``attention_bias``).
    o_bias: the attention output projection carries one (``attention_bias``).
    mlp_bias: gate, up and down projections carry biases (``mlp_bias``).
    rope_scaling: optional Llama-3 or linear scaling (full-attention layers).
    max_position: the context length the model was trained for.
    bos_id, eos_ids: special token ids (eos_ids: every id that ends a turn).
    name: a label for messages and benchmark JSON.
    activation: the MLP's gate activation (``layers.ACTIVATIONS``).
    norm_offset: 1 for Gemma's RMSNorm (``x (1 + w)``), else 0.
    qk_norm: RMSNorm over each query and key head before RoPE (Qwen3,
      Gemma 3).
    sandwich_norms: norms on the attention and MLP outputs too (Gemma 2/3).
    query_scale: attention scores' scale; None: ``head_dim ** -0.5``.
    attn_logit_cap, final_logit_cap: soft-capping of the attention scores
      and of the output logits (Gemma 2); None: none.
    embed_scale: the embedding is multiplied by it (Gemma: sqrt(D)); None:
      not scaled.
    sliding_window: the window of the ``SLIDING`` layers (a key is seen iff
      its position is within ``sliding_window - 1`` of the query's).
    layer_types: ``FULL`` or ``SLIDING`` per layer; empty: all ``FULL``.
    local_rope_theta: RoPE base of the sliding layers (Gemma 3); None: the
      same as the full ones (and their scaling).
  """
  vocab_size: int
  dim: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  ffn_dim: int
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  qkv_bias: bool = False
  rope_scaling: Optional[RopeScaling] = None
  max_position: int = 2048
  bos_id: Optional[int] = None
  eos_ids: tuple[int, ...] = ()
  name: str = "llama"
  o_bias: bool = False
  mlp_bias: bool = False
  activation: str = "silu"
  norm_offset: float = 0.0
  qk_norm: bool = False
  sandwich_norms: bool = False
  query_scale: Optional[float] = None
  attn_logit_cap: Optional[float] = None
  final_logit_cap: Optional[float] = None
  embed_scale: Optional[float] = None
  sliding_window: Optional[int] = None
  layer_types: tuple[str, ...] = ()
  local_rope_theta: Optional[float] = None

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads={self.num_heads} is not a multiple of "
          f"num_kv_heads={self.num_kv_heads}")
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"unsupported activation {self.activation!r} "
                       f"(supported: {', '.join(ACTIVATIONS)})")
    if self.layer_types:
      if len(self.layer_types) != self.num_layers:
        raise ValueError(f"layer_types has {len(self.layer_types)} entries "
                         f"for {self.num_layers} layers")
      if set(self.layer_types) - {FULL, SLIDING}:
        raise ValueError(f"layer_types must be {FULL!r} or {SLIDING!r}, got "
                         f"{sorted(set(self.layer_types))}")
      if SLIDING in self.layer_types and not (self.sliding_window or 0) > 0:
        raise ValueError("sliding layers need sliding_window > 0, got "
                         f"{self.sliding_window}")

  @property
  def group_size(self) -> int:
    """R = N // G query heads share one kv head."""
    return self.num_heads // self.num_kv_heads

  def window(self, layer: int) -> Optional[int]:
    """Layer ``layer``'s sliding window, or None (full attention)."""
    if self.layer_types and self.layer_types[layer] == SLIDING:
      return self.sliding_window
    return None
