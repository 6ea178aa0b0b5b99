"""CLaSp: the target drafts for itself with layers skipped, the skipped set
re-chosen from the target's own hidden states.

No weights, no training. After a verification, the target's inputs to every
layer at the last verified token, ``x_0 .. x_L`` (``x_L`` the last layer's
output), are kept (the engine's features: every layer is a tap). A dynamic
programme over (layers run i, layers skipped j) then picks M layers to skip:

  g(i, 0) = x_i;  for j >= 1, the better of  f_i(g(i-1, j))  (run layer i)
  and  g(i-1, j-1)  (skip it)  by cosine similarity to x_i,

and the skip set is read back from (L, M). Each cell's candidate is the
state the token would have with its skip set, so ``f_i`` runs on the M
candidates of a layer at once: M tokens at the token's position, each
seeing the cached prefix and itself (``Target.run_layer``), about one
forward over M tokens for the whole programme. With a batch, the rows share
one skip set (the cosines summed over rows): a skipped layer is then a
``lax.cond`` that computes nothing for any row.

Drafting runs the target over its own cache (``Context.cache``: the prefix's
exact keys and values) with those layers passed over (``forward(skip=)``),
never writing it: each draft step re-feeds the newest token and the drafts
so far (K tokens, causal), which on a CPU costs about a one-token forward.
The drafts are sampled from the skipping model's warped distributions and
verified as any chain, so the output follows the target at any temperature.

``propose_tree`` drafts an EAGLE-2 dynamic tree with the skipping model
instead (``trees.best_first``: the W best children of each level's W best
nodes, then the ``num_nodes`` best by cumulative log-probability). Its
block holds the root and W slots per level after it, K levels; each level
re-feeds the whole block under the tree's ancestor mask (the slots not yet
filled see only themselves) and reads the frontier's logits. The tree is
the skipping model's top-k, no draws, so ``verify_tree`` is exact.

The skip set is re-chosen every ``refresh`` steps (1: every step).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.core import tree as trees
from specjax.core.rows import at_rows
from specjax.drafters.base import Context, Proposal, TreeProposal
from specjax.drafters.chain import draft_chain
from specjax.models.target import Target


@struct.dataclass
class ClaspState:
  """Attributes:
    hidden: ``[B, L + 1, D]`` the last verified token's input to each layer
      and the last layer's output.
    skip: ``bool[B, L]`` the layers the draft passes over (the same in
      every row).
    age: ``int32[B]`` steps since the skip set was chosen.
    num_tokens: ``int32[B]`` committed tokens when ``hidden`` was taken.
  """
  hidden: jax.Array
  skip: jax.Array
  age: jax.Array
  num_tokens: jax.Array


@dataclasses.dataclass(frozen=True)
class ClaspDrafter:
  """Build it with ``from_target``; its params are the target's own.

  Attributes:
    target: the target (a ``Target`` with ``run_layer`` and
      ``forward(skip=)``).
    num_skipped: M, the layers each draft passes over.
    refresh: steps between two choices of the skip set.
    min_confidence: dynamic K threshold on the draft's top probability.
    tree_width: W, a tree's children per frontier node and frontier nodes
      per level.
  """
  target: Target
  num_skipped: int
  refresh: int = 1
  min_confidence: float = 0.0
  tree_width: int = 4
  feature_taps: tuple[int, ...] = ()
  needs_params: ClassVar[bool] = True  # the target's weights
  reads_target_cache: ClassVar[bool] = True

  @classmethod
  def from_target(cls, target: Target, num_layers: int, refresh: int = 1,
                  min_confidence: float = 0.0,
                  tree_width: int = 4) -> "ClaspDrafter":
    """The drafter that runs ``num_layers`` of the target's layers."""
    depth = target.config.num_layers
    if not 1 <= num_layers < depth:
      raise ValueError(f"clasp needs 1 <= layers < {depth} (the target's "
                       f"depth), got {num_layers}")
    if not callable(getattr(target, "run_layer", None)):
      raise ValueError(f"clasp needs a target with run_layer (one layer on "
                       f"hidden states); {type(target).__name__} has none")
    if refresh < 1 or tree_width < 1:
      raise ValueError(f"refresh and tree width must be >= 1, got "
                       f"{refresh} and {tree_width}")
    return cls(target, depth - num_layers, refresh, min_confidence,
               tree_width, tuple(range(depth + 1)))

  def _hidden(self, features, at_B):
    """``[B, L + 1, D]``: the features of position ``at`` per row, split
    per layer."""
    x_BF = at_rows(features, at_B)
    return x_BF.reshape(x_BF.shape[0], len(self.feature_taps), -1)

  def init(self, params, prompt: Context, capacity, num_draft,
           features=None) -> ClaspState:
    del params, capacity, num_draft
    B, L = prompt.tokens.shape[0], self.target.config.num_layers
    return ClaspState(
        hidden=self._hidden(features, prompt.num_tokens - 1),
        skip=jnp.zeros((B, L), bool),
        age=jnp.full((B,), self.refresh, jnp.int32),
        num_tokens=prompt.num_tokens + 1)

  def commit(self, params, state: ClaspState, ctx: Context,
             features=None) -> ClaspState:
    """The features of the last token the step verified: path position
    (tokens it emitted) - 1; a row that emitted none keeps its own."""
    del params
    at_B = ctx.num_tokens - state.num_tokens - 1
    hidden = self._hidden(features, jnp.maximum(at_B, 0))
    return state.replace(
        hidden=jnp.where((at_B >= 0)[:, None, None], hidden, state.hidden),
        num_tokens=ctx.num_tokens)

  def _skip(self, params, state: ClaspState, ctx: Context):
    """``(skip bool[L], state)``: the set chosen afresh when ``refresh``
    steps have passed, else the one held."""
    fresh = state.age[0] >= self.refresh
    skip_L = jax.lax.cond(
        fresh, lambda: choose_skip(self.target, params, state.hidden,
                                   ctx.cache, self.num_skipped),
        lambda: state.skip[0])
    return skip_L, state.replace(
        skip=jnp.broadcast_to(skip_L, state.skip.shape),
        age=jnp.where(fresh, 1, state.age + 1))

  def propose(self, params, state: ClaspState, ctx: Context, key, num_draft,
              sampling) -> Proposal:
    skip_L, state = self._skip(params, state, ctx)
    B, K = ctx.tokens.shape[0], num_draft
    block_BK = jnp.zeros((B, K), jnp.int32).at[:, 0].set(ctx.newest())

    def logits_at(block_BK, j):
      return self.target.forward(
          params, block_BK, ctx.cache, skip=skip_L, write_cache=False,
          logit_positions_BP=jnp.full((B, 1), j, jnp.int32)).logits[:, 0]

    def step(tok_B, carry):
      block_BK, j = carry
      block_BK = block_BK.at[:, j].set(tok_B)
      return logits_at(block_BK, j), (block_BK, j + 1)

    drafts_BK, probs_BKV, num_B, _ = draft_chain(
        logits_at(block_BK, 0), step, (block_BK, jnp.int32(1)), key, K,
        sampling, self.min_confidence)
    return Proposal(tokens=drafts_BK, probs=probs_BKV, num_drafted=num_B,
                    state=state)

  def propose_tree(self, params, state: ClaspState, ctx: Context, key,
                   num_draft, num_nodes, sampling) -> TreeProposal:
    """An EAGLE-2 dynamic tree of the skipping model (module doc)."""
    del key, sampling  # the tree is the skipping model's top-k: no draws
    skip_L, state = self._skip(params, state, ctx)
    B, W, K = ctx.tokens.shape[0], self.tree_width, num_draft
    T = 1 + (K - 1) * W  # the root, then W slots per level
    depth_T = jnp.asarray(np.concatenate([[0], np.repeat(np.arange(1, K), W)]))
    positions_BT = ctx.cache.lengths[:, None] + depth_T[None, :]
    eye_TT = jnp.eye(T, dtype=bool)
    root_B = ctx.newest()

    def logp(block_BT, anc_BTT, at_BX):
      logits_BXV = self.target.forward(
          params, block_BT, ctx.cache, skip=skip_L, write_cache=False,
          positions_BT=positions_BT, mask_BTT=anc_BTT,
          logit_positions_BP=at_BX).logits
      return jax.nn.log_softmax(logits_BXV.astype(jnp.float32))

    def grow(level, tok_BW, anc_BWT, shared):
      block_BT, anc_BTT = shared
      slots_W = 1 + level * W + jnp.arange(W)
      anc_BWT = anc_BWT | eye_TT[slots_W][None]
      block_BT = block_BT.at[:, slots_W].set(tok_BW)
      anc_BTT = anc_BTT.at[:, slots_W].set(anc_BWT)
      lp_BWW, kid_BWW = jax.lax.top_k(
          logp(block_BT, anc_BTT, jnp.broadcast_to(slots_W, (B, W))), W)
      return lp_BWW, kid_BWW, anc_BWT, (block_BT, anc_BTT)

    block_BT = jnp.zeros((B, T), jnp.int32).at[:, 0].set(root_B)
    anc_BTT = jnp.broadcast_to(eye_TT, (B, T, T))
    score_BW, tok_BW = jax.lax.top_k(
        logp(block_BT, anc_BTT, jnp.zeros((B, 1), jnp.int32))[:, 0], W)
    anc_BWT = jnp.broadcast_to(eye_TT[0], (B, W, T))
    tokens_BC, scores_BC, parents_BC = trees.best_first(
        score_BW, tok_BW, grow, anc_BWT, (block_BT, anc_BTT), K)
    tree = trees.select(root_B, tokens_BC, scores_BC, parents_BC, num_nodes)
    return TreeProposal(tree=tree, state=state)


def _cosine(a_BMD: jax.Array, x_BD: jax.Array) -> jax.Array:
  """``[M]``: each candidate's cosine similarity to x, summed over rows."""
  a = a_BMD.astype(jnp.float32)
  x = x_BD.astype(jnp.float32)[:, None]
  dot = jnp.sum(a * x, axis=-1)
  norms = jnp.linalg.norm(a, axis=-1) * jnp.linalg.norm(x, axis=-1)
  return jnp.sum(dot / jnp.maximum(norms, 1e-20), axis=0)


def skip_programme(target: Target, params, hidden_BID: jax.Array, cache,
                   num_skipped: int) -> tuple[jax.Array, jax.Array]:
  """CLaSp's dynamic programme (module doc) over the hidden states ``x_0 ..
  x_L`` of each row's last cached token (``cache`` holds it: lengths - 1
  is its position), M = ``num_skipped``: ``(skipped bool[L, M], states
  [L, B, M + 1, D])``, whether cell (i, j) took its skip candidate and
  each cell's state g(i, j), i = 1..L."""
  B, L, M = hidden_BID.shape[0], hidden_BID.shape[1] - 1, num_skipped
  prefix = cache.with_lengths(cache.lengths - 1)
  positions_BM = jnp.broadcast_to(prefix.lengths[:, None], (B, M))
  mask_BMM = jnp.broadcast_to(jnp.eye(M, dtype=bool), (B, M, M))
  j_M = np.arange(1, M + 1)
  g_BJD = jnp.zeros((B, M + 1) + hidden_BID.shape[2:], hidden_BID.dtype)
  g_BJD = g_BJD.at[:, 0].set(hidden_BID[:, 0])
  skipped, states = [], []
  for i in range(1, L + 1):
    ran_BMD = target.run_layer(params, i - 1, g_BJD[:, 1:], prefix,
                               positions_BT=positions_BM, mask_BTT=mask_BMM)
    passed_BMD = g_BJD[:, :-1]
    x_BD = hidden_BID[:, i]
    can_run, can_skip = j_M <= i - 1, j_M <= i
    skip_M = can_skip & (~can_run | (_cosine(passed_BMD, x_BD)
                                     > _cosine(ran_BMD, x_BD)))
    g_BJD = jnp.concatenate([x_BD[:, None], jnp.where(
        skip_M[None, :, None], passed_BMD, ran_BMD)], axis=1)
    skipped.append(skip_M)
    states.append(g_BJD)
  return jnp.stack(skipped), jnp.stack(states)


def choose_skip(target: Target, params, hidden_BID: jax.Array, cache,
                num_skipped: int) -> jax.Array:
  """``bool[L]``: the layers ``skip_programme`` skips, read back from its
  cell (L, M)."""
  skipped_LM, _ = skip_programme(target, params, hidden_BID, cache,
                                 num_skipped)
  L = skipped_LM.shape[0]
  skip_L, j = jnp.zeros((L,), bool), jnp.int32(num_skipped)
  for i in range(L, 0, -1):
    took = (j > 0) & skipped_LM[i - 1, jnp.maximum(j - 1, 0)]
    skip_L, j = skip_L.at[i - 1].set(took), j - took
  return skip_L
