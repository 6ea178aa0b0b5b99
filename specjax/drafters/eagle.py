"""EAGLE chain drafting inside the engine (EAGLE-3 heads, and EAGLE-1 ones).

The head consumes pairs (target feature at position t, token t + 1). Its
"stable" KV cache holds one entry per committed pair; it lags the target:
after a step that committed n tokens, pairs t < n - 1 - c are in the cache
and the last c pairs (c = accepted + 1) are *pending*: their target features
came with the verify forward (``commit(features=...)``, kept as
``pending [B, K + 1, F]``) and their tokens are committed tokens.

``propose`` runs the pending pairs through the head as one padded block of
K + 1 (ragged c per row), takes the head output at each row's last valid pair
and drafts K tokens, feeding its own outputs back as features (the scratch
entries it writes past the stable length are overwritten next time). Draft
probabilities are the head's warped distribution over Vd scattered into the
full vocabulary (zero elsewhere), so verification stays exact.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from specjax.cache import KVCache, write_kv
from specjax.drafters.base import Proposal
from specjax.drafters.chain import draft_chain
from specjax.heads.eagle import HeadConfig, head_module
from specjax.models import llama


@struct.dataclass
class EagleParams:
  """Drafter params: the head's, the draft vocabulary and the frozen embedding.

  Attributes:
    head: the head's parameter dict (``Eagle3Head`` or ``Eagle1Head``).
    draft_ids: ``int32[Vd]`` target id of each draft index.
    embed: ``[V, D]`` the target's token embedding (shared, not copied).
  """
  head: Any
  draft_ids: jax.Array
  embed: jax.Array


@struct.dataclass
class EagleState:
  """Attributes:
    cache: the head's one-layer ``KVCache`` (the target's layout and code);
      its lengths count the stable (committed-pair) entries.
    pending: ``[B, K + 1, F]`` target features of the last verified block.
  """
  cache: KVCache
  pending: jax.Array

  @property
  def lengths(self) -> jax.Array:
    return self.cache.lengths

  def with_lengths(self, lengths_B: jax.Array) -> "EagleState":
    return self.replace(cache=self.cache.with_lengths(lengths_B))


@dataclasses.dataclass(frozen=True)
class EagleDrafter:
  """Chain drafting with an EAGLE-3 head (``cfg``). ``init`` sizes the
  pending-feature buffer to ``K + 1`` rows for the K it is given, so the
  decode loop's state keeps its shape; ``propose`` checks it is asked for
  that K.

  ``min_confidence`` > 0 gives dynamic K: a row's chain ends before the first
  draft whose head distribution (over Vd, before temperature) has its top
  probability below the threshold. The rule reads distributions, never the
  drawn token, so verification stays exact; a step where no row drafts costs
  one single-token target forward (``engine.step``).
  """
  cfg: HeadConfig
  min_confidence: float = 0.0

  @property
  def feature_taps(self) -> tuple[int, ...]:
    return self.cfg.taps

  def _call(self, params: EagleParams, method, *args):
    return head_module(self.cfg).apply({"params": params.head}, *args,
                                       method=method)

  def _run(self, params, state: EagleState, tok_BT, h_BTD):
    """Head layer over T new pairs written at each row's cache end, on the
    target's attention code (prefix + causal). Pairs past a row's valid
    count are harmless: causality hides them from the valid ones, and the
    next write starts at the row's stable length."""
    B, T = tok_BT.shape
    c, cache = self.cfg, state.cache
    slots_BT = cache.new_slots(T)
    q, k, v, resid = self._call(params, "project", tok_BT, h_BTD,
                                params.embed, slots_BT)
    kc, vc = write_kv(cache.k[0], cache.v[0], k, v, slots_BT)
    mask_BQS = llama.query_mask(cache.lengths, llama.causal_mask(B, T),
                                cache.capacity, c.num_heads // c.num_kv_heads)
    out = self._call(params, "finish", resid,
                     llama.attention(q, kc, vc, mask_BQS))
    return out, state.replace(cache=cache.replace(k=(kc,), v=(vc,)))

  def init(self, params: EagleParams, prompt_BT, prompt_lengths_B, capacity,
           num_draft, features=None):
    """Pairs (g_t, x_{t+1}) for t < len - 1 go in the cache; the last
    prompt position's feature is pending (its token is the first sample)."""
    B, Tp = prompt_BT.shape
    c = self.cfg
    state = EagleState(cache=KVCache.init(1, B, capacity, c.num_kv_heads,
                                          c.head_dim, params.embed.dtype),
                       pending=None)
    h = self._call(params, "features", features)
    nxt = jnp.concatenate([prompt_BT[:, 1:], prompt_BT[:, -1:]], axis=1)
    _, state = self._run(params, state, nxt, h)
    last = jnp.take_along_axis(
        features, (prompt_lengths_B - 1)[:, None, None], axis=1)  # [B,1,F]
    pending = jnp.concatenate(
        [last, jnp.zeros((B, num_draft) + last.shape[2:], last.dtype)],
        axis=1)
    return state.with_lengths(prompt_lengths_B - 1).replace(pending=pending)

  def commit(self, params, state: EagleState, tokens_BS, num_tokens_B,
             features=None):
    del params, tokens_BS, num_tokens_B
    return state.replace(pending=features.astype(state.pending.dtype))

  def propose(self, params: EagleParams, state: EagleState, tokens_BS,
              num_tokens_B, key, num_draft, sampling) -> Proposal:
    if state.pending.shape[1] != num_draft + 1:
      raise ValueError(f"EagleDrafter state made for K="
                       f"{state.pending.shape[1] - 1}, asked for {num_draft}")
    B, S = tokens_BS.shape
    K, V = num_draft, params.embed.shape[0]
    pending = state.pending
    P = pending.shape[1]  # K + 1 (after the prefill only row 0 is real)
    # Pending pairs: (g_t, x_{t+1}) for t = lengths .. num_tokens - 2.
    count_B = num_tokens_B - 1 - state.lengths
    idx_BP = jnp.clip(state.lengths[:, None] + 1 + jnp.arange(P)[None, :], 0,
                      S - 1)
    tok_BP = jnp.take_along_axis(tokens_BS, idx_BP, axis=1)
    h_BPD = self._call(params, "features", pending)
    out_BPD, state = self._run(params, state, tok_BP, h_BPD)
    stable_B = state.lengths + count_B  # == num_tokens - 1
    a_BD = jnp.take_along_axis(out_BPD, (count_B - 1)[:, None, None],
                               axis=1)[:, 0]

    def logits(a_BD):
      """Head output -> logits over the full vocabulary (-inf off Vd)."""
      logits_BVd = self._call(params, "logits", a_BD[:, None])[:, 0]
      return jnp.full((B, V), -jnp.inf, jnp.float32).at[
          :, params.draft_ids].set(logits_BVd)

    def step(tok_B, carry):
      st, a_BD = carry
      out, st = self._run(params, st, tok_B[:, None], a_BD[:, None])
      return logits(out[:, 0]), (st.with_lengths(st.lengths + 1), out[:, 0])

    scratch = state.with_lengths(stable_B)  # draft entries: overwritten
    drafts_BK, probs_BKV, num_B, _ = draft_chain(
        logits(a_BD), step, (scratch, a_BD), key, K, sampling,
        self.min_confidence)
    return Proposal(tokens=drafts_BK, probs=probs_BKV, num_draft=num_B,
                    state=state.with_lengths(stable_B))
