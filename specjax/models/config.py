"""Static configuration of a Llama-family model (hashable: safe as a jit static arg)."""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 style frequency-dependent RoPE scaling (``rope_type: llama3``)."""
  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes and numerics of a Llama/Mistral/Qwen2-style decoder.

  Attributes:
    vocab_size: V.
    dim: D, the residual width.
    num_layers: L.
    num_heads: N query heads.
    num_kv_heads: G key/value heads (GQA when G < N).
    head_dim: H.
    ffn_dim: width of the SwiGLU hidden layer.
    rope_theta: RoPE base frequency.
    norm_eps: RMSNorm epsilon.
    tie_embeddings: the LM head is the transposed token embedding.
    qkv_bias: q/k/v projections carry a bias (Qwen2).
    rope_scaling: optional Llama-3 scaling.
    max_position: the context length the model was trained for.
    bos_id, eos_ids: special token ids (eos_ids: every id that ends a turn).
    name: a label for messages and benchmark JSON.
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

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads={self.num_heads} is not a multiple of "
          f"num_kv_heads={self.num_kv_heads}")

  @property
  def group_size(self) -> int:
    """R = N // G query heads share one kv head."""
    return self.num_heads // self.num_kv_heads
