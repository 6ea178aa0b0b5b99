"""EAGLE-3 head warm start: held-out acceptance of the two
initializations, at step 0 and after N training steps of the same recipe.

  .venv/bin/python -m benchmarks.warm_start --steps 0 \
      --json benchmarks/results/warm_start.jsonl
  .venv/bin/python -m benchmarks.warm_start --steps 1000 --workdir runs/warm \
      --config configs/eagle3_smollm2_cached.py --inits target,random

``random``: today's init (normal(0.02) layer, LM head and final norm from the
target); ``target``: ``head.init_layer=target`` (the layer starts as the target
layer the high tap feeds, ``training.train.warm_layer``). Held-out top-1
agreement per TTT step (``evaluate.heldout_accuracy``, 7 steps) on the
recipe's held-out conversations; α₀ is step 0's. With ``--steps N`` each
init trains the first N steps of ``--config``'s schedule in
``WORKDIR/<init>`` (resumable: a rerun goes on from the newest checkpoint;
with a cached recipe the inits share the first one's feature cache). One
JSON line per (init, step).
"""

from __future__ import annotations

import argparse
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", default=str(ROOT / "configs" /
                                          "eagle3_smollm2.py"))
  ap.add_argument("--steps", type=int, default=0)
  ap.add_argument("--workdir", default="runs/warm_start")
  ap.add_argument("--json", default=None)
  ap.add_argument("--inits", default="random,target",
                  help="which initializations, in this order")
  args = ap.parse_args(argv)

  from benchmarks.common import machine
  from specjax.measure import bench
  from specjax.models.registry import load_model
  from specjax.training import data as edata
  from specjax.training import config as tconfig
  from specjax.training import evaluate, train
  base = tconfig.load(args.config).train
  model = load_model(base.model)
  examples = edata.sharegpt_examples(model.tokenizer,
                                     base.data.num_conversations,
                                     base.data.max_len)
  inits = args.inits.split(",")
  for init in inits:
    cfg = base.updated({"head.init_layer": init})
    if args.steps:  # the recipe's schedule, stopped after N steps
      work = pathlib.Path(args.workdir) / init
      if base.data.feature_cache:  # one feature cache for all inits
        _share_features(pathlib.Path(args.workdir) / inits[0], work)
      run = train.train(cfg, str(work),
                        model=model, examples=examples,
                        stop_after=args.steps)
      s, params = run.setup, run.params
    else:
      s = train.setup(cfg, model=model, examples=examples)
      params = s.params
    acc = evaluate.heldout_accuracy(s, params)
    rec = dict(init=init, step=args.steps, config=pathlib.Path(
        args.config).name, alpha0=acc["acc"][0], **acc,
               git_sha=bench.git_sha(), machine=machine())
    print(json.dumps(rec), flush=True)
    if args.json:
      with open(args.json, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")


def _share_features(first: pathlib.Path, work: pathlib.Path) -> None:
  """Points ``work/features`` at ``first/features``: the cache's fingerprint
  does not depend on the head's initialization."""
  (first / "features").mkdir(parents=True, exist_ok=True)
  if work != first and not (work / "features").exists():
    work.mkdir(parents=True, exist_ok=True)
    (work / "features").symlink_to((first / "features").absolute())


if __name__ == "__main__":
  main()
