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


def step_speedup(tokens: float, verify: float, draft: float = 0.0,
                 overlap: bool = False) -> float:
  """The speedup of a method measured as a whole step rather than α: each
  step emits ``tokens`` (its measured τ) for a verify forward of ``verify``
  AR steps (v of the tokens it scores: Lookahead scores 1 + its trie's
  nodes + its window's K·W tokens, where a chain scores K + 1) plus
  ``draft`` AR steps of drafting (CLaSp: K forwards of L - M of the L
  layers, plus its dynamic programme, about a forward over M tokens):
  τ / (draft + verify); with ``overlap`` (PEARL on two device groups) the
  two run at once: τ / max(draft, verify)."""
  if tokens < 1 or verify <= 0 or draft < 0:
    raise ValueError(f"want tokens >= 1, verify > 0, draft >= 0; got "
                     f"{tokens}, {verify}, {draft}")
  return tokens / (max(draft, verify) if overlap else draft + verify)


@dataclasses.dataclass(frozen=True)
class PearlSteps:
  """PEARL's steps at i.i.d. acceptance α (``pearl_steps``): tokens a step
  emits on average and the share of steps with nothing pending."""
  tokens: float
  pre_verify: float


def pearl_steps(alpha: float, k: int) -> PearlSteps:
  """PEARL's modes (``core.pearl``) as a two-state chain. With nothing
  pending a step tests one draft and emits one token (the draft or the
  correction), going on with K - 1 pending with probability α. With drafts
  pending it tests a chain of K: all accepted (α^K) emits K and stays;
  else the first rejection after j accepted emits j + 1 and leaves nothing
  pending. The chain's stationary share of pre-verify steps is
  (1 − α^K) / (α + 1 − α^K); a post-verify step emits
  E[tokens](α, K − 1) = Σ_{j<K} α^j on average (``expected_tokens``)."""
  if k < 1:
    raise ValueError(f"PEARL needs k >= 1, got {k}")
  post_tokens = expected_tokens(alpha, k - 1)
  leave = 1 - alpha ** k  # post -> pre
  pre = leave / (alpha + leave) if alpha + leave > 0 else 1.0
  return PearlSteps(tokens=pre + (1 - pre) * post_tokens, pre_verify=pre)


def with_prefill(speedup_: float, prefill: float, new_tokens: int) -> float:
  """The speedup of a whole request: a prefill of ``prefill`` AR steps
  (paid alike by AR and the method) then ``new_tokens`` tokens, decoded
  ``speedup_`` times as fast: (prefill + n) / (prefill + n / speedup)."""
  if new_tokens < 1 or prefill < 0 or speedup_ <= 0:
    raise ValueError(f"want new_tokens >= 1, prefill >= 0, speedup > 0; got "
                     f"{new_tokens}, {prefill}, {speedup_}")
  return (prefill + new_tokens) / (prefill + new_tokens / speedup_)


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


# Trees. A static tree's node at depth d that is its parent's r-th child
# holds the drafter's r-th best token there. With p[d - 1][r] the chance
# that the target's next token at depth d is the drafter's rank-r token,
# given the path to depth d - 1 was accepted (ranks are distinct tokens, so
# these are disjoint events; Sequoia's positional acceptance, here per
# depth), a node is accepted with the product of p along its path, and
#
#   E[tokens per verify] = 1 + sum over nodes of prod_{edges} p[depth][rank].
#
# ``best_tree`` maximises that for a node budget by dynamic programming over
# (depth, next rank, nodes left), as Sequoia sizes its trees.

RankPath = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class TreePlan:
  """A static tree: its nodes as rank paths (parents first) and E[tokens]."""
  paths: tuple[RankPath, ...]
  expected_tokens: float

  @property
  def num_nodes(self) -> int:
    return len(self.paths)

  @property
  def depth(self) -> int:
    return max((len(q) for q in self.paths), default=0)

  def spec(self) -> str:
    """The ``--tree-shape`` text (``shape_text``)."""
    return shape_text(self.paths)


def shape_text(paths) -> str:
  """Rank paths as ``--tree-shape`` text (``tree.parse_shape`` reads it):
  comma-separated paths, ranks joined by dots (``0,1,0.0``)."""
  return ",".join(".".join(map(str, q)) for q in paths)


def tree_expected_tokens(paths, p_DR) -> float:
  """E[tokens per verify] of the tree of rank ``paths`` under ``p_DR``."""
  total = 1.0
  for q in paths:
    prob = 1.0
    for d, r in enumerate(q):
      prob *= p_DR[d][r] if d < len(p_DR) and r < len(p_DR[d]) else 0.0
    total += prob
  return total


def best_tree(p_DR, num_nodes: int, max_depth: Optional[int] = None
              ) -> TreePlan:
  """The tree of at most ``num_nodes`` drafted nodes, none deeper than
  ``max_depth`` (default ``len(p_DR)``), with the most expected tokens per
  verify. ``p_DR[d][r]``: acceptance of the rank-r token at depth d + 1
  (should fall with r; a node's children then take ranks 0, 1, ...)."""
  return best_trees(p_DR, num_nodes, max_depth)[-1]


def best_trees(p_DR, max_nodes: int, max_depth: Optional[int] = None
               ) -> list[TreePlan]:
  """``best_tree`` for every budget 0..``max_nodes``, from one dynamic
  program: ``F[d][n]``, the most expected accepted nodes below an accepted
  node at depth d using at most n nodes; ``G(d, r, n)``, the same with only
  child ranks >= r left, which either stops or gives rank r a subtree of
  m >= 1 nodes: ``p[d][r] (1 + F[d + 1][m - 1]) + G(d, r + 1, n - m)``."""
  D = len(p_DR) if max_depth is None else min(max_depth, len(p_DR))
  N = max_nodes
  if N < 0 or D < 0:
    raise ValueError(f"need num_nodes >= 0 and depth >= 0, got {N}, {D}")
  R = [min(len(p_DR[d]), N) for d in range(D)]
  F = [[0.0] * (N + 1) for _ in range(D + 1)]
  # choice[d][r][n] = nodes given to rank r's subtree (0: stop).
  choice = [[[0] * (N + 1) for _ in range(R[d] + 1)] for d in range(D)]
  for d in range(D - 1, -1, -1):
    G = [[0.0] * (N + 1) for _ in range(R[d] + 1)]
    for r in range(R[d] - 1, -1, -1):
      for n in range(1, N + 1):
        best, pick = 0.0, 0
        for m in range(1, n + 1):
          v = p_DR[d][r] * (1.0 + F[d + 1][m - 1]) + G[r + 1][n - m]
          if v > best + 1e-12:
            best, pick = v, m
        G[r][n], choice[d][r][n] = best, pick
    F[d] = G[0]

  def build(prefix: RankPath, d: int, n: int, out: list):
    for r in range(R[d] if d < D else 0):
      m = choice[d][r][n]
      if not m:
        return
      out.append(prefix + (r,))
      build(prefix + (r,), d + 1, m - 1, out)
      n -= m

  plans = []
  for n in range(N + 1):
    paths: list[RankPath] = []
    build((), 0, n, paths)
    paths.sort(key=lambda q: (len(q), q))
    plans.append(TreePlan(paths=tuple(paths),
                          expected_tokens=1.0 + (F[0][n] if D else 0.0)))
  return plans
