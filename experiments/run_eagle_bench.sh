#!/usr/bin/env bash
# The EAGLE benchmark behind docs/RESULTS.md (issue 4): the shipped EAGLE-3
# head against AR in the same run, next to n-gram; 128 new tokens, batch 1.
# Prompt counts are cut to what fits a session on the 2-core CPU (each
# configuration decodes every prompt, and so does AR).
# Appends JSON lines to experiments/results/bench_eagle.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-experiments/results/bench_eagle.jsonl}
PY=${PY:-.venv/bin/python}
B="$PY experiments/bench_methods.py --json $OUT"
# The aim's setting (chain K = 7, T = 0), dynamic K (a row stops drafting
# below 0.3 head confidence) and n-gram, on MT-bench.
$B --dataset mtbench --num-prompts ${N_CHAT:-30} --temperature 0 \
  eagle3:k=7 eagle3:k=7:conf=0.3 ngram:k=5
$B --dataset mtbench --num-prompts ${N_T1:-20} --temperature 1 \
  eagle3:k=7 eagle3:k=7:conf=0.3
$B --dataset humaneval --num-prompts ${N_CODE:-20} --temperature 0 \
  eagle3:k=7 eagle3:k=7:conf=0.3 ngram:k=5
