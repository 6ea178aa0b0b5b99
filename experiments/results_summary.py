"""The current results at a glance: one table and plots from bench rows.

  .venv/bin/python experiments/results_summary.py \
      experiments/results/bench_trees_humaneval164_t0.jsonl \
      experiments/results/bench_tries_medusa_mtbench80_t0.jsonl ... \
      --png-dir docs/figures

Prints a markdown table (one line per row: method and knobs, head, dataset,
T, τ, tokens/s against the same run's AR, speedup, predicted speedup, greedy
= AR, git sha, file) sorted by dataset then speedup, and writes two PNGs:
``speedup.png`` (each row's speedup over its own run's AR, grouped by
dataset) and ``acceptance.png`` (acceptance per draft position, one line per
row). Ratios only compare within a run: every row's AR ran beside it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def label(row: dict) -> str:
  """A row's method and knobs as ``bench_methods`` specs read."""
  c = row.get("config", {})
  parts = [row["method"], f"k={row['num_draft']}"]
  if c.get("tree_shape"):
    parts = [row["method"], f"shape={c['tree_shape']}"]
  elif row.get("tree_nodes"):
    parts.append(f"nodes={row['tree_nodes']}")
  if c.get("min_confidence"):
    parts.append(f"conf={c['min_confidence']}")
  return ":".join(parts)


def load(paths) -> list[dict]:
  rows = []
  for path in paths:
    for line in pathlib.Path(path).read_text().splitlines():
      if line.strip():
        rows.append({**json.loads(line), "file": pathlib.Path(path).name})
  return rows


def table(rows) -> str:
  head = ("| method | head | dataset, T | τ | tok/s (AR) | speedup | predicted "
          "| greedy = AR | git | file |\n|---|---|---|---|---|---|---|---|---|---|")
  lines = [head]
  for r in sorted(rows, key=lambda r: (r["dataset"], r["temperature"],
                                       -r["speedup"])):
    same = {True: "yes", False: "**no**", None: "—"}[r.get("greedy_identical")]
    lines.append(
        f"| {label(r)} | {(r.get('head_id') or '—').split('@')[0]} "
        f"| {r['dataset']} {r['num_prompts']}, T = {r['temperature']:g} "
        f"| {r['tau']:.2f} | {r['tokens_per_s']:.1f} "
        f"({r['ar_tokens_per_s']:.1f}) | **{r['speedup']:.2f}×** "
        f"| {r['predicted_speedup']:.2f}× | {same} | {r['git_sha']} "
        f"| {r['file']} |")
  return "\n".join(lines)


def plots(rows, out: pathlib.Path) -> list[pathlib.Path]:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  out.mkdir(parents=True, exist_ok=True)
  groups = {}
  for r in rows:
    groups.setdefault(f"{r['dataset']} {r['num_prompts']}, T = "
                      f"{r['temperature']:g}", []).append(r)
  fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.5),
                           squeeze=False)
  for ax, (name, rs) in zip(axes[0], sorted(groups.items())):
    rs = sorted(rs, key=lambda r: r["speedup"])
    bars = ax.barh([label(r) for r in rs], [r["speedup"] for r in rs],
                   color=["tab:green" if r["speedup"] >= 1 else "tab:grey"
                          for r in rs])
    ax.bar_label(bars, fmt="%.2f×", fontsize=8)
    ax.axvline(1.0, color="black", lw=1)
    ax.set_title(name)
    ax.set_xlabel("speedup over AR (same run)")
    ax.tick_params(axis="y", labelsize=8)
  fig.tight_layout()
  speed = out / "speedup.png"
  fig.savefig(speed, dpi=90)
  plt.close(fig)

  fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4),
                           squeeze=False)
  for ax, (name, rs) in zip(axes[0], sorted(groups.items())):
    for r in rs:
      acc = r["acceptance_per_position"]
      ax.plot(range(1, len(acc) + 1), acc, marker="o", label=label(r))
    ax.set_title(name)
    ax.set_xlabel("draft position (tree depth)")
    ax.set_ylabel("accepted per verify")
    ax.legend(fontsize=7)
  fig.tight_layout()
  acc_png = out / "acceptance.png"
  fig.savefig(acc_png, dpi=90)
  plt.close(fig)
  return [speed, acc_png]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("files", nargs="+")
  ap.add_argument("--png-dir", default=None)
  args = ap.parse_args(argv)
  rows = load(args.files)
  print(table(rows))
  if args.png_dir:
    for p in plots(rows, pathlib.Path(args.png_dir)):
      print(p)


if __name__ == "__main__":
  main()
