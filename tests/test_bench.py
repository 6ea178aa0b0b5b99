"""``measure.bench``: the JSON contract and the bookkeeping behind it."""

import dataclasses

import numpy as np
import pytest

from specjax.core.sampling import SamplingParams
from specjax.drafters import methods
from specjax.measure import bench

CONTRACT = ("method", "dataset", "temperature", "num_prompts", "new_tokens",
            "tau", "acceptance_per_position", "tokens_per_s",
            "ar_tokens_per_s", "speedup", "greedy_identical", "time_split",
            "ttft_ms", "config", "head_id", "git_sha")


@pytest.mark.long
def test_bench_contract_on_smollm2(smollm2):
  """Invariants on a small real run (2 prompts, n-gram, K = 3, T = 0):
  every contract field is present; greedy output equals AR; the accepted
  length histogram sums to the verify steps and reproduces the per-position
  acceptance and (up to budget cuts) τ; the time split is a partition of the wall time;
  the time to the first token is a part of the run's wall time; each
  result reaches ``on_result`` as soon as it is measured."""
  prompts = [smollm2.tokenizer.encode_chat(p) for p in
             ("Repeat after me: one two three, one two three.",
              "Count from 1 to 12, separated by commas.")]
  seen = []
  [res] = bench.run(smollm2, [methods.MethodSpec("ngram", num_draft=3)],
                    prompts, max_new_tokens=24, sampling=SamplingParams(),
                    dataset="unit", on_result=seen.append, progress=False)
  assert seen == [res]
  assert all(k in res for k in CONTRACT)
  assert res["head_id"] is None  # n-gram has no head; see the head test
  assert res["greedy_identical"] is True and res["rows_differing_from_ar"] == 0
  hist = np.array(res["accepted_length_histogram"])
  assert len(hist) == 4 and hist.sum() == res["target_forwards"]
  # Verified tokens per step = accepted drafts + one correction/bonus; a
  # row's last block may be cut at its budget (at most K tokens per row).
  verified = (hist * np.arange(4)).sum() + hist.sum()
  emitted = res["tau"] * res["target_forwards"]
  assert 0 <= verified - emitted <= 3 * len(prompts) + 1e-6
  assert res["tau"] > 1
  p_ge = hist[::-1].cumsum()[::-1] / hist.sum()  # P(accepted >= j)
  np.testing.assert_allclose(res["acceptance_per_position"], p_ge[1:],
                             atol=1e-4)
  split = res["time_split"]
  assert set(split) == {"draft_s", "verify_s", "rest_s"}
  assert all(v >= 0 for v in split.values())
  # A partition of the wall time: == 1, or more when rest was clipped at 0.
  assert sum(split.values()) >= 0.999
  assert split["rest_s"] > 0 or sum(split.values()) <= 1.5, split
  assert split["rest_s"] == 0 or abs(sum(split.values()) - 1) < 1e-3, split
  assert res["speedup"] > 0 and res["predicted_speedup"] > 0
  assert 0 < res["ttft_ms"] < 1e3 * res["new_tokens"] / res["tokens_per_s"]


@pytest.mark.long
def test_journal_resumes_a_cut_run(smollm2, tmp_path, monkeypatch):
  """A benchmark rerun with its journal decodes only the batches missing
  from it and reports what an uninterrupted run reports (everything but
  timings); a torn last line is skipped, and a journal of other settings
  is never read back."""
  from specjax.core import runner
  prompts = [smollm2.tokenizer.encode_chat(p) for p in
             ("Repeat after me: one two three, one two three.",
              "Count from 1 to 12, separated by commas.")]
  spec = methods.MethodSpec("ngram", num_draft=3)
  calls = []
  real = runner.generate_ids
  monkeypatch.setattr(runner, "generate_ids",
                      lambda *a, **kw: calls.append(1) or real(*a, **kw))
  journal = tmp_path / "bench.journal"
  go = lambda n=16: bench.run(smollm2, [spec], prompts, max_new_tokens=n,
                              sampling=SamplingParams(), journal=journal,
                              progress=False)[0]
  full = go()
  assert len(calls) == 4  # 2 batches x (AR + n-gram)
  first, _ = journal.read_text().splitlines()
  journal.write_text(first + "\n" + '{"key": "cut sh')
  calls.clear()
  resumed = go()
  assert len(calls) == 2  # only the second batch ran again
  same = ("tau", "acceptance_per_position", "accepted_length_histogram",
          "new_tokens", "greedy_identical", "target_forwards")
  assert {k: resumed[k] for k in same} == {k: full[k] for k in same}
  assert len(journal.read_text().splitlines()) == 3
  calls.clear()
  go(n=12)
  assert len(calls) == 4  # other settings: nothing read back
  # Other drafter parameters (a retrained head in the same file): a new key.
  method = methods.build(smollm2, spec)
  key = lambda w: bench._journal_key(
      smollm2, [(spec, dataclasses.replace(method, params={"w": w}))],
      prompts, max_new_tokens=16)
  assert key(np.zeros(3)) == key(np.zeros(3)) != key(np.ones(3))


def test_head_id_names_the_head_file_and_its_digest(tmp_path):
  """Invariant: a head method's result rows carry ``name@digest`` of the
  head file they were measured with (the shipped one by default), so two
  heads with the same name are told apart; other methods carry None."""
  for name in ("eagle3", "medusa"):
    shipped = methods.head_id("smollm2-135m", methods.MethodSpec(name))
    assert shipped.startswith(f"smollm2-135m-{name}.npz@") and len(
        shipped.split("@")[1]) == 12
  a, b = tmp_path / "a" / "head.npz", tmp_path / "b" / "head.npz"
  for path, data in ((a, b"one"), (b, b"two")):
    path.parent.mkdir()
    path.write_bytes(data)
  ids = [methods.head_id("smollm2-135m", methods.MethodSpec(
      "medusa", head=str(p))) for p in (a, b)]
  assert ids[0] != ids[1] and all(i.startswith("head.npz@") for i in ids)
  assert methods.head_id("smollm2-135m", methods.MethodSpec("ngram")) is None
  with pytest.raises(methods.MethodError, match="no eagle head ships"):
    methods.head_id("smollm2-135m", methods.MethodSpec("eagle"))


def test_results_summary_keeps_the_newest_row_of_each_method():
  """Invariant: the at-a-glance table keeps, per method and knobs, head,
  dataset and temperature, the row of the last file given; other knobs,
  datasets and temperatures stay apart."""
  from benchmarks.results_summary import newest
  def row(file, k, dataset="mtbench", t=0.0, nodes=0):
    return dict(method="ngram", num_draft=k, tree_nodes=nodes, config={},
                dataset=dataset, num_prompts=80, temperature=t, file=file)
  rows = [row("old", 5), row("old", 5, t=1.0), row("old", 5, "humaneval"),
          row("old", 5, nodes=8), row("new", 5), row("new", 4)]
  out = newest(rows)
  assert len(out) == 5
  kept = {(r["num_draft"], r["tree_nodes"], r["dataset"], r["temperature"]):
          r["file"] for r in out}
  assert kept == {(5, 0, "mtbench", 0.0): "new", (4, 0, "mtbench", 0.0): "new",
                  (5, 0, "mtbench", 1.0): "old",
                  (5, 0, "humaneval", 0.0): "old",
                  (5, 8, "mtbench", 0.0): "old"}


def test_a_journal_of_garbage_is_skipped_line_by_line(tmp_path):
  """Invariant: a journal holding random bytes (not UTF-8), JSON nested
  100,000 deep, a JSON list and a record of the wrong shape is read
  without an error, and the one good record in it is read back whole."""
  from specjax.core import runner
  row = runner.RowResult(prompt_ids=[1], output_ids=[2, 3],
                         stop_reason="length")
  res = runner.BatchResult(rows=[row], wall_s=1.0, compile_s=0.0,
                           num_steps=2)
  journal = tmp_path / "bench.journal"
  journal.write_bytes(np.random.default_rng(0).bytes(4096) + b"\n"
                      + b"[" * 100_000 + b"\n[1, 2]\n" + b'{"key": 5}\n')
  bench._append_journal(journal, "k", 0, 0, [res, res])
  done = bench._read_journal(journal, "k", 2)
  assert list(done) == [(0, 0)]
  assert done[0, 0][1].rows[0].output_ids == [2, 3]
