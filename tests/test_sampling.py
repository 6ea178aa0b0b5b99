"""specjax.core.sampling: parity with transformers' warpers, greedy decoding, a
chi-square test of ``sample_logits`` (with its mutation check) and validation.
"""

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
import torch
from transformers.generation import logits_process as hf_lp

from specjax.core.sampling import SamplingParams, sample, sample_logits, warp

V = 37
TEMPERATURES = (0.5, 1.0, 1.7)
TOP_KS = (0, 1, 3, 10, V + 13)  # 0: off; V + 13: more than the vocab
# 1: off; 1e-3: below any top probability (>= 1/V), so only the top survives.
TOP_PS = (1.0, 0.9, 0.5, 1e-3)
MIN_PS = (0.0, 0.1, 0.6)  # 0: off
GRID = list(itertools.product(TEMPERATURES, TOP_KS, TOP_PS, MIN_PS))


def _parity_rows() -> np.ndarray:
  """f32[R, V] logits: random rows, rows with exact ties at the top-k cut and
  rows whose top-p cut falls inside a group of exactly tied tokens."""
  rng = np.random.default_rng(0)
  rows = [r for r in rng.normal(0.0, 2.0, (8, V)).astype(np.float32)]
  for k in (1, 3, 10):  # the (k+1)-th largest logit equals the k-th
    r = rng.normal(0.0, 2.0, V).astype(np.float32)
    order = np.argsort(-r)
    r[order[k]] = r[order[k - 1]]
    rows.append(r)
  # Mass on three tokens, p(5) > p(9) == p(20): for T in {1, 1.7} the cut of
  # top_p 0.5 falls between 9 and 20 (p(5) < 0.5 < p(5) + p(9)).
  r = np.full(V, -30.0, np.float32)
  r[[5, 9, 20]] = [1.0, 0.5, 0.5]
  rows.append(r)
  r = np.full(V, -30.0, np.float32)  # tied top tokens; small top_p cuts them
  r[[3, 30]] = 2.0
  rows.append(r)
  return np.stack(rows)


def _transformers_warp(logits: np.ndarray, sp: SamplingParams):
  """transformers' warpers in ``generate``'s order (``_get_logits_processor``).

  Returns ``(probs, tempered_logits, pre_top_p_logits)`` as f32 numpy.
  """
  scores = torch.tensor(logits, dtype=torch.float32)
  scores = hf_lp.TemperatureLogitsWarper(float(sp.temperature))(None, scores)
  tempered = scores.clone()
  if sp.top_k:
    scores = hf_lp.TopKLogitsWarper(sp.top_k)(None, scores)
  pre_top_p = scores.clone()
  if sp.top_p < 1:
    scores = hf_lp.TopPLogitsWarper(sp.top_p)(None, scores)
  return (torch.softmax(scores, dim=-1).numpy(), tempered.numpy(),
          pre_top_p.numpy())


def _tie_closed_reference(logits: np.ndarray, sp: SamplingParams):
  """transformers' result, with its top-p tie-breaking replaced by ours.

  At a top-p cut inside a group of exactly tied tokens transformers keeps an
  arbitrary part of the group (whichever tied entries its unstable ascending
  ``torch.sort`` puts last, compared with a float-rounded cumulative sum),
  while specjax keeps the whole group (module docstring: "ties at a cut-off
  are kept"). This reference adds back the tied tokens transformers dropped and
  renormalizes the pre-top-p distribution over the result. Ties are detected
  on the tempered logits (a division is exactly rounded, so equal logits stay
  equal; softmax outputs need not). Returns ``(probs, rows_changed)``.
  """
  probs, tempered, pre_top_p = _transformers_warp(logits, sp)
  kept = probs > 0
  changed = np.zeros(len(logits), bool)
  if sp.top_p < 1:
    lowest_kept = np.min(np.where(kept, tempered, np.inf), axis=-1,
                         keepdims=True)
    closed = kept | ((tempered == lowest_kept) & np.isfinite(pre_top_p))
    changed = (closed != kept).any(axis=-1)
    masked = torch.tensor(np.where(closed, pre_top_p, -np.inf))
    probs = torch.softmax(masked, dim=-1).numpy()
  if sp.min_p > 0:  # after top-p, as generate applies it
    scores = hf_lp.MinPLogitsWarper(sp.min_p)(None, torch.log(
        torch.tensor(probs)))
    probs = torch.softmax(scores, dim=-1).numpy()
  return probs, changed


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", GRID)
def test_warp_matches_transformers_warpers(temperature, top_k, top_p, min_p):
  """Invariant: ``warp`` equals transformers' Temperature -> TopK -> TopP ->
  MinP warpers + softmax (|Δp| <= 1e-6) on random rows and rows with exact ties at
  the top-k cut (both keep every token tied with the k-th); the only allowed
  deviation is the documented top-p tie rule, which the reference applies
  exactly (see ``_tie_closed_reference``) and only on the rows built for it or
  where top-k ties meet a top-p cut."""
  logits = _parity_rows()
  sp = SamplingParams(temperature, top_k, top_p, min_p)
  ours = np.asarray(warp(jnp.asarray(logits), sp))
  ref, changed = _tie_closed_reference(logits, sp)
  assert ours.dtype == np.float32
  np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-6)
  np.testing.assert_array_equal(ours > 0, ref > 0)  # same support, exactly
  # The tie rule may only matter on rows that contain exact ties (8: random).
  assert not changed[:8].any()


@pytest.mark.parametrize("temperature,top_p,min_p", [
    (t, p, m) for t, k, p, m in GRID if p < 1 and k == 0])
def test_top_p_searched_over_the_vocabulary_matches_too(
    temperature, top_p, min_p, monkeypatch):
  """Invariant: when the most likely tokens hold less than top_p (here
  one candidate, so nearly always), the cut searched over the whole
  vocabulary (``_mass_cut``, no sort) gives the same distribution as
  transformers' sorted rule (as above: 1e-6, the same support)."""
  from specjax.core import sampling
  monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", 1)
  logits = _parity_rows()
  sp = SamplingParams(temperature, 0, top_p, min_p)
  ours = np.asarray(jax.jit(lambda x: warp(x, sp))(jnp.asarray(logits)))
  ref, _ = _tie_closed_reference(logits, sp)
  np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-6)
  np.testing.assert_array_equal(ours > 0, ref > 0)


def test_top_p_keeps_the_whole_tie_group_at_the_cut():
  """Invariant: a top-p cut inside a group of equal probabilities keeps the
  whole group (specjax's documented rule), and this is exactly where
  transformers differs: its TopP keeps just one of the two tied tokens (a
  "smallest set" in its docstring's words, chosen by sort position)."""
  logits = np.full((1, V), -30.0, np.float32)
  logits[0, [5, 9, 20]] = [1.0, 0.5, 0.5]
  sp = SamplingParams(1.0, 0, 0.5)
  ours = np.asarray(warp(jnp.asarray(logits), sp))[0]
  e = np.exp(np.float64([1.0, 0.5, 0.5]))
  expected = np.zeros(V)
  expected[[5, 9, 20]] = e / e.sum()
  np.testing.assert_allclose(ours, expected, atol=1e-6)
  hf_probs = _transformers_warp(logits, sp)[0][0]
  assert hf_probs[5] > 0 and (hf_probs[9] > 0) != (hf_probs[20] > 0)
  assert np.count_nonzero(hf_probs) == 2


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 0.5), (1, 1e-3)])
def test_greedy_is_argmax(top_k, top_p):
  """Invariant: temperature 0 makes ``warp`` the one-hot of the argmax (ties ->
  lowest id) whatever top_k/top_p are, and ``sample_logits`` returns that
  argmax for any key."""
  logits = _parity_rows()
  sp = SamplingParams(0.0, top_k, top_p)
  argmax = np.argmax(logits, axis=-1)  # numpy: first of tied maxima
  probs = np.asarray(warp(jnp.asarray(logits), sp))
  np.testing.assert_array_equal(probs, np.eye(V, dtype=np.float32)[argmax])
  assert probs[-1, 3] == 1.0  # tied top tokens 3 and 30: the lower id wins
  for seed in (0, 1):
    tokens = sample_logits(jnp.asarray(logits), sp, jax.random.key(seed))
    assert tokens.dtype == jnp.int32
    np.testing.assert_array_equal(tokens, argmax)


# Chi-square goodness of fit of the sampler against ``warp``.
N_SAMPLES = 50_000
CHI_SP = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
# Top 5 by logit: ids 1, 5, 3, 7, 4; at T=0.7 their mass before id 4 is
# ~0.81 < 0.9 and before the next ~0.92, so top-p then drops id 4 too: 4
# tokens survive with p ~ (0.42, 0.28, 0.18, 0.12) and 6 have probability 0.
CHI_LOGITS = np.array([0.3, 2.0, -1.0, 1.4, 0.9, 1.7, -0.2, 1.1, 0.0, -2.0],
                      np.float32)
CHI_SUPPORT = (1, 3, 5, 7)
ALPHA = 0.999


def _chi_square(tokens: np.ndarray, probs: np.ndarray):
  """Pearson statistic over the support of ``probs``, its 99.9% critical
  value (df = support size - 1) and the per-token counts."""
  counts = np.bincount(tokens, minlength=len(probs))
  support = probs > 0
  expected = len(tokens) * probs[support]
  stat = float(np.sum((counts[support] - expected) ** 2 / expected))
  critical = float(scipy.stats.chi2.ppf(ALPHA, int(support.sum()) - 1))
  return stat, critical, counts


def _warped_chi_probs() -> np.ndarray:
  probs = np.asarray(warp(jnp.asarray(CHI_LOGITS), CHI_SP), np.float64)
  assert tuple(np.flatnonzero(probs)) == CHI_SUPPORT
  assert (N_SAMPLES * probs[list(CHI_SUPPORT)] > 1000).all()  # chi2 regime
  return probs


def test_sample_logits_chi_square_against_warp():
  """Invariant: 50,000 draws of ``sample_logits`` (T 0.7, top_k 5, top_p 0.9,
  V=10, one batched call) fit ``warp``'s probabilities: Pearson's statistic is
  below chi2.ppf(0.999, df=3) ~= 16.27, and the 6 tokens with probability 0
  are never drawn."""
  probs = _warped_chi_probs()
  batch = jnp.broadcast_to(jnp.asarray(CHI_LOGITS), (N_SAMPLES, len(probs)))
  tokens = np.asarray(sample_logits(batch, CHI_SP, jax.random.key(42)))
  assert tokens.shape == (N_SAMPLES,) and tokens.dtype == np.int32
  stat, critical, counts = _chi_square(tokens, probs)
  assert critical == pytest.approx(16.266, abs=1e-3)
  assert counts[probs == 0].sum() == 0, counts
  assert stat < critical, (stat, counts)


def _unwarped_softmax() -> np.ndarray:
  return np.asarray(jax.nn.softmax(jnp.asarray(CHI_LOGITS)))


def _right_support_no_temperature() -> np.ndarray:
  e = np.where(_warped_chi_probs() > 0, np.exp(CHI_LOGITS), 0.0)
  return (e / e.sum()).astype(np.float32)


@pytest.mark.parametrize("wrong_probs", [_unwarped_softmax,
                                         _right_support_no_temperature])
def test_chi_square_rejects_a_wrong_sampler(wrong_probs):
  """Invariant (mutation check of the test above): the same statistic and
  threshold reject samplers drawing from a wrong distribution: the un-warped
  softmax (also caught by the zero-probability check) and, more subtly, the
  right support but without temperature (p ~ 0.37/0.28/0.20/0.15 instead of
  0.42/0.28/0.18/0.12)."""
  probs = _warped_chi_probs()
  wrong = jnp.broadcast_to(jnp.asarray(wrong_probs()),
                           (N_SAMPLES, len(probs)))
  tokens = np.asarray(sample(wrong, jax.random.key(42)))
  stat, critical, counts = _chi_square(tokens, probs)
  assert stat > critical, (stat, counts)
  if wrong_probs is _unwarped_softmax:
    assert counts[probs == 0].sum() > 0


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-0.1), dict(temperature=float("nan")),
    dict(top_p=0.0), dict(top_p=-0.5), dict(top_p=1.0001),
    dict(top_p=float("nan")), dict(top_k=-1)])
def test_sampling_params_rejects_invalid(kwargs):
  """Invariant: temperature < 0 (or NaN), top_p outside (0, 1] (or NaN) and
  top_k < 0 raise ValueError naming the field."""
  field = next(iter(kwargs))
  with pytest.raises(ValueError, match=field):
    SamplingParams(**kwargs)


def test_sampling_params_accepts_the_boundaries():
  """Invariant: the closed ends of the valid ranges are accepted: temperature
  0 (greedy), top_p 1 and top_k 0 (both "off")."""
  sp = SamplingParams(temperature=0.0, top_k=0, top_p=1.0)
  assert sp.greedy
  assert not SamplingParams(temperature=1e-6, top_p=1e-9).greedy


def test_temperatures_f32_cannot_hold_are_refused_and_tiny_ones_are_finite():
  """Invariants: a temperature below f32's smallest normal number (XLA
  flushes it to 0, and 0 / 0 is NaN) or above its largest is refused by
  name; the smallest accepted one warps to a finite one-hot at the argmax
  (no NaN), with top-k and top-p too."""
  from specjax.core.sampling import F32_MAX, F32_TINY
  for t in (1e-40, 1e-320, 1e39):
    with pytest.raises(ValueError,
                       match=re.escape(f"temperature {t} is outside f32")):
      SamplingParams(temperature=t)
  logits = jnp.asarray([[1.0, 3.0, -2.0, 2.5]])
  for sp in (SamplingParams(temperature=F32_TINY),
             SamplingParams(temperature=F32_TINY, top_k=2, top_p=0.5),
             SamplingParams(temperature=F32_MAX)):
    probs = np.asarray(jax.jit(lambda x: warp(x, sp))(logits))
    assert np.isfinite(probs).all() and probs.sum() == pytest.approx(1.0)
    if sp.temperature < 1:
      np.testing.assert_array_equal(probs, [[0, 1, 0, 0]])


def test_every_bit_of_a_seed_counts():
  """Invariant: seeds below 2**32 keep ``jax.random.key``'s keys (results
  published with them stand); seeds that differ only above bit 32 --
  which ``jax.random.key`` alone maps to one key without x64 -- get
  different keys; a seed past 2**63 (a CLI's seed plus a prompt's index)
  wraps instead of overflowing."""
  from specjax.core.sampling import seed_key
  data = lambda k: np.asarray(jax.random.key_data(k)).tolist()
  assert data(seed_key(12345)) == data(jax.random.key(12345))
  assert data(jax.random.key(2**32)) == data(jax.random.key(0))  # the trap
  keys = {str(data(seed_key(s))) for s in (0, 2**32, 2**40, 2**63 - 1)}
  assert len(keys) == 4
  assert data(seed_key(2**63 + 7)) == data(seed_key(7))
