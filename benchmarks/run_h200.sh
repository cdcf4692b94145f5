#!/usr/bin/env bash
# One GPU session's worth of measurements, in priority order, each step under its own time limit:
# GPU tests, then the training benchmark table for the 3B and 8B shapes, then a Trainer run.
# Usage (on the GPU machine, from the repo root): OUT=out bash benchmarks/run_h200.sh [commit]
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
C=${1:-unknown}
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$PWD
B="python3 benchmarks/bench_train.py --steps 4 --warmup 2 --no-probe --commit $C"
timeout 90 python3 -m pytest -q -m gpu tests/test_engine_gpu.py -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
tail -1 "$OUT/gpu_tests.log"
timeout 170 $B --model llama3-3b --providers slide,resident --batch 16 --offload-batches 16 --timeout 80 --json "$OUT/b3_16.json" 2>&1 | tail -4
timeout 70 $B --model llama3-3b --providers slide --batch 8 --offload-batches 8 --timeout 65 --json "$OUT/b3_8.json" 2>&1 | tail -2
timeout 150 $B --model llama3-8b --providers slide --batch 16 --offload-batches 16 --timeout 145 --json "$OUT/b8_16.json" 2>&1 | tail -2
timeout 120 python3 benchmarks/bench_train.py --steps 2 --warmup 1 --no-probe --commit $C --model llama3-8b --providers slide \
  --batch 1 --offload-batches 1 --cap-gib 8 --timeout 115 --json "$OUT/b8_cap8.json" 2>&1 | tail -2
timeout 110 python3 examples/train_trainer.py --output_dir /tmp/trainer_out --save_strategy no --shape llama-1b \
  --seq_len 2048 --samples 96 --per_device_train_batch_size 8 --max_steps 10 --logging_steps 1 --bf16 \
  --slide_gpu_memory_limit 24 --report_to none --disable_tqdm true > "$OUT/trainer_1b.log" 2>&1
tail -3 "$OUT/trainer_1b.log" | cut -c1-1500
# Update-order comparison (docs/engine.md): the 3B rows again with the other worker orderings
# (JSON under /tmp: the device returns at most 8 files; the table rows are printed).
for order in hybrid forward; do
  for b in 16 8; do
    timeout 75 $B --model llama3-3b --providers slide --batch $b --offload-batches $b --timeout 70 \
      --slide-config "{\"update_order\": \"$order\"}" --json "/tmp/b3_${b}_${order}.json" 2>&1 | tail -1
  done
done
