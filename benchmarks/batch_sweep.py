"""Tokens/s of hf_slideformer over several batch sizes in one process (one model build), and the
smallest batch that reaches 90% of the best: the "how small a batch still saturates" figure.

Each batch gets its own warm-up steps (the engine re-plans its resident units when a batch is
larger than the one it planned for, so batches run from the largest down).

Usage: python benchmarks/batch_sweep.py --model llama3-3b --batches 16,12,10,8,6 [--cap-gib 24]
           [--steps 3] [--warmup 2] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv: list[str] | None = None) -> int:
    from providers.base import random_batch
    from soak import common_args, slid_model, train_step

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(ap, "llama3-3b")
    ap.add_argument("--batches", default="16,12,10,8,6", help="comma-separated, run largest first")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)

    config, device, model = slid_model(args)
    opt = model.create_optimizer(lr=1e-5)
    rows = []
    for batch in sorted({int(b) for b in args.batches.split(",")}, reverse=True):
        ids, _ = random_batch(config.vocab_size, batch, args.seq, device)
        times = [train_step(model, opt, ids, device) for _ in range(args.warmup + args.steps)][args.warmup:]
        step_s = statistics.median(times)
        stats = model.slide_stats()
        rows.append({"batch": batch, "step_s": step_s, "tokens_per_s": batch * args.seq / step_s,
                     "resident_layers": stats.get("resident_layers"),
                     "resident_embedding": stats.get("resident_embedding")})
        print(f"batch {batch:3d}: {rows[-1]['tokens_per_s']:9,.0f} tokens/s, step {step_s:.3f} s, resident "
              f"embedding {rows[-1]['resident_embedding']}, layers {rows[-1]['resident_layers']}", flush=True)
    best = max(r["tokens_per_s"] for r in rows)
    at90 = min((r["batch"] for r in rows if r["tokens_per_s"] >= 0.9 * best), default=None)
    print(f"best {best:,.0f} tokens/s; smallest batch at 90% of it: {at90}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "seq": args.seq, "rows": rows, "best_tokens_per_s": best,
                       "smallest_batch_at_90pct": at90}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
