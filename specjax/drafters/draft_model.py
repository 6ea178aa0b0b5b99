"""A separate (smaller) Llama-family model that shares the target's tokenizer.

The drafter keeps its own KV cache with the target's invariant: it holds
``num_tokens - 2`` or more committed entries. Each ``propose`` first re-feeds
the row's last two committed tokens at their positions (after verification the
drafter may lag by up to two tokens: the last accepted draft it never fed and
the correction/bonus token), which yields the first draft distribution; up to
K - 1 single-token forwards follow, each sampling from the *warped* draft
distribution (the same ``sampling.warp`` the target uses). ``commit`` rolls
the cache back to the committed prefix by lengths.

Dynamic K: with ``min_confidence > 0`` a row stops drafting at the first
position where the draft model's top probability (softmax of its raw logits,
so the rule reads the same at every temperature) is below the threshold,
and the draft loop exits early once every row has stopped. The rule looks at
the distribution, never at the token drawn from it: whether position i is
drafted must not depend on the draft itself, or the accepted tokens would be
biased toward confident drafts and the output would no longer follow the
target (a stopping rule may only use what is known before drawing). The
verify forward keeps its fixed ``[B, K + 1]`` shape; the saving is in draft
forwards and in drafts that would most likely be rejected.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.drafters.base import Proposal
from specjax.models import llama
from specjax.models.config import ModelConfig
from specjax.sampling import sample, warp


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter:
  """Drafts with ``config``'s model; its ``LlamaParams`` are the drafter params.

  Attributes:
    config: the draft model's static config (vocab must match the target's).
    min_confidence: dynamic K threshold on the draft model's top probability
      (0 = always draft K).
  """
  config: ModelConfig
  min_confidence: float = 0.0

  def __post_init__(self):
    if not 0.0 <= self.min_confidence < 1.0:
      raise ValueError(f"min_confidence must be in [0, 1), got "
                       f"{self.min_confidence}")

  def draft_params(self, params):
    """The draft model's parameters inside the drafter params."""
    return params

  def init(self, params, prompt_BT, prompt_lengths_B, capacity,
           features=None):
    del features
    params = self.draft_params(params)
    cache = llama.init_cache(self.config, prompt_BT.shape[0], capacity,
                             params.embed.dtype)
    return llama.forward(params, self.config, prompt_BT, cache,
                         logit_positions_BP=jnp.zeros_like(prompt_BT[:, :1])
                         ).cache.with_lengths(prompt_lengths_B - 1)

  def commit(self, params, cache, tokens_BS, num_tokens_B, features=None):
    del params, tokens_BS, features
    # Roll back to entries that certainly match committed tokens: everything
    # before the newest two (the accepted drafts it fed are among them).
    return cache.with_lengths(num_tokens_B - 2)

  def propose(self, params, cache, tokens_BS, num_tokens_B, key, num_draft,
              sampling) -> Proposal:
    params = self.draft_params(params)
    B, K, V = tokens_BS.shape[0], num_draft, self.config.vocab_size
    rows = jnp.arange(B)
    start_B = jnp.maximum(num_tokens_B - 2, 0)
    pair_B2 = jnp.stack([tokens_BS[rows, start_B],
                         tokens_BS[rows, num_tokens_B - 1]], axis=1)
    out = llama.forward(params, self.config, pair_B2,
                        cache.with_lengths(start_B))
    keys = jax.random.split(key, K)

    def emit(i, logits_BV, carry):
      """Draws draft i from the logits and records it for rows still on."""
      drafts_BK, probs_BKV, num_B, active_B = carry
      p_BV = warp(logits_BV, sampling)
      tok_B = _draw(p_BV, keys[i], sampling)
      active_B &= _keep_drafting(logits_BV, p_BV, tok_B, self.min_confidence)
      drafts_BK = drafts_BK.at[:, i].set(jnp.where(active_B, tok_B, 0))
      probs_BKV = jax.lax.dynamic_update_slice_in_dim(
          probs_BKV, p_BV[:, None], i, axis=1)
      return tok_B, (drafts_BK, probs_BKV, num_B + active_B, active_B)

    record = (jnp.zeros((B, K), jnp.int32), jnp.zeros((B, K, V), jnp.float32),
              jnp.zeros((B,), jnp.int32), jnp.ones((B,), bool))
    tok_B, record = emit(0, out.logits[:, 1], record)

    def body(carry):
      i, cache, tok_B, record = carry
      o = llama.forward(params, self.config, tok_B[:, None], cache)
      tok_B, record = emit(i, o.logits[:, 0], record)
      return i + 1, o.cache, tok_B, record

    def more(carry):
      i, _, _, (_, _, _, active_B) = carry
      return (i < K) & jnp.any(active_B)

    _, cache, _, (drafts_BK, probs_BKV, num_B, _) = jax.lax.while_loop(
        more, body, (jnp.int32(1), out.cache, tok_B, record))
    return Proposal(tokens=drafts_BK, probs=probs_BKV, num_draft=num_B,
                    state=cache)


@dataclasses.dataclass(frozen=True)
class LayerSkipDrafter(DraftModelDrafter):
  """Self-drafting: the target's first ``config.num_layers`` layers, then its
  final norm and LM head. The drafter params are the target's own params
  (nothing is copied: the first layers are picked from the per-layer tuple).
  Build it with ``LayerSkipDrafter.from_target``.
  """

  @classmethod
  def from_target(cls, target: ModelConfig, num_layers: int,
                  min_confidence: float = 0.0) -> "LayerSkipDrafter":
    if not 1 <= num_layers < target.num_layers:
      raise ValueError(f"layer-skip needs 1 <= layers < {target.num_layers} "
                       f"(the target's depth), got {num_layers}")
    return cls(dataclasses.replace(target, num_layers=num_layers,
                                   name=f"{target.name}[:{num_layers}]"),
               min_confidence)

  def draft_params(self, params):
    return params.replace(layers=params.layers[:self.config.num_layers])


def _keep_drafting(logits_BV, probs_BV, tok_B, min_confidence):
  """Dynamic K: may this row propose the draft at this position? Reads the
  draft distribution only (see module doc); the drawn token is an argument
  so the mutation test can swap in the biased rule that looks at it."""
  del probs_BV, tok_B
  return jnp.max(jax.nn.softmax(logits_BV), axis=-1) >= min_confidence


def _draw(probs_BV, key, sampling):
  if sampling.greedy:
    return jnp.argmax(probs_BV, axis=-1).astype(jnp.int32)
  return sample(probs_BV, key)
