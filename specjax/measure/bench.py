"""Speculative vs autoregressive decoding, measured side by side in one run.

For every batch of prompts the AR baseline and each method run back to back
(same process, same shapes, compiled ahead of the timed calls), so machine
noise hits both alike; the reported speedup is the median over repeats of
total-AR-time / total-method-time. Per method it reports the acceptance
statistics, the wall-time split and the speedup the theory predicts from the
measured τ and cost curve (``measure_costs``).

Definitions (aggregated over all rows):
  tau: tokens emitted per target verify forward (correction/bonus included,
    the prefill's first token excluded).
  acceptance_per_position[i]: fraction of verify steps whose draft i was
    accepted (acceptance is prefix-closed, so this is P(accepted > i)).
  accepted_length_histogram[j]: verify steps that accepted exactly j drafts.
  acceptance_per_node[m] (trees): fraction of verify steps whose accepted
    path ran through drafted node m + 1 (a static tree's node m + 1 is the
    same depth and rank every step).
  wide_verify_fraction: steps whose target forward covered all K + 1 tokens;
    in the others no row had drafted and the newest token was scored alone.
  verify_width: tokens a wide verify forward scores per row: the block (the
    newest token and the drafts or tree nodes) and a lookahead window.
  ttft_ms: time to the first token of the first batch (its prefill and first
    sample, at its prompt bucket); tokens_per_s counts the prefill in.
  pre_verify_steps, post_verify_steps (PEARL): steps with no drafts
    pending and with some; predicted_speedup_two_groups: the speedup the
    theory predicts with the draft and the target's forward on disjoint
    device groups, at once (a step waits for the longer of the two
    measured costs), where one device runs them one after the other.
  time_split: the method's wall time attributed to drafting, verifying and
    the rest (sampling, bookkeeping, loop), from per-component timings of
    the jitted propose and verify forward at the run's own shapes.

A long run (80 MT-bench prompts x several methods is an hour on a 2-core CPU)
can keep a journal: each batch's AR and method runs are appended to it as
soon as that batch is done, and a rerun of the same benchmark reads them back
instead of decoding again. A batch's AR and method timings always come from
one process, back to back, so its speedup ratio stays a fair comparison.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import pathlib
import statistics
import subprocess
import time
from typing import Callable, Optional, Sequence

import jax
import numpy as np

from specjax.core import bucketing, engine, runner
from specjax.core.sampling import SamplingParams
from specjax.drafters import methods
from specjax.models.registry import Model


@dataclasses.dataclass
class Costs:
  """Per-step costs in seconds at one run's shapes (medians of repeats)."""
  target_1: float   # target forward over [B, 1] (an AR step's forward)
  verify: float     # target forward over [B, width] (the block and riders)
  draft: float      # one drafter.propose of K drafts
  prefill: float = 0.0  # the batch's prefill and first sample: its TTFT

  def step_s(self, wide_fraction: float = 1.0, overlap: bool = False
             ) -> float:
    """Forward + draft seconds of a speculative step when ``wide_fraction``
    of the steps verify K + 1 tokens and the rest score one (nothing
    drafted); with ``overlap`` (PEARL on two device groups) the draft and
    the forward run at once, so the step waits for the longer."""
    forward = (wide_fraction * self.verify
               + (1 - wide_fraction) * self.target_1)
    return max(self.draft, forward) if overlap else self.draft + forward

  def predicted_speedup(self, tau: float, ar_step_s: float,
                        wide_fraction: float = 1.0,
                        overlap: bool = False) -> float:
    """Theory: AR time per token / speculative time per token, where a
    speculative step costs ``step_s`` + the AR step's non-forward rest."""
    rest = max(ar_step_s - self.target_1, 0.0)
    return tau * ar_step_s / (self.step_s(wide_fraction, overlap) + rest)


def median_time(fn: Callable[[], object], repeats: int = 5) -> float:
  """Median seconds of ``fn()`` (compiled and warmed up first)."""
  jax.block_until_ready(fn())  # compile + warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def prefill_call(model: Model, prompt_BT, lengths, dcfg: engine.DecodeConfig,
                 drafter_params=None) -> Callable[[], engine.DecodeState]:
  """A call of the prefill and its first sample (the time to first token)
  on these padded prompts, for ``median_time``."""
  return lambda: engine.prefill_jit(
      model.params, prompt_BT, lengths, jax.random.key(0), np.int32(1),
      target=model.target, dcfg=dcfg, drafter_params=drafter_params)


DRAFT_RUN = 4  # proposals a draft timing runs in a row


def measure_costs(model: Model, prompts: Sequence[Sequence[int]],
                  dcfg: engine.DecodeConfig, drafter_params,
                  repeats: int = 5) -> Costs:
  """Times the prefill (the time to the first token) and the pieces of one
  speculative step on the real post-prefill state."""
  prompt_BT, lengths = bucketing.pad_prompts(prompts,
                                             model.tokenizer.pad_id or 0)
  prefill = prefill_call(model, prompt_BT, lengths, dcfg, drafter_params)
  prefill_s = median_time(prefill, repeats)
  state = prefill()
  K, width = dcfg.k, dcfg.width
  fwd = jax.jit(lambda p, t, c: model.target.forward(p, t, c).logits)
  target_1 = median_time(
      lambda: fwd(model.params, state.tokens[:, :1], state.cache), repeats)
  verify = median_time(
      lambda: fwd(model.params, state.tokens[:, :width], state.cache), repeats)
  draft = 0.0
  if dcfg.pearl:  # PEARL's drafter half as its step runs it
    from specjax.core import pearl
    half = jax.jit(lambda s, k, p: pearl.draft_half(
        s, k, dcfg=dcfg, vocab_size=model.config.vocab_size,
        drafter_params=p))
    draft = median_time(lambda: half(state, jax.random.key(1),
                                     drafter_params), repeats)
  elif K:
    d, M = dcfg.drafter, dcfg.tree_nodes
    propose = jax.jit(
        (lambda p, s, c, k, sp: d.propose_tree(p, s, c, k, K, M, sp)) if M
        else (lambda p, s, c, k, sp: d.propose(p, s, c, k, K, sp)))
    ctx = engine.drafter_context(state, d)
    sampler = state.sampler(dcfg, model.config.vocab_size)

    def proposals():
      """DRAFT_RUN proposals, each on the drafter state the last returned
      (a drafter whose cost varies from step to step, as CLaSp choosing its
      layers every ``refresh`` steps, is timed over its cycle)."""
      drafter_state = state.drafter_state
      for _ in range(DRAFT_RUN):
        out = propose(drafter_params, drafter_state, ctx, jax.random.key(1),
                      sampler)
        drafter_state = out.state
      return out

    draft = median_time(proposals, repeats) / DRAFT_RUN
  return Costs(target_1=target_1, verify=verify, draft=draft,
               prefill=prefill_s)


@dataclasses.dataclass
class Tally:
  """Sums over batches for one method in one repeat."""
  wall_s: float = 0.0
  steps: int = 0
  wide_steps: int = 0
  new_tokens: int = 0
  outputs: list = dataclasses.field(default_factory=list)
  rows: list = dataclasses.field(default_factory=list)

  def add(self, res: runner.BatchResult):
    self.wall_s += res.wall_s
    self.steps += res.num_steps + 1  # + the prefill step
    self.wide_steps += res.num_wide_steps
    self.new_tokens += res.new_tokens
    self.outputs += [r.output_ids for r in res.rows]
    self.rows += res.rows


def acceptance_stats(rows: Sequence[runner.RowResult], k: int) -> dict:
  """τ, per-position acceptance and the accepted-length histogram over rows
  (definitions in the module docstring)."""
  forwards = sum(r.target_forwards for r in rows)
  emitted = sum(len(r.output_ids) - 1 for r in rows)
  at = np.sum([r.accepted_at for r in rows], axis=0) if k else np.zeros(0)
  nodes = (np.sum([r.accepted_nodes for r in rows], axis=0) if rows
           else np.zeros(0))
  per_node = {} if not np.size(nodes) else dict(acceptance_per_node=[
      round(float(a) / max(forwards, 1), 4) for a in nodes])
  return dict(
      tau=emitted / max(forwards, 1),
      acceptance_per_position=[round(float(a) / max(forwards, 1), 4)
                               for a in at],
      **per_node,
      accepted_length_histogram=runner.accepted_length_histogram(at, forwards),
      drafted_per_step=sum(r.num_drafted for r in rows) / max(forwards, 1),
      target_forwards=forwards)


@functools.cache
def git_sha() -> str:
  """The checkout's commit (``-dirty`` with uncommitted changes to tracked
  files), read once: an hours-long run reports the code it started with,
  not a commit made while it ran."""
  root = pathlib.Path(__file__).parents[1]
  git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True,
                                  check=True, cwd=root).stdout.strip()
  try:
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return git("rev-parse", "--short", "HEAD") + ("-dirty" if dirty else "")
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def _journal_key(model: Model, built, prompts, **settings) -> str:
  """What a journal record is valid for: the same model, backend, prompts,
  settings and drafters, down to the bytes of the drafters' parameters (a
  retrained head under the same file name is a new benchmark)."""
  h = hashlib.sha256(json.dumps(
      [repr(model.config), jax.default_backend(),
       [list(map(int, p)) for p in prompts],
       [[dataclasses.asdict(s), repr(m.drafter)] for s, m in built],
       settings], sort_keys=True, default=str).encode())
  for leaf in jax.tree.leaves([m.params for _, m in built]):
    h.update(np.ascontiguousarray(leaf).tobytes())
  return h.hexdigest()[:16]


def _read_journal(path: Optional[pathlib.Path], key: str, runs: int) -> dict:
  """``{(repeat, batch): [BatchResult of AR, then of each method]}``; a
  record of another benchmark, cut short by a kill or of another layout is
  ignored, and so is any line that is not one (bytes that are not UTF-8,
  JSON nested too deep to parse)."""
  done = {}
  if path is None or not path.is_file():
    return done
  for line in path.read_bytes().splitlines():
    try:
      rec = json.loads(line.decode("utf-8"))
      if rec.get("key") != key or len(rec["runs"]) != runs:
        continue
      done[rec["repeat"], rec["batch"]] = [
          runner.BatchResult(**{**r, "rows": [runner.RowResult(**row)
                                             for row in r["rows"]]})
          for r in rec["runs"]]
    except (ValueError, AttributeError, KeyError, TypeError, RecursionError):
      continue  # JSONDecodeError and UnicodeDecodeError are ValueErrors
  return done


def _append_journal(path: pathlib.Path, key: str, rep: int, i: int,
                    results: Sequence[runner.BatchResult]):
  rec = dict(key=key, repeat=rep, batch=i, git_sha=git_sha(),
             runs=[dataclasses.asdict(r) for r in results])
  line = json.dumps(rec) + "\n"
  with open(path, "ab+") as f:
    if f.seek(0, 2):  # a kill mid-write leaves a torn last line: end it
      f.seek(-1, 2)
      if f.read(1) != b"\n":
        line = "\n" + line
    f.write(line.encode())


def run(model: Model, methods_: Sequence[methods.MethodSpec | tuple],
        prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
        sampling: SamplingParams, batch_size: int = 1, repeats: int = 1,
        seed: int = 0, dataset: str = "?",
        on_result: Optional[Callable[[dict], None]] = None,
        journal=None, progress: bool = True) -> list[dict]:
  """Benchmarks each method against AR on ``prompts``; one dict per method.

  ``methods_`` holds ``MethodSpec``s or already built ``(spec, Method)``
  pairs (``methods.build``).

  ``on_result`` is called with each method's dict as soon as it is done, so
  a long run keeps what it measured if it is interrupted later.

  ``journal``: a JSONL file of finished batches (module doc); batches found
  there for this exact benchmark are read back, not decoded again.
  """
  from tqdm import tqdm
  git_sha()  # now, before hours of decoding
  built = [m if isinstance(m, tuple) else (m, methods.build(model, m))
           for m in methods_]
  specs = [m[0] for m in built]
  batches = [list(prompts[i:i + batch_size])
             for i in range(0, len(prompts), batch_size)]
  kw = dict(max_new_tokens=max_new_tokens, sampling=sampling)
  journal = pathlib.Path(journal) if journal else None
  key = journal and _journal_key(model, built, prompts, batch_size=batch_size,
                                 seed=seed, **kw)
  done = _read_journal(journal, key, 1 + len(built))
  ar_tallies, tallies = [], {s: [] for s in specs}
  total = repeats * len(batches) * (1 + len(specs))
  bar = tqdm(total=total, desc="bench", unit="run", disable=not progress)
  for rep in range(repeats):
    ar = Tally()
    per = {s: Tally() for s in specs}
    for i, chunk in enumerate(batches):
      batch_runs = done.get((rep, i))
      if batch_runs is None:
        sd = seed + 1000 * rep + i
        batch_runs = [runner.generate_ids(model, chunk, seed=sd, **kw)]
        bar.update()
        for _, method in built:
          batch_runs.append(runner.generate_ids(model, chunk, seed=sd,
                                                method=method, **kw))
          bar.update()
        if journal:
          _append_journal(journal, key, rep, i, batch_runs)
      else:
        bar.update(len(batch_runs))
      ar.add(batch_runs[0])
      for spec, res in zip(specs, batch_runs[1:]):
        per[spec].add(res)
      bar.set_postfix(ar_tok_s=f"{ar.new_tokens / ar.wall_s:.1f}")
    ar_tallies.append(ar)
    for s in specs:
      tallies[s].append(per[s])
  bar.close()

  ar_tok_s = statistics.median(t.new_tokens / t.wall_s for t in ar_tallies)
  ar_step_s = statistics.median(t.wall_s / t.steps for t in ar_tallies)
  results = []
  for spec, method in built:
    runs = tallies[spec]
    dcfg = runner.decode_config(
        model, bucketing.bucket_length(max(map(len, batches[0]))),
        max_new_tokens, sampling, method)
    costs = measure_costs(model, batches[0], dcfg, method.params)
    acc = acceptance_stats(runs[0].rows, spec.k)
    wall = statistics.median(t.wall_s for t in runs)
    steps, wide = runs[0].steps, runs[0].wide_steps
    wide_fraction = wide / max(steps, 1)
    split = dict(draft_s=costs.draft * steps,
                 verify_s=costs.verify * wide + costs.target_1 * (steps - wide))
    split["rest_s"] = max(wall - split["draft_s"] - split["verify_s"], 0.0)
    speedup = statistics.median(a.wall_s / t.wall_s * t.new_tokens /
                                a.new_tokens
                                for a, t in zip(ar_tallies, runs))
    predicted = costs.predicted_speedup(acc["tau"], ar_step_s, wide_fraction)
    pearl = {} if not dcfg.pearl else dict(
        pre_verify_steps=sum(r.pre_verify_steps for r in runs[0].rows),
        post_verify_steps=sum(r.post_verify_steps for r in runs[0].rows),
        predicted_speedup_two_groups=round(costs.predicted_speedup(
            acc["tau"], ar_step_s, wide_fraction, overlap=True), 4))
    identical = [a == b for a, b in zip(ar_tallies[0].outputs, runs[0].outputs)]
    result = dict(
        method=spec.name, dataset=dataset, model=model.config.name,
        **sampling.record(), num_prompts=len(prompts),
        new_tokens=runs[0].new_tokens, max_new_tokens=max_new_tokens,
        batch_size=batch_size, repeats=repeats, num_draft=spec.k,
        tree_nodes=spec.tree_nodes, verify_width=dcfg.width,
        wide_verify_fraction=round(wide_fraction, 4),
        **{k: (round(v, 4) if isinstance(v, float) else v)
           for k, v in acc.items()},
        tokens_per_s=round(statistics.median(t.new_tokens / t.wall_s
                                             for t in runs), 3),
        ar_tokens_per_s=round(ar_tok_s, 3), speedup=round(speedup, 4),
        predicted_speedup=round(predicted, 4),
        speedup_vs_predicted=round(speedup / predicted, 4), **pearl,
        greedy_identical=(all(identical) if sampling.greedy else None),
        rows_differing_from_ar=(identical.count(False) if sampling.greedy
                                else None),
        time_split={k: round(v / wall, 4) for k, v in split.items()},
        ttft_ms=round(costs.prefill * 1e3, 3),
        costs_ms=dict(target_forward_1=round(costs.target_1 * 1e3, 3),
                      verify_forward=round(costs.verify * 1e3, 3),
                      draft=round(costs.draft * 1e3, 3),
                      ar_step=round(ar_step_s * 1e3, 3)),
        config=dataclasses.asdict(spec),
        head_id=methods.head_id(model.config.name, spec), git_sha=git_sha(),
        backend=jax.default_backend())
    results.append(result)
    if on_result:
      on_result(result)
  return results
