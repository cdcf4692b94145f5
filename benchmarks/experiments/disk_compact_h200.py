"""Llama-3.1-8B with 8-bit moments and a bf16 master under host_memory_limit: entirely in RAM at 56
GiB (a 64 GB PC), and at a limit low enough that the last layers' compact moments go to disk
(docs/disk.md, "Records per state format"). Run from the repository root on the GPU machine:

    OUT=out python3 benchmarks/experiments/disk_compact_h200.py [--moment-layers 6] [--timeout 100]

It first runs the GPU tests of the compact disk records (tests/test_disk_record.py, marked gpu),
then each row through benchmarks/bench_train.py (batch 16, 12 GiB cap, --steps 3 --warmup 1
--no-probe, one process per row under --timeout), and prints a short table last: the split the
engine's arithmetic gives at each limit (disk_plan.split_layers, with the fp32 split at the same
limit beside it), what the run's slide_stats() counted, tokens/s, host RSS and disk bytes per step.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

FORMAT = "adamw_8bit_bf16"
GiB = 2 ** 30


def _shape():
    from hf_slideformer.planner.plan_estimate import load_model_config, model_shape
    return model_shape(load_model_config(str(ROOT / "benchmarks/configs/llama3-8b.json")))


def split_at(limit_gib: float, fmt_name: str):
    """The engine's split of the 8B shape's layers at this limit (no clipping, no accumulation:
    bench_train's step, so no accumulators; the embedding and head in the format)."""
    from hf_slideformer.disk.disk_plan import host_limit_bytes, split_layers
    from hf_slideformer.host.host_optim import embed_format, state_format

    s, fmt = _shape(), state_format(fmt_name)
    emb = embed_format(fmt_name, s.hidden)
    fixed = int(emb.bytes_per_param * s.embed_params) + int(fmt.bytes_per_param * s.head_params)
    return split_layers(host_limit_bytes(limit_gib), fixed, [s.layer_params] * s.layers, fmt)


def limit_for(moment_layers: int) -> float:
    """The largest limit (0.1 GiB steps) at which at least `moment_layers` layers' moments go to disk."""
    limit = 56.0
    while limit > 1 and (split_at(limit, FORMAT) is None or split_at(limit, FORMAT).layers < moment_layers):
        limit = round(limit - 0.1, 1)
    return limit


def run_row(tag: str, limit: float, nvme: str, out: Path, timeout: int) -> dict:
    cfg = {"host_memory_limit": limit, "optimizer_state": FORMAT, "nvme_path": nvme}
    path = out / f"disk_compact_{tag}.json"
    cmd = [sys.executable, "benchmarks/bench_train.py", "--model", "llama3-8b", "--providers", "slide",
           "--batch", "16", "--offload-batches", "16", "--cap-gib", "12", "--steps", "3", "--warmup", "1",
           "--no-probe", "--timeout", str(timeout), "--slide-config", json.dumps(cfg), "--json", str(path)]
    print("$", " ".join(cmd), flush=True)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout + 60)
        print("\n".join(line for line in proc.stdout.splitlines()[-14:] if "@@bench" not in line), flush=True)
        if proc.returncode:
            print(proc.stderr[-3000:], flush=True)
    except subprocess.TimeoutExpired:
        print(f"row {tag}: past {timeout + 60} s", flush=True)
    try:
        return json.loads(path.read_text())["results"][0]
    except (OSError, ValueError, KeyError, IndexError):
        return {"status": "no result"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--moment-layers", type=int, default=6, help="layers whose moments the low row puts on disk")
    ap.add_argument("--timeout", type=int, default=100, help="seconds per bench_train row")
    ap.add_argument("--no-tests", action="store_true", help="skip the GPU tests")
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if not args.no_tests:
        t = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_disk_record.py",
                            "-p", "no:cacheprovider", "-rf"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=240)
        tests = (t.stdout.strip().splitlines() or ["no output"])[-1]
        print(t.stdout[-2500:], flush=True)
    else:
        tests = "skipped"
    low = limit_for(args.moment_layers)
    rows = []
    with tempfile.TemporaryDirectory(prefix="slide-nvme-", dir=os.environ.get("NVME_DIR", "/tmp")) as nvme:
        for tag, limit in (("ram56", 56.0), (f"disk{low}", low)):
            r = run_row(tag, limit, nvme, out, args.timeout)
            st = (r.get("extra") or {}).get("slide_stats") or {}
            per = (r.get("extra") or {}).get("slide_stats_per_step") or {}
            disk_bytes = (per.get("disk_read_bytes") or 0) + (per.get("disk_write_bytes") or 0)
            rows.append((limit, split_at(limit, FORMAT), split_at(limit, "adamw"), st.get("disk_layers", 0),
                         st.get("disk_moment_layers", 0), r.get("tokens_per_s"), r.get("host_rss_peak_gib"),
                         disk_bytes / 1e9, r.get("status")))
    (out / "disk_compact_table.json").write_text(json.dumps([[str(x) for x in row] for row in rows], indent=1))
    print(f"\nGPU tests (tests/test_disk_record.py -m gpu): {tests}")
    print("\nLlama-3.1-8B, batch 16, seq 2048, 12 GiB cap, optimizer_state=adamw_8bit_bf16 (target: >= 9,000 "
          "tokens/s in RAM at 56)")
    print(f"{'limit GiB':>9} | {'split (8bit_bf16)':>18} | {'split (adamw)':>16} | {'disk layers run':>15} | "
          f"{'tokens/s':>9} | {'host RSS GiB':>12} | {'disk GB/step':>12} | status")
    for limit, sp, sp32, dl, dm, tps, rss, gb, status in rows:
        f = lambda x: "none fit" if x is None else f"{x.moments}M+{x.whole}W"      # noqa: E731
        print(f"{limit:>9.1f} | {f(sp):>18} | {f(sp32):>16} | {f'{dl} ({dm}M)':>15} | "
              f"{tps or 0:>9,.0f} | {rss or 0:>12.1f} | {gb:>12.2f} | {status}")


if __name__ == "__main__":
    main()
