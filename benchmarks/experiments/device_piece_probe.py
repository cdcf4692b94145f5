"""The main thread's time to issue one piece of a device update in the backward, on the CPU path.

A device-updated layer (device_update.py) is updated in its backward piece by piece; the main
thread queues each piece's copies and update before it can queue the next layer's recompute. This
probe trains a small Llama with `adamw_8bit_bf16` and `device_update_share=0.5` on the CPU, with
tiny pieces (`--piece` elements) so that a layer has thousands of them, and the 8-bit update's
arithmetic replaced by its preamble (the constants, the kernel's arguments): what is left is what
the main thread pays per piece besides the kernel itself. On a GPU each device operation counted
here is also a launch.

    python benchmarks/experiments/device_piece_probe.py [--piece 256] [--hidden 256] [--steps 6]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from helpers import batches, make_pair  # noqa: E402

from hf_slideformer.engine import device_update  # noqa: E402
from hf_slideformer.host import adam8_torch  # noqa: E402


def preamble_only(hp, master, q1, q2, a1, a2, grad, step, key, ctr, scale=None, grad_mul=1.0, found_inf=None,
                  hyper=None):
    """`adamw8_range_torch` without its arithmetic: the constants and the kernel's arguments only."""
    hyper = hyper or adam8_torch.Hyper8(hp, scale, grad_mul, step, key)
    if hasattr(hyper, "kernel_args"):
        hyper.kernel_args(master.device)
    else:                                   # a tree from before the constants were made once per entry
        dev = master.device
        torch.stack([adam8_torch._dev_scalar(x, dev) for x in (hyper.gscale, hyper.bc2, hyper.neg_step)])
        hyper.key.to(dev, torch.int64).reshape(())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--piece", type=int, default=256, help="elements per piece (the engine's DEVICE_PIECE)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--steps", type=int, default=6, help="training steps; the first two are not counted")
    args = ap.parse_args()
    adam8_torch.adamw8_range_torch = preamble_only
    device_update.DEVICE_PIECE = args.piece
    device_update.device_piece = lambda numel, least: least     # every layer in pieces of --piece
    calls = []
    issue = device_update.DeviceUpdater.update_now

    def timed(self, place, grads, hp, found_inf):
        done = self.engine.stats.gpu_adam_params
        start = time.perf_counter()
        issue(self, place, grads, hp, found_inf)
        calls.append((time.perf_counter() - start, self.engine.stats.gpu_adam_params - done))

    device_update.DeviceUpdater.update_now = timed
    _, model = make_pair("llama", False, device_update_share=0.5, optimizer_state="adamw_8bit_bf16",
                         cfg_kw=dict(hidden_size=args.hidden, intermediate_size=4 * args.hidden))
    optimizer = model.create_optimizer(lr=1e-2)
    for batch in batches(args.steps, bsz=1, seq=8):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    counted = calls[len(calls) * 2 // args.steps:]
    seconds = sum(c[0] for c in counted)
    pieces = sum(c[1] for c in counted) / args.piece
    print(f"torch {torch.__version__}: {len(counted)} device updates of {pieces / len(counted):.0f} pieces: "
          f"{seconds / len(counted) * 1e3:.1f} ms an update, {seconds / pieces * 1e6:.0f} us a piece")


if __name__ == "__main__":
    main()
