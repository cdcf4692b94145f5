#!/usr/bin/env bash
# The FP8 measurements of docs/fp8.md and docs/benchmarks.md ("FP8 projections (H200)"), in parts
# that each fit one device call. Usage (on the GPU machine, from the repo root):
#   OUT=out bash benchmarks/experiments/run_fp8_h200.sh PART
#   a: the FP8 GPU tests; one layer's projections in bf16 and FP8 and each quantization kernel alone
#   b: Llama-3.1-8B batch 16 under 24 GiB, slide beside slide_fp8
#   c: Llama-3.1-8B batch 16 under 12 GiB, slide beside slide_fp8
#   d: Llama-3.2-3B batch 16 under 9 GiB, slide beside slide_fp8
#   e: the quality run: a ~1.2B Llama shape, bf16 and FP8, STEPS steps (default 500), same seed and data
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
bench() {   # model cap tag
    python3 benchmarks/bench_train.py --model "$1" --providers slide,slide_fp8 --batch 16 --offload-batches 16 \
        --cap-gib "$2" --steps 3 --warmup 1 --json "$OUT/$3.json" 2>&1 | grep -v '@@bench' | tail -12
}
case "${1:-}" in
    a) python3 -m pytest -q -m gpu tests/test_fp8_gpu.py -p no:cacheprovider -rf 2>&1 | tee "$OUT/gpu.log" | tail -5
       python3 benchmarks/experiments/fp8_layer_probe.py 2>&1 | tee "$OUT/probe.txt" ;;
    b) bench llama3-8b 24 fp8_8b_24 ;;
    c) bench llama3-8b 12 fp8_8b_12 ;;
    d) bench llama3-3b 9 fp8_3b_9 ;;
    e) python3 benchmarks/fp8_quality.py --steps "${STEPS:-500}" --json "$OUT/fp8_quality.json" 2>&1 | tail -70 ;;
    *) echo "usage: OUT=out bash $0 a|b|c|d|e" >&2; exit 2 ;;
esac
