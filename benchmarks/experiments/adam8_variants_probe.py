"""The 8-bit host update built from variants of its source, each timed at a thread count, beside the
source as it is: which form of a part is fastest on this host's CPU.

    python3 benchmarks/experiments/adam8_variants_probe.py [--threads 1,15] [--params 33554432] [--rounds 2]
        [--dirs DIR ...] [--march sapphirerapids]

Variants (host_adam8.c, each the source with its substitutions; all give the same values):
- `permute_pack`: the code search packs its bytes and words with one two-source permute each
  (`vpermt2b` / `vpermt2w`) instead of two narrowing conversions and an insert (5-7% faster on an
  AMD EPYC core; on the GPU machines' Xeon host the source's conversions were measured faster, the
  update with the permutes and a per-pair noise at about half the rate: docs/host_state.md).
`--dirs` adds source directories (a copy of hf_slideformer/host/csrc, e.g. another tree's from
`git archive REV hf_slideformer/host/csrc`) by their name. Each variant is built and timed in a
process of its own, all in turn for --rounds rounds, each one's best round counting, each rate
printed as it is measured; both 8-bit formats for every variant.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from adam8_parts_probe import CSRC, rate  # noqa: E402

EVEN_BYTES = ("    static const uint8_t even[64] = {" + ", ".join(str(2 * i) for i in range(64)) + "};\n")
EVEN_WORDS = ("    static const uint16_t even[32] = {" + ", ".join(str(2 * i) for i in range(32)) + "};\n")
LOW_BYTES = "    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(w0)), _mm512_cvtepi16_epi8(w1), 1);\n}\n"
LOW_WORDS = ("/* The low words of 2 x 16 dword lanes, in order: one two-source word permute. */\n"
             "static inline __m512i low_words(__m512i d0, __m512i d1) {\n" + EVEN_WORDS
             + "    return _mm512_permutex2var_epi16(d0, _mm512_loadu_si512(even), d1);\n}\n")
REQUANT_PACK = ("            w[h] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(_mm512_loadu_si512(x + j + 32 * h))),\n"
                "                                      _mm512_cvtepi32_epi16(_mm512_loadu_si512(x + j + 32 * h + 16)), 1);\n")
VARIANTS = {
    "permute_pack": [
        (LOW_BYTES, EVEN_BYTES + "    return _mm512_permutex2var_epi8(w0, _mm512_loadu_si512(even), w1);\n}\n\n" + LOW_WORDS),
        (REQUANT_PACK, "            w[h] = low_words(_mm512_loadu_si512(x + j + 32 * h), _mm512_loadu_si512(x + j + 32 * h + 16));\n")],
}


def variant(root: Path, name: str) -> Path:
    """A copy of the kernel's sources with variant `name`'s substitutions."""
    d = root / name
    shutil.copytree(CSRC, d)
    src = d / "host_adam8.c"
    text = src.read_text()
    for old, new in VARIANTS[name]:
        if old not in text:
            raise SystemExit(f"host_adam8.c has changed: the {name!r} variant no longer applies; update this probe")
        text = text.replace(old, new)
    src.write_text(text)
    return d


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", default="1", help="comma-separated thread counts")
    p.add_argument("--params", type=int, default=1 << 25)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dirs", nargs="*", default=[], help="more source directories, timed by their name")
    p.add_argument("--march", default=None, help="build with -march=MARCH instead of native (e.g. sapphirerapids: "
                                                  "another core's tuning, where this CPU runs its instructions)")
    args = p.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        shutil.copytree(CSRC, root / "as_is")
        extra = {Path(d).name: Path(d).resolve() for d in args.dirs}
        dirs = {"as_is": root / "as_is", **{name: variant(root, name) for name in VARIANTS}, **extra}
        best: dict[tuple, float] = {}
        for _ in range(args.rounds):
            for t in threads:
                for fmt in ("adamw_8bit_bf16", "adamw_8bit"):
                    for name, d in dirs.items():
                        key = (fmt, t, name)
                        r = rate(d, args.params, fmt, t, args.march)
                        print(f"  {fmt} {t} threads {name}: {r:.3f} G params/s", flush=True)
                        best[key] = max(best.get(key, 0.0), r)
    print(f"{args.params:,} parameters, best of {args.rounds} rounds, -march={args.march or 'native'}")
    print(f"{'format':<16} {'threads':>7} {'variant':<19} {'G params/s':>10} {'x as is':>8}")
    for (fmt, t, name), r in sorted(best.items()):
        print(f"{fmt:<16} {t:>7} {name:<19} {r:10.3f} {r / best[(fmt, t, 'as_is')]:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
