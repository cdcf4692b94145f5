"""The gated delta rule's scan over chunks at the Qwen3.5-9B shape: the torch loop against the Triton
kernels (`triton_ops/kernels/chunk_scan.py`) at each launch setting, forward and backward apart.

    python3 benchmarks/experiments/chunk_scan_probe.py [--batch 16] [--seq 2048]

Inputs: batch x 32 value heads, chunks of 64, key and value width 128 (the 9B layer's), built as
tests/test_chunk_scan.py builds them. For each setting (value columns per program, warps, stages,
the products' precision: fp32 `ieee`, three TF32
products `tf32x3`, one `tf32` for its speed) it prints the median of 5 timed calls after 2 warm-up each way, and the
largest difference from the loop relative to the loop's largest magnitude (forward: corrected
values and states; backward: dV and the states' gradients). A setting that fails to compile or
run is printed with its error and skipped.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from triton_ops.gated_delta import _ChunkScan  # noqa: E402
from triton_ops.kernels import chunk_scan  # noqa: E402


def _time(fn, reps=5, warmup=2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    args = p.parse_args(argv)
    b, h, c, dk, dv = args.batch, 32, 64, 128, 128
    n = args.seq // c
    g = torch.Generator(device="cuda").manual_seed(0)

    def rows(*shape):
        x = torch.randn(*shape, device="cuda", generator=g)
        return x / x.norm(dim=-1, keepdim=True)

    key, k_cumdecay = rows(b, h, n, c, dk), rows(b, h, n, c, dk) * 0.5
    new_values = torch.randn(b, h, n, c, dv, device="cuda", generator=g)
    decay = 0.3 + 0.7 * torch.rand(b, h, n, device="cuda", generator=g)
    s0 = torch.randn(b, h, dk, dv, device="cuda", generator=g)
    from_out = torch.randn(b, h, n, c, dv, device="cuda", generator=g)
    q_out = torch.randn(b, h, n, dk, dv, device="cuda", generator=g) * 0.1
    d_final = torch.randn(b, h, dk, dv, device="cuda", generator=g)

    fwd_args = (key, new_values, k_cumdecay, decay, s0)
    bwd_args = (key, k_cumdecay, decay, from_out, q_out, d_final)
    ref_f = _ChunkScan._scan(*fwd_args)
    ref_b = _ChunkScan._scan_back(*bwd_args)
    print(f"shape: batch x heads {b * h}, {n} chunks of {c}, key {dk}, value {dv}")
    print(f"torch loop            forward {_time(lambda: _ChunkScan._scan(*fwd_args)):7.2f} ms   "
          f"backward {_time(lambda: _ChunkScan._scan_back(*bwd_args)):7.2f} ms")
    default = dict(chunk_scan.CONFIG)
    rows_out = []
    settings = ([(bv, w, 1, "ieee") for bv, w in itertools.product((16, 32), (4, 8))]
                + [(bv, w, s, "tf32x3") for bv, w, s in itertools.product((16, 32, 64), (4, 8), (1, 2))]
                + [(32, 4, 1, "tf32"), (64, 4, 2, "tf32"), (64, 8, 2, "tf32")])
    for bv, warps, stages, prec in settings:
        cfg = {"block_v": bv, "num_warps": warps, "num_stages": stages, "precision": prec}
        chunk_scan.CONFIG.clear()
        chunk_scan.CONFIG.update(cfg)
        name = f"v{bv} w{warps} s{stages} {prec}"
        try:
            f = chunk_scan.scan_forward(*fwd_args)
            bk = chunk_scan.scan_backward(*bwd_args)
            err_f = max(_rel(f[1], ref_f[1]), _rel(f[0], ref_f[0]), _rel(f[2], ref_f[2]))
            err_b = max(_rel(bk[1], ref_b[1]), _rel(bk[0], ref_b[0]), _rel(bk[2], ref_b[2]))
            tf = _time(lambda: chunk_scan.scan_forward(*fwd_args))
            tb = _time(lambda: chunk_scan.scan_backward(*bwd_args))
        except Exception as e:              # a setting that does not compile here: say so, go on
            print(f"{name:<22}failed: {type(e).__name__}: {str(e)[:160]}")
            continue
        rows_out.append((tf + tb, name))
        print(f"{name:<22}forward {tf:7.2f} ms   backward {tb:7.2f} ms   difference {err_f:.1e} / {err_b:.1e}")
    chunk_scan.CONFIG.clear()
    chunk_scan.CONFIG.update(default)
    for total, name in sorted(rows_out)[:5]:
        print(f"fastest: {name:<22} {total:7.2f} ms forward + backward")
    return 0


if __name__ == "__main__":
    sys.exit(main())
