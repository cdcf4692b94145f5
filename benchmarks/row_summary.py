#!/usr/bin/env python
"""One line per bench_train row: where a step's time went, per timed step.

    python benchmarks/row_summary.py out/*.json

Reads the JSON files `bench_train.py --json` writes and prints, for each result row, the step,
tokens/s and, for hf_slideformer rows, `slide_stats_per_step` (the counters' change over the timed
steps, divided by their count: the setup and warm-up steps are not in it), the allocator's
retries in the timed steps and the host's RSS at the end. The counters:
- gpu: the GPU's compute spans (kernels of the layers, the head and the embedding);
- adam / busy / wait: the CPU worker's AdamW, all its tasks, and its waits inside them
  (for gradients to land);
- buf / upd: the main thread waiting for a free gradient buffer / for an update the next
  forward needs.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

COLUMNS = (("gpu", "gpu_compute_s"), ("adam", "cpu_adam_s"), ("busy", "worker_busy_s"), ("wait", "worker_wait_s"),
           ("buf", "wait_grad_buffer_s"), ("upd", "wait_update_s"))


def rows(doc: dict, name: str) -> list[str]:
    """The summary lines of one bench_train JSON document (`name` labels them)."""
    out = []
    for r in doc.get("results", []):
        if r.get("status") != "ok":
            out.append(f"{name} {r.get('provider')}: {r.get('status')}")
            continue
        line = f"{name} {r.get('provider')} b{r.get('batch')}: {r['tokens_per_s']:,.0f} tok/s, step {r['step_s']:.3f} s"
        per_step = (r.get("extra") or {}).get("slide_stats_per_step") or {}
        parts = [f"{label} {per_step[key]:.2f}" for label, key in COLUMNS
                 if isinstance(per_step.get(key), (int, float))]
        if parts:
            line += " | per step: " + ", ".join(parts)
        if r.get("gpu_alloc_retries") is not None:
            line += f" | retries {r['gpu_alloc_retries']}"
        if r.get("host_rss_end"):
            line += f" | RSS {r['host_rss_end'] / 2 ** 30:.1f} GiB"
        out.append(line)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="bench_train.py --json files")
    args = ap.parse_args(argv)
    status = 0
    for f in args.files:
        try:
            doc = json.loads(Path(f).read_text())
        except (OSError, ValueError) as e:
            print(f"{f}: unreadable ({e})", file=sys.stderr)
            status = 1
            continue
        if not isinstance(doc, dict) or "results" not in doc:
            print(f"{f}: not a bench_train.py --json file (no 'results')", file=sys.stderr)
            status = 1
            continue
        for line in rows(doc, Path(f).stem):
            print(line)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
