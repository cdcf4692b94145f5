#!/usr/bin/env python
"""Training throughput: hf_slideformer against its baselines on one model shape, in one run.

    python benchmarks/bench_train.py --model llama3-3b --providers slide,hf,ds2,ds3,resident \\
        --batch 16 --steps 5 --json out/train.json
    python benchmarks/bench_train.py --model llama3-3b --providers ds2,ds3 --search-batches 4,8,16,32
    python benchmarks/bench_train.py --device cpu --model tiny --providers slide,hf   # smoke test

Each provider runs in its own process (clean GPU state, its own memory cap, DeepSpeed's
process group) under a wall-time limit; the parent collects the workers' JSON lines, derives
tokens/s, model TFLOPS, MFU and the efficiency against the step bound of DESIGN section 6,
writes JSON and prints the table last. Protocol and columns: docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
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

from benchmarks.harness import (DEFAULT_HARDWARE, GIB, StepTimer, emit, environment, flops_per_token,  # noqa: E402
                                format_table, free_memory, gpu_memory_peaks, host_rss_bytes, host_rss_peak_bytes,
                                is_cuda_oom, median, parse_line, peak_tflops, reset_peaks, run_probe)
from benchmarks.batch_search import search_batches  # noqa: E402
from benchmarks.providers import PROVIDERS, RunSpec, get_provider  # noqa: E402
from benchmarks.providers.base import load_config, random_batch  # noqa: E402

DEFAULT_CAP_GIB = 24.0
RESPAWN_EXIT = 3


# ---------------------------------------------------------------------------------------------
# worker: one provider, one process
# ---------------------------------------------------------------------------------------------
def run_worker(spec: RunSpec) -> int:
    """Set up one provider, try its batches largest first, emit the result of the first that fits."""
    t_start = time.perf_counter()
    device = torch.device(spec.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
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
    emit("setup", setup_s=time.perf_counter() - t_start, n_params=provider.n_params, n_linear=provider.n_linear,
         n_layers=config.num_hidden_layers, attn_dim=config.num_attention_heads * _head_dim(config),
         hidden=config.hidden_size)

    seen_oom, i = False, 0
    while i < len(spec.batches):
        batch = spec.batches[i]
        timer, failure, loss = StepTimer(device), None, None
        try:
            ids, labels = random_batch(config.vocab_size, batch, spec.seq, device, spec.seed)
            for step in range(spec.warmup + spec.steps):
                warm = step < spec.warmup
                if step == spec.warmup:
                    provider.begin_timed()
                with (StepTimer(device) if warm else timer) as t:
                    loss = provider.train_step(ids, labels)
                emit("warmup" if warm else "step", batch=batch, step=step, seconds=t.seconds[-1])
        except Exception as exc:
            traceback.print_exc()
            failure = (is_cuda_oom(exc), _short(exc))
        if failure is None:
            break
        ids = labels = loss = None
        oom, message = failure
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
    emit("result", status="ok", batch=batch, step_s=median(timer.seconds), step_times=timer.seconds,
         loss=float(loss.float().item()), host_rss_peak=host_rss_peak_bytes(), host_rss_end=host_rss_bytes(),
         **gpu_memory_peaks(device),
         notes=provider.notes, extra=extra)
    return 0


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
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **env_extra}
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *args], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    events: list[dict] = []
    tail: collections.deque[str] = collections.deque(maxlen=20)

    def read() -> None:
        for line in proc.stdout:
            event = parse_line(line)
            if event is not None:
                events.append(event)
            else:
                tail.append(line.rstrip())
            sys.stderr.write(f"[{name}] {line}")
            sys.stderr.flush()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the worker's whole session: its compiler and helper processes
        proc.wait()
        code = None
    reader.join(timeout=10)
    return events, code, list(tail)


def run_provider(name: str, spec: RunSpec, timeout: float) -> dict:
    """Run one provider to its row, respawning a worker when an OOM left the previous one broken."""
    deadline = time.monotonic() + timeout
    row: dict = {"provider": name, "capped": PROVIDERS[name][2], "cap_gib": spec.cap_gib,
                 "description": PROVIDERS[name][3], "oom_batches": [], "processes": 0}
    batches = list(spec.batches)
    while True:
        env = {"PYTORCH_CUDA_ALLOC_CONF": spec.alloc_conf} if spec.alloc_conf else {}
        if name.startswith("ds"):
            env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(_free_port()), "DS_SKIP_CUDA_CHECK": "1"}
        spec.batches = batches
        events, code, tail = _launch(["--worker-spec", spec.to_json()], name, deadline - time.monotonic(), env)
        row["processes"] += 1
        steps = [e for e in events if e["event"] == "step"]
        for e in events:
            if e["event"] in ("device", "setup", "result"):
                row.update({k: v for k, v in e.items() if k != "event"})
            elif e["event"] == "oom":
                row["oom_batches"].append(e["batch"])
        respawn = next((e for e in events if e["event"] == "respawn"), None)
        if respawn:
            if respawn["batches"] and deadline - time.monotonic() > 30:
                row.setdefault("notes", []).append(f"fresh process after: {respawn['error']}")
                batches = respawn["batches"]
                continue
            row.update(status="error", error=f"{respawn['error']} (after an OOM; no batch or time left to retry)")
        elif code is None:
            row.update(status="timeout", error=f"wall-time limit of {timeout:.0f} s reached")
            if steps:  # a partial measurement beats none; the row says so
                last = steps[-1]["batch"]
                times = [e["seconds"] for e in steps if e["batch"] == last]
                row.update(batch=last, step_s=median(times), step_times=times, partial=True)
        elif "status" not in row:
            row.update(status="crashed", error=f"exit code {code}: {tail[-1] if tail else ''}"[:300])
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
                 "search_batches": args.search_batches,
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
                       alloc_conf=args.alloc_conf if args.device == "cuda" else "")
        if search:
            row = search_batches(lambda b, left: run_provider(name, dataclasses.replace(spec, batches=[b]), left),
                                 search, seq, args.timeout)
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
# derived figures: throughput, FLOPs, the bound of DESIGN section 6
# ---------------------------------------------------------------------------------------------
def _finish(doc: dict, args: argparse.Namespace) -> None:
    rows = doc["results"]
    gpu = next((r["gpu"] for r in rows if r.get("gpu")), None)
    doc["gpu"] = gpu
    peak = args.peak_tflops or peak_tflops(gpu)
    doc["peak_tflops"] = peak
    seq = doc["shape"]["seq"]
    for r in rows:
        if r.get("step_s") and r.get("batch"):
            tokens = r["batch"] * seq * ((r.get("extra") or {}).get("micro_batches") or 1)
            r["tokens_per_step"] = tokens
            r["tokens_per_s"] = tokens / r["step_s"]
            if r.get("n_linear"):
                r["model_tflops"] = flops_per_token(r["n_linear"], r["n_layers"], r["attn_dim"], seq) * tokens / r["step_s"] / 1e12
                r["mfu"] = r["model_tflops"] / peak if peak else None
        for key in ("gpu_peak_allocated", "gpu_peak_reserved", "host_rss_peak", "host_rss_end"):
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
    """The largest of the step-time lower bounds of DESIGN section 6, and the row's efficiency against it.

    - gpu: the `resident` provider's forward + backward time, scaled linearly to this row's tokens;
    - pcie (capped rows): bf16 weights sent twice (forward and backward) and bf16 gradients
      returned once, at the measured one-way pinned bandwidths;
    - cpu_adam (capped rows): the parameters the CPU updates per step (all of them, less the
      resident layers' that the GPU updates) at the measured CPU AdamW update rate.
    Uncapped rows keep the model on the GPU: only the gpu term applies.
    """
    if not row.get("step_s") or not row.get("n_params"):
        return {}
    terms: dict[str, float] = {}
    if resident is not None:
        terms["gpu"] = resident["extra"]["compute_s"] * row["tokens_per_step"] / resident["tokens_per_step"]
    if row.get("capped"):
        p = row["n_params"]
        terms["pcie"] = max(2 * 2 * p / (hardware["h2d_gbs"] * 1e9), 2 * p / (hardware["d2h_gbs"] * 1e9))
        per_step = ((row.get("extra") or {}).get("slide_stats_per_step") or {})
        cpu_p = per_step.get("updated_params") or p
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
    ("provider", "provider", ""), ("status", "status", ""), ("batch", "batch", "d"),
    ("tokens_per_s", "tokens/s", ",.0f"), ("step_s", "step s", ".3f"), ("model_tflops", "TFLOPS", ".1f"),
    ("mfu", "MFU", ".1%"), ("gpu_peak_allocated_gib", "GPU alloc GiB", ".1f"),
    ("gpu_peak_reserved_gib", "GPU reserved GiB", ".1f"), ("host_rss_peak_gib", "host RSS GiB", ".1f"),
    ("host_rss_end_gib", "RSS end GiB", ".1f"),
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
        if r.get("search"):
            facts.append("batch search, one process each: " + "; ".join(
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
    ap.add_argument("--slide-config", default=None, help="JSON object of extra SlideConfig fields")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--lora-r", type=int, default=16, help="LoRA rank of the slide_lora, hf_lora and "
                    "hf_lora_offload providers")
    ap.add_argument("--peak-tflops", type=float, default=None, help="GPU bf16 peak for MFU (default: by GPU name)")
    ap.add_argument("--no-probe", action="store_true", help="skip measuring PCIe and CPU Adam (use DESIGN's figures)")
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
    if args.worker_spec:
        return run_worker(RunSpec.from_json(args.worker_spec))
    if args.probe:
        return run_probe()
    return run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
