"""The project's chunked gated delta rule eager and under `torch.compile`, forward + backward, at the
Qwen3.5-9B shape: what compiling the rule's elementwise passes (decays, masks, products by beta,
casts) would take off a linear-attention layer.

    python3 benchmarks/experiments/gated_delta_compile_probe.py [--batch 16] [--seq 2048] [--device cuda]

Inputs as gated_delta_probe.py's rule inputs (bf16 q / k / v heads repeated to the 32 value heads,
fp32 log decays, bf16 beta, the q / k L2 norm in the rule). Prints the eager median (CUDA events,
5 after 2 warm-up), the compiled one, the first compiled call's wall time (the compilation), and
the compiled results' largest relative difference from the eager ones (output and the five
gradients). `--device cpu --batch 1 --seq 128` runs it as a smoke test.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from triton_ops.gated_delta import chunk_gated_delta_rule  # noqa: E402


def _timed(fn, device, reps=5, warm=2) -> float:
    times = []
    for i in range(warm + reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= warm:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    dev, nv, d = args.device, 32, 128
    gen = torch.Generator(dev).manual_seed(0)

    def leaf(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=gen) * scale).to(dtype).requires_grad_()

    q, k, v = (leaf(args.batch, args.seq, nv, d) for _ in range(3))
    g = (-torch.rand(args.batch, args.seq, nv, device=dev, generator=gen)).requires_grad_()
    beta = torch.rand(args.batch, args.seq, nv, device=dev, generator=gen).bfloat16().requires_grad_()
    leaves = (q, k, v, g, beta)
    weight = torch.randn(args.batch, args.seq, nv, d, device=dev, generator=gen)

    def run(rule):
        out, _ = rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        grads = torch.autograd.grad((out.float() * weight).sum(), leaves)
        return out, grads

    compiled = torch.compile(chunk_gated_delta_rule)
    t0 = time.perf_counter()
    c_out, c_grads = run(compiled)
    if dev == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter() - t0
    e_out, e_grads = run(chunk_gated_delta_rule)

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()

    diffs = [rel(c_out, e_out)] + [rel(a, b) for a, b in zip(c_grads, e_grads)]
    print(f"shape: batch {args.batch}, seq {args.seq}, {nv} heads of {d}, {dev}")
    print(f"eager rule fwd+bwd:    {_timed(lambda: run(chunk_gated_delta_rule), dev):8.2f} ms")
    print(f"compiled rule fwd+bwd: {_timed(lambda: run(compiled), dev):8.2f} ms  (first call {first:.1f} s)")
    print("compiled against eager, relative: out %.1e, grads %s" % (
        diffs[0], " ".join(f"d{n} {x:.1e}" for n, x in zip(("q", "k", "v", "g", "beta"), diffs[1:]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
