"""Lookahead decoding: the target drafts for itself by Jacobi iteration.

No draft weights, no data. Each row keeps a window of L levels by W columns
of guessed tokens, and a pool of n-grams the target produced from it. Every
step the target scores, in its one verify forward, the row's newest token,
a trie of candidate continuations, and the window beside them (its
``Riders``):

  level l, column i sits at ``l + i + 1`` positions after the newest token
  and sees the newest token, level 0's columns up to i and its own column's
  levels 1..l (a diagonal): its context is consecutive positions. The trie's
  nodes never see the window, the window never sees the trie.

The target's greedy token at the last level's columns continues each
column's diagonal: ``(level 0, ..., level L - 1, that token)`` is an n-gram
of L + 1 tokens the target itself strung together, and goes into the pool
(key: its first token). The window then moves one level on (the new tokens
become its last level) and, when the step committed more than one token,
its columns shift left by the extra tokens, so a column stays at the
positions it guessed for.

Candidates for the next step are the trie, under the newest token, of the
row's own context's continuations (prompt lookup: ``NGramDrafter``'s best
suffix matches, which covers what seeding the pool with the prompt's
n-grams would, and finds longer matches first) and of the ``width`` newest
pool n-grams keyed by that token, K deep (the engine's ``num_draft``; the
pool's paths are L <= K deep, the context's up to K). The trie depends
only on committed tokens and on the target's greedy outputs at earlier
steps, never on this step's draws, so ``verify_tree`` is exact at every
temperature: the longest greedy match at T = 0, the target's distribution
at T > 0 (``core.tree``).

Every leaf of the state leads with the batch axis; the pool is a ring of
fixed size per row (the oldest n-grams overwritten), an n-gram already in it
never written twice.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.core.rows import set_at_rows
from specjax.core.tree import trie
from specjax.drafters.base import Context, Riders, TreeProposal
from specjax.drafters.ngram import NGramDrafter


@struct.dataclass
class LookaheadState:
  """Attributes:
    window: ``int32[B, L, W]`` the Jacobi window, level 0 first.
    pool: ``int32[B, P, L + 1]`` n-grams, each its key then L tokens
      (key -1: an empty slot).
    next_slot: ``int32[B]`` where the pool writes next (a ring).
    num_tokens: ``int32[B]`` the committed tokens the window is placed for.
  """
  window: jax.Array
  pool: jax.Array
  next_slot: jax.Array
  num_tokens: jax.Array


@dataclasses.dataclass(frozen=True)
class LookaheadDrafter:
  """Attributes:
    window: W, the Jacobi window's columns.
    levels: L, the window's levels: the pool's n-grams are L + 1 tokens
      (None: the engine's ``num_draft``, the trie's depth; at most that).
    width: n-grams from the pool merged into the trie (the context gives
      its drafter's ``num_paths`` continuations).
    pool_size: n-grams a row's pool holds.
    context: the prompt-lookup drafter searching the row's own tokens
      (None: the pool's n-grams alone).
  """
  window: int = 4
  levels: Optional[int] = None
  width: int = 4
  pool_size: int = 512
  context: Optional[NGramDrafter] = NGramDrafter()

  feature_taps: ClassVar[tuple[int, ...]] = ()
  needs_params: ClassVar[bool] = False

  def __post_init__(self):
    for name in ("window", "levels", "width", "pool_size"):
      if getattr(self, name) is not None and getattr(self, name) < 1:
        raise ValueError(f"lookahead {name} must be >= 1, got "
                         f"{getattr(self, name)}")

  def init(self, params, prompt: Context, capacity, num_draft,
           features=None) -> LookaheadState:
    """An empty pool, and a window of the prompt's last tokens."""
    del params, capacity, features
    B, L, W = prompt.tokens.shape[0], self._levels(num_draft), self.window
    back_E = jnp.arange(L * W)[None, :]
    idx_BE = jnp.mod(prompt.num_tokens[:, None] - 1 - back_E,
                     prompt.num_tokens[:, None])
    window = jnp.take_along_axis(prompt.tokens, idx_BE, axis=1)
    return LookaheadState(
        window=window.reshape(B, L, W).astype(jnp.int32),
        pool=jnp.full((B, self.pool_size, L + 1), -1, jnp.int32),
        next_slot=jnp.zeros((B,), jnp.int32),
        # After the prefill, the prompt and its first sampled token.
        num_tokens=(prompt.num_tokens + 1).astype(jnp.int32))

  def _levels(self, num_draft: int) -> int:
    if self.levels is None:
      return num_draft
    if self.levels > num_draft:
      raise ValueError(f"lookahead levels {self.levels} exceed the trie's "
                       f"depth k={num_draft}")
    return self.levels

  def num_riders(self, num_draft: int) -> int:
    return self._levels(num_draft) * self.window

  def propose(self, params, state, ctx, key, num_draft, sampling):
    raise ValueError("lookahead drafts trees (its window rides beside one): "
                     "give tree_nodes")

  def propose_tree(self, params, state: LookaheadState, ctx: Context, key,
                   num_draft, num_nodes, sampling) -> TreeProposal:
    del params, key, sampling
    K = num_draft
    grams_BPL, lengths_BP = self._pooled(state, ctx.newest())
    paths_BPK = jnp.pad(grams_BPL, ((0, 0), (0, 0),
                                    (0, K - grams_BPL.shape[-1])))
    if self.context is not None:
      own_BPK, own_BP = self.context.paths(None, ctx, K)
      paths_BPK = jnp.concatenate([own_BPK, paths_BPK], axis=1)
      lengths_BP = jnp.concatenate([own_BP, lengths_BP], axis=1)
    tree = trie(ctx.newest(), paths_BPK, lengths_BP, num_nodes)
    B, L, W = state.window.shape
    offsets_E, sees_EE = window_layout(L, W)
    riders = Riders(tokens=state.window.reshape(B, L * W),
                    offsets=jnp.asarray(offsets_E),
                    sees=jnp.asarray(sees_EE))
    return TreeProposal(tree=tree, state=state, riders=riders)

  def _pooled(self, state: LookaheadState, newest_B: jax.Array):
    """The pool's ``width`` newest n-grams keyed by each row's newest token:
    ``(tokens [B, width, L], lengths [B, width])`` (length 0: none)."""
    P = self.pool_size
    age_P = jnp.arange(P)[None, :]
    age_BP = jnp.mod(state.next_slot[:, None] - 1 - age_P, P)
    hit_BP = state.pool[:, :, 0] == newest_B[:, None]
    score_BG, slot_BG = jax.lax.top_k(jnp.where(hit_BP, P - age_BP, -1),
                                      min(self.width, P))
    grams_BGL = jnp.take_along_axis(state.pool[:, :, 1:], slot_BG[..., None],
                                    axis=1)
    L = grams_BGL.shape[-1]
    return grams_BGL, jnp.where(score_BG >= 0, L, 0).astype(jnp.int32)

  def ridden(self, params, state: LookaheadState, ctx: Context,
             greedy_BE: jax.Array) -> LookaheadState:
    """The state after the target scored the window (its greedy token at
    each rider, ``greedy``) and the step committed ``ctx``: the diagonals'
    n-grams pooled, the window a level on and shifted to the new context."""
    del params
    B, L, W = state.window.shape
    new_BW = greedy_BE.reshape(B, L, W)[:, -1]
    grams_BWN = jnp.concatenate([state.window, new_BW[:, None]],
                                axis=1).transpose(0, 2, 1)
    state = self._pooled_in(state, grams_BWN)
    moved_B = jnp.maximum(ctx.num_tokens - state.num_tokens - 1, 0)
    cols_BW = jnp.minimum(jnp.arange(W)[None, :] + moved_B[:, None], W - 1)
    window = jnp.concatenate([state.window[:, 1:], new_BW[:, None]], axis=1)
    window = jnp.take_along_axis(window, jnp.broadcast_to(
        cols_BW[:, None], (B, L, W)), axis=2)
    return state.replace(window=window, num_tokens=ctx.num_tokens)

  def _pooled_in(self, state: LookaheadState,
                 grams_BWN: jax.Array) -> LookaheadState:
    """``grams`` written into the ring, each one not already in the pool
    and not an earlier one's repeat."""
    W = grams_BWN.shape[1]
    held_BW = jnp.any(jnp.all(
        grams_BWN[:, :, None] == state.pool[:, None], axis=-1), axis=-1)
    same_BWW = jnp.all(grams_BWN[:, :, None] == grams_BWN[:, None], axis=-1)
    repeat_BW = jnp.any(same_BWW & jnp.tri(W, k=-1, dtype=bool)[None],
                        axis=-1)
    new_BW = ~held_BW & ~repeat_BW
    slot_BW = jnp.mod(state.next_slot[:, None]
                      + jnp.cumsum(new_BW, axis=1) - 1, self.pool_size)
    slot_BW = jnp.where(new_BW, slot_BW, self.pool_size)
    return state.replace(
        pool=set_at_rows(state.pool, slot_BW, grams_BWN, mode="drop"),
        next_slot=jnp.mod(state.next_slot + jnp.sum(new_BW, axis=1),
                          self.pool_size).astype(jnp.int32))

  def commit(self, params, state, ctx: Context, features=None):
    del params, ctx, features
    return state


def window_layout(levels: int, columns: int) -> tuple[np.ndarray, np.ndarray]:
  """The window's riders, level by level: ``(offsets [E], sees [E, E])``,
  rider ``l * columns + i`` at ``l + i + 1`` positions after the newest
  token, seeing level 0's columns up to i and column i's levels 1..l."""
  level_E = np.repeat(np.arange(levels), columns)
  col_E = np.tile(np.arange(columns), levels)
  sees_EE = np.where(
      level_E[None, :] == 0, col_E[None, :] <= col_E[:, None],
      (col_E[None, :] == col_E[:, None])
      & (level_E[None, :] <= level_E[:, None]))
  return (level_E + col_E + 1).astype(np.int32), sees_EE
