#!/usr/bin/env bash
# Small-GPU rows with and without layers updated on the GPU in the backward, in one call:
#   bash benchmarks/experiments/backward_device_rows.sh COMMIT "MODEL:CAP:SHARE ..."
# SHARE: a number (device_update_share) or auto. Each row's JSON and log under $OUT.
set -u
commit=$1; rows=$2; out=${OUT:-out}; mkdir -p "$out"
for r in $rows; do
  IFS=: read -r model cap share <<<"$r"
  cfg=$([ "$share" = auto ] && echo '{}' || echo "{\"device_update_share\": $share}")
  name="${model}_cap${cap}_share${share}"
  timeout 170 python3 benchmarks/bench_train.py --model "$model" --providers slide --batch 16 --offload-batches 16 \
    --cap-gib "$cap" --steps 3 --warmup 2 --no-probe --timeout 160 --commit "$commit" \
    --slide-config "$cfg" --json "$out/$name.json" > "$out/$name.log" 2>&1
  python3 - "$out/$name.json" "$name" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))["results"][0]
    s = r["extra"]["slide_stats_per_step"]
    print(f"{sys.argv[2]:28s} {r['status']:4s} tok/s {32768 / r['step_s']:8.0f} step {r['step_s']:.3f} "
          f"gpu {s['gpu_compute_s']:.2f} adam {s['cpu_adam_s']:.2f} busy {s['worker_busy_s']:.2f} "
          f"wgb {s['wait_grad_buffer_s']:.2f} wup {s['wait_update_s']:.2f} gpu_upd {s['gpu_updated_params'] / 1e9:.2f}G "
          f"h2d {s['h2d_bytes'] / 1e9:.1f} d2h {s['d2h_bytes'] / 1e9:.1f} "
          f"mem {r['gpu_peak_allocated'] / 2**30:.1f}/{r['gpu_peak_reserved'] / 2**30:.1f} rss {r['host_rss_peak'] / 2**30:.1f}")
except Exception as exc:
    print(sys.argv[2], "failed:", exc)
PY
done
