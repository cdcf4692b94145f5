"""The 8-bit host update built from variants of its source, each timed at a thread count, beside the
source as it is: which form of a part is fastest on this host's CPU.

    python3 benchmarks/experiments/adam8_variants_probe.py [--threads 1,15] [--params 33554432] [--rounds 2]
        [--dirs DIR ...] [--march sapphirerapids]

Variants (host_adam8.c, each the source with its substitutions; all give the same values):
- `noise_stored`: a block's rounding noise is hashed once per pair of elements into an array
  before the update's loop, which reads its halves back (the form that was 7% faster on an AMD
  EPYC core), instead of each element hashing its pair in the loop;
- `noise_stored_early`: the same, hashed before the block's moments are dequantized, so the loop's
  loads come well after the stores;
- `convert_pack`: the code search packs its words and bytes with the narrowing conversions it used
  before the two-source permutes.
`--dirs` adds source directories (a copy of hf_slideformer/host/csrc, e.g. another tree's) by their
name. Each variant is built and timed in a process of its own, all in turn for --rounds rounds,
each one's best round counting; `adamw_8bit_bf16` for every variant, `adamw_8bit` for the source as
it is and `convert_pack`.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from adam8_parts_probe import CSRC, rate  # noqa: E402

NOISE_BLOCK = """/* The noise of counters c0 .. c0 + len - 1 (len <= Q_BLOCK) as a pointer into `halves` (Q_BLOCK + 2
 * values): one hash per pair of counters, its bytes copied into two halves. */
static inline const uint16_t *noise_block(uint64_t key, uint32_t c0, int64_t len, uint16_t *restrict halves) {
    const uint32_t p0 = c0 >> 1, k1 = (uint32_t)key, k2 = (uint32_t)(key >> 32);
    const int64_t np = (len + (c0 & 1u) + 1) / 2;
    _Pragma("omp simd")
    for (int64_t k = 0; k < np; k++) {
        const uint32_t h = hash32(p0 + (uint32_t)k, k1, k2);
        memcpy(halves + 2 * k, &h, sizeof h);
    }
    return halves + (c0 & 1u);
}

"""
ROUNDING = "/* bf16 of f rounded up or down by the 16-bit noise r"
COUNTER = "    const uint32_t c0 = (uint32_t)(ctr + (uint64_t)lo);       /* the block's first rounding counter */\n"
NOISE_CALL = ("    uint16_t halves[Q_BLOCK + 2];\n"
              "    const uint16_t *restrict noise = mbf ? noise_block(hp->seed, c0, len, halves) : 0;\n")
DEQUANTIZE = ("    dequantize(q1 + lo, m, len, code1, lut1, s1);\n"
              "    dequantize(q2 + lo, v, len, code2, lut2, s2);\n")
IN_LOOP = ("f2b_noise(p, noise16(hp->seed, c0 + (uint32_t)j))", "f2b_noise(p, noise[j])")
VARIANTS = {
    "noise_stored": [(ROUNDING, NOISE_BLOCK + ROUNDING), (DEQUANTIZE + COUNTER, DEQUANTIZE + COUNTER + NOISE_CALL),
                     IN_LOOP],
    "noise_stored_early": [(ROUNDING, NOISE_BLOCK + ROUNDING),
                           (DEQUANTIZE + COUNTER, COUNTER + NOISE_CALL + DEQUANTIZE), IN_LOOP],
    "convert_pack": [
        ("    return _mm512_permutex2var_epi8(w0, _mm512_loadu_si512(even), w1);",
         "    (void)even;\n    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(w0)), "
         "_mm512_cvtepi16_epi8(w1), 1);"),
        ("    return _mm512_permutex2var_epi16(d0, _mm512_loadu_si512(even), d1);",
         "    (void)even;\n    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(d0)), "
         "_mm512_cvtepi32_epi16(d1), 1);")],
}
EIGHT_BIT = ("as_is", "convert_pack")


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
                        if fmt == "adamw_8bit" and name not in EIGHT_BIT and name not in extra:
                            continue
                        key = (fmt, t, name)
                        best[key] = max(best.get(key, 0.0), rate(d, args.params, fmt, t, args.march))
    print(f"{args.params:,} parameters, best of {args.rounds} rounds, -march={args.march or 'native'}")
    print(f"{'format':<16} {'threads':>7} {'variant':<19} {'G params/s':>10} {'x as is':>8}")
    for (fmt, t, name), r in sorted(best.items()):
        print(f"{fmt:<16} {t:>7} {name:<19} {r:10.3f} {r / best[(fmt, t, 'as_is')]:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
