"""EAGLE-3's training-time test (TTT): K unrolled draft steps, one ``lax.scan``.

Alignment (eagle3.md §2; our indexing, one convention everywhere): ``x`` are
the ids, ``taps[t]`` the target's fused features at position t and
``target_logits[t]`` its (Vd-restricted) logits there, i.e. its distribution
of ``x[t+1]``. At TTT step k (0-based) query position t gets

  token   x[t + 1 + k]                     (always the *true* token)
  feature fc(taps[t]) at k = 0, else the head's own step k-1 output at t
  RoPE    position t + k
  target  target_logits[t + 1 + k]          (the distribution of x[t + 2 + k])
  weight  0.8^k, counted iff x[t + 2 + k] is an assistant token and the
          target's argmax there is in the draft vocabulary.

Attention at step k: causal over the step-0 keys, plus the keys that steps
1..k computed at the query's *own* position ("diagonal" blocks); ``dense_mask``
spells that rule out as one ``[T, (k+1) T]`` mask for reference code. The
scan keeps the diagonal keys in a fixed ``[K-1, B, T, G, H]`` buffer and masks
steps not yet run, so shapes never change.

Loss per step: soft cross-entropy against the target distribution
renormalized over Vd, averaged over that step's counted positions (the
reference averages over all B·T positions, which scales the loss by each
batch's share of assistant tokens; we divide by the count instead). Total =
Σ_k 0.8^k · loss_k. Accuracy per step: draft argmax == target argmax.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from specjax.training.fused_ce import fused_soft_ce
from specjax.heads.base import HeadConfig
from specjax.heads import head_call
from specjax.heads.vocab import DraftVocab
from specjax.models.layers import rms_norm
from specjax.models.target import Target


@struct.dataclass
class TTTBatch:
  """One training batch, everything the frozen target contributes included.

  Attributes:
    tokens: ``int32[B, T]`` ids (right-padded).
    taps: ``[B, T, len(taps) * D]`` target features.
    target_logits: ``f32[B, T, Vd]`` target logits at the draft ids.
    target_in_vocab: ``bool[B, T]`` the target's argmax is in Vd.
    loss_mask: ``bool[B, T]`` token t is an assistant token (to be learnt).
  """
  tokens: jax.Array
  taps: jax.Array
  target_logits: jax.Array
  target_in_vocab: jax.Array
  loss_mask: jax.Array


def _target_forward(target_params, target: Target, head_cfg: HeadConfig,
                    vocab: DraftVocab, tokens_BT, hidden: bool = False):
  """The frozen target once over the batch (no cache reuse needed): fused
  taps, the final-normed hidden (``hidden``: what a feature cache keeps;
  else None), whether its argmax is in Vd, full logits."""
  B, T = tokens_BT.shape
  cache = target.init_cache(target_params, B, T)
  out = target.forward(target_params, tokens_BT, cache,
                       taps=head_cfg.taps + (target.config.num_layers,))
  taps_BTF = jnp.concatenate(list(out.taps[:-1]), axis=-1)  # low, mid, high
  hidden_BTD = None
  if hidden:
    scale_D, eps = target.output_norm(target_params)
    hidden_BTD = rms_norm(out.taps[-1], scale_D.astype(out.taps.dtype), eps)
  in_vocab = jnp.asarray(vocab.in_vocab)[jnp.argmax(out.logits, axis=-1)]
  return (jax.lax.stop_gradient(taps_BTF), hidden_BTD, in_vocab, out.logits)


def target_outputs(target_params, target: Target, head_cfg, vocab, tokens_BT):
  """``(taps, hidden, in_vocab)``: what ``eagle.features`` caches."""
  return _target_forward(target_params, target, head_cfg, vocab, tokens_BT,
                         hidden=True)[:3]


def target_batch(target_params, target: Target, head_cfg: HeadConfig,
                 vocab: DraftVocab, tokens_BT, loss_mask_BT) -> TTTBatch:
  """A ``TTTBatch`` with the frozen target's outputs computed on the fly."""
  taps, _, in_vocab, logits = _target_forward(target_params, target,
                                              head_cfg, vocab, tokens_BT)
  return TTTBatch(tokens=tokens_BT, taps=taps,
                  target_logits=logits[..., jnp.asarray(vocab.ids)],
                  target_in_vocab=in_vocab,
                  loss_mask=jnp.asarray(loss_mask_BT, bool))


def dense_mask(T: int, k: int) -> np.ndarray:
  """``bool[T, (k+1) T]``: query t at step k vs the keys of steps 0..k laid
  side by side -- causal on step 0, own position only on steps 1..k."""
  q = np.arange(T)[:, None]
  kv = np.arange((k + 1) * T)[None, :]
  return ((kv < T) & (kv <= q)) | ((kv >= T) & ((kv - q) % T == 0))


def _shifted(batch: TTTBatch, K: int):
  """Arrays padded at the end so step k reads ``[k + offset, k + offset + T)``;
  the target's softmax and argmax are taken once here, not once per step."""
  pad = K + 2
  padded = lambda a, fill: jnp.concatenate(
      [a, jnp.full((a.shape[0], pad) + a.shape[2:], fill, a.dtype)], axis=1)
  return dict(tokens=padded(batch.tokens, 0),
              probs=padded(jax.nn.softmax(batch.target_logits, axis=-1), 0.0),
              argmax=padded(jnp.argmax(batch.target_logits, axis=-1), 0),
              in_vocab=padded(batch.target_in_vocab, False),
              loss_mask=padded(batch.loss_mask, False))


def _step_inputs(p: dict, k, T: int):
  take = lambda a, off: jax.lax.dynamic_slice_in_dim(a, k + off, T, axis=1)
  weight = take(p["loss_mask"], 2) & take(p["in_vocab"], 1)
  return (take(p["tokens"], 1), take(p["probs"], 1), take(p["argmax"], 1),
          weight)


def loss_rows(loss_mask_BT, bucket: int = 128) -> int:
  """A static ``rows`` for ``ttt_loss``: the batch's assistant positions
  rounded up to ``bucket`` (so a run compiles a few shapes, not one per
  batch), at most B·T. Host-side: the mask is data the loop already has."""
  n = int(np.asarray(loss_mask_BT).sum())
  return min(max(-(-n // bucket), 1) * bucket, int(np.size(loss_mask_BT)))


def _compact(rows: int, w_M, *arrays_M):
  """The first ``rows`` rows with weight > 0 (the rest zero-weighted
  padding); exact whenever at most ``rows`` rows are weighted."""
  idx = jnp.nonzero(w_M > 0, size=rows, fill_value=0)[0]
  live = jnp.arange(rows) < jnp.sum(w_M > 0)
  return (jnp.where(live, w_M[idx], 0.0),) + tuple(a[idx] for a in arrays_M)


def ttt_loss(params, cfg: HeadConfig, embed_VD, batch: TTTBatch,
             num_steps: int = 7, decay: float = 0.8, fused: bool = True,
             rows: int | None = None):
  """Σ_k decay^k · loss_k over ``num_steps`` unrolled steps (``lax.scan``).

  ``fused`` computes LM head + soft CE in one custom-VJP op
  (``fused_ce``); ``False`` is plain autodiff (same values, slower on CPU).
  ``rows`` (fused only) runs the LM head on that many gathered rows instead
  of all B·T: only weighted positions (assistant tokens, ~60% of ShareGPT)
  carry loss, and the LM head is ~2/3 of a step's FLOPs. It must be at least
  the number of assistant positions (``loss_rows``) -- every step's weighted
  positions are a subset of those -- and then changes nothing but speed.
  For an EAGLE-1 head (``cfg.variant``) loss_k = SmoothL1(predicted feature,
  target feature at t + 1 + k) + 0.1 · soft CE, as in EAGLE-1's training.
  Returns ``(loss, metrics)`` with per-step ``loss``, ``acc`` and ``count``
  arrays of length ``num_steps``, and ``assistant``: the step-0 positions
  whose next token is an assistant token, counted or not (``count[0] /
  assistant`` is the draft vocabulary's coverage of the target's argmax).
  """
  call = head_call(cfg, params)
  B, T = batch.tokens.shape
  K = num_steps
  p = _shifted(batch, K)
  pos_BT = jnp.broadcast_to(jnp.arange(T), (B, T))
  causal = jnp.tril(jnp.ones((T, T), bool))[None]
  h = call("features", batch.taps)
  eagle1 = cfg.variant == "eagle1"
  if eagle1:  # regression targets: the (frozen) target features, shifted
    f = jax.lax.stop_gradient(h)
    p["features"] = jnp.concatenate(
        [f, jnp.zeros((B, K + 2) + f.shape[2:], f.dtype)], axis=1)

  def step_loss(k, out_BTD, probs, arg, weight):
    """Soft CE over Vd (+ feature regression for EAGLE-1) and accuracy,
    averaged over counted positions."""
    w = weight.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(w), 1.0)
    if fused:
      x = call("normed", out_BTD).reshape(B * T, -1)
      w_M, probs_MV, arg_M = (w.reshape(-1), probs.reshape(B * T, -1),
                              arg.reshape(-1))
      if rows is not None:
        w_M, x, probs_MV, arg_M = _compact(rows, w_M, x, probs_MV, arg_M)
      ce, hits = fused_soft_ce(x, params["lm_head"]["kernel"], probs_MV,
                               arg_M, w_M)
    else:
      logits = call("logits", out_BTD)
      ce = jnp.sum(w * -jnp.sum(probs * jax.nn.log_softmax(logits), -1))
      hits = jnp.sum(w * (jnp.argmax(logits, -1) == arg))
    loss = ce / n
    if eagle1:
      f_next = jax.lax.dynamic_slice_in_dim(p["features"], k + 1, T, axis=1)
      reg = jnp.mean(optax.huber_loss(out_BTD, f_next, delta=1.0), -1)
      loss = jnp.sum(w * reg) / n + 0.1 * loss
    return loss, hits / n, jnp.sum(w)

  tok, probs, arg, w = _step_inputs(p, 0, T)
  q, k0, v0, resid = call("project", tok, h, embed_VD, pos_BT)
  out = call("finish", resid, attend_blocks(q, [(k0, v0, causal)]))
  first = step_loss(0, out, probs, arg, w)
  if K == 1:
    stats = [jnp.stack([x]) for x in first]
  else:
    G, H = cfg.num_kv_heads, cfg.head_dim
    zeros = jnp.zeros((K - 1, B, T, G, H), k0.dtype)

    def body(carry, k):
      h, kd, vd = carry
      tok, probs, arg, w = _step_inputs(p, k, T)
      q, kk, vv, resid = call("project", tok, h, embed_VD, pos_BT + k)
      kd, vd = kd.at[k - 1].set(kk), vd.at[k - 1].set(vv)
      blocks = [(k0, v0, causal)] + [
          (kd[j], vd[j], jnp.broadcast_to(j < k, (B, T))) for j in range(K - 1)]
      out = call("finish", resid, attend_blocks(q, blocks))
      return (out, kd, vd), step_loss(k, out, probs, arg, w)

    _, rest = jax.lax.scan(body, (out, zeros, zeros), jnp.arange(1, K))
    stats = [jnp.concatenate([jnp.stack([a]), b]) for a, b in zip(first, rest)]
  losses, accs, counts = stats
  total = jnp.sum(decay ** jnp.arange(K) * losses)
  assistant = jnp.sum(jax.lax.dynamic_slice_in_dim(p["loss_mask"], 2, T, 1))
  return total, dict(loss=losses, acc=accs, count=counts, assistant=assistant)


def attend_blocks(q_BTNH, blocks) -> jax.Array:
  """Attention of queries over several key blocks with one joint softmax.

  ``blocks``: ``(k, v, mask)`` triples; ``k``/``v`` are ``[B, S, G, H]`` with
  a ``bool`` mask broadcastable to ``[B, T, S]`` (query t may see key s), or
  ``[B, T, G, H]`` with mask ``None`` marking a *diagonal* block: query t sees
  only key t of it (the TTT rule for the head's own earlier steps); a
  diagonal block may also come with a ``bool[B, T]`` validity instead.
  Scores and softmax are f32. Decoding's ``layers.attention`` over the
  keys side by side with the dense mask (``dense_mask``) computes the same
  (tests/test_eagle_ttt.py); the blocks avoid its K x T x T scores.
  """
  B, T, N, H = q_BTNH.shape
  G = blocks[0][0].shape[2]
  q = (q_BTNH.reshape(B, T, G, N // G, H) * H ** -0.5).astype(jnp.float32)
  scores, values = [], []
  for k, v, mask in blocks:
    if mask is None or mask.ndim == 2:  # diagonal block
      s = jnp.einsum("btgrh,btgh->bgrt", q, k.astype(jnp.float32))[..., None]
      if mask is not None:
        s = jnp.where(mask[:, None, None, :, None], s, -1e30)
      scores.append(s)
      values.append((v, None))
    else:
      s = jnp.einsum("btgrh,bsgh->bgrts", q, k.astype(jnp.float32))
      s = jnp.where(jnp.broadcast_to(mask, (B, T, k.shape[1]))[:, None, None],
                    s, -1e30)
      scores.append(s)
      values.append((v, k.shape[1]))
  p = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)
  out, col = 0.0, 0
  for v, width in values:
    if width is None:
      out = out + jnp.einsum("bgrt,btgh->btgrh", p[..., col],
                             v.astype(jnp.float32))
      col += 1
    else:
      out = out + jnp.einsum("bgrts,bsgh->btgrh", p[..., col:col + width],
                             v.astype(jnp.float32))
      col += width
  return out.reshape(B, T, N, H).astype(q_BTNH.dtype)


def medusa_loss(params, cfg: HeadConfig, batch: TTTBatch, decay: float = 0.8,
                rows: int | None = None):
  """Σ_k decay^k · loss_k over a Medusa head's depths, with TTT's alignment:
  depth k at position t scores token t + 2 + k, which is TTT step k's target
  at t (``_step_inputs``), counted under the same rule. All depths read the
  target's hidden state at t (no recurrence, no attention). ``rows`` as in
  ``ttt_loss``. Returns ``(loss, metrics)`` shaped as ``ttt_loss``'s, one
  entry per depth."""
  call = head_call(cfg, params)
  B, T = batch.tokens.shape
  K = cfg.medusa_heads
  p = _shifted(batch, K)
  out_BTKD = call("outputs", call("features", batch.taps))
  stats = []
  for k in range(K):
    _, probs, arg, weight = _step_inputs(p, k, T)
    w_M = weight.astype(jnp.float32).reshape(-1)
    x_MD = out_BTKD[:, :, k].reshape(B * T, -1)
    probs_MV, arg_M = probs.reshape(B * T, -1), arg.reshape(-1)
    if rows is not None:
      w_M, x_MD, probs_MV, arg_M = _compact(rows, w_M, x_MD, probs_MV, arg_M)
    ce, hits = fused_soft_ce(x_MD, params["lm_head"]["kernel"], probs_MV,
                             arg_M, w_M)
    n = jnp.maximum(jnp.sum(w_M), 1.0)
    stats.append((ce / n, hits / n, jnp.sum(w_M)))
  losses, accs, counts = (jnp.stack(x) for x in zip(*stats))
  total = jnp.sum(decay ** jnp.arange(K) * losses)
  assistant = jnp.sum(jax.lax.dynamic_slice_in_dim(p["loss_mask"], 2, T, 1))
  return total, dict(loss=losses, acc=accs, count=counts, assistant=assistant)


@struct.dataclass
class CodLayout:
  """P-EAGLE's training sequence per row: depth 0 at every position, then
  each depth's anchors (COD-sampled), all packed into one sequence of E.

  Attributes:
    anchor: ``int32[B, E]`` the position t each entry drafts after.
    depth: ``int32[E]`` its depth d (0: the pair (x[t + 1], taps[t]); d >= 1:
      a placeholder at position t + d, drafting x[t + 2 + d]).
    mask: ``bool[B, E, E]`` which entries each sees: depth 0 up to its own
      anchor, and its own chain's depths 1..d.
  """
  anchor: jax.Array
  depth: jax.Array
  mask: jax.Array


def cod_count(T: int, ratio: float, depth: int) -> int:
  """Anchors a row keeps at ``depth``: ceil(T · ratio^depth), at least 1."""
  return max(1, math.ceil(T * ratio ** depth))


def cod_layout(key, B: int, T: int, num_depths: int, ratio: float,
               priority_BT: jax.Array | None = None) -> CodLayout:
  """COD sampling (PARD's): depth 0 keeps every position, depth d a random
  ``cod_count`` of them, each depth's anchors among the depth before's (a
  row's one random order, cut shorter at each depth), so every entry's
  chain below it is in the sequence. With ``priority_BT``, the order puts
  higher priorities first (random among equals): the loss gives it the
  depths each anchor is counted at, so the few deep entries are ones that
  count."""
  order_BT = jnp.argsort(jax.random.uniform(key, (B, T)) - (
      0 if priority_BT is None else priority_BT), axis=1)
  counts = [cod_count(T, ratio, d) for d in range(1, num_depths)]
  anchor_BE = jnp.concatenate(
      [jnp.broadcast_to(jnp.arange(T), (B, T))]
      + [order_BT[:, :n] for n in counts], axis=1).astype(jnp.int32)
  depth_E = jnp.asarray(np.repeat(np.arange(num_depths), [T] + counts),
                        jnp.int32)
  a_q, a_k = anchor_BE[:, :, None], anchor_BE[:, None, :]
  d_q, d_k = depth_E[None, :, None], depth_E[None, None, :]
  mask_BEE = (((d_k == 0) & (a_k <= a_q))
              | ((a_k == a_q) & (d_k >= 1) & (d_k <= d_q)))
  return CodLayout(anchor=anchor_BE, depth=depth_E, mask=mask_BEE)


def _counted(p: dict, step_BN) -> jax.Array:
  """``bool[B, N]``: whether TTT step d at anchor t (``step_BN`` = t + d,
  into ``_shifted``'s arrays) counts: x[t + 2 + d] an assistant token and
  the target's argmax at t + 1 + d in the draft vocabulary."""
  at = lambda a, off: jnp.take_along_axis(a, step_BN + off, axis=1)
  return at(p["loss_mask"], 2) & at(p["in_vocab"], 1)


def counted_depths(p: dict, T: int, num_depths: int) -> jax.Array:
  """``int32[B, T]``: at how many depths d < ``num_depths`` the entry
  anchored at t counts (``_counted``)."""
  B = p["loss_mask"].shape[0]
  t_BT = jnp.broadcast_to(jnp.arange(T), (B, T))
  return sum(_counted(p, t_BT + d).astype(jnp.int32)
             for d in range(num_depths))


def peagle_outputs(params, cfg: HeadConfig, embed_VD, batch: TTTBatch,
                   lay: CodLayout) -> jax.Array:
  """The head's output at every entry of ``lay`` (``[B, E, D]``), one
  forward: entry (t, 0) is the pair (x[t + 1], taps[t]) at position t,
  entry (t, d) the placeholder with ``mask_hidden`` at t + d."""
  call = head_call(cfg, params)
  T = batch.tokens.shape[1]
  tokens = jnp.concatenate([batch.tokens[:, 1:], batch.tokens[:, -1:]], 1)
  tok_BE = jnp.concatenate([tokens, jnp.full(
      (tokens.shape[0], lay.depth.shape[0] - T), cfg.mask_token,
      jnp.int32)], axis=1)
  h_BED = jnp.concatenate([call("features", batch.taps), call(
      "placeholders", tok_BE[:, T:])], axis=1)
  q, k, v, resid = call("project", tok_BE, h_BED, embed_VD,
                        lay.anchor + lay.depth[None])
  return call("finish", resid, attend_blocks(q, [(k, v, lay.mask)]))


def peagle_loss(params, cfg: HeadConfig, embed_VD, batch: TTTBatch,
                num_depths: int, key, ratio: float = 0.5,
                rows: int | None = None):
  """A P-EAGLE head's loss: every depth of a COD-sampled layout
  (``cod_layout``, anchors counted at more depths drawn first) in one
  forward, soft CE against the target over Vd, counted as ``ttt_loss``'s
  steps are (entry (t, d) scores x[t + 2 + d] under TTT step d's rule),
  summed over every counted entry and divided by their count (no per-depth
  decay). ``rows`` compacts depth 0's LM head as in ``ttt_loss``. Returns
  ``(loss, metrics)`` shaped as ``ttt_loss``'s, one entry per depth."""
  call = head_call(cfg, params)
  B, T = batch.tokens.shape
  p = _shifted(batch, num_depths)
  lay = cod_layout(key, B, T, num_depths, ratio,
                   priority_BT=counted_depths(p, T, num_depths))
  step_BE = lay.anchor + lay.depth[None]  # entry (t, d) is TTT step d at t
  at = lambda a, off: jnp.take_along_axis(
      a, (step_BE + off).reshape(step_BE.shape + (1,) * (a.ndim - 2)),
      axis=1)
  w_BE = _counted(p, step_BE)
  x_BED = call("normed", peagle_outputs(params, cfg, embed_VD, batch, lay))
  sizes = [T] + [cod_count(T, ratio, d) for d in range(1, num_depths)]
  stats, start = [], 0
  for n in sizes:
    sl = lambda a: jax.lax.slice_in_dim(a, start, start + n, axis=1)
    w_M = sl(w_BE).astype(jnp.float32).reshape(-1)
    x_MD = sl(x_BED).reshape(B * n, -1)
    probs_MV = sl(at(p["probs"], 1)).reshape(B * n, -1)
    arg_M = sl(at(p["argmax"], 1)).reshape(-1)
    if start == 0 and rows is not None:
      w_M, x_MD, probs_MV, arg_M = _compact(rows, w_M, x_MD, probs_MV, arg_M)
    ce, hits = fused_soft_ce(x_MD, params["lm_head"]["kernel"], probs_MV,
                             arg_M, w_M)
    stats.append((ce, hits, jnp.sum(w_M)))
    start += n
  ces, hits, counts = (jnp.stack(x) for x in zip(*stats))
  per = jnp.maximum(counts, 1.0)
  total = jnp.sum(ces) / jnp.maximum(jnp.sum(counts), 1.0)
  assistant = jnp.sum(jax.lax.dynamic_slice_in_dim(p["loss_mask"], 2, T, 1))
  return total, dict(loss=ces / per, acc=hits / per, count=counts,
                     assistant=assistant)


def head_loss(params, cfg: HeadConfig, embed_VD, batch: TTTBatch,
              num_steps: int, rows: int | None = None, key=None,
              cod_ratio: float = 0.5):
  """The loss a head of ``cfg.variant`` trains on: ``ttt_loss`` over
  ``num_steps`` unrolled steps for EAGLE heads, ``medusa_loss`` (its own
  depth count) for Medusa heads, ``peagle_loss`` over ``num_steps`` depths
  (COD-sampled with ``key`` and ``cod_ratio``) for P-EAGLE heads."""
  if cfg.variant == "medusa":
    return medusa_loss(params, cfg, batch, rows=rows)
  if cfg.variant == "peagle":
    return peagle_loss(params, cfg, embed_VD, batch, num_steps, key,
                       cod_ratio, rows=rows)
  return ttt_loss(params, cfg, embed_VD, batch, num_steps, rows=rows)
