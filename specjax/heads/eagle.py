"""The EAGLE-3 draft head (Flax): fused target features -> one decoder layer.

Follows the released reference code where it differs from the paper
(../shared/research/eagle3.md §1): the attention input is the 2D-wide
``concat(in_norm(embed(token)), hidden_norm(h))`` (no second FC), the residual
is the un-normalized ``h``, logits are ``lm_head(norm(out))`` over the draft
vocabulary Vd, and the token embedding is the target's, passed in frozen (it
is an argument, never a parameter, so it is neither trained nor saved).

``h`` is ``fc(concat(taps))`` -- the target's residual stream at the inputs of
layers ``HeadConfig.taps`` -- on a row's first step, and the head's own
previous output afterwards (the recurrent feature). The module exposes the
layer in pieces (``features``, ``project``, ``finish``, ``logits``) so the
attention between ``project`` and ``finish`` is the caller's: drafting runs
the target's own (``layers.attention`` over a one-layer ``KVCache``, RoPE from
``layers.rope``), training the TTT block form of the same rule
(``specjax.training.ttt.attend_blocks``, tested equal to it).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from specjax import native
from specjax.models.config import ModelConfig
from specjax.models.layers import (PackedWeight, apply_rope, attention,
                                  causal_mask, linear, pack_weight,
                                  query_mask, rope, rope_inv_freq)


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
      depth, sharing one LM head over Vd).
    medusa_heads: a Medusa head's depths (0 for the EAGLE variants).
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

  def __post_init__(self):
    if self.variant not in ("eagle3", "eagle1", "medusa"):
      raise ValueError(f"unknown head variant {self.variant!r}")
    if (self.variant == "medusa") != (self.medusa_heads > 0):
      raise ValueError(f"medusa_heads must be > 0 exactly for Medusa heads, "
                       f"got {self.medusa_heads} for {self.variant}")

  @classmethod
  def for_target(cls, target: ModelConfig, draft_vocab: int,
                 variant: str = "eagle3", **overrides) -> "HeadConfig":
    """Defaults for a target: EAGLE-3 taps three layers' inputs
    (``eagle3_taps``); EAGLE-1 the last layer's output (tap L) over the full vocabulary,
    Medusa (4 depths) that tap over Vd; all take the target's attention
    shape and MLP width (Medusa uses neither)."""
    L = target.num_layers
    eagle1 = variant == "eagle1"
    kw = dict(target_dim=target.dim, target_vocab=target.vocab_size,
              target_layers=L,
              taps=overrides.get("taps") or (
                  eagle3_taps(L) if variant == "eagle3" else (L,)),
              medusa_heads=4 if variant == "medusa" else 0,
              variant=variant,
              num_heads=target.num_heads, num_kv_heads=target.num_kv_heads,
              head_dim=target.head_dim, ffn_dim=target.ffn_dim,
              draft_vocab=target.vocab_size if eagle1 else draft_vocab,
              rope_theta=target.rope_theta,
              norm_eps=target.norm_eps)
    kw.update(overrides)
    return cls(**kw)

  def check_fits(self, target: ModelConfig) -> None:
    """Raises ValueError naming the first mismatch with ``target``."""
    for name, mine, theirs in (("hidden size", self.target_dim, target.dim),
                               ("vocab", self.target_vocab, target.vocab_size),
                               ("layer count", self.target_layers,
                                target.num_layers)):
      if mine != theirs:
        raise ValueError(f"EAGLE head was trained for a target with {name} "
                         f"{mine}, this target has {theirs}")
    if max(self.taps) > target.num_layers or min(self.taps) < 0:
      raise ValueError(f"EAGLE head taps layers {list(self.taps)}; the "
                       f"target's taps are 0..{target.num_layers}")


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


def pack_head(params):
  """A head's parameters with every dense kernel packed for the native CPU
  matmul (``specjax.native``), as ``decoder.pack_params`` does the target's:
  for drafting on a packed target. Inference only (no VJP). Kernels that
  bf16 holds exactly (the shipped head's, stored in bf16) get bf16 panels:
  drafting reads half the bytes and computes the same f32 products."""
  is_kernel = lambda path: path[-1].key == "kernel"
  kernels = [x for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
             if is_kernel(path)]
  dtype = (jnp.bfloat16 if all(native.exact_in(w, jnp.bfloat16)
                               for w in kernels) else jnp.float32)
  return jax.tree_util.tree_map_with_path(
      lambda path, x: pack_weight(x, dtype) if is_kernel(path) else x,
      params)


def _dense(features: int, name: str, use_bias: bool = False) -> Dense:
  return Dense(features, use_bias=use_bias, name=name,
               kernel_init=nn.initializers.normal(0.02))


class Eagle3Head(nn.Module):
  """One EAGLE-3 decoder layer over (token, feature) pairs. See module doc."""
  cfg: HeadConfig

  def setup(self):
    c = self.cfg
    norm = lambda name: nn.RMSNorm(epsilon=c.norm_eps, name=name)
    self.fc = _dense(c.target_dim, "fc")
    self.in_norm, self.hidden_norm = norm("in_norm"), norm("hidden_norm")
    _layer(self)
    self.norm = norm("norm")
    self.lm_head = _dense(c.draft_vocab, "lm_head")

  def __call__(self, taps_BTF, tok_BT, embed_VD, positions_BT):
    """Init helper and a plain causal single step (tests, shape checks)."""
    h = self.features(taps_BTF)
    q, k, v, resid = self.project(tok_BT, h, embed_VD, positions_BT)
    B, T = tok_BT.shape
    mask = query_mask(jnp.zeros((B,), jnp.int32), causal_mask(B, T), T,
                      self.cfg.num_heads // self.cfg.num_kv_heads)
    attn = attention(q, k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3),
                     mask)
    return self.logits(self.finish(resid, attn))

  def features(self, taps_BTF):
    """``fc``: concatenated target taps ``[B, T, len(taps) * D]`` -> ``[B, T, D]``."""
    return self.fc(taps_BTF)

  def project(self, tok_BT, h_BTD, embed_VD, positions_BT):
    """RoPE'd q ``[B,T,N,H]``, k and v ``[B,T,G,H]`` from (token, feature),
    and the residual stream the layer adds to (here the feature itself)."""
    e_BTD = self.in_norm(jnp.take(embed_VD, tok_BT, axis=0).astype(h_BTD.dtype))
    z_BT2D = jnp.concatenate([e_BTD, self.hidden_norm(h_BTD)], axis=-1)
    return (*_qkv(self, z_BT2D, positions_BT), h_BTD)

  def finish(self, resid_BTD, attn_BTNH):
    """Attention output (``[B, T, N, H]`` or ``[B, T, N * H]``) onto the
    residual, then the SwiGLU MLP."""
    return _finish(self, resid_BTD, attn_BTNH)

  def logits(self, out_BTD):
    """``f32[B, T, Vd]`` over the draft vocabulary."""
    return self.lm_head(self.normed(out_BTD)).astype(jnp.float32)

  def normed(self, out_BTD):
    """The LM head's input (training fuses the head with its loss)."""
    return self.norm(out_BTD)


class Eagle1Head(nn.Module):
  """EAGLE-1 (the baseline EAGLE-3 improves on), same interface: the feature
  is the target's last hidden state after its final norm (``feature_norm``,
  a copy of that norm), ``fc(concat(embed(token), feature))`` with a bias
  feeds one decoder layer without an input norm, and the output is the
  predicted next feature, read out by a copy of the target's LM head over the
  full vocabulary. ``feature_norm`` and ``lm_head`` stay frozen in training
  (``FROZEN``); the loss adds feature regression to the soft CE."""
  cfg: HeadConfig

  def setup(self):
    c = self.cfg
    self.feature_norm = nn.RMSNorm(epsilon=c.norm_eps, name="feature_norm")
    self.fc = _dense(c.target_dim, "fc", use_bias=True)
    _layer(self)
    self.lm_head = _dense(c.draft_vocab, "lm_head")

  __call__ = Eagle3Head.__call__

  def features(self, taps_BTD):
    return self.feature_norm(taps_BTD)

  def project(self, tok_BT, h_BTD, embed_VD, positions_BT):
    e_BTD = jnp.take(embed_VD, tok_BT, axis=0).astype(h_BTD.dtype)
    z_BTD = self.fc(jnp.concatenate([e_BTD, h_BTD], axis=-1))
    return (*_qkv(self, z_BTD, positions_BT), z_BTD)

  def finish(self, resid_BTD, attn_BTNH):
    return _finish(self, resid_BTD, attn_BTNH)

  def logits(self, out_BTD):
    return self.lm_head(out_BTD).astype(jnp.float32)

  def normed(self, out_BTD):
    return out_BTD


# Parameters training leaves alone, per variant (copies of target weights).
FROZEN = {"eagle3": (), "eagle1": ("feature_norm", "lm_head"),
          "medusa": ("feature_norm",)}


def head_module(cfg: HeadConfig) -> nn.Module:
  if cfg.variant == "medusa":
    from specjax.heads.medusa import MedusaHead
    return MedusaHead(cfg)
  return (Eagle1Head if cfg.variant == "eagle1" else Eagle3Head)(cfg)


def head_call(cfg: HeadConfig, params):
  """``call(method, *args)``: the head's method (``features``, ``project``,
  ``logits``, ...) applied with ``params`` -- how drafting and training run
  a head piece by piece."""
  module = head_module(cfg)
  return lambda method, *args: module.apply({"params": params}, *args,
                                            method=method)


def _layer(m):
  """The decoder layer's attention and SwiGLU weights (both variants)."""
  c = m.cfg
  D, N, G, H = c.target_dim, c.num_heads, c.num_kv_heads, c.head_dim
  m.wq, m.wk, m.wv = (_dense(N * H, "wq"), _dense(G * H, "wk"),
                      _dense(G * H, "wv"))
  m.wo = _dense(D, "wo")
  m.mlp_norm = nn.RMSNorm(epsilon=c.norm_eps, name="mlp_norm")
  m.w_gate, m.w_up = _dense(c.ffn_dim, "w_gate"), _dense(c.ffn_dim, "w_up")
  m.w_down = _dense(D, "w_down")


def _qkv(m, z_BTX, positions_BT):
  c = m.cfg
  B, T = z_BTX.shape[:2]
  q = m.wq(z_BTX).reshape(B, T, c.num_heads, c.head_dim)
  k = m.wk(z_BTX).reshape(B, T, c.num_kv_heads, c.head_dim)
  v = m.wv(z_BTX).reshape(B, T, c.num_kv_heads, c.head_dim)
  cos, sin = rope(positions_BT, rope_inv_freq(c.head_dim, c.rope_theta))
  return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _finish(m, resid_BTD, attn_BTNH):
  B, T = attn_BTNH.shape[:2]
  r = resid_BTD + m.wo(attn_BTNH.reshape(B, T, -1))
  x = m.mlp_norm(r)
  return r + m.w_down(jax.nn.silu(m.w_gate(x)) * m.w_up(x))
