#!/usr/bin/env python
"""The loss head's projection and dW update: cuBLAS against triton_ops' own GEMMs, per config.

    python benchmarks/experiments/lce_triton_probe.py [--chunk 512] [--quick]

Shapes: T = 16384 tokens, H = 4096, V = 128256, bf16, summed over the T / C chunks (median of 5,
ms) with TFLOP/s. Every Triton config is checked against torch before it is timed. Also times dh
(cuBLAS) and dW on two streams at once, the chunk's two independent GEMMs.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import triton  # noqa: E402

from benchmarks.experiments.lce_gemm_probe import timed  # noqa: E402
from benchmarks.experiments.lce_triton_gemms import GemmConfig, accumulate_dw_, project_  # noqa: E402


def _proj(a, b, m, n, cfg, m_fastest=True, stats=None):
    out = torch.empty(m, n, device="cuda", dtype=a.dtype)
    project_(a, b, out, cfg, m_fastest, stats)
    return out


def _dw(a, b, m, n, cfg, a_t):
    out = torch.full((m, n), float("nan"), device="cuda", dtype=a.dtype)
    accumulate_dw_(a, b, out, False, cfg, a_t)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--T", type=int, default=16384)
    p.add_argument("--H", type=int, default=4096)
    p.add_argument("--V", type=int, default=128256)
    a = p.parse_args()
    T, H, V, C = a.T, a.H, a.V, a.chunk
    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(T, H, device="cuda", dtype=dt, generator=g)
    weight = (torch.randn(V, H, device="cuda", generator=g) * H ** -0.5).to(dt)
    buf = (torch.randn(C, V, device="cuda", generator=g) * 1e-4).to(dt)
    dw = torch.zeros(V, H, device="cuda", dtype=dt)
    dh = torch.empty(T, H, device="cuda", dtype=dt)
    starts = list(range(0, T, C))
    flop = 2.0 * T * H * V
    rows = []

    def report(name, ms):
        rows.append((name, ms))
        print(f"{name:44s} {ms:7.2f} ms {flop / ms / 1e9:6.0f} TFLOP/s", flush=True)

    report("cublas proj", timed(lambda s: torch.mm(hidden[s:s + C], weight.t(), out=buf), starts))
    report("cublas dh", timed(lambda s: torch.mm(buf, weight, out=dh[s:s + C]), starts))
    report("cublas dW addmm", timed(lambda s: dw.addmm_(buf.t(), hidden[s:s + C]), starts))

    bufT = buf.t().contiguous()                                          # (V, C)
    report("cublas dh (logits.T layout)", timed(lambda s: torch.mm(bufT.t(), weight, out=dh[s:s + C]), starts))
    report("cublas dW addmm (logits.T layout)", timed(lambda s: dw.addmm_(bufT, hidden[s:s + C]), starts))
    h0 = hidden[:C]
    ref_proj = h0.float() @ weight.float().t()
    ref_dw = buf.float().t() @ h0.float()
    best = {}

    def trial(name, run_once, check, fn):
        try:
            out = run_once()
            err = check(out)
            del out
            torch.cuda.synchronize()
            if err > 2e-2:
                print(f"{name}: WRONG (rel err {err:.3g})", flush=True)
                return
            ms = timed(fn, starts)
            report(f"{name} err {err:.1e}", ms)
            kind = name.split(" ")[1]
            if kind not in best or ms < best[kind][1]:
                best[kind] = (name, ms)
        except Exception as e:  # noqa: BLE001  (a config that does not compile or fit)
            print(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:100]}", flush=True)
            torch.cuda.synchronize()

    rel = lambda out, ref: ((out.float() - ref).abs().max() / ref.abs().max()).item()  # noqa: E731
    nm = lambda bm: triton.cdiv(V, bm)  # noqa: E731
    proj_cfgs = [(128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (256, 128, 64, 3, 8), (128, 128, 64, 5, 4)]
    for ws in (False, True):
        cfg = GemmConfig(128, 256, 64, 3, 8, ws=ws)
        trial(f"triton proj {cfg}", lambda: _proj(h0, weight, C, V, cfg), lambda o: rel(o, ref_proj),
              lambda s, cfg=cfg: project_(hidden[s:s + C], weight, buf, cfg))
        for c in proj_cfgs:
            cfg = GemmConfig(*c, ws=ws)
            for st in (False, True):
                stats = (torch.empty(nm(cfg.bm), C, device="cuda"), torch.empty(nm(cfg.bm), C, device="cuda"))
                trial(f"triton projT{'+stats' if st else ''} {cfg}",
                      lambda: _proj(weight, h0, V, C, cfg, False, stats if st else None), lambda o: rel(o, ref_proj.t()),
                      lambda s, cfg=cfg, st=st, stats=stats: project_(weight, hidden[s:s + C], bufT, cfg, False,
                                                                      stats if st else None))
    dw_cfgs = [(128, 256, 64, 3, 8), (128, 256, 64, 2, 8), (128, 128, 64, 4, 8), (256, 128, 64, 3, 8),
               (128, 128, 128, 3, 8), (128, 256, 128, 2, 8)]
    variants = [("noacc", False, False), ("reduce", True, True), ("rmw", True, False)]
    for c in dw_cfgs:
        cfg = GemmConfig(*c)
        for a_t in (False, True):
            A = buf if a_t else bufT
            for vname, acc, red in variants:
                if vname == "rmw" and cfg.stages > 2:
                    continue
                trial(f"triton dW{'(A.T)' if a_t else ''} {vname} {cfg}",
                      lambda: _dw(A, h0, V, H, cfg, a_t), lambda o: rel(o, ref_dw),
                      lambda s, cfg=cfg, a_t=a_t, A=A, acc=acc, red=red: accumulate_dw_(
                          A, hidden[s:s + C], dw, acc, cfg, a_t, red))

    # the two projection layouts and cuBLAS, interleaved three times (the clocks drift between runs)
    cfg = GemmConfig(128, 256, 64, 3, 8)
    for rep in range(3):
        report(f"[{rep}] cublas proj", timed(lambda s: torch.mm(hidden[s:s + C], weight.t(), out=buf), starts))
        report(f"[{rep}] triton proj {cfg}", timed(lambda s: project_(hidden[s:s + C], weight, buf, cfg), starts))
        report(f"[{rep}] triton projT {cfg}",
               timed(lambda s: project_(weight, hidden[s:s + C], bufT, cfg, False), starts))
        report(f"[{rep}] cublas dW addmm", timed(lambda s: dw.addmm_(buf.t(), hidden[s:s + C]), starts))
        report(f"[{rep}] triton dW(A.T) reduce {cfg}",
               timed(lambda s: accumulate_dw_(buf, hidden[s:s + C], dw, True, cfg, True), starts))

    # dh and dW of a chunk on two streams (both read the chunk's gradient, write different outputs)
    side = torch.cuda.Stream()

    def two_streams(dw_fn):
        def run(s):
            ev = torch.cuda.Event()
            ev.record()
            side.wait_event(ev)
            with torch.cuda.stream(side):
                dw_fn(s)
            torch.mm(buf, weight, out=dh[s:s + C])
            torch.cuda.current_stream().wait_stream(side)
        return run

    report("dh + cublas dW sequential", timed(
        lambda s: (torch.mm(buf, weight, out=dh[s:s + C]), dw.addmm_(buf.t(), hidden[s:s + C])), starts))
    report("dh || cublas dW (two streams)", timed(two_streams(lambda s: dw.addmm_(buf.t(), hidden[s:s + C])), starts))
    print("\nbest:", {k: (v[0], round(v[1], 2)) for k, v in best.items()})
    print("summary (ms, TFLOP/s)")
    for name, ms in rows:
        print(f"  {name:44s} {ms:7.2f} {flop / ms / 1e9:6.0f}")


if __name__ == "__main__":
    main()
