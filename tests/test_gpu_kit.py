"""The GPU kit's plumbing (experiments/gpu_kit.py): what travels in parts
comes back whole or not at all, the data survives its compact format, and
the step plan fits the budget it was given."""

import hashlib
import json

import numpy as np
import pytest

from experiments import gpu_kit
from specjax.eagle.data import Examples


def test_parts_join_back_and_name_what_is_missing_or_damaged(tmp_path):
  """Invariant: split -> join is the identity across part folders; a
  missing or altered part is named, and no joined file is claimed."""
  blob = np.random.default_rng(0).bytes(10_000)
  src = tmp_path / "kit.tar"
  src.write_bytes(blob)
  whole = hashlib.sha256(blob).hexdigest()
  recs = gpu_kit.split_file(src, 3_000, lambda i: tmp_path / f"p{i + 1}")
  assert [r["bytes"] for r in recs] == [3000, 3000, 3000, 1000]
  found = sorted(tmp_path.glob("p*/kit.tar.*"))
  out = gpu_kit.join_parts(found, recs, tmp_path / "o" / "kit.tar", whole)
  assert out.read_bytes() == blob
  with pytest.raises(ValueError, match="missing parts: kit.tar.002"):
    gpu_kit.join_parts(found[:2] + found[3:], recs, tmp_path / "x", whole)
  found[1].write_bytes(b"\0" + found[1].read_bytes()[1:])
  with pytest.raises(ValueError, match="kit.tar.001 is damaged"):
    gpu_kit.join_parts(found, recs, tmp_path / "y", whole)


def test_examples_round_trip_through_the_kit_format(tmp_path):
  """Invariant: uint16 ids and bit-packed masks (T not a multiple of 8)
  load back as the int32 / bool arrays training reads."""
  rng = np.random.default_rng(1)
  make = lambda n: Examples(rng.integers(0, 49152, (n, 13)).astype(np.int32),
                            rng.random((n, 13)) < 0.5,
                            rng.integers(1, 14, n).astype(np.int32))
  train, held = make(5), make(3)
  gpu_kit.save_examples(tmp_path / "e.npz", train, held)
  for a, b in zip((train, held), gpu_kit.load_examples(tmp_path / "e.npz")):
    for x, y in zip((a.ids, a.mask, a.lengths), (b.ids, b.mask, b.lengths)):
      assert x.dtype == y.dtype
      np.testing.assert_array_equal(x, y)


def test_step_plan_fits_the_budget():
  """Invariant: from a probe with known compile and step times the plan
  recovers them and picks the most steps whose time fits the budget."""
  class Cfg:
    ttt_warm_fraction = 0.85
  warm, full, c3, c7 = 0.2, 0.5, 30.0, 40.0
  e, t = {}, 0.0
  for step in range(1, 17):
    t += (c3 if step == 1 else c7 if step == 9 else 0) + (
        warm if step <= 8 else full)
    e[step] = t
  plan = gpu_kit.plan_steps([dict(step=s, elapsed_s=v) for s, v in e.items()],
                            Cfg, seconds=400.0)
  assert plan["step_s_warm"] == pytest.approx(warm)
  assert plan["step_s_full"] == pytest.approx(full)
  assert plan["compile_s"] == pytest.approx(c3 + c7 + warm, abs=0.1)
  per = 0.85 * warm + 0.15 * full
  assert plan["steps"] == int((400.0 - (c3 + c7 + warm)) / per)


def test_check_reports_parts_and_fails_on_damage_or_mixed_packs(
    tmp_path, monkeypatch, capsys):
  """Invariant: `check` lists each part as ok / missing (exit 0: later
  calls bring those), exits 1 on a damaged part, and refuses parts whose
  manifests differ (two packs)."""
  import json
  monkeypatch.setattr(gpu_kit, "KIT", tmp_path)
  src = tmp_path / "kit.tar"
  src.write_bytes(bytes(range(256)) * 20)
  recs = gpu_kit.split_file(src, 2_000, lambda i: tmp_path / f"p{i + 1}")
  manifest = json.dumps(dict(tar="kit.tar", sha256=gpu_kit.sha256(src),
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
  """Invariant: the device-side smoke run trains, checkpoints, resumes to
  its last step with finite losses and exports a head (what the real run
  needs from a machine's packages)."""
  out = gpu_kit.smoke(tmp_path / "s")
  assert out["seconds"] > 0
  assert (tmp_path / "s" / "head.npz").exists()
  assert [json.loads(l)["step"] for l in
          (tmp_path / "s" / "metrics.jsonl").open()] == [1, 2, 3, 4]


def test_first_passing_falls_back_to_the_next_package_set(tmp_path):
  """Invariant: package folders are tried in order and the first set with
  which the command succeeds is returned; if none does, a ValueError."""
  good, bad = tmp_path / "good", tmp_path / "bad"
  good.mkdir(), bad.mkdir()
  (good / "kitprobe_mod.py").write_text("")
  argv = ["-c", "import kitprobe_mod"]
  assert gpu_kit.first_passing([[bad], [good, bad]], argv) == [good, bad]
  assert gpu_kit.first_passing([[good]], argv) == [good]
  with pytest.raises(ValueError, match="every package set failed"):
    gpu_kit.first_passing([[bad]], argv)
