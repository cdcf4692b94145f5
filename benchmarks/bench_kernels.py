#!/usr/bin/env python
"""Kernel benchmark: torch reference vs Liger-Kernel vs triton_ops, forward + backward.

    python benchmarks/bench_kernels.py --json out/kernels.json            # the table of docs/benchmarks.md
    python benchmarks/bench_kernels.py --ops lce --sweep                  # chunk sizes, schedules, breakdown

Shapes (bf16): linear cross-entropy at T=16384, H=4096, V=128256 (the Llama-3 head); rms_norm,
rope and swiglu at Llama-3-8B layer shapes, batch 4 x 2048 tokens. Each measurement times one
forward + backward with CUDA events (warm-up runs first, median of the timed runs) and records
the peak memory allocated above what was allocated before the call (inputs excluded; outputs and
gradients included). For the small ops it also times 20 calls issued back to back ("ms in a
stream"): the per-call cost inside a model, where the host launches ahead of the GPU, as opposed
to one call's wall time, which at these sizes is mostly the host's launch cost. The hardware
bound stated for the loss head is its three matmuls,
3 * 2 * T * H * V FLOP, at the GPU's dense bf16 peak and at the 790 TFLOP/s cuBLAS reaches.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import triton_ops  # noqa: E402
from benchmarks.harness import GIB, environment, format_table, peak_tflops  # noqa: E402
from triton_ops import reference  # noqa: E402

CUBLAS_TFLOPS = 790.0


def liger():
    """The Liger-Kernel functional module, or None when it is not installed."""
    try:
        from liger_kernel.transformers import functional
    except Exception:
        return None
    return functional


def stream_ms(make, run, calls: int = 20, reps: int = 5) -> float:
    """Milliseconds per call of `calls` calls issued back to back (inputs made beforehand), median
    of `reps`: what one call costs inside a model, where the host runs ahead of the GPU: the
    larger of its host launch cost and its GPU time."""
    times = []
    for _ in range(reps):
        args = [make() for _ in range(calls)]
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for a in args:
            run(*a)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
        del args
    return statistics.median(times)


def measure(make, run, warmup: int, iters: int, stream: bool = False) -> dict:
    """Median time (ms) and peak extra memory (GiB) of run(*make()) over `iters` timed calls
    (and, with `stream`, the per-call time of calls back to back: `stream_ms`)."""
    times, peaks = [], []
    for i in range(warmup + iters):
        args = make()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run(*args)
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
            peaks.append(torch.cuda.max_memory_allocated() - base)
        del args
    out = {"ms": statistics.median(times), "ms_min": min(times), "peak_gib": max(peaks) / GIB,
           "gpu_ms": gpu_kernel_ms(make, run)}
    if stream:
        out["stream_ms"] = stream_ms(make, run)
    return out


def gpu_kernel_ms(make, run) -> float | None:
    """Sum of the GPU kernels' durations in one call (torch.profiler), without launch gaps.

    Where this is well below the wall time, the op is bound by its host-side launch cost at
    this size; inside a model the host runs ahead and only the kernel time remains.
    """
    try:
        from torch.profiler import ProfilerActivity, profile

        args = make()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run(*args)
            torch.cuda.synchronize()
        total = 0.0
        for evt in prof.key_averages():
            total += getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0)
        return total / 1000.0
    except Exception:
        return None


# ---------------------------------------------------------------- linear cross-entropy

def lce_cases(T: int, H: int, V: int, sweep: bool):
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    weight = (torch.randn(V, H, device="cuda", generator=g) * H ** -0.5).to(torch.bfloat16)
    labels = torch.randint(0, V, (T,), device="cuda", generator=g)
    labels[::50] = -100

    def make():
        return hidden.detach().requires_grad_(), weight.detach().requires_grad_()

    def torch_run(h, w):
        F.cross_entropy((h @ w.t()).float(), labels).backward()

    def ours(chunk):
        def run(h, w):
            triton_ops.linear_cross_entropy(h, w, labels, chunk_tokens=chunk).backward()
        return run

    cases = [("torch", torch_run)]
    lg = liger()
    if lg is not None:
        cases.append(("liger", lambda h, w: lg.liger_fused_linear_cross_entropy(h, w, labels).backward()))
        if sweep:
            for c in (2, 4):
                cases.append((f"liger chunk_mem_const={c}", lambda h, w, c=c: lg.liger_fused_linear_cross_entropy(
                    h, w, labels, chunk_mem_const=c).backward()))
    cases.append(("ours", lambda h, w: triton_ops.linear_cross_entropy(h, w, labels).backward()))
    if sweep:
        for chunk in (1024, 2048):
            cases.append((f"ours chunk_tokens={chunk}", ours(chunk)))
    return make, cases


def lce_breakdown(T: int, H: int, V: int, chunk: int, iters: int = 5) -> dict:
    """Milliseconds per stage summed over the chunks: projection (cuBLAS, ours), softmax kernel,
    dh, dW (cuBLAS addmm, ours)."""
    from triton_ops.kernels.cross_entropy import cross_entropy_rows_
    from benchmarks.experiments.lce_triton_gemms import accumulate_dw_, project_

    hidden = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    weight = (torch.randn(V, H, device="cuda") * H ** -0.5).to(torch.bfloat16)
    labels = torch.randint(0, V, (T,), device="cuda")
    buf = torch.empty(chunk, V, device="cuda", dtype=torch.bfloat16)
    dh, dw = torch.empty_like(hidden), torch.zeros_like(weight)
    loss_rows = torch.empty(T, device="cuda")
    inv = torch.full((1,), 1.0 / T, device="cuda")
    stages = {
        "project": lambda s: torch.mm(hidden[s:s + chunk], weight.t(), out=buf),
        "project (triton)": lambda s: project_(hidden[s:s + chunk], weight, buf),
        "softmax": lambda s: cross_entropy_rows_(buf, labels[s:s + chunk], loss_rows[s:s + chunk], inv),
        "dh": lambda s: torch.mm(buf, weight, out=dh[s:s + chunk]),
        "dW": lambda s: dw.addmm_(buf.t(), hidden[s:s + chunk]),
        "dW (triton, TMA reduction)": lambda s: accumulate_dw_(buf, hidden[s:s + chunk], dw, True, a_transposed=True),
    }
    out = {}
    for name, fn in stages.items():
        times = []
        for _ in range(iters + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if name == "softmax":       # then dh and dW read the softmax's gradients, as in the op
                torch.mm(hidden[:chunk], weight.t(), out=buf)
            start.record()
            for s in range(0, T, chunk):
                fn(s)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        out[name] = statistics.median(times[1:])
    return out


# ---------------------------------------------------------------- rms_norm, rope, swiglu

def norm_cases(B, S, H):
    x0 = torch.randn(B, S, H, device="cuda", dtype=torch.bfloat16)
    w0 = (1 + 0.1 * torch.randn(H, device="cuda")).to(torch.bfloat16)

    def make():
        return x0.detach().requires_grad_(), w0.detach().requires_grad_(), torch.randn_like(x0)

    cases = [("torch", lambda x, w, dy: reference.rms_norm(x, w, 1e-5).backward(dy))]
    lg = liger()
    if lg is not None:
        cases.append(("liger", lambda x, w, dy: lg.liger_rms_norm(x, w, 1e-5).backward(dy)))
    cases.append(("ours", lambda x, w, dy: triton_ops.rms_norm(x, w, 1e-5, in_place_backward=True).backward(dy)))
    return make, cases


def rope_cases(B, S, Hq, Hk, D):
    ang = torch.arange(S, device="cuda")[:, None] * torch.rand(D // 2, device="cuda")[None]
    cos = torch.cat([ang, ang], -1).cos()[None].to(torch.bfloat16)
    sin = torch.cat([ang, ang], -1).sin()[None].to(torch.bfloat16)

    def make():
        # As in attention: (B, H, S, D) views of the projections' (B, S, H*D) outputs.
        ql = torch.randn(B, S, Hq * D, device="cuda", dtype=torch.bfloat16).requires_grad_()
        kl = torch.randn(B, S, Hk * D, device="cuda", dtype=torch.bfloat16).requires_grad_()
        dq = torch.randn(B, Hq, S, D, device="cuda", dtype=torch.bfloat16)
        dk = torch.randn(B, Hk, S, D, device="cuda", dtype=torch.bfloat16)
        return ql, kl, ql * 1, kl * 1, dq, dk

    def views(q, k):
        return q.view(B, S, Hq, D).transpose(1, 2), k.view(B, S, Hk, D).transpose(1, 2)

    def run_with(fn):
        def run(ql, kl, q, k, dq, dk):
            qo, ko = fn(*views(q, k), cos, sin)
            torch.autograd.backward([qo, ko], [dq, dk])
        return run

    cases = [("torch", run_with(reference.rope))]
    lg = liger()
    if lg is not None:
        cases.append(("liger", run_with(lg.liger_rope)))
    cases.append(("ours", run_with(triton_ops.rope)))
    return make, cases


def swiglu_cases(B, S, inter):
    def make():
        # As in the MLP: the two inputs are non-leaf outputs (of gate_proj and up_proj).
        al = torch.randn(B, S, inter, device="cuda", dtype=torch.bfloat16).requires_grad_()
        bl = torch.randn(B, S, inter, device="cuda", dtype=torch.bfloat16).requires_grad_()
        return al, bl, al * 1, bl * 1, torch.randn_like(al)

    cases = [("torch", lambda al, bl, a, b, dc: reference.swiglu(a, b).backward(dc))]
    lg = liger()
    if lg is not None:
        cases.append(("liger", lambda al, bl, a, b, dc: lg.liger_swiglu(a, b).backward(dc)))
    cases.append(("ours", lambda al, bl, a, b, dc: triton_ops.swiglu(a, b, in_place_backward=True).backward(dc)))
    return make, cases


# ---------------------------------------------------------------- main

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", default="lce,rms_norm,rope,swiglu", help="comma-separated subset")
    parser.add_argument("--tokens", type=int, default=16384, help="loss-head tokens T")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--sweep", action="store_true", help="loss head: chunk sizes, schedules, stage breakdown")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    ops = args.ops.split(",")
    gpu = torch.cuda.get_device_name()
    T, H, V = args.tokens, 4096, 128256
    shapes = {
        "lce": (f"T={T} H={H} V={V}", lambda: lce_cases(T, H, V, args.sweep)),
        "rms_norm": ("x 4x2048x4096", lambda: norm_cases(4, 2048, 4096)),
        "rope": ("q 4x32x2048x128, k 4x8x2048x128", lambda: rope_cases(4, 2048, 32, 8, 128)),
        "swiglu": ("4x2048x14336", lambda: swiglu_cases(4, 2048, 14336)),
    }
    rows = []
    for op in ops:
        shape, build = shapes[op]
        make, cases = build()
        for name, run in cases:
            try:
                r = measure(make, run, args.warmup, args.iters, stream=op != "lce")
            except Exception as exc:  # an OOM or a missing feature of one provider
                r = {"error": f"{type(exc).__name__}: {str(exc)[:160]}"}
                torch.cuda.empty_cache()
            rows.append({"op": op, "shape": shape, "provider": name, **r})
            print(json.dumps(rows[-1]), flush=True)
        for row in rows:
            base = next((x for x in rows if x["op"] == op and x["provider"] == "liger" and "ms" in x), None)
            if row["op"] == op and base and "ms" in row:
                row["vs_liger"] = row["ms"] / base["ms"]
                if "stream_ms" in row and "stream_ms" in base:
                    row["stream_vs_liger"] = row["stream_ms"] / base["stream_ms"]
        del make, cases
        torch.cuda.empty_cache()
    result = {"gpu": gpu, "environment": environment(), "rows": rows}
    if "lce" in ops:
        flop = 3 * 2 * T * H * V
        result["lce_bound_ms"] = {"cublas_790_tflops": flop / CUBLAS_TFLOPS / 1e9,
                                  "peak": flop / peak_tflops(gpu) / 1e9 if peak_tflops(gpu) else None}
        if args.sweep:
            result["lce_breakdown_ms"] = {c: lce_breakdown(T, H, V, c) for c in (512, 1024)}
            print(json.dumps(result["lce_breakdown_ms"]))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    print(f"\n{gpu}; loss-head matmul bound: {result.get('lce_bound_ms')}")
    print(format_table(rows, [("op", "op", ""), ("shape", "shape", ""), ("provider", "provider", ""),
                              ("ms", "ms", ".2f"), ("vs_liger", "x Liger", ".3f"), ("gpu_ms", "kernel ms", ".2f"),
                              ("stream_ms", "ms in a stream", ".3f"), ("stream_vs_liger", "x Liger", ".3f"),
                              ("peak_gib", "peak extra GiB", ".3f"),
                              ("error", "error", "")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
