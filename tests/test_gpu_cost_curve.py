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


def test_pearl_predictions_wait_for_the_longer_half():
  """Invariant: from a curve with SmolLM2's and the 8B's forwards,
  PEARL's prediction on two devices divides the tokens a step emits by the
  longer of the draft (K one-token SmolLM2 forwards) and the 8B's forward
  over K; on one device by their sum; the chain's by K - 1 drafts and the
  same forward. A curve without the 8B gives none."""
  from specjax.measure import theory
  row = lambda shape, t, ms: dict(shape=shape, dtype="bfloat16", batch=1,
                                  tokens=t, ms=ms)
  curve = dict(forward=[row("llama-8b", 1, 20.0), row("llama-8b", 4, 24.0),
                        row("smollm2-135m", 1, 3.0)], head=[])
  [p] = cost_curve.pearl_predictions(curve, alphas=(0.7,), k=4)
  tokens = theory.pearl_steps(0.7, 4).tokens
  draft, verify = 4 * 3.0 / 20.0, 24.0 / 20.0
  assert p["pearl_two_devices"] == round(tokens / max(draft, verify), 3)
  assert p["pearl_one_device"] == round(tokens / (draft + verify), 3)
  assert p["chain_speedup"] == round(
      theory.expected_tokens(0.7, 3) / (3 * 3.0 / 20.0 + verify), 3)
  assert cost_curve.pearl_predictions(dict(forward=curve["forward"][2:],
                                           head=[])) == []
