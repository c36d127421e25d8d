#!/usr/bin/env bash
# Same-run comparison of 2-rank data-parallel training with PyTorch DDP (gloo) on this machine:
# ../shared/peers/ddp_gpt_bench.py --modes ddp (2 processes x 1 thread, micro-batch 8 per rank,
# 3 warm-up + 10 timed steps, plus no_sync steps to read off the all-reduce cost) against
# `flotilla train --nproc 2 --threads 1` on the same configs (13 steps; the first is not timed;
# tokens/s and exposed communication from the summary line), at each ZeRO stage of
# ZERO_STAGES (default "0 3": plain data parallel and ZeRO-3), ROUNDS times, interleaved.
# Usage: scripts/bench-ddp-vs-peers.sh [OUTFILE]
# Needs a Python with torch: PEER_PY (default /root/.cache/flotilla-peers/venv/bin/python).
set -euo pipefail
OUT=${1:-/dev/stdout}
ROUNDS=${ROUNDS:-2}
ZERO_STAGES=${ZERO_STAGES:-0 3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PEERS=${PEERS:-$ROOT/../shared/peers}
PY=${PEER_PY:-/root/.cache/flotilla-peers/venv/bin/python}
BIN=${FLOTILLA_BIN:-$ROOT/target/release/flotilla}
[ -x "$BIN" ] || (cd "$ROOT" && cargo build --release -p flotilla)
{
echo "## $(date -u +%FT%TZ) $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
for r in $(seq "$ROUNDS"); do
  for cfg in tiny small; do
    echo "### round $r, config $cfg, 2 processes x 1 thread, micro-batch 8 per rank"
    "$PY" "$PEERS/ddp_gpt_bench.py" --config "$cfg" --modes ddp --warmup 3 --steps 10 \
      | grep -E '^(# matmul|config|'"$cfg"')'
    for z in $ZERO_STAGES; do
      "$BIN" train --config "$cfg" --nproc 2 --threads 1 --batch 8 --steps 13 --no-progress \
        --log-every 1000 --zero "$z" | grep -E '^# (done|model|state)' | sed "s/^/flotilla zero $z /"
    done
  done
done
} | tee -a "$OUT"
