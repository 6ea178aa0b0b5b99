"""N-gram prompt lookup: copy what followed the last occurrence of the suffix.

For each row, the longest suffix n-gram (n from ``n_max`` down to ``n_min``)
that occurred earlier in the row's prompt + generated tokens is located (most
recent occurrence wins) and the up-to-K tokens that followed it are proposed.
Rows with no match, or whose match is followed by fewer than K committed
tokens, draft fewer (ragged ``num_draft``, possibly 0). As a tree drafter it
merges the continuations of the few best matches into a trie (shared
prefixes once, siblings distinct). Fully jitted: one ``[B, S]`` comparison
per n and offset, no host work. Deterministic (p = one-hot).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.core.rows import at_rows
from specjax.drafters.base import Context, Proposal, TableTrie


@dataclasses.dataclass(frozen=True)
class NGramDrafter(TableTrie):
  """Attributes:
    n_max, n_min: the suffix lengths looked up, longest first.
    num_paths: continuations merged into the trie ``propose_tree`` drafts.
  """
  n_max: int = 3
  n_min: int = 1
  num_paths: int = 4

  def __post_init__(self):
    if not 1 <= self.n_min <= self.n_max:
      raise ValueError(f"need 1 <= n_min <= n_max, got {self.n_min}, "
                       f"{self.n_max}")
    if self.num_paths < 1:
      raise ValueError(f"num_paths must be >= 1, got {self.num_paths}")

  def _match_lengths(self, tokens_BS, num_tokens_B) -> jax.Array:
    """``int32[B, S]``: at each continuation start s, the longest n in
    ``[n_min, n_max]`` such that the n tokens before s equal the row's last
    n tokens (0: none). Only s below ``num_tokens`` (a continuation exists)
    and at least n count."""
    B, S = tokens_BS.shape
    s_S = jnp.arange(S)[None, :]
    len_BS = jnp.zeros((B, S), jnp.int32)
    for n in range(self.n_min, self.n_max + 1):  # longer n overwrite shorter
      match_BS = (s_S >= n) & (s_S < num_tokens_B[:, None]) & (
          num_tokens_B[:, None] >= n + 1)
      for i in range(n):  # tokens[s - n + i] == suffix[i]
        suffix_B = at_rows(tokens_BS, jnp.maximum(num_tokens_B - n + i, 0))
        match_BS &= jnp.roll(tokens_BS, n - i, axis=1) == suffix_B[:, None]
      len_BS = jnp.where(match_BS, n, len_BS)
    return len_BS

  def _continuations(self, tokens_BS, num_tokens_B, num_paths: int,
                     num_draft: int):
    """The ``num_paths`` best matches (longest n, then most recent):
    ``(tokens [B, P, K], available [B, P])`` -- what followed each, and how
    many of those K tokens exist (0 for no match)."""
    S = tokens_BS.shape[1]
    len_BS = self._match_lengths(tokens_BS, num_tokens_B)
    score_BS = jnp.where(len_BS > 0, len_BS * S + jnp.arange(S)[None, :], -1)
    score_BP, start_BP = jax.lax.top_k(score_BS, num_paths)
    avail_BP = jnp.where(score_BP >= 0, num_tokens_B[:, None] - start_BP, 0)
    idx_BPK = jnp.clip(start_BP[..., None] + jnp.arange(num_draft)[None, None],
                       0, S - 1)
    cont_BPK = jnp.take_along_axis(tokens_BS[:, None, :], idx_BPK, axis=2)
    return cont_BPK, jnp.clip(avail_BP, 0, num_draft).astype(jnp.int32)

  def propose(self, params, state, ctx: Context, key, num_draft,
              sampling) -> Proposal:
    del params, key, sampling
    K = num_draft
    cont_BPK, avail_BP = self._continuations(ctx.tokens, ctx.num_tokens, 1, K)
    drafts_BK = jnp.where(jnp.arange(K)[None, :] < avail_BP,
                          cont_BPK[:, 0], 0)
    return Proposal(tokens=drafts_BK, probs=None, num_drafted=avail_BP[:, 0],
                    state=state)

  def paths(self, params, ctx: Context, num_draft):
    """What followed each of the ``num_paths`` best matches, up to
    ``num_draft`` deep: ``(tokens [B, P, K], lengths [B, P])``; its trie is
    ``propose_tree`` (``TableTrie``)."""
    del params
    return self._continuations(ctx.tokens, ctx.num_tokens, self.num_paths,
                               num_draft)
