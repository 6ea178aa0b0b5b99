"""Exact chain verification: Leviathan et al. rejection sampling, vectorized
over a batch whose rows draft different numbers of tokens (ragged).

Given K drafted tokens per row, their draft distributions p and the target's
distributions q at the K + 1 positions (the last one is the bonus position),
row b emits its longest accepted prefix plus one token: at the first rejection
a sample of norm(max(q - p, 0)); if all ``num_draft[b]`` drafts are accepted,
a bonus sample of q at position ``num_draft[b]``. Each emitted token is then
distributed exactly as the target's (Leviathan, Kalman & Matias 2023, Thm 1).

p and q must come from the same ``sampling.warp`` (same temperature, top-k,
top-p). All math is f32. Degenerate cases: a draft with p = 0 where q > 0 is
accepted (ratio infinite); a draft with q = 0 (e.g. cut by top-k) is always
rejected; a residual with no mass (q <= p everywhere, possible only through
rounding) falls back to q.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

from specjax.core.rows import at_rows
from specjax.core.sampling import sample, split, uniform


@struct.dataclass
class ChainResult:
  """Output of ``verify_chain``.

  Attributes:
    tokens: ``int32[B, K + 1]``, row b's first ``num_emitted[b]`` entries are
      emitted (accepted drafts, then the correction or bonus); the rest is 0.
    num_emitted: ``int32[B]`` = accepted + 1, in ``[1, num_draft + 1]``.
    num_accepted: ``int32[B]``.
  """
  tokens: jax.Array
  num_emitted: jax.Array
  num_accepted: jax.Array


def _accept(u, p_draft, q_draft):
  """u < q/p without dividing: p = 0 < q accepts, q = 0 always rejects."""
  return u * p_draft < q_draft


def _residual(q_BV, p_BV):
  """norm(max(q - p, 0)); q itself when that has no mass."""
  residual = jnp.maximum(q_BV - p_BV, 0.0)
  mass = jnp.sum(residual, axis=-1, keepdims=True)
  return jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), q_BV)


def _draft_targets(q_BK1V, K):
  """The target's distribution each draft is verified against: position i
  for draft i."""
  return q_BK1V[:, :K]


def _extra_target(q_BK1V, num_acc_B):
  """The target's distribution the one extra token comes from: at position
  ``num_acc`` (the bonus position ``num_draft`` when all were accepted)."""
  return at_rows(q_BK1V, num_acc_B)


def verify_chain(draft_BK: jax.Array, draft_probs_BKV: Optional[jax.Array],
                 target_probs_BK1V: jax.Array, num_draft_B: jax.Array,
                 key: jax.Array, *, greedy: bool = False) -> ChainResult:
  """Verifies K drafts per row against the target in one vectorized pass.

  Args:
    draft_BK: ``int32[B, K]`` drafted tokens (entries past ``num_draft`` are
      ignored).
    draft_probs_BKV: ``[B, K, V]`` the distributions the drafts were sampled
      from, or None for a deterministic drafter (p = one-hot of the draft).
    target_probs_BK1V: ``[B, K + 1, V]`` warped target distributions; position
      i is the target's distribution for draft i, position K the bonus.
    num_draft_B: ``int32[B]`` drafts per row, each in ``[0, K]``.
    key: PRNG key, or one per row (``key[B]``: row b's draws from key[b]
      alone); split internally for acceptance and correction draws.
    greedy: temperature-0 rule: accept iff the draft is the target's argmax,
      correct/bonus with the argmax. No randomness is used.

  Returns:
    ``ChainResult``.
  """
  B, K = draft_BK.shape
  q = target_probs_BK1V.astype(jnp.float32)
  draft_BK = draft_BK.astype(jnp.int32)
  q_drafts_BKV = _draft_targets(q, K)
  q_draft_BK = jnp.take_along_axis(q_drafts_BKV, draft_BK[..., None],
                                   -1)[..., 0]
  valid_BK = jnp.arange(K)[None, :] < num_draft_B[:, None]
  key_accept, key_fix = split(key)

  if greedy:
    accept_BK = draft_BK == jnp.argmax(q_drafts_BKV, axis=-1)
  else:
    if draft_probs_BKV is None:
      p_draft_BK = jnp.ones((B, K), jnp.float32)
    else:
      p_draft_BK = jnp.take_along_axis(
          draft_probs_BKV.astype(jnp.float32), draft_BK[..., None], -1)[..., 0]
    accept_BK = _accept(uniform(key_accept, (B, K)), p_draft_BK,
                        q_draft_BK)
  # Length of the accepted prefix among the row's valid drafts.
  num_acc_B = jnp.sum(jnp.cumprod(accept_BK & valid_BK, axis=1), axis=1)
  num_acc_B = num_acc_B.astype(jnp.int32)

  # Distribution of the one extra token, at position num_acc.
  q_fix_BV = _extra_target(q, num_acc_B)
  rejected_B = num_acc_B < num_draft_B
  if greedy:
    extra_B = jnp.argmax(q_fix_BV, axis=-1).astype(jnp.int32)
  else:
    pos_B = jnp.minimum(num_acc_B, max(K - 1, 0))
    if K == 0:  # nothing drafted: only the bonus, p is never used
      p_fix_BV = jnp.zeros_like(q_fix_BV)
    elif draft_probs_BKV is None:
      p_fix_BV = jax.nn.one_hot(at_rows(draft_BK, pos_B), q.shape[-1],
                                dtype=jnp.float32)
    else:
      p_fix_BV = at_rows(draft_probs_BKV.astype(jnp.float32), pos_B)
    extra_BV = jnp.where(rejected_B[:, None], _residual(q_fix_BV, p_fix_BV),
                         q_fix_BV)
    extra_B = sample(extra_BV, key_fix)

  idx_BK1 = jnp.arange(K + 1)[None, :]
  padded_BK1 = jnp.concatenate([draft_BK, jnp.zeros((B, 1), jnp.int32)], 1)
  tokens_BK1 = jnp.where(idx_BK1 < num_acc_B[:, None], padded_BK1, 0)
  tokens_BK1 = jnp.where(idx_BK1 == num_acc_B[:, None], extra_B[:, None],
                         tokens_BK1)
  return ChainResult(tokens=tokens_BK1, num_emitted=num_acc_B + 1,
                     num_accepted=num_acc_B)
