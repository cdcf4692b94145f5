"""The figure of the FP8 quality run: bf16 and FP8 train and held-out losses against the step.

    python3 benchmarks/fp8_quality_plot.py fp8_quality.json docs/fp8_quality.svg

Reads the JSON of `benchmarks/fp8_quality.py` (its logged rows) and draws two panels
side by side, each on a log scale: the train loss (the mean since the last log) and the held-out
loss, of bf16, FP8 and the bf16 control where the run has one. With the grammar stream both
panels show the stream's entropy, the lowest loss any model reaches (dashed); with the corpus
stream the train panel shows the floor below which the criterion no longer judges the train loss
and the held-out panel the step of bf16's lowest, where the learning phase ends (dashed). One SVG,
no plotting library.
"""
from __future__ import annotations

import json
import math
import sys

COLORS = {"bf16": "#1f77b4", "fp8": "#d62728", "control": "#2ca02c", "fp8_gw_hp": "#ff7f0e",
          "resident_bf16": "#9467bd", "torchao": "#8c564b"}
PANEL_W, PANEL_H, PAD = 380, 300, 52


class Panel:
    """One log-scale panel at horizontal offset `left`: maps (step, loss) to SVG coordinates."""

    def __init__(self, left: float, steps: int, values: list[float]):
        self.left, self.steps = left, max(1, steps)
        self.lo, self.hi = math.log10(min(values)), math.log10(max(values))
        if self.hi - self.lo < 1e-6:
            self.lo, self.hi = self.lo - 0.05, self.hi + 0.05

    def xy(self, step: float, loss: float) -> tuple[float, float]:
        x = self.left + PAD + (PANEL_W - 1.5 * PAD) * step / self.steps
        y = PANEL_H - PAD + (2 * PAD - PANEL_H) * (math.log10(loss) - self.lo) / (self.hi - self.lo)
        return x, y

    def frame(self, title: str) -> list[str]:
        x0, y0 = self.xy(0, 10 ** self.lo)
        x1, y1 = self.xy(self.steps, 10 ** self.hi)
        return [f'<line x1="{x0:.1f}" y1="{y0:.1f}" x2="{x1:.1f}" y2="{y0:.1f}" stroke="black"/>',
                f'<line x1="{x0:.1f}" y1="{y0:.1f}" x2="{x0:.1f}" y2="{y1:.1f}" stroke="black"/>',
                f'<text x="{(x0 + x1) / 2:.1f}" y="{PAD - 22}" text-anchor="middle" font-weight="bold">{title}</text>',
                f'<text x="{(x0 + x1) / 2:.1f}" y="{PANEL_H - 14}" text-anchor="middle">step (0 to {self.steps})</text>',
                f'<text x="{x0 - 4:.1f}" y="{y1 + 4:.1f}" text-anchor="end">{10 ** self.hi:.3g}</text>',
                f'<text x="{x0 - 4:.1f}" y="{y0:.1f}" text-anchor="end">{10 ** self.lo:.3g}</text>']

    def line(self, points: list[tuple[int, float]], color: str, dash: str = "") -> str:
        pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in (self.xy(s, v) for s, v in points))
        extra = f' stroke-dasharray="{dash}"' if dash else ""
        return f'<polyline fill="none" stroke="{color}" stroke-width="1.4"{extra} points="{pts}"/>'


def svg(doc: dict) -> str:
    """The two panels of a quality run's JSON, as SVG text."""
    rows = doc["rows"]
    entropy = doc.get("stream", {}).get("entropy_floor")                    # the grammar stream's
    floor = entropy or min(min(r["bf16_held_out"], r["fp8_held_out"]) for r in rows)   # as fp8_quality.judge
    best = min(rows, key=lambda r: r["bf16_held_out"])["step"]
    steps = rows[-1]["step"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * PANEL_W}" height="{PANEL_H}" '
           f'font-family="sans-serif" font-size="12">', f'<rect width="{2 * PANEL_W}" height="{PANEL_H}" fill="white"/>']
    for left, kind, title in ((0, "train", "train loss (mean since the last log)"), (PANEL_W, "held_out", "held-out loss")):
        curves = {arm: [(r["step"], r[f"{arm}_{kind}"]) for r in rows if r[f"{arm}_{kind}"] is not None]
                  for arm in COLORS if f"{arm}_{kind}" in rows[0]}
        values = [v for c in curves.values() for _, v in c] + ([floor] if kind == "train" or entropy else [])
        panel = Panel(left, steps, values)
        out += panel.frame(title)
        for (arm, points), y in zip(curves.items(), (PAD - 6, PAD + 8, PAD + 22)):
            out.append(panel.line(points, COLORS[arm]))
            out.append(f'<text x="{left + PANEL_W - 12}" y="{y}" text-anchor="end" fill="{COLORS[arm]}">{arm}</text>')
        if kind == "train" or entropy:
            out.append(panel.line([(0, floor), (steps, floor)], "#777777", "4 3"))
            x, y = panel.xy(steps, floor)
            label = "entropy" if entropy else "floor"
            out.append(f'<text x="{x:.1f}" y="{y - 4:.1f}" text-anchor="end" fill="#777777">{label} {floor:.3f}</text>')
        else:                                   # the learning phase ends at bf16's lowest held-out loss
            out.append(panel.line([(best, 10 ** panel.lo), (best, 10 ** panel.hi)], "#777777", "4 3"))
            x, y = panel.xy(best, 10 ** panel.hi)
            out.append(f'<text x="{x + 4:.1f}" y="{y + 12:.1f}" fill="#777777">lowest, step {best}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        doc = json.load(f)
    with open(argv[1], "w") as f:
        f.write(svg(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
