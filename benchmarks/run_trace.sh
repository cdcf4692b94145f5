#!/usr/bin/env bash
# Diagnostic pass: the 3B rows with a step timeline each (SLIDE_TRACE), summarized by trace_summary.py.
# Usage (on the GPU machine, from the repo root): OUT=out bash benchmarks/run_trace.sh [commit] [orders]
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
C=${1:-unknown}; ORDERS=${2:-"arrival hybrid"}
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$PWD
B="python3 benchmarks/bench_train.py --steps 3 --warmup 2 --no-probe --commit $C"
for b in 8 16; do
  for order in $ORDERS; do
    SLIDE_TRACE=/tmp/tr_${b}_${order}.json timeout 75 $B --model llama3-3b --providers slide --batch $b \
      --offload-batches $b --timeout 70 --slide-config "{\"update_order\": \"$order\"}" \
      --json "/tmp/b3_${b}_${order}.json" 2>&1 | tail -1
    echo "== 3B batch $b order $order"
    python3 benchmarks/trace_summary.py /tmp/tr_${b}_${order}.json --gaps 6 | tail -9
    cp /tmp/tr_${b}_${order}.json "$OUT/" 2>/dev/null
  done
done
