"""EAGLE chain drafting inside the engine (EAGLE-3 heads, and EAGLE-1 ones).

The head consumes pairs (target feature at position t, token t + 1). Its
"stable" KV cache holds one entry per committed pair; it lags the target:
after a step that committed c tokens (accepted drafts and the bonus or
correction; PEARL's accepted chain takes no bonus), of n in all, pairs
t < n - 1 - c are in the cache and the last c pairs are *pending*: their
target features came with the verify forward (``commit(features=...)``,
kept as ``pending [B, K + 1, F]``, rows past c unread) and their tokens are
committed tokens.

``propose`` runs the pending pairs through the head as one padded block of
K + 1 (ragged c per row), takes the head output at each row's last valid pair
and drafts K tokens, feeding its own outputs back as features (the scratch
entries it writes past the stable length are overwritten next time). Draft
probabilities are the head's warped distribution over Vd scattered into the
full vocabulary (zero elsewhere), so verification stays exact.

``propose_tree`` drafts an EAGLE-2 dynamic tree instead (``_expand``): the
``tree_width`` W best tokens under the root, then, level by level, the W best
children of each of the level's W best nodes by cumulative log-probability
(one head block of W pairs per level, under an ancestor mask over the
scratch entries), and finally the ``num_nodes`` best of all candidates
(``tree.select``). With a ``tree_shape`` (a static tree: a branching spec,
rank paths, or a Sequoia tree sized by ``theory.best_tree``) the shape is
fixed instead: every node with children is fed to the head, level by level,
and its i-th child is the head's i-th best token there (``_expand_static``).
Either way the tree is the head's top-k, drawn from nothing, so it is fixed
before the target scores it and ``tree.verify_tree`` is exact at every
temperature. ``commit`` then receives the target features gathered
along the accepted path, so the head's state is as after a chain.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from specjax.core import tree as trees
from specjax.core.cache import KVCache, write_kv
from specjax.drafters.base import Context, Proposal, TreeProposal
from specjax.drafters.chain import draft_chain
from specjax.heads import head_call
from specjax.heads.base import HeadConfig
from specjax.heads.vocab import full_vocab_logits
from specjax.models import layers


@struct.dataclass
class EagleParams:
  """Drafter params: the head's, the draft vocabulary and the frozen embedding.

  Attributes:
    head: the head's parameter dict (``Eagle3Head`` or ``Eagle1Head``).
    draft_ids: ``int32[Vd]`` target id of each draft index.
    embed: ``[V, D]`` the target's token embedding (shared, not copied).
  """
  head: Any
  draft_ids: jax.Array
  embed: jax.Array


@struct.dataclass
class EagleState:
  """Attributes:
    cache: the head's one-layer ``KVCache`` (the target's layout and code);
      its lengths count the stable (committed-pair) entries.
    pending: ``[B, K + 1, F]`` target features of the last verified block.
  """
  cache: KVCache
  pending: jax.Array

  @property
  def lengths(self) -> jax.Array:
    return self.cache.lengths

  def with_lengths(self, lengths_B: jax.Array) -> "EagleState":
    return self.replace(cache=self.cache.with_lengths(lengths_B))


def behind_slots(num_draft: int) -> int:
  """The slots of a P-EAGLE block that drafts K behind up to K - 1 unscored
  tokens (``EagleDrafter.propose_behind``, PEARL's): 2K - 1."""
  return 2 * num_draft - 1


@dataclasses.dataclass(frozen=True)
class EagleDrafter:
  """Chain drafting with an EAGLE-3 head (``cfg``). ``init`` sizes the
  pending-feature buffer to ``K + 1`` rows for the K it is given, so the
  decode loop's state keeps its shape; ``propose`` checks it is asked for
  that K.

  ``tree_shape`` (``tree.parse_shape`` of a branching spec or of rank
  paths) makes ``propose_tree`` draft that static tree instead of a dynamic
  one.

  ``min_confidence`` > 0 gives dynamic K: a row's chain ends before the first
  draft whose head distribution (over Vd, before temperature) has its top
  probability below the threshold. The rule reads distributions, never the
  drawn token, so verification stays exact; a step where no row drafts costs
  one single-token target forward (``engine.step``; PEARL's forward is
  always K wide).
  """
  cfg: HeadConfig
  min_confidence: float = 0.0
  tree_width: int = 4
  tree_shape: tuple[int, ...] = ()  # a static tree's parents, root first
  needs_params: ClassVar[bool] = True  # EagleParams

  @property
  def feature_taps(self) -> tuple[int, ...]:
    return self.cfg.taps

  def _call(self, params: EagleParams, method, *args):
    return head_call(self.cfg, params.head)(method, *args)

  def _run(self, params, state: EagleState, tok_BT, h_BTD, slots_BT=None,
           positions_BT=None, visible_BTS=None):
    """Head layer over T new pairs, written at ``slots`` and attending to
    the ``visible`` slots, on the target's attention code. Default: a chain
    block at each row's cache end (prefix + causal); pairs past a row's
    valid count are harmless there: causality hides them from the valid
    ones, and the next write starts at the row's stable length."""
    B, T = tok_BT.shape
    c, cache = self.cfg, state.cache
    if slots_BT is None:
      slots_BT = positions_BT = cache.new_slots(T)
      visible_BTS = layers.attention_mask(cache.lengths, layers.causal_mask(
          B, T), cache.capacity)
    q, k, v, resid = self._call(params, "project", tok_BT, h_BTD,
                                params.embed, positions_BT)
    kc, vc = write_kv(cache.k[0], cache.v[0], k, v, slots_BT)
    mask_BQS = jnp.repeat(visible_BTS, c.num_heads // c.num_kv_heads, axis=1)
    out = self._call(params, "finish", resid,
                     layers.attention(q, kc, vc, mask_BQS))
    return out, state.replace(cache=cache.replace(k=(kc,), v=(vc,)))

  def init(self, params: EagleParams, prompt: Context, capacity, num_draft,
           features=None):
    """Pairs (g_t, x_{t+1}) for t < len - 1 go in the cache; the last
    prompt position's feature is pending (its token is the first sample)."""
    prompt_BT, prompt_lengths_B = prompt.tokens, prompt.num_tokens
    B, Tp = prompt_BT.shape
    c = self.cfg
    state = EagleState(cache=KVCache.init(1, B, capacity, c.num_kv_heads,
                                          c.head_dim, params.embed.dtype),
                       pending=None)
    h = self._call(params, "features", features)
    nxt = jnp.concatenate([prompt_BT[:, 1:], prompt_BT[:, -1:]], axis=1)
    _, state = self._run(params, state, nxt, h)
    last = jnp.take_along_axis(
        features, (prompt_lengths_B - 1)[:, None, None], axis=1)  # [B,1,F]
    pending = jnp.concatenate(
        [last, jnp.zeros((B, num_draft) + last.shape[2:], last.dtype)],
        axis=1)
    return state.with_lengths(prompt_lengths_B - 1).replace(pending=pending)

  def commit(self, params, state: EagleState, ctx: Context, features=None):
    del params, ctx
    return state.replace(pending=features.astype(state.pending.dtype))

  def _start(self, params: EagleParams, state: EagleState, ctx: Context,
             num_draft):
    """Runs the pending pairs through the head: ``(state, stable, a)`` with
    ``stable [B]`` = committed pairs now in the cache (num_tokens - 1) and
    ``a [B, D]`` the head output that predicts the first draft."""
    if state.pending.shape[1] != num_draft + 1:
      raise ValueError(f"EagleDrafter state made for K="
                       f"{state.pending.shape[1] - 1}, asked for {num_draft}")
    tokens_BS, num_tokens_B = ctx.tokens, ctx.num_tokens
    S = tokens_BS.shape[1]
    P = state.pending.shape[1]  # K + 1 (after the prefill only row 0 is real)
    # Pending pairs: (g_t, x_{t+1}) for t = lengths .. num_tokens - 2.
    count_B = num_tokens_B - 1 - state.lengths
    idx_BP = jnp.clip(state.lengths[:, None] + 1 + jnp.arange(P)[None, :], 0,
                      S - 1)
    tok_BP = jnp.take_along_axis(tokens_BS, idx_BP, axis=1)
    h_BPD = self._call(params, "features", state.pending)
    out_BPD, state = self._run(params, state, tok_BP, h_BPD)
    a_BD = jnp.take_along_axis(out_BPD, (count_B - 1)[:, None, None],
                               axis=1)[:, 0]
    return state, state.lengths + count_B, a_BD

  def propose(self, params: EagleParams, state: EagleState, ctx: Context,
              key, num_draft, sampling) -> Proposal:
    V = params.embed.shape[0]
    state, stable_B, a_BD = self._start(params, state, ctx, num_draft)
    if self.cfg.variant == "peagle":
      return self._propose_block(
          params, state, stable_B,
          self.block_outputs(params, state, stable_B, a_BD, num_draft), key,
          num_draft, sampling)

    def logits(a_BD):
      """Head output -> logits over the full vocabulary (-inf off Vd)."""
      return full_vocab_logits(self._call(params, "logits", a_BD[:, None]),
                               params.draft_ids, V)[:, 0]

    def step(tok_B, carry):
      st, a_BD = carry
      out, st = self._run(params, st, tok_B[:, None], a_BD[:, None])
      return logits(out[:, 0]), (st.with_lengths(st.lengths + 1), out[:, 0])

    scratch = state.with_lengths(stable_B)  # draft entries: overwritten
    drafts_BK, probs_BKV, num_B, _ = draft_chain(
        logits(a_BD), step, (scratch, a_BD), key, num_draft, sampling,
        self.min_confidence)
    return Proposal(tokens=drafts_BK, probs=probs_BKV, num_drafted=num_B,
                    state=state.with_lengths(stable_B))

  def block_outputs(self, params: EagleParams, state: EagleState, stable_B,
                    a_BD, num_draft):
    """A P-EAGLE head's block: slot 0's output ``a`` (the pending pairs'
    last, at position ``stable - 1``), then K - 1 placeholder slots run as
    one block at positions ``stable .. stable + K - 2``, each seeing the
    prefix (slot 0 included) and the slots before it. Returns the K outputs
    ``[B, K, D]``; the placeholders' cache entries are scratch. Refuses a
    block deeper than the head's trained depths (``check_block``)."""
    self.cfg.check_block(num_draft)
    B, T = a_BD.shape[0], num_draft - 1
    tok_BT = jnp.full((B, T), self.cfg.mask_token, jnp.int32)
    h_BTD = self._call(params, "placeholders", tok_BT)
    out_BTD, _ = self._run(params, state.with_lengths(stable_B), tok_BT,
                           h_BTD)
    return jnp.concatenate([a_BD[:, None], out_BTD.astype(a_BD.dtype)], 1)

  @property
  def drafts_behind(self) -> bool:
    """Whether ``propose_behind`` can draft (``Drafter``): a P-EAGLE
    block's slots read no draft."""
    return self.cfg.variant == "peagle"

  def propose_behind(self, params: EagleParams, state: EagleState,
                     ctx: Context, behind_B, key, num_draft,
                     sampling) -> Proposal:
    """K drafts for the positions after ``ctx``'s committed tokens and
    ``behind_B`` (< K) more that the target has not scored (PEARL's
    pending drafts): a block of 2K - 1 slots, row b's drafts from slots
    ``behind_B[b] ..`` on. Slots read placeholders, never the tokens
    behind, so each draft's distribution is its slot's whatever those
    tokens are."""
    if not self.drafts_behind:
      raise ValueError(f"a {self.cfg.variant} head drafts each token from "
                       "the one before it; only a P-EAGLE block drafts "
                       "behind unscored tokens")
    state, stable_B, a_BD = self._start(params, state, ctx, num_draft)
    out_BXD = self.block_outputs(params, state, stable_B, a_BD,
                                 behind_slots(num_draft))
    at_BK = behind_B[:, None] + jnp.arange(num_draft)[None, :]
    return self._propose_block(
        params, state, stable_B,
        jnp.take_along_axis(out_BXD, at_BK[..., None], axis=1), key,
        num_draft, sampling)

  def _propose_block(self, params: EagleParams, state: EagleState, stable_B,
                     out_BKD, key, num_draft, sampling) -> Proposal:
    """K drafts from a block's K slot outputs (``block_outputs``): draft i
    is drawn from slot i's own distribution, which no other draft changed,
    so the chain rule's verification is exact (``draft_chain`` over the K
    logits)."""
    V = params.embed.shape[0]
    logits_BKV = full_vocab_logits(self._call(params, "logits", out_BKD),
                                   params.draft_ids, V)
    step = lambda tok_B, i: (jax.lax.dynamic_index_in_dim(
        logits_BKV, i, axis=1, keepdims=False), i + 1)
    drafts_BK, probs_BKV, num_B, _ = draft_chain(
        logits_BKV[:, 0], step, jnp.int32(1), key, num_draft, sampling,
        self.min_confidence)
    return Proposal(tokens=drafts_BK, probs=probs_BKV, num_drafted=num_B,
                    state=state.with_lengths(stable_B))

  def propose_tree(self, params: EagleParams, state: EagleState,
                   ctx: Context, key, num_draft, num_nodes, sampling
                   ) -> TreeProposal:
    """An EAGLE-2 dynamic tree (module doc), ``num_draft`` levels deep, or
    the static ``tree_shape``."""
    del key, sampling  # the tree is the head's top-k: no draws
    if self.cfg.variant == "peagle" and self.tree_shape:
      raise ValueError("a P-EAGLE head's trees are built from its block's "
                       "marginals, not a static tree_shape")
    if self.tree_shape:
      shape = trees.Shape(self.tree_shape)
      shape.check(num_nodes, num_draft, self.cfg.draft_vocab)
    elif self.tree_width > self.cfg.draft_vocab:
      raise ValueError(f"tree width {self.tree_width} exceeds the draft "
                       f"vocabulary ({self.cfg.draft_vocab})")
    state, stable_B, a_BD = self._start(params, state, ctx, num_draft)
    root_B = ctx.newest()
    if self.tree_shape:
      tree, _ = self._expand_static(params, state, stable_B, a_BD, root_B,
                                    shape)
    elif self.cfg.variant == "peagle":
      tokens_BC, scores_BC, parents_BC = self._expand_block(
          params, state, stable_B, a_BD, num_draft)
      tree = trees.select(root_B, tokens_BC, scores_BC, parents_BC, num_nodes)
    else:
      tokens_BC, scores_BC, parents_BC = self._expand(
          params, state, stable_B, a_BD, num_draft)
      tree = trees.select(root_B, tokens_BC, scores_BC, parents_BC, num_nodes)
    return TreeProposal(tree=tree, state=state.with_lengths(stable_B))

  def _top(self, params, out_BXD, c: int):
    """The head's ``c`` best tokens after each of X outputs ``[B, X, D]``:
    their log-probabilities and target ids, ``[B, X, c]`` each."""
    logp_BXV = jax.nn.log_softmax(self._call(params, "logits", out_BXD))
    # The barrier keeps XLA's CPU top-k a TopK call: fused into what uses
    # it, it became a sort of the whole vocabulary (a P-EAGLE tree's draft
    # took 4.5x as long). One barrier per output: over top-k's tuple, it
    # crashed XLA's top-k decomposer on a vocabulary split over a mesh.
    lp_BXC, idx_BXC = map(jax.lax.optimization_barrier,
                          jax.lax.top_k(logp_BXV, c))
    return lp_BXC, params.draft_ids[idx_BXC].astype(jnp.int32)

  def _expand_block(self, params, state: EagleState, stable_B, a_BD,
                    num_draft):
    """Candidates of a tree from a P-EAGLE block's K marginals
    (``trees.best_first`` without a forward per level): depth d's children
    of any node are the W best tokens of slot d - 1, scored by the sum of
    their slots' log-probabilities, since no slot saw another's token."""
    out_BKD = self.block_outputs(params, state, stable_B, a_BD, num_draft)
    lp_BKW, tok_BKW = self._top(params, out_BKD, self.tree_width)
    B, _, W = tok_BKW.shape
    each = lambda a_BW: jnp.broadcast_to(a_BW[:, None], (B, W, W))

    def grow(level, tok_BW, nodes, shared):
      del tok_BW  # every node's children are the same slot's best
      lp_BWW, kid_BWW = (each(a[:, level + 1]) for a in (lp_BKW, tok_BKW))
      return lp_BWW, kid_BWW, nodes, shared
    return trees.best_first(lp_BKW[:, 0], tok_BKW[:, 0], grow, (), (),
                            num_draft)

  def _expand_static(self, params, state: EagleState, stable_B, a_BD,
                     root_B, shape):
    """The static tree ``shape``: the root's children are the head's best
    tokens after the pending pairs (``a``); then, depth by depth, the nodes
    that have children go through the head as one block (position ``stable
    + depth - 1``, each in its own scratch slot, seeing the prefix, its
    ancestors' slots and its own) and child i of a node is the head's i-th
    best token after it. Returns ``(tree, state)`` (the state with the
    scratch entries, for tests; drafting drops them)."""
    B, S = a_BD.shape[0], state.cache.capacity
    expanded = shape.expanded  # non-root nodes with children, in order
    scratch_ME = shape.scratch_visibility()  # [M, E] static
    rel_BS = jnp.arange(S)[None, :] - stable_B[:, None]
    in_scratch_BS = (rel_BS >= 0) & (rel_BS < len(expanded))
    tok = {0: root_B}
    out_of = {0: a_BD}  # the head output after each expanded node

    def add_children(nodes, out_BnD):
      c = max(len(shape.children[j]) for j in nodes)
      _, kid_BnC = self._top(params, out_BnD, c)
      for row, j in enumerate(nodes):
        for r, child in enumerate(shape.children[j]):
          tok[child] = kid_BnC[:, row, r]

    add_children([0], a_BD[:, None])
    for depth in range(1, shape.max_depth):
      nodes = [j for j in expanded if shape.depths[j] == depth]
      vis_nE = jnp.asarray(scratch_ME[nodes])
      vis_BnS = jnp.take(vis_nE, jnp.clip(rel_BS, 0, len(expanded) - 1),
                         axis=1).transpose(1, 0, 2)
      seen_BnS = ((rel_BS < 0)[:, None, :]
                  | (in_scratch_BS[:, None, :] & vis_BnS))
      slots_Bn = stable_B[:, None] + jnp.asarray(
          [expanded.index(j) for j in nodes])[None, :]
      out_BnD, state = self._run(
          params, state, jnp.stack([tok[j] for j in nodes], 1),
          jnp.stack([out_of[shape.parents[j]] for j in nodes], 1), slots_Bn,
          jnp.broadcast_to(stable_B[:, None] + depth - 1, slots_Bn.shape),
          seen_BnS)
      for row, j in enumerate(nodes):
        out_of[j] = out_BnD[:, row]
      add_children(nodes, out_BnD)
    M = shape.num_nodes + 1
    return trees.Tree(
        tokens=jnp.stack([tok[j] for j in range(M)], 1).astype(jnp.int32),
        parents=jnp.broadcast_to(jnp.asarray(shape.parents, jnp.int32),
                                 (B, M)),
        valid=jnp.ones((B, M), bool)), state

  def _expand(self, params, state: EagleState, stable_B, a_BD, num_draft):
    """Candidates of an EAGLE-2 tree (``trees.best_first``), W =
    tree_width: each level's frontier is fed to the head as one block of W
    pairs at position ``stable + level`` that sees the prefix, its
    ancestors' scratch entries and itself. Returns ``(tokens, scores,
    parents)``, each ``[B, C]``, C = W + (K - 1) W²."""
    B, W, S = a_BD.shape[0], self.tree_width, state.cache.capacity
    top = lambda out_BXD: self._top(params, out_BXD, W)

    def grow(level, tok_BW, nodes, state):
      feat_BWD, seen_BWS = nodes
      slots_BW = stable_B[:, None] + level * W + jnp.arange(W)[None, :]
      seen_BWS = seen_BWS | (jnp.arange(S)[None, None, :]
                             == slots_BW[..., None])
      out_BWD, state = self._run(
          params, state, tok_BW, feat_BWD, slots_BW,
          jnp.broadcast_to(stable_B[:, None] + level, (B, W)), seen_BWS)
      return (*top(out_BWD), (out_BWD, seen_BWS), state)

    score_BW, tok_BW = (x[:, 0] for x in top(a_BD[:, None]))
    feat_BWD = jnp.broadcast_to(a_BD[:, None], (B, W, a_BD.shape[-1]))
    seen_BWS = jnp.broadcast_to((jnp.arange(S)[None, :] < stable_B[:, None]
                                 )[:, None], (B, W, S))
    return trees.best_first(score_BW, tok_BW, grow, (feat_BWD, seen_BWS),
                            state, num_draft)
