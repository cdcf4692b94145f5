#!/usr/bin/env bash
# What blocks the thread that queues a device layer's update in its backward (docs/host_state.md,
# "Host-bound steps: part of the update on the GPU"), one call per part:
#   OUT=out bash benchmarks/experiments/device_issue_h200.sh probe          # under a minute
#   OUT=out bash benchmarks/experiments/device_issue_h200.sh pieces LOG2    # about 4 minutes
# probe   device_issue_probe.py: the thread's time to queue 1,024 to 8,192 operations on a copy
#         stream behind a wait the GPU has not reached
# pieces  the Mistral-Small-24B trace row (device_share_h200.sh trace 0.5) run from a copy of this
#         tree whose device-update pieces are 2^LOG2 elements (planner/budget.py's DEVICE_PIECE,
#         2^22 here), then its timeline's summary: the device layers' `update_now` time and the
#         GPU's gaps against the tree's own row
# Logs under $OUT; a short summary last.
set -uo pipefail
PART=${1:?usage: OUT=out bash benchmarks/experiments/device_issue_h200.sh probe|pieces LOG2}
OUT=${OUT:-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
case "$PART" in
  probe)
    for n in 1024 2048 4096 8192; do
      python3 benchmarks/experiments/device_issue_probe.py --ops "$n" --sleep-ms 300 | tee -a "$OUT/probe.txt"
    done ;;
  pieces)
    LOG2=${2:?pieces needs LOG2, e.g. 24}
    TREE=$(mktemp -d)
    cp -r hf_slideformer triton_ops benchmarks "$TREE"/
    sed -i "s/^DEVICE_PIECE = 1 << 22$/DEVICE_PIECE = 1 << $LOG2/" "$TREE/hf_slideformer/planner/budget.py"
    grep -q "^DEVICE_PIECE = 1 << $LOG2$" "$TREE/hf_slideformer/planner/budget.py" || { echo "DEVICE_PIECE not found"; exit 2; }
    (cd "$TREE" && PYTHONPATH=$TREE:${PYTHONPATH:-} COMMIT="${COMMIT:-tree}+piece$LOG2" OUT="$OUT/piece$LOG2" \
      bash benchmarks/experiments/device_share_h200.sh trace 0.5)
    grep -E "^step|main.device_update" "$OUT/piece$LOG2/trace/trace_summary.txt" | head -4 ;;
  *) echo "unknown part $PART (probe, pieces)"; exit 2 ;;
esac
