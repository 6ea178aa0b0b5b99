"""Acceptance of a head's rank-r token at depth d: what sizes trees.

  .venv/bin/python -m benchmarks.tree_rank_acceptance --dataset mtbench \
      --depth 6 --ranks 8 --json benchmarks/results/tree_rank_acceptance.jsonl \
      --priors

Decodes the prompts through the engine with a static "caterpillar" tree: a
spine of the head's best tokens, ``--depth`` deep, and under every spine node
(and the root) its ``--ranks`` best tokens. The engine counts how often each
node was on the accepted path (``DecodeState.accepted_nodes``), so

  p[d][r] = P(rank-r node at depth d + 1 accepted)
            / P(spine node at depth d accepted)     (the root: every step)

is the chance that the target's token at depth d + 1 is the head's rank-r
token, given the path so far was the head's own best: the per-depth,
per-rank acceptance ``theory.best_tree`` sizes static trees from (Sequoia's
positional acceptance, per depth). Its running sum over r is the head's
top-k coverage per depth. Deep spine nodes are reached rarely (a few dozen
times in 80 prompts at depth 6), so the prior ``--priors`` stores in
specjax/tuner_priors.json for ``specjax tune`` is ``p_pooled``: the ranks'
hits over all depths by the spine steps over all depths, the same at every
depth (Sequoia's depth-independent positional acceptance; the measured
depths of the EAGLE-3 head agree within noise; a Medusa head's do not, as
each depth is its own head: size its trees from ``p``). Prints one JSON line
with both.
"""

from __future__ import annotations

import argparse
import json
import pathlib


TASKS = {"mtbench": "chat", "sharegpt": "chat", "humaneval": "code"}


def caterpillar(depth: int, ranks: int) -> list[tuple[int, ...]]:
  """Rank paths: under the root and each spine node, ranks 0..R-1 (rank 0
  continues the spine)."""
  return [(0,) * d + (r,) for d in range(depth) for r in range(ranks)]


def rank_acceptance(accepted_nodes, forwards: int, depth: int, ranks: int):
  """``p[d][r]`` and the spine steps it is measured on, from per-node
  acceptance counts of the ``caterpillar`` tree (nodes breadth first: depth
  d's ranks are nodes d * R + 1 .. d * R + R)."""
  hits = [[int(accepted_nodes[d * ranks + r]) for r in range(ranks)]
          for d in range(depth)]
  spine = [forwards] + [hits[d][0] for d in range(depth - 1)]
  p = [[round(h / max(spine[d], 1), 4) for h in hits[d]]
       for d in range(depth)]
  pooled = [round(sum(hits[d][r] for d in range(depth)) / max(sum(spine), 1),
                  4) for r in range(ranks)]
  return p, spine, pooled


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--dataset", default="mtbench", choices=sorted(TASKS))
  ap.add_argument("--num-prompts", type=int, default=None)
  ap.add_argument("--max-new-tokens", type=int, default=128)
  ap.add_argument("--temperature", type=float, default=0.0)
  ap.add_argument("--method", default="eagle3",
                  choices=("eagle", "eagle3", "medusa"))
  ap.add_argument("--head", default=None)
  ap.add_argument("--depth", type=int, default=6)
  ap.add_argument("--ranks", type=int, default=8)
  ap.add_argument("--batch-size", type=int, default=4)
  ap.add_argument("--json", default=None)
  ap.add_argument("--priors", action="store_true",
                  help="store p in specjax/tuner_priors.json")
  args = ap.parse_args(argv)

  from tqdm import tqdm

  from benchmarks.common import machine
  from specjax import data
  from specjax.core import runner
  from specjax.core.sampling import SamplingParams
  from specjax.drafters import methods
  from specjax.measure import bench
  from specjax.measure.theory import shape_text
  from specjax.models.registry import load_model
  paths = caterpillar(args.depth, args.ranks)
  spec = methods.MethodSpec(args.method, head=args.head,
                            tree_shape=shape_text(paths))
  model = load_model("smollm2-135m")
  method = methods.build(model, spec)
  prompts = data.load_prompts(args.dataset, args.num_prompts)
  chat = args.dataset != "humaneval"
  ids = [model.tokenizer.encode_chat(p) if chat else model.tokenizer.encode(p)
         for p in prompts]
  rows = []
  for i in tqdm(range(0, len(ids), args.batch_size), desc="caterpillar",
                unit="batch"):
    rows += runner.generate_ids(
        model, ids[i:i + args.batch_size], max_new_tokens=args.max_new_tokens,
        sampling=SamplingParams(temperature=args.temperature), seed=i,
        method=method).rows
  forwards = sum(r.target_forwards for r in rows)
  nodes = [sum(r.accepted_nodes[m] for r in rows) for m in range(len(paths))]
  p, spine, pooled = rank_acceptance(nodes, forwards, args.depth, args.ranks)
  coverage = {k: [round(sum(pd[:k]), 4) for pd in p]
              for k in (1, 2, 4, 8) if k <= args.ranks}
  rec = dict(method=args.method, head=args.head or "shipped",
             dataset=args.dataset, task=TASKS[args.dataset],
             temperature=args.temperature, prompts=len(ids),
             depth=args.depth, ranks=args.ranks, p=p, p_pooled=pooled,
             spine_steps=spine,
             top_k_coverage=coverage,
             tau=round(bench.acceptance_stats(rows, spec.k)["tau"], 4),
             git_sha=bench.git_sha(), machine=machine())
  print(json.dumps(rec), flush=True)
  if args.json:
    with open(args.json, "a", encoding="utf-8") as f:
      f.write(json.dumps(rec) + "\n")
  if args.priors:
    path = pathlib.Path(__file__).resolve().parents[1] / (
        "specjax/tuner_priors.json")
    priors = json.loads(path.read_text())
    table = priors.setdefault("tree_acceptance", [])
    table[:] = [t for t in table if (t["method"], t["task"], t["temperature"])
                != (args.method, rec["task"], args.temperature)]
    table.append(dict(method=args.method, task=rec["task"],
                      temperature=args.temperature,
                      p=[pooled] * args.depth,
                      source=f"benchmarks/tree_rank_acceptance.py "
                      f"--dataset {args.dataset} at {rec['git_sha']}"))
    path.write_text(json.dumps(priors, indent=1) + "\n")


if __name__ == "__main__":
  main()
