"""Where an FP8 layer's time goes: one Llama layer's projections, forward + backward, in bf16 and in
FP8 (hf_slideformer.compute.fp8), with the quantization kernels timed on their own.

    python3 benchmarks/experiments/fp8_layer_probe.py [--tokens 32768] [--hidden 4096] [--inter 14336]

Prints, per projection shape (CUDA events, median of --iters): the bf16 linear's forward +
backward, the FP8 linear's (weights pre-quantized, as the engine's slot cache has them), and
each quantization kernel alone on that projection's operands (the backward's are rows+amax(gy)
and cols_t(gy|amax); rows(gy) and cols_t(gy) are the separate passes they replace); then the sums. The gap between
the FP8 sum and bf16 sum / 1.70 (docs/fp8.md, "GEMM rates") is the quantization's share.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hf_slideformer.compute.fp8 import CudaFp8, Fp8Linear, QuantizedWeight  # noqa: E402


def timed(fn, iters: int) -> float:
    """Median milliseconds of fn() over `iters` runs after 3 warm-ups."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def probe(m: int, k: int, n: int, iters: int) -> dict:
    ops = CudaFp8()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16().requires_grad_()
    gy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 1e-3
    qw = QuantizedWeight(w, ops)          # its forward form kept, its dgrad form made in each backward (one per fill)
    g_amax = gy.float().abs().amax(0)

    def bf16():
        torch.autograd.grad(torch.nn.functional.linear(x, w), [x, w], gy)

    def fp8():
        torch.autograd.grad(Fp8Linear.apply(x, w, None, qw, ops, True), [x, w], gy)

    return {"shape": f"{m} x {k} -> {n}", "bf16": timed(bf16, iters), "fp8": timed(fp8, iters),
            "rows(x)": timed(lambda: ops.quantize_rows(x.detach()), iters),
            "rows(gy)": timed(lambda: ops.quantize_rows(gy), iters),
            "rows+amax(gy)": timed(lambda: ops.quantize_rows_col_amax(gy), iters),
            "cols_t(gy)": timed(lambda: ops.quantize_cols_t(gy), iters),
            "cols_t(gy|amax)": timed(lambda: ops.quantize_cols_t(gy, g_amax), iters),
            "cols_t(x)": timed(lambda: ops.quantize_cols_t(x.detach()), iters)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--kv", type=int, default=1024, help="k and v projection width (kv heads x head dim)")
    p.add_argument("--inter", type=int, default=14336)
    p.add_argument("--iters", type=int, default=10)
    a = p.parse_args()
    T, H, I = a.tokens, a.hidden, a.inter
    shapes = [(T, H, H), (T, H, a.kv), (T, H, a.kv), (T, H, H), (T, H, I), (T, H, I), (T, I, H)]
    rows = [probe(*s, a.iters) for s in shapes]
    keys = ["bf16", "fp8", "rows(x)", "rows(gy)", "rows+amax(gy)", "cols_t(gy)", "cols_t(gy|amax)", "cols_t(x)"]
    print(f"{'projection':>24} " + " ".join(f"{k:>15}" for k in keys) + "   (ms)")
    for r in rows:
        print(f"{r['shape']:>24} " + " ".join(f"{r[k]:15.2f}" for k in keys))
    sums = {k: sum(r[k] for r in rows) for k in keys}
    print(f"{'sum':>24} " + " ".join(f"{sums[k]:15.2f}" for k in keys))
    print(f"bf16 / 1.70 = {sums['bf16'] / 1.70:.2f} ms; FP8 over that: {sums['fp8'] - sums['bf16'] / 1.70:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
