"""The GPU verify-cost curve script (benchmarks/gpu/cost_curve.py) on this
CPU with a tiny shape: what a lease's first call runs and brings back."""

import json

import pytest

from benchmarks.gpu import cost_curve


@pytest.mark.long
def test_cost_curve_times_forwards_and_head_steps(tmp_path):
  """Invariant: every (batch, tokens) forward and both head Ks are timed
  (positive ms; T = 1 has ratio 1) and written as JSON; a deadline already
  past skips every group and still writes the file (nothing measured is
  lost when a call is cut)."""
  out = tmp_path / "cc.json"
  assert cost_curve.main([
      "--shapes", "tiny", "--dtypes", "float32", "--tokens", "1,4",
      "--batches", "2", "--context", "16", "--repeats", "10",
      "--out", str(out)]) == 0
  r = json.loads(out.read_text())
  assert [(x["batch"], x["tokens"]) for x in r["forward"]] == [(2, 1), (2, 4)]
  assert all(x["ms"] > 0 and x["ms_min"] <= x["ms"] for x in r["forward"])
  assert r["forward"][0]["ratio_to_1"] == 1.0
  assert [x["k"] for x in r["head"]] == [1, 7] and "step_ms" in r["head"][1]
  assert r["skipped"] == [] and r["backend"] == "cpu"
  late = cost_curve.measure(["tiny"], ["float32"], tmp_path / "late.json",
                                batches=(1,), tokens=(1,), context=16,
                                repeats=10, deadline=0.0)
  assert late["forward"] == [] and late["head"] == []
  assert late["skipped"] == ["forward tiny float32", "head tiny float32"]
