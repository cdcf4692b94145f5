#!/usr/bin/env bash
# The model families' GPU rows (docs/models.md, issue targets), one part per device call:
#   OUT=out bash benchmarks/experiments/families_h200.sh PART [COMMIT]
# PART (each under about 5 minutes; full logs and JSON under $OUT/PART/, a short table last):
#   gemma3    Gemma-3 ~4B shape (benchmarks/configs/gemma3-4b.json), seq 2048: slide batch 16 under a
#             24 GiB cap against hf GPU-resident (checkpointing, Liger's gemma3_text patch or triton_ops,
#             fused AdamW, uncapped) at batches 16 and 32, its best counting; target slide >= 0.95x hf
#   qwen3moe  Qwen3-30B-A3B shape, LoRA r16 on the attention and the experts' weights, batch 8:
#             slide_lora under 24 GiB against hf_lora (PEFT on the GPU-resident bf16 model, uncapped,
#             checkpointing, Liger's qwen3_moe patch without its experts where Liger has it, else
#             plain HF: the row's kernels note says which); target slide_lora >= 0.85x hf_lora,
#             within the host's memory
#   qwen35    Qwen3.5-9B dense shape (benchmarks/configs/qwen3.5-9b.json), full fine-tuning, batch 16 under
#             24 GiB, beside the Llama-3.1-8B shape's row in the same call; target: tokens/s per parameter
#             within 10% of Llama's. Its linear-attention layers run flash-linear-attention where installed
#             (it needs Triton >= 3.7.1 or tilelang on Hopper), else transformers' torch path
#   gptoss    gpt-oss-20b shape, full fine-tuning, batch 16 under 24 GiB, slide_8bit_bf16 (8-bit
#             moments and a bf16 master: the fp32 state does not fit 125 GiB), beside the planner
#   tests     pytest -m gpu tests/test_families_gpu.py tests/test_lora*.py
# Each training part first writes the planner's prediction (`hf-slideformer plan`) to $OUT/PART/plan.txt.
set -uo pipefail
PART=${1:?usage: OUT=out bash benchmarks/experiments/families_h200.sh gemma3|qwen3moe|qwen35|gptoss|tests [COMMIT]}
C=${2:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
OUT=${OUT:-out}; D="$OUT/$PART"; mkdir -p "$D"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$PWD
B="python3 benchmarks/bench_train.py --seq 2048 --steps 3 --warmup 1 --no-probe --commit $C"
PLAN="python3 -m hf_slideformer.cli plan --host-mem 125 --gpu-mem 24"

bench() {          # bench NAME LIMIT_S ARGS...: one bench_train run, its log and JSON under $D
  local name=$1 limit=$2; shift 2
  timeout "$limit" $B "$@" --json "$D/$name.json" > "$D/$name.log" 2>&1
  echo "$name: rc $? $(tail -1 "$D/$name.log" | cut -c1-160)"
}

case "$PART" in
  gemma3)
    $PLAN benchmarks/configs/gemma3-4b.json --batch 16 > "$D/plan.txt" 2>&1
    bench slide 170 --model gemma3-4b --providers slide --batch 16 --offload-batches 16 --cap-gib 24 --timeout 160
    bench hf 130 --model gemma3-4b --providers hf --search-batches 16,32 --checkpointing on --kernels auto --timeout 120
    ;;
  qwen3moe)
    $PLAN benchmarks/configs/qwen3-30b-a3b.json --batch 8 --lora-r 16 > "$D/plan.txt" 2>&1
    bench lora 400 --model qwen3-30b-a3b --providers slide_lora,hf_lora --batch 8 --offload-batches 8,4 \
      --cap-gib 24 --lora-r 16 --checkpointing on --timeout 190
    ;;
  qwen35)
    $PLAN benchmarks/configs/qwen3.5-9b.json --batch 16 > "$D/plan.txt" 2>&1
    python3 -c "import fla; print('flash-linear-attention', fla.__version__)" > "$D/fla.txt" 2>&1
    bench qwen35 200 --model qwen3.5-9b --providers slide --batch 16 --offload-batches 16 --cap-gib 24 --timeout 190
    bench llama8b 170 --model llama3-8b --providers slide --batch 16 --offload-batches 16 --cap-gib 24 --timeout 160
    ;;
  gptoss)
    $PLAN benchmarks/configs/gpt-oss-20b.json --batch 16 --optim adamw_8bit_bf16 > "$D/plan.txt" 2>&1
    bench slide 290 --model gpt-oss-20b --providers slide_8bit_bf16 --batch 16 --offload-batches 16 --cap-gib 24 \
      --timeout 280
    ;;
  tests)
    timeout 290 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_families_gpu.py tests/test_lora.py \
      tests/test_lora_experts.py > "$D/gpu_tests.log" 2>&1
    echo "gpu tests: rc $?"
    grep -E "^(FAILED|ERROR)" "$D/gpu_tests.log" | cut -c1-200 | head -30
    tail -1 "$D/gpu_tests.log"
    exit 0
    ;;
  *) echo "unknown part $PART (gemma3, qwen3moe, qwen35, gptoss, tests)"; exit 2 ;;
esac

python3 - "$D" "$PART" <<'PY'
import json, re, sys
from pathlib import Path

d, part = Path(sys.argv[1]), sys.argv[2]
baseline = {"gemma3": ("slide", "hf", 0.95), "qwen3moe": ("slide_lora", "hf_lora", 0.85)}.get(part)
plan = (d / "plan.txt").read_text() if (d / "plan.txt").exists() else ""
m = re.search(r"expected about ([\d.]+) s \(([\d.]+) k tokens/s\)", plan)
print(f"planner: {m.group(2)} k tokens/s ({m.group(1)} s/step)" if m else "planner: no estimate (see plan.txt)")
rows = []
for p in sorted(d.glob("*.json")):
    rows += json.loads(p.read_text()).get("results", [])
gib = lambda v: "-" if v is None else f"{v / 2**30:.1f}"
tps = {r.get("provider"): r.get("tokens_per_s") or 0.0 for r in rows}
print(f"{'provider':<16} {'status':<8} {'batch':>5} {'tokens/s':>9} {'step s':>7} {'GPU res GiB':>11} "
      f"{'host RSS GiB':>12} {'bound by':>8} {'x base':>7}")
for r in rows:
    x = "-"
    if baseline and r.get("provider") == baseline[0] and tps.get(baseline[1]):
        x = f"{(r.get('tokens_per_s') or 0) / tps[baseline[1]]:.2f}"
    step = r.get("step_s")
    print(f"{r.get('provider', '?'):<16} {r.get('status', '?'):<8} {str(r.get('batch', '-')):>5} "
          f"{r.get('tokens_per_s') or 0:>9,.0f} {'-' if step is None else f'{step:.2f}':>7} "
          f"{gib(r.get('gpu_peak_reserved')):>11} {r.get('host_rss_peak_gib') or 0:>12.1f} "
          f"{str(r.get('bound_by', '-')):>8} {x:>7}")
if baseline:
    print(f"target: {baseline[0]} >= {baseline[2]}x {baseline[1]}")
if part == "qwen35":      # tokens/s per parameter (both dense: every parameter is active)
    per = {p.stem: r for p in sorted(d.glob("*.json")) for r in json.loads(p.read_text()).get("results", [])}
    q, l = per.get("qwen35", {}), per.get("llama8b", {})
    if q.get("tokens_per_s") and l.get("tokens_per_s") and q.get("n_params") and l.get("n_params"):
        ratio = q["tokens_per_s"] * q["n_params"] / (l["tokens_per_s"] * l["n_params"])
        print(f"tokens/s x parameters, Qwen3.5 over Llama: {ratio:.2f} (target >= 0.90)")
PY
