"""The decoder every supported architecture is, as a pure function over a
parameter pytree, and ``Decoder``: it as a ``specjax.models.target.Target``.

Llama 1/2/3, Mistral, Qwen2/3, Gemma 2/3 and Phi-3 are one pre-norm decoder
whose differences are ``ModelConfig`` fields (biases, q/k norms, sandwich
norms, Gemma's ``1 + w`` norms, GeGLU, sliding windows per layer, local RoPE
bases, soft-capping, embedding scale), composed from ``layers``.

``forward`` serves prefill (T = prompt bucket), decode (T = 1) and speculative
verification (T = K + 1, or M tree nodes with a custom mask) alike: new tokens
attend to the row's valid cache slots plus, among themselves, a causal (or
caller-given tree) mask, and a sliding layer to those within its window.
Layers are a tuple of per-layer weights run by an unrolled Python loop, not
``lax.scan`` over stacked weights: on XLA CPU the scan's per-layer slice of
the stacked weights costs as much as the matmuls (measured: docs/DESIGN.md,
"Layers are unrolled over per-layer buffers"). Each layer
scatters its new keys/values into its own cache buffers (in place when the
cache is donated) and then attends over the cache.

Axis letters: see ``specjax/__init__.py``. Q, K, V projections are fused into
one ``[D, (N + 2G) H]`` matmul and gate/up into one ``[D, 2F]`` matmul: on the
CPU decode is bound by weight reads and launch overhead, fewer dots help. The
fused output columns are ordered so that any split of them into equal blocks
along kv heads (q/k/v: group by group, each group's R query heads then its key
and value head) or along F (gate/up: interleaved per FFN unit) keeps every
block self-contained: tensor parallelism over a mesh's ``model`` axis
(``specjax.core.sharding``) needs no communication inside a projection.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.core.cache import KVCache, write_kv
from specjax.kernels import native
from specjax.models.config import ModelConfig
from specjax.models.layers import (PackedWeight, apply_rope, attention,
                                   causal_mask, dense_weight, gated_mlp,
                                   linear, native_attention, pack_weight,
                                   rms_norm, rope_inv_freq, rope_once, softcap,
                                   window_masks)
from specjax.models.target import ForwardOutput



@struct.dataclass
class LayerParams:
  """One decoder layer's weights (an optional one is None when the
  architecture has no such weight).

  Attributes:
    attn_norm: ``[D]``.
    wqkv: ``[D, G (R + 2) H]`` fused q/k/v projection, group-major
      (``fuse_qkv``; HF rotate-half layout within a head).
    bqkv: ``[G (R + 2) H]`` or None (no bias), the same order.
    wo: ``[N H, D]``; ``bo``: ``[D]`` or None.
    mlp_norm: ``[D]``.
    w_gate_up: ``[D, F 2]`` gate and up interleaved (``fuse_gate_up``);
      ``b_gate_up``: ``[F 2]`` or None.
    w_down: ``[F, D]``; ``b_down``: ``[D]`` or None.
    q_norm, k_norm: ``[H]`` per-head norms before RoPE, or None.
    post_attn_norm, post_mlp_norm: ``[D]`` norms of the attention and MLP
      outputs (sandwich norms), or None.
  """
  attn_norm: jax.Array
  wqkv: jax.Array
  bqkv: Optional[jax.Array]
  wo: jax.Array
  mlp_norm: jax.Array
  w_gate_up: jax.Array
  w_down: jax.Array
  bo: Optional[jax.Array] = None
  b_gate_up: Optional[jax.Array] = None
  b_down: Optional[jax.Array] = None
  q_norm: Optional[jax.Array] = None
  k_norm: Optional[jax.Array] = None
  post_attn_norm: Optional[jax.Array] = None
  post_mlp_norm: Optional[jax.Array] = None


@struct.dataclass
class DecoderParams:
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


def is_packed(params: DecoderParams) -> bool:
  """Whether ``params`` went through ``pack_params``: the native CPU path."""
  return isinstance(params.layers[0].wqkv, PackedWeight)


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


def random_params(key: jax.Array, cfg: ModelConfig, scale: float = 0.02,
                  dtype=jnp.float32) -> DecoderParams:
  """Normal(0, scale) weights and unit norms of ``cfg``'s shapes: a model
  with no checkpoint behind it, for smoke runs on a machine without files."""
  D, F, H, V = cfg.dim, cfg.ffn_dim, cfg.head_dim, cfg.vocab_size
  NH, GH = cfg.num_heads * H, cfg.num_kv_heads * H
  keys = iter(jax.random.split(key, 8 * cfg.num_layers + 2))
  w = lambda *shape: scale * jax.random.normal(next(keys), shape, dtype)
  norm = lambda n: jnp.full((n,), 1.0 - cfg.norm_offset, dtype)
  maybe = lambda flag, make: make() if flag else None
  layers = tuple(LayerParams(
      attn_norm=norm(D), wqkv=w(D, NH + 2 * GH),
      bqkv=maybe(cfg.qkv_bias, lambda: w(NH + 2 * GH)), wo=w(NH, D),
      mlp_norm=norm(D), w_gate_up=w(D, 2 * F), w_down=w(F, D),
      bo=maybe(cfg.o_bias, lambda: w(D)),
      b_gate_up=maybe(cfg.mlp_bias, lambda: w(2 * F)),
      b_down=maybe(cfg.mlp_bias, lambda: w(D)),
      q_norm=maybe(cfg.qk_norm, lambda: norm(H)),
      k_norm=maybe(cfg.qk_norm, lambda: norm(H)),
      post_attn_norm=maybe(cfg.sandwich_norms, lambda: norm(D)),
      post_mlp_norm=maybe(cfg.sandwich_norms, lambda: norm(D)))
      for _ in range(cfg.num_layers))
  return DecoderParams(embed=w(V, D), layers=layers, final_norm=norm(D),
                       lm_head=None if cfg.tie_embeddings else w(V, D))


def pack_params(params: DecoderParams) -> DecoderParams:
  """The same f32 model with every layer matmul and the LM head
  pre-arranged for the native small-row matmul (``kernels.small_gemm``). A tied
  LM head gets its own packed copy of the embedding (V x D more floats); the
  embedding stays as it is for lookups. Packed weights put ``forward`` on
  the native CPU path: the native attention too (full-attention layers
  without soft-capping), for any number of new tokens (a decode step, a
  verify block or tree, a prefill chunk), when ``native.available()``."""
  if params.embed.dtype != jnp.float32:
    raise ValueError(f"the native matmul is f32; these weights are "
                     f"{params.embed.dtype}")
  pk = pack_weight
  layers = tuple(lp.replace(wqkv=pk(lp.wqkv), wo=pk(lp.wo),
                            w_gate_up=pk(lp.w_gate_up), w_down=pk(lp.w_down))
                 for lp in params.layers)
  return params.replace(layers=layers, lm_head=pk(lm_head_VD(params).T))


def lm_head_VD(params: DecoderParams) -> jax.Array:
  """The output projection as ``[V, D]``, whether tied to ``embed``, plain
  or packed (``pack_params``)."""
  w = params.lm_head
  if w is None:
    return params.embed
  return dense_weight(w).T if isinstance(w, PackedWeight) else w


def init_cache(cfg: ModelConfig, batch: int, capacity: int,
               dtype=jnp.float32, num_layers: Optional[int] = None) -> KVCache:
  return KVCache.init(cfg.num_layers if num_layers is None else num_layers,
                      batch, capacity, cfg.num_kv_heads, cfg.head_dim, dtype)


def _layer_masks(cfg: ModelConfig, windows, positions_BT, prefix_B1S,
                 mask_BTT, capacity: int):
  """Per distinct window (None: full attention) the ``(slots [B, Q, S],
  new tokens [B, Q, T])`` masks of ``attention``'s query rows."""
  out = {}
  for w in set(windows):
    prefix, new = prefix_B1S, mask_BTT
    if w is not None:
      win_BTS, win_BTT = window_masks(positions_BT, capacity, w)
      prefix, new = prefix_B1S & win_BTS, mask_BTT & win_BTT
      prefix = jnp.repeat(prefix, cfg.group_size, axis=1)
    out[w] = (prefix, jnp.repeat(new, cfg.group_size, axis=1))
  return out


def _rope_tables(cfg: ModelConfig, windows, positions_BT):
  """cos/sin per layer kind: the full layers' (base and scaling) and, for
  Gemma 3, the sliding layers' own base."""
  full = rope_once(positions_BT, rope_inv_freq(cfg.head_dim, cfg.rope_theta,
                                               cfg.rope_scaling))
  if cfg.local_rope_theta is None or all(w is None for w in windows):
    return lambda w: full
  local = rope_once(positions_BT, rope_inv_freq(cfg.head_dim,
                                                cfg.local_rope_theta))
  return lambda w: full if w is None else local


def _norm(cfg: ModelConfig, x: jax.Array, w: jax.Array) -> jax.Array:
  """The architecture's RMSNorm (its eps; Gemma's ``1 + w``)."""
  return rms_norm(x, w, cfg.norm_eps, cfg.norm_offset)


def layer_qkv(lp: LayerParams, cfg: ModelConfig, x_BTX: jax.Array,
              cos_sin) -> tuple[jax.Array, jax.Array, jax.Array]:
  """A layer's RoPE'd queries ``[B, T, N, H]``, keys and values
  ``[B, T, G, H]`` from its normed input ``x_BTX`` (X = D for the decoder,
  2 D for an EAGLE-3 head's layer) and ``(cos, sin)`` of the positions:
  the fused projection with its bias, then the q/k norms if any."""
  B, T = x_BTX.shape[:2]
  N, G, H, R = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.group_size
  qkv = linear(x_BTX, lp.wqkv, lp.bqkv)
  qkv_BTGJH = qkv.reshape(B, T, G, R + 2, H)  # fuse_qkv's order, J = R + 2
  qk = qkv_BTGJH[:, :, :, :R + 1]
  if lp.q_norm is not None:
    qk = jnp.concatenate([_norm(cfg, qk[:, :, :, :R], lp.q_norm),
                          _norm(cfg, qk[:, :, :, R:], lp.k_norm)], axis=3)
  qk = apply_rope(qk, *cos_sin)
  return (qk[:, :, :, :R].reshape(B, T, N, H), qk[:, :, :, R],
          qkv_BTGJH[:, :, :, R + 1])


def layer_out(lp: LayerParams, cfg: ModelConfig, x_BTD: jax.Array,
              attn: jax.Array) -> jax.Array:
  """The rest of a layer once attention ran (``attn`` ``[B, T, N H]`` or
  ``[B, T, N, H]``): its output projection (and norm) onto the residual
  stream ``x_BTD``, then the MLP block the same way."""
  a_BTD = linear(attn.reshape(*x_BTD.shape[:2], -1), lp.wo, lp.bo)
  if lp.post_attn_norm is not None:
    a_BTD = _norm(cfg, a_BTD, lp.post_attn_norm)
  x_BTD = x_BTD + a_BTD
  m_BTD = gated_mlp(_norm(cfg, x_BTD, lp.mlp_norm), lp.w_gate_up,
                    lp.w_down, cfg.activation, lp.b_gate_up, lp.b_down)
  if lp.post_mlp_norm is not None:
    m_BTD = _norm(cfg, m_BTD, lp.post_mlp_norm)
  return x_BTD + m_BTD


def forward(params: DecoderParams, cfg: ModelConfig, tokens_BT: jax.Array,
            cache: KVCache, *, positions_BT: Optional[jax.Array] = None,
            mask_BTT: Optional[jax.Array] = None, taps: Sequence[int] = (),
            logit_positions_BP: Optional[jax.Array] = None,
            write_cache: bool = True,
            layers: Optional[Sequence[int]] = None,
            skip: Optional[jax.Array] = None) -> ForwardOutput:
  """Runs T new tokens per row on top of each row's cached prefix.

  Args:
    params: model weights.
    cfg: static model config.
    tokens_BT: ``int32[B, T]`` new tokens.
    cache: keys/values of each row's prefix; row b's new tokens are written
      at slots ``lengths[b] + arange(T)``. Slot s holds position s.
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
    layers: run only these layers (static, increasing), then the final norm
      and the LM head (layer-skip drafting); the cache then holds one entry
      per layer run, and taps count the layers run. None: all.
    skip: ``bool[L]`` (traced) layers to pass over as the identity, each
      under a ``lax.cond`` so a skipped layer is not computed (CLaSp's
      draft); only with ``write_cache=False`` (a skipped layer's new
      entries are zeros).

  Every layer attends over the cache prefix (slots below each row's length)
  plus the new tokens' own keys/values, so both modes compute the same.

  Returns:
    ``ForwardOutput`` with f32 logits, the cache (appended or untouched), the
    taps and (not writing) the new entries.
  """
  B, T = tokens_BT.shape
  if skip is not None and write_cache:
    raise ValueError("skip needs write_cache=False: a skipped layer has no "
                     "cache entries to write")
  lengths_B = cache.lengths
  run = tuple(range(cfg.num_layers)) if layers is None else tuple(layers)
  # No two positions of a row are a capacity apart (slot s holds position
  # s): a window that wide never binds, and its layer runs as a full one.
  windows = [w if w and w < cache.capacity else None
             for w in map(cfg.window, run)]
  if positions_BT is None:
    positions_BT = lengths_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
  if mask_BTT is None:
    mask_BTT = causal_mask(B, T)
  prefix_B1S = _prefix_mask(cache)
  masks = _layer_masks(cfg, windows, positions_BT, prefix_B1S, mask_BTT,
                       cache.capacity)
  slots_BT = cache.new_slots(T)
  # Decode, verify, trees and prefill chunks alike.
  use_native_attention = _native_attention_ok(params, cfg)
  tables = _rope_tables(cfg, windows, positions_BT)

  x_BTD = jnp.take(params.embed, tokens_BT, axis=0)
  if cfg.embed_scale is not None:
    x_BTD = x_BTD * jnp.asarray(cfg.embed_scale, x_BTD.dtype)
  hidden, ks, vs, new_kv = [], list(cache.k), list(cache.v), []
  for c, (i, window) in enumerate(zip(run, windows)):
    hidden.append(x_BTD)
    layer = lambda x_BTD, c=c, i=i, window=window: _layer(
        params.layers[i], cfg, x_BTD, ks[c], vs[c], tables(window),
        masks[window], lengths_B=lengths_B, mask_BTT=mask_BTT,
        slots_BT=slots_BT if write_cache else None,
        kernel=use_native_attention and window is None)
    if skip is None:
      x_BTD, ks[c], vs[c], kv = layer(x_BTD)
    else:
      x_BTD, kv = jax.lax.cond(skip[i], _passed_over(cfg, B, T),
                               lambda x_BTD: layer(x_BTD)[::3], x_BTD)
    new_kv.append(kv)
  hidden.append(x_BTD)
  new_cache = KVCache(k=tuple(ks), v=tuple(vs),
                      lengths=lengths_B + T if write_cache else lengths_B)
  tap_out = jnp.stack([hidden[t] for t in taps]) if taps else None

  h_BTD = _norm(cfg, x_BTD, params.final_norm)
  if logit_positions_BP is not None:
    h_BTD = jnp.take_along_axis(h_BTD, logit_positions_BP[..., None], axis=1)
  w_VD = params.embed if params.lm_head is None else params.lm_head
  return ForwardOutput(
      logits=softcap(_logits(h_BTD, w_VD), cfg.final_logit_cap),
      cache=new_cache, taps=tap_out,
      new_kv=None if write_cache else tuple(new_kv))


def _prefix_mask(cache: KVCache) -> jax.Array:
  """``bool[B, 1, S]``: each row's cache slots in use. Opaque to XLA: a
  fresh cache's prefix mask is a constant (all False), and XLA would
  constant-fold every layer's masked prefill scores (~8 s a layer at a
  512-token bucket) instead of computing them."""
  return jax.lax.optimization_barrier(
      (jnp.arange(cache.capacity)[None, :] < cache.lengths[:, None])[:, None])


def _native_attention_ok(params: DecoderParams, cfg: ModelConfig) -> bool:
  """Packed weights mean the native CPU path: its attention too, on the
  layers it computes (no window, no soft-capping)."""
  return (is_packed(params) and cfg.attn_logit_cap is None
          and native.available())


def _layer(lp: LayerParams, cfg: ModelConfig, x_BTD, k_BSGH, v_BSGH, rope,
           masks, *, lengths_B, mask_BTT, slots_BT, kernel: bool):
  """One decoder layer over each row's cached prefix and the new tokens:
  ``(x out, keys, values, (new keys, new values))``; the new entries are
  written at ``slots_BT`` first (None: the cache is only read). ``masks``:
  ``_layer_masks``' pair for the layer's window; ``kernel``: the native
  CPU kernel's attention (no window, no soft-capping)."""
  H = cfg.head_dim
  scale = H ** -0.5 if cfg.query_scale is None else cfg.query_scale
  q, k, v = layer_qkv(lp, cfg, _norm(cfg, x_BTD, lp.attn_norm), rope)
  if slots_BT is not None:
    # Write first, then attend (over the prefix): reading the buffers
    # before the write would make XLA copy them to keep the old values.
    k_BSGH, v_BSGH = write_kv(k_BSGH, v_BSGH, k, v, slots_BT)
  if kernel:  # it scales by H ** -0.5; any other scale goes into q
    attn = native_attention(q * (scale * H ** 0.5) if cfg.query_scale else q,
                            k_BSGH, v_BSGH, k, v, lengths_B, mask_BTT)
  else:
    prefix, new = masks
    attn = attention(q, k_BSGH, v_BSGH, prefix, new=(k, v, new), scale=scale,
                     logit_cap=cfg.attn_logit_cap)
  return layer_out(lp, cfg, x_BTD, attn), k_BSGH, v_BSGH, (k, v)


def _passed_over(cfg: ModelConfig, B: int, T: int):
  """A skipped layer: the input unchanged, zero new entries."""
  zeros = jnp.zeros((B, T, cfg.num_kv_heads, cfg.head_dim))
  return lambda x_BTD: (x_BTD, (zeros.astype(x_BTD.dtype),) * 2)


def run_layer(params: DecoderParams, cfg: ModelConfig, layer: int,
              x_BTD: jax.Array, cache: KVCache, *, positions_BT: jax.Array,
              mask_BTT: jax.Array) -> jax.Array:
  """Layer ``layer`` alone on hidden states ``x_BTD`` at ``positions``,
  over each row's cached prefix (read, never written) and the new states
  ``mask_BTT`` lets each see: CLaSp's dynamic programme runs its
  candidate states through one layer at a time with it."""
  window = cfg.window(layer)
  window = window if window and window < cache.capacity else None
  masks = _layer_masks(cfg, [window], positions_BT, _prefix_mask(cache),
                       mask_BTT, cache.capacity)[window]
  kernel = _native_attention_ok(params, cfg) and window is None
  return _layer(params.layers[layer], cfg, x_BTD, cache.k[layer],
                cache.v[layer], _rope_tables(cfg, [window], positions_BT)(
                    window), masks, lengths_B=cache.lengths,
                mask_BTT=mask_BTT, slots_BT=None, kernel=kernel)[0]


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


def param_axes(params: DecoderParams) -> DecoderParams:
  """Logical axes of every parameter (``specjax.core.sharding``), as a tree like
  ``params``: q/k/v, the attention output and its kv heads over
  ``kv_heads``, the MLP over ``ffn``, the vocabulary over ``vocab``."""
  if is_packed(params):
    raise ValueError("packed weights (the native CPU path) run on one "
                     "device; load the model with native=False for a mesh")
  axes = dict(attn_norm=(None,), wqkv=(None, "kv_heads"), bqkv=("kv_heads",),
              wo=("kv_heads", None), bo=(None,), mlp_norm=(None,),
              w_gate_up=(None, "ffn"), b_gate_up=("ffn",),
              w_down=("ffn", None), b_down=(None,), q_norm=(None,),
              k_norm=(None,), post_attn_norm=(None,), post_mlp_norm=(None,))
  layer = lambda lp: LayerParams(**{
      f.name: None if getattr(lp, f.name) is None else axes[f.name]
      for f in dataclasses.fields(LayerParams)})
  return DecoderParams(
      embed=("vocab", None), layers=tuple(layer(lp) for lp in params.layers),
      final_norm=(None,),
      lm_head=None if params.lm_head is None else ("vocab", None))


@dataclasses.dataclass(frozen=True)
class Decoder:
  """specjax's own decoder as a ``Target``: every architecture
  ``load_model`` reads (``ModelConfig`` says which), on ``DecoderParams``."""
  config: ModelConfig

  def init_cache(self, params, batch: int, capacity: int, dtype=None,
                 layers: Optional[Sequence[int]] = None) -> KVCache:
    dtype = params.embed.dtype if dtype is None else dtype
    return init_cache(self.config, batch, capacity, dtype,
                      None if layers is None else len(layers))

  def forward(self, params, tokens_BT, cache, **kw) -> ForwardOutput:
    return forward(params, self.config, tokens_BT, cache, **kw)

  def run_layer(self, params, layer, x_BTD, cache, **kw) -> jax.Array:
    return run_layer(params, self.config, layer, x_BTD, cache, **kw)

  def embedding(self, params) -> jax.Array:
    return params.embed

  def lm_head(self, params) -> jax.Array:
    return lm_head_VD(params)

  def output_norm(self, params) -> tuple[jax.Array, float]:
    c = self.config
    return (params.final_norm.astype(jnp.float32) + c.norm_offset,
            c.norm_eps)

  def param_axes(self, params):
    return param_axes(params)

  @property
  def axis_sizes(self) -> dict[str, int]:
    c = self.config
    return dict(kv_heads=c.num_kv_heads, ffn=c.ffn_dim, vocab=c.vocab_size)

  def layer_weights(self, params, layer: int) -> dict:
    """Layer ``layer``'s weights as plain arrays in the decoder's fused
    layout: ``attn_norm, wqkv, wo, mlp_norm, w_gate_up, w_down`` (norms as
    their effective scale). Raises ValueError for a layer that is not a
    plain Llama layer (biases, q/k or sandwich norms, not SwiGLU): what an
    EAGLE head's layer (``heads.base.DecoderLayer``) can start from."""
    c, lp = self.config, params.layers[layer]
    extra = [n for n in ("bqkv", "bo", "b_gate_up", "q_norm",
                         "post_attn_norm") if getattr(lp, n) is not None]
    if extra or c.activation != "silu":
      raise ValueError(f"layer {layer} of {c.name} is not a plain Llama "
                       f"layer ({', '.join(extra) or c.activation})")
    eff = lambda w: w.astype(jnp.float32) + c.norm_offset
    return dict(attn_norm=eff(lp.attn_norm), wqkv=dense_weight(lp.wqkv),
                wo=dense_weight(lp.wo), mlp_norm=eff(lp.mlp_norm),
                w_gate_up=dense_weight(lp.w_gate_up),
                w_down=dense_weight(lp.w_down))
