#!/usr/bin/env bash
# The compact host state formats on the H200 machine, each row beside fp32 AdamW in one call
# (docs/host_state.md, "The GPU placements: predicted rows"). About 5-6 minutes:
#   OUT=out bash benchmarks/experiments/compact_rows_h200.sh [COMMIT] [24b]
# 1. GPU tests of the 8-bit update: the Triton kernel against the torch ops and the native host
#    kernel, and the resident / device-updated layers in a compact format (tests/test_adam8_triton.py,
#    tests/test_adam8_torch.py)
# 2. the host update rates at 16 threads (fp32, adamw_8bit, adamw_8bit_bf16), and whether the host
#    kernel built its AVX-512 VBMI path
# 3. Llama-3.2-3B, batch 8 under 8 GiB: adamw, adamw_8bit, adamw_8bit_bf16; each row's resident
#    layers and what its resident plan read (reserved / allocated peak, a layer's GPU bytes/param)
# 4. with `24b` as the second argument, and only then: the Mistral-Small-24B shape, batch 8 under
#    24 GiB, adamw_8bit_bf16 (about 4 more minutes)
# Full logs and JSON under $OUT; a short table last.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
C=${1:-unknown}
PART=${2:-}
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$PWD

timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_adam8_triton.py tests/test_adam8_torch.py -s \
  > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests: $(tail -1 "$OUT/gpu_tests.log")"

{ grep -o -m1 -w avx512vbmi /proc/cpuinfo || echo "no avx512vbmi"; nproc; } > "$OUT/host_cpu.txt"
timeout 90 python3 benchmarks/host_adam_rate.py --threads 16 --repeat 3 --json "$OUT/host_rate.json" \
  > "$OUT/host_rate.log" 2>&1
echo "host rates: $(tail -1 "$OUT/host_rate.log")"

B="python3 benchmarks/bench_train.py --steps 3 --warmup 1 --no-probe --commit $C"
timeout 240 $B --model llama3-3b --providers slide,slide_8bit,slide_8bit_bf16 --batch 8 --offload-batches 8 \
  --cap-gib 8 --timeout 110 --json "$OUT/3b_b8_cap8.json" > "$OUT/3b_b8_cap8.log" 2>&1
echo "3b: $(tail -1 "$OUT/3b_b8_cap8.log")"

if [ "$PART" = "24b" ]; then
  timeout 280 $B --model mistral-small-24b --providers slide_8bit_bf16 --batch 8 --offload-batches 8 --cap-gib 24 \
    --steps 2 --timeout 270 --json "$OUT/24b_b8_cap24.json" > "$OUT/24b_b8_cap24.log" 2>&1
  echo "24b: $(tail -1 "$OUT/24b_b8_cap24.log")"
fi

python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"host: {(out / 'host_cpu.txt').read_text().split()}")
rate = out / "host_rate.json"
if rate.exists():
    rows = json.loads(rate.read_text())["rows"]
    for name in ("native, bf16 grad", "native adamw_8bit, spread codes", "native adamw_8bit_bf16, spread codes"):
        r = rows.get(name)
        print(f"host update {name:<38} {r['params_per_s'] / 1e9:6.2f} G params/s" if r else f"{name}: -")
GiB = 2 ** 30
print(f"{'row':<30} {'tokens/s':>9} {'x fp32':>7} {'res.':>5} {'plan peak res/alloc GiB':>24} {'B/param':>8} "
      f"{'GPU s/step':>10} {'adam s/step':>11} {'RSS GiB':>8}")
for name in ("3b_b8_cap8", "24b_b8_cap24"):
    p = out / f"{name}.json"
    if not p.exists():
        continue
    rows = json.loads(p.read_text()).get("results", [])
    base = next((r.get("tokens_per_s") for r in rows if r.get("provider") == "slide"), None)
    for r in rows:
        tps = r.get("tokens_per_s") or 0.0
        extra = r.get("extra") or {}
        st, per = extra.get("slide_stats") or {}, extra.get("slide_stats_per_step") or {}
        plan = st.get("resident_plan") or {}
        peak = (f"{plan['peak_bytes'] / GiB:.2f} / {plan['allocated_peak_bytes'] / GiB:.2f} of "
                f"{plan['limit_bytes'] / GiB:.0f}") if plan else "-"
        bpp = f"{plan['layer_bytes_per_param']:.2f}" if plan else "-"
        x = f"{tps / base:.2f}" if base and tps else "-"
        gpu, adam, rss = per.get("gpu_compute_s"), per.get("cpu_adam_s"), r.get("host_rss_peak_gib")
        f = lambda v: "-" if v is None else f"{v:.3f}"       # noqa: E731
        print(f"{name + ' ' + r.get('provider', '?'):<30} {tps:>9,.0f} {x:>7} {str(st.get('resident_layers', '-')):>5} "
              f"{peak:>24} {bpp:>8} {f(gpu):>10} {f(adam):>11} {'-' if rss is None else f'{rss:.1f}':>8}  "
              f"{r.get('status', '')}")
PY
