"""What a device mesh costs on this CPU: compile time, time per
decode step and the collectives in the program, one device vs forced meshes.

  .venv/bin/python -m benchmarks.sharded_overhead --devices 8 \
      --meshes none,data=8,data=4/model=2,data=2/model=4,data=1/model=8

SmolLM2-135M (f32, XLA's dot: the native kernels run on one device, so the
single-device row is measured without them too, and once with them for
reference), batch 8 of MT-bench prompts, AR and the shipped EAGLE-3 head's
K = 4 chain, 32 new tokens, greedy; each run's tokens compared with the
single-device run's. On one 2-core machine, N forced devices share the same
two cores: the step times say what the partitioned program and its
collectives cost, not what N real devices would gain. Prints one JSON line.
Mesh specs use '/' between axes here ('data=2/model=4'), ',' between meshes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys



def _args(argv):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--devices", type=int, default=8)
  ap.add_argument("--meshes",
                  default="none,data=8,data=4/model=2,data=2/model=4,"
                  "data=1/model=8")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--max-new-tokens", type=int, default=32)
  ap.add_argument("--repeats", type=int, default=3)
  return ap.parse_args(argv)


def main(argv=None) -> int:
  args = _args(argv)
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_"
                             f"host_platform_device_count={args.devices}")
  import jax
  from benchmarks.common import machine
  from specjax import data
  from specjax.core import runner, sharding
  from specjax.core.sharding import on_mesh
  from specjax.drafters import methods
  from specjax.measure.bench import git_sha
  from specjax.models.registry import load_model

  base = load_model("smollm2-135m", native=False)
  prompts = data.load_prompts("mtbench", args.batch)
  ids = [base.tokenizer.encode_chat(p) for p in prompts]
  rows, ref = [], {}
  for mesh_name in ["native"] + args.meshes.split(","):
    if mesh_name == "native":
      model = load_model("smollm2-135m", native=True)
    elif mesh_name == "none":
      model = base
    else:
      model = on_mesh(base, sharding.make_mesh(mesh_name.replace("/", ",")))
    for method in ("ar", "eagle3"):
      spec = methods.MethodSpec(method, num_draft=4)
      built = methods.build(model, spec)
      runs = [runner.generate_ids(model, ids,
                                  max_new_tokens=args.max_new_tokens,
                                  method=built)
              for _ in range(args.repeats)]  # the first one compiles
      res, walls = runs[0], [r.wall_s for r in runs]
      out = [r.output_ids for r in res.rows]
      ref.setdefault(method, out)
      # The program generate_ids compiled last (the runner's cache).
      hlo = list(runner._EXECUTABLES.values())[-1].as_text()  # noqa: SLF001
      rows.append(dict(
          mesh=mesh_name, method=method, compile_s=round(res.compile_s, 2),
          ms_per_step=round(1e3 * min(walls) / res.num_steps, 2),
          steps=res.num_steps, equal_to_one_device=out == ref[method],
          collectives={op: len(re.findall(rf"= \S+ {op}(-start)?\(", hlo))
                       for op in ("all-reduce", "all-gather", "all-to-all",
                                  "collective-permute", "reduce-scatter")}))
      print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
  print(json.dumps(dict(machine=machine(), git_sha=git_sha(),
                        jax=jax.__version__, devices=args.devices,
                        batch=args.batch, max_new_tokens=args.max_new_tokens,
                        rows=rows)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
