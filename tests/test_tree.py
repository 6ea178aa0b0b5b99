"""Draft trees: construction, and exact verification at T = 0 and T > 0."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import tree as trees
from specjax.sampling import SamplingParams
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


# Root 0; under it 1 and a duplicate 1 with different children, and 3.
DUP_TOKENS = [0, 1, 1, 3, 4, 5, 2]
DUP_PARENTS = [0, 0, 0, 0, 1, 2, 3]


def _joint_first_two(n=50_000, seed=0):
  """The first two tokens after the root, over n independent verifications
  of the tree above at T = 1; rows that emitted one token get the second
  from the target (so the pair's law is the target's if verification is
  exact)."""
  t = _tree(DUP_TOKENS, DUP_PARENTS, batch=n)
  res = _verify(t, jax.random.key(seed), SamplingParams(1.0), max_depth=2)
  first = np.asarray(res.tokens[:, 0])
  second = np.asarray(res.tokens[:, 1])
  rng = np.random.default_rng(seed)
  alone = np.asarray(res.num_emitted) == 1
  u = rng.random(n)[:, None]
  fill = (u > np.cumsum(TRANSITIONS[first], axis=1)).sum(1)
  second = np.where(alone, fill, second)
  return first * V + second, (~alone).mean()


def test_sampled_tree_verification_is_exact():
  """Invariant: at T = 1 the first two emitted tokens follow the target's
  joint law (chi-square, 99.9% critical value, 50,000 verifications of a
  tree with a duplicated sibling); test_verification_check_catches_mutations
  shows the same check failing for wrong verifiers."""
  joint = TRANSITIONS[0][:, None] * TRANSITIONS
  pairs, accepted = _joint_first_two()
  assert 0.2 < accepted < 0.9  # both cases occur
  stat, crit = _chi2_ok(pairs, joint)
  assert stat < crit, (stat, crit)


@pytest.mark.parametrize("mutation", ["own_draw", "duplicates_kept"])
def test_verification_check_catches_mutations(mutation, monkeypatch):
  """The chi-square above fails for a node matched against its own draw
  instead of its parent's, and for siblings not de-duplicated."""
  if mutation == "own_draw":
    monkeypatch.setattr(trees, "matches", lambda tree, draws: (
        tree.valid & (tree.tokens == draws)))
  else:
    monkeypatch.setattr(trees, "distinct_siblings", lambda tree: tree.valid)
  joint = TRANSITIONS[0][:, None] * TRANSITIONS
  stat, crit = _chi2_ok(_joint_first_two()[0], joint)
  assert stat > crit, (stat, crit)


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
