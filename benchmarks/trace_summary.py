"""Summarize a step trace written by the slide provider (SLIDE_TRACE=path): per step, the GPU's
busy and idle time, the worker's Adam / wait / other time, the main thread's waits by reason, and
the longest GPU idle gaps with what the main thread and the worker were doing during them and
the copies that ended then (C:fill / input / update / gradients: the copy the GPU may have waited
for; the time each kind of copy was in flight is the step's "copies" line).

Usage: python benchmarks/trace_summary.py trace.json [--gaps 8]
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict


def overlap(a0, a1, b0, b1):
    return max(0.0, min(a1, b1) - max(a0, b0))


def slow_spans(events, factor: float = 1.2, k: int = 3) -> list[str]:
    """GPU spans (one per layer's work) more than `factor` x the median of their k neighbours on
    either side: a stall inside a layer's work, as a stream waiting for a copy or the caching
    allocator's synchronising retry. The longest span of the step (the head) is left out; the
    time above the neighbours' median is summed."""
    spans = sorted((a, b - a) for th, _, a, b in events if th == "gpu")
    if len(spans) < 2 * k + 1:
        return []
    longest = max(range(len(spans)), key=lambda j: spans[j][1])
    slow = []
    def median(side):
        xs = sorted(x for _, x in side)
        return xs[len(xs) // 2] if xs else 0.0
    for j, (_, d) in enumerate(spans):
        # the larger side's median: a span where the work changes (backward to forward) is like one side
        med = max(median(spans[max(0, j - k):j]), median(spans[j + 1:j + 1 + k]))
        if j != longest and d > factor * med:
            slow.append((d, med))
    if not slow:
        return []
    return [f"  slow GPU spans: {len(slow)} of {len(spans)} over {factor:g}x their neighbours, "
            f"{sum(d - m for d, m in slow) * 1e3:.0f} ms above them ("
            + ", ".join(f"{d * 1e3:.0f}/{m * 1e3:.0f}" for d, m in slow[:8]) + " ms)"]


def sweep(spans, s0: float, s1: float) -> tuple[float, list]:
    """The time inside [s0, s1] that `spans` ((start, end) pairs) cover, overlaps counted once, and
    the gaps between them: (covered seconds, [(gap, start, end)])."""
    busy, last, idle = 0.0, s0, []
    for a, b in sorted((max(a, s0), min(b, s1)) for a, b in spans):
        if a > last:
            idle.append((a - last, last, a))
        busy += max(0.0, b - max(a, last))
        last = max(last, b)
    if s1 > last:
        idle.append((s1 - last, last, s1))
    return busy, idle


def copy_busy(copies, s0: float, s1: float) -> dict:
    """Seconds inside [s0, s1] during which a copy of each kind (fill, input, update, gradients:
    the label's prefix) was in flight, overlapping spans of one kind counted once."""
    kinds = sorted({lab.split(":")[0] for _, lab, _, _ in copies})
    return {kind: sweep([(a, b) for _, lab, a, b in copies if lab.split(":")[0] == kind], s0, s1)[0]
            for kind in kinds}


def summarize(events, gaps: int = 8) -> str:
    steps = [e[2] for e in events if e[1] == "step"]
    lines = []
    for s0, s1 in zip(steps, steps[1:]):
        inside = [e for e in events if e[3] > s0 and e[2] < s1]
        busy, idle = sweep([(e[2], e[3]) for e in inside if e[0] == "gpu"], s0, s1)
        by = defaultdict(float)
        for th, label, a, b in inside:
            if th in ("gpu", "copy") or a == b:
                continue
            kind = label.split(":")[0]
            by[("worker" if "worker" in th else "main", kind)] += overlap(a, b, s0, s1)
        fb = [e[2] for e in inside if e[1] == "backward_begin"]
        be = [e[2] for e in inside if e[1] == "backward_end"]
        lines.append(f"step {s1 - s0:.3f}s  gpu busy {busy:.3f}s ({busy / (s1 - s0):.0%})  "
                     f"backward {((be[0] - fb[0]) if fb and be else float('nan')):.3f}s")
        lines.append("  " + "  ".join(f"{th}.{k} {v:.3f}" for (th, k), v in sorted(by.items())))
        copies = [e for e in inside if e[0] == "copy"]
        if copies:
            lines.append("  copies " + "  ".join(f"{k} {v:.3f}" for k, v in sorted(copy_busy(copies, s0, s1).items())))
        lines.extend(slow_spans([e for e in inside if s0 <= e[2] < s1]))
        for d, a, b in sorted(idle, reverse=True)[:gaps]:
            what = sorted({f"{'W' if 'worker' in th else 'M'}:{lab}" for th, lab, x, y in inside
                           if th not in ("gpu", "copy") and overlap(x, y, a, b) > 0.3 * d})
            # the copies that end inside the gap or just after it: what the GPU may have waited for
            what += sorted({f"C:{lab}" for th, lab, x, y in copies if a < y <= b + 0.5e-3})
            lines.append(f"  idle {d * 1e3:6.1f} ms at +{(a - s0) * 1e3:7.1f} ms: {', '.join(what)[:160]}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--gaps", type=int, default=8)
    args = ap.parse_args()
    with open(args.trace) as f:
        print(summarize(json.load(f), args.gaps))


if __name__ == "__main__":
    main()
