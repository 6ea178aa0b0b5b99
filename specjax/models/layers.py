"""The layer library: the pieces every target and head is built from.

One implementation per concept: the matmul with its native/packed dispatch
(``linear``), RMSNorm (plain and Gemma's ``1 + w``), RoPE (default, Llama-3
and linear scaling), the attention masks (causal, tree ancestors, the
cache's prefix, sliding windows), attention over the KV cache with logit
soft-capping, and the gated MLPs (SwiGLU, GeGLU). ``specjax.models.decoder``
composes them into the decoder every supported architecture is; the EAGLE
heads call the same RoPE, masks and attention.

Axis letters: see ``specjax/__init__.py``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.kernels import attention as attention_kernel
from specjax.kernels import small_gemm

NEG_INF = -1e30  # finite: a fully masked row must not produce NaNs


# --- matmuls -----------------------------------------------------------------

@struct.dataclass
class PackedWeight:
  """A ``[K, N]`` weight pre-arranged once for the native small-row matmul
  (``kernels.small_gemm``, CPU): ``panels [ceil(N / 16), K, 16]``, ``n`` = N."""
  panels: jax.Array
  n: int = struct.field(pytree_node=False)


def linear(x: jax.Array, w, b: Optional[jax.Array] = None) -> jax.Array:
  """``x @ w (+ b)`` over the last axis, for a ``[K, N]`` array (XLA's dot)
  or a ``PackedWeight`` (the native kernel; f32 math)."""
  if isinstance(w, PackedWeight):
    *lead, K = x.shape
    y = small_gemm.small_matmul(x.reshape(-1, K), w.panels, w.n).reshape(
        *lead, w.n)
  else:
    y = x @ w
  return y if b is None else y + b.reshape((1,) * (y.ndim - 1) + b.shape)


def pack_weight(w_KN: jax.Array, dtype=jnp.float32) -> PackedWeight:
  """A ``[K, N]`` weight pre-arranged for the native small-row matmul, its
  panels f32 or (for weights bf16 holds exactly) bf16: half the bytes."""
  return PackedWeight(small_gemm.pack(w_KN, dtype), w_KN.shape[1])


def dense_weight(w) -> jax.Array:
  """A ``[K, N]`` weight as an array, whether plain or packed."""
  if isinstance(w, PackedWeight):
    return small_gemm.unpack(w.panels, w.n).astype(jnp.float32)
  return w


# --- norms and activations ---------------------------------------------------

def rms_norm(x: jax.Array, weight: jax.Array, eps: float,
             offset: float = 0.0) -> jax.Array:
  """RMSNorm over the last axis, statistics in f32. ``offset`` 1 is Gemma's
  form (the stored weight is ``w`` in ``x (1 + w)``, applied in f32)."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  if offset:
    scale = jnp.broadcast_to(offset + weight.astype(jnp.float32), x.shape)
    return (x32 * scale).astype(x.dtype)
  return x32.astype(x.dtype) * jnp.broadcast_to(weight, x.shape)


def softcap(x: jax.Array, cap: Optional[float]) -> jax.Array:
  """``cap * tanh(x / cap)`` (Gemma 2's logit soft-capping); None: x."""
  return x if cap is None else cap * jnp.tanh(x / cap)


ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def gated_mlp(x_BTD: jax.Array, w_gate_up, w_down, activation: str,
              b_gate_up=None, b_down=None) -> jax.Array:
  """``down(act(gate(x)) * up(x))`` (SwiGLU with silu, GeGLU with gelu) on
  gate and up fused as ``[D, F 2]``, unit f's pair side by side
  (``fuse_gate_up``)."""
  gate, up = split_gate_up(linear(x_BTD, w_gate_up, b_gate_up))
  return linear(ACTIVATIONS[activation](gate) * up, w_down, b_down)


def fuse_gate_up(gate, up):
  """``[..., F]`` gate and up as one ``[..., F 2]`` (unit f's pair side by
  side: any split into equal blocks along F keeps whole units)."""
  xp = np if isinstance(gate, np.ndarray) else jnp
  return xp.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], -1)


def split_gate_up(w):
  """``fuse_gate_up``'s inverse: ``(gate, up)``."""
  pairs = w.reshape(*w.shape[:-1], -1, 2)
  return pairs[..., 0], pairs[..., 1]


# --- rotary embeddings -------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling: ``kind`` "llama3" (frequency-dependent, the
  three factors below) or "linear" (every frequency divided by ``factor``)."""
  factor: float
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: int = 8192
  kind: str = "llama3"


def rope_inv_freq(head_dim: int, theta: float,
                  scaling: Optional[RopeScaling] = None) -> np.ndarray:
  """``[H/2]`` inverse frequencies, scaled as ``scaling`` says."""
  half = head_dim // 2
  inv = 1.0 / (theta ** (np.arange(half, dtype=np.float64) * 2 / head_dim))
  sc = scaling
  if sc is None:
    return inv.astype(np.float32)
  if sc.kind == "linear":
    return (inv / sc.factor).astype(np.float32)
  low_wavelen = sc.original_max_position / sc.low_freq_factor
  high_wavelen = sc.original_max_position / sc.high_freq_factor
  wavelen = 2 * math.pi / inv
  scaled = np.where(wavelen > low_wavelen, inv / sc.factor, inv)
  smooth = ((sc.original_max_position / wavelen - sc.low_freq_factor)
            / (sc.high_freq_factor - sc.low_freq_factor))
  smoothed = (1 - smooth) * scaled / sc.factor + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def rope(positions_BT: jax.Array, inv_freq_h: np.ndarray):
  """cos, sin ``f32[B, T, H]`` (halves repeated) for ``apply_rope``."""
  angles_BTh = (positions_BT[..., None].astype(jnp.float32)
                * inv_freq_h[None, None, :])
  angles_BTH = jnp.concatenate([angles_BTh, angles_BTh], axis=-1)
  return jnp.cos(angles_BTH), jnp.sin(angles_BTH)


def rope_once(positions_BT: jax.Array, inv_freq_h: np.ndarray):
  """``rope``'s tables computed once for every layer that uses them. XLA
  CPU fuses the cos and sin into each consumer and evaluates them there for
  every element of q and k (at 16 new tokens, 30 layers: 1.6 of the step's
  5 ms of small ops), and it drops optimization barriers before fusing; a
  conditional's results are buffers. Both branches are the same, so the
  (data-dependent) predicate changes nothing. Elsewhere (GPU: a conditional
  syncs with the host) plain ``rope``."""
  if jax.default_backend() != "cpu":
    return rope(positions_BT, inv_freq_h)
  compute = lambda p: rope(p, inv_freq_h)
  return jax.lax.cond(positions_BT[0, 0] >= 0, compute, compute, positions_BT)


def apply_rope(x_BTnH: jax.Array, cos_BTH: jax.Array,
               sin_BTH: jax.Array) -> jax.Array:
  """Half-split ("rotate_half") RoPE over the last axis of ``[B, T, ..., H]``
  (any head axes between), math in f32."""
  half = x_BTnH.shape[-1] // 2
  x = x_BTnH.astype(jnp.float32)
  x1, x2 = x[..., :half], x[..., half:]
  B, T = cos_BTH.shape[:2]
  heads = (1,) * (x.ndim - 3)  # any head axes between T and H
  cos = cos_BTH[..., :half].reshape(B, T, *heads, half)
  sin = sin_BTH[..., :half].reshape(B, T, *heads, half)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTnH.dtype)


# --- masks -------------------------------------------------------------------

def causal_mask(batch: int, num_new: int) -> jax.Array:
  """``bool[B, T, T]``: each new token sees itself and the ones before it."""
  return jnp.broadcast_to(jnp.tril(jnp.ones((num_new, num_new), bool)),
                          (batch, num_new, num_new))


def attention_mask(lengths_B: jax.Array, mask_BTT: jax.Array,
                   capacity: int) -> jax.Array:
  """``bool[B, T, S]``: slot s is visible to new token t of row b iff it is in
  the row's prefix (s < lengths[b]) or it is new token u = s - lengths[b] and
  ``mask_BTT[b, t, u]``."""
  T = mask_BTT.shape[-1]
  rel_BS = jnp.arange(capacity)[None, :] - lengths_B[:, None]
  is_new_BS = (rel_BS >= 0) & (rel_BS < T)
  new_BTS = jnp.take_along_axis(
      mask_BTT, jnp.broadcast_to(jnp.clip(rel_BS, 0, T - 1)[:, None, :],
                                 (mask_BTT.shape[0], T, capacity)), axis=2)
  return (rel_BS < 0)[:, None, :] | (is_new_BS[:, None, :] & new_BTS)


def query_mask(lengths_B: jax.Array, mask_BTT: jax.Array, capacity: int,
               group_size: int) -> jax.Array:
  """``bool[B, Q, S]``: ``attention_mask`` for ``attention``'s query rows,
  Q = T * group_size ordered (t, r)."""
  return jnp.repeat(attention_mask(lengths_B, mask_BTT, capacity), group_size,
                    axis=1)


def window_masks(positions_BT: jax.Array, capacity: int, window: int):
  """A sliding window's ``(bool[B, T, S], bool[B, T, T])``: which cache slots
  and which new tokens lie within ``window`` positions of each new token
  (key position > query position - window, as transformers counts it).
  Cache slot s holds position s (the cache is a row's positions in order);
  a tree node's position is its root's plus its depth, so its window is
  counted along its root path."""
  q_BT1 = positions_BT[:, :, None]
  slots_11S = jnp.arange(capacity)[None, None, :]
  return (slots_11S > q_BT1 - window,
          positions_BT[:, None, :] > q_BT1 - window)


# --- attention ---------------------------------------------------------------

def attention(q_BTNH, kc_BGHS, vc_BGSH, mask_BQS, new=None, *,
              scale: Optional[float] = None,
              logit_cap: Optional[float] = None):
  """Attention of T new queries over the cache, and over the new tokens'
  own keys/values when ``new = (k_BTGH, v_BTGH, mask_BQT)`` is given (the
  target's forward: the cache holds the prefix and is only read); without
  ``new`` the new entries must already be in the cache (the EAGLE heads'
  drafting layer).

  Queries are grouped per kv head as Q = T*R rows so the products are plain
  batched matmuls over (B, G) against the cache's layouts; ``mask_BQS`` says
  which slots those rows see (``query_mask``; ``[B, 1, S]`` broadcasts),
  ``mask_BQT`` which new tokens. Scores are ``q.k * scale`` (default
  ``H ** -0.5``), soft-capped at ``logit_cap`` when given, then masked.
  Masked scores are replaced (not added to) and values no row sees are
  zeroed, so whatever a stale slot holds (NaN, inf) never reaches the
  output; a non-finite new value reaches exactly the queries that see it.
  Keys no row sees are zeroed too: a forward that wrote the cache first
  then reads it through a select, which at batch 1 kept XLA on CPU from
  fusing the key scatter twice (into the score's dot and into the loop's
  carry) and copying each layer's key buffer four times a step.
  """
  B, T, N, H = q_BTNH.shape
  G, S = kc_BGHS.shape[1], kc_BGHS.shape[-1]
  R = N // G
  scale = H ** -0.5 if scale is None else scale
  q_BGQH = (q_BTNH.reshape(B, T, G, R, H) * scale).transpose(
      0, 2, 1, 3, 4).reshape(B, G, T * R, H)
  seen_BS = jnp.any(mask_BQS, axis=1)
  kc_BGHS = jnp.where(seen_BS[:, None, None, :], kc_BGHS, 0)
  s_BGQS = softcap(jnp.einsum("bgqh,bghs->bgqs", q_BGQH, kc_BGHS,
                              preferred_element_type=jnp.float32), logit_cap)
  scores = [jnp.where(mask_BQS[:, None], s_BGQS, NEG_INF)]
  if new is not None:
    k_BTGH, v_BTGH, mask_BQT = new
    s_BGQT = softcap(jnp.einsum("bgqh,btgh->bgqt", q_BGQH, k_BTGH,
                                preferred_element_type=jnp.float32), logit_cap)
    scores.append(jnp.where(mask_BQT[:, None], s_BGQT, NEG_INF))
  p_BGQX = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)
  v_BGSH = jnp.where(seen_BS[:, None, :, None], vc_BGSH, 0)
  p_BGQS = p_BGQX[..., :S].astype(v_BGSH.dtype)
  out_BGQH = jnp.einsum("bgqs,bgsh->bgqh", p_BGQS, v_BGSH)
  if new is not None:
    # A query sees only some new tokens, and 0 x NaN is NaN: a non-finite
    # value enters the product as 0 and makes exactly the queries that see
    # it NaN (a broken later draft must not poison the earlier positions).
    finite_BTG = jnp.all(jnp.isfinite(v_BTGH), axis=-1)
    p_BGQT = p_BGQX[..., S:].astype(v_BTGH.dtype)
    out_BGQH = out_BGQH + jnp.einsum(
        "bgqt,btgh->bgqh", p_BGQT,
        jnp.where(finite_BTG[..., None], v_BTGH, 0))
    sees_bad_BGQ = jnp.any(
        mask_BQT[:, None] & ~finite_BTG.transpose(0, 2, 1)[:, :, None, :],
        axis=-1)
    out_BGQH = jnp.where(sees_bad_BGQ[..., None], jnp.nan, out_BGQH)
  return out_BGQH.reshape(B, G, T, R, H).transpose(0, 2, 1, 3, 4).reshape(
      B, T, N * H)


def native_attention(q_BTNH, kc_BGHS, vc_BGSH, k_new_BTGH, v_new_BTGH,
                     lengths_B, mask_BTT):
  """``kernels.attention`` (the kernel's forward, scale ``H ** -0.5``) with
  the VJP of the same function in XLA (``attention`` over the prefix and
  the new tokens), so ``jax.grad`` runs through the kernel's path."""
  return _native_attention(q_BTNH, kc_BGHS, vc_BGSH, k_new_BTGH, v_new_BTGH,
                           lengths_B, mask_BTT)


def _xla_twin(q_BTNH, kc_BGHS, vc_BGSH, k_new_BTGH, v_new_BTGH, lengths_B,
              mask_BTT):
  R = q_BTNH.shape[2] // kc_BGHS.shape[1]
  prefix_B1S = (jnp.arange(kc_BGHS.shape[-1])[None, :]
                < lengths_B[:, None])[:, None, :]
  return attention(q_BTNH, kc_BGHS, vc_BGSH, prefix_B1S,
                   new=(k_new_BTGH, v_new_BTGH,
                        jnp.repeat(mask_BTT, R, axis=1)))


@jax.custom_vjp
def _native_attention(q, kc, vc, k_new, v_new, lengths, mask):
  return attention_kernel.attention(q, kc, vc, k_new, v_new, lengths, mask)


def _native_attention_fwd(*args):
  return _native_attention(*args), args


def _native_attention_bwd(args, d_out):
  *floats, lengths, mask = args
  grads = jax.vjp(lambda *f: _xla_twin(*f, lengths, mask), *floats)[1](d_out)
  return (*grads, None, None)


_native_attention.defvjp(_native_attention_fwd, _native_attention_bwd)
