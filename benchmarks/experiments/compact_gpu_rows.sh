#!/usr/bin/env bash
# The compact host state formats with their GPU placements (resident layers, device updates),
# each row beside fp32 AdamW in one call (docs/host_state.md predicts them). About 5-6 minutes:
#   OUT=out bash benchmarks/experiments/compact_gpu_rows.sh [COMMIT]
# 1. GPU tests of the compact update (tests/test_adam8_torch.py, -m gpu)
# 2. Llama-3.2-3B, batch 8 under 8 GiB: adamw, adamw_8bit, adamw_8bit_bf16
# 3. Llama-3.1-8B, batch 16 under 12 GiB: adamw, adamw_8bit_bf16
# and last a short table: provider, tokens/s, x fp32, resident layers, host RSS.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
C=${1:-unknown}
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$PWD
timeout 60 python3 -m pytest -q -m gpu tests/test_adam8_torch.py -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests: $(tail -1 "$OUT/gpu_tests.log")"
B="python3 benchmarks/bench_train.py --steps 3 --warmup 1 --no-probe --commit $C"
timeout 190 $B --model llama3-3b --providers slide,slide_8bit,slide_8bit_bf16 --batch 8 --offload-batches 8 \
  --cap-gib 8 --timeout 60 --json "$OUT/3b_b8_cap8.json" > "$OUT/3b_b8_cap8.log" 2>&1
echo "3b: $(tail -1 "$OUT/3b_b8_cap8.log")"
timeout 210 $B --model llama3-8b --providers slide,slide_8bit_bf16 --batch 16 --offload-batches 16 \
  --cap-gib 12 --timeout 100 --json "$OUT/8b_b16_cap12.json" > "$OUT/8b_b16_cap12.log" 2>&1
echo "8b: $(tail -1 "$OUT/8b_b16_cap12.log")"
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
print(f"{'row':<34} {'tokens/s':>9} {'x fp32':>7} {'resident':>8} {'host RSS GiB':>12}")
for name in ("3b_b8_cap8", "8b_b16_cap12"):
    p = Path(sys.argv[1]) / f"{name}.json"
    if not p.exists():
        print(f"{name}: no result"); continue
    rows = json.loads(p.read_text()).get("results", [])
    base = next((r.get("tokens_per_s") for r in rows if r.get("provider") == "slide"), None)
    for r in rows:
        tps = r.get("tokens_per_s") or 0.0
        st = (r.get("extra") or {}).get("slide_stats") or {}
        rss = r.get("host_rss_peak_gib")
        x = f"{tps / base:.2f}" if base and tps else "-"
        print(f"{name + ' ' + r.get('provider', '?'):<34} {tps:>9,.0f} {x:>7} {str(st.get('resident_layers', '-')):>8} "
              f"{'-' if rss is None else f'{rss:.1f}':>12}  {r.get('status', '')}")
PY
