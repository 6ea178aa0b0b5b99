#!/usr/bin/env bash
# The EAGLE benchmark behind docs/archive/RESULTS_2026-12.md: the then-shipped EAGLE-3
# head (fixed K = 7, and dynamic K: a row stops drafting below 0.3 head
# confidence) against AR in the same run, next to n-gram and layer-skip;
# 128 new tokens, batch 1, full MT-bench (80) and HumanEval (164).
#
# Hours on the 2-core CPU (~40 s per MT-bench prompt for the T = 0 set), so
# each set keeps a journal in $J: rerun the script after an interruption and
# every set resumes after its last finished prompt; a finished set is marked
# $J/SET.done and skipped. N_CHAT / N_CODE cut the prompt counts; the count
# is part of the set's name, so a cut run never stands in for a full one.
# Appends one JSON line per method and set to $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-experiments/results/bench_eagle_full.jsonl}
J=${J:-runs/journals}
PY=${PY:-.venv/bin/python}
mkdir -p "$J"
N_CHAT=${N_CHAT:+--num-prompts $N_CHAT}
N_CODE=${N_CODE:+--num-prompts $N_CODE}
# set NAME DATASET TEMPERATURE N_ARG METHOD...
set_() {
  local name=$1${4:+_n${4##* }} dataset=$2 temp=$3 n=$4; shift 4
  [[ -e "$J/$name.done" ]] && { echo "$name: done, skipped"; return; }
  $PY experiments/bench_methods.py --json "$OUT" --journal "$J/$name.jsonl" \
    --dataset "$dataset" $n --temperature "$temp" "$@"
  touch "$J/$name.done"
}
set_ mtbench_t0 mtbench 0 "$N_CHAT" eagle3:k=7 eagle3:k=7:conf=0.3 ngram:k=5 layerskip:k=3
set_ humaneval_t0 humaneval 0 "$N_CODE" eagle3:k=7 eagle3:k=7:conf=0.3 ngram:k=5
set_ mtbench_t1 mtbench 1 "$N_CHAT" eagle3:k=7 eagle3:k=7:conf=0.3 ngram:k=5
set_ humaneval_t1 humaneval 1 "$N_CODE" eagle3:k=7 eagle3:k=7:conf=0.3 ngram:k=5
