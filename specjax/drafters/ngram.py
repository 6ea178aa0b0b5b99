"""N-gram prompt lookup: copy what followed the last occurrence of the suffix.

For each row, the longest suffix n-gram (n from ``n_max`` down to ``n_min``)
that occurred earlier in the row's prompt + generated tokens is located (most
recent occurrence wins) and the up-to-K tokens that followed it are proposed.
Rows with no match, or whose match is followed by fewer than K committed
tokens, draft fewer (ragged ``num_draft``, possibly 0). Fully jitted: one
``[B, S]`` comparison per n, no host work. Deterministic (p = one-hot).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.drafters.base import Proposal, Stateless


@dataclasses.dataclass(frozen=True)
class NGramDrafter(Stateless):
  n_max: int = 3
  n_min: int = 1

  def __post_init__(self):
    if not 1 <= self.n_min <= self.n_max:
      raise ValueError(f"need 1 <= n_min <= n_max, got {self.n_min}, "
                       f"{self.n_max}")

  def propose(self, params, state, tokens_BS, num_tokens_B, key, num_draft,
              sampling) -> Proposal:
    del params, key, sampling
    B, S = tokens_BS.shape
    K = num_draft
    rows = jnp.arange(B)
    starts_S = jnp.arange(S)
    best_start = jnp.full((B,), -1, jnp.int32)  # where the continuation begins
    for n in range(self.n_min, self.n_max + 1):  # longer n overwrite shorter
      # Window j matches iff tokens[j + i] == suffix[i] for i < n, and it ends
      # before the suffix starts (so a continuation token exists).
      match_BS = (starts_S[None, :] + n < num_tokens_B[:, None]) & (
          num_tokens_B[:, None] >= n + 1)
      for i in range(n):
        suffix_B = tokens_BS[rows, jnp.maximum(num_tokens_B - n + i, 0)]
        window_BS = jnp.roll(tokens_BS, -i, axis=1)
        match_BS &= window_BS == suffix_B[:, None]
      last_BS = jnp.where(match_BS, starts_S[None, :], -1)
      found_B = jnp.max(last_BS, axis=1)
      best_start = jnp.where(found_B >= 0, found_B + n, best_start)
    avail_B = jnp.where(best_start >= 0, num_tokens_B - best_start, 0)
    num_draft_B = jnp.clip(avail_B, 0, K).astype(jnp.int32)
    idx_BK = jnp.clip(best_start[:, None] + jnp.arange(K)[None, :], 0, S - 1)
    drafts_BK = jnp.take_along_axis(tokens_BS, idx_BK, axis=1)
    drafts_BK = jnp.where(jnp.arange(K)[None, :] < num_draft_B[:, None],
                          drafts_BK, 0)
    return Proposal(tokens=drafts_BK, probs=None, num_draft=num_draft_B,
                    state=state)
