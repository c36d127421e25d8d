#!/usr/bin/env bash
# Collectives, Flotilla beside its peers in one run (the same machine state): PyTorch Gloo,
# Open MPI (shared memory and TCP-only), then `flotilla bench comm` with shared memory and with
# TCP only. Run benchmarks one at a time on an otherwise idle machine.
#
#   scripts/bench-vs-peers.sh [W] [OUTDIR]
#
# Needs the peers' venv (bash ../shared/peers/setup_env.sh) and a release build
# (cargo build --release -p flotilla).
set -euo pipefail
W="${1:-4}"
OUT="${2:-/tmp/flotilla-bench-$(date +%Y%m%dT%H%M%S)}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PEERS="${PEERS:-$ROOT/../shared/peers}"
PY="${PEERS_PY:-$HOME/.cache/flotilla-peers/venv/bin/python}"
FL="${FLOTILLA:-$ROOT/target/release/flotilla}"
SIZES="${SIZES:-4K,64K,1M,16M,64M}"
OPS="all_reduce,all_gather,reduce_scatter,broadcast"
mkdir -p "$OUT"
echo "# $(date -Is) W=$W sizes=$SIZES on $(nproc) cores; load: $(cut -d' ' -f1-3 /proc/loadavg)" | tee "$OUT/README"

"$PY" "$PEERS/gloo_allreduce_bench.py" -W "$W" --sizes "$SIZES" --ops "$OPS" --out "$OUT/gloo.txt" >/dev/null
mpirun --allow-run-as-root --oversubscribe -np "$W" "$PY" "$PEERS/mpi_allreduce_bench.py" --sizes "$SIZES" --ops "$OPS" --out "$OUT/mpi.txt" >/dev/null
mpirun --allow-run-as-root --oversubscribe --mca btl tcp,self -np "$W" "$PY" "$PEERS/mpi_allreduce_bench.py" --sizes "$SIZES" --ops "$OPS" --out "$OUT/mpi.txt" --append >/dev/null
"$FL" bench comm --nproc "$W" --sizes "$SIZES" --ops "$OPS" --rounds 3 --target-seconds 0.6 --calibrate | tee "$OUT/flotilla_shm.txt"
"$FL" bench comm --nproc "$W" --sizes "$SIZES" --ops "$OPS" --rounds 3 --target-seconds 0.6 --transport tcp --calibrate | tee "$OUT/flotilla_tcp.txt"
echo "results in $OUT"
