"""The drafter protocol, what a drafter sees and returns, and the stateless
base."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Optional, Protocol, runtime_checkable

import jax
from flax import struct

from specjax.core.cache import KVCache
from specjax.core.rows import at_rows
from specjax.core.sampling import Sampler
from specjax.core.tree import Tree, trie


@struct.dataclass
class Context:
  """Each row's committed tokens: ``tokens[b, :num_tokens[b]]`` (at
  ``init``, the prompts; later, the prompt plus what the row generated).

  Attributes:
    tokens: ``int32[B, S]`` left-aligned, the rest of each row unused.
    num_tokens: ``int32[B]`` valid entries per row, at least 1.
    cache: the target's cache of each row's committed tokens but the
      newest (lengths ``num_tokens - 1``), at ``propose`` for a drafter
      whose ``reads_target_cache`` is true; else None.
  """
  tokens: jax.Array
  num_tokens: jax.Array
  cache: Optional[KVCache] = None

  def newest(self) -> jax.Array:
    """``int32[B]``: each row's last committed token."""
    return at_rows(self.tokens, self.num_tokens - 1)


@struct.dataclass
class Proposal:
  """Drafts for one step.

  Attributes:
    tokens: ``int32[B, K]`` drafted tokens (entries past ``num_drafted``
      unused); K is the step's ``num_draft``.
    probs: ``f32[B, K, V]`` the warped distributions they were sampled from,
      or None for a deterministic drafter (one-hot).
    num_drafted: ``int32[B]`` drafts per row, in ``[0, K]``.
    state: the drafter's state after proposing.
  """
  tokens: jax.Array
  probs: Optional[jax.Array]
  num_drafted: jax.Array
  state: Any = None


@struct.dataclass
class Riders:
  """Tokens a drafter has the target score beside its tree, for its own use
  (Lookahead's Jacobi window): never verified, never kept in the cache. Each
  sees the row's cache, the tree's root and the riders ``sees`` marks; no
  tree node sees a rider.

  Attributes:
    tokens: ``int32[B, E]``.
    offsets: ``int32[E]`` each rider's position after the root's.
    sees: ``bool[E, E]`` which riders each rider attends to (itself too).
  """
  tokens: jax.Array
  offsets: jax.Array
  sees: jax.Array


@struct.dataclass
class TreeProposal:
  """A draft tree for one step (``core.tree.Tree``, ``M = num_nodes + 1``
  nodes, depth at most K) fixed before the target scores it, the
  drafter's state after proposing, and any ``Riders`` (a
  ``RidingDrafter``'s)."""
  tree: Tree
  state: Any = None
  riders: Optional[Riders] = None


@runtime_checkable
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

  Optional: ``reads_target_cache`` (default False): ``propose`` then gets
  the target's cache in ``ctx.cache`` (CLaSp drafts with the target
  itself over it). ``drafts_behind`` (default False): a drafter that reads
  features and still drafts behind tokens the target has not scored
  (PEARL's pending drafts, ``core.pearl``), through
  ``propose_behind(params, state, ctx, behind_B, key, num_draft,
  sampling)``: ``propose``'s drafts for the positions after ``ctx``'s
  committed tokens and ``behind_B`` more, whatever those are.
  """
  feature_taps: tuple[int, ...]
  needs_params: bool

  def init(self, params: Any, prompt: Context, capacity: int,
           num_draft: int, features: Optional[jax.Array] = None) -> Any:
    """The state after the prefill over the prompts."""

  def propose(self, params: Any, state: Any, ctx: Context, key: jax.Array,
              num_draft: int, sampling: Sampler) -> Proposal:
    """Up to ``num_draft`` drafts per row after its committed tokens.
    ``sampling`` (each row's values and history): what a drafter that
    samples its drafts warps with (``drafters.chain.draft_chain``)."""

  def commit(self, params: Any, state: Any, ctx: Context,
             features: Optional[jax.Array] = None) -> Any:
    """The state after verification committed ``ctx``'s tokens."""


@runtime_checkable
class TreeDrafter(Drafter, Protocol):
  """A drafter that can also propose trees (``DecodeConfig.tree_nodes``)."""

  def propose_tree(self, params: Any, state: Any, ctx: Context,
                   key: jax.Array, num_draft: int, num_nodes: int,
                   sampling: Sampler) -> TreeProposal:
    """A tree of up to ``num_nodes`` drafted nodes, none deeper than
    ``num_draft``, whose shape and tokens do not depend on the target."""


@runtime_checkable
class RidingDrafter(TreeDrafter, Protocol):
  """A tree drafter whose proposals carry ``Riders``: it drafts trees only,
  and reads the target's greedy token at each rider."""

  def num_riders(self, num_draft: int) -> int:
    """E, the riders each proposal carries at K = ``num_draft``."""

  def ridden(self, params: Any, state: Any, ctx: Context,
             greedy: jax.Array) -> Any:
    """The state after the verify forward gave ``greedy`` (``int32[B, E]``,
    the target's argmax at each rider) and the step committed ``ctx``'s
    tokens; ``commit`` follows."""


@dataclasses.dataclass(frozen=True, eq=False)
class Method:
  """A decoding method ready to run: what ``runner.generate_ids`` decodes
  with (``methods.build`` makes one from a ``MethodSpec``).

  Attributes:
    drafter: a ``Drafter``, or None for AR.
    params: the drafter's parameters (a pytree), if it has any.
    num_draft: K, the most drafts per step (0 for AR).
    tree_nodes: 0 for chains; else the drafted nodes of each step's tree.
    pearl: draft while verifying (``DecodeConfig.pearl``).
  """
  drafter: Optional[Drafter] = None
  params: Any = None
  num_draft: int = 0
  tree_nodes: int = 0
  pearl: bool = False

  def __post_init__(self):
    if self.drafter is None and (self.num_draft or self.tree_nodes
                                 or self.params is not None or self.pearl):
      raise ValueError(f"num_draft {self.num_draft}, tree_nodes "
                       f"{self.tree_nodes}, params and pearl need a "
                       "drafter; without one the method is AR")


AR = Method()


class Stateless:
  """Protocol methods for drafters that keep no state between steps (table
  lookups): nothing to set up after the prefill, nothing to roll back, no
  target features read."""

  feature_taps: ClassVar[tuple[int, ...]] = ()
  needs_params: ClassVar[bool] = False

  def init(self, params, prompt: Context, capacity, num_draft,
           features=None):
    del params, prompt, capacity, num_draft, features
    return None

  def commit(self, params, state, ctx: Context, features=None):
    del params, ctx, features
    return state


class TableTrie(Stateless):
  """A table drafter's tree (n-gram, retrieval, both): the trie of the
  continuations its ``paths(params, ctx, num_draft) -> (tokens [B, P, K],
  lengths [B, P])`` returns, under the row's newest
  token, cut breadth first to ``num_nodes`` drafted nodes (``tree.trie``:
  shared prefixes once, siblings distinct)."""

  def propose_tree(self, params, state, ctx: Context, key, num_draft,
                   num_nodes, sampling) -> TreeProposal:
    del key, sampling
    paths_BPK, lengths_BP = self.paths(params, ctx, num_draft)
    return TreeProposal(tree=trie(ctx.newest(), paths_BPK, lengths_BP,
                                  num_nodes), state=state)
