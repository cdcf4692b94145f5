"""Soak test: train many steps and check that GPU memory and host RSS stay flat (no leak).

Records, after every optimizer step, the GPU memory allocated / reserved and the process RSS,
and fails (exit 1) when the second half of the run grew beyond a tolerance over the first half's
maximum. Also times the step with clipping on (deferred updates) against the in-backward
mode when --compare-clipping is given.

Usage: python benchmarks/soak.py --model llama3-3b --layers 4 --batch 4 --seq 2048 --steps 200 \
           [--cap-gib 24] [--compare-clipping 20] [--slide-config '{"max_grad_norm": 1.0}'] [--json out.json]

With gradient_accumulation_steps in --slide-config, each step is that many micro-batches.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GIB = 2 ** 30


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def common_args(ap: argparse.ArgumentParser, model: str) -> None:
    """The options every sliding run script shares: the shape, the device and its cap, extra settings."""
    ap.add_argument("--model", default=model)
    ap.add_argument("--layers", type=int, default=None, help="truncate the shape to this many layers")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--cap-gib", type=float, default=24)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--slide-config", default=None, help="JSON object of extra SlideConfig fields")
    ap.add_argument("--json", default=None)


def slid_model(args):
    """(config, device, slid random-init model) for `common_args`' options; bf16 on CUDA, fp32 on the CPU."""
    import hf_slideformer as hs
    from providers.base import build_model, load_config

    device = torch.device(args.device)
    config = load_config(args.model)
    if args.layers:
        config.num_hidden_layers = args.layers
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(config, "cpu", dtype, fill="tiled")
    sc = hs.SlideConfig(device=args.device, dtype=dtype,
                        gpu_memory_limit=args.cap_gib if device.type == "cuda" else None,
                        **json.loads(args.slide_config or "{}"))
    return config, device, hs.slide(model, sc)


def train_step(model, opt, ids, device) -> float:
    """One optimizer step on `ids` (labels = ids); its wall time, the GPU drained."""
    t0 = time.perf_counter()
    for _ in range(model.slide_config.gradient_accumulation_steps):
        model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def run(model, ids, steps: int, device) -> dict:
    opt = model.create_optimizer(lr=1e-5)
    rows = []
    for _ in range(steps):
        rows.append((train_step(model, opt, ids, device),
                     torch.cuda.memory_allocated(device) if device.type == "cuda" else 0,
                     torch.cuda.memory_reserved(device) if device.type == "cuda" else 0, rss_bytes()))
    return {"rows": rows, "stats": model.slide_stats()}


def growth(rows, k: int) -> float:
    """Bytes the second half's maximum of column k exceeds the first half's maximum (after 5 warm-up steps)."""
    body = rows[5:]
    half = len(body) // 2
    return max(r[k] for r in body[half:]) - max(r[k] for r in body[:half])


def main() -> int:
    from providers.base import random_batch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(ap, "llama3-3b")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--compare-clipping", type=int, default=0, help="then time this many steps with clipping on")
    ap.add_argument("--tolerance-mib", type=float, default=64, help="allowed growth of GPU allocated and of RSS")
    args = ap.parse_args()

    config, device, model = slid_model(args)
    ids, _ = random_batch(config.vocab_size, args.batch, args.seq, device)
    out = run(model, ids, args.steps, device)
    rows = out["rows"]
    g_alloc, g_res, g_rss = growth(rows, 1), growth(rows, 2), growth(rows, 3)
    med = sorted(r[0] for r in rows[5:])[len(rows[5:]) // 2]
    result = {"steps": args.steps, "median_step_s": med, "gpu_allocated_growth_mib": g_alloc / 2 ** 20,
              "gpu_reserved_growth_mib": g_res / 2 ** 20, "rss_growth_mib": g_rss / 2 ** 20,
              "gpu_allocated_first_last_gib": [rows[5][1] / GIB, rows[-1][1] / GIB],
              "rss_first_last_gib": [rows[5][3] / GIB, rows[-1][3] / GIB],
              "resident_layers": out["stats"].get("resident_layers"),
              "device_updated_layers": out["stats"].get("device_updated_layers")}
    if args.compare_clipping:
        model.slide_engine.configure_steps(1, 1.0)
        clip = run(model, ids, args.compare_clipping, device)["rows"]
        result["clipping_median_step_s"] = sorted(r[0] for r in clip[3:])[len(clip[3:]) // 2]
        result["clipping_vs_in_backward"] = result["clipping_median_step_s"] / med
    ok = g_alloc <= args.tolerance_mib * 2 ** 20 and g_rss <= args.tolerance_mib * 2 ** 20
    result["flat"] = ok
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**result, "rows": rows}, f)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
