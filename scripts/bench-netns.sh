#!/usr/bin/env bash
# The multi-host all-reduce benchmark on one machine (docs/PERFORMANCE.md): 2 network-namespace
# hosts x 2 ranks, every host's egress limited to RATE (default 1gbit) with tbf, then
# `flotilla bench comm --ops all_reduce --calibrate` with --algo ring, --algo hierarchical and
# automatic selection. Needs root and iproute2; tears the namespaces down on exit.
#
# Usage: scripts/bench-netns.sh [extra bench comm args...]   (appended to every run; change the
#        sizes with SIZES=..., since a repeated --sizes adds to the list)
# Env:   FLOTILLA_BIN (default: $CARGO_TARGET_DIR or target, /release/flotilla), RATE (1gbit),
#        SIZES (4K,1M,16M,64M), NPROC (2), HOSTS (2), PORT (29500),
#        HOST_CPUS (split: each host's ranks run on their own share of the machine's cores, as
#        on separate machines, where there are at least as many cores as hosts; shared: the
#        scheduler places every rank anywhere).
# Build first: cargo build --release -p flotilla
set -euo pipefail
cd "$(dirname "$0")/.."

BIN="${FLOTILLA_BIN:-${CARGO_TARGET_DIR:-target}/release/flotilla}"
RATE="${RATE-1gbit}"   # RATE= (empty): no limit
SIZES="${SIZES:-4K,1M,16M,64M}"
NPROC="${NPROC:-2}"
HOSTS="${HOSTS:-2}"
PORT="${PORT:-29500}"
HOST_CPUS="${HOST_CPUS:-split}"
[ -x "$BIN" ] || { echo "bench-netns: no binary at $BIN (cargo build --release -p flotilla)" >&2; exit 1; }

export FLOTILLA_NETNS_PREFIX="flb$$"
NETNS=scripts/netns-hosts.sh
OUT="$(mktemp -d)"
trap '$NETNS down; rm -rf "$OUT"' EXIT
$NETNS up "$HOSTS" "$RATE"
RDZV="$($NETNS ip 0):$PORT"
FLOTILLA_SECRET="$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')"
export FLOTILLA_SECRET

echo "# machine: $(nproc) cores, $(uname -srm); load: $(cut -d' ' -f1-3 /proc/loadavg)"
if [ -n "$RATE" ]; then LINK="tbf rate $RATE burst 256kb latency 50ms on every host egress"; else LINK="unlimited (veth + bridge)"; fi
echo "# $HOSTS netns hosts x $NPROC ranks; inter-host link: $LINK; host cpus: $HOST_CPUS"

# The command prefix that keeps host $1's process tree on its own cores (empty when shared).
cpus_of() {
  local c h="$1"
  c="$(nproc)"
  if [ "$HOST_CPUS" = split ] && [ "$c" -ge "$HOSTS" ]; then
    echo "taskset -c $((h * c / HOSTS))-$(((h + 1) * c / HOSTS - 1))"
  fi
}

run() {
  local tag="$1"
  shift
  echo
  echo "## flotilla bench comm --ops all_reduce --sizes $SIZES --calibrate $*"
  local pids=() i rc=0
  for ((i = 1; i < HOSTS; i++)); do
    $NETNS exec "$i" $(cpus_of "$i") "$BIN" bench comm --nnodes "$HOSTS" --node-rank "$i" --nproc "$NPROC" \
      --rdzv "$RDZV" --ops all_reduce --sizes "$SIZES" --calibrate --job-timeout-s 600 "$@" \
      >/dev/null &
    pids+=($!)
  done
  $NETNS exec 0 $(cpus_of 0) "$BIN" bench comm --nnodes "$HOSTS" --node-rank 0 --nproc "$NPROC" \
    --rdzv "$RDZV" --ops all_reduce --sizes "$SIZES" --calibrate --job-timeout-s 600 "$@" \
    | tee "$OUT/$tag" || rc=$?
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  return $rc
}

run ring --algo ring "$@"
run hier --algo hierarchical "$@"
run auto "$@"

# Summary: hierarchical speed-up over the flat ring, and the model's error of every row.
echo
echo "## summary (time_us medians; err% = measured vs alpha-beta prediction)"
awk '
  FNR == 1 { run = FILENAME; sub(".*/", "", run) }
  $1 == "all_reduce" { t[run, $3] = $7; e[run, $3] = $12; a[run, $3] = $6; s[$3] = 1 }
  END {
    printf "%11s %12s %6s %12s %6s %12s %-17s %6s %9s\n", "size_B", "ring_us", "err%", "hier_us", "err%", "auto_us", "auto_algo", "err%", "ring/hier"
    n = 0; for (k in s) sz[++n] = k + 0
    for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (sz[j] < sz[i]) { x = sz[i]; sz[i] = sz[j]; sz[j] = x }
    for (i = 1; i <= n; i++) {
      k = sz[i]
      printf "%11d %12.1f %6s %12.1f %6s %12.1f %-17s %6s %8.2fx\n", k, t["ring", k], e["ring", k], t["hier", k], e["hier", k], t["auto", k], a["auto", k], e["auto", k], (t["hier", k] > 0 ? t["ring", k] / t["hier", k] : 0)
    }
  }' "$OUT/ring" "$OUT/hier" "$OUT/auto"
