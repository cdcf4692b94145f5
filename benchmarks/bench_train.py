#!/usr/bin/env python
"""Training throughput: hf_slideformer against its baselines on one model shape, in one run.

    python benchmarks/bench_train.py --model llama3-3b --providers slide,hf,ds2,ds3,resident \\
        --batch 16 --steps 5 --json out/train.json
    python benchmarks/bench_train.py --model llama3-3b --providers ds2,ds3 --search-batches 4,8,16,32
    python benchmarks/bench_train.py --device cpu --model tiny --providers slide,hf   # smoke test
    python benchmarks/bench_train.py --model llama3-8b --providers slide,ds3 --nproc 2 --batch 16  # 2 GPUs

Each provider runs in its own process (clean GPU state, its own memory cap, DeepSpeed's
process group) under a wall-time limit; the parent collects the workers' JSON lines, derives
tokens/s, model TFLOPS, MFU and the efficiency against the step bound of docs/benchmarks.md,
writes JSON and prints the table last. Protocol and columns: docs/benchmarks.md.

With `--nproc N` each provider runs as N processes of one host (data parallel, one GPU each, the
environment torchrun sets); rank 0's events make the row, batch is per process, and tokens/s
counts all of them.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from benchmarks.harness import (DEFAULT_HARDWARE, GIB, HostUsedMonitor, StepTimer, emit, environment,  # noqa: E402
                                flops_per_token, format_table, free_memory, gpu_memory_peaks, host_rss_bytes,
                                host_rss_peak_bytes, is_cuda_oom, median, parse_line, peak_tflops, reset_peaks,
                                run_probe)
from benchmarks.batch_search import search_batches  # noqa: E402
from benchmarks.providers import PROVIDERS, RunSpec, get_provider  # noqa: E402
from benchmarks.providers.base import load_config, random_batch  # noqa: E402

DEFAULT_CAP_GIB = 24.0
RESPAWN_EXIT = 3
GROUP_GRACE_S = 20.0       # --nproc: how long the other ranks get to end after one ended or rank 0 reported
GROUP_FAIL_GRACE_S = 5.0   # ... after one failed (the others wait in a collective that never completes)


# ---------------------------------------------------------------------------------------------
# worker: one provider, one process
# ---------------------------------------------------------------------------------------------
def rank_env() -> tuple[int, int, int, int]:
    """(rank, world, local rank, local world) of this process: the launcher's environment, else one process."""
    def get(key: str, default: int) -> int:
        try:
            return int(os.environ.get(key) or default)
        except ValueError:
            return default
    world = get("WORLD_SIZE", 1)
    rank = get("RANK", 0)
    return rank, world, get("LOCAL_RANK", rank), get("LOCAL_WORLD_SIZE", world)


def run_worker(spec: RunSpec) -> int:
    """Set up one provider, try its batches largest first, emit the result of the first that fits.

    As one rank of several (`--nproc`), the rank trains on its own tokens (seeded with the rank),
    on the GPU of its LOCAL_RANK; the first batch that fails ends the run (an out-of-memory error
    leaves the other ranks in a collective: the parent ends them and may start smaller batches).
    """
    t_start = time.perf_counter()
    host_used = HostUsedMonitor()
    rank, world, local_rank, local_world = rank_env()
    device = torch.device(spec.device)
    if device.type == "cpu" and world > 1:  # the ranks share the cores: no oversubscribed thread pools
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank if world > 1 else device.index or 0)
        torch.cuda.set_device(device)
        total = torch.cuda.get_device_properties(device).total_memory
        if spec.cap_gib is not None:
            torch.cuda.set_per_process_memory_fraction(min(1.0, spec.cap_gib * GIB / total), device.index)
        emit("device", gpu=torch.cuda.get_device_name(device), gpu_total_memory=total)
    try:
        provider = get_provider(spec.provider)(spec)
        provider.setup()
    except ImportError as exc:
        traceback.print_exc()
        emit("result", status="skipped", error=f"not importable: {type(exc).__name__}: {exc}")
        return 0
    except Exception as exc:
        traceback.print_exc()
        emit("result", status="error", error=f"setup: {_short(exc)}")
        return 0
    config = provider.config
    host_used.sample()
    emit("setup", setup_s=time.perf_counter() - t_start, n_params=provider.n_params, n_linear=provider.n_linear,
         n_layers=config.num_hidden_layers, attn_dim=config.num_attention_heads * _head_dim(config),
         hidden=config.hidden_size)

    seen_oom, i = False, 0
    while i < len(spec.batches):
        batch = spec.batches[i]
        timer, failure, loss = StepTimer(device), None, None
        try:
            ids, labels = random_batch(config.vocab_size, batch, spec.seq, device, spec.seed + rank)
            retries0 = None
            for step in range(spec.warmup + spec.steps):
                warm = step < spec.warmup
                if step == spec.warmup:
                    provider.begin_timed()
                    retries0 = gpu_memory_peaks(device)["gpu_alloc_retries"]
                with (StepTimer(device) if warm else timer) as t:
                    loss = provider.train_step(ids, labels)
                host_used.sample()
                emit("warmup" if warm else "step", batch=batch, step=step, seconds=t.seconds[-1])
        except Exception as exc:
            traceback.print_exc()
            failure = (is_cuda_oom(exc), _short(exc))
        if failure is None:
            break
        ids = labels = loss = None
        oom, message = failure
        if world > 1:  # the other ranks wait in a collective for this one: no retry within the group
            if oom:
                emit("oom", batch=batch, error=message[:200])
            emit("result", status="oom" if oom else "error", batch=batch, notes=provider.notes,
                 error=f"out of memory at batch {batch}: {message}" if oom else message)
            return 1
        if not oom:
            if seen_oom:  # state broken by the earlier OOM: a fresh process continues from this batch
                emit("respawn", batches=spec.batches[i:], error=message)
                return RESPAWN_EXIT
            emit("result", status="error", batch=batch, error=message, notes=provider.notes)
            return 0
        seen_oom = True
        emit("oom", batch=batch, error=message[:200])
        free_memory()
        reset_peaks(device)  # the peaks reported are those of the batch that fits
        host_used.reset()
        try:
            retry = provider.after_oom(batch)
        except Exception as exc:
            emit("respawn", batches=spec.batches[i + 1:], error=f"after OOM: {_short(exc)}")
            return RESPAWN_EXIT
        free_memory()
        i += 0 if retry else 1
    else:
        emit("result", status="oom", error=f"out of memory at every batch of {spec.batches}", notes=provider.notes)
        return 0

    try:
        extra = provider.report()
    except Exception as exc:
        extra = {"report_error": _short(exc)}
    gpu = gpu_memory_peaks(device)
    if gpu["gpu_alloc_retries"] is not None and retries0 is not None:   # those of the timed steps
        gpu["gpu_alloc_retries"] -= retries0
    emit("result", status="ok", batch=batch, step_s=median(timer.seconds), step_times=timer.seconds,
         loss=float(loss.float().item()), host_rss_peak=host_rss_peak_bytes(), host_rss_end=host_rss_bytes(),
         **host_used.fields(), **gpu,
         rank=rank, world=world, notes=provider.notes, extra=extra)
    host_used.stop()
    if world > 1:
        _end_group()
    return 0


def _end_group() -> None:
    """Leave the process group after the result is out (a hang here costs the row nothing: the parent ends it)."""
    try:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    except Exception:
        traceback.print_exc()


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


# ---------------------------------------------------------------------------------------------
# parent: one process per provider, under a wall-time limit
# ---------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args: list[str], name: str, timeout: float, env_extra: dict[str, str]) -> tuple[list[dict], int | None, list[str]]:
    """Run `bench_train.py <args>` in a new session; return its events, exit code (None on timeout), last lines."""
    (run,), _ = _launch_group(args, name, timeout, [env_extra])
    return run.events, run.code, run.tail


@dataclasses.dataclass
class RankRun:
    """What one worker process of a launch left: its events, exit code, last lines of other output."""

    events: list[dict]
    code: int | None          # None: still running when it was killed
    tail: list[str]
    killed: bool = False      # ended by the parent (the time limit, or another rank's end)

    def result(self) -> dict | None:
        return next((e for e in reversed(self.events) if e["event"] == "result"), None)


def _launch_group(args: list[str], name: str, timeout: float, envs: list[dict[str, str]],
                  script: str | None = None) -> tuple[list[RankRun], bool]:
    """Run `bench_train.py <args>` (or `script`) as len(envs) processes (the ranks), each in a session of its own.

    Rank 0's output is echoed as `_launch` echoes it; the other ranks' log lines (not their event
    lines) with their rank. When one rank has ended, or rank 0 has reported its result, the others
    get GROUP_GRACE_S to end (GROUP_FAIL_GRACE_S after a failure: they wait in a collective that will
    never complete), then every rank still running is killed with its whole session; at `timeout`
    all are. One process (one env) is waited for until it ends or the time limit. Returns each
    rank's run and whether the time limit ended the launch.
    """
    procs: list[subprocess.Popen] = []
    runs = [RankRun([], None, []) for _ in envs]
    readers = []

    def read(rank: int, proc: subprocess.Popen, tail: collections.deque) -> None:
        label = name if rank == 0 else f"{name} r{rank}"
        for line in proc.stdout:
            event = parse_line(line)
            if event is not None:
                runs[rank].events.append(event)
                if rank:
                    continue
            else:
                tail.append(line.rstrip())
            sys.stderr.write(f"[{label}] {line}")
            sys.stderr.flush()

    def kill(rank: int) -> None:
        if procs[rank].poll() is None:
            try:
                os.killpg(procs[rank].pid, signal.SIGKILL)  # the rank's whole session: its helper processes
            except ProcessLookupError:
                pass
            runs[rank].killed = True

    tails = [collections.deque(maxlen=20) for _ in envs]
    deadline, timed_out, grace_end = time.monotonic() + max(1.0, timeout), False, None
    try:
        for rank, env_extra in enumerate(envs):
            env = {**os.environ, "PYTHONUNBUFFERED": "1", **env_extra}
            argv = [sys.executable, script or str(Path(__file__).resolve()), *args]
            procs.append(subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, start_new_session=True))
            readers.append(threading.Thread(target=read, args=(rank, procs[-1], tails[rank]), daemon=True))
            readers[-1].start()
        while True:
            codes = [proc.poll() for proc in procs]
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            if len(procs) == 1:
                time.sleep(0.1)
                continue
            results = [run.result() for run in runs]
            if any(c not in (None, 0) for c in codes) or any(r and r.get("status") != "ok" for r in results):
                grace_end = min(grace_end or math.inf, now + GROUP_FAIL_GRACE_S)
            elif grace_end is None and (results[0] is not None or any(c is not None for c in codes)):
                grace_end = now + GROUP_GRACE_S
            if grace_end is not None and now >= grace_end:
                break
            time.sleep(0.1)
    finally:
        for rank in range(len(procs)):
            kill(rank)
        for proc in procs:
            proc.wait()
    for rank, (proc, reader) in enumerate(zip(procs, readers)):
        reader.join(timeout=10)
        runs[rank].code = None if runs[rank].killed else proc.returncode
        runs[rank].tail = list(tails[rank])
    return runs, timed_out


def _dist_env(spec: RunSpec, rank: int, port: int) -> dict[str, str]:
    """The environment of rank `rank` of a launch of spec.nproc processes on this host (as torchrun sets it)."""
    n = str(spec.nproc)
    return {"RANK": str(rank), "WORLD_SIZE": n, "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": n,
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def _multi_process_providers() -> list[str]:
    out = []
    for name in PROVIDERS:
        try:
            if get_provider(name).multi_process:
                out.append(name)
        except Exception:
            pass
    return out


def run_provider(name: str, spec: RunSpec, timeout: float) -> dict:
    """Run one provider to its row, respawning a worker when an OOM left the previous one broken.

    With spec.nproc > 1 each launch is a group of that many processes (`_launch_group`); rank 0's
    events make the row (or, when rank 0 has no result, the first other rank that failed), and an
    out-of-memory batch ends the group: a fresh group tries the next smaller batch, if any.
    """
    deadline = time.monotonic() + timeout
    row: dict = {"provider": name, "capped": PROVIDERS[name][2], "cap_gib": spec.cap_gib,
                 "description": PROVIDERS[name][3], "oom_batches": [], "processes": 0, "nproc": spec.nproc}
    if spec.nproc > 1 and not get_provider(name).multi_process:
        row.update(status="skipped", error=f"--nproc {spec.nproc}: {name} trains in one process only (several "
                                           f"processes: {', '.join(_multi_process_providers())})")
        return row
    batches, relaunches = list(spec.batches), []   # relaunches: the parent's notes, kept past the next result
    while True:
        env = {"PYTORCH_CUDA_ALLOC_CONF": spec.alloc_conf} if spec.alloc_conf else {}
        if name.startswith("ds"):
            env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(_free_port()), "DS_SKIP_CUDA_CHECK": "1"}
        spec.batches = batches
        args = ["--worker-spec", spec.to_json()]
        if spec.nproc == 1:
            events, code, tail = _launch(args, name, deadline - time.monotonic(), env)
            runs, timed_out = [RankRun(events, code, tail, killed=code is None)], code is None
        else:  # the existing environment of the provider, less its one-rank group, plus the launch's
            port = _free_port()
            base = {k: v for k, v in env.items() if k not in _dist_env(spec, 0, 0)}
            runs, timed_out = _launch_group(args, name, deadline - time.monotonic(),
                                            [{**base, **_dist_env(spec, r, port)} for r in range(spec.nproc)])
        row["processes"] += spec.nproc
        for key in ("status", "error", "batch", "step_s", "step_times", "partial"):  # a fresh group's attempt
            row.pop(key, None)
        events, code, tail = runs[0].events, runs[0].code, runs[0].tail
        # the rank whose result the row reports: rank 0, else the first other rank that failed
        reporter = next((r for r, run in enumerate(runs) if run.result() is not None
                         and (r == 0 or run.result().get("status") != "ok")), 0)
        steps = [e for e in events if e["event"] == "step"]
        for e in events:
            if e["event"] in ("device", "setup"):
                row.update({k: v for k, v in e.items() if k != "event"})
        for e in runs[reporter].events:
            if e["event"] == "result":
                row.update({k: v for k, v in e.items() if k != "event"})
                if reporter:
                    row["error"] = f"rank {reporter}: {row.get('error')}"
            elif e["event"] == "oom":
                row["oom_batches"].append(e["batch"])
        respawn = next((e for e in events if e["event"] == "respawn"), None)
        if respawn:
            if respawn["batches"] and deadline - time.monotonic() > 30:
                relaunches.append(f"fresh process after: {respawn['error']}")
                batches = respawn["batches"]
                continue
            row.update(status="error", error=f"{respawn['error']} (after an OOM; no batch or time left to retry)")
        elif spec.nproc > 1 and row.get("status") == "oom" and row.get("batch") in batches:
            smaller = batches[batches.index(row["batch"]) + 1:]
            if smaller and deadline - time.monotonic() > 30:
                relaunches.append(f"fresh processes after out of memory at batch {row['batch']}")
                batches = smaller
                continue
        elif "status" in row and spec.nproc > 1:
            pass  # the reporting rank's result stands (the other ranks were ended after it)
        elif timed_out:
            row.update(status="timeout", error=f"wall-time limit of {timeout:.0f} s reached")
            if steps:  # a partial measurement beats none; the row says so
                last = steps[-1]["batch"]
                times = [e["seconds"] for e in steps if e["batch"] == last]
                row.update(batch=last, step_s=median(times), step_times=times, partial=True)
        if "status" not in row:
            crashed = next(((r, run) for r, run in enumerate(runs) if run.code not in (None, 0)), None)
            if crashed is None:  # no rank ended on its own with an error: rank 0's last words
                crashed = (0, runs[0])
            r, run = crashed
            who = f"rank {r} " if spec.nproc > 1 else ""
            row.update(status="crashed",
                       error=f"{who}exit code {run.code}: {run.tail[-1] if run.tail else ''}"[:300])
        elif spec.nproc > 1 and row["status"] != "ok":  # a rank that died can be the cause of the reported error
            died = [f"rank {r} exit code {run.code}" for r, run in enumerate(runs)
                    if r != reporter and run.code not in (None, 0) and run.result() is None]
            if died:
                row["error"] = f"{row.get('error')} ({', '.join(died)}, without a result)"
        if relaunches:
            row["notes"] = [*(row.get("notes") or []), *relaunches]
        return row


def run_parent(args: argparse.Namespace) -> int:
    providers = [p.strip() for p in args.providers.split(",") if p.strip()]
    unknown = [p for p in providers if p not in PROVIDERS]
    if unknown:
        raise SystemExit(f"unknown providers {unknown}; known: {', '.join(PROVIDERS)}")
    config = load_config(args.model)
    seq = args.seq or min(2048, config.max_position_embeddings)
    offload_batches = ([int(b) for b in args.offload_batches.split(",")] if args.offload_batches
                       else _halvings(args.batch))
    env_info = environment()
    if args.commit:
        env_info["commit"] = args.commit
    doc: dict = {**env_info, "shape": _shape(args.model, config, seq), "device": args.device,
                 "alloc_conf": args.alloc_conf,
                 "cap_gib": args.cap_gib, "warmup": args.warmup, "steps": args.steps,
                 "search_batches": args.search_batches, "nproc": args.nproc,
                 "flops_formula": "6 * N_linear + 12 * n_layers * attn_dim * seq per token (PaLM; full attention, "
                                  "no recompute)", "results": []}

    hardware = dict(DEFAULT_HARDWARE)
    if args.device == "cuda" and not args.no_probe:
        events, _, _ = _launch(["--probe"], "probe", 120, {})
        probe = next((e for e in events if e["event"] == "probe"), None)
        if probe:
            hardware.update({k: v for k, v in probe.items() if k != "event"}, source="measured in this run")
    doc["hardware"] = hardware

    search = [int(b) for b in args.search_batches.split(",")] if args.search_batches else None
    for name in providers:
        capped = PROVIDERS[name][2]
        cls = get_provider(name)
        spec = RunSpec(provider=name, model=args.model, seq=seq, device=args.device, dtype=args.dtype,
                       batches=offload_batches if capped else [args.batch], warmup=args.warmup, steps=args.steps,
                       cap_gib=args.cap_gib if capped and args.device == "cuda" else None, lr=args.lr,
                       checkpointing=args.checkpointing or cls.default_checkpointing or "auto",
                       kernels=args.kernels or cls.default_kernels or "none",
                       slide_options=json.loads(args.slide_config or "{}"), lora_r=args.lora_r,
                       alloc_conf=args.alloc_conf if args.device == "cuda" else "", nproc=args.nproc)
        if search:
            row = search_batches(lambda b, left: run_provider(name, dataclasses.replace(spec, batches=[b]), left),
                                 search, seq, args.timeout)
            for attempt in row.get("search", []):  # the search counts one rank's tokens; the row, all ranks'
                if attempt.get("tokens_per_s"):
                    attempt["tokens_per_s"] *= args.nproc
        else:
            row = run_provider(name, spec, args.timeout)
        doc["results"].append(row)
        _finish(doc, args)
        _write(doc, args.json)

    _finish(doc, args)
    _write(doc, args.json)
    print(render(doc))
    return 0


def _halvings(batch: int) -> list[int]:
    out = [batch]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


def _shape(name: str, config, seq: int) -> dict:
    return {"name": name, "model_type": config.model_type, "hidden": config.hidden_size,
            "layers": config.num_hidden_layers, "heads": config.num_attention_heads,
            "kv_heads": config.num_key_value_heads, "intermediate": config.intermediate_size,
            "vocab": config.vocab_size, "tied_embeddings": bool(config.tie_word_embeddings), "seq": seq}


def _write(doc: dict, path: str | None) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(doc, indent=1, default=str))


# ---------------------------------------------------------------------------------------------
# derived figures: throughput, FLOPs, the step bound (docs/benchmarks.md, "Protocol and columns")
# ---------------------------------------------------------------------------------------------
def _finish(doc: dict, args: argparse.Namespace) -> None:
    rows = doc["results"]
    gpu = next((r["gpu"] for r in rows if r.get("gpu")), None)
    doc["gpu"] = gpu
    peak = args.peak_tflops or peak_tflops(gpu)
    doc["peak_tflops"] = peak
    seq = doc["shape"]["seq"]
    for r in rows:
        if r.get("step_s") and r.get("batch"):  # every rank's tokens (batch is per process)
            tokens = r["batch"] * seq * ((r.get("extra") or {}).get("micro_batches") or 1) * (r.get("nproc") or 1)
            r["tokens_per_step"] = tokens
            r["tokens_per_s"] = tokens / r["step_s"]
            if r.get("n_linear"):
                r["model_tflops"] = flops_per_token(r["n_linear"], r["n_layers"], r["attn_dim"], seq) * tokens / r["step_s"] / 1e12
                r["mfu"] = r["model_tflops"] / (peak * (r.get("nproc") or 1)) if peak else None  # of all GPUs
        for key in ("gpu_peak_allocated", "gpu_peak_reserved", "host_rss_peak", "host_rss_end", "host_used_start",
                    "host_used_peak", "host_used_end"):
            if r.get(key) is not None:
                r[key + "_gib"] = r[key] / GIB
    resident = next((r for r in rows if r["provider"] == "resident" and r.get("status") == "ok"
                     and r.get("extra", {}).get("compute_s")), None)
    if resident is None and getattr(args, "resident_from", None):
        resident = _resident_row(args.resident_from, doc["shape"])
        doc["resident_from"] = args.resident_from
    if doc["device"] == "cuda":  # the bound describes a GPU machine; on a CPU run it means nothing
        for r in rows:
            r.update(step_bound(r, resident, doc["hardware"]))


def _resident_row(path: str, shape: dict) -> dict:
    """The `resident` row of an earlier run's JSON, for this run's GPU term (same shape and seq)."""
    with open(path) as f:
        earlier = json.load(f)
    if earlier.get("shape") != shape:
        raise SystemExit(f"--resident-from {path}: its shape {earlier.get('shape')} is not this run's {shape}")
    row = next((r for r in earlier.get("results", []) if r.get("provider") == "resident" and r.get("status") == "ok"
                and (r.get("extra") or {}).get("compute_s") and r.get("tokens_per_step")), None)
    if row is None:
        raise SystemExit(f"--resident-from {path}: no successful `resident` row with its compute time")
    return row


def step_bound(row: dict, resident: dict | None, hardware: dict) -> dict:
    """The largest of the step-time lower bounds (docs/benchmarks.md, "Protocol and columns"), and the
    row's efficiency against it.

    - gpu: the `resident` provider's forward + backward time, scaled linearly to this row's tokens;
    - pcie (capped rows): bf16 weights sent twice (forward and backward) and bf16 gradients
      returned once, at the measured one-way pinned bandwidths;
    - cpu_adam (capped rows): the parameters the CPU updates per step (all of them, less the
      resident layers' that the GPU updates) at the measured CPU AdamW update rate.
    Uncapped rows keep the model on the GPU: only the gpu term applies.
    With N processes (`nproc`) the GPUs and their links work side by side: gpu counts one rank's
    tokens, pcie each link's share (the weights to every GPU, 1/N of the gradients back from each),
    and cpu_adam every parameter, updated once on the one host.
    """
    if not row.get("step_s") or not row.get("n_params"):
        return {}
    n = row.get("nproc") or 1
    terms: dict[str, float] = {}
    if resident is not None:
        terms["gpu"] = resident["extra"]["compute_s"] * row["tokens_per_step"] / n / resident["tokens_per_step"]
    if row.get("capped"):
        p = row["n_params"]
        terms["pcie"] = max(2 * 2 * p / (hardware["h2d_gbs"] * 1e9), 2 * p / n / (hardware["d2h_gbs"] * 1e9))
        per_step = ((row.get("extra") or {}).get("slide_stats_per_step") or {})
        cpu_p = (per_step.get("updated_params") if n == 1 else None) or p   # a rank's stats count its shard
        terms["cpu_adam"] = min(p, cpu_p) / hardware["adam_params_per_s"]
    if not terms:
        return {}
    by = max(terms, key=terms.get)
    return {"bound_terms": terms, "bound_s": terms[by], "bound_by": by if "gpu" in terms else f"{by} (no gpu term)",
            "efficiency": terms[by] / row["step_s"]}


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
COLUMNS = [
    ("provider", "provider", ""), ("status", "status", ""), ("batch", "batch", "d"), ("nproc", "procs", "d"),
    ("tokens_per_s", "tokens/s", ",.0f"), ("step_s", "step s", ".3f"), ("model_tflops", "TFLOPS", ".1f"),
    ("mfu", "MFU", ".1%"), ("gpu_peak_allocated_gib", "GPU alloc GiB", ".1f"),
    ("gpu_peak_reserved_gib", "GPU reserved GiB", ".1f"), ("host_rss_peak_gib", "host RSS GiB", ".1f"),
    ("host_rss_end_gib", "RSS end GiB", ".1f"), ("host_used_peak_gib", "host used GiB", ".1f"),
    ("bound_s", "bound s", ".3f"), ("bound_by", "bound by", ""), ("efficiency", "efficiency", ".0%"),
    ("cap", "GPU cap", ""), ("setup_s", "setup s", ".0f"),
]


def render(doc: dict) -> str:
    """Notes and breakdowns first, the table last."""
    lines = [f"model {doc['shape']['name']} ({doc['shape']['layers']} layers, hidden {doc['shape']['hidden']}, "
             f"vocab {doc['shape']['vocab']}), seq {doc['shape']['seq']}, {doc['warmup']} warm-up + {doc['steps']} "
             f"timed steps, median; GPU {doc.get('gpu') or '-'}, peak {doc.get('peak_tflops') or '-'} TFLOPS bf16; "
             f"commit {(doc.get('commit') or '-')[:10]}{' (dirty)' if doc.get('dirty') else ''}"]
    hw = doc["hardware"]
    lines.append(f"bound inputs: h2d {hw['h2d_gbs']:.1f} GB/s, d2h {hw['d2h_gbs']:.1f} GB/s, "
                 f"CPU AdamW {hw['adam_params_per_s'] / 1e9:.2f} G params/s ({hw['source']})")
    for r in doc["results"]:
        r["cap"] = f"{r['cap_gib']:g} GiB" if r.get("cap_gib") else "none"
        facts = list(r.get("notes") or [])
        extra = r.get("extra") or {}
        if "gradient_checkpointing" in extra:
            facts.append(f"gradient checkpointing {'on' if extra['gradient_checkpointing'] else 'off'}")
        if (r.get("nproc") or 1) > 1 and r.get("batch"):
            facts.append(f"{r['nproc']} processes, batch {r.get('batch', '-')} each: tokens/s of all of them; GPU "
                         "memory and host RSS of rank 0; host used = the whole host's (MemTotal - MemAvailable), "
                         "the shared state once")
        if r.get("search"):
            each = "one launch of its processes" if (r.get("nproc") or 1) > 1 else "one process"
            facts.append(f"batch search, {each} each: " + "; ".join(
                f"{a['batch']} {a['status']}" + (f" {a['tokens_per_s']:,.0f} tokens/s" if a.get("tokens_per_s") else "")
                for a in r["search"]))
        if r.get("oom_batches"):
            facts.append(f"out of memory at batch {', '.join(map(str, r['oom_batches']))}")
        if r.get("partial"):
            facts.append(f"partial: {len(r['step_times'])} timed steps before the time limit")
        if r.get("error"):
            facts.append(f"error: {r['error']}")
        if r.get("bound_terms"):
            facts.append("bound terms: " + ", ".join(f"{k} {v:.3f} s" for k, v in r["bound_terms"].items()))
        if extra.get("compute_s"):
            facts.append(f"forward+backward {extra['compute_s']:.3f} s of the step")
        for key in ("slide_stats_per_step", "slide_stats_error"):
            if key in extra:
                facts.append(f"{key}: {json.dumps(extra[key], default=str)}")
        lines += [f"- {r['provider']}: {f}" for f in facts]
    lines += ["", format_table(doc["results"], COLUMNS)]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-3b", help="shape under benchmarks/configs/ (llama3-3b, llama3-8b, "
                    "qwen2.5-7b, tiny) or a path to a config.json")
    ap.add_argument("--providers", default="slide,hf,ds2,ds3,resident",
                    help="comma-separated: " + "; ".join(f"{k} = {v[3]}" for k, v in PROVIDERS.items()))
    ap.add_argument("--batch", type=int, default=16, help="sequences per step (uncapped providers; the largest "
                    "batch the capped ones try)")
    ap.add_argument("--offload-batches", default=None, help="batches the capped providers try, largest first "
                    "(default: --batch halved down to 1)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: 2048, or the shape's "
                    "max_position_embeddings if smaller)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps; the median counts")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--cap-gib", type=float, default=DEFAULT_CAP_GIB, help="GPU memory cap of the capped providers")
    ap.add_argument("--alloc-conf", default=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
                    help="PYTORCH_CUDA_ALLOC_CONF of every provider's process (the same allocator for all; "
                    "'' leaves it unset)")
    ap.add_argument("--timeout", type=float, default=240, help="wall-time limit per provider, seconds (with "
                    "--search-batches, for all of its processes together)")
    ap.add_argument("--checkpointing", default=None, choices=["auto", "on", "off"],
                    help="gradient checkpointing (HF's, non-reentrant) of hf, ds2, ds3, resident: auto = off unless "
                    "the batch runs out of memory (default: each provider as its users run it: on for hf, ds2, ds3; "
                    "auto for resident)")
    ap.add_argument("--kernels", default=None, choices=["auto", "liger", "triton_ops", "none"],
                    help="fused kernels of hf, ds2, ds3: auto = Liger if importable, else triton_ops (default: auto)")
    ap.add_argument("--search-batches", default=None, help="comma-separated batches each provider tries upward, "
                    "one fresh process per batch, stopping at the first out of memory; the row "
                    "is the fastest batch that fit (replaces --batch and --offload-batches)")
    ap.add_argument("--nproc", type=int, default=1, help="processes per provider, one GPU each, data parallel "
                    "on this host (the environment torchrun sets: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...); "
                    "--batch is per process, tokens/s counts all of them; slide, ds2 and ds3 only")
    ap.add_argument("--slide-config", default=None, help="JSON object of extra SlideConfig fields")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--lora-r", type=int, default=16, help="LoRA rank of the slide_lora, hf_lora and "
                    "hf_lora_offload providers")
    ap.add_argument("--peak-tflops", type=float, default=None, help="GPU bf16 peak for MFU (default: by GPU name)")
    ap.add_argument("--no-probe", action="store_true",
                    help="skip measuring PCIe and CPU Adam (use the H200 machine's figures of docs/benchmarks.md)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--resident-from", default=None, help="JSON of an earlier run of the same shape whose "
                    "`resident` row gives the bound's GPU term when this run has none")
    ap.add_argument("--commit", default=None, help="commit to record when the tree has no git metadata "
                    "(a copied tree on a GPU machine)")
    ap.add_argument("--worker-spec", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.nproc < 1:
        raise SystemExit(f"--nproc must be at least 1, got {args.nproc}")
    if args.worker_spec:
        return run_worker(RunSpec.from_json(args.worker_spec))
    if args.probe:
        return run_probe()
    return run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
