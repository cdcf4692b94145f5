"""How long a thread takes to queue stream operations behind a wait the GPU has not reached yet.

A device-updated layer (device_update.py) is queued in its backward as many small operations on
the h2d and d2h streams (per piece: the gradient's slice, the state's copies in, the update, the
copies back, the events), behind a wait for the layer's backward on the compute stream. If the
device's queue of pending work has a bounded capacity, the thread that queues past it blocks
until the GPU has run the head of the queue, and the next layer's recompute, queued by the same
thread afterwards, starts late. This probe keeps the compute stream busy (`torch.cuda._sleep`),
makes a copy stream wait for it, queues N operations there (small pinned copies in and small
kernels, alternated) and prints the thread's time per operation: flat while the queue has room,
then each operation waits for the GPU.

    python benchmarks/experiments/device_issue_probe.py [--ops 4096] [--sleep-ms 300]

Prints the total issue time, the index of the first operation that took over 1 ms (none: the
queue never filled) and the issue time of each eighth of the operations.
"""
from __future__ import annotations

import argparse
import time

import torch


def cycles_per_ms(device: torch.device) -> float:
    """`torch.cuda._sleep` cycles in a millisecond on `device`, measured."""
    torch.cuda._sleep(1000)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", type=int, default=4096, help="operations queued behind the wait")
    ap.add_argument("--sleep-ms", type=float, default=300.0, help="how long the compute stream stays busy")
    ap.add_argument("--bytes", type=int, default=1 << 16, help="bytes per copy")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("device_issue_probe.py needs a CUDA device")
    device = torch.device("cuda")
    copies = torch.cuda.Stream(device)
    src = torch.empty(args.bytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(args.bytes, dtype=torch.uint8, device=device)
    small = torch.zeros(1024, device=device)
    rate = cycles_per_ms(device)
    with torch.cuda.stream(copies):          # each operation once first: nothing loads lazily behind the wait
        dst.copy_(src, non_blocking=True)
        small.add_(1.0)
    torch.cuda.synchronize(device)

    torch.cuda._sleep(int(args.sleep_ms * rate))         # the compute stream: the layer's backward
    busy = torch.cuda.Event()
    busy.record()
    copies.wait_event(busy)
    times = []
    with torch.cuda.stream(copies):
        for index in range(args.ops):
            start = time.perf_counter()
            if index % 2:
                small.add_(1.0)
            else:
                dst.copy_(src, non_blocking=True)
            times.append(time.perf_counter() - start)
    issued = sum(times)
    torch.cuda.synchronize(device)
    first_slow = next((i for i, t in enumerate(times) if t > 1e-3), None)
    eighths = [sum(times[i * args.ops // 8:(i + 1) * args.ops // 8]) * 1e3 for i in range(8)]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}: {args.ops} operations behind a "
          f"{args.sleep_ms:.0f} ms wait issued in {issued * 1e3:.1f} ms; first over 1 ms: "
          f"{first_slow if first_slow is not None else 'none'}")
    print("issue time per eighth (ms): " + " ".join(f"{e:.1f}" for e in eighths))


if __name__ == "__main__":
    main()
