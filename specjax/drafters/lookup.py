"""Prompt lookup and a datastore together: n-gram first, retrieval behind.

The two table drafters guess from different places: n-gram copies what
followed the row's own latest suffix match (right often when the answer
quotes the prompt or repeats itself, silent on ~half the steps of chat), the
datastore what followed the suffix in other conversations (a guess on almost
every step, right less often). As a chain, a row drafts n-gram's
continuation where its context has a match and retrieval's elsewhere; as a
tree, one trie holds n-gram's best matches' paths and then retrieval's (each
suffix order's), shared prefixes once, cut breadth first to the node budget.
Both are deterministic, so verification is exact at every temperature. On
MT-bench at T = 0 the trie of 8 nodes reaches τ 1.89 where n-gram's chain
has 1.50 and its own trie 1.55 (benchmarks/trie_acceptance.py).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from specjax.drafters.base import Context, Proposal, TableTrie
from specjax.drafters.ngram import NGramDrafter
from specjax.drafters.retrieval import Datastore, RetrievalDrafter


@dataclasses.dataclass(frozen=True)
class LookupDrafter(TableTrie):
  """Attributes: the two drafters (params: the retrieval's datastore)."""
  ngram: NGramDrafter = NGramDrafter()
  retrieval: RetrievalDrafter = RetrievalDrafter()
  needs_params: ClassVar[bool] = True  # the retrieval's Datastore

  def propose(self, params: Datastore, state, ctx: Context, key, num_draft,
              sampling) -> Proposal:
    own = self.ngram.propose(None, state, ctx, key, num_draft, sampling)
    store = self.retrieval.propose(params, state, ctx, key, num_draft,
                                   sampling)
    use_B = own.num_drafted > 0
    return Proposal(
        tokens=jnp.where(use_B[:, None], own.tokens, store.tokens),
        probs=None, num_drafted=jnp.where(use_B, own.num_drafted,
                                          store.num_drafted), state=state)

  def paths(self, params: Datastore, ctx: Context, num_draft):
    """n-gram's paths, then retrieval's (its trie: ``TableTrie``)."""
    own_BPK, own_BP = self.ngram.paths(None, ctx, num_draft)
    store_BQK, store_BQ = self.retrieval.paths(params, ctx, num_draft)
    return (jnp.concatenate([own_BPK, store_BQK], axis=1),
            jnp.concatenate([own_BP, store_BQ], axis=1))
