"""Llama-family decoder as a pure function over a parameter pytree.

``forward`` serves prefill (T = prompt bucket), decode (T = 1) and speculative
verification (T = K + 1, or M tree nodes with a custom mask) alike: new tokens
attend to the row's valid cache slots plus, among themselves, a causal (or
caller-given tree) mask. Layers are stacked and run under ``lax.scan``; the new
keys/values leave the scan as outputs and are written into the cache once
afterwards (writing inside the scan copies the stacked cache every layer and
slows down as the capacity grows -- measured, see docs/DESIGN.md).

Axis letters: see ``specjax/__init__.py``. Q, K, V projections are fused into
one ``[D, (N + 2G) H]`` matmul and gate/up into one ``[D, 2F]`` matmul: on the
CPU decode is bound by weight reads and launch overhead, fewer dots help.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.cache import KVCache
from specjax.models.config import ModelConfig

_NEG_INF = -1e30  # finite: a fully masked row must not produce NaNs


@struct.dataclass
class LayerParams:
  """One decoder layer's weights, every field stacked over a leading L axis.

  Attributes:
    attn_norm: ``[L, D]``.
    wqkv: ``[L, D, (N + 2G) H]`` fused q/k/v projection (HF rotate-half layout).
    bqkv: ``[L, (N + 2G) H]`` or None (no bias).
    wo: ``[L, N H, D]``.
    mlp_norm: ``[L, D]``.
    w_gate_up: ``[L, D, 2F]`` gate then up.
    w_down: ``[L, F, D]``.
  """
  attn_norm: jax.Array
  wqkv: jax.Array
  bqkv: Optional[jax.Array]
  wo: jax.Array
  mlp_norm: jax.Array
  w_gate_up: jax.Array
  w_down: jax.Array


@struct.dataclass
class LlamaParams:
  """All weights of a model.

  Attributes:
    embed: ``[V, D]`` token embedding.
    layers: stacked ``LayerParams``.
    final_norm: ``[D]``.
    lm_head: ``[D, V]``, or None when tied to ``embed``.
  """
  embed: jax.Array
  layers: LayerParams
  final_norm: jax.Array
  lm_head: Optional[jax.Array]


@struct.dataclass
class ForwardOutput:
  """Result of ``forward``.

  Attributes:
    logits: ``f32[B, T, V]`` (or ``[B, P, V]`` when ``logit_positions`` given).
    cache: the cache with the T new entries appended (lengths += T).
    taps: ``[len(taps), B, T, D]`` hidden states at the inputs of the requested
      layers (index L means the last layer's output, before the final norm),
      or None when no taps were requested.
  """
  logits: jax.Array
  cache: KVCache
  taps: Optional[jax.Array]


def init_cache(cfg: ModelConfig, batch: int, capacity: int,
               dtype=jnp.float32) -> KVCache:
  return KVCache.init(cfg.num_layers, batch, capacity, cfg.num_kv_heads,
                      cfg.head_dim, dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return x32.astype(x.dtype) * jnp.broadcast_to(weight, x.shape)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
  """``[H/2]`` inverse frequencies, with Llama-3 scaling when configured."""
  half = cfg.head_dim // 2
  inv = 1.0 / (cfg.rope_theta ** (np.arange(half, dtype=np.float64) * 2
                                  / cfg.head_dim))
  sc = cfg.rope_scaling
  if sc is None:
    return inv.astype(np.float32)
  low_wavelen = sc.original_max_position / sc.low_freq_factor
  high_wavelen = sc.original_max_position / sc.high_freq_factor
  wavelen = 2 * math.pi / inv
  scaled = np.where(wavelen > low_wavelen, inv / sc.factor, inv)
  smooth = ((sc.original_max_position / wavelen - sc.low_freq_factor)
            / (sc.high_freq_factor - sc.low_freq_factor))
  smoothed = (1 - smooth) * scaled / sc.factor + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x_BTnH: jax.Array, cos_BTH: jax.Array,
               sin_BTH: jax.Array) -> jax.Array:
  """Half-split ("rotate_half") RoPE over the last axis, math in f32."""
  half = x_BTnH.shape[-1] // 2
  x = x_BTnH.astype(jnp.float32)
  x1, x2 = x[..., :half], x[..., half:]
  cos, sin = cos_BTH[:, :, None, :half], sin_BTH[:, :, None, :half]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTnH.dtype)


def _attention(q_BTNH, k_BTGH, v_BTGH, kc_BSGH, vc_BSGH, cache_mask_BS,
               new_mask_BTT):
  """Attention of T new queries over the cache slots plus the new keys.

  Scores against cache and new keys are computed separately and joined in one
  softmax, so the cache is never concatenated (copied) with the new keys.
  """
  B, T, N, H = q_BTNH.shape
  G = k_BTGH.shape[2]
  q = q_BTNH.reshape(B, T, G, N // G, H) * (H ** -0.5)
  s_cache = jnp.einsum("btgrh,bsgh->bgrts", q, kc_BSGH,
                       preferred_element_type=jnp.float32)
  s_new = jnp.einsum("btgrh,bugh->bgrtu", q, k_BTGH,
                     preferred_element_type=jnp.float32)
  s_cache = jnp.where(cache_mask_BS[:, None, None, None, :], s_cache, _NEG_INF)
  s_new = jnp.where(new_mask_BTT[:, None, None, :, :], s_new, _NEG_INF)
  S = s_cache.shape[-1]
  p = jax.nn.softmax(jnp.concatenate([s_cache, s_new], axis=-1), axis=-1)
  p = p.astype(v_BTGH.dtype)
  out = (jnp.einsum("bgrts,bsgh->btgrh", p[..., :S], vc_BSGH)
         + jnp.einsum("bgrtu,bugh->btgrh", p[..., S:], v_BTGH))
  return out.reshape(B, T, N * H)


def forward(params: LlamaParams, cfg: ModelConfig, tokens_BT: jax.Array,
            cache: KVCache, *, positions_BT: Optional[jax.Array] = None,
            mask_BTT: Optional[jax.Array] = None, taps: Sequence[int] = (),
            logit_positions_BP: Optional[jax.Array] = None) -> ForwardOutput:
  """Runs T new tokens per row on top of each row's cached prefix.

  Args:
    params: model weights.
    cfg: static model config.
    tokens_BT: ``int32[B, T]`` new tokens.
    cache: keys/values of each row's prefix; row b's new tokens are written
      at slots ``lengths[b] + arange(T)``.
    positions_BT: RoPE positions of the new tokens; default
      ``lengths[:, None] + arange(T)`` (trees pass ``lengths + depth``).
    mask_BTT: ``bool[B, T, T]``, which new tokens each new token may see
      (must include itself); default causal.
    taps: layer indices whose *input* hidden states to return (L = output of
      the last layer). Static.
    logit_positions_BP: ``int32[B, P]`` compute logits only at these new-token
      positions (prefill needs just the last real token of each row).

  Returns:
    ``ForwardOutput`` with f32 logits, the appended cache and the taps.
  """
  B, T = tokens_BT.shape
  lengths_B = cache.lengths
  if positions_BT is None:
    positions_BT = lengths_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
  if mask_BTT is None:
    mask_BTT = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
  cache_mask_BS = jnp.arange(cache.capacity)[None, :] < lengths_B[:, None]

  angles_BTh = (positions_BT[..., None].astype(jnp.float32)
                * rope_inv_freq(cfg)[None, None, :])
  angles_BTH = jnp.concatenate([angles_BTh, angles_BTh], axis=-1)
  cos_BTH, sin_BTH = jnp.cos(angles_BTH), jnp.sin(angles_BTH)

  N, G, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  x_BTD = jnp.take(params.embed, tokens_BT, axis=0)
  want_taps = len(taps) > 0

  def layer(x_BTD, xs):
    lp, kc_BSGH, vc_BSGH = xs
    h = rms_norm(x_BTD, lp.attn_norm, cfg.norm_eps)
    qkv = h @ lp.wqkv
    if lp.bqkv is not None:
      qkv = qkv + lp.bqkv[None, None, :]
    q = qkv[..., :N * H].reshape(B, T, N, H)
    k = qkv[..., N * H:(N + G) * H].reshape(B, T, G, H)
    v = qkv[..., (N + G) * H:].reshape(B, T, G, H)
    q = apply_rope(q, cos_BTH, sin_BTH)
    k = apply_rope(k, cos_BTH, sin_BTH)
    attn = _attention(q, k, v, kc_BSGH, vc_BSGH, cache_mask_BS, mask_BTT)
    y = x_BTD + attn @ lp.wo
    h = rms_norm(y, lp.mlp_norm, cfg.norm_eps)
    gate, up = jnp.split(h @ lp.w_gate_up, 2, axis=-1)
    y = y + (jax.nn.silu(gate) * up) @ lp.w_down
    return y, (k, v, x_BTD if want_taps else None)

  x_BTD, (k_LBTGH, v_LBTGH, h_LBTD) = jax.lax.scan(
      layer, x_BTD, (params.layers, cache.k, cache.v))
  new_cache = cache.append(k_LBTGH, v_LBTGH)

  tap_out = None
  if want_taps:
    all_h = jnp.concatenate([h_LBTD, x_BTD[None]], axis=0)
    tap_out = all_h[jnp.asarray(taps)]

  h_BTD = rms_norm(x_BTD, params.final_norm, cfg.norm_eps)
  if logit_positions_BP is not None:
    h_BTD = jnp.take_along_axis(h_BTD, logit_positions_BP[..., None], axis=1)
  if params.lm_head is None:
    logits = jnp.einsum("btd,vd->btv", h_BTD, params.embed,
                        preferred_element_type=jnp.float32)
  else:
    logits = jnp.einsum("btd,dv->btv", h_BTD, params.lm_head,
                        preferred_element_type=jnp.float32)
  return ForwardOutput(logits=logits, cache=new_cache, taps=tap_out)
