#!/usr/bin/env python
"""The short table of `run_fp8_h200.sh f`: each FP8 row beside its bf16 row and its target.

    python benchmarks/experiments/fp8_table.py out/fp8_3b_9.json out/fp8_8b_12.json out/fp8_8b_24.json

Reads bench_train.py --json files (providers `slide` and `slide_fp8`) and prints one line per
row: tokens/s, step s, the GPU compute per step (`slide_stats_per_step`) and the model TFLOP/s
of it (6 x parameters x tokens per GPU-compute second, the recompute not counted), the reserved
GPU memory and allocator retries, and for the FP8 row its ratio to bf16 and its target.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

TARGETS = {("llama3-8b", 24): 13000, ("llama3-8b", 12): 12000, ("llama3-3b", 9): 26000}


def model_tflops(row: dict, gpu_s: float | None) -> float | None:
    """6 x parameters x tokens per step over the GPU compute per step, in TFLOP/s."""
    if not gpu_s or not row.get("n_params") or not row.get("tokens_per_step"):
        return None
    return 6 * row["n_params"] * row["tokens_per_step"] / gpu_s / 1e12


def lines(doc: dict) -> list[str]:
    shape, cap = doc["shape"]["name"], doc.get("cap_gib")
    by = {r.get("provider"): r for r in doc.get("results", [])}
    out = []
    for name in ("slide", "slide_fp8"):
        r = by.get(name)
        if r is None:
            out.append(f"| {shape} | {cap} | {name} | not run | | | | | |")
            continue
        if r.get("status") != "ok":
            out.append(f"| {shape} | {cap} | {name} | {r.get('status')}: {str(r.get('error', ''))[:60]} | | | | | |")
            continue
        per = (r.get("extra") or {}).get("slide_stats_per_step") or {}
        gpu = per.get("gpu_compute_s")
        tflops = model_tflops(r, gpu)
        note = ""
        if name == "slide_fp8":
            base = by.get("slide")
            if base and base.get("status") == "ok":
                note = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x"
            target = TARGETS.get((shape, int(cap or 0)))
            if target:
                note += f" (target {target:,}: {'met' if r['tokens_per_s'] >= target else 'short'})"
        gpu_text = "None" if gpu is None else f"{gpu:.3f}"
        tflops_text = "None" if tflops is None else f"{tflops:.0f}"
        out.append(f"| {shape} | {cap} | {name} | {r['tokens_per_s']:,.0f} | {r['step_s']:.3f} | {gpu_text} | "
                   f"{tflops_text} | {r.get('gpu_peak_reserved_gib', 0) or 0:.1f} / {r.get('gpu_alloc_retries')} | {note} |")
    return out


def main(argv: list[str]) -> int:
    print("| shape | cap GiB | provider | tokens/s | step s | GPU compute s / step | model TFLOP/s of it | "
          "reserved GiB / retries | FP8 vs bf16 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for f in argv:
        try:
            doc = json.loads(Path(f).read_text())
        except (OSError, ValueError) as e:
            print(f"| {Path(f).stem} | | | unreadable: {e} | | | | | |")
            continue
        for line in lines(doc):
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
