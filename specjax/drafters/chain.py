"""The chain draft loop every model-based drafter runs (draft model,
layer-skip, EAGLE): draw a draft from the warped distribution, feed it back,
repeat up to K times in one ``lax.while_loop`` that ends early once no row
drafts any more.

Dynamic K (``min_confidence > 0``): a row stops drafting at the first
position where the drafter's top probability (softmax of its raw logits, so
the rule reads the same at every temperature) is below the threshold. The
rule looks at the distribution, never at the token drawn from it: whether
position i is drafted must not depend on the draft itself, or the accepted
tokens would be biased toward confident drafts and the output would no
longer follow the target (a stopping rule may only use what is known before
drawing).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from specjax.core.sampling import Sampler, as_sampler, draw, split, warp


def keep_drafting(logits_BV, probs_BV, tok_B, min_confidence):
  """Dynamic K: may this row propose the draft at this position? Reads the
  draft distribution only; the drawn token is an argument so the mutation
  test can swap in the biased rule that looks at it."""
  del probs_BV, tok_B
  return jnp.max(jax.nn.softmax(logits_BV), axis=-1) >= min_confidence


def draft_chain(first_logits_BV: jax.Array,
                step: Callable[[jax.Array, Any], tuple[jax.Array, Any]],
                carry: Any, key: jax.Array, num_draft: int,
                sampling: Sampler, min_confidence: float):
  """Up to ``num_draft`` = K drafts per row.

  Args:
    first_logits_BV: the drafter's logits for the first draft (full vocab;
      -inf outside a draft vocabulary).
    step: ``(tok_B, carry) -> (logits_BV, carry)``: feeds the last draft,
      gives the next position's logits.
    carry: the drafter's loop state (its cache, features).
    sampling: the engine's ``Sampler``; draft i is warped with the drafts
      before it in its history (the penalties a sequential decoder would
      apply there).

  Returns:
    ``(drafts [B, K], probs [B, K, V], num_draft [B], carry)``: the warped
    distributions the drafts were drawn from, each row's drafts before its
    first unconfident position, and the loop state after the last step.
  """
  B, V = first_logits_BV.shape
  K = num_draft
  keys = split(key, K)
  sampling = as_sampler(sampling)

  def emit(i, logits_BV, record):
    """Draws draft i and records it for the rows still drafting."""
    drafts_BK, probs_BKV, num_B, active_B, sampler = record
    p_BV = warp(logits_BV, sampler)
    tok_B = draw(p_BV, sampler, keys[i])
    # A distribution with no mass (every token the allowed-token hook lets
    # through is outside a draft vocabulary): nothing to draft from.
    active_B &= (keep_drafting(logits_BV, p_BV, tok_B, min_confidence)
                 & jnp.any(p_BV > 0, axis=-1))
    drafts_BK = drafts_BK.at[:, i].set(jnp.where(active_B, tok_B, 0))
    probs_BKV = jax.lax.dynamic_update_slice_in_dim(
        probs_BKV, p_BV[:, None], i, axis=1)
    return tok_B, (drafts_BK, probs_BKV, num_B + active_B, active_B,
                   sampler.advance(tok_B, active_B))

  record = (jnp.zeros((B, K), jnp.int32), jnp.zeros((B, K, V), jnp.float32),
            jnp.zeros((B,), jnp.int32), jnp.ones((B,), bool), sampling)
  tok_B, record = emit(0, first_logits_BV, record)

  def more(loop):
    i, _, _, (_, _, _, active_B, _) = loop
    return (i < K) & jnp.any(active_B)

  def body(loop):
    # A while_loop, not a scan: with dynamic K most steps end after one
    # draft, and the remaining K - 1 are not paid for.
    i, carry, tok_B, record = loop
    logits_BV, carry = step(tok_B, carry)
    tok_B, record = emit(i, logits_BV, record)
    return i + 1, carry, tok_B, record

  _, carry, _, (drafts_BK, probs_BKV, num_B, _, _) = jax.lax.while_loop(
      more, body, (jnp.int32(1), carry, tok_B, record))
  return drafts_BK, probs_BKV, num_B, carry
