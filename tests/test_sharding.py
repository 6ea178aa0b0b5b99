"""Decoding on device meshes: sharded = one device, token for token;
every array laid out as intended; mesh specs and their errors."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

from specjax.cli import main as cli
from specjax.core import sharding
from tests.forced_devices import run_worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worker(*flags) -> dict:
  """tests/sharding_worker.py on 8 forced host devices."""
  return run_worker("tests.sharding_worker", 8, *flags)


def _check_runs(out: dict, expected_runs: int):
  runs = out["runs"]
  assert len(runs) == expected_runs
  assert all(r["new_tokens"] == 8 * 12 for r in runs)  # every row ran out
  differ = [r for r in runs if not r["equal"]]
  assert not differ, differ


@pytest.mark.long
def test_without_the_engines_constraints_the_state_is_not_laid_out():
  """Invariant (mutation check): with ``sharding.constrain`` made the
  identity, the decode state the engine returns is not laid out as
  ``state_specs`` says (the cache and token buffer stay whole on each
  device) and the layout check below fails; the parameters, placed by the
  caller, still are."""
  out = _worker("--unconstrained")
  assert not out["every_leaf_as_specified"]
  sp = out["specs"]["data=2,model=4"]
  state = ("cache_k", "cache_v", "cache_lengths", "tokens", "num_tokens",
           "head_cache_k", "head_pending")
  assert any(sp[name] != LAID_OUT[name] for name in state), sp
  assert all(sp[name] == LAID_OUT[name] for name in LAID_OUT
             if name not in state)


# Global and per-device shapes on data=2 x model=4 (a ragged batch of 8).
LAID_OUT = {
    "wqkv": [[32, 128], [32, 32]], "wo": [[64, 32], [16, 32]],
    "w_gate_up": [[32, 96], [32, 24]], "w_down": [[48, 32], [12, 32]],
    "embed": [[64, 32], [16, 32]], "attn_norm": [[32], [32]],
    "cache_k": [[8, 8, 4, 48], [4, 2, 4, 48]],
    "cache_v": [[8, 8, 48, 4], [4, 2, 48, 4]],
    "cache_lengths": [[8], [4]], "tokens": [[8, 48], [4, 48]],
    "num_tokens": [[8], [4]], "head_cache_k": [[8, 8, 4, 48], [4, 8, 4, 48]],
    "head_pending": [[8, 4, 96], [4, 4, 96]], "head_fc": [[96, 32],
                                                          [96, 32]]}


@pytest.mark.long
def test_non_llama_target_sharded_equals_one_device():
  """Invariant: a Gemma-2-like target with every decoder option (biases,
  q/k and sandwich norms, soft-caps, alternating windows shorter than the
  rows, a local RoPE base) decodes on data=2 x model=2 exactly as on one
  device: AR and n-gram at T = 0, AR at T = 1 with the same key; its cache
  split by rows and kv heads."""
  out = _worker("--arch")
  runs = out["runs"]
  assert len(runs) == 3 and all(r["new_tokens"] == 8 * 12 for r in runs)
  assert all(r["equal"] for r in runs), runs
  assert runs[0]["cache_k"] == [[8, 4, 6, 48], [4, 2, 6, 48]]


@pytest.mark.long
def test_sharded_decoding_equals_one_device_and_is_laid_out():
  """Invariants on meshes 1x8, 2x4, 4x2 and 8x1, ragged batch of 8: (0)
  every parameter and every decode-state array (cache, tokens, counters,
  the EAGLE head's state, the key) carries the sharding
  ``sharding.param_specs`` / ``state_specs`` assign it; (1) AR, n-gram,
  EAGLE-3 chains and EAGLE-2 dynamic trees, at T = 0 and T = 1 (top-p 0.9)
  with the same key, emit exactly the single-device tokens (the random
  draws do not depend on the layout; see DESIGN.md "Scaling out"); (2) on
  data=2 x model=4, what each device holds: 1/4 of the kv heads' q/k/v
  columns, of the o-projection's rows, of the FFN units and of the
  vocabulary, all of the norms; 1/2 of the rows of the token buffer, the
  lengths and the cache, and 1/4 of the cache's kv heads; the EAGLE head's
  state split by row, its weights whole; on each mesh, B / data cache rows
  and G / model kv heads per device; (3) 3 kv heads (SmolLM2's) do not
  split over 2: q/k/v replicated, the FFN still split. The worker passes
  host prompts and key: the engine's own layout constraints place the
  state (test_without_the_engines_constraints_the_state_is_not_laid_out
  shows (2) failing without them)."""
  out = _worker("--full")
  _check_runs(out, 2 * 4 * 4)
  assert out["every_leaf_as_specified"]  # each parameter and state array
  assert out["specs"]["data=2,model=4"] == LAID_OUT
  assert out["specs"]["odd_heads"] == {"wqkv": [[32, 60], [32, 60]],
                                       "w_down": [[48, 32], [24, 32]]}
  for name, d, m in (("data=1,model=8", 1, 8), ("data=2,model=4", 2, 4),
                     ("data=4,model=2", 4, 2), ("data=8", 8, 1)):
    assert out["specs"][name]["cache_k"][1] == [8 // d, 8 // m, 4, 48]


def test_spec_maps_logical_axes_only_where_they_divide():
  """Invariant: a logical axis takes its mesh axis only when its size
  divides evenly and no earlier axis of the array took it."""
  mesh = AbstractMesh((2, 4), ("data", "model"))
  sizes = dict(batch=6, kv_heads=8, ffn=12, vocab=10)
  assert sharding.spec(("batch", "kv_heads", None), sizes, mesh) == P(
      "data", "model", None)
  assert sharding.spec(("vocab", None), sizes, mesh) == P(None, None)
  assert sharding.spec(("ffn", "kv_heads"), sizes, mesh) == P("model", None)
  assert sharding.spec(("batch",), dict(batch=3), mesh) == P(None)


def test_make_mesh_errors_name_the_problem():
  n = len(jax.devices())
  mesh = sharding.make_mesh(f"data={n}")
  assert dict(mesh.shape) == {"data": n, "model": 1}
  for bad, msg in (("pipe=2", "unknown mesh axis 'pipe'"),
                   ("data2", "not axis=size"), ("data=0", ">= 1"),
                   (f"data={n + 1}", f"needs {n + 1} devices, there are {n}")):
    with pytest.raises(sharding.MeshError, match=msg):
      sharding.make_mesh(bad)


def test_cli_mesh_error_is_one_line(capsys):
  """A mesh that does not fit the devices fails before the model loads."""
  n = len(jax.devices())
  rc = cli.main(["generate", "--prompt", "hi", "--mesh", f"data={n},model=2"])
  err = capsys.readouterr().err.strip().splitlines()
  assert rc == 2 and len(err) == 1
  assert err[0].startswith("specjax: error: --mesh: mesh ")
  assert f"needs {2 * n} devices" in err[0]


@pytest.mark.long
def test_data_parallel_training_equals_one_device_and_moves_meshes(tmp_path):
  """Invariants (tiny target, EAGLE-3 head, batch 4, 4 steps): (1) training
  on ``data=4,model=2`` (rows split, the frozen target tensor-parallel, the
  head replicated on all 8 devices) gives the one-device losses within
  rtol 1e-5 and parameters within 1e-5 (XLA adds the rows' gradients in
  another order); (2) a run interrupted on that mesh (checkpoint at step 2)
  resumes on ``data=2,model=4`` from step 2 and ends where the one-device
  run does, within the same tolerances."""
  out = _worker("--train", str(tmp_path))
  one = out["one"]
  for name in ("sharded", "moved"):
    assert sorted(out[name]) == sorted(one)
    np.testing.assert_allclose([out[name][s] for s in one],
                               [one[s] for s in one], rtol=1e-5)
    assert out["max_param_diff"][name] < 1e-5
  assert out["resumed_from"] == 2
  assert out["head_fc"] == [[72, 24], [72, 24]] and out["head_on_devices"] == 8


def _free_port() -> int:
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.long
def test_two_processes_decode_on_one_global_mesh(tmp_path):
  """Invariant: two processes (4 CPU devices each, gloo between them)
  joined by ``sharding.initialize_distributed`` decode one batch on the
  global mesh data=4,model=2 through ``runner.generate_ids`` (each process
  holds half the rows; results gathered with ``sharding.to_host``) and
  both get exactly their own one-device output: AR and EAGLE-3, T = 0 and
  T = 1 (top-p 0.9)."""
  env = dict(os.environ,
             XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
             + " --xla_force_host_platform_device_count=4")
  port = str(_free_port())
  # Files, not pipes: neither worker can block on a full pipe, and a failure
  # shows both logs (the one that hangs is rarely the one that failed).
  logs = [(tmp_path / f"{pid}.out", tmp_path / f"{pid}.err") for pid in (0, 1)]
  procs = []
  for pid, (out, err) in enumerate(logs):
    with out.open("w") as o, err.open("w") as e:
      procs.append(subprocess.Popen(
          [sys.executable, "-m", "tests.sharding_worker", "--multihost",
           port, str(pid)], cwd=ROOT, env=env, stdout=o, stderr=e))
  for p in procs:
    p.wait(timeout=900)
  assert [p.returncode for p in procs] == [0, 0], "\n".join(
      f"worker {i}: {err.read_text()[-2000:]}" for i, (_, err) in enumerate(logs))
  outs = [json.loads(out.read_text().strip().splitlines()[-1])
          for out, _ in logs]
  assert [o["process"] for o in outs] == [0, 1]
  for o in outs:
    assert o["processes"] == 2 and o["devices"] == 8
    assert len(o["runs"]) == 4
    assert all(r["equal"] and r["new_tokens"] == 8 * 12 for r in o["runs"]), o


def test_distributed_spec_errors():
  for bad in ("localhost,2,0", "h:1,2", "h:1,2,2", "h:1,x,0"):
    with pytest.raises(sharding.MeshError, match="HOST:PORT,N,I"):
      sharding.initialize_distributed(bad)
