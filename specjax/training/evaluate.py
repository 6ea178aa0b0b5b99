"""Held-out acceptance of a head, without decoding anything.

A chain draft at T=0 is accepted up to the first position where the head's
argmax differs from the target's. The training-time test measures exactly
that position by position: step k sees the true tokens and the head's own
features fed back k times, so its top-1 agreement on held-out conversations
estimates α_k, the acceptance at depth k given depths < k were accepted.
Positions whose target argmax lies outside Vd can never be accepted; they
enter through ``coverage``. The expected tokens per verify of a K-chain is
then τ = 1 + Σ_{i<K} Π_{j≤i} coverage·α_j.

Evaluating every head at K = 7 regardless of the TTT length it was trained
with is what exposes exposure bias (docs/DESIGN.md, "Training-time test").
"""

from __future__ import annotations

import jax
import numpy as np

from specjax.training import data as edata
from specjax.training.train import Setup, TrainConfig, trained_examples
from specjax.training.ttt import head_loss


def expected_tau(acc, coverage: float = 1.0) -> float:
  """Tokens per verify of a chain of ``len(acc)`` drafts at T=0."""
  alive = np.cumprod(np.asarray(acc, np.float64) * coverage)
  return float(1.0 + alive.sum())


# Module-level, configs static: one compile per (head config, K) for the
# process, not one per checkpoint evaluated. A P-EAGLE head's depths are
# scored on one fixed COD sample.
_metrics = jax.jit(lambda p, hcfg, embed, b, K: head_loss(
    p, hcfg, embed, b, K, key=jax.random.key(0))[1], static_argnums=(1, 4))


def heldout_accuracy(s: Setup, params, num_steps: int = 7,
                     batch_size: int = 4) -> dict:
  """Per-step top-1 agreement with the target on ``s.heldout_ex``.

  Returns ``acc`` (list of ``num_steps`` -- a Medusa head's depths for a
  Medusa head, a P-EAGLE head's trained depths for one -- over positions whose target argmax is in Vd), ``coverage`` (share of assistant positions whose target argmax
  is in Vd), ``positions`` and ``expected_tau``.
  """
  ex, N = s.heldout_ex, len(s.heldout_ex)
  num_steps = s.hcfg.medusa_heads or s.hcfg.block_depths or num_steps
  features = s.features()
  hits, counts = np.zeros(num_steps), np.zeros(num_steps)
  assistant = 0
  for i in range(0, N, batch_size):
    idx = np.arange(i, i + batch_size) % N  # one shape: wrap, then mask out
    part = ex.take(idx)
    mask = part.mask & (np.arange(i, i + batch_size) < N)[:, None]
    batch = features(s.model.params, s.vocab, part.ids, mask)
    m = jax.device_get(_metrics(params, s.hcfg, s.model.target.embedding(s.model.params), batch,
                                num_steps))
    hits += np.asarray(m["acc"]) * np.asarray(m["count"])
    counts += np.asarray(m["count"])
    assistant += int(m["assistant"])
  acc = (hits / np.maximum(counts, 1)).tolist()
  coverage = counts[0] / max(assistant, 1)
  return dict(acc=[round(a, 4) for a in acc], coverage=round(coverage, 4),
              positions=int(counts[0]),
              expected_tau=round(expected_tau(acc, coverage), 4))


def tokens_seen(cfg: TrainConfig, train_ex: edata.Examples, step: int) -> int:
  """Tokens the first ``step`` optimizer steps trained on (data order is a
  function of the step, so this needs no log), repeats counted: a run over
  cached features cycles epochs over its first ``feature_cache`` rows."""
  train_ex = trained_examples(cfg, train_ex)
  return int(sum(train_ex.lengths[edata.batch_indices(
      i, len(train_ex), cfg.batch_size, cfg.seed)].sum() for i in range(step)))
