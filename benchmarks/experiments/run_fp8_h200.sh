#!/usr/bin/env bash
# The FP8 measurements of docs/fp8.md and docs/benchmarks.md ("FP8 projections (H200)"), in parts
# that each fit one device call. Usage (on the GPU machine, from the repo root):
#   OUT=out bash benchmarks/experiments/run_fp8_h200.sh PART
#   PARTS="e f" ROWS=8b24 TESTS=0 OUT=out bash benchmarks/experiments/run_fp8_h200.sh   # several, in order
#   a: the FP8 GPU tests; one layer's projections in bf16 and FP8 and each quantization kernel alone
#   b: Llama-3.1-8B batch 16 under 24 GiB, slide beside slide_fp8
#   c: Llama-3.1-8B batch 16 under 12 GiB, slide beside slide_fp8
#   d: Llama-3.2-3B batch 16 under 9 GiB, slide beside slide_fp8
#   e: the quality run (benchmarks/fp8_quality.py): a 0.76B Llama shape, bf16 and FP8, STEPS steps
#      (default 500) of 8 x 256 tokens of new text of the bundled corpus's grammar (never a window
#      twice; STREAM=corpus: the corpus's train split, which the model memorizes), same seed and
#      data, the train and held-out losses every 20 steps, within QUALITY_S seconds (default 180:
#      both arms then cover the steps the bf16 arm made in half of it: 500 steps take ~75 s an arm,
#      ~150 s for two, the build the rest); CONTROL=1 adds a bf16 arm from the weights' last bits
#      flipped, bf16's own noise beside FP8's gap: ~75 s more, and since the bf16 arm then stops at
#      a third of QUALITY_S, QUALITY_S=270 keeps 500 steps; $OUT/fp8_quality.json, from which
#      `python3 benchmarks/fp8_quality_plot.py fp8_quality.json docs/fp8_quality.svg` draws the figure;
#      RECIPES=fp8,fp8_gw_hp adds an arm per further recipe (~75 s each; the bf16 arm stops at
#      QUALITY_S over the arms: QUALITY_S=270 for three); TORCHAO=1 adds the GPU-resident bf16 arm
#      and torchao's own rowwise recipe beside it (`--torchao`: the reference recipe's gap on the
#      same run; torchao travels as a wheel: `python3 -m pip download --no-deps --only-binary=:all:
#      --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 -d .whl torchao`)
#      SEEDS="0 1 2" runs the whole part once per seed (other weights, other text; QUALITY_S is each
#      seed's) and then judges the seed-mean curves (benchmarks/fp8_quality_seeds.py: a single
#      run's gap in the steep fall is mostly the run's own divergence); SEEDS="0 1 2" QUALITY_S=170
#      fits one call
#   f: the FP8 GPU tests (TESTS=0 leaves them out), then slide_fp8 beside slide (3 timed steps,
#      1 warm-up, --no-probe) for 8B batch 16 under 12 GiB, 3B batch 16 under 9 GiB and 8B batch 16
#      under 24 GiB, in that order (ROWS picks others: 8b12 3b9 8b24), after the matmuls' rate in both
#      modes (benchmarks/experiments/step_kernels.py: the 8B layer shape, 2 sliding layers, an
#      8,192-token head, one profiled step each, at most 120 s; KERNELS=0 leaves it out); rows are cut at BUDGET
#      seconds from the script's start (default 575), the FP8 provider first; fp8_table.py's table
#      and the kernels' last
# Time limits: e QUALITY_S + 60 s (it ends near QUALITY_S; CONTROL=1 QUALITY_S=270 fits one call);
# f's tests 150 s, an 8B row 225 s, the 3B row 155 s, the kernels 120 s (expected under 60 s). PARTS="e f" ROWS=8b24 TESTS=0 BUDGET=480 stays
# under 8 minutes: a row that would pass BUDGET is cut, its FP8 provider first.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
SECONDS=0
bench() {   # model cap tag
    python3 benchmarks/bench_train.py --model "$1" --providers slide,slide_fp8 --batch 16 --offload-batches 16 \
        --cap-gib "$2" --steps 3 --warmup 1 --json "$OUT/$3.json" 2>&1 | grep -v '@@bench' | tail -12
}
left() { echo $(( ${BUDGET:-575} - SECONDS )); }
pair() {   # tag model cap seconds-per-provider: slide_fp8 first, then slide, in one bench_train call
    local left need=$(( 2 * $4 + 15 ))
    left=$(left)
    if [ $(( $4 + 15 )) -gt "$left" ]; then echo "$1: skipped (its FP8 row needs $(( $4 + 15 )) s, ${left} s left)"; return; fi
    [ "$need" -gt "$left" ] && need=$left       # the FP8 row first: a row cut short keeps it
    timeout "$need" python3 benchmarks/bench_train.py --model "$2" --providers slide_fp8,slide --batch 16 \
        --offload-batches 16 --cap-gib "$3" --steps 3 --warmup 1 --no-probe --timeout "$4" \
        --json "$OUT/$1.json" > "$OUT/$1.log" 2>&1
    echo "$1: exit $? after $SECONDS s"; python3 benchmarks/row_summary.py "$OUT/$1.json" 2>&1 | sed 's/^/   /'
}
kernels() {   # the matmuls' rate per mode: the 8B layer shape, one profiled step each
    local left; left=$(left)
    if [ 60 -gt "$left" ]; then echo "kernels: skipped (60 s needed, ${left} s left)"; return; fi
    [ "$left" -gt 120 ] && left=120
    timeout "$left" python3 benchmarks/experiments/step_kernels.py --model llama3-8b --layers 2 --vocab 8192 \
        --batch 16 --cap-gib 24 --slide-config '{"resident_layers": 0}' --matmuls dtype,fp8 --top 40 --json "$OUT/fp8_kernels.json" > "$OUT/fp8_kernels.log" 2>&1
    local rc=$?; echo "kernels: exit $rc after $SECONDS s"; [ "$rc" = 0 ] || tail -15 "$OUT/fp8_kernels.log"
}
part_f() {
    if [ "${TESTS:-1}" != 0 ]; then
        timeout 150 python3 -m pytest -q -m gpu tests/test_fp8_gpu.py -p no:cacheprovider -rf > "$OUT/gpu.log" 2>&1
        echo "gpu tests: $(tail -1 "$OUT/gpu.log") after $SECONDS s"; grep -E "^FAILED" "$OUT/gpu.log" | head -5
    fi
    [ "${KERNELS:-1}" != 0 ] && kernels        # short and bounded: before the rows, which BUDGET cuts
    local files=() row
    for row in ${ROWS:-8b12 3b9 8b24}; do
        case $row in
            8b12) pair fp8_8b_12 llama3-8b 12 105 ;;
            3b9) pair fp8_3b_9 llama3-3b 9 70 ;;
            8b24) pair fp8_8b_24 llama3-8b 24 105 ;;
            *) echo "unknown row $row (8b12, 3b9, 8b24)"; continue ;;
        esac
        [ -f "$OUT/fp8_${row:0:2}_${row:2}.json" ] && files+=("$OUT/fp8_${row:0:2}_${row:2}.json")
    done
    python3 benchmarks/experiments/fp8_table.py "${files[@]}"
    [ -f "$OUT/fp8_kernels.log" ] && sed -n '/^| matmuls/,$p' "$OUT/fp8_kernels.log"
}
quality() {   # seed suffix: one fp8_quality.py run, its table
    timeout $(( ${QUALITY_S:-180} + 60 )) python3 benchmarks/fp8_quality.py --steps "${STEPS:-500}" --seed "$1" \
        --train-stream "${STREAM:-grammar}" ${CONTROL:+--control} --recipes "${RECIPES:-fp8}" ${TORCHAO:+--torchao} \
        --max-seconds "${QUALITY_S:-180}" --json "$OUT/fp8_quality$2.json" > "$OUT/fp8_quality$2.log" 2>&1
    local rc=$?; echo "quality (seed $1): exit $rc after $SECONDS s"
    if [ "$rc" = 0 ]; then grep -h '^grammar:' "$OUT/fp8_quality$2.log"; sed -n '/^ step/,$p' "$OUT/fp8_quality$2.log"
    else tail -20 "$OUT/fp8_quality$2.log"; fi
}
for part in ${PARTS:-${1:-}}; do
    case "$part" in
        a) python3 -m pytest -q -m gpu tests/test_fp8_gpu.py -p no:cacheprovider -rf 2>&1 | tee "$OUT/gpu.log" | tail -5
           python3 benchmarks/experiments/fp8_layer_probe.py 2>&1 | tee "$OUT/probe.txt" ;;
        b) bench llama3-8b 24 fp8_8b_24 ;;
        c) bench llama3-8b 12 fp8_8b_12 ;;
        d) bench llama3-3b 9 fp8_3b_9 ;;
        e) if [ -n "${SEEDS:-}" ]; then
               for seed in $SEEDS; do quality "$seed" "_s$seed"; done
               python3 benchmarks/fp8_quality_seeds.py $(for seed in $SEEDS; do echo "$OUT/fp8_quality_s$seed.json"; done) \
                   --json "$OUT/fp8_quality_seeds.json" 2>&1 | tee "$OUT/fp8_quality_seeds.log"
           else
               quality "${SEED:-0}" ""
           fi ;;
        f) part_f ;;
        *) echo "usage: OUT=out bash $0 a|b|c|d|e|f, or PARTS=\"e f\" for several" >&2; exit 2 ;;
    esac
done
[ -n "${PARTS:-${1:-}}" ] || { echo "usage: OUT=out bash $0 a|b|c|d|e|f, or PARTS=\"e f\" for several" >&2; exit 2; }
