#!/usr/bin/env bash
# The planner's forecast beside the measured step (issue 7): `flotilla train --nproc 2` on the
# "tiny" and "small" configs, plain data parallel and ZeRO-3, ROUNDS runs each; prints every
# run's forecast and measurement and the off-by percentage from the training summary.
#   ROUNDS=5 scripts/plan-vs-actual.sh [OUT]
set -euo pipefail
ROUNDS=${ROUNDS:-5}
OUT=${1:-/dev/stdout}
BIN=${BIN:-target/release/flotilla}
[ -x "$BIN" ] || cargo build --release -q -p flotilla
{
  echo "## $(date -u +%FT%TZ) $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
  echo "config zero round plan_ms measured_ms off"
  for cfg in tiny small; do
    for zero in 0 3; do
      for r in $(seq 1 "$ROUNDS"); do
        line=$("$BIN" train --config "$cfg" --nproc 2 --threads 1 --batch 8 --steps 13 \
          --no-progress --zero "$zero" 2>&1 | grep '^#   step' || true)
        read -r _ _ plan _ measured _ off _ <<<"$line"
        echo "$cfg $zero $r $plan $measured $off"
      done
    done
  done
} | tee -a "$OUT"
