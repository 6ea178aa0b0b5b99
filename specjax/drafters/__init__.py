"""Drafters: where speculative tokens come from.

A drafter (the ``base.Drafter`` protocol) is a frozen (hashable) dataclass --
a static argument of the jitted engine -- with three pure methods; its
parameters (if any) travel separately as a pytree argument and its mutable
state (e.g. its own KV cache) lives in ``DecodeState.drafter_state``.
``num_draft`` (K), the static most drafts per step, comes from
``DecodeConfig.num_draft``, passed to ``init`` and ``propose``:

  init(params, prompt: Context, capacity, num_draft, features)
      -> drafter_state
  propose(params, drafter_state, ctx: Context, key, num_draft, sampling)
      -> Proposal
  commit(params, drafter_state, ctx: Context, features) -> drafter_state

A ``base.Context`` is each row's committed tokens, ``ctx.tokens[b,
:ctx.num_tokens[b]]`` (the prompts at ``init``). ``propose`` returns up to
K drafts per row (``Proposal.num_drafted`` of them); ``commit`` runs after
verification with the new context so the drafter can roll its own state
back by lengths.
A drafter that reads the target's hidden states (EAGLE) names the layers in
its ``feature_taps`` (empty for the others); the engine then passes
``features``: the concatenated inputs of those target layers for the tokens
the target just ran (``[B, Tp, F]`` for the prompt at ``init``,
``[B, K + 1, F]`` for ``[newest token, drafts]`` at ``commit``; after a tree
step, the accepted path's, in path order); otherwise ``features`` is None.
A drafter whose ``needs_params`` is true (a head, a draft model, a
datastore) is refused without its ``params``.

A ``base.TreeDrafter`` (n-gram, retrieval, both together, EAGLE, Medusa,
and a head with the tables' trie merged in: ``union.TreeUnion``) also has

  propose_tree(params, drafter_state, ctx: Context, key, num_draft,
               num_nodes, sampling) -> TreeProposal

returning a ``specjax.core.tree.Tree`` of up to ``num_nodes`` drafted nodes at
most K deep, fixed before the target scores it (``DecodeConfig.tree_nodes``).
"""

from specjax.drafters.base import (AR, Context, Drafter, Method, Proposal,
                                   TreeDrafter, TreeProposal)
from specjax.drafters.clasp import ClaspDrafter
from specjax.drafters.draft_model import DraftModelDrafter, LayerSkipDrafter
from specjax.drafters.eagle import EagleDrafter, EagleParams
from specjax.drafters.lookahead import LookaheadDrafter
from specjax.drafters.lookup import LookupDrafter
from specjax.drafters.medusa import MedusaDrafter, MedusaParams
from specjax.drafters.ngram import NGramDrafter
from specjax.drafters.retrieval import (Datastore, RetrievalDrafter,
                                        build_datastore, sharegpt_datastore)

__all__ = ["AR", "ClaspDrafter", "Context", "Datastore", "DraftModelDrafter", "Drafter",
           "EagleDrafter", "EagleParams", "LayerSkipDrafter", "LookaheadDrafter",
           "LookupDrafter",
           "MedusaDrafter", "MedusaParams", "Method", "NGramDrafter",
           "Proposal", "RetrievalDrafter", "TreeDrafter", "TreeProposal",
           "build_datastore", "sharegpt_datastore"]
