#!/usr/bin/env python
"""The host AdamW's rate against torch's fused CPU AdamW and the host's memory bandwidth.

    python benchmarks/host_adam_rate.py --params 218103808 --threads 15 [--busy 1] [--json out/adam.json]

Rates are parameters per second of one update over flat fp32 state (master, exp_avg,
exp_avg_sq), median of `--repeat` calls after one warm-up, gradient read included:
- torch fused, fp32 gradient: torch._fused_adamw_ (what torch.optim.AdamW(fused=True) runs);
- torch fused on a bf16 gradient: widened into an fp32 buffer first (the fallback route);
- native, bf16 / fp32 gradient, and bf16 with the bf16 weight copy written in the same pass;
- native with 8-bit block-wise moments (adamw_8bit: 14 B/param moved, the 8-bit moments and
  their scales read and written) and with a bf16 master too (adamw_8bit_bf16: 10 B/param), each
  with every moment one value and with the moments spread over their codes (as in training).
The bound: STREAM's triad (a = b + s * c) on the same threads, best of the repeats; its bytes are
counted as 16 per element (two reads, the write and its read for ownership), the update's as 26
(bf16 gradient, master and moments read, master and moments written).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from hf_slideformer.config import _host_cores, worker_threads  # noqa: E402
from hf_slideformer.host.host_adam import HostAdam, triad  # noqa: E402
from hf_slideformer.host.host_optim import state_format  # noqa: E402
from hf_slideformer.host.host_rate import rate_unit  # noqa: E402


def timed(fn, repeat: int) -> list[float]:
    fn()
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=218_103_808, help="parameters per update (default: one 8B layer)")
    ap.add_argument("--threads", type=int, default=None, help="threads (default: SlideConfig's cpu_threads default)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--busy", type=int, default=0,
                    help="processes kept busy on the CPU during the timing (each spins one core), as the training "
                         "process's main thread and helpers share the cores with the update")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(max(0, args.busy))]
    threads = torch.get_num_threads()
    try:
        return _measure(args)
    finally:
        torch.set_num_threads(threads)        # called in-process (tests), the caller's threads are its own
        for proc in busy:
            proc.kill()
            proc.wait()


def _measure(args) -> int:
    cores = _host_cores()
    threads = args.threads or worker_threads(cores)
    torch.set_num_threads(threads)
    n = args.params
    p, m, v, g = (torch.rand(n) for _ in range(4))
    gb = g.bfloat16()
    out16 = torch.empty(n, dtype=torch.bfloat16)
    step = [torch.tensor(1.0)]
    hp = {"lr": 1e-5, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    native, fused = HostAdam("native", threads), HostAdam("torch", threads)
    rows = {}

    def rate(name, fn, nbytes=None):
        ts = timed(fn, args.repeat)
        med = statistics.median(ts)
        rows[name] = {"params_per_s": n / med, "s": med, "gb_s": (nbytes * n / med / 1e9) if nbytes else None}

    rate("torch fused, fp32 grad", lambda: fused.step(hp, [p], [g], [m], [v], step), 28)
    rate("torch fused, bf16 grad widened", lambda: fused.step(hp, [p], [gb], [m], [v], step), 26)
    rate("native, fp32 grad", lambda: native.step(hp, [p], [g], [m], [v], step), 28)
    rate("native, bf16 grad", lambda: native.step(hp, [p], [gb], [m], [v], step), 26)
    rate("native, bf16 grad + bf16 weights", lambda: native.step(hp, [p], [gb], [m], [v], step, out16=[out16]), 28)
    # The compact state formats (host_optim.py): 8-bit moments (fp32 master), and a bf16 master too.
    for name, nbytes in (("adamw_8bit", 14), ("adamw_8bit_bf16", 10)):
        fmt = state_format(name)
        u = rate_unit(fmt, n)
        rate(f"native {name}, bf16 grad",
             lambda fmt=fmt, u=u: fmt.run(native, hp, u, u, [(0, 0, n)], [gb], step, None), nbytes)
        # As in training: a first update from a random gradient spreads the moments over their codes
        # (one value everywhere keeps every code lookup on one cache line).
        fmt.run(native, hp, u, u, [(0, 0, n)], [(g - 0.5).bfloat16()], step, None)
        rate(f"native {name}, spread codes",
             lambda fmt=fmt, u=u: fmt.run(native, hp, u, u, [(0, 0, n)], [gb], step, None), nbytes)
        del u
    a = torch.empty(n)
    best = min(timed(lambda: triad(a, p, m, 3.0, threads), args.repeat))
    triad_gbs = 16 * n / best / 1e9
    bound = triad_gbs * 1e9 / 26
    print(f"host: {cores} cores, {threads} threads; {n:,} parameters per update; v_order {native.v_order}"
          + (f"; {args.busy} other busy processes" if args.busy else ""))
    print(f"STREAM triad: {triad_gbs:.1f} GB/s (16 B/element) -> AdamW bound at 26 B/param: {bound / 1e9:.2f} G params/s")
    print(f"{'route':<36} {'G params/s':>11} {'GB/s':>7} {'x torch':>8} {'of bound':>9}")
    base = rows["torch fused, fp32 grad"]["params_per_s"]
    for name, r in rows.items():
        gbs = f"{r['gb_s']:.1f}" if r["gb_s"] else "-"
        print(f"{name:<36} {r['params_per_s'] / 1e9:>11.2f} {gbs:>7} {r['params_per_s'] / base:>7.2f}x "
              f"{r['params_per_s'] / bound:>8.0%}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"threads": threads, "params": n, "busy": args.busy, "triad_gb_s": triad_gbs,
                                               "bound_params_per_s": bound, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
