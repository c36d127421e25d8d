#!/usr/bin/env bash
# Data-pipeline figures for docs/PERFORMANCE.md, all in one run on one machine:
#   - loader bandwidth vs a plain sequential read of the same files (warm and cold page cache),
#   - resume time on a 1-billion-token dataset,
#   - the loader alone at the training rate and unpaced (stress),
#   - training tokens/s on the same dataset (what the loader must outpace 5x).
# Usage: scripts/bench-data.sh            (ROUNDS=3 by default; --cold needs root)
# The 2 GB dataset is written once to $DATA_BENCH_DIR (default /tmp/flotilla-data-bench).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
DIR=${DATA_BENCH_DIR:-/tmp/flotilla-data-bench}
cargo build --release -p flotilla >/dev/null
BIN=target/release/flotilla

if [ ! -f "$DIR/b1/manifest.json" ]; then
  $BIN data synth --out "$DIR/b1" --tokens 1e9 --vocab 50257 --no-progress
fi
echo "# machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2), $(free -g | awk '/Mem/{print $2}') GiB"

for r in $(seq "$ROUNDS"); do
  echo "## round $r"
  for e in 1 3; do
    echo "warm epochs=$e batch=64x1024 workers=3"
    $BIN data bench --dataset "$DIR/b1" --seq-len 1024 --global-batch 64 --workers 3 --epochs $e --json
  done
  echo "warm epochs=1 batch=8x1024 workers=3"
  $BIN data bench --dataset "$DIR/b1" --seq-len 1024 --global-batch 8 --workers 3 --epochs 1 --json
done
# Cold runs last: each empties the page cache, which would make the next warm run's first read cold.
if [ "$(id -u)" = 0 ]; then
  for r in $(seq "$ROUNDS"); do
    echo "cold round $r epochs=1 batch=64x1024 workers=3"
    $BIN data bench --dataset "$DIR/b1" --seq-len 1024 --global-batch 64 --workers 3 --epochs 1 --cold --json
  done
fi

echo "## training on the dataset (gpt2-small shape at 4 layers, 2 threads)"
$BIN train --dataset "$DIR/b1" --config small --steps 12 --batch 4 --seq-len 256 --threads 2 \
  --no-progress --log-every 4 | grep -E "^# done|^# data"

echo "## stress: paced at 5x 20k tokens/s for 10 s, then unpaced for 10 s"
$BIN data stress --dataset "$DIR/b1" --seq-len 1024 --global-batch 8 --rate 100000 --duration 10
$BIN data stress --dataset "$DIR/b1" --seq-len 1024 --global-batch 8 --workers 3 --duration 10
