"""Llama-family decoder as a pure function over a parameter pytree.

``forward`` serves prefill (T = prompt bucket), decode (T = 1) and speculative
verification (T = K + 1, or M tree nodes with a custom mask) alike: new tokens
attend to the row's valid cache slots plus, among themselves, a causal (or
caller-given tree) mask. Layers are a tuple of per-layer weights run by an
unrolled Python loop, not ``lax.scan`` over stacked weights: on XLA CPU the
scan's per-layer slice of the stacked weights costs as much as the matmuls
(decode at batch 1: 30 ms scan vs 17 ms unrolled for the layer matmuls;
docs/DESIGN.md). Each layer scatters its new keys/values into its own cache
buffers (in place when the cache is donated) and then attends over the cache.

Axis letters: see ``specjax/__init__.py``. Q, K, V projections are fused into
one ``[D, (N + 2G) H]`` matmul and gate/up into one ``[D, 2F]`` matmul: on the
CPU decode is bound by weight reads and launch overhead, fewer dots help. The
fused output columns are ordered so that any split of them into equal blocks
along kv heads (q/k/v: group by group, each group's R query heads then its key
and value head) or along F (gate/up: interleaved per FFN unit) keeps every
block self-contained: tensor parallelism over a mesh's ``model`` axis
(``specjax.sharding``) needs no communication inside a projection.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax import native
from specjax.cache import KVCache, write_kv
from specjax.models.config import ModelConfig

_NEG_INF = -1e30  # finite: a fully masked row must not produce NaNs
NATIVE_ATTENTION_MAX_T = 64  # new tokens up to which packed models use it


@struct.dataclass
class LayerParams:
  """One decoder layer's weights.

  Attributes:
    attn_norm: ``[D]``.
    wqkv: ``[D, G (R + 2) H]`` fused q/k/v projection, group-major
      (``fuse_qkv``; HF rotate-half layout within a head).
    bqkv: ``[G (R + 2) H]`` or None (no bias), the same order.
    wo: ``[N H, D]``.
    mlp_norm: ``[D]``.
    w_gate_up: ``[D, F 2]`` gate and up interleaved (``fuse_gate_up``).
    w_down: ``[F, D]``.
  """
  attn_norm: jax.Array
  wqkv: jax.Array
  bqkv: Optional[jax.Array]
  wo: jax.Array
  mlp_norm: jax.Array
  w_gate_up: jax.Array
  w_down: jax.Array


@struct.dataclass
class PackedWeight:
  """A ``[K, N]`` weight pre-arranged once for the native small-row matmul
  (``specjax.native``, CPU): ``panels [ceil(N / 16), K, 16]``, ``n`` = N."""
  panels: jax.Array
  n: int = struct.field(pytree_node=False)


def is_packed(params: "LlamaParams") -> bool:
  """Whether ``params`` went through ``pack_params``: the native CPU path."""
  return isinstance(params.layers[0].wqkv, PackedWeight)


def linear(x: jax.Array, w) -> jax.Array:
  """``x @ w`` over the last axis, for a ``[K, N]`` array (XLA's dot) or a
  ``PackedWeight`` (the native kernel; f32 math)."""
  if not isinstance(w, PackedWeight):
    return x @ w
  *lead, K = x.shape
  return native.small_matmul(x.reshape(-1, K), w.panels, w.n).reshape(
      *lead, w.n)


@struct.dataclass
class LlamaParams:
  """All weights of a model.

  Attributes:
    embed: ``[V, D]`` token embedding.
    layers: L ``LayerParams``, one per layer (not stacked: see module doc).
    final_norm: ``[D]``.
    lm_head: ``[V, D]`` (vocabulary-major like ``embed``; see ``_logits``),
      or None when tied to ``embed``, or a ``PackedWeight`` of ``[D, V]``
      (``pack_params``). Layer matmuls may be ``PackedWeight`` too.
  """
  embed: jax.Array
  layers: tuple[LayerParams, ...]
  final_norm: jax.Array
  lm_head: Optional[jax.Array]


def fuse_qkv(wq, wk, wv, num_kv_heads: int):
  """q/k/v projections (output features last: ``[..., N H]``, ``[..., G H]``,
  ``[..., G H]``) as one ``[..., G (R + 2) H]``: for each kv head g, its R
  query heads (``n = g R + r``, GQA's grouping), its key, its value."""
  xp = np if isinstance(wq, np.ndarray) else jnp
  *lead, NH = wq.shape
  G = num_kv_heads
  H = wk.shape[-1] // G
  group = lambda w: w.reshape(*lead, G, -1, H)
  return xp.concatenate([group(wq), group(wk), group(wv)], axis=-2).reshape(
      *lead, NH + 2 * G * H)


def split_qkv(wqkv, num_kv_heads: int, head_dim: int):
  """``fuse_qkv``'s inverse: ``(wq [..., N H], wk [..., G H], wv)``."""
  *lead, _ = wqkv.shape
  G, H = num_kv_heads, head_dim
  w = wqkv.reshape(*lead, G, -1, H)
  R = w.shape[-2] - 2
  return (w[..., :R, :].reshape(*lead, G * R * H),
          w[..., R, :].reshape(*lead, G * H), w[..., R + 1, :].reshape(
              *lead, G * H))


def fuse_gate_up(gate, up):
  """``[..., F]`` gate and up as one ``[..., F 2]`` (unit f's pair side by
  side)."""
  xp = np if isinstance(gate, np.ndarray) else jnp
  return xp.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], -1)


def split_gate_up(w):
  """``fuse_gate_up``'s inverse: ``(gate, up)``."""
  pairs = w.reshape(*w.shape[:-1], -1, 2)
  return pairs[..., 0], pairs[..., 1]


def random_params(key: jax.Array, cfg: ModelConfig, scale: float = 0.02,
                  dtype=jnp.float32) -> LlamaParams:
  """Normal(0, scale) weights and unit norms of ``cfg``'s shapes: a model
  with no checkpoint behind it, for smoke runs on a machine without files."""
  D, F, H, V = cfg.dim, cfg.ffn_dim, cfg.head_dim, cfg.vocab_size
  NH, GH = cfg.num_heads * H, cfg.num_kv_heads * H
  keys = iter(jax.random.split(key, 5 * cfg.num_layers + 2))
  w = lambda *shape: scale * jax.random.normal(next(keys), shape, dtype)
  ones = jnp.ones((D,), dtype)
  layers = tuple(LayerParams(
      attn_norm=ones, wqkv=w(D, NH + 2 * GH),
      bqkv=w(NH + 2 * GH) if cfg.qkv_bias else None, wo=w(NH, D),
      mlp_norm=ones, w_gate_up=w(D, 2 * F), w_down=w(F, D))
      for _ in range(cfg.num_layers))
  return LlamaParams(embed=w(V, D), layers=layers, final_norm=ones,
                     lm_head=None if cfg.tie_embeddings else w(V, D))


def pack_weight(w_KN: jax.Array, dtype=jnp.float32) -> PackedWeight:
  """A ``[K, N]`` weight pre-arranged for the native small-row matmul, its
  panels f32 or (for weights bf16 holds exactly) bf16: half the bytes."""
  return PackedWeight(native.pack(w_KN, dtype), w_KN.shape[1])


def pack_params(params: LlamaParams) -> LlamaParams:
  """The same f32 model with every layer matmul and the LM head
  pre-arranged for the native small-row matmul (``specjax.native``). A tied
  LM head gets its own packed copy of the embedding (V x D more floats); the
  embedding stays as it is for lookups. Packed weights put ``forward`` on
  the native CPU path: the native attention too, for up to
  ``NATIVE_ATTENTION_MAX_T`` new tokens, when ``native.available()``."""
  if params.embed.dtype != jnp.float32:
    raise ValueError(f"the native matmul is f32; these weights are "
                     f"{params.embed.dtype}")
  pk = pack_weight
  layers = tuple(lp.replace(wqkv=pk(lp.wqkv), wo=pk(lp.wo),
                            w_gate_up=pk(lp.w_gate_up), w_down=pk(lp.w_down))
                 for lp in params.layers)
  return params.replace(layers=layers, lm_head=pk(lm_head_VD(params).T))


def dense_weight(w) -> jax.Array:
  """A ``[K, N]`` weight as an array, whether plain or packed."""
  if isinstance(w, PackedWeight):
    return native.unpack(w.panels, w.n).astype(jnp.float32)
  return w


def lm_head_VD(params: LlamaParams) -> jax.Array:
  """The output projection as ``[V, D]``, whether tied to ``embed``, plain
  or packed (``pack_params``)."""
  w = params.lm_head
  if w is None:
    return params.embed
  return dense_weight(w).T if isinstance(w, PackedWeight) else w


@struct.dataclass
class ForwardOutput:
  """Result of ``forward``.

  Attributes:
    logits: ``f32[B, T, V]`` (or ``[B, P, V]`` when ``logit_positions`` given).
    cache: the cache with the T new entries appended (lengths += T), or
      the input cache untouched (``write_cache=False``).
    taps: ``[len(taps), B, T, D]`` hidden states at the inputs of the requested
      layers (index L means the last layer's output, before the final norm),
      or None when no taps were requested.
    new_kv: with ``write_cache=False``, each layer's new ``(k, v)``,
      ``[B, T, G, H]`` each (keys RoPE'd), for ``KVCache.write``; else None.
  """
  logits: jax.Array
  cache: KVCache
  taps: Optional[jax.Array]
  new_kv: Optional[tuple] = None


def init_cache(cfg: ModelConfig, batch: int, capacity: int,
               dtype=jnp.float32) -> KVCache:
  return KVCache.init(cfg.num_layers, batch, capacity, cfg.num_kv_heads,
                      cfg.head_dim, dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return x32.astype(x.dtype) * jnp.broadcast_to(weight, x.shape)


def rope_inv_freq(head_dim: int, theta: float,
                  scaling=None) -> np.ndarray:
  """``[H/2]`` inverse frequencies, with Llama-3 scaling when given
  (``ModelConfig.rope_scaling``)."""
  half = head_dim // 2
  inv = 1.0 / (theta ** (np.arange(half, dtype=np.float64) * 2 / head_dim))
  sc = scaling
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


def attention(q_BTNH, kc_BGHS, vc_BGSH, mask_BQS, new=None):
  """Attention of T new queries over the cache, and over the new tokens'
  own keys/values when ``new = (k_BTGH, v_BTGH, mask_BQT)`` is given (the
  target's forward: the cache holds the prefix and is only read); without
  ``new`` the new entries must already be in the cache (the EAGLE heads'
  drafting layer).

  Queries are grouped per kv head as Q = T*R rows so the products are plain
  batched matmuls over (B, G) against the cache's layouts; ``mask_BQS`` says
  which slots those rows see (``query_mask``; ``[B, 1, S]`` broadcasts),
  ``mask_BQT`` which new tokens. Masked scores are replaced (not added to)
  and values no row sees are zeroed, so whatever a stale slot holds (NaN,
  inf) never reaches the output; a non-finite new value reaches exactly
  the queries that see it.
  """
  B, T, N, H = q_BTNH.shape
  G, S = kc_BGHS.shape[1], kc_BGHS.shape[-1]
  R = N // G
  q_BGQH = (q_BTNH.reshape(B, T, G, R, H) * (H ** -0.5)).transpose(
      0, 2, 1, 3, 4).reshape(B, G, T * R, H)
  s_BGQS = jnp.einsum("bgqh,bghs->bgqs", q_BGQH, kc_BGHS,
                      preferred_element_type=jnp.float32)
  scores = [jnp.where(mask_BQS[:, None], s_BGQS, _NEG_INF)]
  if new is not None:
    k_BTGH, v_BTGH, mask_BQT = new
    s_BGQT = jnp.einsum("bgqh,btgh->bgqt", q_BGQH, k_BTGH,
                        preferred_element_type=jnp.float32)
    scores.append(jnp.where(mask_BQT[:, None], s_BGQT, _NEG_INF))
  p_BGQX = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)
  seen_BS = jnp.any(mask_BQS, axis=1)
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


def causal_mask(batch: int, num_new: int) -> jax.Array:
  """``bool[B, T, T]``: each new token sees itself and the ones before it."""
  return jnp.broadcast_to(jnp.tril(jnp.ones((num_new, num_new), bool)),
                          (batch, num_new, num_new))


def forward(params: LlamaParams, cfg: ModelConfig, tokens_BT: jax.Array,
            cache: KVCache, *, positions_BT: Optional[jax.Array] = None,
            mask_BTT: Optional[jax.Array] = None, taps: Sequence[int] = (),
            logit_positions_BP: Optional[jax.Array] = None,
            write_cache: bool = True) -> ForwardOutput:
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
    write_cache: False leaves the cache untouched (only its prefix is read)
      and returns the new entries instead (``new_kv``): a verify forward
      under ``lax.cond`` then never copies the cache, and the engine writes
      only what it keeps.

  Every layer attends over the cache prefix (slots below each row's length)
  plus the new tokens' own keys/values, so both modes compute the same.

  Returns:
    ``ForwardOutput`` with f32 logits, the cache (appended or untouched), the
    taps and (not writing) the new entries.
  """
  B, T = tokens_BT.shape
  lengths_B = cache.lengths
  if positions_BT is None:
    positions_BT = lengths_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
  if mask_BTT is None:
    mask_BTT = causal_mask(B, T)
  # Opaque to XLA: a fresh cache's prefix mask is a constant (all False),
  # and XLA would constant-fold every layer's masked prefill scores
  # (~8 s a layer at a 512-token bucket) instead of computing them.
  prefix_B1S = jax.lax.optimization_barrier(
      (jnp.arange(cache.capacity)[None, :] < lengths_B[:, None])[:, None, :])
  mask_BQT = jnp.repeat(mask_BTT, cfg.group_size, axis=1)
  slots_BT = cache.new_slots(T)
  # Packed weights mean the native CPU path: its attention too, for decode,
  # verify and tree widths (prefill's long T stays on XLA's batched dots).
  native_attention = (is_packed(params) and T <= NATIVE_ATTENTION_MAX_T
                      and native.available())

  cos_BTH, sin_BTH = rope_once(positions_BT, rope_inv_freq(
      cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))

  N, G, H, R = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.group_size
  x_BTD = jnp.take(params.embed, tokens_BT, axis=0)
  hidden, ks, vs, new_kv = [], list(cache.k), list(cache.v), []
  for i, lp in enumerate(params.layers):
    hidden.append(x_BTD)
    h = rms_norm(x_BTD, lp.attn_norm, cfg.norm_eps)
    qkv = linear(h, lp.wqkv)
    if lp.bqkv is not None:
      qkv = qkv + lp.bqkv[None, None, :]
    qkv_BTGJH = qkv.reshape(B, T, G, R + 2, H)  # fuse_qkv's order, J = R + 2
    qk = apply_rope(qkv_BTGJH[:, :, :, :R + 1], cos_BTH, sin_BTH)
    q, k = qk[:, :, :, :R].reshape(B, T, N, H), qk[:, :, :, R]
    v = qkv_BTGJH[:, :, :, R + 1]
    if write_cache:
      # Write first, then attend (over the prefix): reading the buffers
      # before the write would make XLA copy them to keep the old values.
      ks[i], vs[i] = write_kv(ks[i], vs[i], k, v, slots_BT)
    new_kv.append((k, v))
    attn = (native.attention(q, ks[i], vs[i], k, v, lengths_B, mask_BTT)
            if native_attention else
            attention(q, ks[i], vs[i], prefix_B1S, new=(k, v, mask_BQT)))
    x_BTD = x_BTD + linear(attn, lp.wo)
    h = rms_norm(x_BTD, lp.mlp_norm, cfg.norm_eps)
    gate, up = split_gate_up(linear(h, lp.w_gate_up))
    x_BTD = x_BTD + linear(jax.nn.silu(gate) * up, lp.w_down)
  hidden.append(x_BTD)
  new_cache = KVCache(k=tuple(ks), v=tuple(vs),
                      lengths=lengths_B + T if write_cache else lengths_B)
  tap_out = jnp.stack([hidden[t] for t in taps]) if taps else None

  h_BTD = rms_norm(x_BTD, params.final_norm, cfg.norm_eps)
  if logit_positions_BP is not None:
    h_BTD = jnp.take_along_axis(h_BTD, logit_positions_BP[..., None], axis=1)
  w_VD = params.embed if params.lm_head is None else params.lm_head
  return ForwardOutput(logits=_logits(h_BTD, w_VD), cache=new_cache,
                       taps=tap_out,
                       new_kv=None if write_cache else tuple(new_kv))


def _logits(h_BTD: jax.Array, w_VD: jax.Array) -> jax.Array:
  """``f32[B, T, V]``. With more than one row, the vocabulary is the dot's
  left operand: XLA CPU's GEMM is then 2-3x faster for a few rows against a
  huge V (measured for 576 x 49152: 8 rows 14 ms vs 44 ms, 5 rows 18 vs 34),
  which is what a verify step over K + 1 tokens needs. One row stays a
  plain GEMV, XLA's fastest form there."""
  if isinstance(w_VD, PackedWeight):  # pack_params: [D, V] panels
    return linear(h_BTD, w_VD)
  B, T, D = h_BTD.shape
  if B * T == 1:
    return jnp.einsum("btd,vd->btv", h_BTD, w_VD,
                      preferred_element_type=jnp.float32)
  logits_VM = jnp.einsum("vd,md->vm", w_VD, h_BTD.reshape(B * T, D),
                         preferred_element_type=jnp.float32)
  return logits_VM.T.reshape(B, T, -1)
