#!/usr/bin/env bash
# The speculative benchmark behind docs/archive/RESULTS_2026-12.md: MT-bench first turns,
# 128 new tokens, batch 1, each method against AR in the same run.
# Appends JSON lines to experiments/results/bench_spec.jsonl (kept on interrupt).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-experiments/results/bench_spec.jsonl}
SJ=${SJ:-.venv/bin/specjax}
for T in 0 1; do
  $SJ bench --method ngram,retrieval --num-draft 5 --dataset mtbench \
    --max-new-tokens 128 --temperature $T --batch-size 1 --json "$OUT"
done
# Layer-skip drafts cost ~0.8 of a target forward each: 20 prompts suffice
# to show where it stands.
for T in 0 1; do
  $SJ bench --method layerskip --num-draft 3 --dataset mtbench \
    --num-prompts 20 --max-new-tokens 128 --temperature $T --batch-size 1 \
    --json "$OUT"
done
