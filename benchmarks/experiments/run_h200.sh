#!/usr/bin/env bash
# The GPU measurements of docs/benchmarks.md, in parts that each fit one 10-minute device call.
# Usage (on the GPU machine, from the repo root): OUT=out bash benchmarks/experiments/run_h200.sh COMMIT [a|b|c|d|e|f|g]
#   a: GPU tests; 3B batch 16 slide vs DeepSpeed ZeRO-2 (capped, best batch; DS=0 skips it); 3B batch 8; 8B batch 16
#   b: the 3B GPU-resident bound (RES_PROVIDERS=resident,hf adds HF); 8B batch 1 under 8 GiB; 200-step
#      soak + clipping timing; the kernel table with KERNELS=1
#   c: GPU tests; the 3B rows at batch 16 and 8 with a step trace each (the quick check after a change)
#   e: 8B batch 16 with a step trace; 8B batch 1 under an 8 GiB cap; 200-step soak + clipping timing
#   f: 8B batch 16 with a step trace, then with update_order "hybrid"; 3B batch sweep 16..8
#   g: GPU tests; 8B batch 16 traced; Qwen2.5-7B batch 16; ZeRO-3 on the 3B shape (at most 8 files under $OUT)
#   h: GPU tests; 8B batch 16 traced; 3B batch 16 traced (the check after an engine change)
#   i: 3B batch 16 with clipping (max_grad_norm 1.0: deferred updates); 3B batch 8; Qwen2.5-7B batch 16
#   j: GPU tests; 8B batch 1 under 8 GiB; 200-step soak + clipping timing; 3B batch 16 with clipping, traced
#   k: GPU tests; 3B batch 16 with clipping, traced; 3B batch 16, traced (the check after a clipping-mode change)
#   l: GPU tests; 3B batch 16 x 2 micro-batches with clipping: all updates on the CPU, then device updates
#   m: GPU tests; 8B batch 16 traced, then with grad_buffers 3 (host memory); 3B batch 16 traced
#   n: GPU tests; 8B batch 16 traced; 3B batch 16 and 8 (the defaults' check)
#   o: the CPU AdamW rate; 8B batch 16 with 3 and with 4 gradient buffers
#   p: the CPU AdamW rate; 3B batch 8 with 3 and with 4 gradient buffers; 3B batch 16 with clipping
#   q: 3B batch 16 with clipping (untraced; the short check)
#   s: GPU tests; 8B batch 16 (the defaults); 8B batch 1 under 8 GiB; 200-step soak + clipping timing
#   t: the 8B step's GPU memory phase by phase (allocated against reserved), with an allocator snapshot
#   r: GPU tests; 8B batch 16 traced (the head updated on the GPU), then with head_update "cpu"; 3B batch 16
#   d: 3B batch sweep (16..6) in one process: the smallest batch at 90% of the best tokens/s
#   u: GPU tests; the host AdamW rate against torch's and the triad bound; 8B batch 16 under 12 and
#      16 GiB; 3B batch 16 under 9 GiB (the small-card rows; ROWS overrides the list, see `row`)
#   v: 8B batch 16 under 24 GiB; 3B batch 16 and 8 under 24 GiB; then the small-card rows of OLD (a
#      commit, run from a git worktree of it) beside them
#   w: GPU tests; 8B batch 16 under 12 GiB from OLD_DIR (a tree made here with `git archive`, the
#      machine has no .git) and from this tree, traced; W_ROWS (as ROWS) old and new side by side;
#      then the allocator's phases of this tree (MEM=0 skips them); RATE=1: host_adam_rate.py alone
#      and beside a busy process, with OLD_DIR's kernel and this tree's
#   x: rows at several late_layer_updates (ROWS: MODEL:BATCH:CAP:LATE ...)
#   y: rows of OLD_DIR (as in w) and of this tree side by side, nothing else (ROWS: MODEL:BATCH:CAP ...)
# Each `row` prints benchmarks/row_summary.py's line after the table's: per timed step, where the time went.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
C=${1:-unknown}; PART=${2:-a}
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$PWD
B="python3 benchmarks/bench_train.py --steps 4 --warmup 2 --no-probe --commit $C"
summ() { python3 benchmarks/trace_summary.py "$1" --gaps 3 | sed -n '4,9p'; }
# 8B batch 16: $1 = directory of its log; $2 = 1 for a step trace ($OUT/tr_8b16.json)
# $3 (optional): a SlideConfig JSON and a name suffix for the log ($4)
b8_16() {
  local logdir=$1 traced=$2 cfg=${3:-"{}"} name=b8_16${4:-}
  if [ "$traced" = 1 ]; then export SLIDE_TRACE=$OUT/tr_8b16.json; fi
  timeout 150 $B --model llama3-8b --providers slide --batch 16 --offload-batches 16 --timeout 145 \
    --slide-config "$cfg" --json "$logdir/$name.json" > "$logdir/$name.log" 2>&1
  unset SLIDE_TRACE
  tail -1 "$logdir/$name.log"; if [ "$traced" = 1 ]; then summ "$OUT/tr_8b16.json"; fi
  grep -o '"host_rss_end": [0-9]*\|"resident_layers": [0-9]*\|"resident_embedding": [a-z]*' "$logdir/$name.log" | tail -3
}
# 8B batch 1 under an 8 GiB cap, then the 200-step soak with the clipping comparison
cap8_and_soak() {
  timeout 100 python3 benchmarks/bench_train.py --steps 2 --warmup 1 --no-probe --commit $C --model llama3-8b \
    --providers slide --batch 1 --offload-batches 1 --cap-gib 8 --timeout 95 --json "$OUT/b8_cap8.json" \
    > "$OUT/b8_cap8.log" 2>&1
  tail -1 "$OUT/b8_cap8.log"
  timeout 100 python3 benchmarks/soak.py --model llama3-3b --layers 4 --batch 2 --seq 2048 --steps 200 \
    --compare-clipping 20 --json "$OUT/soak.json" 2>&1 | tail -22
}
# One row: row MODEL BATCH CAP_GIB NAME [SlideConfig JSON]; run from $ROOT (default: here).
row() {
  local t=150; [ "$1" = llama3-3b ] && t=90
  (cd "${ROOT:-.}" && timeout $t python3 benchmarks/bench_train.py --steps 4 --warmup 2 --no-probe --commit $C \
    --model "$1" --providers slide --batch "$2" --offload-batches "$2" --cap-gib "$3" --timeout $((t - 5)) \
    --slide-config "${5:-{\}}" --json "$OUT/$4.json" > "$OUT/$4.log" 2>&1)
  echo "$4: $(tail -1 "$OUT/$4.log")"
  python3 benchmarks/row_summary.py "$OUT/$4.json" 2>&1 | sed 's/^/   /'
}
if [ "$PART" = w ]; then
  timeout 130 python3 -m pytest -q -m gpu tests -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
  tail -1 "$OUT/gpu_tests.log"
  if [ -n "${OLD_DIR:-}" ]; then
    SLIDE_TRACE=$OUT/tr_old.json ROOT="$OLD_DIR" C=old row llama3-8b 16 12 old_8b_b16_cap12
  fi
  SLIDE_TRACE=$OUT/tr_new.json row llama3-8b 16 12 8b_b16_cap12
  for t in old new; do [ -f "$OUT/tr_$t.json" ] && { echo "== $t"; summ "$OUT/tr_$t.json"; }; done
  grep -ho '"gpu_alloc_retries": [0-9]*' "$OUT"/*8b_b16_cap12.json
  for r in ${W_ROWS:-}; do
    IFS=: read -r m b cap <<< "$r"; n="${m#llama3-}_b${b}_cap${cap}"
    [ -n "${OLD_DIR:-}" ] && ROOT="$OLD_DIR" C=old row "$m" "$b" "$cap" "old_$n"
    row "$m" "$b" "$cap" "$n"
  done
  [ "${MEM:-1}" = 0 ] || timeout 100 python3 benchmarks/memory_profile.py --model llama3-8b --batch 16 --seq 2048 --cap-gib 12 --steps 3 \
    --json "$OUT/mem12.json" > "$OUT/mem12.log" 2>&1
  [ "${MEM:-1}" = 0 ] || tail -4 "$OUT/mem12.log"
  if [ "${RATE:-0}" = 1 ]; then          # the host AdamW alone and beside a busy core, old kernel then this one
    [ -n "${OLD_DIR:-}" ] && cp benchmarks/host_adam_rate.py "$OLD_DIR/benchmarks/"
    for t in ${OLD_DIR:-} .; do for b in 0 1; do
      echo "== $t, $b busy: $(cd "$t" && timeout 120 python3 benchmarks/host_adam_rate.py --busy $b 2>&1 \
        | grep -E '^STREAM|^native, bf16 grad  ' | tr -s ' ' | tr '\n' ' ')"
    done; done
  fi
elif [ "$PART" = y ]; then
  for r in ${ROWS:-llama3-3b:16:24 llama3-8b:16:24}; do
    IFS=: read -r m b cap <<< "$r"; n="${m#llama3-}_b${b}_cap${cap}"
    [ -n "${OLD_DIR:-}" ] && ROOT="$OLD_DIR" C=old row "$m" "$b" "$cap" "old_$n"
    row "$m" "$b" "$cap" "$n"
  done
elif [ "$PART" = x ]; then
  for r in ${ROWS:-llama3-8b:16:12:auto llama3-8b:16:12:6 llama3-8b:16:12:9}; do
    IFS=: read -r m b cap late <<< "$r"
    row "$m" "$b" "$cap" "${m#llama3-}_b${b}_cap${cap}_late$late" "{\"late_layer_updates\": \"$late\"}"
  done
elif [ "$PART" = u ]; then
  timeout 120 python3 -m pytest -q -m gpu tests/test_engine_gpu.py -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
  tail -1 "$OUT/gpu_tests.log"
  timeout 60 python3 -m pytest -q tests/test_host_adam.py -p no:cacheprovider 2>&1 | tail -1
  timeout 100 python3 benchmarks/host_adam_rate.py --json "$OUT/adam_rate.json" 2>&1 | tail -8
  for r in ${ROWS:-llama3-8b:16:12 llama3-8b:16:16 llama3-3b:16:9}; do
    IFS=: read -r m b cap <<< "$r"; row "$m" "$b" "$cap" "${m#llama3-}_b${b}_cap${cap}"
  done
elif [ "$PART" = v ]; then
  for r in ${ROWS:-llama3-8b:16:24 llama3-3b:16:24 llama3-3b:8:24}; do
    IFS=: read -r m b cap <<< "$r"; row "$m" "$b" "$cap" "${m#llama3-}_b${b}_cap${cap}"
  done
  if [ -n "${OLD:-}" ]; then
    git worktree add -f /tmp/old "$OLD" > /dev/null 2>&1
    for r in ${OLD_ROWS:-llama3-8b:16:12 llama3-3b:16:9}; do
      IFS=: read -r m b cap <<< "$r"; ROOT=/tmp/old C=$OLD row "$m" "$b" "$cap" "old_${m#llama3-}_b${b}_cap${cap}"
    done
  fi
elif [ "$PART" = a ]; then
  timeout 100 python3 -m pytest -q -m gpu tests/test_engine_gpu.py -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
  tail -1 "$OUT/gpu_tests.log"
  SLIDE_TRACE=$OUT/tr_3b16.json timeout 80 $B --model llama3-3b --providers slide --batch 16 \
    --offload-batches 16 --timeout 75 --json "$OUT/b3_16.json" > "$OUT/b3_16.log" 2>&1
  tail -1 "$OUT/b3_16.log"; summ "$OUT/tr_3b16.json"
  # ZeRO-2 runs out of memory under the cap at batch 16, 8 and 4 (measured): its best is below.
  [ "${DS:-1}" = 0 ] || timeout 200 $B --model llama3-3b --providers ds2 --batch 2 --offload-batches ${DS_BATCHES:-2,1} --timeout 190 \
    --json "$OUT/b3_ds2.json" > "$OUT/b3_ds2.log" 2>&1
  [ "${DS:-1}" = 0 ] || tail -1 "$OUT/b3_ds2.log"
  SLIDE_TRACE=$OUT/tr_3b8.json timeout 75 $B --model llama3-3b --providers slide --batch 8 --offload-batches 8 \
    --timeout 70 --json "$OUT/b3_8.json" > "$OUT/b3_8.log" 2>&1
  tail -1 "$OUT/b3_8.log"; summ "$OUT/tr_3b8.json"
  b8_16 "$OUT" 0
elif [ "$PART" = e ]; then
  b8_16 "$OUT" 1
  cap8_and_soak
elif [ "$PART" = f ]; then
  b8_16 "$OUT" 1
  timeout 145 $B --model llama3-8b --providers slide --batch 16 --offload-batches 16 --timeout 140 \
    --slide-config '{"update_order":"hybrid"}' --json "$OUT/b8_16h.json" > "$OUT/b8_16h.log" 2>&1
  tail -1 "$OUT/b8_16h.log"
  timeout 150 python3 benchmarks/batch_sweep.py --model llama3-3b --batches 16,12,10,8 --json "$OUT/sweep.json" \
    2>&1 | tail -7
elif [ "$PART" = g ]; then
  timeout 60 python3 -m pytest -q -m gpu tests/test_engine_gpu.py -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
  tail -1 "$OUT/gpu_tests.log"
  b8_16 /tmp 1
  timeout 145 $B --model qwen2.5-7b --providers slide --batch 16 --offload-batches 16 --timeout 140 \
    --json "$OUT/q7_16.json" > /tmp/q7_16.log 2>&1
  tail -1 /tmp/q7_16.log
  timeout 200 $B --model llama3-3b --providers ds3 --batch 4 --offload-batches ${DS_BATCHES:-4,2,1} --timeout 190 \
    --json "$OUT/b3_ds3.json" > /tmp/b3_ds3.log 2>&1
  tail -1 /tmp/b3_ds3.log
elif [ "$PART" = h ]; then
  timeout 70 python3 -m pytest -q -m gpu tests/test_engine_gpu.py -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
  tail -3 "$OUT/gpu_tests.log"
  b8_16 "$OUT" 1
  SLIDE_TRACE=$OUT/tr_3b16.json timeout 80 $B --model llama3-3b --providers slide --batch 16 \
    --offload-batches 16 --timeout 75 --json "$OUT/b3_16.json" > "$OUT/b3_16.log" 2>&1
  tail -1 "$OUT/b3_16.log"; summ "$OUT/tr_3b16.json"
elif [ "$PART" = i ]; then
  timeout 80 $B --model llama3-3b --providers slide --batch 16 --offload-batches 16 --timeout 75 \
    --slide-config '{"max_grad_norm": 1.0}' --json "$OUT/b3_16clip.json" > "$OUT/b3_16clip.log" 2>&1
  tail -1 "$OUT/b3_16clip.log"
  timeout 75 $B --model llama3-3b --providers slide --batch 8 --offload-batches 8 --timeout 70 \
    --json "$OUT/b3_8.json" > "$OUT/b3_8.log" 2>&1
  tail -1 "$OUT/b3_8.log"
  timeout 145 $B --model qwen2.5-7b --providers slide --batch 16 --offload-batches 16 --timeout 140 \
    --json "$OUT/q7_16.json" > "$OUT/q7_16.log" 2>&1
  tail -1 "$OUT/q7_16.log"
elif [ "$PART" = j ]; then
  timeout 70 python3 -m pytest -q -m gpu tests/test_engine_gpu.py -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
  tail -3 "$OUT/gpu_tests.log"
  cap8_and_soak
  SLIDE_TRACE=$OUT/tr_clip.json timeout 90 $B --model llama3-3b --providers slide --batch 16 --offload-batches 16 \
    --timeout 85 --slide-config '{"max_grad_norm": 1.0}' --json "$OUT/b3_16clip.json" > "$OUT/b3_16clip.log" 2>&1
  tail -1 "$OUT/b3_16clip.log"; summ "$OUT/tr_clip.json"
elif [ "$PART" = k ]; then
  timeout 80 python3 -m pytest -q -m gpu tests/test_engine_gpu.py -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
  tail -3 "$OUT/gpu_tests.log"
  SLIDE_TRACE=$OUT/tr_clip.json timeout 100 $B --model llama3-3b --providers slide --batch 16 --offload-batches 16 \
    --timeout 95 --slide-config "${CLIP_CONFIG:-{\"max_grad_norm\": 1.0\}}" --json "$OUT/b3_16clip.json" > "$OUT/b3_16clip.log" 2>&1
  tail -1 "$OUT/b3_16clip.log"; summ "$OUT/tr_clip.json"
  grep -o '"device_updated_layers": [0-9]*\|"resident_layers": [0-9]*' "$OUT/b3_16clip.log" | tail -2
  SLIDE_TRACE=$OUT/tr_3b16.json timeout 80 $B --model llama3-3b --providers slide --batch 16 \
    --offload-batches 16 --timeout 75 --json "$OUT/b3_16.json" > "$OUT/b3_16.log" 2>&1
  tail -1 "$OUT/b3_16.log"; summ "$OUT/tr_3b16.json"
elif [ "$PART" = l ]; then
  timeout 90 python3 -m pytest -q -m gpu tests/test_engine_gpu.py -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
  tail -3 "$OUT/gpu_tests.log"
  for share in 0.0 auto; do
    [ $share = auto ] && q='"auto"' || q=$share
    SLIDE_TRACE=$OUT/tr_ga_$share.json timeout 110 $B --model llama3-3b --providers slide --batch 16 --offload-batches 16 \
      --timeout 105 --slide-config "{\"max_grad_norm\": 1.0, \"gradient_accumulation_steps\": 2, \"device_update_share\": $q}" \
      --json "$OUT/b3_ga_$share.json" > "$OUT/b3_ga_$share.log" 2>&1
    tail -1 "$OUT/b3_ga_$share.log"; summ "$OUT/tr_ga_$share.json" | head -3
  done
elif [ "$PART" = m ]; then
  timeout 90 python3 -m pytest -q -m gpu tests/test_engine_gpu.py -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
  tail -3 "$OUT/gpu_tests.log"
  b8_16 "$OUT" 1
  b8_16 /tmp 0 '{"grad_buffers": 3}' _g3; cp /tmp/b8_16_g3.log "$OUT/"
  SLIDE_TRACE=$OUT/tr_3b16.json timeout 80 $B --model llama3-3b --providers slide --batch 16 \
    --offload-batches 16 --timeout 75 --json /tmp/b3_16.json > "$OUT/b3_16.log" 2>&1
  tail -1 "$OUT/b3_16.log"; summ "$OUT/tr_3b16.json"
elif [ "$PART" = n ]; then
  timeout 90 python3 -m pytest -q -m gpu tests/test_engine_gpu.py -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
  tail -3 "$OUT/gpu_tests.log"
  b8_16 "$OUT" 1
  for b in 16 8; do
    timeout 80 $B --model llama3-3b --providers slide --batch $b --offload-batches $b --timeout 75 \
      --json /tmp/b3_$b.json > "$OUT/b3_$b.log" 2>&1
    tail -1 "$OUT/b3_$b.log"
  done
elif [ "$PART" = o ] || [ "$PART" = p ]; then
  # the host's fused CPU AdamW rate before and after (a slow host shows here), 8B batch 16 with 3 and 4 buffers
  adam_rate() { python3 -c "
import time, torch
n = 218_103_808; p, g, m, v = (torch.rand(n) for _ in range(4)); s = [torch.zeros(())]
f = lambda: torch._fused_adamw_([p], [g], [m], [v], [], s, lr=1e-5, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
f(); t = time.perf_counter(); [f() for _ in range(5)]; print(f'CPU fused AdamW: {5 * n / (time.perf_counter() - t) / 1e9:.2f} G params/s')"; }
  adam_rate
  if [ "$PART" = o ]; then
    b8_16 "$OUT" 0 '{"grad_buffers": 3}' _g3
    b8_16 "$OUT" 0 '{"grad_buffers": 4}' _g4
  else    # p: 3B batch 8 (the CPU-bound batch) with 3 and 4 buffers; 3B batch 16 with clipping
    for g in 3 4; do
      timeout 80 $B --model llama3-3b --providers slide --batch 8 --offload-batches 8 --timeout 75 \
        --slide-config "{\"grad_buffers\": $g}" --json /tmp/b3_8_g$g.json > "$OUT/b3_8_g$g.log" 2>&1
      tail -1 "$OUT/b3_8_g$g.log"
    done
    timeout 100 $B --model llama3-3b --providers slide --batch 16 --offload-batches 16 --timeout 95 \
      --slide-config '{"max_grad_norm": 1.0}' --json /tmp/b3_16clip.json > "$OUT/b3_16clip.log" 2>&1
    tail -1 "$OUT/b3_16clip.log"
  fi
  adam_rate
elif [ "$PART" = r ]; then
  timeout 120 python3 -m pytest -q -m gpu tests/test_engine_gpu.py -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
  tail -3 "$OUT/gpu_tests.log"
  b8_16 "$OUT" 1
  b8_16 "$OUT" 0 '{"head_update": "cpu"}' _hcpu
  timeout 80 $B --model llama3-3b --providers slide --batch 16 --offload-batches 16 --timeout 75 \
    --json /tmp/b3_16.json > "$OUT/b3_16.log" 2>&1
  tail -1 "$OUT/b3_16.log"
elif [ "$PART" = s ]; then
  timeout 120 python3 -m pytest -q -m gpu tests/test_engine_gpu.py -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
  tail -3 "$OUT/gpu_tests.log"
  b8_16 "$OUT" 0
  cap8_and_soak
elif [ "$PART" = t ]; then
  # where the 8B step's reserved memory goes (the plan reads the reserved peak)
  timeout 300 python3 benchmarks/memory_profile.py --model llama3-8b --batch 16 --steps 3 \
    --snapshot "$OUT/mem8b.pickle" --json "$OUT/mem8b.json" 2>&1 | tail -14
elif [ "$PART" = q ]; then
  timeout 100 $B --model llama3-3b --providers slide --batch 16 --offload-batches 16 --timeout 95 \
    --slide-config '{"max_grad_norm": 1.0}' --json /tmp/b3_16clip.json > "$OUT/b3_16clip.log" 2>&1
  tail -1 "$OUT/b3_16clip.log"
elif [ "$PART" = d ]; then
  timeout 200 python3 benchmarks/batch_sweep.py --model llama3-3b --batches 16,12,10,8,6 --json "$OUT/sweep.json" \
    2>&1 | tail -7
elif [ "$PART" = c ]; then
  timeout 45 python3 -m pytest -q -m gpu tests/test_engine_gpu.py -p no:cacheprovider -x > "$OUT/gpu_tests.log" 2>&1
  tail -2 "$OUT/gpu_tests.log"
  for b in 16 8; do
    SLIDE_TRACE=/tmp/tr$b.json timeout 75 $B --model llama3-3b --providers slide --batch $b --offload-batches $b \
      --timeout 72 --json "$OUT/b3_$b.json" > "$OUT/b3_$b.log" 2>&1
    tail -1 "$OUT/b3_$b.log"; summ /tmp/tr$b.json
  done
else
  timeout 110 $B --model llama3-3b --providers ${RES_PROVIDERS:-resident} --batch 16 --timeout 100 \
    --json "$OUT/b3_res.json" > "$OUT/b3_res.log" 2>&1
  tail -1 "$OUT/b3_res.log"
  cap8_and_soak
  if [ -n "${KERNELS:-}" ]; then
    timeout 150 python3 benchmarks/bench_kernels.py > "$OUT/kernels.log" 2>&1; tail -12 "$OUT/kernels.log"
  fi
fi
