"""Several configurations of one or more methods against one AR run.

  .venv/bin/python -m benchmarks.bench_methods --dataset mtbench \
      --temperature 0 eagle3:k=7 eagle3:k=7:conf=0.4 ngram:k=5 \
      --json benchmarks/results/bench_eagle.jsonl --journal runs/mt_t0.journal

Each positional spec is a method in the library's grammar,
NAME[:key=value...] (``specjax.drafters.methods.KNOBS``: k, nodes, width,
shape, lookup, layers, conf, draft, head, conversations, window, levels,
refresh, pearl), so e.g. fixed and
dynamic K, chain, dynamic and static trees, or two heads, share the AR
baseline of one run (``specjax bench --method`` takes the same specs).
Prints and appends one JSON line per spec (the `specjax.measure.bench`
contract; `config` records the knobs).
"""

from __future__ import annotations

import argparse
import json


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("specs", nargs="+")
  ap.add_argument("--dataset", default="mtbench")
  ap.add_argument("--num-prompts", type=int, default=None)
  ap.add_argument("--max-new-tokens", type=int, default=128)
  ap.add_argument("--temperature", type=float, default=0.0)
  ap.add_argument("--json", default=None)
  ap.add_argument("--journal", default=None,
                  help="finished batches go here; a rerun resumes after them")
  ap.add_argument("--xla", action="store_true",
                  help="the target's matmuls on XLA's dot, for AR and every "
                  "method alike (default: the native small-row kernel where "
                  "load_model uses it: CPU, f32, built)")
  ap.add_argument("--mesh", default=None, metavar="data=D,model=M",
                  help="decode over a device mesh (sharding.make_mesh; "
                  "XLA's dot)")
  ap.add_argument("--batch-size", type=int, default=1)
  args = ap.parse_args(argv)
  for path in (args.json, args.journal):  # fail now, not after an hour
    if path:
      open(path, "a", encoding="utf-8").close()

  from benchmarks.common import machine
  from specjax import data
  from specjax.core.sampling import SamplingParams
  from specjax.drafters import methods
  from specjax.measure import bench
  from specjax.models.decoder import is_packed
  from specjax.models.registry import load_model
  try:
    specs = [methods.MethodSpec.parse(s) for s in args.specs]
  except methods.MethodError as e:
    raise SystemExit(f"bench_methods: {e}") from None
  from specjax.core.sharding import make_mesh, on_mesh
  mesh = make_mesh(args.mesh) if args.mesh else None
  model = on_mesh(load_model("smollm2-135m",
                             native=False if args.xla or mesh else None), mesh)
  prompts = data.load_prompts(args.dataset, args.num_prompts)
  chat = args.dataset != "humaneval"
  ids = [model.tokenizer.encode_chat(p) if chat else model.tokenizer.encode(p)
         for p in prompts]
  built = [(s, methods.build(model, s)) for s in specs]

  provenance = {"matmul": "native" if is_packed(model.params) else "xla",
                "machine": machine(), "mesh": args.mesh or "none"}

  def emit(result):
    line = json.dumps(dict(result, **provenance))
    print(line, flush=True)
    if args.json:
      with open(args.json, "a", encoding="utf-8") as f:
        f.write(line + "\n")

  bench.run(model, built, ids, max_new_tokens=args.max_new_tokens,
            sampling=SamplingParams(temperature=args.temperature),
            batch_size=args.batch_size, dataset=args.dataset,
            on_result=emit, journal=args.journal)


if __name__ == "__main__":
  main()
