"""Speculative decoding by the numbers: expected tokens, wall time, optimal K.

With per-draft acceptance probability α (i.i.d. across positions) and K drafts
per step, a step emits the accepted prefix plus one correction/bonus token:

  E[tokens per verify] = sum_{i=0..K} α^i = (1 − α^(K+1)) / (1 − α)   (K + 1 at α = 1)

Time is measured in units of one autoregressive target step. A step costs
K·c for drafting (c = draft cost / target step) plus v(K) for verifying K + 1
tokens in one forward (v ≡ 1 in the idealised model; ``verify_cost`` takes a
measured curve), so

  time per token(K) = (K·c + v(K)) / E[tokens](K),   speedup = 1 / that.

See docs/DESIGN.md for where these differ from the figures quoted in the
speculative-decoding lesson (an off-by-one in E and rounded optima).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

VerifyCost = Callable[[int], float]


def expected_tokens(alpha: float, k: int) -> float:
  """E[tokens emitted per target forward] with K drafts at acceptance α."""
  if not 0 <= alpha <= 1:
    raise ValueError(f"alpha must be in [0, 1], got {alpha}")
  if k < 0:
    raise ValueError(f"k must be >= 0, got {k}")
  if alpha == 1:
    return float(k + 1)
  return (1 - alpha ** (k + 1)) / (1 - alpha)


def time_per_token(alpha: float, k: int, c: float,
                   verify_cost: Optional[VerifyCost] = None) -> float:
  """Wall time per emitted token, in target-step units: (K·c + v(K)) / E."""
  v = 1.0 if verify_cost is None else verify_cost(k)
  return (k * c + v) / expected_tokens(alpha, k)


def speedup(alpha: float, k: int, c: float,
            verify_cost: Optional[VerifyCost] = None) -> float:
  """Tokens per unit time relative to plain autoregressive decoding."""
  return 1.0 / time_per_token(alpha, k, c, verify_cost)


@dataclasses.dataclass(frozen=True)
class Optimum:
  k: int
  expected_tokens: float
  time_per_token: float
  speedup: float


def optimal_k(alpha: float, c: float, k_max: int = 64,
              verify_cost: Optional[VerifyCost] = None) -> Optimum:
  """The K in [1, k_max] minimising time per token (smallest K on ties)."""
  best = min(range(1, k_max + 1),
             key=lambda k: (time_per_token(alpha, k, c, verify_cost), k))
  t = time_per_token(alpha, best, c, verify_cost)
  return Optimum(k=best, expected_tokens=expected_tokens(alpha, best),
                 time_per_token=t, speedup=1.0 / t)
