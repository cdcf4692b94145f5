"""Where the 8-bit host update's time goes: the native kernel rebuilt with one part run twice at a
time, each timed on one thread beside the kernel as it is.

    python3 benchmarks/experiments/adam8_parts_probe.py [--params 8388608] [--format adamw_8bit_bf16]

Parts (host_adam8.c): `rounding` (a bf16 master's stochastic rounding), `requantize` (the codes'
search for the new moments), `dequantize` (the codes' values from the table's byte planes). A part
run twice leaves every value as it was, so the time it adds is the part's own: its share of the
kernel is rate_as_is / rate_twice - 1. (Replacing a part by a cheaper stand-in instead changes the
values the other parts compute on and, with them, their speed.) Each variant is built and timed in
a process of its own (the library is loaded once per process), all of them in turn for --rounds
rounds, each one's best round counting.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CSRC = REPO_ROOT / "hf_slideformer" / "host" / "csrc"

# Each part runs twice (its second run writes what the first wrote, or is picked only where it
# cannot differ), so the data every other part sees is unchanged and the time added is the part's.
TWICE = {
    "rounding": ("            uint16_t w = f2b_stochastic(p, hp->seed, ctr + (uint64_t)i);",
                 "            uint16_t w = f2b_stochastic(p, hp->seed, ctr + (uint64_t)i);\n"
                 "            const uint16_t w2 = f2b_stochastic(p, hp->seed ^ 1u, ctr + (uint64_t)i);\n"
                 "            w = (p == 1234.5f && w2 == 7) ? w2 : w;"),
    "requantize": ("    requantize(x1, q1 + lo, len, lut1, !(mx1 > 0.0f));      /* an all-zero block: codes 0 */\n"
                   "    requantize(x2, q2 + lo, len, lut2, !(mx2 > 0.0f));",
                   "    requantize(x1, q1 + lo, len, lut1, !(mx1 > 0.0f));\n"
                   "    requantize(x2, q2 + lo, len, lut2, !(mx2 > 0.0f));\n"
                   "    requantize(x1, q1 + lo, len, lut1, !(mx1 > 0.0f));\n"
                   "    requantize(x2, q2 + lo, len, lut2, !(mx2 > 0.0f));"),
    "dequantize": ("    dequantize(q1 + lo, m, len, code1, lut1, s1);\n    dequantize(q2 + lo, v, len, code2, lut2, s2);",
                   "    dequantize(q1 + lo, m, len, code1, lut1, s1);\n    dequantize(q2 + lo, v, len, code2, lut2, s2);\n"
                   "    dequantize(q1 + lo, m, len, code1, lut1, s1);\n    dequantize(q2 + lo, v, len, code2, lut2, s2);"),
}

TIMER = r"""
import sys, time, torch
from pathlib import Path
sys.path[:0] = [{repo!r}, {bench!r}]
import hf_slideformer.host.host_adam as host_adam
host_adam._SOURCE = Path({src!r}) / "host_adam.c"
if {march!r}:
    host_adam._FLAGS = [f if f != "-march=native" else "-march=" + {march!r} for f in host_adam._FLAGS]
from hf_slideformer.host.host_optim import state_format
from host_adam_rate import rate_unit
torch.set_num_threads({threads})
torch.manual_seed(0)
n, fmt = {n}, state_format({fmt!r})
native = host_adam.HostAdam("native", {threads})
unit = rate_unit(fmt, n)
hp = {{"lr": 1e-5, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}}
step = [torch.tensor(1.0)]
fmt.run(native, hp, unit, unit, [(0, 0, n)], [(torch.rand(n) - 0.5).bfloat16()], step, None)   # codes spread
grad = (torch.rand(n) - 0.5).bfloat16()
best = float("inf")
for _ in range(7):
    t = time.perf_counter()
    fmt.run(native, hp, unit, unit, [(0, 0, n)], [grad], step, None)
    best = min(best, time.perf_counter() - t)
print(n / best / 1e9)
"""


def rate(source_dir: Path, n: int, fmt: str, threads: int = 1, march: str | None = None) -> float:
    """G params/s on `threads` threads with the kernel built from `source_dir` (with -march=`march`
    in place of -march=native where given)."""
    code = TIMER.format(repo=str(REPO_ROOT), bench=str(REPO_ROOT / "benchmarks"), src=str(source_dir), n=n, fmt=fmt,
                        threads=threads, march=march)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"timing {source_dir} failed:\n{out.stderr[-2000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def variant(root: Path, name: str) -> Path:
    """A copy of the kernel's sources with part `name` run twice."""
    d = root / name
    shutil.copytree(CSRC, d)
    src = d / "host_adam8.c"
    old, new = TWICE[name]
    text = src.read_text()
    if old not in text:
        raise SystemExit(f"host_adam8.c has changed: the {name!r} variant no longer applies; update this probe")
    src.write_text(text.replace(old, new))
    return d


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=int, default=1 << 23)
    p.add_argument("--format", default="adamw_8bit_bf16", choices=("adamw_8bit", "adamw_8bit_bf16"))
    p.add_argument("--rounds", type=int, default=4,
                   help="the variants are timed in turn this many times; each one's best round counts (a shared "
                        "machine's other work comes in bursts)")
    args = p.parse_args(argv)
    parts = [name for name in TWICE if name != "rounding" or args.format == "adamw_8bit_bf16"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        shutil.copytree(CSRC, root / "as_is")
        dirs = {"as_is": root / "as_is", **{name: variant(root, name) for name in parts}}
        best = {name: 0.0 for name in dirs}
        for _ in range(args.rounds):
            for name, d in dirs.items():
                best[name] = max(best[name], rate(d, args.params, args.format))
    base = best.pop("as_is")
    print(f"{args.format}, one thread, {args.params:,} parameters, best of {args.rounds} rounds: the kernel as it "
          f"is {base:.3f} G params/s")
    print(f"{'part run twice':<14} {'G params/s':>10} {'share of the time':>18}")
    for name, r in best.items():
        print(f"{name:<14} {r:10.3f} {base / r - 1:18.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
