"""The seed's exercise: α = 0.9, c = 0.04, K = 1..10 drafts per verify.

Run:  .venv/bin/python experiments/theory_seed.py [--alpha 0.9] [--c 0.04]

Prints JSON (expected tokens per verify, wall time per token in units of one
target step, speedup, for each K, plus the minimising K) and writes
experiments/results/theory_seed.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from specjax.measure import theory  # noqa: E402


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--alpha", type=float, default=0.9)
  ap.add_argument("--c", type=float, default=0.04)
  ap.add_argument("--k-max", type=int, default=10)
  ap.add_argument("--out", default="experiments/results/theory_seed")
  args = ap.parse_args(argv)
  ks = list(range(1, args.k_max + 1))
  rows = [dict(k=k, expected_tokens=round(theory.expected_tokens(args.alpha, k), 4),
               time_per_token=round(theory.time_per_token(args.alpha, k, args.c), 4),
               speedup=round(theory.speedup(args.alpha, k, args.c), 4))
          for k in ks]
  best = theory.optimal_k(args.alpha, args.c, k_max=args.k_max)
  unbounded = theory.optimal_k(args.alpha, args.c, k_max=256)
  result = dict(alpha=args.alpha, c=args.c, rows=rows, best_k=best.k,
                best_speedup=round(best.speedup, 4),
                best_k_unbounded=unbounded.k,
                best_speedup_unbounded=round(unbounded.speedup, 4))
  print(json.dumps(result, indent=2))
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")

  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax1 = plt.subplots(figsize=(7, 4.2))
  ax1.plot(ks, [r["expected_tokens"] for r in rows], "o-", color="tab:blue",
           label="E[tokens per verify]")
  ax1.set_xlabel("K (drafts per verify)")
  ax1.set_ylabel("tokens per verify", color="tab:blue")
  ax2 = ax1.twinx()
  ax2.plot(ks, [r["time_per_token"] for r in rows], "s-", color="tab:red",
           label="time per token")
  ax2.set_ylabel("time per token (target steps)", color="tab:red")
  ax2.axvline(best.k, color="gray", ls="--")
  ax2.annotate(f"min at K={best.k}\n{best.speedup:.2f}x", (best.k, best.time_per_token),
               textcoords="offset points", xytext=(-70, 25))
  ax1.set_title(f"Speculative decoding, alpha={args.alpha}, c={args.c}")
  fig.tight_layout()
  fig.savefig(out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
  main()
