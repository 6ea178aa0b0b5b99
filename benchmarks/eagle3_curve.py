"""Held-out acceptance per TTT step of every checkpoint of one or more runs.

  .venv/bin/python -m benchmarks.eagle3_curve RUN_DIR [RUN_DIR ...] \
      --json benchmarks/results/eagle3_curve.jsonl --plot docs/eagle3_curve.png

Each RUN_DIR is a `specjax train` workdir (its config.json says how it was
trained; its ckpt/ holds the steps). Every checkpoint is evaluated at K = 7
on the run's held-out conversations (specjax.training.evaluate) and printed as
one JSON line: run, step, training tokens, acc per step, coverage of Vd,
expected τ of a 7-chain. --heldout-of RUN scores every run on RUN's held-out
conversations instead (e.g. replies the target regenerated; rows then carry
"heldout": RUN and stay out of the plot). Lines already in --json are
skipped, so the script resumes; --plot draws τ against training tokens and
acceptance per step; --export writes checkpoints as head files for
`--method eagle3 --head`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib



def evaluate_runs(run_dirs, out: pathlib.Path, num_steps: int, label=None,
                  only=None, export=None, heldout_of=None):
  from specjax.training import evaluate
  from specjax.heads import export as eexport
  from specjax.training import config as tconfig
  from specjax.training import train
  from specjax.models.registry import load_model
  done = set()
  if out.is_file():
    done = {(r["run"], r["step"], r.get("heldout"))
            for r in map(json.loads, out.read_text().splitlines())}
  model, other = None, None
  config = tconfig.run_config
  if heldout_of:
    cfg = config(heldout_of)
    model = load_model(cfg.model)
    other = train.setup(cfg, model=model).heldout_ex
  for run in run_dirs:
    run = pathlib.Path(run)
    cfg = config(run)
    model = model or load_model(cfg.model)
    s = train.setup(cfg, model=model, progress=False)
    where = {}
    if other is not None:
      s = dataclasses.replace(s, heldout_ex=other)
      where = dict(heldout=pathlib.Path(heldout_of).name)
    for step in sorted(train.checkpoints(run).all_steps()):
      name = label or run.name
      key = (name, step, where.get("heldout"))
      if (only and step not in only) or (key in done and not export):
        continue
      params = train.restore_params(run, step, s, cfg)
      if export:
        eexport.save_head(pathlib.Path(export) / f"{name}-{step}.npz", s.hcfg,
                          params, s.vocab.ids)
      if key in done:
        continue
      rec = dict(run=name, **where, variant=cfg.head.variant, ttt=cfg.ttt.steps,
                 step=step,
                 tokens=evaluate.tokens_seen(cfg, s.train_ex, step),
                 **evaluate.heldout_accuracy(s, params, num_steps))
      print(json.dumps(rec), flush=True)
      with open(out, "a") as f:
        f.write(json.dumps(rec) + "\n")


def plot(rows, path: pathlib.Path):
  """Left: expected τ against training tokens, one line per run. Right:
  acceptance per depth of each run's last checkpoint, plus (dashed) longer
  runs at the budget all runs share, so same-budget rows compare directly."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.2))
  runs = {}
  rows = [r for r in rows if "heldout" not in r]  # own held-out sets only
  for r in sorted(rows, key=lambda r: r["step"]):
    runs.setdefault(r["run"], []).append(r)
  common = min(rs[-1]["step"] for rs in runs.values())
  colors = plt.get_cmap("tab20").colors  # C0..C9 would repeat past ten runs
  for i, (run, rs) in enumerate(sorted(runs.items())):
    color = colors[i % len(colors)]
    ax1.plot([r["tokens"] / 1e6 for r in rs], [r["expected_tau"] for r in rs],
             "o-", color=color, label=run)
    shown = [rs[-1]] + [r for r in rs if r["step"] == common and r is not rs[-1]]
    for r in shown:
      ax2.plot(range(len(r["acc"])), r["acc"], "o-" if r is rs[-1] else "o--",
               color=color, label=f"{run} @ {r['tokens'] / 1e6:.2f}M tok")
  ax1.set_xlabel("training tokens (M)")
  ax1.set_ylabel("expected τ, 7-chain, T=0 (held-out)")
  ax1.set_xscale("log")
  ax1.legend(fontsize=8)
  ax2.set_xlabel("draft depth k (TTT step)")
  ax2.set_ylabel("held-out acceptance α_k")
  ax2.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("runs", nargs="*", help="specjax train workdirs")
  ap.add_argument("--json", default="benchmarks/results/eagle3_curve.jsonl")
  ap.add_argument("--label", default=None,
                  help="name for a single run (default: its directory)")
  ap.add_argument("--num-steps", type=int, default=7)
  ap.add_argument("--steps", type=int, nargs="*", default=None,
                  help="evaluate only these checkpoint steps")
  ap.add_argument("--plot", default=None, help="write a PNG of all rows")
  ap.add_argument("--export", default=None, metavar="DIR",
                  help="also write each selected checkpoint's head to "
                  "DIR/RUN-STEP.npz")
  ap.add_argument("--heldout-of", default=None, metavar="RUN_DIR",
                  help="score on this run's held-out conversations")
  args = ap.parse_args(argv)
  out = pathlib.Path(args.json)
  out.parent.mkdir(parents=True, exist_ok=True)
  evaluate_runs(args.runs, out, args.num_steps, args.label, args.steps,
                args.export, args.heldout_of)
  if args.plot:
    plot([json.loads(l) for l in out.read_text().splitlines() if l.strip()],
         pathlib.Path(args.plot))


if __name__ == "__main__":
  main()
