"""docs/benchmarks.md's current results against the files a suite call writes.

A row of the "Current results" tables whose command cell is `suite SCENARIO --only STEP` is the
project's result (`slide`, `slide_lora`) of that step in `SCENARIO.json` (what `python -m
benchmarks.suite` writes under `--out`). This prints, for every such row a given file holds, the
documented tokens/s beside the measured one, and exits 1 when one differs by more than
`--tolerance` (default 3%: rows move by 1-4% between calls). `--write` puts the measured figures
(commit, tokens/s, step, GPU memory, host RSS) into the rows instead, so that the table holds the
latest measurement of each row:

    python3 benchmarks/doc_rows.py out/quick.json out/small-gpu.json
    python3 benchmarks/doc_rows.py --write out/quick.json
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
COMMAND = re.compile(r"`suite (\S+) --only (\S+)`")


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def doc_rows(text: str) -> dict[tuple[str, str], tuple[int, dict[str, int]]]:
    """(scenario, step) -> (line number, column of each header) of the current results' rows."""
    start = text.index("\n## Current results")
    end = text.find("\n## ", start + 1)
    lines = text.splitlines()
    first = text[:start].count("\n") + 1
    last = text[:end].count("\n") if end >= 0 else len(lines)
    rows, header = {}, None
    for i in range(first, last):
        line = lines[i]
        if not line.startswith("|"):
            header = None
        elif header is None:
            header = {name: k for k, name in enumerate(cells(line))}
        elif not line.startswith("|---") and "command" in header:
            found = COMMAND.fullmatch(cells(line)[header["command"]])
            if found:
                rows[found.groups()] = (i, header)
    return rows


def measured(files: list[Path]) -> dict[tuple[str, str], dict]:
    """(scenario, step) -> the project's row (`slide`, `slide_lora`) of that step in the suite files."""
    out = {}
    for path in files:
        doc = json.loads(path.read_text())
        for step in doc.get("steps", []):
            for row in step.get("rows") or []:
                project = str(row.get("provider")).startswith("slide")
                if step.get("tree") == "new" and project and row.get("status") == "ok":
                    out[(doc["scenario"], step["name"])] = {**row, "commit": (doc.get("commit") or "-")[:7]}
    return out


def figure(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def compare(text: str, rows: dict[tuple[str, str], dict], tolerance: float, write: bool) -> tuple[str, list[str]]:
    """The doc with the measured figures written in (when `write`), and one report line per row."""
    lines, report = text.splitlines(), []
    for key, (i, header) in sorted(doc_rows(text).items(), key=lambda kv: kv[1][0]):
        if key not in rows:
            continue
        row, doc_cells = rows[key], cells(lines[i])
        documented = float(doc_cells[header["tokens/s"]].strip("*").replace(",", ""))
        ratio = row["tokens_per_s"] / documented
        stale = abs(ratio - 1) > tolerance
        report.append(f"{'STALE' if stale else 'ok':5}  suite {key[0]} --only {key[1]}: documented {documented:,.0f}, "
                      f"measured {row['tokens_per_s']:,.0f} tokens/s ({ratio:.3f}x) at {row['commit']}")
        if write:
            bold = doc_cells[header["tokens/s"]].startswith("**")
            new = {"commit": row["commit"], "step s": figure(row.get("step_s"), ".3f"),
                   "tokens/s": ("**{}**" if bold else "{}").format(figure(row["tokens_per_s"], ",.0f")),
                   "GPU alloc / reserved GiB": f"{figure(row.get('gpu_peak_allocated_gib'), '.1f')} / "
                                               f"{figure(row.get('gpu_peak_reserved_gib'), '.1f')}",
                   "host RSS GiB": figure(row.get("host_rss_peak_gib"), ".1f")}
            for name, value in new.items():
                if name in header:
                    doc_cells[header[name]] = value
            lines[i] = "| " + " | ".join(doc_cells) + " |"
    return "\n".join(lines) + ("\n" if text.endswith("\n") else ""), report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path, help="SCENARIO.json files of suite calls")
    ap.add_argument("--doc", type=Path, default=DOC, help="the page whose current results are checked")
    ap.add_argument("--tolerance", type=float, default=0.03, help="the relative difference a row may have")
    ap.add_argument("--write", action="store_true", help="write the measured figures into the page's rows")
    args = ap.parse_args(argv)
    text = args.doc.read_text(encoding="utf-8")
    updated, report = compare(text, measured(args.files), args.tolerance, args.write)
    print("\n".join(report) if report else "no documented row in these files")
    if args.write:
        args.doc.write_text(updated, encoding="utf-8")
        return 0
    return int(any(line.startswith("STALE") for line in report))


if __name__ == "__main__":
    sys.exit(main())
