#!/usr/bin/env bash
# Same-run comparison of Flotilla's model engine with PyTorch on this machine:
#   - f32 GEMM GFLOP/s at 1024^3 and 2048^3 (torch.mm vs `flotilla bench model`'s GEMM),
#   - single-process training tokens/s for the peer benchmark's tiny and small
#     configs (../shared/peers/ddp_gpt_bench.py --modes single vs `flotilla bench model`).
# Usage: scripts/bench-model-vs-peers.sh [THREADS] [OUTFILE]
# Needs a Python with torch: PEER_PY (default /root/.cache/flotilla-peers/venv/bin/python).
set -euo pipefail
THREADS=${1:-2}
OUT=${2:-/dev/stdout}
ROUNDS=${ROUNDS:-3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PEERS=${PEERS:-$ROOT/../shared/peers}
PY=${PEER_PY:-/root/.cache/flotilla-peers/venv/bin/python}
BIN=${FLOTILLA_BIN:-$ROOT/target/release/flotilla}
[ -x "$BIN" ] || (cd "$ROOT" && cargo build --release -p flotilla)
{
echo "## $(date -u +%FT%TZ) $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
echo "### GEMM f32, $THREADS threads: $ROUNDS interleaved rounds (torch.mm, then flotilla), median of 20 each"
for r in $(seq "$ROUNDS"); do
"$PY" - "$THREADS" <<'PYEOF'
import statistics, sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
for n in (1024, 2048):
    a, b, c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
    for _ in range(3): torch.mm(a, b, out=c)
    ts = []
    for _ in range(20):
        t = time.perf_counter(); torch.mm(a, b, out=c); ts.append(time.perf_counter() - t)
    print(f"torch.mm {n}^3: {2*n**3/statistics.median(ts)/1e9:.1f} GFLOP/s")
PYEOF
"$BIN" bench model --config tiny --threads "$THREADS" --steps 1 --untimed 0 | grep '^# gemm'
done
for cfg in tiny small; do
  echo "### training, config $cfg, 1 process x $THREADS threads"
  "$PY" "$PEERS/ddp_gpt_bench.py" --config "$cfg" --modes single --single-threads "$THREADS" --warmup 3 --steps 10 | grep -E '^(# matmul|config|'"$cfg"')'
  "$BIN" bench model --config "$cfg" --threads "$THREADS" --untimed 3 --steps 10 --gemm 2048 | grep -E '^(config|'"$cfg"')' | sed 's/^/flotilla /'
done
} | tee -a "$OUT"
