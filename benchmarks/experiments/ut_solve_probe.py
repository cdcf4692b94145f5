"""The gated delta rule's UT transform solves, two ways, at the Qwen3.5-9B shape (batch 16 x 2048:
16 x 32 heads x 32 chunks = 16,384 unit lower-triangular 64 x 64 systems, 128 right-hand columns
each for the values and for the decayed keys):

    python3 benchmarks/experiments/ut_solve_probe.py [--batch 16]

- as the rule does it: two `torch.linalg.solve_triangular` calls (cuBLAS's batched solve, 3.2 ms
  each way per call on an H100 in the module's profile);
- through the inverse: one solve against the identity (64 right-hand columns), then two batched
  products; forward and forward + backward under autograd, and the largest relative difference.
If the second is clearly faster, the rule can take it on CUDA (the CPU path stays transformers'
bit for bit). CUDA only; CUDA events (the module probe's timer).
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gated_delta_probe import timed  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    n, c, d = args.batch * 32 * 32, 64, 128
    a = torch.randn(n, c, c, device="cuda").tril(-1) * 0.1 + torch.eye(c, device="cuda")
    b1, b2 = torch.randn(n, c, d, device="cuda"), torch.randn(n, c, d, device="cuda")
    eye = torch.eye(c, device="cuda").expand(n, c, c)

    def solves(a, b1, b2):
        return (torch.linalg.solve_triangular(a, b1, upper=False, unitriangular=True),
                torch.linalg.solve_triangular(a, b2, upper=False, unitriangular=True))

    def inverse(a, b1, b2):
        t = torch.linalg.solve_triangular(a, eye, upper=False, unitriangular=True)
        return t @ b1, t @ b2

    x, y = solves(a, b1, b2), inverse(a, b1, b2)
    diff = max(((u - v).abs().max() / u.abs().max()).item() for u, v in zip(x, y))
    leaves = [t.clone().requires_grad_() for t in (a, b1, b2)]
    grads = [torch.randn_like(b1), torch.randn_like(b2)]
    for name, fn in (("two solves", solves), ("inverse + two products", inverse)):
        fwd = timed(lambda: fn(a, b1, b2))
        both = timed(lambda: torch.autograd.backward(fn(*leaves), grads))
        print(f"{name:<24} forward {fwd:6.2f} ms   forward + backward {both:6.2f} ms")
    print(f"largest relative difference of the solutions: {diff:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
