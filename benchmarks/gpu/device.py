"""What ``benchmarks.gpu`` runs on the lent GPU machine, call by call.

Call 1, ``first`` (carrying part 1 only): first contact, then the
measurements that need no data. Each phase prints its seconds and lands in
``$OUT/first_contact.json``:
  1. ``nvidia-smi`` and the package versions;
  2. the backend is the one ``JAX_PLATFORMS`` names (``cuda``: a CUDA plugin
     that fails to load cannot fall back to the CPU unnoticed);
  3. part 1's loose wheels (``gguf``, our pinned flax/optax/orbax/chex) are
     installed into scratch folders;
  4. a child process imports flax, optax, orbax, chex, tokenizers, jinja2,
     gguf and runs the trainer's smoke test, with the machine's packages and
     if that fails with the pinned ones (each try under a timeout); the
     passing set is kept in ``packages.json`` on the warm machine;
  5. the verify-cost curve (``cost_curve.py``, child, timeout; a failure
     here is reported and the call goes on);
  6. the timing probe (child, timeout): the GPU config trained for a few
     steps on a random SmolLM2-shaped target and scored on random held-out
     rows, which fills the persistent compilation cache and leaves
     ``plan.json`` (step, compile and scoring seconds).
A failure in 1-4 or 6 ends the call with exit 1 at once: hand the machine
back, fix, restart with most of the lease left.

Calls 2..N-1, ``check``: the parts held, each verified.

Call N, ``train``: joins the kit, installs its wheels, loads the target and
data, runs 3 steps of the real run (trace + cache hits: the step compiled
in call 1 serves it, the run's length being data), sizes ``steps`` to the
budget left from the measured step time and the probe's scoring time,
trains with a deadline, writes the head (in parts), its log and
``result.json`` to $OUT before scoring it on the CPU runs' held-out set.
No checkpoints: nothing resumes across leases, the head comes back.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tarfile
import time

from benchmarks.gpu import files as kit_files
from benchmarks.gpu.files import MIB, OUT_FILE_BYTES, ROOT, sha256

CONFIG = ROOT / "configs" / "eagle3_smollm2_gpu.py"
GPU_KIT = ("-m", "benchmarks.gpu")
# The device's own versions of these may differ from the ones tested here;
# the kit carries ours, used only if the smoke run fails with the device's.
PINNED = ("flax", "optax", "orbax-checkpoint", "chex")
IMPORTS = ("flax", "optax", "orbax.checkpoint", "chex", "tokenizers",
           "jinja2", "gguf", "ml_collections")
INIT_HEAD = "init_head.npz"  # in the kit's tar when the head is not in the tree
# Child timeouts: together within call 1's timeout (kit_plan).
SMOKE_TIMEOUT_S = 120  # each package set
COST_CURVE_S = 150  # the curve starts no new group past this
COST_CURVE_TIMEOUT_S = 210
PROBE_TIMEOUT_S = 200
WARM_STEPS = 3  # steps of the real run before it is sized
WRITE_S = 15  # head parts, logs, result after training
SCORE_S = 60  # held-out scoring, when no probe measured it
DECODE_S = 150  # AR vs EAGLE-3 chain and trees in bf16 (kit_plan's "decode")


class Phases:
  """Seconds per named phase, printed as each ends."""

  def __init__(self):
    self.seconds: dict[str, float] = {}

  def run(self, name: str, fn, *args, **kwargs):
    t = time.time()
    try:
      return fn(*args, **kwargs)
    finally:
      self.seconds[name] = round(time.time() - t, 1)
      print(f"gpu_kit: {name}: {self.seconds[name]} s", flush=True)


def version(name: str) -> str:
  import importlib.metadata as md
  try:
    return md.version(name)
  except md.PackageNotFoundError:
    return "missing"


def versions() -> dict:
  return {n: version(n) for n in ("jax", "jaxlib", "jax-cuda13-plugin",
                                  *PINNED, "tokenizers", "jinja2", "gguf",
                                  "numpy")}


def nvidia_smi() -> str:
  try:
    return subprocess.run(["nvidia-smi"], capture_output=True, text=True,
                          timeout=30).stdout
  except (OSError, subprocess.TimeoutExpired) as e:
    return f"nvidia-smi: {e}"


def require_backend() -> str:
  """The JAX backend, checked against ``JAX_PLATFORMS`` (which must be
  set: unset, JAX silently takes the CPU when the CUDA plugin fails)."""
  want = os.environ.get("JAX_PLATFORMS", "").split(",")[0]
  if not want:
    raise ValueError("JAX_PLATFORMS is not set (cuda on the device)")
  import jax
  got = jax.default_backend()
  if got != {"cuda": "gpu", "rocm": "gpu"}.get(want, want):
    raise ValueError(f"JAX_PLATFORMS={want} but JAX runs on {got}")
  return f"{got}: {jax.devices()}"


def install(wheels: list[pathlib.Path], target: pathlib.Path) -> None:
  if wheels:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                    "--no-index", "--no-deps", "--no-compile", "--upgrade",
                    "--target", str(target), *map(str, sorted(wheels))],
                   check=True)


def device_env(scratch: pathlib.Path) -> None:
  """For this process and its children, set before JAX is imported: a
  persistent compilation cache in ``scratch`` (kept on the warm machine
  from call to call), and GPU memory taken as needed rather than 75% up
  front (call 1's parent holds a backend while its children run theirs)."""
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                        str(pathlib.Path(scratch) / "xla-cache"))
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def child_env(paths) -> dict:
  """The environment of a child: ``paths`` ahead on PYTHONPATH."""
  return dict(os.environ, PYTHONPATH=os.pathsep.join(
      [*map(str, paths), str(ROOT),
       *filter(None, [os.environ.get("PYTHONPATH")])]))


def run_child(argv: list[str], paths, timeout: float) -> int:
  """Exit code of ``python argv`` with ``paths`` ahead on PYTHONPATH; 124
  (said in one line) when it outlasts ``timeout`` seconds."""
  try:
    return subprocess.run([sys.executable, *argv], env=child_env(paths),
                          timeout=timeout).returncode
  except subprocess.TimeoutExpired:
    print(f"gpu_kit: {argv[0]} timed out after {timeout:.0f} s", flush=True)
    return 124


def first_passing(candidates: list[list[pathlib.Path]], argv: list[str],
                  timeout: float = SMOKE_TIMEOUT_S) -> list[pathlib.Path]:
  """The first list of package folders with which ``python argv`` exits 0
  within ``timeout`` seconds, each tried on PYTHONPATH ahead of the
  machine's own packages."""
  for i, paths in enumerate(candidates):
    rc = run_child(argv, paths, timeout)
    if rc == 0:
      return paths
    print(f"gpu_kit: failed ({rc}) with package folders "
          f"{[str(p) for p in paths]}"
          + ("; trying the next" if i + 1 < len(candidates) else ""),
          flush=True)
  raise ValueError("every package set failed the smoke run (output above)")


def package_paths(scratch: pathlib.Path) -> list[pathlib.Path]:
  """The package set call 1 chose, or a fresh smoke run's choice."""
  chosen = scratch / "packages.json"
  if chosen.is_file():
    return [pathlib.Path(p) for p in json.loads(chosen.read_text())]
  site, pinned = scratch / "site", scratch / "pinned-site"
  paths = first_passing([[site], [pinned, site]],
                        [*GPU_KIT, "smoke", "--work", str(scratch / "smoke")])
  chosen.write_text(json.dumps([str(p) for p in paths]))
  return paths


def gpu_config(assignments=()):
  """The GPU recipe with ``--set`` overrides (``PATH=VALUE``, dotted)."""
  from specjax.training import config as tconfig
  return tconfig.load(str(CONFIG), [f"--config.{a}" for a in assignments]
                      ).train


# --------------------------------------------------------------- call 1

def cmd_first(args) -> int:
  out, scratch = pathlib.Path(args.out), pathlib.Path(args.scratch)
  import shutil
  shutil.rmtree(scratch, ignore_errors=True)  # a new lease starts clean
  scratch.mkdir(parents=True)
  out.mkdir(parents=True, exist_ok=True)
  ph, report = Phases(), {}
  report["nvidia_smi"] = ph.run("nvidia-smi", nvidia_smi)
  print(report["nvidia_smi"], flush=True)
  report["versions"] = versions()
  print("versions:", json.dumps(report["versions"]), flush=True)
  try:
    report["backend"] = ph.run("backend", require_backend)
    print("backend:", report["backend"], flush=True)
    man, _ = kit_files.manifest()
    loose = kit_files.KIT / "p1"
    ph.run("wheels", install, [loose / w for w in man["loose"]],
           scratch / "site")
    ph.run("pinned wheels", install, sorted((loose / "pinned").glob("*.whl")),
           scratch / "pinned-site")
    paths = ph.run("smoke", package_paths, scratch)
  except Exception as e:  # noqa: BLE001 (any failure here ends the lease)
    report.update(ok=False, error=str(e), seconds=ph.seconds)
    (out / "first_contact.json").write_text(json.dumps(report, indent=1))
    print(f"gpu_kit: FIRST CONTACT FAILED: {e}\ngive the machine back now, "
          "fix, and start again", flush=True)
    return 1
  report["packages"] = [str(p) for p in paths]
  rc = ph.run("cost curve", run_child, [
      *GPU_KIT, "curve", "--out",
      str(out / "cost_curve.json"), "--seconds", str(COST_CURVE_S),
      *args.curve_args.split()], paths, COST_CURVE_TIMEOUT_S)
  report["cost_curve_rc"] = rc
  rc = ph.run("probe", run_child, [*GPU_KIT, "probe", "--scratch",
                                   str(scratch), *args.probe_args.split(),
                                   *set_args(args.set)],
              paths, args.probe_timeout)
  if (scratch / "plan.json").is_file():
    shutil.copyfile(scratch / "plan.json", out / "plan.json")
  report.update(ok=rc == 0, probe_rc=rc, seconds=ph.seconds)
  (out / "first_contact.json").write_text(json.dumps(report, indent=1))
  print("first contact:", json.dumps(dict(ok=rc == 0, seconds=ph.seconds)))
  return 0 if rc == 0 else 1


def set_args(assignments) -> list[str]:
  """``--set`` overrides as arguments of a child command."""
  return [x for a in assignments for x in ("--set", a)]


def random_examples(cfg, vocab_size: int, rows: int, seed: int = 0):
  """Token rows of the run's shape with assistant masks from position 16
  on (every row fills ``max_len``: the shapes, not the text, set the time)."""
  import numpy as np
  from specjax.training.data import Examples
  rng = np.random.default_rng(seed)
  T = cfg.data.max_len
  return Examples(rng.integers(0, vocab_size, (rows, T)).astype(np.int32),
                  np.broadcast_to(np.arange(T) >= min(16, T - 1), (rows, T)
                                  ).copy(), np.full((rows,), T, np.int32))


def target_config(man: dict):
  from specjax.models.config import ModelConfig, RopeScaling
  c = dict(man["target_config"])
  c["eos_ids"] = tuple(c["eos_ids"])
  if c.get("rope_scaling"):
    c["rope_scaling"] = RopeScaling(**c["rope_scaling"])
  return ModelConfig(**c)


def step_times(rows: list[dict]) -> dict:
  """From a log of every step (``elapsed_s``, ``ttt``): per TTT length its
  steady step time (median of its steps after the first two) and compile
  time (its first step less one steady step)."""
  import numpy as np
  prev, by_k = 0.0, {}
  for r in sorted(rows, key=lambda r: r["step"]):
    by_k.setdefault(r["ttt"], []).append(r["elapsed_s"] - prev)
    prev = r["elapsed_s"]
  out = {}
  for k, d in by_k.items():
    steady = float(np.median(d[2:] if len(d) > 2 else d[1:] or d))
    out[k] = dict(step_s=round(steady, 4),
                  compile_s=round(max(d[0] - steady, 0.0), 2))
  return out


def plan_steps(times: dict, cfg, seconds: float,
               compiled: tuple[int, ...] = ()) -> int:
  """Most steps of ``cfg``'s TTT schedule that fit ``seconds``, counting
  the compile of each TTT length not yet in ``compiled``."""
  ttt = cfg.ttt
  lengths = {ttt.warm_steps, ttt.steps} if ttt.warm_fraction > 0 \
      else {ttt.steps}
  compile_s = sum(times[k]["compile_s"] for k in lengths
                  if k not in compiled)
  f = ttt.warm_fraction
  per = f * times[ttt.warm_steps]["step_s"] + (1 - f) * times[
      ttt.steps]["step_s"] if f > 0 else times[ttt.steps]["step_s"]
  return max(int((seconds - compile_s) / per), 0)


def cmd_probe(args) -> int:
  """Child of call 1: the GPU config on a random target of the real shape."""
  import jax
  from specjax.models.decoder import Decoder, random_params
  from specjax.models.registry import Model
  from specjax.training import train as etrain
  scratch = pathlib.Path(args.scratch)
  man, _ = kit_files.manifest()
  tcfg = target_config(man)
  cfg = gpu_config(args.set).updated({"head.init_head": ""})
  steps = args.steps
  if cfg.ttt.warm_fraction > 0:  # both TTT lengths, half the steps each
    cfg = cfg.updated({"ttt.warm_fraction": 0.5})
  model = Model(Decoder(tcfg), random_params(jax.random.key(0), tcfg), None)
  ex = random_examples(cfg, tcfg.vocab_size, 2 * cfg.batch_size)
  import shutil
  shutil.rmtree(scratch / "probe", ignore_errors=True)  # a new run each time
  t = time.time()
  run = etrain.train(cfg.updated({"steps": steps, "log_every": 1,
                                  "checkpoint_every": 0, "data.heldout": 0}),
                     scratch / "probe", model=model, examples=ex,
                     progress=False)
  trained = time.time() - t
  rows = [json.loads(l) for l in (scratch / "probe" / "metrics.jsonl").open()]
  plan = dict(times=step_times(rows), score_s=round(probe_score(
      run, cfg, tcfg, args.heldout_rows or man["heldout_rows"],
      man["heldout_rows"]), 1), train_s=round(trained, 1), steps=steps,
              device=str(jax.devices()[0]))
  (scratch / "plan.json").write_text(json.dumps(plan, indent=1))
  print("probe:", json.dumps(plan), flush=True)
  return 0


def probe_score(run, cfg, tcfg, rows: int, full: int) -> float:
  """Seconds to score ``full`` held-out rows, from scoring ``rows`` random
  ones (twice when fewer: the second, compiled, run gives the per-row
  time that the first one's compile is added to)."""
  from specjax.training import evaluate
  held = random_examples(cfg, tcfg.vocab_size, rows, seed=1)
  s = dataclasses.replace(run.setup, heldout_ex=held)
  t = time.time()
  evaluate.heldout_accuracy(s, run.params)
  first = time.time() - t
  if rows >= full:
    return first
  t = time.time()
  evaluate.heldout_accuracy(s, run.params)
  again = time.time() - t
  return first + again * (full / rows - 1)


def smoke(work: pathlib.Path) -> dict:
  """The trainer end to end on a random 3-layer target: 3 steps, a
  checkpoint, a resume to step 4, an export; after importing everything the
  run needs. What the run needs from a machine's packages, in seconds."""
  import importlib
  for name in IMPORTS:
    importlib.import_module(name)
  import jax
  import numpy as np
  from specjax.models.config import ModelConfig
  from specjax.models.decoder import Decoder, random_params
  from specjax.models.registry import Model
  from specjax.training import data as edata
  from specjax.training import train as etrain
  t0 = time.time()
  mcfg = ModelConfig(vocab_size=96, dim=32, num_layers=3, num_heads=4,
                     num_kv_heads=2, head_dim=8, ffn_dim=40,
                     tie_embeddings=True, eos_ids=(95,))
  model = Model(Decoder(mcfg), random_params(jax.random.key(0), mcfg), None)
  rng = np.random.default_rng(0)
  ex = edata.Examples(rng.integers(0, 96, (8, 16)).astype(np.int32),
                      np.arange(16)[None, :] >= rng.integers(2, 6, (8, 1)),
                      np.full((8,), 16, np.int32))
  cfg = etrain.TrainConfig().updated({
      "model": "random", "data.heldout": 2, "data.max_len": 16,
      "batch_size": 2, "steps": 4, "ttt.steps": 2, "head.draft_vocab": 64,
      "checkpoint_every": 3, "keep": 2, "log_every": 1})
  etrain.train(cfg, work, model=model, examples=ex, stop_after=3,
               progress=False)
  run = etrain.train(cfg, work, model=model, examples=ex, progress=False)
  if run.step != 4 or not all(map(np.isfinite, run.losses.values())):
    raise RuntimeError(f"smoke run ended at step {run.step} with losses "
                       f"{run.losses}")
  return dict(device=str(jax.devices()[0]), seconds=round(time.time() - t0, 1),
              versions=versions())


def cmd_smoke(args) -> int:
  import shutil
  shutil.rmtree(args.work, ignore_errors=True)
  print("smoke:", json.dumps(smoke(pathlib.Path(args.work))), flush=True)
  return 0


# ----------------------------------------------------------- calls 2..N-1

def cmd_check(args) -> int:
  """Which parts this machine holds, each verified; exit 1 if one is
  damaged (carry it again before the last call)."""
  man, found = kit_files.manifest()
  have = {p.name: p for p in found}
  damaged = False
  for r in man["parts"]:
    p = have.get(r["name"])
    ok = p is not None and sha256(p) == r["sha256"]
    damaged |= p is not None and not ok
    print(f"{r['name']}: {'missing' if p is None else 'ok' if ok else 'DAMAGED'}")
  print("this machine:", ", ".join(f"{n} {version(n)}" for n in
                                   ("jax", "jaxlib", *PINNED)))
  print("kit pins:", ", ".join(man.get("pinned", [])))
  return 1 if damaged else 0


# ---------------------------------------------------------------- call N

def unpack_kit(scratch: pathlib.Path) -> dict:
  """Joins and extracts the kit into ``scratch/kit``; installs its wheels
  into ``scratch/site`` beside call 1's. Returns the manifest."""
  man, found = kit_files.manifest()
  dest = scratch / "kit"
  tar = kit_files.join_parts(found, man["parts"], dest / man["tar"],
                             man["sha256"])
  with tarfile.open(tar) as t:
    t.extractall(dest, filter="data")
  tar.unlink()
  install(sorted(dest.glob("*.whl")), scratch / "site")
  return man


def init_head_path(man: dict, scratch: pathlib.Path) -> str:
  """The head to go on from: a path in the tree, or the kit's copy."""
  if not man.get("init_head"):
    return ""
  if man.get("init_head_in_tree"):
    return str(ROOT / man["init_head"])
  return str(scratch / "kit" / INIT_HEAD)


def cmd_train(args) -> int:
  import shutil
  t_start = time.time()
  end = t_start + args.budget
  out, scratch = pathlib.Path(args.out), pathlib.Path(args.scratch)
  out.mkdir(parents=True, exist_ok=True)
  for d in ("warm", "run"):  # a rerun on the same machine starts over
    shutil.rmtree(scratch / d, ignore_errors=True)
  ph = Phases()
  man = ph.run("unpack", unpack_kit, scratch)
  paths = ph.run("packages", package_paths, scratch)
  sys.path[:0] = map(str, paths)
  import jax
  from specjax.models.registry import load_model
  print("backend:", require_backend(), "packages:", json.dumps(versions()),
        flush=True)
  cfg = gpu_config(args.set).updated(
      {"head.init_head": init_head_path(man, scratch)})
  train_ex, heldout = kit_files.load_examples(scratch / "kit" / "examples.npz")
  model = ph.run("load", load_model, cfg.model)
  cfg, plan = ph.run("warm-up", size_run, cfg, model, train_ex, scratch,
                     end, args.probe_steps)
  plan["seconds"] = ph.seconds.copy()
  print("plan:", json.dumps(plan), flush=True)
  from specjax.training import train as etrain
  run = ph.run("train", etrain.train, cfg, scratch / "run", model=model,
               examples=train_ex, deadline=plan["train_until"],
               progress=args.progress)
  result = write_head(run, cfg, scratch / "run", out, plan)
  result["device"] = str(jax.devices()[0])
  ph.run("score", score, run, heldout, result, out)
  head = scratch / "run" / result["head"]["name"]
  # No configuration starts in the last 30 s: compiling one and its three
  # timed runs take up to that on the device (stated, not yet measured).
  ph.run("decode", decode_bench, model, str(head), heldout,
         out=out / "decode.json", until=end - 30)
  result["seconds"] = dict(ph.seconds, total=round(time.time() - t_start, 1))
  (out / "result.json").write_text(json.dumps(result, indent=1))
  print(json.dumps({k: result.get(k) for k in
                    ("step", "stopped", "tokens", "acc", "expected_tau",
                     "seconds")}))
  return 0


def size_run(cfg, model, train_ex, scratch: pathlib.Path, end: float,
             probe_steps: int):
  """``(cfg with steps, plan)``: a few steps of the real run compile it (or
  load call 1's compiles from the cache) and time it; ``steps`` then fills
  the time left before ``end`` less scoring (the probe's measured time)
  and writes. Without call 1's plan.json, ``probe_steps`` are timed."""
  from specjax.training import train as etrain
  probe = _read_json(scratch / "plan.json")
  warm = cfg.updated({"steps": WARM_STEPS if probe else probe_steps,
                      "log_every": 1, "checkpoint_every": 0})
  etrain.train(warm, scratch / "warm", model=model, examples=train_ex,
               progress=False)
  times = step_times([json.loads(l) for l in
                      (scratch / "warm" / "metrics.jsonl").open()])
  compiled = tuple(times)
  for k, t in (probe or {}).get("times", {}).items():
    # The probe saw more steps: its step time, unless this one is slower.
    mine = times.setdefault(int(k), dict(t))
    mine["step_s"] = max(mine["step_s"], t["step_s"])
  score_s = probe["score_s"] if probe else SCORE_S
  train_until = end - score_s - WRITE_S - DECODE_S
  steps = plan_steps(times, cfg, train_until - time.time(), compiled)
  if steps < 1:
    raise ValueError(f"no time left to train ({train_until - time.time():.0f}"
                     " s before scoring)")
  return cfg.updated({"steps": steps}), dict(
      steps=steps, times=times, score_s=score_s, train_until=train_until,
      probe=bool(probe))


def _read_json(path: pathlib.Path):
  return json.loads(path.read_text()) if path.is_file() else None


def write_head(run, cfg, work: pathlib.Path, out: pathlib.Path,
               plan: dict) -> dict:
  """The head (in parts under the per-file limit), the log and a first
  ``result.json`` to $OUT: a command cut while scoring still returns them."""
  from specjax.training import evaluate
  head = work / f"eagle3-gpu-{run.step}.npz"
  (work / "head.npz").rename(head)
  result = dict(run="eagle3-gpu", variant=cfg.head.variant, ttt=cfg.ttt.steps,
                step=run.step, stopped=run.stopped,
                tokens=evaluate.tokens_seen(cfg, run.setup.train_ex, run.step),
                head=dict(name=head.name, sha256=sha256(head),
                          parts=kit_files.split_file(
                              head, OUT_FILE_BYTES - MIB, lambda i: out)),
                plan=plan, config=dataclasses.asdict(cfg))
  (out / "metrics.jsonl").write_bytes((work / "metrics.jsonl").read_bytes())
  (out / "result.json").write_text(json.dumps(result, indent=1))
  return result


def score(run, heldout, result: dict, out: pathlib.Path) -> None:
  from specjax.training import evaluate
  s = dataclasses.replace(run.setup, heldout_ex=heldout)
  result.update(evaluate.heldout_accuracy(s, run.params))
  (out / "result.json").write_text(json.dumps(result, indent=1))


# What the lease times against AR: the chain and the trees measured on the
# CPU (the static tree `theory.best_tree` proposes at 7 nodes, and
# EAGLE-2 dynamic trees of 7 and 16 nodes).
DECODE_SPECS = (("eagle3", dict(num_draft=7)),
                ("eagle3_static7", dict(tree_shape="0,1,2,0.0,0.1,1.0,0.0.0")),
                ("eagle3_dynamic7", dict(num_draft=4, tree_nodes=7)),
                ("eagle3_dynamic16", dict(num_draft=5, tree_nodes=16)))


def decode_bench(model, head: str, heldout, new_tokens: int = 128,
                 repeats: int = 3, batches=(1, 8), specs=DECODE_SPECS,
                 out=None, until: float = float("inf")) -> dict:
  """AR against EAGLE-3 chains and trees (``specs``: name -> MethodSpec
  knobs, ``head``) in bf16, greedy, at batch 1 and 8 on held-out prompts
  (each row's text before its first reply): tokens/s (median of ``repeats``
  timed calls, each shape compiled ahead), tau, and whether the output
  equals AR's (bf16 rounding may part them where two logits nearly tie).
  No configuration starts past ``until`` (a ``time.time()``); each batch's
  row is written to ``out`` as it ends, so a cut run keeps what it timed."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from specjax.core import runner
  from specjax.drafters import methods
  bf16 = lambda tree: jax.tree.map(
      lambda a: a.astype(jnp.bfloat16)
      if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)
  mb = dataclasses.replace(model, params=bf16(model.params))
  configs = {"ar": {}}
  for name, knobs in specs:
    spec = methods.MethodSpec("eagle3", head=head, **knobs)
    method = methods.build(mb, spec)
    configs[name] = dict(method=dataclasses.replace(
        method, params=bf16(method.params)))
  prompts = [r[:int(np.argmax(m))].tolist()
             for r, m in zip(heldout.ids, heldout.mask) if m[1:].any()][:8]
  result = dict(rows=[], specs=dict(specs))
  for B in batches:
    if time.time() >= until:
      break
    ar = None
    row = dict(batch=B, dtype="bfloat16", new_tokens=new_tokens)
    for name, kw in configs.items():
      if time.time() >= until:
        break
      res = [runner.generate_ids(mb, prompts[:B], max_new_tokens=new_tokens,
                                 **kw) for _ in range(repeats)]
      tok_s = res[0].new_tokens / float(np.median([r.wall_s for r in res]))
      if ar is None:
        ar, row["ar_tok_s"] = (res[0], tok_s), round(tok_s, 1)
        continue
      row[name] = dict(tok_s=round(tok_s, 1), speedup=round(tok_s / ar[1], 3),
                       tau=round(float(np.mean([r.tau for r in res[0].rows])),
                                 3),
                       greedy_equal=[a.output_ids == b.output_ids
                                     for a, b in zip(ar[0].rows, res[0].rows)])
    result["rows"].append(row)
    print("decode:", json.dumps(row), flush=True)
    if out is not None:
      pathlib.Path(out).write_text(json.dumps(result, indent=1))
  return result


def add_parsers(sub) -> dict:
  """The device-side subcommands of ``benchmarks.gpu``; returns name -> run."""
  scratch = dict(default="/tmp/specjax-kit",
                 help="kept on the warm machine from call to call")
  f = sub.add_parser("first", help="device call 1: first contact, cost "
                     "curve, timing probe")
  f.add_argument("--out", required=True, help="$OUT on the device")
  f.add_argument("--scratch", **scratch)
  f.add_argument("--set", action="append", default=[],
                 metavar="PATH=VALUE", help="a config override, "
                 "--config.PATH=VALUE of specjax train")
  f.add_argument("--curve-args", default="", help="passed to "
                 "cost_curve.py, as --curve-args='...' (a rehearsal's "
                 "tiny shape)")
  f.add_argument("--probe-args", default="", help="passed to the probe, as "
                 "--probe-args='...' (a rehearsal's fewer steps and rows)")
  f.add_argument("--probe-timeout", type=float, default=PROBE_TIMEOUT_S)
  sub.add_parser("check", help="device calls 2..N-1: which parts are here")
  sm = sub.add_parser("smoke", help="the trainer on a random tiny target")
  sm.add_argument("--work", required=True)
  p = sub.add_parser("probe", help="call 1's child: time the GPU config on "
                     "a random target of the real shape")
  p.add_argument("--scratch", **scratch)
  p.add_argument("--steps", type=int, default=8)
  p.add_argument("--heldout-rows", type=int, default=0,
                 help="random rows scored (0: as many as the kit's held-out "
                 "set; fewer on a CPU, the time scaled up)")
  p.add_argument("--set", action="append", default=[],
                 metavar="PATH=VALUE", help="a config override, "
                 "--config.PATH=VALUE of specjax train")
  t = sub.add_parser("train", help="device call N: train, export, score")
  t.add_argument("--out", required=True, help="$OUT on the device")
  t.add_argument("--budget", type=float, required=True,
                 help="seconds for the whole command (kit_plan's rule)")
  t.add_argument("--scratch", **scratch)
  t.add_argument("--probe-steps", type=int, default=8,
                 help="steps timed when call 1 left no plan.json")
  t.add_argument("--set", action="append", default=[],
                 metavar="PATH=VALUE", help="a config override, "
                 "--config.PATH=VALUE of specjax train")
  t.add_argument("--progress", action="store_true")
  return {"first": cmd_first, "check": cmd_check, "smoke": cmd_smoke,
          "probe": cmd_probe, "train": cmd_train}
