"""Where the GPU memory of a slid training step goes: allocated against reserved, per phase.

The resident plan reads the reserved peak of the first step (engine note `[Why the plan measures
reserved memory]`), so memory the caching allocator holds without using it is memory no
resident unit gets. At the 8B shape, batch 16 under 24 GiB, the reserved peak was 23.9 GiB for
an allocated peak of 17.2 GiB (docs/benchmarks.md). This script measures that gap phase by phase
(forward, backward, optimizer step) for a few steps, with the allocator's own counters
(`torch.cuda.memory_stats`: active, inactive-split, reserved, retries), and can dump a memory
snapshot of the last step for `torch.cuda.memory._dump_snapshot`'s viewer.

Usage: python benchmarks/memory_profile.py --model llama3-8b --batch 16 --seq 2048 [--cap-gib 24]
           [--steps 3] [--slide-config '{...}'] [--snapshot out/mem.pickle] [--json out/mem.json]
On the CPU (`--device cpu --model tiny`) it runs the same steps and reports host memory only.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GIB = 2 ** 30
KEYS = ("allocated_bytes.all.peak", "active_bytes.all.peak", "inactive_split_bytes.all.peak",
        "reserved_bytes.all.peak", "num_alloc_retries", "num_device_alloc", "num_device_free")


def phase(device: torch.device, name: str) -> dict:
    """The allocator's counters since the last phase (peaks reset after reading)."""
    from soak import rss_bytes
    row = {"phase": name, "host_rss_gib": rss_bytes() / GIB}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        stats = torch.cuda.memory_stats(device)
        row.update({k: stats.get(k, 0) / (GIB if k.endswith("peak") else 1) for k in KEYS})
        row["allocated_now_gib"] = torch.cuda.memory_allocated(device) / GIB
        row["reserved_now_gib"] = torch.cuda.memory_reserved(device) / GIB
        torch.cuda.reset_peak_memory_stats(device)
    return row


def main() -> int:
    from providers.base import random_batch
    from soak import common_args, slid_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(ap, "llama3-8b")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--snapshot", default=None, help="dump the allocator's history of the last step here")
    args = ap.parse_args()

    config, device, model = slid_model(args)
    ids, _ = random_batch(config.vocab_size, args.batch, args.seq, device)
    opt = model.create_optimizer(lr=1e-5)
    rows = [phase(device, "start")]
    for step in range(args.steps):
        record = args.snapshot and device.type == "cuda" and step == args.steps - 1
        if record:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        loss = model(input_ids=ids, labels=ids).loss
        rows.append(dict(phase(device, "forward"), step=step))
        loss.backward()
        rows.append(dict(phase(device, "backward"), step=step))
        opt.step()
        opt.zero_grad()
        rows.append(dict(phase(device, "optimizer step"), step=step))
        if record:
            torch.cuda.memory._dump_snapshot(args.snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
    stats = model.slide_stats()
    result = {"model": args.model, "batch": args.batch, "seq": args.seq, "cap_gib": args.cap_gib,
              "resident_layers": stats.get("resident_layers"), "resident_embedding": stats.get("resident_embedding"),
              "rows": rows}
    cols = ["step", "phase", "allocated_bytes.all.peak", "reserved_bytes.all.peak", "inactive_split_bytes.all.peak",
            "num_alloc_retries", "host_rss_gib"]
    print(" | ".join(c.replace("_bytes.all.peak", " peak GiB") for c in cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.2f}" if isinstance(r.get(c), float) else str(r.get(c, "-")) for c in cols))
    print(f"resident: embedding {result['resident_embedding']}, layers {result['resident_layers']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
