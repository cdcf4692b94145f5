#!/usr/bin/env bash
# The GPU check of the lm_head weight's object (lm_weight.py), the device updates' pending state
# on their placement and the planner in stages: the GPU tests that run the head, the tied
# embedding and the device updates, then the default rows of an older tree (OLD_DIR) and of this
# one side by side, old then new for each row. Two calls, each under 8 minutes:
#
#   OLD_DIR=/path/to/old OUT=out bash benchmarks/experiments/lm_weight_h200.sh a   # GPU tests; 3B batch 16 and 8, 24 GiB
#   OLD_DIR=/path/to/old OUT=out bash benchmarks/experiments/lm_weight_h200.sh b   # 8B batch 16, 12 and 24 GiB
#
# OLD_DIR: the tree to compare against, made where git is (the GPU machine has none), e.g.
#   mkdir -p old && git archive main | tar -x -C old       (then carry it with the checkout)
# ROWS overrides a part's rows (MODEL:BATCH:CAP ...). Logs and JSON under $OUT; a table last:
# each row's tokens/s old and new and their ratio (the change should stay within 2%).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
PART=${1:-a}
export PYTHONUNBUFFERED=1
HERE=$PWD
: "${OLD_DIR:?OLD_DIR: the older tree to compare against (see the header)}"
OLD_DIR=$(cd "$OLD_DIR" && pwd)

row() {    # row TREE LABEL MODEL BATCH CAP
  local tree=$1 label=$2 model=$3 batch=$4 cap=$5 t=150 name
  [ "$model" = llama3-3b ] && t=90
  name="${label}_${model#llama3-}_b${batch}_cap${cap}"
  (cd "$tree" && PYTHONPATH=$tree timeout $t python3 benchmarks/bench_train.py --steps 4 --warmup 2 --no-probe \
    --commit "$label" --model "$model" --providers slide --batch "$batch" --offload-batches "$batch" \
    --cap-gib "$cap" --timeout $((t - 5)) --json "$OUT_ABS/$name.json" > "$OUT_ABS/$name.log" 2>&1)
  echo "$name: $(tail -1 "$OUT_ABS/$name.log")"
}
OUT_ABS=$(cd "$OUT" && pwd)

if [ "$PART" = a ]; then
  PYTHONPATH=$HERE timeout 120 python3 -m pytest -q -m gpu tests/test_engine_gpu.py tests/test_lora.py \
    -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
  echo "GPU tests: $(tail -1 "$OUT/gpu_tests.log")"
  DEFAULT_ROWS="llama3-3b:16:24 llama3-3b:8:24"
else
  DEFAULT_ROWS="llama3-8b:16:12 llama3-8b:16:24"
fi
for r in ${ROWS:-$DEFAULT_ROWS}; do
  IFS=: read -r model batch cap <<< "$r"
  row "$OLD_DIR" old "$model" "$batch" "$cap"
  row "$HERE" new "$model" "$batch" "$cap"
done

python3 - "$OUT_ABS" ${ROWS:-$DEFAULT_ROWS} <<'EOF'
import json, sys
from pathlib import Path
out, rows = Path(sys.argv[1]), sys.argv[2:]

def rate(label, model, batch, cap):
    path = out / f"{label}_{model.removeprefix('llama3-')}_b{batch}_cap{cap}.json"
    try:
        ok = [r for r in json.loads(path.read_text())["results"] if r.get("status") == "ok"]
    except (OSError, ValueError, KeyError):
        return None
    return ok[0].get("tokens_per_s") if ok else None

print(f"\n{'row':24s} {'old tok/s':>10s} {'new tok/s':>10s} {'new/old':>8s}")
for r in rows:
    model, batch, cap = r.split(":")
    old, new = rate("old", model, batch, cap), rate("new", model, batch, cap)
    ratio = f"{new / old:.3f}" if old and new else "-"
    show = lambda v: f"{v:,.0f}" if v else "failed"
    print(f"{model} b{batch} {cap} GiB".ljust(24), f"{show(old):>10s} {show(new):>10s} {ratio:>8s}")
EOF
