"""FP8 quality over several seeds: the seed-mean loss curves judged as one run's are.

    python3 benchmarks/fp8_quality_seeds.py out/fp8_quality_s0.json out/fp8_quality_s1.json ... \
        [--tolerance 0.015] [--json out/fp8_quality_seeds.json]

Each input is one `benchmarks/fp8_quality.py` run (`--seed N`: other initial weights and another
draw of the training text). Where the loss falls by a quarter in twenty steps a single run's gap
between two arms is mostly that run's divergence, of either sign and larger than the criterion
(docs/benchmarks.md, "FP8 quality"): a curve is judged by its mean over seeds. At every step all
the runs logged, each arm's train and held-out losses are averaged over the seeds, and
`fp8_quality.judge` reads those mean rows as it reads one run's (every arm against bf16, torchao's
against the GPU-resident bf16 arm). Beside the mean gaps the table prints the spread of the
per-seed gaps (their lowest and highest), which says how far one run is from the mean. The JSON's
mean rows draw as one run's do: `python3 benchmarks/fp8_quality_plot.py fp8_quality_seeds.json
docs/fp8_quality.svg`.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.fp8_quality import judge, rel_gap  # noqa: E402


def mean_rows(runs: list[list[dict]]) -> list[dict]:
    """One row per step that every run logged: each key the mean over the runs (None where a run
    has none, as the train losses at step 0)."""
    steps = sorted(set.intersection(*({r["step"] for r in rows} for rows in runs)))
    by_step = [{r["step"]: r for r in rows} for rows in runs]
    out = []
    for step in steps:
        row = {"step": step}
        for key in by_step[0][step]:
            if key == "step":
                continue
            values = [rows[step].get(key) for rows in by_step]
            row[key] = None if any(v is None for v in values) else sum(values) / len(values)
        out.append(row)
    return out


def gap_spread(runs: list[list[dict]], step: int, arm: str, kind: str, base: str = "bf16") -> tuple | None:
    """The lowest and highest signed gap (arm above base > 0) of one step over the runs."""
    gaps = []
    for rows in runs:
        row = next(r for r in rows if r["step"] == step)
        if row.get(f"{base}_{kind}") is None:
            return None
        gaps.append((row[f"{arm}_{kind}"] - row[f"{base}_{kind}"]) / row[f"{base}_{kind}"])
    return min(gaps), max(gaps)


def seed_verdicts(docs: list[dict], tolerance: float) -> dict:
    """The mean rows, and `judge`'s verdict on them for every arm beside bf16."""
    runs = [d["rows"] for d in docs]
    rows = mean_rows(runs)
    args = docs[0]["args"]
    memorizable = args.get("train_stream", "grammar") == "corpus"
    arms = [k[:-len("_held_out")] for k in rows[0] if k.endswith("_held_out") and k != "bf16_held_out"]
    verdicts = {}
    for arm in arms:
        if arm == "resident_bf16":
            continue
        base = "resident_bf16" if arm == "torchao" else "bf16"
        verdicts[arm] = judge(rows, args["warmup"], tolerance, memorizable, other=arm, base=base)
    return {"seeds": [d["args"]["seed"] for d in docs], "rows": rows, "verdicts": verdicts, "arms": arms,
            "stream": docs[0].get("stream", {})}


def print_table(result: dict, runs: list[list[dict]]) -> None:
    rows, arms = result["rows"], [a for a in result["arms"] if a != "resident_bf16"]
    print(f"seeds {result['seeds']}: the mean over the seeds of every arm's losses; the gap of the means, "
          f"and [lowest, highest] of the per-seed gaps")
    for kind in ("train", "held_out"):
        print(f"\n{kind}\n{'step':>5} {'bf16':>8}" + "".join(f" {a:>10} {'gap':>7} {'per seed':>17}" for a in arms))
        for r in rows:
            if r[f"bf16_{kind}"] is None:
                continue
            line = f"{r['step']:5d} {r[f'bf16_{kind}']:8.4f}"
            for a in arms:
                base = "resident_bf16" if a == "torchao" else "bf16"
                lo, hi = gap_spread(runs, r["step"], a, kind, base)
                line += f" {r[f'{a}_{kind}']:10.4f} {rel_gap(r[f'{base}_{kind}'], r[f'{a}_{kind}']):7.2%} [{lo:+7.2%},{hi:+7.2%}]"
            print(line)
    for arm, v in result["verdicts"].items():
        print(f"{arm}: mean curves, max gap train {v['train_max_gap']:.2%} (step {v['train_max_step']}), "
              f"held-out {v['held_out_max_gap']:.2%} (step {v['held_out_max_step']}): "
              f"{'met' if v['met'] else 'NOT met'} (within {v['tolerance']:.1%})")


def load_run(path: str) -> dict:
    """One fp8_quality.py JSON, or a SystemExit that names the file and what it lacks."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{path}: not a readable JSON file ({exc}); pass fp8_quality.py --json outputs") from exc
    if not isinstance(doc, dict) or not {"rows", "args"} <= doc.keys() or "seed" not in doc["args"]:
        raise SystemExit(f"{path}: not an fp8_quality.py result (no rows or args.seed); pass its --json output")
    return doc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="fp8_quality.py JSON files, one per seed")
    p.add_argument("--tolerance", type=float, default=0.015)
    p.add_argument("--json", help="where to write the mean rows and the verdicts")
    args = p.parse_args(argv)
    docs = [load_run(f) for f in args.runs]
    seeds = [d["args"]["seed"] for d in docs]
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"the runs must have different seeds (got {seeds}): run fp8_quality.py with --seed N")
    result = seed_verdicts(docs, args.tolerance)
    print_table(result, [d["rows"] for d in docs])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
