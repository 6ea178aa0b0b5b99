"""Draft trees in fixed shapes, and their exact verification.

A tree holds M nodes per row (static): node 0 is the root, the row's newest
committed token (fed to the target like the first token of a chain block);
every other node is a drafted token whose parent comes before it
(``parents[b, m] < m``). ``valid`` marks the nodes a row really drafted; an
invalid node sees only itself in the target forward and is never accepted. A
chain of K drafts is the tree with parents ``m - 1``.

The target scores all M nodes in one forward: node m sits at position
``length + depth[m]`` and attends to the row's cache plus its ancestors
(``ancestors``), so its logits are the target's distribution after the path
root -> m, exactly as if that path had been fed alone.

Verification (``verify_tree``) is for trees fixed before the target is
consulted (tries, static shapes, deterministic top-k): draw one target token
``y[m]`` per node (the argmax at temperature 0, else an independent sample of
the warped distribution), accept node m iff its token equals its parent's
draw and all its ancestors are accepted, and emit the deepest accepted path
followed by that node's draw. Why the output follows the target exactly:
every ``y[m]`` is a draw from the target given that node's path, made before
(and independently of) anything the walk decides; the walk emits ``y[root]``,
and whenever that token is a child of the current node it moves there and
emits the child's draw, else it stops. So each emitted token is a fresh draw
from the target given everything emitted before it, and stopping depends only
on tokens already emitted: ancestral sampling with a stopping rule. This
needs sibling tokens to be distinct (a duplicate would make the walk's move
depend on which copy it takes; ``verify_tree`` ignores later duplicates) and
the tree to be fixed before any draw. At temperature 0 it is the longest
path of greedy tokens: the output equals greedy decoding token for token.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.core.rows import at_rows, set_at_rows
from specjax.core.sampling import Sampler, draw


@struct.dataclass
class Tree:
  """Attributes:
    tokens: ``int32[B, M]``, node 0 the root.
    parents: ``int32[B, M]``, ``parents[:, 0] == 0``, else below the node.
    valid: ``bool[B, M]``, node 0 always valid; a valid node's parent valid.
  """
  tokens: jax.Array
  parents: jax.Array
  valid: jax.Array

  @property
  def num_drafted(self) -> jax.Array:
    """``int32[B]`` valid nodes besides the root."""
    return jnp.sum(self.valid[:, 1:], axis=1).astype(jnp.int32)


def ancestors(parents_BM: jax.Array, valid_BM: jax.Array) -> jax.Array:
  """``bool[B, M, M]``: ``[b, m, j]`` iff node j is m or an ancestor of m.
  An invalid node is its own only ancestor. Built in node order, which is
  parents-first, so one pass suffices."""
  B, M = parents_BM.shape
  anc_BMM = jnp.broadcast_to(jnp.eye(M, dtype=bool), (B, M, M))
  for m in range(1, M):
    inherited = at_rows(anc_BMM, parents_BM[:, m]) & valid_BM[:, m, None]
    anc_BMM = anc_BMM.at[:, m].set(anc_BMM[:, m] | inherited)
  return anc_BMM


def depths(anc_BMM: jax.Array) -> jax.Array:
  """``int32[B, M]``: ancestors other than the node itself."""
  return (jnp.sum(anc_BMM, axis=-1) - 1).astype(jnp.int32)


def positions(lengths_B: jax.Array, anc_BMM: jax.Array) -> jax.Array:
  """``int32[B, M]`` RoPE positions: the root at the row's cache length,
  every node at its depth further on (not at its index in the block)."""
  return lengths_B[:, None] + depths(anc_BMM)


def chain(root_B: jax.Array, drafts_BK: jax.Array,
          num_draft_B: jax.Array) -> Tree:
  """The tree of a chain: root, then drafts i < ``num_draft`` in a line."""
  B, K = drafts_BK.shape
  tokens = jnp.concatenate([root_B[:, None], drafts_BK], axis=1)
  parents = jnp.broadcast_to(jnp.maximum(jnp.arange(K + 1) - 1, 0), (B, K + 1))
  valid = jnp.arange(K + 1)[None, :] <= num_draft_B[:, None]
  return Tree(tokens=tokens.astype(jnp.int32), parents=parents.astype(
      jnp.int32), valid=valid)


# The most drafted nodes of a tree: its ancestor mask is built by one traced
# step per node, so compile time grows with the count (and a verify forward
# scores M + 1 tokens a row).
MAX_NODES = 512


def static_parents(branching: tuple[int, ...]) -> np.ndarray:
  """Parents of a full tree, breadth first: ``branching[d]`` children under
  every node at depth d (``(2, 2)`` -> 1 + 2 + 4 = 7 nodes)."""
  parents, level = [0], [0]
  for width in branching:
    nxt = []
    for p in level:
      for _ in range(width):
        nxt.append(len(parents))
        parents.append(p)
    level = nxt
  return np.asarray(parents, np.int32)


def paths_parents(paths) -> np.ndarray:
  """Parents of the tree of rank paths (Medusa's "choices"): path ``(0, 2)``
  is the root's best child's third-best child. Every prefix of a path must
  be a path too, a node's children must be ranks 0..c-1, and no path may
  come twice. Nodes breadth first, siblings by rank, so child i of a node
  is its i-th best token."""
  paths = [tuple(int(r) for r in q) for q in paths]
  if len(set(paths)) < len(paths):
    raise ValueError("a path given twice")
  paths = sorted(paths, key=lambda q: (len(q), q))
  index = {(): 0}
  parents = [0]
  for q in paths:
    if q[:-1] not in index:
      raise ValueError(f"tree path {q} lacks its parent path {q[:-1]}")
    if q[-1] > 0 and q[:-1] + (q[-1] - 1,) not in index:
      raise ValueError(f"tree path {q} skips rank {q[-1] - 1}")
    index[q] = len(parents)
    parents.append(index[q[:-1]])
  return np.asarray(parents, np.int32)


def parse_shape(text: str) -> np.ndarray:
  """Parents of a static tree written as a branching spec (``"2x2x1"``:
  children per node at each depth; ``"4"``: four under the root) or as rank
  paths (``"0,1,0.0,0.1"``: comma-separated, ranks joined by dots;
  ``theory.shape_text`` writes these; ``"0"`` is the one-node tree)."""
  text = text.strip()
  try:
    if re.fullmatch(r"[1-9]\d*(x\d+)*", text):
      branching = tuple(int(w) for w in text.split("x"))
      if min(branching) < 1:
        raise ValueError
      nodes = sum(math.prod(branching[:d + 1]) for d in range(len(branching)))
      if nodes > MAX_NODES:
        raise ValueError(f"{nodes} nodes, more than {MAX_NODES}")
      return static_parents(branching)
    paths = text.split(",")
    if len(paths) > MAX_NODES:
      raise ValueError(f"{len(paths)} paths, more than {MAX_NODES} nodes")
    return paths_parents(tuple(int(r) for r in q.split(".")) for q in paths)
  except ValueError as e:
    why = f" ({e})" if str(e) else ""
    raise ValueError(f"bad tree shape {text!r}: want a branching spec like "
                     f"2x2x1 or rank paths like 0,1,0.0{why}") from None


class Shape:
  """A static tree's shape (host-side; node 0 the root, parents first,
  siblings in rank order: child i is the i-th best token after its parent).
  """

  def __init__(self, parents):
    self.parents = tuple(int(p) for p in parents)
    if not self.parents or self.parents[0] != 0 or any(
        not 0 <= p < m for m, p in enumerate(self.parents) if m):
      raise ValueError(f"tree shape {self.parents}: need parents[0] = 0 and "
                       "0 <= parents[m] < m")
    self.children = [[] for _ in self.parents]
    self.depths = [0] * len(self.parents)
    for m, p in enumerate(self.parents[1:], 1):
      self.children[p].append(m)
      self.depths[m] = self.depths[p] + 1
    # Non-root nodes the head expands (they have children), in node order.
    self.expanded = [m for m in range(1, len(self.parents))
                     if self.children[m]]

  @property
  def num_nodes(self) -> int:
    """Drafted nodes (the root excluded)."""
    return len(self.parents) - 1

  @property
  def max_depth(self) -> int:
    return max(self.depths)

  def check(self, num_nodes: int, num_draft: int, num_ranks: int) -> None:
    """Raises ValueError unless the shape has ``num_nodes`` drafted nodes,
    none deeper than ``num_draft``, and no node more than ``num_ranks``
    children (a head's draft vocabulary)."""
    width = max(map(len, self.children))
    if (self.num_nodes != num_nodes or self.max_depth > num_draft
        or width > num_ranks):
      raise ValueError(f"tree_shape has {self.num_nodes} nodes, depth "
                       f"{self.max_depth}, {width} children at most; asked "
                       f"for {num_nodes} nodes, depth <= {num_draft}, ranks "
                       f"within the draft vocabulary ({num_ranks})")

  def paths(self) -> list[tuple[int, ...]]:
    """Each drafted node's rank path (its rank among its siblings at every
    depth from the root), in node order: ``theory.shape_text`` writes them
    as ``parse_shape`` reads them."""
    path = {0: ()}
    for m in range(1, len(self.parents)):
      path[m] = path[self.parents[m]] + (self.children[self.parents[m]].index(
          m),)
    return [path[m] for m in range(1, len(self.parents))]

  def scratch_visibility(self) -> np.ndarray:
    """``bool[M, E]``: expanded node e (``expanded[e]``) is node m or one of
    its ancestors: the head's scratch entries node m's pair attends to."""
    pos = {m: e for e, m in enumerate(self.expanded)}
    vis = np.zeros((len(self.parents), len(self.expanded)), bool)
    for m in range(1, len(self.parents)):
      a = m
      while a:
        if a in pos:
          vis[m, pos[a]] = True
        a = self.parents[a]
    return vis


def trie(root_B: jax.Array, paths_BPK: jax.Array, lengths_BP: jax.Array,
         num_nodes: int) -> Tree:
  """The trie of P token paths under the root, each path's first
  ``lengths[b, p]`` tokens: a prefix shared by several paths is one node, so
  siblings are distinct. Nodes are numbered breadth first (by depth, then
  by the first path through them, so earlier paths come first) and the
  first ``num_nodes`` are kept: ``M = num_nodes + 1`` nodes, root included.
  Keeping a breadth-first prefix keeps every kept node's parent. More nodes
  than the paths hold (P K) leave the rest invalid."""
  B, P, K = paths_BPK.shape
  if num_nodes > P * K:  # empty paths: candidates that are never valid
    extra = -(-num_nodes // K) - P
    paths_BPK = jnp.concatenate(
        [paths_BPK, jnp.zeros((B, extra, K), paths_BPK.dtype)], axis=1)
    lengths_BP = jnp.concatenate(
        [lengths_BP, jnp.zeros((B, extra), lengths_BP.dtype)], axis=1)
    P += extra
  live_BPK = jnp.arange(K)[None, None, :] < lengths_BP[..., None]
  # same[b, p, q, i]: paths p and q agree on tokens 0..i and both reach i.
  same_BPPK = jnp.cumprod(
      paths_BPK[:, :, None] == paths_BPK[:, None, :], axis=-1).astype(bool)
  same_BPPK &= live_BPK[:, :, None] & live_BPK[:, None, :]
  first_BPK = jnp.argmax(same_BPPK, axis=2)  # first path through the node
  own_BPK = live_BPK & (first_BPK == jnp.arange(P)[None, :, None])
  # Depth-major candidate order: candidate (i, p) -> i * P + p.
  flat = lambda a_BPK: a_BPK.transpose(0, 2, 1).reshape(B, K * P)
  valid_BC = flat(own_BPK)
  parent_BPK = jnp.concatenate(
      [jnp.full((B, P, 1), -1),
       (jnp.arange(K - 1)[None, None, :] * P + first_BPK[:, :, :-1])], axis=2)
  parent_BC = flat(parent_BPK)  # -1: the root
  # Keep the first num_nodes valid candidates, renumbered 1..num_nodes.
  rank_BC = jnp.cumsum(valid_BC, axis=1) - 1
  keep_BC = valid_BC & (rank_BC < num_nodes)
  order_BC = jnp.argsort(~keep_BC, axis=1, stable=True)[:, :num_nodes]
  pick = lambda a_BC: jnp.take_along_axis(a_BC, order_BC, axis=1)
  parent_old_BM = pick(parent_BC)
  parent_BM = jnp.where(parent_old_BM < 0, 0, 1 + jnp.take_along_axis(
      rank_BC, jnp.maximum(parent_old_BM, 0), axis=1))
  valid_BM = pick(keep_BC)
  return Tree(
      tokens=jnp.concatenate([root_B[:, None], jnp.where(
          valid_BM, pick(flat(paths_BPK)), 0)], axis=1).astype(jnp.int32),
      parents=jnp.concatenate([jnp.zeros((B, 1), jnp.int32),
                               jnp.where(valid_BM, parent_BM, 0)],
                              axis=1).astype(jnp.int32),
      valid=jnp.concatenate([jnp.ones((B, 1), bool), valid_BM], axis=1))


def node_paths(tree: Tree, max_depth: int) -> tuple[jax.Array, jax.Array]:
  """Every drafted node's root path: ``(tokens [B, M - 1, max_depth],
  lengths [B, M - 1])``; path m is the tokens of node m + 1's ancestors
  below the root and its own, by depth (length 0 for an invalid node).
  ``trie`` of these paths is the tree again."""
  anc_BMM = ancestors(tree.parents, tree.valid)
  depth_BM = depths(anc_BMM)
  at_BMKM = anc_BMM[:, :, None, :] & (
      depth_BM[:, None, None, :] == 1 + jnp.arange(max_depth)[None, None, :,
                                                              None])
  tokens_BMK = jnp.sum(jnp.where(at_BMKM, tree.tokens[:, None, None, :], 0),
                       axis=-1)
  return tokens_BMK[:, 1:], jnp.where(tree.valid, depth_BM, 0)[:, 1:]


def union(first: Tree, second: Tree, max_depth: int) -> Tree:
  """One tree holding both trees' nodes (same roots), a path the two share
  once: the trie of their node paths, ``first``'s before ``second``'s at
  each depth. It has ``M = N1 + N2 + 1`` nodes, padded with invalid ones
  where the trees overlap, so nothing is cut."""
  (p1, n1), (p2, n2) = (node_paths(t, max_depth) for t in (first, second))
  num_nodes = p1.shape[1] + p2.shape[1]
  return trie(first.tokens[:, 0], jnp.concatenate([p1, p2], axis=1),
              jnp.concatenate([n1, n2], axis=1), num_nodes)


def best_first(score_BW: jax.Array, tok_BW: jax.Array, grow, nodes, shared,
               num_levels: int):
  """EAGLE-2's dynamic tree candidates, level by level: the W best tokens
  under the root (``tok``, their log-probabilities ``score``), then under
  each of the W best nodes of the level before (by cumulative
  log-probability), their W best children. ``grow(level, tokens [B, W],
  nodes, shared) -> (logp [B, W, W], children [B, W, W], nodes, shared)``
  scores the frontier's children; ``nodes`` (leaves ``[B, W, ...]``, one
  per frontier node) is passed on to each picked child from its parent,
  ``shared`` as is.
  Returns ``(tokens, scores, parents)`` for ``select``, each ``[B, C]``
  with C = W + (num_levels - 1) W² in level order (parents -1 for the
  root's children)."""
  B, W = tok_BW.shape
  toks, scores = [tok_BW.astype(jnp.int32)], [score_BW]
  parents = [jnp.full((B, W), -1, jnp.int32)]
  node_BW = jnp.broadcast_to(jnp.arange(W, dtype=jnp.int32), (B, W))
  first = W  # candidate index of the next level's first entry
  for level in range(num_levels - 1):
    lp_BWW, kid_BWW, nodes, shared = grow(level, tok_BW, nodes, shared)
    cum_BX = (score_BW[..., None] + lp_BWW).reshape(B, W * W)
    toks.append(kid_BWW.reshape(B, W * W).astype(jnp.int32))
    scores.append(cum_BX)
    parents.append(jnp.repeat(node_BW, W, axis=1))
    # The next frontier: the W best of these W * W children.
    _, pick_BW = jax.lax.top_k(cum_BX, W)
    from_BW = pick_BW // W  # which frontier node is the parent
    nodes = jax.tree.map(lambda a: jnp.take_along_axis(a, from_BW.reshape(
        (B, W) + (1,) * (a.ndim - 2)), axis=1), nodes)
    tok_BW = jnp.take_along_axis(toks[-1], pick_BW, axis=1)
    score_BW = jnp.take_along_axis(cum_BX, pick_BW, axis=1)
    node_BW = first + pick_BW
    first += W * W
  return (jnp.concatenate(toks, 1), jnp.concatenate(scores, 1),
          jnp.concatenate(parents, 1))


def select(root_B: jax.Array, tokens_BC: jax.Array, scores_BC: jax.Array,
           parents_BC: jax.Array, num_nodes: int) -> Tree:
  """The tree of the ``num_nodes`` best-scoring candidates (EAGLE-2's
  rerank). Candidates come parents first (``parents_BC`` < own index, -1 for
  the root's children) and score no higher than their parent (cumulative
  log-probabilities). ``lax.top_k`` puts the lower index first among equal
  scores, so a child never displaces its tied parent: the selection is
  closed under ancestors. Kept nodes stay in candidate order; ``M =
  num_nodes + 1`` nodes, padded with invalid ones if there are fewer
  candidates; a candidate scoring -inf is invalid."""
  B, C = tokens_BC.shape
  N = min(num_nodes, C)
  pick_BN = jnp.sort(jax.lax.top_k(scores_BC, N)[1], axis=1)
  new_BC = set_at_rows(jnp.full((B, C), -1, jnp.int32), pick_BN,
                       jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32),
                                        (B, N)))
  parent_old_BN = jnp.take_along_axis(parents_BC, pick_BN, axis=1)
  parent_BN = jnp.where(parent_old_BN < 0, 0, 1 + jnp.take_along_axis(
      new_BC, jnp.maximum(parent_old_BN, 0), axis=1))
  valid_BN = jnp.isfinite(jnp.take_along_axis(scores_BC, pick_BN, axis=1))
  pad = lambda a, fill: jnp.pad(a, ((0, 0), (1, num_nodes - N)),
                                constant_values=fill)
  tokens = pad(jnp.where(valid_BN, jnp.take_along_axis(tokens_BC, pick_BN, 1),
                         0), 0).at[:, 0].set(root_B)
  return Tree(tokens=tokens.astype(jnp.int32),
              parents=pad(jnp.where(valid_BN, parent_BN, 0), 0).astype(
                  jnp.int32),
              valid=pad(valid_BN, False).at[:, 0].set(True))


def distinct_siblings(tree: Tree) -> jax.Array:
  """``bool[B, M]`` valid nodes that no earlier valid sibling duplicates
  (the root, its own parent by convention, is nobody's sibling)."""
  M = tree.tokens.shape[1]
  m = jnp.arange(M)
  earlier_MM = (m[None, :] < m[:, None]) & (m[None, :] > 0)
  same_BMM = ((tree.parents[:, :, None] == tree.parents[:, None, :])
              & (tree.tokens[:, :, None] == tree.tokens[:, None, :])
              & tree.valid[:, None, :]
              & earlier_MM[None])
  return tree.valid & ~jnp.any(same_BMM, axis=-1)


def matches(tree: Tree, draws_BM: jax.Array) -> jax.Array:
  """``bool[B, M]``: node m's token is its parent's target draw (and m is a
  valid node no earlier sibling duplicates)."""
  return distinct_siblings(tree) & (
      tree.tokens == jnp.take_along_axis(draws_BM, tree.parents, axis=1))


@struct.dataclass
class TreeResult:
  """Output of ``verify_tree``.

  Attributes:
    tokens: ``int32[B, max_depth + 1]``: the accepted path's tokens (root
      excluded), then the last accepted node's draw; zero past
      ``num_emitted``.
    num_emitted: ``int32[B]`` = accepted + 1.
    num_accepted: ``int32[B]`` depth of the last accepted node.
    path: ``int32[B, max_depth + 1]`` node at each depth of the accepted path
      (``path[:, 0] == 0``; entries past the depth repeat the last node).
  """
  tokens: jax.Array
  num_emitted: jax.Array
  num_accepted: jax.Array
  path: jax.Array


def verify_tree(tree: Tree, anc_BMM: jax.Array, target_probs_BMV: jax.Array,
                key: jax.Array, sampling: Sampler,
                max_depth: int) -> TreeResult:
  """Exact verification of a tree fixed before the target scored it (module
  doc): one target draw per node, the deepest path of matching draws.

  Args:
    tree: the drafted tree (``ancestors(tree.parents, tree.valid)`` is
      ``anc_BMM``).
    target_probs_BMV: the warped target distribution after each node.
    sampling: greedy (argmax draws) or not (samples, independent per node).
    max_depth: static bound on any valid node's depth.
  """
  B, M = tree.tokens.shape
  draws_BM = draw(target_probs_BMV.astype(jnp.float32), sampling, key)
  matched_BM = matches(tree, draws_BM).at[:, 0].set(True)
  accepted_BM = ~jnp.any(anc_BMM & ~matched_BM[:, None, :], axis=-1)
  depth_BM = depths(anc_BMM)
  last_B = jnp.argmax(jnp.where(accepted_BM, depth_BM, -1), axis=1)
  num_acc_B = at_rows(depth_BM, last_B)
  on_path_BM = at_rows(anc_BMM, last_B)
  at_depth_BK1M = on_path_BM[:, None, :] & (
      depth_BM[:, None, :] == jnp.arange(max_depth + 1)[None, :, None])
  path_BK1 = jnp.where(jnp.any(at_depth_BK1M, axis=-1),
                       jnp.argmax(at_depth_BK1M, axis=-1), last_B[:, None])
  idx_BK1 = jnp.arange(max_depth + 1)[None, :]
  next_BK1 = jnp.take_along_axis(
      tree.tokens, jnp.concatenate([path_BK1[:, 1:], path_BK1[:, -1:]], 1), 1)
  tokens_BK1 = jnp.where(idx_BK1 < num_acc_B[:, None], next_BK1, 0)
  tokens_BK1 = jnp.where(idx_BK1 == num_acc_B[:, None],
                         at_rows(draws_BM, last_B)[:, None], tokens_BK1)
  return TreeResult(tokens=tokens_BK1.astype(jnp.int32),
                    num_emitted=num_acc_B + 1, num_accepted=num_acc_B,
                    path=path_BK1.astype(jnp.int32))
