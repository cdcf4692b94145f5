#!/usr/bin/env python
"""Host-side cost of one forward + backward of the small fused ops (ours vs Liger).

    python benchmarks/experiments/host_overhead_probe.py [--profile]

Per op: microseconds of host time per call (N calls without synchronizing, then one
synchronize), and with --profile the functions that take the host time (cProfile).
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402

import triton_ops  # noqa: E402


def cases():
    B, S, H, Hq, Hk, D = 4, 2048, 4096, 32, 8, 128
    x = torch.randn(B, S, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (1 + 0.1 * torch.randn(H, device="cuda")).to(torch.bfloat16).requires_grad_()
    dy = torch.randn_like(x)
    ang = torch.arange(S, device="cuda")[:, None] * torch.rand(D // 2, device="cuda")[None]
    cos = torch.cat([ang, ang], -1).cos()[None].to(torch.bfloat16)
    sin = torch.cat([ang, ang], -1).sin()[None].to(torch.bfloat16)
    ql = torch.randn(B, S, Hq * D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kl = torch.randn(B, S, Hk * D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dq = torch.randn(B, Hq, S, D, device="cuda", dtype=torch.bfloat16)
    dk = torch.randn(B, Hk, S, D, device="cuda", dtype=torch.bfloat16)

    def rope_run(fn):
        def run():
            q = (ql * 1).view(B, S, Hq, D).transpose(1, 2)
            k = (kl * 1).view(B, S, Hk, D).transpose(1, 2)
            qo, ko = fn(q, k, cos, sin)
            torch.autograd.backward([qo, ko], [dq, dk])
        return run

    out = {"rms ours": lambda: triton_ops.rms_norm(x, w, 1e-5, in_place_backward=True).backward(dy.clone()),
           "rope ours": rope_run(triton_ops.rope)}
    try:
        from liger_kernel.transformers import functional as lg
        out["rms liger"] = lambda: lg.liger_rms_norm(x, w, 1e-5).backward(dy.clone())
        out["rope liger"] = rope_run(lg.liger_rope)
    except Exception as e:  # noqa: BLE001
        print("no liger:", e)
    out["rms torch-clone-only"] = lambda: dy.clone()
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--profile", action="store_true")
    p.add_argument("--n", type=int, default=300)
    a = p.parse_args()
    for name, fn in cases().items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.n):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        print(f"{name:22s} host {1e6 * (t1 - t0) / a.n:7.1f} us/call  wall {1e6 * (t2 - t0) / a.n:7.1f} us/call",
              flush=True)
        if a.profile and ("ours" in name or "liger" in name):
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(100):
                fn()
            pr.disable()
            torch.cuda.synchronize()
            st = pstats.Stats(pr)
            st.sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
