"""A head's draft tree with a table drafter's trie merged in.

A trained head (EAGLE, Medusa) guesses the next tokens from the target's
hidden state; the tables (n-gram, retrieval: ``LookupDrafter``) copy what
followed the same context before, at no draft cost. They are right in
different places: the head on fresh text, the tables where the reply quotes
the prompt, repeats itself or says what other conversations said. The union
drafts both trees from the same committed tokens and verifies them as one
(``tree.union``: a path both propose is one node, so siblings stay
distinct). Both trees are fixed before the target scores them, so their
union is too and ``tree.verify_tree`` stays exact at every temperature.

The head keeps its state: it drafts and commits as it would alone (the
engine hands it the target features along the accepted path, whichever
tree's nodes that path ran through); the tables keep none.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from flax import struct

from specjax.core import tree as trees
from specjax.drafters.base import Context, Proposal, TableTrie, TreeProposal


@struct.dataclass
class UnionParams:
  """Attributes: the head drafter's params and the table's (a datastore)."""
  head: Any
  table: Any


@dataclasses.dataclass(frozen=True)
class TreeUnion:
  """Attributes:
    head: a ``TreeDrafter`` (EAGLE or Medusa) that drafts the first
      ``num_nodes - table_nodes`` nodes of a tree step.
    table: the table drafter whose trie fills the other ``table_nodes``.
    table_nodes: the trie's budget within the step's ``num_nodes``.
  Chains (``propose``) are the head's alone.
  """
  head: Any
  table: TableTrie
  table_nodes: int
  needs_params: ClassVar[bool] = True  # UnionParams

  @property
  def feature_taps(self) -> tuple[int, ...]:
    return self.head.feature_taps

  def init(self, params: UnionParams, prompt: Context, capacity, num_draft,
           features=None):
    return self.head.init(params.head, prompt, capacity, num_draft, features)

  def commit(self, params: UnionParams, state, ctx: Context, features=None):
    return self.head.commit(params.head, state, ctx, features)

  def propose(self, params: UnionParams, state, ctx: Context, key,
              num_draft, sampling) -> Proposal:
    return self.head.propose(params.head, state, ctx, key, num_draft,
                             sampling)

  def propose_tree(self, params: UnionParams, state, ctx: Context, key,
                   num_draft, num_nodes, sampling) -> TreeProposal:
    if not 0 < self.table_nodes < num_nodes:
      raise ValueError(f"table_nodes={self.table_nodes} must leave the head "
                       f"some of the tree's {num_nodes} nodes")
    own = self.head.propose_tree(params.head, state, ctx, key, num_draft,
                                 num_nodes - self.table_nodes, sampling)
    table = self.table.propose_tree(params.table, None, ctx, key, num_draft,
                                    self.table_nodes, sampling)
    return TreeProposal(tree=trees.union(own.tree, table.tree, num_draft),
                        state=own.state)
