"""The current results at a glance: one table and plots from bench rows.

  .venv/bin/python -m benchmarks.results_summary \
      benchmarks/results/bench_trees_humaneval164_t0.jsonl \
      benchmarks/results/bench_tries_medusa_mtbench80_t0.jsonl ... \
      --png-dir docs/figures

Prints a markdown table (the newest row of each method and knobs, head,
dataset and T, files given oldest first: method and knobs, head, dataset,
T, τ, tokens/s against the same run's AR, speedup, predicted speedup, greedy
= AR, git sha, file) sorted by dataset then speedup, and writes three PNGs:
``speedup.png`` (each row's speedup over its own run's AR, grouped by
dataset), ``acceptance.png`` (acceptance per draft position, one line per
row) and ``predicted.png`` (measured against predicted speedup). Ratios only
compare within a run: every row's AR ran beside it.

``--peers FILE ...`` (``bench_peers.py`` rows) adds a table of every engine's
AR and speculative tokens/s per dataset and ``peers.png``.
"""

from __future__ import annotations

import argparse
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def label(row: dict) -> str:
  """A row's method and knobs as ``bench_methods`` specs read."""
  c = row.get("config", {})
  parts = [row["method"], f"k={row['num_draft']}"]
  if c.get("tree_shape"):
    if not c.get("lookup_nodes"):  # K is the shape's depth (else the trie's)
      parts.pop()
    parts.append(f"shape={c['tree_shape']}")
  elif row.get("tree_nodes"):
    parts.append(f"nodes={row['tree_nodes']}")
  if c.get("lookup_nodes"):
    parts.append(f"lookup={c['lookup_nodes']}")
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


def newest(rows) -> list[dict]:
  """One row per method, knobs, head, dataset and temperature: the last
  one in the order given (files oldest first)."""
  keep = {}
  for r in rows:
    keep[label(r), r.get("head_id"), r["dataset"], r["num_prompts"],
         r["temperature"]] = r
  return list(keep.values())


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


def _pyplot():
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def _panels(groups: dict, height: float, width: float = 6.0):
  """A figure with one panel per group, and ``[(ax, name, rows)]`` in
  name order."""
  fig, axes = _pyplot().subplots(1, len(groups), squeeze=False,
                                 figsize=(width * len(groups), height))
  return fig, [(ax, name, rs) for ax, (name, rs)
               in zip(axes[0], sorted(groups.items()))]


def _save(fig, out: pathlib.Path, name: str) -> pathlib.Path:
  out.mkdir(parents=True, exist_ok=True)
  fig.tight_layout()
  fig.savefig(out / name, dpi=90)
  _pyplot().close(fig)
  return out / name


def plots(rows, out: pathlib.Path) -> list[pathlib.Path]:
  groups = {}
  for r in rows:
    groups.setdefault(f"{r['dataset']} {r['num_prompts']}, T = "
                      f"{r['temperature']:g}", []).append(r)
  fig, panels = _panels(groups, 4.5)
  for ax, name, rs in panels:
    rs = sorted(rs, key=lambda r: r["speedup"])
    bars = ax.barh([label(r) for r in rs], [r["speedup"] for r in rs],
                   color=["tab:green" if r["speedup"] >= 1 else "tab:grey"
                          for r in rs])
    ax.bar_label(bars, fmt="%.2f×", fontsize=8)
    ax.axvline(1.0, color="black", lw=1)
    ax.set_title(name)
    ax.set_xlabel("speedup over AR (same run)")
    ax.tick_params(axis="y", labelsize=8)
  written = [_save(fig, out, "speedup.png")]

  fig, panels = _panels(groups, 4.0)
  for ax, name, rs in panels:
    for r in rs:
      acc = r["acceptance_per_position"]
      ax.plot(range(1, len(acc) + 1), acc, marker="o", label=label(r))
    ax.set_title(name)
    ax.set_xlabel("draft position (tree depth)")
    ax.set_ylabel("accepted per verify")
    ax.legend(fontsize=7)
  written.append(_save(fig, out, "acceptance.png"))

  fig, ax = _pyplot().subplots(figsize=(5.5, 5))
  for i, (name, rs) in enumerate(sorted(groups.items())):
    ax.scatter([r["predicted_speedup"] for r in rs], [r["speedup"] for r in rs],
               label=name, color=f"C{i}")
  lo = min(min(r["speedup"], r["predicted_speedup"]) for r in rows) - 0.05
  hi = max(max(r["speedup"], r["predicted_speedup"]) for r in rows) + 0.05
  ax.plot([lo, hi], [lo, hi], color="black", lw=1, label="measured = predicted")
  ax.set_xlabel("predicted speedup (τ and the timed draft and verify)")
  ax.set_ylabel("measured speedup (same run)")
  ax.legend(fontsize=8)
  return written + [_save(fig, out, "predicted.png")]


def peers_table(rows) -> str:
  lines = ["| dataset | engine | weights | method | tok/s | over its own AR "
           "| = its own greedy | specjax best ÷ this | version |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    same = "yes" if r["equals_own_greedy"] else (
        f"**no** ({r['rows_differing_from_own_greedy']} of "
        f"{r['num_prompts']} differ)")
    lines.append(
        f"| {r['dataset']} {r['num_prompts']} | {r['engine']} | {r['weights']} "
        f"| {r['method']} | {r['tokens_per_s']:.1f} "
        f"| {r['speedup_over_own_ar']:.2f}× | {same} "
        f"| {r['specjax_best_over_this']:.2f} | {r['version']} |")
  return "\n".join(lines)


def peers_plot(rows, out: pathlib.Path) -> pathlib.Path:
  """tokens/s of every engine and method, one panel per dataset."""
  groups = {}
  for r in rows:
    groups.setdefault(f"{r['dataset']} {r['num_prompts']}, T = 0", []).append(r)
  fig, panels = _panels(groups, 4.5, width=6.5)
  for ax, name, rs in panels:
    colors = [("tab:blue" if r["engine"] == "specjax" else "tab:orange")
              if r["method"] != "ar" else "tab:grey" for r in rs]
    bars = ax.barh([f"{r['engine']}: {r['method']}" for r in rs][::-1],
                   [r["tokens_per_s"] for r in rs][::-1], color=colors[::-1])
    ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_title(name)
    ax.set_xlabel("tokens/s, batch 1, same run (grey: AR)")
    ax.tick_params(axis="y", labelsize=8)
  return _save(fig, out, "peers.png")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("files", nargs="+")
  ap.add_argument("--peers", nargs="*", default=[],
                  help="bench_peers.py result files")
  ap.add_argument("--png-dir", default=None)
  args = ap.parse_args(argv)
  rows = newest(load(args.files))
  print(table(rows))
  peers = load(args.peers)
  if peers:
    print()
    print(peers_table(peers))
  if args.png_dir:
    for p in plots(rows, pathlib.Path(args.png_dir)):
      print(p)
    if peers:
      print(peers_plot(peers, pathlib.Path(args.png_dir)))


if __name__ == "__main__":
  main()
