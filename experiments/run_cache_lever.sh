#!/usr/bin/env bash
# Is caching the target's features (several epochs over fewer examples)
# worth more than fresh data at the same compute? (measured as
# acceptance per CPU-hour). Baseline: the 150-step online TTT-3
# run of docs/archive/RESULTS_2026-12.md ("Same budget").
#
# Compute is counted in the per-step costs measured alone on this CPU
# (DESIGN.md, "Only assistant rows reach the LM head"): target forward
# 2.98 s and TTT-3 head step 2.68 s per 2 x 512 batch, i.e. 1.49 s of target
# per example. 150 online steps = 150 x (2.98 + 2.68) = 849 s. Equal compute
# with a cache of E examples and S steps: 1.49 E + 2.68 S = 849:
#   2 epochs (S = E):      E = 204, S = 204
#   4 epochs (S = 2E):     E = 124, S = 248
# Same data order seed, schedule (steps=2000 stopped early, as the baseline)
# and TTT 3. Then scores each on the 64 held-out conversations. The builds
# measured 1.7-2.0 s per example at c7cb9f3 (a memmap writer, since replaced);
# docs/archive/RESULTS_2026-12.md compares the measured seconds, not these estimates.
set -euo pipefail
cd "$(dirname "$0")/.."
SJ=${SJ:-.venv/bin/specjax}
W=${W:-runs/cache_lever}
for spec in "204 204" "124 248"; do
  set -- $spec
  $SJ train --config experiments/eagle3_smollm2.py --set steps=2000 \
    --set ttt_warm_fraction=1.0 --set feature_cache=$1 --set checkpoint_every=$2 \
    --stop-after $2 --workdir $W/cache$1
done
.venv/bin/python experiments/eagle3_curve.py $W/cache204 $W/cache124 \
  --json experiments/results/eagle3_curve.jsonl
