"""The one benchmark entry: `python -m benchmarks.suite SCENARIO`, one GPU call per scenario.

    python -m benchmarks.suite quick                   # GPU tests; 3B batch 16 and 8 under 24 GiB
    python -m benchmarks.suite baselines               # slide beside ZeRO-2, ZeRO-3 (best batches) and HF
    python -m benchmarks.suite multi                   # 8B on 2 GPUs: slide with 1 and 2 processes, ZeRO-3 on 2
    python -m benchmarks.suite small-gpu --old 14f6ed1 # ... and the project rows of an older commit
    python -m benchmarks.suite long --only 8b_seq64k,8b_seq128k
    python -m benchmarks.suite quick --smoke           # the same plumbing on the CPU, tiny shapes
    python -m benchmarks.suite full --dry-run          # the commands, not run

Runs the steps of `benchmarks/scenarios.py` in order, each in its own process group under its
timeout, and stops starting steps when the call's budget (`--budget`, 570 s of a 10-minute call)
is spent; a step that did not start says so. Steps of a chain (the long-context lengths) stop
at the first that does not succeed. With `--old COMMIT` the project's rows run a second time,
after the others, from a `git worktree` of that commit. Writes two files under `--out` (default
$OUT, else out/): SCENARIO.json (every step's status, rows and the JSON of its bench_train run)
and SCENARIO.log (every step's output), rewritten after each step; prints a short table last.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.scenarios import SCENARIOS, Settings, Step  # noqa: E402

DEFAULT_BUDGET_S = 570.0
MIN_STEP_S = 30.0  # a step with less time left than this is not started
_now = time.monotonic  # the budget's clock


# ---------------------------------------------------------------------------------------------
# trees: this checkout, and an older commit's worktree
# ---------------------------------------------------------------------------------------------
def _git(root: Path, *args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=120,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def old_worktree(commit: str) -> tuple[Path, str]:
    """A detached `git worktree` of `commit` under the temp directory (reused if there); its root and hash."""
    sha = _git(REPO_ROOT, "rev-parse", "--verify", f"{commit}^{{commit}}")
    if sha is None:
        raise SystemExit(f"--old {commit}: not a commit of this repository")
    root = Path(tempfile.gettempdir()) / f"slide-suite-old-{sha[:10]}"
    if not (root / "benchmarks" / "bench_train.py").is_file():
        if _git(REPO_ROOT, "worktree", "add", "-f", "--detach", str(root), sha) is None:
            raise SystemExit(f"--old {commit}: git worktree add {root} failed")
    return root, sha


# ---------------------------------------------------------------------------------------------
# running one step
# ---------------------------------------------------------------------------------------------
def run_step(step: Step, root: Path, commit: str | None, workdir: Path, timeout: float, label: str) -> dict:
    """Run `step` from `root`; its result: status, seconds, the rows of a train step, the log's path."""
    stem = f"{label}_{step.name}" if label != "new" else step.name
    log, out_json = workdir / f"{stem}.log", workdir / f"{stem}.json"
    argv = [sys.executable, *step.argv]
    if "--timeout" in argv and step.kind == "train":  # bench_train stops its provider in time to write its JSON
        i = argv.index("--timeout") + 1
        argv[i] = str(int(max(1.0, min(float(argv[i]), timeout - 10))))
    if step.kind == "train":
        argv += ["--json", str(out_json)] + (["--commit", commit] if commit else [])
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    result = {"name": step.name, "tree": label, "commit": commit, "command": " ".join(argv[1:]),
              "timeout_s": round(timeout), "log": str(log)}
    t0 = time.monotonic()
    with open(log, "w") as f:
        f.write(f"$ {' '.join(argv[1:])}\n")
        f.flush()
        proc = subprocess.Popen(argv, cwd=root, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the step's whole session: workers and their helpers
            proc.wait()
            rc = None
    result["seconds"] = round(time.monotonic() - t0, 1)
    result["rc"] = rc
    result["status"] = "timeout" if rc is None else "ok" if rc == 0 else f"failed (exit {rc})"
    text = log.read_text(errors="replace")
    result["last_line"] = next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip() not in ("", "}", "]")),
                               "")[:160]
    result["tail"] = text.splitlines()[-step.tail:] if step.tail else []
    if step.kind == "train" and out_json.is_file():
        doc = json.loads(out_json.read_text())
        result["doc"] = doc
        result["rows"] = [_row(r, doc) for r in doc.get("results", [])]
        if result["status"] == "ok" and any(r["status"] != "ok" for r in result["rows"]):
            result["status"] = next(r["status"] for r in result["rows"] if r["status"] != "ok")
    elif step.kind == "train" and result["status"] == "ok":
        result["status"] = "failed (no JSON)"
    return result


def _row(r: dict, doc: dict) -> dict:
    """The table's view of one bench_train result."""
    extra = r.get("extra") or {}
    notes = []
    if "gradient_checkpointing" in extra:
        notes.append(f"ckpt {'on' if extra['gradient_checkpointing'] else 'off'}")
    if extra.get("kernels"):
        notes.append(str(extra["kernels"]).split(":")[0].split("(")[0].strip())
    if r.get("search"):
        notes.append("search " + " ".join(f"{a['batch']}:{a['status']}" for a in r["search"]))
    elif r.get("oom_batches"):
        notes.append(f"oom at {','.join(map(str, r['oom_batches']))}")
    if r.get("partial"):
        notes.append("partial")
    if r.get("error") and r.get("status") != "ok":
        notes.append(r["error"][:80])
    return {"provider": r.get("provider"), "status": r.get("status"), "batch": r.get("batch"),
            "nproc": r.get("nproc") or 1, "seq": (doc.get("shape") or {}).get("seq"), "cap_gib": r.get("cap_gib"),
            "tokens_per_s": r.get("tokens_per_s"), "step_s": r.get("step_s"), "model_tflops": r.get("model_tflops"),
            "mfu": r.get("mfu"), "gpu_peak_allocated_gib": r.get("gpu_peak_allocated_gib"),
            "gpu_peak_reserved_gib": r.get("gpu_peak_reserved_gib"), "host_rss_peak_gib": r.get("host_rss_peak_gib"),
            "host_used_peak_gib": r.get("host_used_peak_gib"), "note": "; ".join(notes)}


# ---------------------------------------------------------------------------------------------
# the scenario
# ---------------------------------------------------------------------------------------------
def plan(args: argparse.Namespace, workdir: Path) -> list[tuple[Step, str]]:
    """(step, tree label) pairs in run order: the scenario's steps, then the project's on the old tree."""
    steps = SCENARIOS[args.scenario](Settings(smoke=args.smoke, workdir=workdir))
    only = set(filter(None, (args.only or "").split(",")))
    unknown = only - {s.name for s in steps}
    if unknown:
        raise SystemExit(f"--only: no step {sorted(unknown)} in {args.scenario}; its steps: "
                         f"{', '.join(s.name for s in steps)}")
    steps = [s for s in steps if not only or s.name in only]
    out = [(s, "new") for s in steps]
    if args.old:
        out += [(s, "old") for s in steps if s.project]
    return out


def run_suite(args: argparse.Namespace) -> dict:
    """Run the scenario's steps; the doc written to SCENARIO.json. The steps' own files go afterwards."""
    workdir = Path(tempfile.mkdtemp(prefix=f"suite-{args.scenario}-"))
    try:
        return _run_steps(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run_steps(args: argparse.Namespace, workdir: Path) -> dict:
    deadline = _now() + args.budget
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = plan(args, workdir)
    commit = args.commit or _git(REPO_ROOT, "rev-parse", "HEAD")
    doc = {"scenario": args.scenario, "smoke": args.smoke, "commit": commit, "old": args.old,
           "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "budget_s": args.budget,
           "command": " ".join(["python -m benchmarks.suite", *sys.argv[1:]]), "steps": []}
    trees = {"new": (REPO_ROOT, commit)}
    stopped: dict[tuple[str, str], str] = {}   # (tree, chain) -> the step that ended it
    for step, label in steps:
        result = {"name": step.name, "tree": label}
        left = deadline - _now()
        chain_end = stopped.get((label, step.chain or ""))
        if step.chain and chain_end:
            result.update(status="not run", last_line=f"{chain_end} did not succeed")
        elif left < MIN_STEP_S:
            result.update(status="not run", last_line=f"the call's budget of {args.budget:.0f} s is spent")
        else:
            try:
                if label not in trees:
                    trees[label] = old_worktree(args.old)
                root, sha = trees[label]
                result = run_step(step, root, sha, workdir, min(step.timeout, left), label)
            except SystemExit as exc:
                result.update(status="error", last_line=str(exc))
            if step.chain and result["status"] != "ok":
                stopped[(label, step.chain)] = step.name
        result["chain"] = step.chain
        doc["steps"].append(result)
        _progress(result)
        write_outputs(doc, out_dir)
    return doc


def _progress(result: dict) -> None:
    rows = result.get("rows") or []
    what = "; ".join(f"{r['provider']} {r['status']} {r['tokens_per_s'] or 0:,.0f} tokens/s" for r in rows)
    print(f"[suite] {result['tree']}:{result['name']}: {result['status']} ({result.get('seconds', 0):.0f} s) "
          f"{what or result.get('last_line', '')}", file=sys.stderr, flush=True)


def write_outputs(doc: dict, out_dir: Path) -> None:
    """SCENARIO.json and SCENARIO.log under `out_dir`: two files, whatever the number of steps."""
    name = doc["scenario"]
    steps = [{k: v for k, v in r.items() if k != "log"} for r in doc["steps"]]  # the logs live in SCENARIO.log
    (out_dir / f"{name}.json").write_text(json.dumps({**doc, "steps": steps}, indent=1, default=str))
    with open(out_dir / f"{name}.log", "w") as f:
        for r in doc["steps"]:
            f.write(f"\n===== {r['tree']}:{r['name']}: {r['status']}\n")
            if r.get("log") and Path(r["log"]).is_file():
                f.write(Path(r["log"]).read_text(errors="replace"))


COLUMNS = [("step", "step", ""), ("provider", "provider", ""), ("status", "status", ""), ("batch", "batch", "d"),
           ("nproc", "procs", "d"), ("seq", "seq", "d"), ("cap", "cap GiB", ""), ("tokens_per_s", "tokens/s", ",.0f"),
           ("step_s", "step s", ".3f"),
           ("model_tflops", "TFLOPS", ".0f"), ("mfu", "MFU", ".1%"), ("gpu", "GPU alloc/res GiB", ""),
           ("host_rss_peak_gib", "host RSS GiB", ".1f"), ("host_used_peak_gib", "host used GiB", ".1f"),
           ("note", "note", "")]


def render(doc: dict) -> str:
    """The tails of the steps that keep one, then one table row per result, last."""
    from benchmarks.harness import format_table

    lines, rows = [], []
    for r in doc["steps"]:
        if r.get("tail"):
            lines += [f"--- {r['tree']}:{r['name']}", *r["tail"]]
        step = r["name"] if r["tree"] == "new" else f"{r['name']} ({r['tree']} {(r.get('commit') or '')[:7]})"
        for row in r.get("rows") or [{"status": r["status"], "note": r.get("last_line", "")[:100]}]:
            gpu = (f"{row['gpu_peak_allocated_gib']:.1f} / {row['gpu_peak_reserved_gib']:.1f}"
                   if row.get("gpu_peak_allocated_gib") is not None else None)
            cap = f"{row['cap_gib']:g}" if row.get("cap_gib") else None
            rows.append({**row, "step": step, "gpu": gpu, "cap": cap})
    for chain in dict.fromkeys(r["chain"] for r in doc["steps"] if r.get("chain")):
        for tree in dict.fromkeys(r["tree"] for r in doc["steps"]):
            done = [r for r in doc["steps"] if r.get("chain") == chain and r["tree"] == tree]
            ok = [r["name"] for r in done if r["status"] == "ok"]
            end = next((f"; {r['name']}: {r['status']}" for r in done if r["status"] != "ok"), "")
            if done:
                lines.append(f"{chain} ({tree}): the last that trained: {ok[-1] if ok else 'none'}{end}")
                rates = [(r["name"], (r.get("rows") or [{}])[0].get("model_tflops"))
                         for r in done if r["status"] == "ok"]
                if len(rates) > 1 and rates[0][1]:  # the attention-adjusted FLOP rate against the shortest's
                    lines.append(f"  TFLOPS against {rates[0][0]}'s: " + ", ".join(
                        f"{name} {rate / rates[0][1]:.0%}" for name, rate in rates[1:] if rate))
    commit = (doc.get("commit") or "-")[:10]
    lines += ["", f"suite {doc['scenario']}{' (smoke)' if doc['smoke'] else ''}, commit {commit}, "
                  f"{doc['date_utc']}", format_table(rows, COLUMNS)]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.suite", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scenario", choices=list(SCENARIOS), help="; ".join(
        f"{k}: {(fn.__doc__ or '').strip().rstrip('.')}" for k, fn in SCENARIOS.items()))
    ap.add_argument("--old", default=None, help="also run the project's rows from a git worktree of this commit")
    ap.add_argument("--only", default=None, help="comma-separated step names to run (see --dry-run)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"), help="where SCENARIO.json and .log go "
                    "(default: $OUT, else out/)")
    ap.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds for all steps together")
    ap.add_argument("--commit", default=None, help="commit to record when the tree has no git metadata")
    ap.add_argument("--smoke", action="store_true", help="CPU scale: the tiny shape, short sequences, one step")
    ap.add_argument("--dry-run", action="store_true", help="print the steps' commands and exit")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        with tempfile.TemporaryDirectory(prefix=f"suite-{args.scenario}-") as workdir:
            for step, label in plan(args, Path(workdir)):
                chain = f", chain {step.chain}" if step.chain else ""
                print(f"{label}:{step.name} (timeout {step.timeout:.0f} s{chain}): python {' '.join(step.argv)}")
        return 0
    doc = run_suite(args)
    print(render(doc))
    return 0 if all(r["status"] == "ok" for r in doc["steps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
