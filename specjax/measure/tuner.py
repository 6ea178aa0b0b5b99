"""Which method and K to use for a workload: theory + measured costs + priors.

The tuner scores every (method, K) with ``theory``'s wall-time model,

  time per token(K) = (draft(K) + verify(K + 1) + rest) / E[tokens](α, K),

where the verify curve and the per-step rest are timed on this machine for
the workload's batch size (``measure_costs``), draft costs follow from them
(a layer-skip draft of k of L layers costs about k/L of a forward per token;
a trained head costs the fraction of a forward per token that ``specjax
bench`` measured, ``DRAFT_COST``; table drafters cost ~nothing), and α, the
per-draft acceptance, comes from ``PRIORS``: acceptance measured by
``specjax bench`` (docs/RESULTS.md), interpolated in temperature. A drafter
that drafts on only a share w of steps (``DRAFT_RATE``: a table drafter with
no match) is scored as the mixture the engine runs: w of the steps as above,
the rest a one-token forward that emits one token. Tasks that were not
measured borrow the nearest measured one and say so in the reasoning. When no
method beats AR by 5%, AR is the recommendation: speculation only pays where
α survives the workload.

Trees (``recommend_tree``): for a head whose per-depth, per-rank acceptance
was measured (``TREE_PRIORS``, from benchmarks/tree_rank_acceptance.py),
``theory.best_tree`` gives the best static tree of every node budget and
depth, and the tuner keeps the one with the lowest time per token under the
measured verify curve, now timed out to ``TREE_WIDTHS`` tokens, and a draft
cost of one head call per level (Sequoia's sizing on this machine).

Methods measured whole (``CONFIG_PRIORS``: Lookahead, whose step scores its
window beside its trie, and CLaSp, whose draft runs L - M layers per token
plus its choice of the M, about one forward over M tokens) are scored per
measured configuration: its τ for a verify forward over the tokens it
scores, timed on the curve here, plus its measured drafting
(``theory.step_speedup``); so the tuner picks CLaSp's M among those
measured.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import TYPE_CHECKING, Optional

import jax
import numpy as np

from specjax.measure import theory

if TYPE_CHECKING:
  from specjax.models.registry import Model

TASKS = ("chat", "code", "summarize", "creative")
K_MAX = 8
MIN_GAIN = 1.05
TREE_WIDTHS = (12, 16, 24, 33)  # verify widths timed past K_MAX + 1 for trees

def _load_priors():
  """From ``specjax bench`` runs (benchmarks/summarize_spec_bench.py writes
  them; docs/RESULTS.md), by (method, task) and temperature: the per-draft
  acceptance α of the steps that drafted (the geometric fit
  (1 - α^(K+1)) / (1 - α) = τ of those steps) and the share of steps that
  drafted at all (a table drafter with no match runs a one-token forward);
  and per method, a drafted token's cost in one-token target forwards."""
  path = pathlib.Path(__file__).with_name("tuner_priors.json")
  if not path.is_file():
    return {}, {}, {}, {}, []
  data = json.loads(path.read_text())
  alpha: dict = {}
  rate: dict = {}
  for p in data["priors"]:
    key, t = (p["method"], p["task"]), float(p["temperature"])
    alpha.setdefault(key, {})[t] = float(p["alpha"])
    rate.setdefault(key, {})[t] = float(p.get("draft_rate", 1.0))
  costs = {m: float(c) for m, c in data.get("draft_costs", {}).items()}
  trees: dict = {}
  for t in data.get("tree_acceptance", []):
    trees.setdefault((t["method"], t["task"]), {})[float(t["temperature"])] = (
        t["p"])
  return alpha, rate, costs, trees, data.get("configs", [])


PRIORS, DRAFT_RATE, DRAFT_COST, TREE_PRIORS, CONFIG_PRIORS = _load_priors()

# Unmeasured tasks borrow a measured one; why, in words for the reasoning.
BORROW = {
    "summarize": ("chat", "summaries copy the source, so this is a floor for "
                          "ngram/retrieval"),
    "creative": ("chat", "creative text repeats less than chat answers, so "
                         "this is optimistic"),
    "code": ("chat", "this method was not measured on code"),
}


@dataclasses.dataclass(frozen=True)
class Workload:
  """What the user runs. ``latency_target_ms``: wanted ms per token per row;
  ``prompt_tokens`` (0: not considered) and ``new_tokens``: a request's
  length, for its time to first token and its speedup with the prefill."""
  batch_size: int = 1
  task: str = "chat"
  temperature: float = 0.0
  latency_target_ms: Optional[float] = None
  prompt_tokens: int = 0
  new_tokens: int = 256

  def __post_init__(self):
    if self.task not in TASKS:
      raise ValueError(f"unknown task {self.task!r} (choose from "
                       f"{', '.join(TASKS)})")
    if self.batch_size < 1:
      raise ValueError(f"batch size must be >= 1, got {self.batch_size}")
    if not 0 <= self.temperature <= 2:
      raise ValueError(f"temperature must be in [0, 2], got "
                       f"{self.temperature}")
    if self.prompt_tokens < 0 or self.new_tokens < 1:
      raise ValueError(f"want prompt tokens >= 0 and new tokens >= 1, got "
                       f"{self.prompt_tokens} and {self.new_tokens}")
    if self.latency_target_ms is not None and not (
        0 < self.latency_target_ms < math.inf):
      raise ValueError(f"latency target must be > 0 ms per token, got "
                       f"{self.latency_target_ms}")


@dataclasses.dataclass(frozen=True)
class CostCurve:
  """Seconds on this machine at one batch size.

  Attributes:
    forward: ``forward[t]`` = one target forward over t tokens per row,
      t = 1..K_MAX + 1 (index 0 unused).
    rest: the rest of an AR step (sampling, bookkeeping, loop).
    num_layers: L, for layer-skip draft costs.
    wide: ``(t, seconds)`` forwards over more tokens (``TREE_WIDTHS``).
    prefill: ``(prompt tokens, seconds)`` of a prefill and its first
      sample (the time to first token), or None (not measured).
  """
  forward: tuple[float, ...]
  rest: float
  num_layers: int
  wide: tuple[tuple[int, float], ...] = ()
  prefill: Optional[tuple[int, float]] = None

  def forward_at(self, t: int) -> float:
    """A forward over t tokens: measured, or linear between the measured
    widths (and along the last segment past them)."""
    if t < len(self.forward):
      return self.forward[t]
    xs, ys = zip(*[(i, f) for i, f in enumerate(self.forward) if i],
                 *self.wide)
    if t >= xs[-1]:
      slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
      return ys[-1] + slope * (t - xs[-1])
    return float(np.interp(t, xs, ys))

  @property
  def ar_step(self) -> float:
    return self.forward[1] + self.rest

  def draft(self, method: str, k: int, layers: int) -> float:
    if method == "layerskip":  # a 2-token re-feed, then K - 1 single tokens
      frac = layers / self.num_layers
      return frac * (self.forward[2] + (k - 1) * self.forward[1])
    # A head's step is a fixed fraction of a forward; tables cost ~0.
    return k * DRAFT_COST.get(method, 0.0) * self.forward[1]

  def verify_ratio(self, k: int) -> float:
    """v(K): the verify forward (plus the step's rest) in AR-step units."""
    return (self.forward[k + 1] + self.rest) / self.ar_step


@dataclasses.dataclass
class Option:
  """A method and K; ``method`` is a whole spec in the method grammar for
  a configuration measured whole (``alpha`` None)."""
  method: str
  num_draft: int
  alpha: Optional[float]
  expected_tokens: float
  ms_per_token: float
  speedup: float


@dataclasses.dataclass
class Recommendation:
  method: str
  num_draft: int
  expected_speedup: float
  ms_per_token: float
  ar_ms_per_token: float
  meets_latency_target: Optional[bool]
  reasoning: list[str]
  options: list[Option]
  ttft_ms: Optional[float] = None
  speedup_with_prefill: Optional[float] = None

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def measure_costs(model: "Model", batch_size: int, progress: bool = True,
                  context: int = 256, rounds: int = 9,
                  prompt_tokens: int = 0, new_tokens: int = 256
                  ) -> CostCurve:
  """Times target forwards over 1..K_MAX + 1 tokens and a full AR step.

  The shapes are timed round-robin (one call each per round, median over
  rounds), so machine-speed drift hits every point of the curve alike; timed
  one after the other, v(K) moved by ±30% between runs on this VM. With
  ``prompt_tokens``, also a prefill of that many tokens per row in the
  program of a request for ``new_tokens`` (``CostCurve.prefill``).
  """
  import time

  from tqdm import tqdm

  from specjax.core import engine, runner
  target, B = model.target, batch_size
  runner.check_memory(model, B, 2 * context, context,
                      max(K_MAX + 2, *TREE_WIDTHS))
  cache = target.init_cache(model.params, B, 2 * context).with_lengths(
      np.full((B,), context, np.int32))
  fwd = jax.jit(lambda p, t, c: target.forward(p, t, c).logits)
  dcfg = engine.DecodeConfig(capacity=2 * context, eos_ids=())
  state = engine.prefill_jit(
      model.params, np.ones((B, context), np.int32),
      np.full((B,), context - 1, np.int32), jax.random.key(0),
      np.int32(1 << 20), target=target, dcfg=dcfg)
  step = jax.jit(lambda p, s: engine.step(p, s, target=target, dcfg=dcfg))
  widths = list(range(1, K_MAX + 2)) + list(TREE_WIDTHS)
  calls = [lambda t=t: fwd(model.params, np.ones((B, t), np.int32), cache)
           for t in widths]
  calls.append(lambda: step(model.params, state))
  times = [[] for _ in calls]
  for call in tqdm(calls, desc="compiling", disable=not progress):
    jax.block_until_ready(call())
  for _ in tqdm(range(rounds), desc="timing verify curve",
                disable=not progress):
    for i, call in enumerate(calls):
      start = time.perf_counter()
      jax.block_until_ready(call())
      times[i].append(time.perf_counter() - start)
  med = [float(np.median(t)) for t in times]
  n = K_MAX + 1
  forward, ar_step = [0.0] + med[:n], med[-1]
  return CostCurve(forward=tuple(forward), rest=max(ar_step - forward[1], 0.0),
                   num_layers=target.config.num_layers,
                   wide=tuple(zip(TREE_WIDTHS, med[n:-1])),
                   prefill=(prompt_tokens, _prefill_s(
                       model, B, prompt_tokens, new_tokens, min(rounds, 3)))
                   if prompt_tokens else None)


def _prefill_s(model: "Model", B: int, prompt_tokens: int, new_tokens: int,
               rounds: int) -> float:
  """Median seconds of a prefill of ``prompt_tokens`` per row and its first
  sample, in the program the runner builds for that request (AR)."""
  from specjax.core import bucketing, runner
  from specjax.core.sampling import SamplingParams
  from specjax.measure.bench import median_time, prefill_call
  Tp = bucketing.bucket_length(prompt_tokens)
  dcfg = runner.decode_config(model, Tp, new_tokens, SamplingParams())
  runner.check_memory(model, B, dcfg.capacity, Tp)
  return median_time(prefill_call(
      model, np.ones((B, Tp), np.int32),
      np.full((B,), prompt_tokens, np.int32), dcfg), rounds)


def _measured_task(method: str, task: str) -> tuple[str, str]:
  """The task whose measurement stands in, and a note when it is borrowed."""
  if (method, task) not in PRIORS and task in BORROW:
    source, why = BORROW[task]
    return source, f" (borrowed from {source}: {why})"
  return task, ""


def _interp(by_t: dict[float, float], temperature: float) -> float:
  """Linear in temperature between measured points, clamped outside."""
  ts = sorted(by_t)
  t = min(max(temperature, ts[0]), ts[-1])
  return float(np.interp(t, ts, [by_t[x] for x in ts]))


def alpha_for(method: str, task: str, temperature: float
              ) -> tuple[Optional[float], str]:
  """α for the workload and where it came from (a phrase for the reasoning)."""
  source, note = _measured_task(method, task)
  by_t = PRIORS.get((method, source))
  if not by_t:
    return None, "no measurement"
  alpha = _interp(by_t, temperature)
  return alpha, f"α={alpha:.2f} measured on {source} at T in {sorted(by_t)}{note}"


def draft_rate_for(method: str, task: str, temperature: float) -> float:
  """Share of steps that draft, from the same measurement as ``alpha_for``
  (1 where none says otherwise)."""
  by_t = DRAFT_RATE.get((method, _measured_task(method, task)[0]))
  return _interp(by_t, temperature) if by_t else 1.0


def recommend(workload: Workload, costs: CostCurve, methods=None,
              layers: Optional[int] = None) -> Recommendation:
  """Scores every measured (method, K ≤ K_MAX) and picks the fastest."""
  layers = layers or max(1, round(0.8 * costs.num_layers))
  methods = methods or ("ngram", "retrieval", "ngram+retrieval", "layerskip",
                        "eagle3")
  ar_ms = costs.ar_step * 1e3
  reasoning = [f"AR step at batch {workload.batch_size}: {ar_ms:.1f} ms; a "
               f"verify over K+1 tokens costs v(K) = "
               + ", ".join(f"{costs.verify_ratio(k):.2f}" for k in (1, 4, 8))
               + " AR steps at K = 1, 4, 8 (measured here)."]
  options = []
  for method in methods:
    alpha, source = alpha_for(method, workload.task, workload.temperature)
    if alpha is None:
      reasoning.append(f"{method}: skipped, {source}.")
      continue
    # A step without drafts (rate 1 - w) emits one token for a one-token
    # forward: the engine's adaptive verify width.
    w = draft_rate_for(method, workload.task, workload.temperature)
    best = None
    for k in range(1, K_MAX + 1):
      e = (1 - w) + w * theory.expected_tokens(alpha, k)
      step_s = costs.rest + (1 - w) * costs.forward[1] + w * (
          costs.draft(method, k, layers) + costs.forward[k + 1])
      opt = Option(method, k, alpha, e, step_s / e * 1e3,
                   costs.ar_step * e / step_s)
      if best is None or opt.speedup > best.speedup:
        best = opt
    options.append(best)
    drafts = "" if w >= 0.995 else f", drafting on {w:.0%} of steps"
    reasoning.append(f"{method}: {source}{drafts}; best K={best.num_draft} "
                     f"gives E={best.expected_tokens:.2f} tokens/verify, "
                     f"{best.speedup:.2f}x.")
  options += _config_options(workload, costs, reasoning)
  options.sort(key=lambda o: -o.speedup)
  top = options[0] if options else None
  if top is None or top.speedup < MIN_GAIN:
    method, k, gain, ms = "ar", 0, 1.0, ar_ms
    reasoning.append("No speculative method is predicted to beat AR by "
                     f"{MIN_GAIN - 1:.0%}: acceptance is too low for what "
                     "a wider verify forward costs here, so decode plainly.")
  else:
    method, k, gain, ms = (top.method, top.num_draft, top.speedup,
                           top.ms_per_token)
    reasoning.append(f"Pick {method} with K={k}: {gain:.2f}x predicted.")
  ttft_ms = whole = None
  if costs.prefill and workload.prompt_tokens:
    tokens, seconds = costs.prefill
    ttft_ms = seconds * 1e3
    whole = theory.with_prefill(gain, seconds / costs.ar_step,
                                workload.new_tokens)
    reasoning.append(
        f"Prefill of {tokens} prompt tokens: {ttft_ms:.0f} ms to the first "
        f"token ({seconds / costs.ar_step:.0f} AR steps), paid alike by AR "
        f"and {method}: over {workload.new_tokens} new tokens the request "
        f"runs {whole:.2f}x AR's.")
  meets = None
  if workload.latency_target_ms is not None:
    meets = ms <= workload.latency_target_ms
    reasoning.append(f"Latency target {workload.latency_target_ms:g} ms/token: "
                     f"predicted {ms:.1f} ms/token, "
                     + ("met." if meets else "missed; a smaller batch or a "
                        "faster machine is needed."))
  return Recommendation(method=method, num_draft=k, expected_speedup=gain,
                        ms_per_token=ms, ar_ms_per_token=ar_ms,
                        meets_latency_target=meets, reasoning=reasoning,
                        options=options, ttft_ms=ttft_ms,
                        speedup_with_prefill=whole)


def _config_options(workload: Workload, costs: CostCurve,
                    reasoning: list[str]) -> list[Option]:
  """Each configuration measured whole (``CONFIG_PRIORS``) for the
  workload's task (or the one it borrows), its τ interpolated in
  temperature, scored on this machine's curve: a verify forward over the
  tokens it scores, plus its drafting."""
  task, note = workload.task, ""
  if task not in {c["task"] for c in CONFIG_PRIORS} and task in BORROW:
    task, why = BORROW[task]
    note = f" (borrowed from {task}: {why})"
  by_spec: dict = {}
  for c in CONFIG_PRIORS:
    if c["task"] == task:
      by_spec.setdefault(c["spec"], []).append(c)
  options = []
  for spec, runs in by_spec.items():
    tau = _interp({float(c["temperature"]): c["tau"] for c in runs},
                  workload.temperature)
    c = runs[0]
    verify = ((costs.forward_at(c["verify_width"]) + costs.rest)
              / costs.ar_step)
    draft = c.get("draft_cost", 0.0) * costs.forward[1] / costs.ar_step
    gain = theory.step_speedup(tau, verify, draft)
    options.append(Option(spec, c["k"], None, tau,
                          costs.ar_step / gain * 1e3, gain))
    reasoning.append(
        f"{spec}: τ={tau:.2f} measured on {c['task']} at T in "
        f"{sorted(float(r['temperature']) for r in runs)}{note}; scores "
        f"{c['verify_width']} tokens a step (v={verify:.2f}), {gain:.2f}x.")
  return options


@dataclasses.dataclass
class TreeOption:
  """A static tree for ``--tree-shape`` and what it is predicted to give."""
  method: str
  shape: str  # theory.TreePlan.spec(): rank paths
  num_nodes: int
  depth: int
  expected_tokens: float
  ms_per_token: float
  speedup: float
  source: str


def tree_acceptance_for(method: str, task: str, temperature: float):
  """``p[d][r]`` for the workload (the nearest measured temperature) and
  where it came from, or ``(None, why)``."""
  source, note = _measured_task(method, task)
  by_t = TREE_PRIORS.get((method, source))
  if not by_t:
    return None, "no per-rank acceptance measured"
  t = min(by_t, key=lambda x: (abs(x - temperature), x))
  return by_t[t], f"per-rank acceptance measured on {source} at T={t:g}{note}"


def recommend_tree(workload: Workload, costs: CostCurve, method: str = "eagle3",
                   max_nodes: int = 32) -> Optional[TreeOption]:
  """The static tree with the lowest predicted time per token: for every
  depth D and node budget N, ``theory.best_tree``'s tree, costed as D head
  calls (one per level) plus a verify forward over its nodes + 1."""
  p, source = tree_acceptance_for(method, workload.task, workload.temperature)
  if p is None:
    return None
  best = None
  for depth in range(1, len(p) + 1):
    for plan in theory.best_trees(p, max_nodes, depth)[1:]:
      step_s = (costs.rest + costs.draft(method, plan.depth, 0)
                + costs.forward_at(plan.num_nodes + 1))
      speedup = costs.ar_step * plan.expected_tokens / step_s
      if best is None or speedup > best.speedup + 1e-9:
        best = TreeOption(method, plan.spec(), plan.num_nodes, plan.depth,
                          plan.expected_tokens,
                          step_s / plan.expected_tokens * 1e3, speedup,
                          source)
  return best
