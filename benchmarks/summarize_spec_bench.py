"""Markdown tables from `specjax bench` JSON lines, and the tuner's priors.

  python -m benchmarks.summarize_spec_bench benchmarks/results/bench_spec.jsonl \
      [more.jsonl ...] [--priors specjax/tuner_priors.json]

Prints one table row per (method, temperature) and, with --priors, writes what
the tuner uses: the share of steps that drafted (the rest ran a one-token
forward and emitted one token) and the per-draft acceptance α whose geometric
model (1 - α^(K+1)) / (1 - α) reproduces the τ of the steps that drafted at
the measured K (fixed-K chains only: neither a dynamic-K row's τ nor a
tree's is that of a chain of its K; later files win on the same method, task
and temperature), and for each drafter with a per-token cost (a trained
head), a drafted token's cost in one-token target forwards (median over its
rows in the last file that has any: costs fall as the code gets faster,
unlike acceptance). Lookahead and CLaSp rows (``WHOLE``: no α model fits a
step that scores a window beside a trie, nor a draft whose cost includes
choosing its layers) are written whole, one per configuration: its τ, the
tokens its verify forward scores and its drafting's cost.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

TASK_OF = {"mtbench": "chat", "humaneval": "code", "sharegpt": "chat",
           "longdoc": "summarize"}
WHOLE = ("lookahead", "clasp")  # the tuner scores them per configuration


def alpha_from_tau(tau: float, k: int) -> float:
  """Bisection on the monotone map α -> E[tokens](α, K)."""
  from specjax.measure.theory import expected_tokens
  lo, hi = 0.0, 1.0
  tau = min(max(tau, 1.0), k + 1.0)
  for _ in range(60):
    mid = (lo + hi) / 2
    if expected_tokens(mid, k) < tau:
      lo = mid
    else:
      hi = mid
  return round((lo + hi) / 2, 4)


def label(r: dict) -> str:
  """Method plus the knobs that tell two runs of it apart."""
  cfg = r.get("config") or {}
  parts = [r["method"]]
  if cfg.get("min_confidence"):
    parts.append(f"conf {cfg['min_confidence']:g}")
  if cfg.get("head"):
    parts.append(cfg["head"].rsplit("/", 1)[-1])
  return ", ".join(parts)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("jsonl", nargs="+")
  ap.add_argument("--priors", help="write tuner priors JSON here")
  args = ap.parse_args(argv)
  rows = [dict(json.loads(l), file=path) for path in args.jsonl
          for l in open(path) if l.strip()]
  print("| method | data | T | prompts | K | τ | acceptance per position | "
        "tok/s (AR) | speedup | predicted | measured/predicted | greedy = AR | "
        "wide verifies | time split draft/verify/rest |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    ts = r["time_split"]
    same = ("—" if r["greedy_identical"] is None else
            "yes" if r["greedy_identical"] else
            f"{r['num_prompts'] - r['rows_differing_from_ar']}/"
            f"{r['num_prompts']}")
    wide = r.get("wide_verify_fraction")
    print(f"| {label(r)} | {r['dataset']} | {r['temperature']:g} | "
          f"{r['num_prompts']} | "
          f"{r['num_draft']} | {r['tau']:.2f} | "
          f"{' '.join(f'{a:.2f}' for a in r['acceptance_per_position'])} | "
          f"{r['tokens_per_s']:.1f} ({r['ar_tokens_per_s']:.1f}) | "
          f"**{r['speedup']:.2f}×** | {r['predicted_speedup']:.2f}× | "
          f"{r['speedup_vs_predicted']:.2f} | {same} | "
          f"{'—' if wide is None else f'{wide:.2f}'} | "
          f"{ts['draft_s']:.2f}/{ts['verify_s']:.2f}/{ts['rest_s']:.2f} |")
  if args.priors:
    fixed = [r for r in rows if not (r.get("config") or {}).get("min_confidence")
             and not r.get("tree_nodes")  # trees: tree_rank_acceptance.py
             and r["method"] not in WHOLE]
    from specjax.drafters.methods import MethodSpec
    configs = {}
    for r in rows:
      if r["method"] in WHOLE:
        spec = MethodSpec(**r["config"]).text()
        task = TASK_OF.get(r["dataset"], "chat")
        c = r["costs_ms"]
        configs[spec, task, r["temperature"]] = dict(
            method=r["method"], spec=spec, task=task,
            temperature=r["temperature"], k=r["num_draft"], tau=r["tau"],
            verify_width=r["verify_width"],
            draft_cost=round(c["draft"] / c["target_forward_1"], 4),
            git_sha=r["git_sha"])
    priors = {}
    for r in fixed:
      task = TASK_OF.get(r["dataset"], "chat")
      # Steps without drafts emit exactly one token; α fits the others.
      w = r.get("wide_verify_fraction") or 1.0
      priors[r["method"], task, r["temperature"]] = dict(
          method=r["method"], task=task, temperature=r["temperature"],
          k=r["num_draft"], tau=r["tau"], draft_rate=w,
          alpha=alpha_from_tau(1 + (r["tau"] - 1) / w, r["num_draft"]),
          git_sha=r["git_sha"])
    per_token = {}  # method -> file -> costs, files in the order given
    for r in fixed:
      if r["method"] != "layerskip":  # the tuner models it from its layers
        c = r["costs_ms"]
        per_token.setdefault(r["method"], {}).setdefault(r["file"], []).append(
            c["draft"] / (r["num_draft"] * c["target_forward_1"]))
    # The newest file's rows: costs fall as the code gets faster.
    costs = {m: round(statistics.median(list(by_file.values())[-1]), 4)
             for m, by_file in per_token.items()}
    path = pathlib.Path(args.priors)
    kept = {}  # what other scripts wrote (tree_rank_acceptance.py's table)
    if path.is_file():
      kept = {k: v for k, v in json.loads(path.read_text()).items()
              if k not in ("source", "priors", "draft_costs", "configs")}
    with open(path, "w") as f:
      json.dump(dict(source=f"specjax bench ({', '.join(args.jsonl)})",
                     priors=list(priors.values()), draft_costs=costs,
                     configs=list(configs.values()), **kept), f, indent=1)
    print(f"wrote {len(priors)} priors to {args.priors}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
