#!/usr/bin/env python
"""The loss head's three matmuls in each layout and BLAS backend, summed over the chunks.

    python benchmarks/experiments/lce_gemm_probe.py [--chunks 512,1024]

Shapes: T = 16384 tokens, H = 4096, V = 128256, bf16. "buf" is the (C, V) logits chunk,
"bufT" its (V, C) transpose layout; dW is (V, H), dWT (H, V). Prints ms summed over T / C
chunks (median of 5) and TFLOP/s.
"""
from __future__ import annotations

import argparse
import statistics

import torch


def timed(fn, chunks, iters=5):
    for s in chunks[:2]:
        fn(s)
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for s in chunks:
            fn(s)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--chunks", default="512,1024")
    p.add_argument("--T", type=int, default=16384)
    p.add_argument("--H", type=int, default=4096)
    p.add_argument("--V", type=int, default=128256)
    a = p.parse_args()
    T, H, V = a.T, a.H, a.V
    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(T, H, device="cuda", dtype=dt, generator=g)
    weight = torch.randn(V, H, device="cuda", dtype=dt, generator=g) * 0.02
    dw = torch.zeros(V, H, device="cuda", dtype=dt)
    dwT = torch.zeros(H, V, device="cuda", dtype=dt)
    dh = torch.empty(T, H, device="cuda", dtype=dt)
    flop = 2.0 * T * H * V
    rows = []
    for C in [int(c) for c in a.chunks.split(",")]:
        buf = torch.randn(C, V, device="cuda", dtype=dt, generator=g) * 1e-3
        bufT = buf.t().contiguous()
        starts = list(range(0, T, C))
        cases = {
            "proj  h@W.T -> buf (C,V)": lambda s: torch.mm(hidden[s:s + C], weight.t(), out=buf),
            "proj  W@h.T -> bufT (V,C)": lambda s: torch.mm(weight, hidden[s:s + C].t(), out=bufT),
            "dh    buf@W": lambda s: torch.mm(buf, weight, out=dh[s:s + C]),
            "dh    bufT.T@W": lambda s: torch.mm(bufT.t(), weight, out=dh[s:s + C]),
            "dW    dw += buf.T@h": lambda s: dw.addmm_(buf.t(), hidden[s:s + C]),
            "dW    dw += bufT@h": lambda s: dw.addmm_(bufT, hidden[s:s + C]),
            "dW    dwT += h.T@buf": lambda s: dwT.addmm_(hidden[s:s + C].t(), buf),
            "dW    dwT += h.T@bufT.T": lambda s: dwT.addmm_(hidden[s:s + C].t(), bufT.t()),
        }
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            for name, fn in cases.items():
                ms = timed(fn, starts)
                rows.append((C, lib, name, ms, flop / ms / 1e9))
                print(f"C={C:5d} {lib:8s} {name:28s} {ms:7.2f} ms {flop / ms / 1e9:6.0f} TFLOP/s", flush=True)
        torch.backends.cuda.preferred_blas_library("cublas")
        del buf, bufT
    print("\nsummary (ms)")
    for r in rows:
        print(f"{r[0]:5d} {r[1]:8s} {r[2]:28s} {r[3]:7.2f} {r[4]:6.0f}")


if __name__ == "__main__":
    main()
