"""Chain verification preserves the target distribution exactly.

Every statistical test draws N independent verifications (one per batch row),
compares the emitted tokens' histogram with the target's exact distribution by
a chi-square test, and passes when the statistic is below the 99.9% critical
value of chi2(dof = support - 1): a correct verifier fails one such check in a
thousand runs; keys are fixed, so the suite is deterministic. The mutation
tests run the very same check against deliberately wrong verifiers and require
it to fail, proving the check has teeth.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from specjax.core import verify
from specjax.core.sampling import SamplingParams, warp

N = 50_000
V = 6
K = 3
# Target q and draft p for positions 0..K (p only for 0..K-1); p is
# deliberately far from q, including a token p proposes that q never emits
# (index 5 at position 0) and one q likes that p never proposes (index 4).
Q = np.array([[0.30, 0.05, 0.20, 0.25, 0.20, 0.00],
              [0.10, 0.40, 0.10, 0.10, 0.10, 0.20],
              [0.25, 0.25, 0.10, 0.10, 0.20, 0.10],
              [0.05, 0.05, 0.50, 0.20, 0.10, 0.10]], np.float32)
P = np.array([[0.10, 0.30, 0.20, 0.10, 0.00, 0.30],
              [0.30, 0.10, 0.30, 0.10, 0.10, 0.10],
              [0.10, 0.10, 0.10, 0.40, 0.20, 0.10]], np.float32)


def _chi2_ok(samples, probs):
  """(statistic, critical value) of a chi-square fit; zero-prob tokens must
  never appear (they would make the statistic infinite)."""
  samples = np.asarray(samples).ravel()
  probs = np.asarray(probs, np.float64).ravel()
  counts = np.bincount(samples, minlength=probs.size)
  if counts[probs == 0].any():
    return np.inf, 0.0
  support = probs > 0
  expected = probs[support] * samples.size
  stat = ((counts[support] - expected) ** 2 / expected).sum()
  return stat, scipy.stats.chi2.ppf(0.999, support.sum() - 1)


def _draft(key, p_KV, n=N):
  """n rows of K drafts, position i sampled from p_KV[i]."""
  keys = jax.random.split(key, p_KV.shape[0])
  return jnp.stack([jax.random.categorical(k, jnp.log(p), shape=(n,))
                    for k, p in zip(keys, p_KV)], axis=1).astype(jnp.int32)


def _first_tokens(p_KV=P, q_K1V=Q, num_draft=None, key=0, one_hot=False):
  k_draft, k_verify = jax.random.split(jax.random.key(key))
  if one_hot:  # a deterministic drafter always proposing token 2
    drafts = jnp.full((N, K), 2, jnp.int32)
    draft_probs = None
  else:
    drafts = _draft(k_draft, jnp.asarray(p_KV))
    draft_probs = jnp.broadcast_to(jnp.asarray(p_KV), (N,) + p_KV.shape)
  num = jnp.full((N,), K, jnp.int32) if num_draft is None else num_draft
  res = jax.jit(verify.verify_chain)(
      drafts, draft_probs, jnp.broadcast_to(jnp.asarray(q_K1V), (N, K + 1, V)),
      num, jax.random.key(key + 100))
  return res, drafts


def test_first_token_is_target_distributed():
  """Invariant: the first emitted token ~ q[0] (chi-square, 99.9%)."""
  res, _ = _first_tokens()
  stat, crit = _chi2_ok(res.tokens[:, 0], Q[0])
  assert stat < crit, (stat, crit)


def test_one_hot_drafts():
  """Invariant: with a deterministic drafter (p = one-hot, passed as None)
  the first emitted token still ~ q[0]."""
  res, _ = _first_tokens(one_hot=True)
  stat, crit = _chi2_ok(res.tokens[:, 0], Q[0])
  assert stat < crit, (stat, crit)


def test_ragged_num_draft_batch():
  """Invariant: rows drafting 0, 1, 2 or 3 tokens in one batch each emit a
  first token ~ q[0]; rows with 0 drafts emit exactly one (bonus) token and
  no row emits more than num_draft + 1."""
  num = jnp.asarray(np.arange(N) % (K + 1), jnp.int32)
  res, _ = _first_tokens(num_draft=num)
  for d in range(K + 1):
    rows = np.asarray(num) == d
    stat, crit = _chi2_ok(np.asarray(res.tokens)[rows, 0], Q[0])
    assert stat < crit, (d, stat, crit)
  assert (np.asarray(res.num_emitted)[np.asarray(num) == 0] == 1).all()
  assert (np.asarray(res.num_emitted) <= np.asarray(num) + 1).all()


def test_joint_first_two_positions():
  """Invariant: the first two tokens of the output sequence ~ q0(a) q1(b | a)
  jointly (36 cells). q1 depends on the first token, and the second token
  comes from the same step when the first draft was accepted, else from a
  second verification step started after the correction."""
  rng = np.random.default_rng(0)
  q1_given = rng.dirichlet(np.ones(V), size=V).astype(np.float32)  # [a, V]
  q1_given[:, 3] = 0  # a token the target never emits at position 1
  q1_given /= q1_given.sum(1, keepdims=True)
  k1, k2, k3, k4 = jax.random.split(jax.random.key(5), 4)
  drafts = _draft(k1, jnp.asarray(P[:2]))
  # Step 1 target: q0, then q1 given the *drafted* first token, then a bonus.
  q_step1 = np.stack([np.broadcast_to(Q[0], (N, V)), q1_given[drafts[:, 0]],
                      np.broadcast_to(Q[2], (N, V))], axis=1)
  p = jnp.broadcast_to(jnp.asarray(P[:2]), (N, 2, V))
  res1 = verify.verify_chain(drafts, p, jnp.asarray(q_step1),
                             jnp.full((N,), 2), k2)
  first = np.asarray(res1.tokens[:, 0])
  # Rows that emitted one token verify a fresh draft for position 1.
  drafts2 = _draft(k3, jnp.asarray(P[1:2]))
  q_step2 = np.stack([q1_given[first], np.broadcast_to(Q[2], (N, V))], axis=1)
  res2 = verify.verify_chain(drafts2, jnp.broadcast_to(jnp.asarray(P[1:2]),
                                                       (N, 1, V)),
                             jnp.asarray(q_step2), jnp.ones((N,), jnp.int32),
                             k4)
  second = np.where(np.asarray(res1.num_emitted) >= 2,
                    np.asarray(res1.tokens[:, 1]), np.asarray(res2.tokens[:, 0]))
  joint = Q[0][:, None] * q1_given
  stat, crit = _chi2_ok(first * V + second, joint)
  assert stat < crit, (stat, crit)


@pytest.mark.parametrize("sp", [SamplingParams(0.7, 0, 1.0),
                                SamplingParams(1.3, 4, 1.0),
                                SamplingParams(0.9, 0, 0.8),
                                SamplingParams(1.0, 5, 0.7)],
                         ids=["temperature", "top_k", "top_p", "all"])
def test_with_warping(sp):
  """Invariant: when drafter and target logits go through the same warp
  (temperature, top-k, top-p), the first token ~ warp(target logits)[0],
  including when warping zeroes tokens the drafter proposes."""
  rng = np.random.default_rng(1)
  q = np.asarray(warp(jnp.asarray(rng.normal(0, 1.5, (K + 1, V))), sp))
  p = np.asarray(warp(jnp.asarray(rng.normal(0, 1.5, (K, V))), sp))
  res, _ = _first_tokens(p_KV=p, q_K1V=q, key=3)
  stat, crit = _chi2_ok(res.tokens[:, 0], q[0])
  assert stat < crit, (stat, crit)


@pytest.mark.parametrize("mutation", ["correction_from_q", "accept_p_over_q"])
def test_check_catches_wrong_verifiers(mutation, monkeypatch):
  """Invariant (mutation check): the same chi-square check FAILS for a
  verifier that samples the correction from q instead of the residual, and
  for one that accepts with min(1, p/q) instead of min(1, q/p)."""
  jax.clear_caches()  # re-trace the jitted verifier with the mutation in place
  if mutation == "correction_from_q":
    monkeypatch.setattr(verify, "_residual", lambda q, p: q)
  else:
    monkeypatch.setattr(verify, "_accept", lambda u, p, q: u * q < p)
  try:
    res, _ = _first_tokens()
  finally:
    jax.clear_caches()  # never let a mutated trace serve another test
  stat, crit = _chi2_ok(res.tokens[:, 0], Q[0])
  assert stat > crit, (stat, crit)


def test_greedy_rule_and_ragged_acceptance():
  """Invariant (T = 0, the seed's exercise): row A's drafts all equal the
  target argmax and it emits K + 1 tokens (bonus = argmax at K); row B's third
  draft differs and it emits its 2 accepted drafts plus the argmax correction;
  row C drafts nothing and emits the argmax. Nothing past num_emitted is set."""
  argmax = jnp.array([3, 1, 4, 2])
  q = jax.nn.one_hot(jnp.broadcast_to(argmax, (3, K + 1)), V)
  drafts = jnp.array([[3, 1, 4], [3, 1, 5], [0, 0, 0]], jnp.int32)
  res = verify.verify_chain(drafts, None, q, jnp.array([3, 3, 0]),
                            jax.random.key(0), greedy=True)
  np.testing.assert_array_equal(res.num_emitted, [4, 3, 1])
  np.testing.assert_array_equal(res.num_accepted, [3, 2, 0])
  np.testing.assert_array_equal(res.tokens, [[3, 1, 4, 2], [3, 1, 4, 0],
                                             [3, 0, 0, 0]])


def test_zero_probability_cases():
  """Invariant: a draft the target gives probability 0 is always rejected; a
  draft with p = 0 but q > 0 is always accepted."""
  q = jnp.broadcast_to(jnp.asarray(Q[:2]), (1000, 2, V))
  p = jnp.broadcast_to(jnp.asarray(P[:1]), (1000, 1, V))
  rej = verify.verify_chain(jnp.full((1000, 1), 5, jnp.int32), p, q,
                            jnp.ones((1000,), jnp.int32), jax.random.key(1))
  assert (np.asarray(rej.num_accepted) == 0).all()  # Q[0, 5] == 0
  acc = verify.verify_chain(jnp.full((1000, 1), 4, jnp.int32), p, q,
                            jnp.ones((1000,), jnp.int32), jax.random.key(2))
  assert (np.asarray(acc.num_accepted) == 1).all()  # P[0, 4] == 0 < Q[0, 4]


# Full depth: a Markov target q(b | a) and a Markov draft p(b | a) over three
# tokens, K = 4, every row drafting 0..4 tokens at random each step.
V3, K4, DEPTH = 3, 4, 5
Q_MARKOV = np.array([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.3, 0.1, 0.6]])
P_MARKOV = np.array([[0.5, 0.3, 0.2], [0.3, 0.5, 0.2], [0.2, 0.2, 0.6]])


def _markov_rows(n=N, seed=0):
  """The first DEPTH tokens n rows emit after token 0 by drafting (up to K4
  drafts per step, ragged) and verifying until each has DEPTH tokens; and
  how many rows emitted all K4 + 1 tokens of a step at least once."""
  rng = np.random.default_rng(seed)
  step = jax.jit(verify.verify_chain)
  out = np.zeros((n, 0), np.int64)
  last = lengths = np.zeros(n, np.int64)
  full = np.zeros(n, bool)
  for i in range(DEPTH):
    drafts = np.zeros((n, K4), np.int64)
    prev = last
    for j in range(K4):  # draft j ~ p(. | the token before it)
      u = rng.random(n)[:, None]
      drafts[:, j] = (u > np.cumsum(P_MARKOV[prev], 1)).sum(1)
      prev = drafts[:, j]
    before = np.concatenate([last[:, None], drafts], 1)  # [n, K4 + 1]
    num = rng.integers(0, K4 + 1, n)
    res = step(jnp.asarray(drafts, jnp.int32),
               jnp.asarray(P_MARKOV[before[:, :K4]], jnp.float32),
               jnp.asarray(Q_MARKOV[before], jnp.float32),
               jnp.asarray(num, jnp.int32), jax.random.key(100 + i))
    emitted, toks = np.asarray(res.num_emitted), np.asarray(res.tokens)
    full |= (num == K4) & (emitted == K4 + 1)
    # Append each row's emitted tokens after its own.
    grown = np.zeros((n, out.shape[1] + K4 + 1), np.int64)
    grown[:, :out.shape[1]] = out
    cols = lengths[:, None] + np.arange(K4 + 1)[None]
    keep = np.arange(K4 + 1)[None] < emitted[:, None]
    rows = np.broadcast_to(np.arange(n)[:, None], cols.shape)
    grown[rows[keep], cols[keep]] = toks[keep]
    out, lengths = grown, lengths + emitted
    last = out[np.arange(n), lengths - 1]
  assert (lengths >= DEPTH).all()
  return out[:, :DEPTH], full.sum()


def _markov_joint():
  joint = np.ones([V3] * DEPTH)
  for cell in np.ndindex(*joint.shape):
    prev = 0
    for t in cell:
      joint[cell] *= Q_MARKOV[prev, t]
      prev = t
  return joint


def test_full_depth_chain_with_bonus():
  """Invariant: over whole K = 4 chains with ragged num_draft (0..4 per row
  and step), the first five emitted tokens -- accepted drafts at every
  position, corrections, and the bonus after four accepted drafts -- follow
  the Markov target's joint law over all 243 cells (chi-square, 99.9%), and
  thousands of rows did emit a full K + 1 block."""
  tokens, full = _markov_rows()
  stat, crit = _chi2_ok(np.ravel_multi_index(tokens.T, (V3,) * DEPTH),
                        _markov_joint())
  assert stat < crit, (stat, crit)
  assert full > 1000, full


@pytest.mark.parametrize("mutation", ["draft_verified_one_position_early",
                                      "bonus_from_the_last_draft_position"])
def test_full_depth_check_catches_wrong_positions(mutation, monkeypatch):
  """Invariant (mutation check): the full-depth check FAILS when draft i is
  verified against position i - 1's target distribution, and when the bonus
  is drawn from the last draft's position instead of the bonus position."""
  if mutation == "draft_verified_one_position_early":
    monkeypatch.setattr(verify, "_draft_targets", lambda q, K: jnp.concatenate(
        [q[:, :1], q[:, :K - 1]], 1))
  else:
    from specjax.core.rows import at_rows
    monkeypatch.setattr(verify, "_extra_target", lambda q, num_acc: at_rows(
        q, jnp.minimum(num_acc, q.shape[1] - 2)))
  jax.clear_caches()
  try:
    tokens, _ = _markov_rows()
  finally:
    jax.clear_caches()
  stat, crit = _chi2_ok(np.ravel_multi_index(tokens.T, (V3,) * DEPTH),
                        _markov_joint())
  assert stat > crit, (stat, crit)
