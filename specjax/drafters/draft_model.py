"""A separate (smaller) Llama-family model that shares the target's tokenizer.

The drafter keeps its own KV cache with the target's invariant: it holds
``num_tokens - 2`` or more committed entries. Each ``propose`` first re-feeds
the row's last two committed tokens at their positions (after verification the
drafter may lag by up to two tokens: the last accepted draft it never fed and
the correction/bonus token), which yields the first draft distribution; K - 1
single-token forwards follow, each sampling from the *warped* draft
distribution (the same ``sampling.warp`` the target uses). ``commit`` rolls
the cache back to the committed prefix by lengths.
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
  """
  config: ModelConfig

  def init(self, params, prompt_BT, prompt_lengths_B, capacity):
    cache = llama.init_cache(self.config, prompt_BT.shape[0], capacity,
                             params.embed.dtype)
    return llama.forward(params, self.config, prompt_BT, cache,
                         logit_positions_BP=jnp.zeros_like(prompt_BT[:, :1])
                         ).cache.with_lengths(prompt_lengths_B - 1)

  def commit(self, params, cache, tokens_BS, num_tokens_B):
    del params, tokens_BS
    # Roll back to entries that certainly match committed tokens: everything
    # before the newest two (the accepted drafts it fed are among them).
    return cache.with_lengths(num_tokens_B - 2)

  def propose(self, params, cache, tokens_BS, num_tokens_B, key, num_draft,
              sampling) -> Proposal:
    B = tokens_BS.shape[0]
    rows = jnp.arange(B)
    start_B = jnp.maximum(num_tokens_B - 2, 0)
    pair_B2 = jnp.stack([tokens_BS[rows, start_B],
                         tokens_BS[rows, num_tokens_B - 1]], axis=1)
    out = llama.forward(params, self.config, pair_B2,
                        cache.with_lengths(start_B))
    keys = jax.random.split(key, num_draft)
    probs = warp(out.logits[:, 1], sampling)
    tok = _draw(probs, keys[0], sampling)
    cache = out.cache

    def body(carry, k):
      cache, tok = carry
      o = llama.forward(params, self.config, tok[:, None], cache)
      p = warp(o.logits[:, 0], sampling)
      nxt = _draw(p, k, sampling)
      return (o.cache, nxt), (nxt, p)

    (cache, _), (rest_KB, rest_probs_KBV) = jax.lax.scan(
        body, (cache, tok), keys[1:])
    drafts_BK = jnp.concatenate([tok[:, None], rest_KB.T], axis=1)
    probs_BKV = jnp.concatenate(
        [probs[:, None], jnp.swapaxes(rest_probs_KBV, 0, 1)], axis=1)
    return Proposal(tokens=drafts_BK, probs=probs_BKV,
                    num_draft=jnp.full((B,), num_draft, jnp.int32),
                    state=cache)


def _draw(probs_BV, key, sampling):
  if sampling.greedy:
    return jnp.argmax(probs_BV, axis=-1).astype(jnp.int32)
  return sample(probs_BV, key)
