"""Markdown tables from `specjax bench` JSON lines, and the tuner's priors.

  python experiments/summarize_spec_bench.py experiments/results/bench_spec.jsonl \
      [--priors specjax/tuner_priors.json]

Prints one table row per (method, temperature) and, with --priors, writes the
per-draft acceptance α the tuner uses: the α whose geometric model
(1 - α^(K+1)) / (1 - α) reproduces the measured τ at the measured K.
"""

from __future__ import annotations

import argparse
import json
import sys

TASK_OF = {"mtbench": "chat", "humaneval": "code", "sharegpt": "chat"}


def alpha_from_tau(tau: float, k: int) -> float:
  """Bisection on the monotone map α -> E[tokens](α, K)."""
  from specjax.theory import expected_tokens
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
  ap.add_argument("jsonl")
  ap.add_argument("--priors", help="write tuner priors JSON here")
  args = ap.parse_args(argv)
  rows = [json.loads(l) for l in open(args.jsonl) if l.strip()]
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
    priors = [dict(method=r["method"], task=TASK_OF.get(r["dataset"], "chat"),
                   temperature=r["temperature"], k=r["num_draft"],
                   tau=r["tau"], alpha=alpha_from_tau(r["tau"], r["num_draft"]),
                   git_sha=r["git_sha"]) for r in rows]
    with open(args.priors, "w") as f:
      json.dump(dict(source=f"specjax bench ({args.jsonl})", priors=priors),
                f, indent=1)
    print(f"wrote {len(priors)} priors to {args.priors}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
