"""Medusa drafting inside the engine: every depth from one hidden state.

A Medusa head (``heads.medusa``) reads the target's last hidden state at the
newest position the target has run, t = num_tokens - 2 (the newest committed
token, t + 1, was drawn from the target's logits there and is the root of
the next block), and scores token t + 2 + k at depth k. The verify forward
hands those hidden states over (``commit(features=...)``: the block's, or a
tree's accepted path in path order); the state keeps them with the position
of the first, so ``propose`` picks the one at t.

``propose`` drafts a chain: draft k is drawn from depth k's warped
distribution (over Vd, scattered into the full vocabulary), through the
shared chain loop (``draft_chain``; dynamic K reads the depths'
distributions). The depths do not see the drafts before them, which is
allowed: the verifier only needs each draft drawn from the distribution
reported for it. ``propose_tree`` drafts the static ``tree_shape``: node m
at depth d with rank r among its siblings is depth d - 1's r-th best token
(siblings are distinct ranks, so distinct tokens). The tree is fixed before
the target scores it, so ``tree.verify_tree`` is exact at every temperature.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.core import tree as trees
from specjax.drafters.base import Context, Proposal, TreeProposal
from specjax.drafters.chain import draft_chain
from specjax.heads import head_call
from specjax.heads.base import HeadConfig
from specjax.heads.vocab import full_vocab_logits


@struct.dataclass
class MedusaParams:
  """Attributes:
    head: the ``MedusaHead`` parameter dict.
    draft_ids: ``int32[Vd]`` target id of each draft index.
  """
  head: Any
  draft_ids: jax.Array


@struct.dataclass
class MedusaState:
  """Attributes:
    hidden: ``[B, K + 1, F]`` the target's tapped hidden states of the last
      verified block (or accepted path).
    start: ``int32[B]`` the position of ``hidden[:, 0]``.
  """
  hidden: jax.Array
  start: jax.Array


@dataclasses.dataclass(frozen=True)
class MedusaDrafter:
  """Chains and static trees from a Medusa head (``cfg``); K (and a tree's
  depth) at most ``cfg.medusa_heads``. ``min_confidence`` > 0: dynamic K
  as for the other model drafters."""
  cfg: HeadConfig
  min_confidence: float = 0.0
  tree_shape: tuple[int, ...] = ()  # a static tree's parents, root first
  needs_params: ClassVar[bool] = True  # MedusaParams

  def __post_init__(self):
    if self.cfg.variant != "medusa":
      raise ValueError(f"MedusaDrafter needs a Medusa head, got "
                       f"{self.cfg.variant}")

  @property
  def feature_taps(self) -> tuple[int, ...]:
    return self.cfg.taps

  def init(self, params: MedusaParams, prompt: Context, capacity, num_draft,
           features=None):
    """The prompt's last hidden state, at position length - 1."""
    del params, capacity
    B = features.shape[0]
    last = jnp.take_along_axis(
        features, (prompt.num_tokens - 1)[:, None, None], axis=1)
    hidden = jnp.concatenate(
        [last, jnp.zeros((B, num_draft) + last.shape[2:], last.dtype)], 1)
    return MedusaState(hidden=hidden, start=prompt.num_tokens - 1)

  def commit(self, params, state: MedusaState, ctx: Context, features=None):
    del params, ctx
    return state.replace(hidden=features.astype(state.hidden.dtype))

  def _logits(self, params: MedusaParams, state: MedusaState, num_tokens_B,
              num_draft: int):
    """``(logits [B, K, Vd], state)``: the first K depths' logits after the
    newest position the target ran; the state expects the next block's
    hidden states from the root's position on."""
    if state.hidden.shape[1] != num_draft + 1:
      raise ValueError(f"MedusaDrafter state made for K="
                       f"{state.hidden.shape[1] - 1}, asked for {num_draft}")
    if num_draft > self.cfg.medusa_heads:
      raise ValueError(f"K={num_draft} exceeds the Medusa head's "
                       f"{self.cfg.medusa_heads} depths")
    at_B11 = (num_tokens_B - 2 - state.start)[:, None, None]
    taps_B1F = jnp.take_along_axis(state.hidden, at_B11, axis=1)
    call = head_call(self.cfg, params.head)
    out_BKD = call("outputs", call("features", taps_B1F))[:, 0, :num_draft]
    return (call("logits", out_BKD),
            state.replace(start=num_tokens_B - 1))

  def propose(self, params: MedusaParams, state: MedusaState, ctx: Context,
              key, num_draft, sampling) -> Proposal:
    logits_BKVd, state = self._logits(params, state, ctx.num_tokens,
                                      num_draft)
    V = self.cfg.target_vocab
    depth = lambda i: full_vocab_logits(
        jax.lax.dynamic_index_in_dim(logits_BKVd, i, 1, keepdims=False),
        params.draft_ids, V)
    # The chain loop feeds each draft back; the depths ignore it.
    drafts_BK, probs_BKV, num_B, _ = draft_chain(
        depth(0), lambda tok_B, i: (depth(i), i + 1), jnp.int32(1), key,
        num_draft, sampling, self.min_confidence)
    return Proposal(tokens=drafts_BK, probs=probs_BKV, num_drafted=num_B,
                    state=state)

  def propose_tree(self, params: MedusaParams, state: MedusaState,
                   ctx: Context, key, num_draft, num_nodes, sampling
                   ) -> TreeProposal:
    """The static ``tree_shape`` over the depths' top-k (module doc)."""
    del key, sampling  # the tree is the head's top-k: no draws
    if not self.tree_shape:
      raise ValueError("Medusa trees are static: give MedusaDrafter a "
                       "tree_shape")
    shape = trees.Shape(self.tree_shape)
    shape.check(num_nodes, num_draft, self.cfg.draft_vocab)
    logits_BKVd, state = self._logits(params, state, ctx.num_tokens,
                                      num_draft)
    _, top_BKC = jax.lax.top_k(logits_BKVd, max(map(len, shape.children)))
    depth_M = np.asarray(shape.depths[1:]) - 1
    rank_M = np.asarray([path[-1] for path in shape.paths()])
    B, M = ctx.tokens.shape[0], shape.num_nodes + 1
    root_B = ctx.newest()
    tokens_BM = jnp.concatenate(
        [root_B[:, None], params.draft_ids[top_BKC[:, depth_M, rank_M]]], 1)
    return TreeProposal(tree=trees.Tree(
        tokens=tokens_BM.astype(jnp.int32),
        parents=jnp.broadcast_to(jnp.asarray(shape.parents, jnp.int32),
                                 (B, M)),
        valid=jnp.ones((B, M), bool)), state=state)
