#!/usr/bin/env bash
# The pipeline's measured bubble against (p-1)/(m+p-1) (issue 8): `flotilla train --pp 2` on
# balanced stages (8 blocks of d_model 128 and a 64-token vocabulary, so the embeddings and the
# head are under 1 % of a stage's work), 2 workers x 1 thread, 1F1B with m = 4, 8, 16
# micro-batches of 2 rows. Each run prints the most idle stage's wait (time blocked in sends and
# receives over the steps after the first) beside the planner's bubble.
# Usage: ROUNDS=3 scripts/bench-bubble.sh [path/to/flotilla]
set -euo pipefail
BIN=${1:-target/release/flotilla}
ROUNDS=${ROUNDS:-3}
for round in $(seq 1 "$ROUNDS"); do
  for m in 4 8 16; do
    out=$("$BIN" train --nproc 2 --threads 1 --pp 2 --pipeline-schedule 1f1b --grad-accum "$m" \
      --config tiny --layers 8 --d-model 128 --heads 4 --vocab 64 --seq-len 128 --batch 2 \
      --steps 6 --no-progress --peak-gflops 60 2>&1)
    line=$(grep '^# pipeline:' <<<"$out")
    tps=$(grep '^# done:' <<<"$out" | sed -E 's/.*, ([0-9.]+) tokens\/s.*/\1/')
    echo "round $round m $m: $line; $tps tokens/s"
  done
done
