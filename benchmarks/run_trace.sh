#!/usr/bin/env bash
# Diagnostic pass: 3B rows with a step timeline each (SLIDE_TRACE), summarized by trace_summary.py.
# Usage (on the GPU machine, from the repo root):
#   OUT=out bash benchmarks/run_trace.sh COMMIT 'BATCH:JSON-SLIDE-CONFIG' ...
# e.g. OUT=out bash benchmarks/run_trace.sh abc123 '8:{}' '8:{"resident_layers": 0}' '16:{}'
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
C=${1:-unknown}; shift
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$PWD
B="python3 benchmarks/bench_train.py --steps 3 --warmup 2 --no-probe --commit $C"
k=0
for spec in "$@"; do
  k=$((k + 1)); b=${spec%%:*}; cfg=${spec#*:}
  SLIDE_TRACE=/tmp/tr_$k.json timeout 80 $B --model ${MODEL:-llama3-3b} --providers slide --batch $b \
    --offload-batches $b --timeout 75 --slide-config "$cfg" --json "/tmp/run_$k.json" > /tmp/run_$k.log 2>&1
  echo "== batch $b $cfg"
  grep -o '"resident_layers": [0-9]*' /tmp/run_$k.log | tail -1
  tail -1 /tmp/run_$k.log | cut -c1-160
  python3 benchmarks/trace_summary.py /tmp/tr_$k.json --gaps 4 | tail -7
  cp /tmp/tr_$k.json "$OUT/" 2>/dev/null
done
