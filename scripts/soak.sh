#!/usr/bin/env bash
# The chaos soak (issue 29; docs/PERFORMANCE.md, "Soak"): one rigid job of 3 nodes x 1 worker
# (3 agents on this machine, the tiny 1-layer model of the tests) runs `--chaos soak:N`, N
# random faults (kill, hang, partition, slow) drawn from SEED, and then the same job
# undisturbed; prints the faults of each kind, the restarts, the goodput ledger beside the
# planner's figure, and whether the two saved models are byte for byte equal.
#   scripts/soak.sh [N] [SEED] [OUT]      (defaults: 100 faults, seed 1, stdout)
# Opt-in benchmark, not a test: a 100-fault soak takes minutes. BIN picks the binary (default
# target/debug/flotilla, built if absent: the model is tiny, recovery is what is measured);
# KEEP=1 keeps the nodes' logs.
set -euo pipefail
N=${1:-100}
SEED=${2:-1}
OUT=${3:-/dev/stdout}
BIN=${BIN:-target/debug/flotilla}
[ -x "$BIN" ] || cargo build -q -p flotilla
# Collectives give up on a silent peer after 3 s (a partition lasts twice that, 6 s); a
# stopped worker's heartbeat is missed after 3 s.
export FLOTILLA_TIMEOUT_S=${FLOTILLA_TIMEOUT_S:-3}
export FLOTILLA_SECRET=soak-secret-0123456789abcdef
STEPS=${STEPS:-$((3 * N + 1))}
WORK=$(mktemp -d)
# KEEP=1 keeps every node's output (and the checkpoints) in $WORK.
[ -n "${KEEP:-}" ] && echo "keeping the nodes' output in $WORK" >&2 || trap 'rm -rf "$WORK"' EXIT

# One job of 3 agents in $WORK/$1, extra flags after; node i's output in $WORK/$1/node$i.{out,err}.
job() {
  local tag=$1
  shift
  local port
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  mkdir -p "$WORK/$tag"
  local pids=()
  for i in 0 1 2; do
    "$BIN" train --config tiny --layers 1 --d-model 32 --heads 2 --seq-len 32 --batch 2 \
      --threads 1 --peak-gflops 100 --no-progress --nproc 1 --nnodes 3 --node-rank "$i" \
      --rdzv "127.0.0.1:$port" --log-every 1 --steps "$STEPS" \
      --ckpt-dir "$WORK/$tag/ck" --ckpt-every 2 --ckpt-sync --save "$WORK/$tag/model" \
      --heartbeat-timeout-s 3 --admission-timeout-s 120 --job-timeout-s 7200 "$@" \
      >"$WORK/$tag/node$i.out" 2>"$WORK/$tag/node$i.err" &
    pids+=($!)
    sleep 0.05
  done
  local rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  return $rc
}

t0=$(date +%s.%N)
ok=yes
job soak --chaos "soak:$N" --chaos-seed "$SEED" --max-restarts "$N" \
  --metrics "$WORK/soak/metrics.jsonl" || ok=no
t1=$(date +%s.%N)
job straight || { echo "the undisturbed job failed" >&2; exit 1; }
log=$WORK/soak/node0.out
same=no
if cmp -s "$WORK/soak/model/model.safetensors" "$WORK/straight/model/model.safetensors" &&
  cmp -s "$WORK/soak/model/flotilla.json" "$WORK/straight/model/flotilla.json"; then
  same=yes
fi
{
  echo "## $(date -u +%FT%TZ) soak:$N seed $SEED, $STEPS steps, $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
  echo "job succeeded on every node: $ok; wall $(echo "$t1 - $t0" | bc) s"
  grep -m1 '# node 0: chaos: soak:' "$log" || true
  for k in kill hang partition slow; do
    echo "$k faults handed out: $(grep -c "^# node 0: chaos: $k@" "$log" || true)"
  done
  echo "struck (workers' own words): kill $(cat "$WORK"/soak/node*.err | grep -c 'chaos: kill@.* strikes' || true)," \
    "hang $(cat "$WORK"/soak/node*.err | grep -c 'chaos: hang@.* strikes' || true)," \
    "partition $(cat "$WORK"/soak/node*.out | grep -c 'partition healed after' || true) healed," \
    "slow $(cat "$WORK"/soak/node*.err | grep -c 'is slow from step' || true)"
  echo "skipped: $(grep -c 'skipped' "$log" || true)"
  grep -E '^# job finished|^# goodput ledger, run|^# goodput beside' "$log" || true
  echo "final model byte-identical to the undisturbed run's: $same"
} | tee -a "$OUT"
[ "$ok" = yes ] && [ "$same" = yes ]
