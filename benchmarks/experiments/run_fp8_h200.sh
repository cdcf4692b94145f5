#!/usr/bin/env bash
# The FP8 measurements of docs/fp8.md and docs/benchmarks.md ("FP8 projections (H200)"), in parts
# that each fit one device call. Usage (on the GPU machine, from the repo root):
#   OUT=out bash benchmarks/experiments/run_fp8_h200.sh PART
#   a: the FP8 GPU tests; one layer's projections in bf16 and FP8 and each quantization kernel alone
#   b: Llama-3.1-8B batch 16 under 24 GiB, slide beside slide_fp8
#   c: Llama-3.1-8B batch 16 under 12 GiB, slide beside slide_fp8
#   d: Llama-3.2-3B batch 16 under 9 GiB, slide beside slide_fp8
#   e: the quality run: a ~1.1B Llama shape, bf16 and FP8, STEPS steps (default 500), same seed and
#      data, within QUALITY_S seconds (default 280; both arms then cover the steps the bf16 arm made);
#      the curves as $OUT/fp8_quality.svg (docs/fp8_quality.svg in docs/benchmarks.md)
#   f: the FP8 GPU tests, then slide_fp8 beside slide (3 timed steps, 1 warm-up, --no-probe) for
#      8B batch 16 under 12 GiB, 3B batch 16 under 9 GiB and 8B batch 16 under 24 GiB, in that order
#      (ROWS picks others: 8b12 3b9 8b24), the whole within BUDGET seconds (default 575: a row
#      is cut at it, its FP8 provider first); benchmarks/experiments/fp8_table.py's table last
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
bench() {   # model cap tag
    python3 benchmarks/bench_train.py --model "$1" --providers slide,slide_fp8 --batch 16 --offload-batches 16 \
        --cap-gib "$2" --steps 3 --warmup 1 --json "$OUT/$3.json" 2>&1 | grep -v '@@bench' | tail -12
}
pair() {   # tag model cap seconds-per-provider: slide_fp8 first, then slide, in one bench_train call
    local left=$(( ${BUDGET:-575} - SECONDS )) need=$(( 2 * $4 + 15 ))
    if [ $(( $4 + 15 )) -gt "$left" ]; then echo "$1: skipped (its FP8 row needs $(( $4 + 15 )) s, ${left} s left)"; return; fi
    [ "$need" -gt "$left" ] && need=$left       # the FP8 row first: a row cut short keeps it
    timeout "$need" python3 benchmarks/bench_train.py --model "$2" --providers slide_fp8,slide --batch 16 \
        --offload-batches 16 --cap-gib "$3" --steps 3 --warmup 1 --no-probe --timeout "$4" \
        --json "$OUT/$1.json" > "$OUT/$1.log" 2>&1
    echo "$1: exit $? after $SECONDS s"; python3 benchmarks/row_summary.py "$OUT/$1.json" 2>&1 | sed 's/^/   /'
}
case "${1:-}" in
    a) python3 -m pytest -q -m gpu tests/test_fp8_gpu.py -p no:cacheprovider -rf 2>&1 | tee "$OUT/gpu.log" | tail -5
       python3 benchmarks/experiments/fp8_layer_probe.py 2>&1 | tee "$OUT/probe.txt" ;;
    b) bench llama3-8b 24 fp8_8b_24 ;;
    c) bench llama3-8b 12 fp8_8b_12 ;;
    d) bench llama3-3b 9 fp8_3b_9 ;;
    e) timeout 330 python3 benchmarks/fp8_quality.py --steps "${STEPS:-500}" --max-seconds "${QUALITY_S:-280}" \
           --log-every 25 --json "$OUT/fp8_quality.json" --svg "$OUT/fp8_quality.svg" 2>&1 | tail -30 ;;
    f) SECONDS=0
       timeout 150 python3 -m pytest -q -m gpu tests/test_fp8_gpu.py -p no:cacheprovider -rf > "$OUT/gpu.log" 2>&1
       echo "gpu tests: $(tail -1 "$OUT/gpu.log") after $SECONDS s"; grep -E "^FAILED" "$OUT/gpu.log" | head -5
       files=()
       for row in ${ROWS:-8b12 3b9 8b24}; do
           case $row in
               8b12) pair fp8_8b_12 llama3-8b 12 105 ;;
               3b9) pair fp8_3b_9 llama3-3b 9 70 ;;
               8b24) pair fp8_8b_24 llama3-8b 24 105 ;;
               *) echo "unknown row $row (8b12, 3b9, 8b24)"; continue ;;
           esac
           [ -f "$OUT/fp8_${row:0:2}_${row:2}.json" ] && files+=("$OUT/fp8_${row:0:2}_${row:2}.json")
       done
       python3 benchmarks/experiments/fp8_table.py "${files[@]}" ;;
    *) echo "usage: OUT=out bash $0 a|b|c|d|e|f" >&2; exit 2 ;;
esac
