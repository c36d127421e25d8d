#!/usr/bin/env bash
# The multi-host all-reduce benchmark on one machine (docs/PERFORMANCE.md): 2 network-namespace
# hosts x 2 ranks, every host's egress limited to RATE (default 1gbit) with tbf, then
# `flotilla bench comm --ops all_reduce --calibrate` with --algo ring, --algo hierarchical and
# automatic selection. Needs root and iproute2; tears the namespaces down on exit.
#
# Usage: scripts/bench-netns.sh [extra bench comm args...]
# Env:   FLOTILLA_BIN (default: $CARGO_TARGET_DIR or target, /release/flotilla), RATE (1gbit),
#        SIZES (4K,1M,16M,64M), NPROC (2), HOSTS (2), PORT (29500).
# Build first: cargo build --release -p flotilla
set -euo pipefail
cd "$(dirname "$0")/.."

BIN="${FLOTILLA_BIN:-${CARGO_TARGET_DIR:-target}/release/flotilla}"
RATE="${RATE:-1gbit}"
SIZES="${SIZES:-4K,1M,16M,64M}"
NPROC="${NPROC:-2}"
HOSTS="${HOSTS:-2}"
PORT="${PORT:-29500}"
[ -x "$BIN" ] || { echo "bench-netns: no binary at $BIN (cargo build --release -p flotilla)" >&2; exit 1; }

export FLOTILLA_NETNS_PREFIX="flb$$"
NETNS=scripts/netns-hosts.sh
trap '$NETNS down' EXIT
$NETNS up "$HOSTS" "$RATE"
RDZV="$($NETNS ip 0):$PORT"
FLOTILLA_SECRET="$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')"
export FLOTILLA_SECRET

echo "# machine: $(nproc) cores, $(uname -srm); load: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# $HOSTS netns hosts x $NPROC ranks, inter-host egress tbf rate $RATE burst 256kb latency 50ms"

run() {
  echo
  echo "## flotilla bench comm --ops all_reduce --sizes $SIZES --calibrate $*"
  local pids=() i rc=0
  for ((i = 1; i < HOSTS; i++)); do
    $NETNS exec "$i" "$BIN" bench comm --nnodes "$HOSTS" --node-rank "$i" --nproc "$NPROC" \
      --rdzv "$RDZV" --ops all_reduce --sizes "$SIZES" --calibrate --job-timeout-s 600 "$@" \
      >/dev/null &
    pids+=($!)
  done
  $NETNS exec 0 "$BIN" bench comm --nnodes "$HOSTS" --node-rank 0 --nproc "$NPROC" \
    --rdzv "$RDZV" --ops all_reduce --sizes "$SIZES" --calibrate --job-timeout-s 600 "$@" || rc=$?
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  return $rc
}

run --algo ring "$@"
run --algo hierarchical "$@"
run "$@"
