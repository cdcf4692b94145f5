"""A provider's best batch under the cap: one fresh process per batch, upward until out of memory.

`bench_train.py --search-batches 4,8,16,32` measures each batch in a process of its own (an
out-of-memory error leaves no broken allocator or half-reduced DeepSpeed state behind), from the
smallest up, and stops at the first batch that runs out of memory, errs or times out. When the
smallest already runs out of memory it halves downwards until one fits. The provider's row is
the attempt with the most tokens per second; `search` lists every attempt.
"""
from __future__ import annotations

import time
from typing import Callable

__all__ = ["search_batches", "search_order"]


def search_order(batches: list[int]) -> list[int]:
    """The batches to try upward: sorted, duplicates dropped, all positive."""
    out = sorted(set(batches))
    if not out or out[0] < 1:
        raise ValueError(f"search batches must be positive, got {batches}")
    return out


def search_batches(run: Callable[[int, float], dict], batches: list[int], seq: int, timeout: float) -> dict:
    """Run `run(batch, seconds)` (one fresh process, returns its row) upward until the first failure.

    Args:
        run: measures one batch within the seconds given and returns the provider's row (`status`
            "ok" with `step_s`, or "oom", "error", "timeout", "crashed", "skipped").
        batches: the batches to try; tried in increasing order.
        seq: tokens per sequence, for the tokens per second of each attempt.
        timeout: seconds for the whole search. A larger batch is not started when less time is
            left than the last attempt took (it would be cut short); its entry says so.

    Returns:
        The row of the attempt with the most tokens per second (or, when none fit, the last
        attempt's), with `search` (every attempt: batch, status, tokens/s, error) and
        `oom_batches`.
    """
    attempts: list[tuple[int, dict]] = []
    order = search_order(batches)
    batch, downward = order[0], False
    deadline, last_s = time.monotonic() + timeout, 0.0
    while True:
        left = deadline - time.monotonic()
        if attempts and left < max(last_s, 1.0):
            why = f"{left:.0f} s left of the search's {timeout:.0f} s"
            attempts.append((batch, {"status": "not run", "error": why}))
            break
        t0 = time.monotonic()
        row = run(batch, left)
        last_s = time.monotonic() - t0
        attempts.append((batch, row))
        status = row.get("status")
        if status == "ok":
            if downward:
                break
            bigger = [b for b in order if b > batch]
            if not bigger:
                break
            batch = bigger[0]
        elif _ran_out(row) and (len(attempts) == 1 or downward):
            if batch == 1:
                break
            batch, downward = batch // 2, True
        else:
            break
    fitted = [(b, r) for b, r in attempts if r.get("status") == "ok" and r.get("step_s")]
    best = max(fitted, key=lambda br: _tokens_per_s(br[0], br[1], seq))[1] if fitted else attempts[-1][1]
    best = dict(best)
    best["search"] = [{"batch": b, "status": r.get("status"),
                       "tokens_per_s": _tokens_per_s(b, r, seq) if r.get("status") == "ok" else None,
                       "error": (r.get("error") or "")[:200] or None} for b, r in attempts]
    best["oom_batches"] = [b for b, r in attempts if _ran_out(r)]
    best["processes"] = sum(r.get("processes", 1) for _, r in attempts if r.get("status") != "not run")
    return best


def _ran_out(row: dict) -> bool:
    """Out of memory, also where the error that ended the process came after an OOM (DeepSpeed's cleanup)."""
    return row.get("status") == "oom" or (row.get("status") != "ok" and bool(row.get("oom_batches")))


def _tokens_per_s(batch: int, row: dict, seq: int) -> float:
    micro = (row.get("extra") or {}).get("micro_batches") or 1
    return batch * seq * micro / row["step_s"] if row.get("step_s") else 0.0
