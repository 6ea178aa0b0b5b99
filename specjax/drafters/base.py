"""The drafter protocol, what a drafter returns, and the stateless base."""

from __future__ import annotations

from typing import Any, ClassVar, Optional, Protocol, runtime_checkable

import jax
from flax import struct

from specjax.core.rows import at_rows
from specjax.core.tree import trie


@struct.dataclass
class Proposal:
  """Drafts for one step.

  Attributes:
    tokens: ``int32[B, K]`` drafted tokens (entries past ``num_draft`` unused).
    probs: ``f32[B, K, V]`` the warped distributions they were sampled from,
      or None for a deterministic drafter (one-hot).
    num_draft: ``int32[B]`` drafts per row, in ``[0, K]``.
    state: the drafter's state after proposing.
  """
  tokens: jax.Array
  probs: Optional[jax.Array]
  num_draft: jax.Array
  state: Any = None


@struct.dataclass
class TreeProposal:
  """A draft tree for one step (``core.tree.Tree``, ``M = num_nodes + 1``
  nodes, depth at most K) fixed before the target scores it, and the
  drafter's state after proposing."""
  tree: Any
  state: Any = None


class Drafter(Protocol):
  """What the engine calls (``specjax.drafters`` describes the contract).

  A drafter is a frozen, hashable dataclass: a static argument of the jitted
  engine. Its parameters travel as ``params``, its mutable state as
  ``state`` (``DecodeState.drafter_state``), a pytree whose every leaf leads
  with the batch axis B (on a mesh it is split over rows like the target's
  cache: ``specjax.core.sharding``). K, the drafts per step, lives in
  ``DecodeConfig.num_draft`` alone and is passed to ``init`` (to size the
  state) and to ``propose``.

  Attributes:
    feature_taps: target layers whose inputs the drafter reads (EAGLE); the
      engine passes their concatenation as ``features``. Empty: none.
    needs_params: whether ``params`` must be given (a head, a draft model's
      weights, a datastore); the engine refuses None for such a drafter.
  """
  feature_taps: tuple[int, ...]
  needs_params: bool

  def init(self, params, prompt_BT, prompt_lengths_B, capacity: int,
           num_draft: int, features=None) -> Any:
    """The state after the prefill over ``prompt_BT``."""

  def propose(self, params, state, tokens_BS, num_tokens_B, key,
              num_draft: int, sampling) -> Proposal:
    """Up to ``num_draft`` drafts per row after its committed tokens."""

  def commit(self, params, state, tokens_BS, num_tokens_B, features=None
             ) -> Any:
    """The state after verification committed ``num_tokens_B``."""


@runtime_checkable
class TreeDrafter(Drafter, Protocol):
  """A drafter that can also propose trees (``DecodeConfig.tree_nodes``)."""

  def propose_tree(self, params, state, tokens_BS, num_tokens_B, key,
                   num_draft: int, num_nodes: int, sampling) -> TreeProposal:
    """A tree of up to ``num_nodes`` drafted nodes, none deeper than
    ``num_draft``, whose shape and tokens do not depend on the target."""


class Stateless:
  """Protocol methods for drafters that keep no state between steps (table
  lookups): nothing to set up after the prefill, nothing to roll back, no
  target features read."""

  feature_taps: ClassVar[tuple[int, ...]] = ()
  needs_params: ClassVar[bool] = False

  def init(self, params, prompt_BT, prompt_lengths_B, capacity, num_draft,
           features=None):
    del params, prompt_BT, prompt_lengths_B, capacity, num_draft, features
    return None

  def commit(self, params, state, tokens_BS, num_tokens_B, features=None):
    del params, tokens_BS, num_tokens_B, features
    return state


class TableTrie(Stateless):
  """A table drafter's tree (n-gram, retrieval, both): the trie of the
  continuations its ``paths(params, tokens_BS, num_tokens_B, num_draft) ->
  (tokens [B, P, K], lengths [B, P])`` returns, under the row's newest
  token, cut breadth first to ``num_nodes`` drafted nodes (``tree.trie``:
  shared prefixes once, siblings distinct)."""

  def propose_tree(self, params, state, tokens_BS, num_tokens_B, key,
                   num_draft, num_nodes, sampling) -> TreeProposal:
    del key, sampling
    paths_BPK, lengths_BP = self.paths(params, tokens_BS, num_tokens_B,
                                       num_draft)
    root_B = at_rows(tokens_BS, num_tokens_B - 1)
    return TreeProposal(tree=trie(root_B, paths_BPK, lengths_BP, num_nodes),
                        state=state)
