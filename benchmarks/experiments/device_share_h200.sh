#!/usr/bin/env bash
# Device-updated layers without clipping (device_update.py: [Why a layer may be updated on the GPU
# without clipping]) on one GPU machine, each row beside the same run without them in one call
# (docs/host_state.md, "Host-bound steps: part of the update on the GPU"):
#   OUT=out bash benchmarks/experiments/device_share_h200.sh tests|24b|trace|3b [SHARE]
#   tests  the GPU tests of the mode: against plain PyTorch (fp32), under slowed streams (fp32 and
#          adamw_8bit_bf16), a non-finite step skipped on the device, compact formats against the
#          host run (tests/test_engine_gpu.py, tests/test_adam8_torch.py; about 2 minutes)
#   24b    Mistral-Small-24B shape, adamw_8bit_bf16, batch 8 under 24 GiB: device_update_share
#          SHARE (default 0.5) then 0 (about 7 minutes; each run's first step takes about two
#          minutes: the host state is paged in and the device layers' state pinned)
#   trace  the 24b row at SHARE with a step timeline (SLIDE_TRACE), summarized by
#          benchmarks/trace_summary.py: what the backward waits for (about 4 minutes)
#   3b     Llama-3.2-3B, batch 8 under 8 GiB, 8 gradient buffers: fp32 AdamW and adamw_8bit_bf16,
#          each with SHARE (default 0.5) and 0 (about 5 minutes)
#   threads  the 3b adamw_8bit_bf16 row at SHARE (default 0.5) with the worker's threads at
#          THREADS (default "0 12 8": 0 is the default count; "0passive", "8passive" run that count
#          with OMP_WAIT_POLICY=PASSIVE: no OpenMP team spins after its work), each with a step timeline, and
#          the host update's rate alone (benchmarks/host_adam_rate.py) beside them: is the
#          worker slower inside the step than alone, and does a core given back change it
#          (docs/host_state.md; about 4 minutes)
# Each training row first writes the planner's prediction with the share. SHARES="0.5 0.7" runs
# those shares instead of SHARE and 0; EXTRA adds settings to the 24b and trace rows' --slide-config
# (EXTRA=', "grad_buffers": 8'). Full logs and JSON under $OUT; a short table last.
set -uo pipefail
PART=${1:?usage: OUT=out bash benchmarks/experiments/device_share_h200.sh tests|24b|trace|3b [SHARE]}
SHARE=${2:-0.5}
OUT=${OUT:-out}; D="$OUT/$PART"; mkdir -p "$D"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$PWD
C=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
B="python3 benchmarks/bench_train.py --seq 2048 --steps 3 --warmup 2 --no-probe --commit $C"

row() {            # row NAME LIMIT_S SHARE ARGS...: one bench_train run with that share
  local name=$1 limit=$2 share=$3; shift 3
  timeout "$limit" $B "$@" --timeout $((limit - 5)) --slide-config "{\"device_update_share\": $share$EXTRA}" \
    --json "$D/$name.json" > "$D/$name.log" 2>&1
  echo "$name: rc $? $(grep -E '^\| slide' "$D/$name.log" | head -1 | cut -c1-150)"
}

case "$PART" in
  tests)
    timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_engine_gpu.py tests/test_adam8_torch.py \
      -k "device_update or non_finite or fp32_cuda or device_layers" > "$D/gpu_tests.log" 2>&1
    echo "gpu tests: rc $?"; grep -E "^(FAILED|ERROR)" "$D/gpu_tests.log" | cut -c1-200 | head -20
    tail -1 "$D/gpu_tests.log"; exit 0 ;;
  24b)
    EXTRA=${EXTRA:-}
    python3 -m hf_slideformer.cli plan benchmarks/configs/mistral-small-24b.json --batch 8 --gpu-mem 24 \
      --host-mem 125 --optim adamw_8bit_bf16 --device-update-share "$SHARE" > "$D/plan.txt" 2>&1
    for s in ${SHARES:-$SHARE 0.0}; do
      row "share_$s" 235 "$s" --model mistral-small-24b --providers slide_8bit_bf16 --batch 8 --offload-batches 8 --cap-gib 24
    done ;;
  trace)
    EXTRA=${EXTRA:-}
    export SLIDE_TRACE="$D/trace.json"
    row "trace_$SHARE" 235 "$SHARE" --model mistral-small-24b --providers slide_8bit_bf16 --batch 8 --offload-batches 8 \
      --cap-gib 24
    unset SLIDE_TRACE
    python3 benchmarks/trace_summary.py "$D/trace.json" --gaps 8 > "$D/trace_summary.txt" 2>&1
    tail -25 "$D/trace_summary.txt" ;;
  3b)
    EXTRA=', "grad_buffers": 8'
    for p in slide slide_8bit_bf16; do
      optim=$([ $p = slide ] && echo adamw || echo adamw_8bit_bf16)
      python3 -m hf_slideformer.cli plan benchmarks/configs/llama3-3b.json --batch 8 --gpu-mem 8 --host-mem 125 \
        --grad-buffers 8 --optim $optim --device-update-share "$SHARE" > "$D/plan_$p.txt" 2>&1
      for s in ${SHARES:-$SHARE 0.0}; do
        row "${p}_$s" 120 "$s" --model llama3-3b --providers $p --batch 8 --offload-batches 8 --cap-gib 8
      done
    done ;;
  threads)
    lscpu | grep -E "^(Model name|Thread|Core|Socket|CPU\(s\))" | tee "$D/lscpu.txt"; grep -o -w -E "avx512(f|bw|vbmi)" /proc/cpuinfo | sort -u | tee -a "$D/lscpu.txt"
    timeout 120 python3 benchmarks/host_adam_rate.py > "$D/host_rate.txt" 2>&1; tail -8 "$D/host_rate.txt"
    for t in ${THREADS:-0 12 8}; do
      n=${t%passive}
      extra=$([ "${n:-0}" = 0 ] && echo ', "grad_buffers": 8' || echo ", \"grad_buffers\": 8, \"cpu_threads\": $n")
      args=(--model llama3-3b --providers slide_8bit_bf16 --batch 8 --offload-batches 8 --cap-gib 8)
      if [ "$n" != "$t" ]; then
        OMP_WAIT_POLICY=PASSIVE EXTRA=$extra SLIDE_TRACE="$D/trace_t$t.json" row "threads_$t" 120 "$SHARE" "${args[@]}"
      else
        EXTRA=$extra SLIDE_TRACE="$D/trace_t$t.json" row "threads_$t" 120 "$SHARE" "${args[@]}"
      fi
      python3 benchmarks/trace_summary.py "$D/trace_t$t.json" --gaps 4 2>&1 | sed -n 7,14p | cut -c1-220
    done ;;
  *) echo "unknown part $PART (tests, 24b, trace, 3b, threads)"; exit 2 ;;
esac

python3 - "$D" <<'PY'
import json, sys
from pathlib import Path

print(f"{'row':24} {'tokens/s':>9} {'step s':>7} {'cpu_adam s':>10} {'gpu s':>6} {'device layers':>13}")
for f in sorted(Path(sys.argv[1]).glob("*.json")):
    data = json.loads(f.read_text())
    for r in data.get("results", []) if isinstance(data, dict) else []:      # not a row: a step trace
        if r.get("status") != "ok":
            print(f"{f.stem:24} {r.get('status')}")
            continue
        per = r.get("extra", {}).get("slide_stats_per_step", {})
        dev = r.get("extra", {}).get("slide_stats", {}).get("device_updated_layers", "-")
        print(f"{f.stem:24} {r.get('tokens_per_s', 0):9,.0f} {r.get('step_s', 0):7.3f} {per.get('cpu_adam_s', 0):10.3f} "
              f"{per.get('gpu_compute_s', 0):6.3f} {dev!s:>13}")
PY
