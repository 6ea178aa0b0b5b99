"""Draft trees: construction, and exact verification at T = 0 and T > 0."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.core import tree as trees
from specjax.core.sampling import SamplingParams, warp
from specjax.measure import theory
from tests.test_verify import _chi2_ok

V = 6
# A Markov "target": the distribution after a node depends on its token only.
TRANSITIONS = np.random.default_rng(0).dirichlet(np.full(V, 0.7), size=V)


def _tree(tokens, parents, batch=1):
  rep = lambda a: jnp.tile(jnp.asarray(a, jnp.int32)[None], (batch, 1))
  return trees.Tree(tokens=rep(tokens), parents=rep(parents),
                    valid=jnp.ones((batch, len(tokens)), bool))


def test_trie_shares_prefixes_and_cuts_breadth_first():
  """Invariants: a prefix shared by several paths is one node (siblings
  distinct), a path's tokens past its length are no nodes, nodes come
  breadth first with parents before children, and the cut to ``num_nodes``
  keeps a breadth-first prefix (every kept node's parent is kept)."""
  paths = jnp.asarray([[[7, 8, 9], [7, 8, 4], [5, 6, 0], [7, 2, 2]]])
  lengths = jnp.asarray([[3, 3, 2, 1]])
  t = trees.trie(jnp.asarray([1]), paths, lengths, num_nodes=8)
  # depth 1: 7, 5; depth 2: 8 (under 7), 6 (under 5); depth 3: 9, 4 (under 8)
  np.testing.assert_array_equal(t.tokens[0], [1, 7, 5, 8, 6, 9, 4, 0, 0])
  np.testing.assert_array_equal(t.parents[0], [0, 0, 0, 1, 2, 3, 3, 0, 0])
  np.testing.assert_array_equal(t.valid[0], [1] * 7 + [0, 0])
  cut = trees.trie(jnp.asarray([1]), paths, lengths, num_nodes=3)
  np.testing.assert_array_equal(cut.tokens[0], [1, 7, 5, 8])
  np.testing.assert_array_equal(cut.parents[0], [0, 0, 0, 1])
  anc = trees.ancestors(t.parents, t.valid)
  np.testing.assert_array_equal(trees.depths(anc)[0], [0, 1, 1, 2, 2, 3, 3,
                                                       0, 0])
  assert bool(anc[0, 5, 1]) and not bool(anc[0, 5, 2])


def test_trie_asked_for_more_nodes_than_its_paths_hold():
  """Invariant: ``num_nodes`` beyond the P K tokens of the paths (a bound,
  not a count) gives the same trie with the rest invalid, never an error."""
  paths = jnp.asarray([[[7, 8], [5, 6]]])
  lengths = jnp.asarray([[2, 2]])
  t = trees.trie(jnp.asarray([1]), paths, lengths, num_nodes=7)
  np.testing.assert_array_equal(t.tokens[0, :5], [1, 7, 5, 8, 6])
  np.testing.assert_array_equal(t.parents[0, :5], [0, 0, 0, 1, 2])
  np.testing.assert_array_equal(t.valid[0], [1] * 5 + [0] * 3)


@pytest.mark.parametrize("text, words", [
    ("1000x1000", "1001000 nodes, more than 512"),
    (",".join(str(i) for i in range(600)), "600 paths, more than 512"),
    ("0,1,0.0,1", "a path given twice"),
])
def test_tree_shapes_too_big_or_repeated_are_refused(text, words):
  """Invariant: a static shape over ``tree.MAX_NODES`` nodes (it would
  compile for minutes) or with a path given twice is refused by name before
  anything is built."""
  with pytest.raises(ValueError, match=re.escape(words)):
    trees.parse_shape(text)


def _node_paths(t, b):
  """Brute force: the set of row b's valid nodes' root paths."""
  tok, par, val = (np.asarray(a[b]) for a in (t.tokens, t.parents, t.valid))
  out = []
  for m in range(1, len(tok)):
    if val[m]:
      path, j = [], m
      while j:
        path.append(int(tok[j]))
        j = int(par[j])
      out.append(tuple(path[::-1]))
  return out


def test_union_holds_each_path_of_both_trees_once():
  """Invariants of ``tree.union`` on random tries with shared and distinct
  paths, invalid nodes and different depths: its nodes' root paths are the
  union of the two trees' (each once: siblings distinct), parents come
  before children, and the size is N1 + N2 + 1 with the overlap invalid."""
  rng = np.random.default_rng(1)
  B, K = 3, 3
  make = lambda P, n: trees.trie(
      jnp.full((B,), 9), jnp.asarray(rng.integers(0, 3, (B, P, K))),
      jnp.asarray(rng.integers(0, K + 1, (B, P))), n)
  for _ in range(5):
    a, b = make(3, 5), make(4, 6)
    u = trees.union(a, b, K)
    assert u.tokens.shape == (B, 12)
    for r in range(B):
      got = _node_paths(u, r)
      assert len(got) == len(set(got))
      assert set(got) == set(_node_paths(a, r)) | set(_node_paths(b, r))
      par = np.asarray(u.parents[r])
      assert all(par[m] < m for m in range(1, 12) if u.valid[r, m])
    np.testing.assert_array_equal(u.tokens[:, 0], 9)


def test_chain_is_a_tree_with_parents_before():
  t = trees.chain(jnp.asarray([4, 4]), jnp.asarray([[1, 2, 3], [1, 2, 3]]),
                  jnp.asarray([3, 1]))
  anc = trees.ancestors(t.parents, t.valid)
  np.testing.assert_array_equal(trees.depths(anc), [[0, 1, 2, 3],
                                                    [0, 1, 0, 0]])
  np.testing.assert_array_equal(t.num_drafted, [3, 1])


def _verify(t, key, sampling, max_depth):
  probs = jnp.asarray(TRANSITIONS, jnp.float32)[t.tokens]
  anc = trees.ancestors(t.parents, t.valid)
  return trees.verify_tree(t, anc, probs, key, sampling, max_depth)


def test_greedy_emits_the_longest_greedy_path():
  """Invariant at T = 0: the output is the greedy continuation of the root,
  as long as the tree holds it (plus one token), for random tries."""
  rng = np.random.default_rng(1)
  B, P, K = 256, 3, 4
  greedy_next = TRANSITIONS.argmax(1)
  roots = rng.integers(0, V, B)
  paths = rng.integers(0, V, (B, P, K))
  # Make some paths follow the greedy chain for a while.
  for b in range(B):
    tok = roots[b]
    for i in range(rng.integers(0, K + 1)):
      tok = greedy_next[tok]
      paths[b, b % P, i] = tok
  t = trees.trie(jnp.asarray(roots), jnp.asarray(paths),
                 jnp.asarray(rng.integers(0, K + 1, (B, P))), num_nodes=9)
  res = _verify(t, jax.random.key(0), SamplingParams(), K)
  tokens, parents, valid = map(np.asarray, (t.tokens, t.parents, t.valid))
  for b in range(B):
    node, want = 0, []
    while True:  # walk the tree along the greedy chain
      nxt = greedy_next[tokens[b, node]]
      want.append(nxt)
      kids = [m for m in range(1, tokens.shape[1])
              if valid[b, m] and parents[b, m] == node and tokens[b, m] == nxt]
      if not kids:
        break
      node = kids[0]
    n = int(res.num_emitted[b])
    assert np.asarray(res.tokens[b, :n]).tolist() == want, b
  assert int(res.num_accepted.max()) >= 2  # not vacuous


# Root 0; under it 4, 1, a duplicate 4 (node 3: its subtree must never be
# accepted) and 2, which the warped target never produces; an invalid node
# (6); leaves at depths 1 to 3. Tokens follow the warped target's support.
DUP_TOKENS = [0, 4, 1, 4, 2, 1, 0, 5, 3, 5, 5]
DUP_PARENTS = [0, 0, 0, 0, 0, 1, 1, 2, 3, 5, 7]
DUP_VALID = [1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1]
DUP = 3
WARPING = SamplingParams(0.7, 0, 0.8)
WARPED = np.asarray(warp(jnp.log(jnp.asarray(TRANSITIONS)), WARPING),
                    np.float64)


def _first_three(n=50_000, seed=0):
  """The first three tokens after the root over n verifications of the
  tree above under ``WARPING``; tokens a row did not emit are drawn from
  the target (so the triple's law is the target's if verification is
  exact). Also returns the accepted depths."""
  t = _tree(DUP_TOKENS, DUP_PARENTS, batch=n)
  t = t.replace(valid=jnp.tile(jnp.asarray(DUP_VALID, bool)[None], (n, 1)))
  anc = trees.ancestors(t.parents, t.valid)
  probs = jnp.asarray(WARPED, jnp.float32)[t.tokens]
  res = trees.verify_tree(t, anc, probs, jax.random.key(seed), WARPING, 3)
  out = np.array(res.tokens[:, :3])
  emitted = np.asarray(res.num_emitted)
  rng = np.random.default_rng(seed)
  for i in range(1, 3):
    prev = out[:, i - 1]
    fill = (rng.random(n)[:, None] > np.cumsum(WARPED[prev], 1)).sum(1)
    out[:, i] = np.where(emitted > i, out[:, i], np.minimum(fill, V - 1))
  return (out[:, 0] * V + out[:, 1]) * V + out[:, 2], np.asarray(
      res.num_accepted)


def _expected_accepted():
  """E[accepted depth] = sum over acceptable nodes of the product of target
  probabilities along their path (the duplicate's subtree and the invalid
  node excluded)."""
  total = 0.0
  for m in range(1, len(DUP_TOKENS)):
    path, node = [], m
    while node:
      path.append(node)
      node = DUP_PARENTS[node]
    if not DUP_VALID[m] or DUP in path:
      continue
    prob = 1.0
    for node in path:
      prob *= WARPED[DUP_TOKENS[DUP_PARENTS[node]], DUP_TOKENS[node]]
    total += prob
  return total


def _check():
  """Chi-square of the first three tokens (99.9% critical value) and a
  z-test of the mean accepted depth against ``_expected_accepted``."""
  triples, accepted = _first_three()
  joint = (WARPED[0][:, None, None] * WARPED[:, :, None] * WARPED[None])
  stat, crit = _chi2_ok(triples, joint)
  z = (accepted.mean() - _expected_accepted()) / (
      max(accepted.std(), 1e-6) / np.sqrt(accepted.size))
  return stat, crit, z, accepted


def test_sampled_tree_verification_is_exact():
  """Invariants at T = 0.7, top-p 0.8 over 50,000 verifications of a tree
  with a duplicated sibling, an invalid node and leaves at depths 1-3: the
  first three emitted tokens follow the target's joint law (chi-square
  below the 99.9% critical value) and the mean accepted depth equals the
  sum over nodes of the path's target probabilities (|z| < 4);
  test_verification_check_catches_mutations shows the check failing for
  wrong verifiers."""
  stat, crit, z, accepted = _check()
  assert stat < crit, (stat, crit)
  assert abs(z) < 4, z
  assert (accepted >= 2).mean() > 0.05 and (accepted == 0).mean() > 0.1


@pytest.mark.parametrize("mutation", ["own_draw", "duplicates_kept",
                                      "shared_key"])
def test_verification_check_catches_mutations(mutation, monkeypatch):
  """The checks above fail for a node matched against its own draw instead
  of its parent's (nothing is ever accepted: z), for siblings not
  de-duplicated (chi-square 1,209, z 12.9) and for one random draw shared by
  every node (the same Gumbel noise: chi-square 18,664)."""
  if mutation == "own_draw":
    monkeypatch.setattr(trees, "matches", lambda tree, draws: (
        tree.valid & (tree.tokens == draws)))
  elif mutation == "duplicates_kept":
    monkeypatch.setattr(trees, "distinct_siblings", lambda tree: tree.valid)
  else:
    def shared(probs_BMV, sampling, key):
      del sampling
      g = jax.random.gumbel(key, probs_BMV.shape[:1] + (1, V))
      return jnp.argmax(jnp.log(probs_BMV) + g, axis=-1).astype(jnp.int32)
    monkeypatch.setattr(trees, "draw", shared)
  stat, crit, z, _ = _check()
  assert stat > crit or abs(z) > 4, (stat, crit, z)


def test_select_keeps_the_best_nodes_closed_under_ancestors():
  """Invariants of EAGLE-2's rerank for random candidate tables with tied
  scores (children scoring exactly their parent's): the kept nodes are the
  ``num_nodes`` best scores, every kept node's parent is kept and comes
  first, and tokens follow their candidates."""
  rng = np.random.default_rng(2)
  B, W, levels, n = 64, 3, 3, 7
  parents, scores = [-np.ones((B, W), int)], [np.log(rng.random((B, W)))]
  for level in range(1, levels):
    first = sum(p.shape[1] for p in parents[:-1])
    par = rng.integers(0, parents[-1].shape[1], (B, W * W)) + first
    drop = np.where(rng.random((B, W * W)) < 0.3, 0.0,
                    np.log(rng.random((B, W * W))))
    allsc = np.concatenate(scores, 1)
    scores.append(np.take_along_axis(allsc, par, 1) + drop)
    parents.append(par)
  parents, scores = np.concatenate(parents, 1), np.concatenate(scores, 1)
  C = scores.shape[1]
  tokens = np.tile(np.arange(C), (B, 1)) + 100
  t = trees.select(jnp.zeros(B, jnp.int32), jnp.asarray(tokens),
                   jnp.asarray(scores, jnp.float32), jnp.asarray(parents), n)
  tok, par, valid = map(np.asarray, (t.tokens, t.parents, t.valid))
  assert valid.all() and tok.shape == (B, n + 1)
  for b in range(B):
    kept = tok[b, 1:] - 100
    np.testing.assert_allclose(np.sort(scores[b, kept]),
                               np.sort(scores[b])[-n:], rtol=1e-6)
    for m in range(1, n + 1):
      p = par[b, m]
      assert p < m
      want = parents[b, kept[m - 1]]
      assert (p == 0) if want < 0 else (tok[b, p] - 100 == want)


def test_ancestors_and_depths_equal_a_brute_force_walk():
  """Invariant for random trees (parents before children, invalid nodes
  whose subtrees are invalid too): ``ancestors`` holds exactly the nodes
  met walking up the parent links, ``depths`` their count; an invalid node
  sees only itself."""
  rng = np.random.default_rng(3)
  B, M = 32, 12
  parents = np.zeros((B, M), int)
  valid = np.ones((B, M), bool)
  for m in range(1, M):
    parents[:, m] = rng.integers(0, m, B)
    valid[:, m] = valid[np.arange(B), parents[:, m]] & (rng.random(B) < 0.8)
  anc = np.asarray(trees.ancestors(jnp.asarray(parents), jnp.asarray(valid)))
  dep = np.asarray(trees.depths(jnp.asarray(anc)))
  for b in range(B):
    for m in range(M):
      want, node = {m}, m
      while valid[b, m] and node:
        node = parents[b, node]
        want.add(node)
      assert set(np.flatnonzero(anc[b, m])) == want, (b, m)
      assert dep[b, m] == len(want) - 1


def test_static_shapes_parse_print_and_describe_themselves():
  """Invariants: a branching spec is the full tree breadth first; rank
  paths give parents first with siblings in rank order, and print back
  unchanged; ``Shape`` derives depths, ranks and which expanded nodes each
  node's head pair sees (itself and its expanded ancestors); malformed
  shapes are refused naming the problem."""
  np.testing.assert_array_equal(trees.parse_shape("2x2"),
                                trees.static_parents((2, 2)))
  np.testing.assert_array_equal(trees.parse_shape("3"), [0, 0, 0, 0])
  np.testing.assert_array_equal(trees.parse_shape("0"), [0, 0])
  text = "0,1,0.0,0.1,1.0,0.0.0"
  parents = trees.parse_shape(text)
  np.testing.assert_array_equal(parents, [0, 0, 0, 1, 1, 2, 3])
  shape = trees.Shape(parents)
  assert theory.shape_text(shape.paths()) == text
  assert theory.shape_text(trees.Shape(trees.parse_shape(
      "1.0,0,1")).paths()) == "0,1,1.0"
  assert shape.depths == [0, 1, 1, 2, 2, 2, 3] and shape.max_depth == 3
  assert shape.paths() == [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
  assert shape.expanded == [1, 2, 3] and shape.num_nodes == 6
  np.testing.assert_array_equal(shape.scratch_visibility(), [
      [0, 0, 0], [1, 0, 0], [0, 1, 0], [1, 0, 1], [1, 0, 0], [0, 1, 0],
      [1, 0, 1]])
  for bad, why in (("0.1", "lacks its parent"), ("0,2", "skips rank 1"),
                   ("2x0", "bad tree shape"), ("a,b", "bad tree shape")):
    with pytest.raises(ValueError, match=why):
      trees.parse_shape(bad)
  with pytest.raises(ValueError, match="parents"):
    trees.Shape([0, 0, 2])
