"""The GPU run (``python -m benchmarks.gpu``, benchmarks/gpu/): what travels
in parts comes back whole or not at all, the data survives its compact
format, first contact picks a working package set in time, the step plan
fits the budget it was given, and the lease plan fits the lease. A
benchmark's tests, so the long stage runs them."""

import hashlib
import json
import os

import numpy as np
import pytest

from benchmarks.gpu import device as kit_device
from benchmarks.gpu import files as kit_files
from benchmarks.gpu import kit as gpu_kit
from benchmarks.gpu import plan as kit_plan
from specjax.training.data import Examples

pytestmark = pytest.mark.long

MIB = kit_files.MIB


def test_parts_join_back_and_name_what_is_missing_or_damaged(tmp_path):
  """Invariant: split -> join is the identity across part folders (a
  smaller first part included); a missing or altered part is named, and no
  joined file is claimed."""
  blob = np.random.default_rng(0).bytes(10_000)
  src = tmp_path / "kit.tar"
  src.write_bytes(blob)
  whole = hashlib.sha256(blob).hexdigest()
  recs = kit_files.split_file(src, 3_000, lambda i: tmp_path / f"p{i + 1}",
                              first_bytes=1_000)
  assert [r["bytes"] for r in recs] == [1000, 3000, 3000, 3000]
  found = sorted(tmp_path.glob("p*/kit.tar.*"))
  out = kit_files.join_parts(found, recs, tmp_path / "o" / "kit.tar", whole)
  assert out.read_bytes() == blob
  with pytest.raises(ValueError, match="missing parts: kit.tar.002"):
    kit_files.join_parts(found[:2] + found[3:], recs, tmp_path / "x", whole)
  found[1].write_bytes(b"\0" + found[1].read_bytes()[1:])
  with pytest.raises(ValueError, match="kit.tar.001 is damaged"):
    kit_files.join_parts(found, recs, tmp_path / "y", whole)


def test_examples_round_trip_through_the_kit_format(tmp_path):
  """Invariant: uint16 ids and bit-packed masks (T not a multiple of 8)
  load back as the int32 / bool arrays training reads."""
  rng = np.random.default_rng(1)
  make = lambda n: Examples(rng.integers(0, 49152, (n, 13)).astype(np.int32),
                            rng.random((n, 13)) < 0.5,
                            rng.integers(1, 14, n).astype(np.int32))
  train, held = make(5), make(3)
  kit_files.save_examples(tmp_path / "e.npz", train, held)
  for a, b in zip((train, held), kit_files.load_examples(tmp_path / "e.npz")):
    for x, y in zip((a.ids, a.mask, a.lengths), (b.ids, b.mask, b.lengths)):
      assert x.dtype == y.dtype
      np.testing.assert_array_equal(x, y)


def _log(phases):
  """A metrics log of every step: ``phases`` = [(ttt, compile, step, n)]."""
  rows, t, step = [], 0.0, 0
  for ttt, compile_s, step_s, n in phases:
    for i in range(n):
      t += step_s + (compile_s if i == 0 else 0.0)
      step += 1
      rows.append(dict(step=step, ttt=ttt, elapsed_s=t))
  return rows


def test_step_plan_fits_the_budget():
  """Invariant: from a log with known compile and step times the plan
  recovers them per TTT length and picks the most steps whose time fits
  the budget, counting only compiles not yet paid."""
  from specjax.training.config import TrainConfig
  One = TrainConfig().updated({"ttt.warm_fraction": 0.0, "ttt.warm_steps": 3,
                               "ttt.steps": 3})
  Two = TrainConfig().updated({"ttt.warm_fraction": 0.85,
                               "ttt.warm_steps": 3, "ttt.steps": 7})
  times = kit_device.step_times(_log([(3, 30.0, 0.2, 8), (7, 40.0, 0.5, 8)]))
  assert times[3]["step_s"] == pytest.approx(0.2)
  assert times[7]["step_s"] == pytest.approx(0.5)
  assert times[3]["compile_s"] == pytest.approx(30.0)
  assert times[7]["compile_s"] == pytest.approx(40.0)
  assert kit_device.plan_steps(times, One, 100.0) == int((100 - 30) / 0.2)
  assert kit_device.plan_steps(times, One, 100.0, compiled=(3,)) == 500
  per = 0.85 * 0.2 + 0.15 * 0.5
  assert kit_device.plan_steps(times, Two, 400.0, compiled=(3,)) == int(
      (400 - 40) / per)
  assert kit_device.plan_steps(times, One, 20.0) == 0


def test_check_reports_parts_and_fails_on_damage_or_mixed_packs(
    tmp_path, monkeypatch, capsys):
  """Invariant: `check` lists each part as ok / missing (exit 0: later
  calls bring those), exits 1 on a damaged part, and refuses parts whose
  manifests differ (two packs)."""
  monkeypatch.setattr(kit_files, "KIT", tmp_path)
  src = tmp_path / "kit.tar"
  src.write_bytes(bytes(range(256)) * 20)
  recs = kit_files.split_file(src, 2_000, lambda i: tmp_path / f"p{i + 1}")
  manifest = json.dumps(dict(tar="kit.tar", sha256=kit_files.sha256(src),
                             parts=recs))
  for d in ("p1", "p2"):
    (tmp_path / d / "manifest.json").write_text(manifest)
  (tmp_path / "p3" / "kit.tar.002").unlink()
  assert gpu_kit.main(["check"]) == 0
  assert capsys.readouterr().out.split("\n")[:3] == [
      "kit.tar.000: ok", "kit.tar.001: ok", "kit.tar.002: missing"]
  (tmp_path / "p2" / "kit.tar.001").write_bytes(b"x")
  assert gpu_kit.main(["check"]) == 1
  assert "kit.tar.001: DAMAGED" in capsys.readouterr().out
  (tmp_path / "p2" / "manifest.json").write_text(manifest.replace("kit", "kat"))
  assert gpu_kit.main(["check"]) == 2
  assert "different packs" in capsys.readouterr().err


def test_smoke_runs_the_trainer_through_a_resume(tmp_path):
  """Invariant: the device-side smoke run imports what the run needs,
  trains, checkpoints, resumes to its last step with finite losses and
  exports a head (what the real run needs from a machine's packages)."""
  out = kit_device.smoke(tmp_path / "s")
  assert out["seconds"] > 0 and out["versions"]["gguf"] != "missing"
  assert (tmp_path / "s" / "head.npz").exists()
  assert [json.loads(l)["step"] for l in
          (tmp_path / "s" / "metrics.jsonl").open()] == [1, 2, 3, 4]


def test_first_passing_falls_back_on_failure_and_on_timeout(tmp_path):
  """Invariant: package folders are tried in order and the first set with
  which the command succeeds in time is returned; a set whose child hangs
  past the timeout counts as failed; if none passes, a ValueError."""
  good, bad, slow = tmp_path / "good", tmp_path / "bad", tmp_path / "slow"
  for d in (good, bad, slow):
    d.mkdir()
  (good / "kitprobe_mod.py").write_text("")
  (slow / "kitprobe_mod.py").write_text("import time; time.sleep(60)")
  argv = ["-c", "import kitprobe_mod"]
  assert kit_device.first_passing([[bad], [good, bad]], argv) == [good, bad]
  assert kit_device.first_passing([[good]], argv) == [good]
  assert kit_device.first_passing([[slow], [good]], argv, timeout=2) == [good]
  with pytest.raises(ValueError, match="every package set failed"):
    kit_device.first_passing([[bad], [slow]], argv, timeout=2)


def test_backend_must_be_the_one_jax_platforms_names(monkeypatch):
  """Invariant: first contact refuses to go on unless JAX_PLATFORMS is set
  and JAX runs on it (a CUDA plugin that fails must not fall back to the
  CPU unnoticed)."""
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  with pytest.raises(ValueError, match="JAX_PLATFORMS is not set"):
    kit_device.require_backend()
  monkeypatch.setenv("JAX_PLATFORMS", "cuda")
  with pytest.raises(ValueError, match="JAX_PLATFORMS=cuda but JAX runs on "
                     "cpu"):
    kit_device.require_backend()
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  assert kit_device.require_backend().startswith("cpu")


def test_first_contact_failure_ends_the_call_at_once(tmp_path, monkeypatch):
  """Invariant: a failed first contact exits 1 before the cost curve and
  the probe, with the reason in first_contact.json."""
  monkeypatch.setattr(kit_files, "KIT", tmp_path / "nokit")
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  out = tmp_path / "out"
  assert gpu_kit.main(["first", "--out", str(out), "--scratch",
                       str(tmp_path / "s")]) == 1
  report = json.loads((out / "first_contact.json").read_text())
  assert report["ok"] is False and "manifest.json" in report["error"]
  assert "cost curve" not in report["seconds"]
  assert sorted(p.name for p in out.iterdir()) == ["first_contact.json"]


def test_lease_plan_fits_the_lease_and_says_why_not():
  """Invariant: the plan's seconds add up to at most the lease less the
  spare, training gets the rest (capped by a command's limit), and a call
  carrying over 64 MiB or a lease leaving too little training is refused
  with the reason."""
  tree, parts = 28 * MIB, [33 * MIB, 35 * MIB, 30 * MIB]
  plan = kit_plan.time_plan(parts, tree)
  assert plan["ok"] and [c["role"] for c in plan["calls"]] == [
      "first", "check", "train"]
  assert plan["planned_s"] <= kit_plan.LEASE_S - kit_plan.SPARE_S + 1e-6
  assert plan["spare_s"] >= kit_plan.SPARE_S
  assert plan["budget_s"] <= kit_plan.COMMAND_S - kit_plan.TIMEOUT_MARGIN_S
  assert sum(c["seconds"] for c in plan["calls"]) + kit_plan.DEVICE_S[
      "give_back"] == pytest.approx(plan["planned_s"], abs=0.5)
  big = kit_plan.time_plan([40 * MIB, 10 * MIB], tree)
  assert not big["ok"] and "call 1 carries 68.0 MiB" in big["problems"][0]
  slow = kit_plan.time_plan(parts, tree, costs=dict(kit_plan.DEVICE_S,
                                                    start=500))
  assert not slow["ok"] and "left for training" in slow["problems"][-1]
  one = kit_plan.calls([10 * MIB])
  assert [c.role for c in one] == ["first", "train"] and one[1].carry == ()


def test_calls_tee_their_log_and_hold_jax_to_the_platform():
  """Invariant: every long call tees its whole log into $OUT and names
  JAX_PLATFORMS, and no timeout exceeds a command's limit (the last call's
  is B + the margin, B at most the limit less the margin)."""
  for c in kit_plan.calls([30 * MIB] * 4):
    assert "JAX_PLATFORMS=cuda" in c.command
    if c.role == "train":
      assert c.timeout_s is None and "B = min(570," in (
          kit_plan.last_budget_rule())
    else:
      assert c.timeout_s <= kit_plan.COMMAND_S
    if c.role != "check":
      assert "set -o pipefail" in c.command
      assert c.command.endswith(f"| tee $OUT/{c.role}.log")


def test_rehearsal_refuses_a_part_that_would_not_fit(tmp_path, monkeypatch,
                                                     capsys):
  """Invariant: `rehearse` measures tree + part per call and fails loudly
  (exit 1, the call named) before running anything when one is over."""
  monkeypatch.setattr(kit_files, "KIT", tmp_path)
  for i, size in ((1, 20), (2, 70)):
    (tmp_path / f"p{i}").mkdir()
    with open(tmp_path / f"p{i}" / "kit.tar.000", "wb") as f:
      f.truncate(size * MIB)  # sparse: sizes, not bytes, are measured
  assert gpu_kit.main(["rehearse"]) == 1
  report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert report["ok"] is False and report["calls"] == 2
  assert any(p.startswith("call 2 carries") for p in report["problems"])
  assert report["max_call_mib"] > 70 and "runs" in report
  assert report["runs"] == []


def test_out_limits_name_what_would_not_come_back(tmp_path):
  """Invariant: more than 8 files, a file over 16 MiB, an odd name or a
  folder three down are each named."""
  out = tmp_path / "out"
  (out / "a" / "b" / "c").mkdir(parents=True)
  assert kit_files.out_problems(out) == []
  (out / "ok.json").write_text("{}")
  (out / "a" / "b" / "deep.txt").write_text("")
  assert kit_files.out_problems(out) == []
  (out / "a" / "b" / "c" / "deeper.txt").write_text("")
  (out / "bad name.txt").write_text("")
  with open(out / "big.bin", "wb") as f:
    f.truncate(17 * MIB)
  for i in range(5):
    (out / f"f{i}").write_text("")
  problems = kit_files.out_problems(out)
  assert any("files > 8" in p for p in problems)
  assert any(p.startswith("big.bin: 17.0 MiB") for p in problems)
  assert any(p.startswith("a/b/c/deeper.txt") for p in problems)
  assert any(p.startswith("bad name.txt") for p in problems)


def test_pip_download_asks_for_the_device_python(monkeypatch, tmp_path):
  """Invariant: wheels are fetched for the device's Python and platform,
  binary only, so a compiled package arrives for its ABI."""
  seen = {}
  monkeypatch.setattr(gpu_kit.subprocess, "run",
                      lambda argv, check: seen.setdefault("argv", argv))
  gpu_kit.pip_download(tmp_path, ["gguf==0.19.0"])
  argv = seen["argv"]
  assert argv[argv.index("--python-version") + 1] == "3.12"
  assert "--only-binary=:all:" in argv and "manylinux_2_28_x86_64" in argv
  assert argv[-1] == "gguf==0.19.0"
  assert os.path.samefile(argv[argv.index("-d") + 1], tmp_path)


def test_last_call_sizes_the_run_and_compares_decoding(tmp_path):
  """Invariants: the last call sizes the run so that training ends where
  scoring and writes still fit (steps x the slower of the probe's and its
  own step time fills the time left, before the decode's reserved time),
  and the bf16 decode comparison reports AR and every EAGLE-3 chain and tree
  at each batch with their outputs compared, written as each batch ends and
  starting nothing past its deadline."""
  import time
  from tests.test_eagle_train import CFG, _examples, make_tiny_model
  model = make_tiny_model()
  ex = _examples(20)
  cfg = CFG.updated({"steps": 100, "checkpoint_every": 0,
                     "data.heldout": 0})
  from specjax.training import train as etrain
  etrain.train(cfg.updated({"steps": 2}), tmp_path / "h",
               model=model, examples=ex, progress=False)
  (tmp_path / "plan.json").write_text(json.dumps(dict(
      times={"2": dict(step_s=0.5, compile_s=1.0)}, score_s=5.0)))
  end = time.time() + 120 + kit_device.DECODE_S
  sized, plan = kit_device.size_run(cfg, model, ex, tmp_path, end, 3)
  left = plan["train_until"] - time.time()
  assert plan["probe"] and plan["score_s"] == 5.0
  assert plan["train_until"] == pytest.approx(
      end - 5.0 - kit_device.WRITE_S - kit_device.DECODE_S)
  assert sized.steps == plan["steps"] >= 1
  assert plan["times"][2]["step_s"] == 0.5  # the slower of the two
  assert (sized.steps - 1) * 0.5 <= left + 1 and sized.steps * 0.5 >= left - 1
  head = str(tmp_path / "h" / "head.npz")
  out = kit_device.decode_bench(model, head, ex, new_tokens=4, repeats=1,
                                batches=(2,), out=tmp_path / "decode.json")
  (row,) = out["rows"]
  assert json.loads((tmp_path / "decode.json").read_text()) == out
  assert row["batch"] == 2 and row["dtype"] == "bfloat16"
  assert row["ar_tok_s"] > 0
  for name, _ in kit_device.DECODE_SPECS:
    assert row[name]["tok_s"] > 0 and row[name]["tau"] >= 1.0
    assert len(row[name]["greedy_equal"]) == 2
  late = kit_device.decode_bench(model, head, ex, new_tokens=4, repeats=1,
                                 batches=(2,), until=time.time())
  assert late["rows"] == []
