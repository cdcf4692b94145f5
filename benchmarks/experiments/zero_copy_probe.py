"""A device update without pieces: the 8-bit update's Triton kernel reading and writing the pinned
host state in place (zero-copy through unified addressing), against today's pieces (copies in, the
update in a device buffer, copies back), each alone and beside a matmul load on the compute stream.

A device-updated layer (device_update.py) is today cut into pieces: per piece the state's five
arrays cross in on the h2d stream, the update runs there, and they cross back on the d2h stream,
about fifteen stream operations a piece that the backward's thread queues one by one
(docs/host_state.md, "Host-bound steps: part of the update on the GPU"). Pinned host memory is
addressable from the GPU, so one launch of the same kernel on the host arrays would do the same
update with no piece buffers, copies or events; its costs are the PCIe efficiency of the kernel's
own accesses and the SMs it holds while it waits on them. This probe measures both, for a range
of N parameters of `adamw_8bit_bf16` state (bf16 master, two 8-bit code arrays, two block-scale
arrays) with a bf16 gradient on the device:

- `pieces`: today's way, pieces of `--piece` elements through two device buffer sets, the copies
  on two copy streams and the update on the h2d stream (`PieceSets`' order);
- `zero-copy`: one launch of `_adamw8_kernel` on the pinned host arrays, on a side stream;
- each again beside `--gemms` bf16 matmuls of 8192^3 on the compute stream: the matmuls' time
  against their time alone says what the update takes from the layer's backward.

Both ways give the same state bit for bit (checked: the same kernel on the same values).

    python benchmarks/experiments/zero_copy_probe.py [--numel 268435456] [--piece 16777216] [--gemms 20]

Prints, per way: the update's time and the PCIe bytes it moved per second, then the matmuls' time
alone and beside it. CUDA only.
"""
from __future__ import annotations

import argparse
import time

import torch

BLOCK = 256


def state(numel: int, seed: int) -> dict[str, torch.Tensor]:
    """Pinned host arrays of an `adamw_8bit_bf16` range: a bf16 master, two code arrays, two scales."""
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-numel // BLOCK)
    arrays = {"master": (torch.randn(numel, generator=gen) * 0.02).to(torch.bfloat16),
              "q1": torch.randint(0, 256, (numel,), generator=gen, dtype=torch.uint8),
              "q2": torch.randint(0, 256, (numel,), generator=gen, dtype=torch.uint8),
              "a1": torch.rand(blocks, generator=gen) * 1e-3,
              "a2": torch.rand(blocks, generator=gen) * 1e-6}
    return {name: tensor.pin_memory() for name, tensor in arrays.items()}


def launch(kernel, tables, args_dev, key, arrays, grad, ctr: int) -> None:
    """One launch of the 8-bit kernel over `arrays` (device buffers or pinned host arrays)."""
    from triton_ops.kernels.adamw8 import ROWS
    import triton

    n = arrays["master"].numel()
    code1, code2, lut1, lut2 = tables
    grid = (triton.cdiv(triton.cdiv(n, BLOCK), ROWS),)
    kernel[grid](arrays["master"], arrays["q1"], arrays["q2"], arrays["a1"], arrays["a2"], grad, code1, code2,
                 lut1, lut2, args_dev, key, args_dev, n, ctr, 1.0, 0.9, 0.1, 0.999, 0.001, 1e-8,
                 ROWS=ROWS, BLOCK=BLOCK, BF16=True, HAS_SKIP=False, num_warps=4, enable_fp_fusion=False)


def by_pieces(host, grad, piece: int, run, streams, buffers) -> None:
    """Today's order: per piece the arrays in on h2d, the update there, the arrays back on d2h."""
    h2d, d2h = streams
    free = [None, None]
    n = host["master"].numel()
    for turn, lo in enumerate(range(0, n, piece)):
        hi = min(n, lo + piece)
        b0, b1 = lo // BLOCK, -(-hi // BLOCK)
        bufs = buffers[turn % 2]
        views = {k: (bufs[k][:hi - lo], host[k][lo:hi]) if k in ("master", "q1", "q2")
                 else (bufs[k][:b1 - b0], host[k][b0:b1]) for k in host}
        if free[turn % 2] is not None:
            h2d.wait_event(free[turn % 2])
        with torch.cuda.stream(h2d):
            for dev, src in views.values():
                dev.copy_(src, non_blocking=True)
            run({k: dev for k, (dev, _) in views.items()}, grad[lo:hi], lo)
            done = torch.cuda.Event()
            done.record(h2d)
        d2h.wait_event(done)
        with torch.cuda.stream(d2h):
            for dev, dst in views.values():
                dst.copy_(dev, non_blocking=True)
            free[turn % 2] = torch.cuda.Event()
            free[turn % 2].record(d2h)


def timed(fn, repeat: int = 3) -> float:
    """Median seconds of `fn()` (synchronized before and after)."""
    out = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - start)
    return sorted(out)[len(out) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=1 << 28, help="parameters updated (a 24B layer has about 590 M)")
    ap.add_argument("--piece", type=int, default=1 << 24, help="elements per piece of today's way")
    ap.add_argument("--gemms", type=int, default=20, help="8192^3 bf16 matmuls of the compute load")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("zero_copy_probe.py needs a CUDA device")
    from hf_slideformer.host.adam8_torch import _tables
    from triton_ops.kernels.adamw8 import _adamw8_kernel

    dev = torch.device("cuda")
    tables = _tables(dev)
    args_dev = torch.tensor([1.0, 0.05, -1e-4], device=dev)         # gradient scale, bc2, neg_step
    key = torch.tensor(12345, dtype=torch.int64, device=dev)
    n, piece = args.numel, args.piece
    grad = (torch.randn(n, device=dev) * 1e-3).to(torch.bfloat16)
    reference, host = state(n, 0), state(n, 0)
    streams = (torch.cuda.Stream(dev), torch.cuda.Stream(dev))
    side = torch.cuda.Stream(dev)
    buffers = [{k: torch.empty(piece if k in ("master", "q1", "q2") else -(-piece // BLOCK) + 1,
                               dtype=v.dtype, device=dev) for k, v in host.items()} for _ in range(2)]

    def run(arrays, g, ctr):
        launch(_adamw8_kernel, tables, args_dev, key, arrays, g, ctr)

    def pieces():
        by_pieces(reference, grad, piece, run, streams, buffers)

    def zero_copy():
        with torch.cuda.stream(side):
            run(host, grad, 0)

    pieces()
    try:
        zero_copy()                      # one step each, same values: must agree bit for bit
        torch.cuda.synchronize()
    except Exception as exc:             # e.g. a Triton that refuses host pointers
        print(f"zero-copy launch failed: {type(exc).__name__}: {exc}")
        return
    same = all(torch.equal(reference[k], host[k]) for k in host)
    moved = n * (2 + 1 + 1) * 2 + 2 * 4 * -(-n // BLOCK) * 2           # state in and back, bytes
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def gemms():
        for _ in range(args.gemms):
            torch.mm(a, b)

    alone = timed(gemms)
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}: {n / 2**20:.0f} M parameters, "
          f"{moved / 1e9:.2f} GB of state in and back; the two ways agree bit for bit: {same}")
    print(f"matmuls alone: {alone * 1e3:.1f} ms")
    for name, fn in (("pieces", pieces), ("zero-copy", zero_copy)):
        t = timed(fn)

        def both():
            fn()
            gemms()
        beside = timed(both)
        print(f"{name:10s} update alone {t * 1e3:7.1f} ms ({moved / t / 1e9:5.1f} GB/s)  "
              f"update + matmuls together {beside * 1e3:7.1f} ms (matmuls alone {alone * 1e3:.1f})")


if __name__ == "__main__":
    main()
