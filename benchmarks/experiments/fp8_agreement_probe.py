"""Does the engine's FP8 linear compute what torchao's rowwise Float8Linear computes? One projection,
forward and both gradients, in five ways against an fp64 reference:

    python3 benchmarks/experiments/fp8_agreement_probe.py [--tokens 2048] [--hidden 2048] [--out 8192]

- bf16: `F.linear` on bf16 operands (the slid model's bf16 mode);
- autocast: `F.linear` on an fp32 weight under bf16 autocast (the GPU-resident arm of
  benchmarks/fp8_quality.py);
- fp8 / fp8_gw_hp: the engine's `Fp8Linear` on the bf16 weight (its two recipes);
- torchao: torchao's `Float8Linear` (the "rowwise" recipe) on the fp32 weight under bf16 autocast,
  as the quality run's torchao arm converts the decoder layers.

For y, dx and dw it prints the relative error to the reference (||a - ref|| / ||ref||), the
ratio of norms (||a|| / ||ref||: 1 unless the way scales or rounds the result as a whole) and the
cosine to the reference. The operands are drawn as a trained layer sees them (weights N(0, 0.02),
inputs with a few outlier features, output gradients 1e-3), seeded. The quality run of
docs/benchmarks.md ("FP8 quality") has torchao's arm 10-17% below bf16 in its first 40 steps,
where the engine's FP8 is within 1%: a norm ratio or error far from the engine's here says the
recipes differ in what they compute, not in their noise.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hf_slideformer.compute.fp8 import CudaFp8, EmulatedFp8, Fp8Linear, QuantizedWeight  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"      # cpu: the recipe's emulation (a smoke test)


def operands(m: int, k: int, n: int, seed: int):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(m, k, device=DEVICE, generator=g)
    x[:, torch.randperm(k, device=DEVICE, generator=g)[:8]] *= 20            # a few outlier features
    w = torch.randn(n, k, device=DEVICE, generator=g) * 0.02
    gy = torch.randn(m, n, device=DEVICE, generator=g) * 1e-3
    return x, w, gy


def run(kind: str, x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor):
    """(y, dx, dw) of one way of computing x @ w.T, all as float64."""
    ops = CudaFp8() if DEVICE == "cuda" else EmulatedFp8()
    if kind == "reference":
        xs, ws = x.double().requires_grad_(), w.double().requires_grad_()
        y = F.linear(xs, ws)
        y.backward(gy.double())
    elif kind == "bf16":
        xs, ws = x.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
        y = F.linear(xs, ws)
        y.backward(gy.bfloat16())
    elif kind == "autocast":
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            y = F.linear(xs, ws)
        y.backward(gy.bfloat16())
    elif kind in ("fp8", "fp8_gw_hp"):
        hp = kind == "fp8_gw_hp"
        xs, ws = x.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
        y = Fp8Linear.apply(xs, ws, None, QuantizedWeight(ws, ops, hp), ops, True, None, hp)
        y.backward(gy.bfloat16())
    elif kind == "torchao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        lin = torch.nn.Sequential(torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=DEVICE))
        with torch.no_grad():
            lin[0].weight.copy_(w)
        convert_to_float8_training(lin, config=Float8LinearConfig.from_recipe_name("rowwise"))
        xs, ws = x.clone().requires_grad_(), lin[0].weight
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            y = lin(xs)
        y.backward(gy.bfloat16())
    else:
        raise ValueError(kind)
    return y.detach().double(), xs.grad.double(), ws.grad.double()


def compare(a: torch.Tensor, ref: torch.Tensor) -> str:
    err = ((a - ref).norm() / ref.norm()).item()
    ratio = (a.norm() / ref.norm()).item()
    cos = F.cosine_similarity(a.flatten(), ref.flatten(), dim=0).item()
    return f"err {err:8.2e}  norm x{ratio:.5f}  cos {cos:.6f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--out", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    x, w, gy = operands(args.tokens, args.hidden, args.out, args.seed)
    ref = run("reference", x, w, gy)
    for kind in ("bf16", "autocast", "fp8", "fp8_gw_hp", "torchao"):
        try:
            got = run(kind, x, w, gy)
        except Exception as exc:                 # torchao missing or refusing: say so, go on
            print(f"{kind:10s} not run: {type(exc).__name__}: {exc}")
            continue
        for name, a, r in zip(("y", "dx", "dw"), got, ref):
            print(f"{kind:10s} {name:3s} {compare(a, r)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
