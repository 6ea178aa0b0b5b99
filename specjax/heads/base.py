"""What every draft head shares: its static shape (``HeadConfig``, with the
EAGLE-3 taps for any target depth), the dense layer that also runs packed
native kernels, the decoder's RMSNorm and layer as trainable Flax modules
(``Norm``, ``DecoderLayer``), and packing a head's parameters for the
native kernels."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from specjax.kernels import small_gemm
from specjax.models import decoder
from specjax.models.config import ModelConfig
from specjax.models.layers import (PackedWeight, linear, pack_weight,
                                   rms_norm, rope, rope_inv_freq)


VARIANTS = ("eagle3", "eagle1", "medusa", "mtp", "peagle")


@dataclasses.dataclass(frozen=True)
class HeadConfig:
  """Static shape of a head (hashable).

  Attributes:
    target_dim: D of the target (the head's width too: it adds to the target's
      embedding and its features).
    target_vocab: V.
    target_layers: L of the target (to check a loaded head fits).
    taps: target layer indices whose *inputs* are fused (low, mid, high).
    num_heads, num_kv_heads, head_dim: N, G, H of the head's attention.
    ffn_dim: SwiGLU width.
    draft_vocab: Vd.
    rope_theta: the head's own RoPE base.
    norm_eps: RMSNorm epsilon.
    variant: "eagle3" (fused low/mid/high taps, own LM head over Vd),
      "eagle1" (the target's last hidden state after its final norm, the
      target's LM head over the full vocabulary, frozen) or "medusa"
      (``heads.medusa``: residual blocks on that last hidden state, one per
      depth, sharing one LM head over Vd) or "mtp" (``heads.eagle.MTPHead``:
      a multi-token-prediction module as DeepSeek-V3 and Qwen3.5 ship
      inside their checkpoints, over the same feature as EAGLE-1, the full
      vocabulary) or "peagle" (``heads.eagle.PEagleHead``: an EAGLE-3
      head that drafts a block of K in one forward, P-EAGLE).
    medusa_heads: a Medusa head's depths (0 for the EAGLE variants).
    qk_norm: the head's layer norms each query and key head (Qwen3's
      layer; an MTP module takes its target's layer).
    feed_normed: an MTP head's next step is fed its output after the final
      norm (Qwen3.5, speculators) instead of its layer's output (DeepSeek-V3,
      what specjax trains).
    mask_token: a P-EAGLE head's placeholder token, the token of its block's
      slots 1..K-1 (-1 for the other variants).
    block_depths: the depths a P-EAGLE head was trained on: the most slots
      its block drafts (``check_block``; 0: not recorded, no limit).
  """
  target_dim: int
  target_vocab: int
  target_layers: int
  taps: tuple[int, ...]
  num_heads: int
  num_kv_heads: int
  head_dim: int
  ffn_dim: int
  draft_vocab: int
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5
  variant: str = "eagle3"
  medusa_heads: int = 0
  qk_norm: bool = False
  feed_normed: bool = False
  mask_token: int = -1
  block_depths: int = 0

  def __post_init__(self):
    if self.variant not in VARIANTS:
      raise ValueError(f"unknown head variant {self.variant!r} (choose from "
                       f"{', '.join(VARIANTS)})")
    if (self.variant == "medusa") != (self.medusa_heads > 0):
      raise ValueError(f"medusa_heads must be > 0 exactly for Medusa heads, "
                       f"got {self.medusa_heads} for {self.variant}")
    if self.feed_normed and self.variant != "mtp":
      raise ValueError(f"feed_normed is for MTP heads, not {self.variant}")
    if (self.variant == "peagle"
        and not 0 <= self.mask_token < self.target_vocab):
      raise ValueError(f"a P-EAGLE head's mask_token must be a token id in "
                       f"[0, {self.target_vocab}), got {self.mask_token}")
    if self.variant != "peagle" and self.mask_token != -1:
      raise ValueError(f"mask_token is for P-EAGLE heads, not {self.variant}")
    if self.block_depths < 0 or (self.block_depths
                                 and self.variant != "peagle"):
      raise ValueError(f"block_depths is a P-EAGLE head's trained depths "
                       f"(>= 0), got {self.block_depths} for {self.variant}")

  def check_block(self, slots: int) -> None:
    """Raises ValueError when a P-EAGLE block of ``slots`` would draft at
    depths the head was never trained on (``block_depths``)."""
    if self.block_depths and slots > self.block_depths:
      raise ValueError(
          f"this P-EAGLE head was trained on {self.block_depths} depths; a "
          f"block of {slots} slots drafts past them (num_draft at most "
          f"{self.block_depths}, with PEARL at most "
          f"{(self.block_depths + 1) // 2})")

  @classmethod
  def for_target(cls, target: ModelConfig, draft_vocab: int,
                 variant: str = "eagle3", **overrides) -> "HeadConfig":
    """Defaults for a target: EAGLE-3 taps three layers' inputs
    (``eagle3_taps``); EAGLE-1 and MTP the last layer's output (tap L) over
    the full vocabulary, Medusa (4 depths) that tap over Vd; all take the
    target's attention shape and MLP width (Medusa uses neither), an MTP
    head its q/k norms too."""
    L = target.num_layers
    full = variant in ("eagle1", "mtp")
    kw = dict(target_dim=target.dim, target_vocab=target.vocab_size,
              target_layers=L,
              taps=overrides.get("taps") or (
                  eagle3_taps(L) if fuses_taps(variant) else (L,)),
              medusa_heads=4 if variant == "medusa" else 0,
              variant=variant,
              num_heads=target.num_heads, num_kv_heads=target.num_kv_heads,
              head_dim=target.head_dim, ffn_dim=target.ffn_dim,
              draft_vocab=target.vocab_size if full else draft_vocab,
              rope_theta=target.rope_theta,
              norm_eps=target.norm_eps,
              qk_norm=variant == "mtp" and target.qk_norm)
    kw.update(overrides)
    return cls(**kw)

  def layer_config(self) -> ModelConfig:
    """The EAGLE and MTP heads' decoder layer as ``decoder`` runs it: a
    Llama layer (SwiGLU, plain RMSNorm, no biases) of the head's attention
    shape, with q/k norms if ``qk_norm`` (Qwen3's layer)."""
    return ModelConfig(vocab_size=self.draft_vocab, dim=self.target_dim,
                       num_layers=1, num_heads=self.num_heads,
                       num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                       ffn_dim=self.ffn_dim, rope_theta=self.rope_theta,
                       norm_eps=self.norm_eps, qk_norm=self.qk_norm,
                       name=f"{self.variant} head")

  def check_fits(self, target: ModelConfig) -> None:
    """Raises ValueError naming the first mismatch with ``target``."""
    for name, mine, theirs in (("hidden size", self.target_dim, target.dim),
                               ("vocab", self.target_vocab, target.vocab_size),
                               ("layer count", self.target_layers,
                                target.num_layers)):
      if mine != theirs:
        raise ValueError(f"{self.variant} head was trained for a target "
                         f"with {name} {mine}, this target has {theirs}")
    if max(self.taps) > target.num_layers or min(self.taps) < 0:
      raise ValueError(f"{self.variant} head taps layers {list(self.taps)}; "
                       f"the target's taps are 0..{target.num_layers}")


def fuses_taps(variant: str) -> bool:
  """Whether a head of ``variant`` fuses several layers' inputs (EAGLE-3's
  low/mid/high) rather than reading the last hidden state."""
  return variant in ("eagle3", "peagle")


def eagle3_taps(num_layers: int) -> tuple[int, ...]:
  """The layers whose inputs an EAGLE-3 head fuses (low, mid, high): the
  reference's {2, L//2, L-3} where those are distinct (L >= 7), else three
  distinct layers spread over the depth. A target with fewer than 3
  layers has no three distinct taps: ValueError (pass ``taps``)."""
  L = num_layers
  if L >= 7:
    return (2, L // 2, L - 3)
  if L < 3:
    raise ValueError(f"an EAGLE-3 head fuses three distinct layers; this "
                     f"target has {L} (give the head its own taps)")
  return (0, L // 2, L - 1)


class Dense(nn.Dense):
  """``nn.Dense`` (same parameters, same training) that also runs a kernel
  ``pack_head`` pre-arranged for the native small-row matmul."""

  def __call__(self, x):
    if self.has_variable("params", "kernel"):
      w = self.get_variable("params", "kernel")
      if isinstance(w, PackedWeight):
        y = linear(x, w)
        if self.use_bias:
          b = self.get_variable("params", "bias")
          y = y + b.reshape((1,) * (y.ndim - 1) + b.shape)
        return y
    return super().__call__(x)


class Norm(nn.Module):
  """RMSNorm (``layers.rms_norm``, the decoder's) with a trainable
  ``scale``."""
  eps: float

  @nn.compact
  def __call__(self, x):
    return rms_norm(x, self.param("scale", nn.initializers.ones,
                                  (x.shape[-1],)), self.eps)


class DecoderLayer(nn.Module):
  """The decoder's layer (``decoder.layer_qkv`` and ``decoder.layer_out``,
  the target's own code) with trainable weights in the decoder's fused
  layout: ``wqkv [X, G (R + 2) H]`` over an ``in_dim``-wide input X (2 D for
  EAGLE-3's token-and-feature input), ``wo``, ``mlp_norm``, ``w_gate_up``,
  ``w_down``, and ``q_norm``, ``k_norm`` when ``cfg.qk_norm``. The caller
  norms the input, unless ``attn_norm`` gives the layer its own input norm
  (an MTP module's: a whole decoder layer), and runs the attention between
  ``qkv`` and ``out``. Weights may be packed (``pack_head``)."""
  cfg: ModelConfig
  in_dim: int
  attn_norm: bool = False

  def _weight(self, name, init, shape):
    # A packed weight has other shapes than Flax's check expects (as Dense).
    if self.has_variable("params", name):
      w = self.get_variable("params", name)
      if isinstance(w, PackedWeight):
        return w
    return self.param(name, init, shape)

  def setup(self):
    c = self.cfg
    w = nn.initializers.normal(0.02)
    D, F, NH = c.dim, c.ffn_dim, c.num_heads * c.head_dim
    QKV = NH + 2 * c.num_kv_heads * c.head_dim
    ones = nn.initializers.ones
    norm = lambda name, n, on: self._weight(name, ones, (n,)) if on else None
    self.weights = decoder.LayerParams(
        attn_norm=norm("attn_norm", self.in_dim, self.attn_norm), bqkv=None,
        q_norm=norm("q_norm", c.head_dim, c.qk_norm),
        k_norm=norm("k_norm", c.head_dim, c.qk_norm),
        wqkv=self._weight("wqkv", w, (self.in_dim, QKV)),
        wo=self._weight("wo", w, (NH, D)),
        mlp_norm=self._weight("mlp_norm", nn.initializers.ones, (D,)),
        w_gate_up=self._weight("w_gate_up", w, (D, 2 * F)),
        w_down=self._weight("w_down", w, (F, D)))

  def qkv(self, x_BTX, positions_BT):
    """RoPE'd ``q [B, T, N, H]``, ``k``, ``v [B, T, G, H]`` (after the
    layer's own input norm, if it has one)."""
    c = self.cfg
    if self.weights.attn_norm is not None:
      x_BTX = rms_norm(x_BTX, self.weights.attn_norm, c.norm_eps)
    cos_sin = rope(positions_BT, rope_inv_freq(c.head_dim, c.rope_theta))
    return decoder.layer_qkv(self.weights, c, x_BTX, cos_sin)

  def out(self, resid_BTD, attn):
    return decoder.layer_out(self.weights, self.cfg, resid_BTD, attn)


def pack_head(params):
  """A head's parameters with every matmul weight (every 2-D leaf: a head
  holds no other) packed for the native CPU matmul (``kernels.small_gemm``), as
  ``decoder.pack_params`` does the target's: for drafting on a packed
  target. Weights that bf16 holds exactly (the
  shipped head's, stored in bf16) get bf16 panels: drafting reads half the
  bytes and computes the same f32 products."""
  kernels = [x for x in jax.tree_util.tree_leaves(params) if x.ndim == 2]
  dtype = (jnp.bfloat16 if all(small_gemm.exact_in(w, jnp.bfloat16)
                               for w in kernels) else jnp.float32)
  return jax.tree_util.tree_map(
      lambda x: pack_weight(x, dtype) if x.ndim == 2 else x, params)


def dense(features: int, name: str, use_bias: bool = False) -> Dense:
  return Dense(features, use_bias=use_bias, name=name,
               kernel_init=nn.initializers.normal(0.02))
