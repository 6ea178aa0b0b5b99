"""measure.theory against exact values and against the real chain verifier."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.core import verify
from specjax.measure import theory


@pytest.mark.parametrize("alpha,k,expected", [
    (0.6, 5, 2.38336), (0.9, 5, 4.68559), (0.8, 8, 4.32891), (0.0, 7, 1.0),
    (1.0, 7, 8.0)])
def test_expected_tokens_exact(alpha, k, expected):
  """Invariant: E = (1 − α^(K+1)) / (1 − α): α 0.6 → 2.38 and α 0.9 → 4.69 at
  K = 5 (the lesson's 2.2 and 4.1 are (1 − α^K)/(1 − α): one token short)."""
  assert theory.expected_tokens(alpha, k) == pytest.approx(expected, abs=1e-5)
  assert theory.expected_tokens(0.9, 5) - (1 - 0.9 ** 5) / 0.1 == pytest.approx(
      0.9 ** 5)


@pytest.mark.parametrize("alpha,c,k,speedup", [(0.8, 0.05, 8, 3.09),
                                               (0.95, 0.02, 31, 9.95)])
def test_optimal_k_exact(alpha, c, k, speedup):
  """Invariant: with wall time (K·c + 1)/E, α=0.8, c=0.05 is optimal at K=8
  (3.09×) and α=0.95, c=0.02 at K=31 (9.95×), not the lesson's rounded
  N ≈ 5-7 / 8-10."""
  opt = theory.optimal_k(alpha, c)
  assert opt.k == k
  assert opt.speedup == pytest.approx(speedup, abs=0.005)


def test_lesson_range_for_high_alpha():
  """Invariant: at α=0.95, c=0.02 the lesson's N = 8-10 gives 6.4-7.2×."""
  s = [theory.speedup(0.95, k, 0.02) for k in (8, 9, 10)]
  assert s[0] == pytest.approx(6.4, abs=0.05)
  assert s[-1] == pytest.approx(7.2, abs=0.05)


def test_verify_cost_curve_moves_the_optimum():
  """Invariant: a verify cost growing with K (measured curves do) lowers the
  optimal K compared with the idealised constant cost."""
  flat = theory.optimal_k(0.8, 0.05)
  rising = theory.optimal_k(0.8, 0.05, verify_cost=lambda k: 1 + 0.1 * k)
  assert rising.k < flat.k and rising.speedup < flat.speedup


@pytest.mark.parametrize("alpha", [0.5, 0.8, 0.95])
def test_monte_carlo_with_real_verifier(alpha):
  """Invariant: the real chain verifier, fed a deterministic drafter whose
  every draft the target accepts with probability α (q(draft) = α), emits on
  average (1 − α^(K+1))/(1 − α) tokens per verify: |mean − E| < 4 standard
  errors over 20,000 verifications."""
  n, k, v = 20_000, 6, 5
  q = jnp.full((n, k + 1, v), (1 - alpha) / (v - 1)).at[:, :, 0].set(alpha)
  res = verify.verify_chain(jnp.zeros((n, k), jnp.int32), None, q,
                            jnp.full((n,), k), jax.random.key(int(alpha * 100)))
  emitted = np.asarray(res.num_emitted, np.float64)
  se = emitted.std() / np.sqrt(n)
  assert abs(emitted.mean() - theory.expected_tokens(alpha, k)) < 4 * se


def _rank_closed_trees(max_nodes, depth, ranks):
  """Every tree of rank paths with at most ``max_nodes`` nodes, none deeper
  than ``depth``, ranks < ``ranks``, each node's children ranks 0..c-1 (by
  brute force: grow one child at a time from every frontier)."""
  seen, todo = {()}, [()]
  while todo:
    tree = todo.pop()
    if len(tree) == max_nodes:
      continue
    nodes = [()] + list(tree)
    for parent in nodes:
      if len(parent) == depth:
        continue
      c = sum(1 for q in tree if len(q) == len(parent) + 1 and q[:-1] == parent)
      if c < ranks:
        grown = tuple(sorted(tree + (parent + (c,),)))
        if grown not in seen:
          seen.add(grown)
          todo.append(grown)
  return seen


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_best_tree_is_the_brute_force_optimum(depth):
  """Invariant: for every budget up to 6 nodes, ``best_tree``'s dynamic
  program finds the expected tokens of the best of all rank-closed trees
  (enumerated), and its tree has that value, fits the budget and depth, and
  lists parents before children. Per-depth rank acceptances differ by depth
  (the per-depth Sequoia model), one of them not decreasing in rank."""
  p = [[0.6, 0.2, 0.1], [0.4, 0.3, 0.05], [0.5, 0.1, 0.2]]
  trees = _rank_closed_trees(6, depth, 3)
  for n in range(7):
    want = max(theory.tree_expected_tokens(t, p) for t in trees
               if len(t) <= n)
    plan = theory.best_tree(p, n, depth)
    assert plan.expected_tokens == pytest.approx(want, abs=1e-12)
    assert theory.tree_expected_tokens(plan.paths, p) == pytest.approx(want)
    assert plan.num_nodes <= n and plan.depth <= depth
    assert all(q[:-1] in plan.paths[:i] or len(q) == 1
               for i, q in enumerate(plan.paths))


def test_best_tree_is_a_chain_or_a_star_at_the_extremes():
  """Invariants: with all acceptance on rank 0 the best tree is the chain;
  with depth 1 it is the top-N star; a zero budget is the root alone."""
  chain = theory.best_tree([[0.9, 0.0]] * 4, 4)
  assert chain.paths == ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))
  assert chain.expected_tokens == pytest.approx(
      theory.expected_tokens(0.9, 4))
  star = theory.best_tree([[0.5, 0.3, 0.1, 0.05]], 3)
  assert star.paths == ((0,), (1,), (2,)) and star.spec() == "0,1,2"
  assert theory.best_tree([[0.5]], 0).expected_tokens == 1.0


def test_pearl_steps_at_the_extremes():
  """Invariant: PEARL's two-state chain (``pearl_steps``) at α = 0 never
  leaves pre-verify and emits one token a step; at α = 1 it stays in
  post-verify, K tokens a step; in between it lies between. Against the
  engine: ``test_pearl.test_the_modes_follow_the_theorys_two_state_chain``
  (long)."""
  assert theory.pearl_steps(0.0, 4) == theory.PearlSteps(1.0, 1.0)
  assert theory.pearl_steps(1.0, 4) == theory.PearlSteps(4.0, 0.0)
  mid = theory.pearl_steps(0.7, 4)
  assert 1 < mid.tokens < 4 and 0 < mid.pre_verify < 1
  with pytest.raises(ValueError, match="k >= 1"):
    theory.pearl_steps(0.5, 0)
