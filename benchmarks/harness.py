"""Shared benchmark plumbing: timing, memory, FLOPs, environment, the JSON-line protocol, the table.

Every benchmark script in `benchmarks/` measures the same way with these helpers:

- time: wall clock between device synchronisations (`StepTimer`), the median over the timed
  steps after the warm-up ones;
- GPU memory: the caching allocator's peaks (`max_memory_allocated` / `max_memory_reserved`);
- host memory: the process's peak resident set (`VmHWM`), and the whole host's used memory
  (`MemTotal - MemAvailable`, sampled: `HostUsedMonitor`), which counts state that several
  processes share once;
- model FLOPs: `flops_per_token` (formula in its docstring), MFU against `peak_tflops`;
- a worker process talks to its parent in JSON lines tagged `@@bench ` on stdout (`emit`,
  `parse_line`), so that the worker's own logging can go to the same stream.
"""
from __future__ import annotations

import gc
import importlib.metadata
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

__all__ = [
    "TAG", "emit", "parse_line", "StepTimer", "median", "host_rss_peak_bytes", "host_rss_bytes", "host_used_bytes",
    "HostUsedMonitor", "gpu_memory_peaks",
    "is_cuda_oom", "free_memory", "reset_peaks", "linear_params", "flops_per_token", "peak_tflops", "environment",
    "format_table", "GIB", "DEFAULT_HARDWARE", "run_probe",
]

TAG = "@@bench "
GIB = 1024 ** 3
REPO_ROOT = Path(__file__).resolve().parent.parent

# Dense bf16 tensor-core peaks (TFLOPS) from the vendors' data sheets, for MFU.
_PEAK_BF16_TFLOPS = {
    "H200": 989.4, "H100 SXM": 989.4, "H100 80GB HBM3": 989.4, "H100 PCIe": 756.0, "H100 NVL": 835.0,
    "GH200": 989.4, "A100": 312.0, "L40S": 362.1, "RTX 4090": 165.2, "RTX 3090": 71.0, "A6000": 154.8,
}


# ---------------------------------------------------------------------------------------------
# worker -> parent protocol
# ---------------------------------------------------------------------------------------------
def emit(event: str, **fields: Any) -> None:
    """Print one tagged JSON line on stdout for the parent process."""
    print(TAG + json.dumps({"event": event, **fields}, default=_json_default), flush=True)


def parse_line(line: str) -> dict | None:
    """The event dict of a tagged line, or None for any other output."""
    line = line.strip()
    if not line.startswith(TAG.strip()):
        return None
    try:
        return json.loads(line[len(TAG.strip()):])
    except json.JSONDecodeError:
        return None


def _json_default(obj: Any) -> Any:
    if torch.is_tensor(obj):
        return obj.item() if obj.numel() == 1 else obj.tolist()
    if isinstance(obj, (torch.dtype, torch.device, Path)):
        return str(obj)
    return repr(obj)


# ---------------------------------------------------------------------------------------------
# timing and memory
# ---------------------------------------------------------------------------------------------
class StepTimer:
    """Wall time of a block, synchronising the device before and after it.

    Synchronising around the block makes the figure the time the block really costs, queued
    asynchronous GPU work included; host-side work that a block leaves running (a worker thread)
    shows up in the next block, so the median over steady-state steps counts it once.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.seconds: list[float] = []

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __enter__(self) -> "StepTimer":
        self._sync()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self._sync()
            self.seconds.append(time.perf_counter() - self._t0)


def median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _proc_status_bytes(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def host_rss_peak_bytes() -> int:
    """Peak resident set size of this process (VmHWM), pinned host memory included."""
    peak = _proc_status_bytes("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def host_rss_bytes() -> int | None:
    """Resident set size of this process now (VmRSS): the steady state after the timed steps."""
    return _proc_status_bytes("VmRSS")


def host_used_bytes() -> int | None:
    """Memory in use on the whole host now: MemTotal - MemAvailable of /proc/meminfo.

    Every process counts, and so do RAM file systems' pages (the state that data-parallel ranks
    share in shared memory counts once, where the sum of the ranks' RSS would count it in each rank);
    page cache the kernel can drop does not. None where /proc/meminfo is unreadable.
    """
    try:
        fields = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                fields[key] = int(rest.split()[0]) * 1024
        return fields["MemTotal"] - fields["MemAvailable"]
    except (OSError, KeyError, ValueError, IndexError):
        return None


class HostUsedMonitor:
    """The peak of `host_used_bytes` over a process's run: a daemon thread samples it every
    `interval` seconds, and `sample()` adds a reading where the caller knows a peak may be (after
    each training step). `fields()` gives host_used_start (at construction), host_used_peak and
    host_used_end (now), in bytes; None where the host has no /proc/meminfo.
    """

    def __init__(self, interval: float = 0.05):
        self.interval = interval
        self.start_bytes = host_used_bytes()
        self.peak = self.start_bytes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="host-used-monitor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> int | None:
        now = host_used_bytes()
        if now is not None and (self.peak is None or now > self.peak):
            self.peak = now
        return now

    def reset(self) -> None:
        """Start the peak afresh from now (after an attempt that ran out of memory)."""
        self.peak = host_used_bytes()

    def stop(self) -> None:
        self._stop.set()

    def fields(self) -> dict[str, int | None]:
        end = self.sample()
        return {"host_used_start": self.start_bytes, "host_used_peak": self.peak, "host_used_end": end}


def gpu_memory_peaks(device: torch.device) -> dict[str, int | None]:
    """Peak bytes allocated and reserved by the caching allocator since the process started, and
    how often it had to free its cache and retry an allocation (each retry synchronises the
    device: a cap that is tight for the run shows here first)."""
    device = torch.device(device)
    if device.type != "cuda":
        return {"gpu_peak_allocated": None, "gpu_peak_reserved": None, "gpu_alloc_retries": None}
    return {"gpu_peak_allocated": torch.cuda.max_memory_allocated(device),
            "gpu_peak_reserved": torch.cuda.max_memory_reserved(device),
            "gpu_alloc_retries": torch.cuda.memory_stats(device).get("num_alloc_retries")}


def reset_peaks(device: torch.device) -> None:
    """Start the GPU and host peak counters afresh (after an attempt that ran out of memory)."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: resets VmHWM to the current RSS
    except OSError:
        pass


def is_cuda_oom(exc: BaseException) -> bool:
    """True for a GPU out-of-memory error, whichever layer raised it (torch, cuBLAS, DeepSpeed)."""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("CUDA out of memory" in text or "CUDA error: out of memory" in text
                                              or "CUBLAS_STATUS_ALLOC_FAILED" in text)


def free_memory() -> None:
    """Collect garbage and hand cached GPU blocks back, after an out-of-memory error."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------
def linear_params(model: torch.nn.Module) -> int:
    """Parameters that take part in matrix multiplies: every nn.Linear's weight and bias.

    The lm_head counts (it is a matmul over the vocabulary, tied to the embedding or not); the
    input embedding lookup and the norm weights do not.
    """
    seen: set[int] = set()
    n = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            for p in module.parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    n += _numel(p)
    return n


def _numel(p: torch.Tensor) -> int:
    ds_numel = getattr(p, "ds_numel", None)  # ZeRO-3 partitioned parameters keep their full size here
    return int(ds_numel) if ds_numel is not None else p.numel()


def flops_per_token(n_linear: int, n_layers: int, attn_dim: int, seq: int) -> float:
    """Model FLOPs of one training token (forward + backward), the PaLM appendix-B formula.

    6 * N_linear + 12 * n_layers * attn_dim * seq, where N_linear counts the parameters in
    matmuls (`linear_params`) and attn_dim = n_heads * head_dim. The attention term counts the
    full S x S score and value products (no causal halving), and recomputation is not counted:
    these are model FLOPs, the same for every provider, not hardware FLOPs.
    """
    return 6.0 * n_linear + 12.0 * n_layers * attn_dim * seq


def peak_tflops(gpu_name: str | None) -> float | None:
    """Dense bf16 peak of the named GPU, or None when it is not in the table."""
    if not gpu_name:
        return None
    for key in sorted(_PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key in gpu_name:
            return _PEAK_BF16_TFLOPS[key]
    return None


# ---------------------------------------------------------------------------------------------
# hardware probe: the inputs of the step bound (docs/benchmarks.md, "Protocol and columns")
# ---------------------------------------------------------------------------------------------
# The H200 machine's figures (docs/benchmarks.md, "The machine"), used where the probe did not run.
DEFAULT_HARDWARE = {"h2d_gbs": 54.6, "d2h_gbs": 55.2, "duplex_gbs": 43.2, "adam_params_per_s": 3.5e9,
                    "source": "the H200 machine's figures (docs/benchmarks.md), not measured in this run"}


def run_probe(copy_bytes: int = GIB, adam_params: int = 1 << 29) -> int:
    """Measure pinned h2d / d2h bandwidth (each alone and both at once) and CPU AdamW's update rate.

    Copies: `copy_bytes` between a pinned host buffer and the GPU, best of 3 (GB/s = 1e9 B/s).
    Adam: torch.optim.AdamW(fused=True) on `adam_params` fp32 parameters on the CPU, all threads,
    median of 3 steps after one warm-up: the rate the offloading providers' CPU Adam can reach.
    Emits one `probe` event.
    """
    out: dict[str, Any] = {}
    if torch.cuda.is_available():
        host = [torch.empty(copy_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        dev = [torch.empty(copy_bytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
        streams = [torch.cuda.Stream(), torch.cuda.Stream()]

        def timed(fn) -> float:
            best = float("inf")
            for _ in range(4):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t0)
            return best

        def both() -> None:
            with torch.cuda.stream(streams[0]):
                dev[0].copy_(host[0], non_blocking=True)
            with torch.cuda.stream(streams[1]):
                host[1].copy_(dev[1], non_blocking=True)

        out["h2d_gbs"] = copy_bytes / timed(lambda: dev[0].copy_(host[0], non_blocking=True)) / 1e9
        out["d2h_gbs"] = copy_bytes / timed(lambda: host[1].copy_(dev[1], non_blocking=True)) / 1e9
        out["duplex_gbs"] = copy_bytes / timed(both) / 1e9
        out["gpu"] = torch.cuda.get_device_name()
        del host, dev
    p = torch.nn.Parameter(torch.zeros(adam_params))
    p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW([p], lr=1e-5, fused=True)
    seconds = []
    for _ in range(4):
        t0 = time.perf_counter()
        opt.step()
        seconds.append(time.perf_counter() - t0)
    out["adam_params_per_s"] = adam_params / statistics.median(seconds[1:])
    out["adam_threads"] = torch.get_num_threads()
    emit("probe", **out)
    return 0


# ---------------------------------------------------------------------------------------------
# environment
# ---------------------------------------------------------------------------------------------
def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def environment(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Where and with what a benchmark ran: command, commit, versions, host. No CUDA init here."""
    argv = list(sys.argv if argv is None else argv)
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "command": " ".join([os.path.basename(sys.executable)] + argv),
        "commit": _git("rev-parse", "HEAD"),
        "dirty": bool(status) if status is not None else None,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "memory_gib": _host_memory_gib()},
        "versions": {
            "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            **{name: _version(name) for name in ("transformers", "deepspeed", "triton", "liger-kernel",
                                                 "accelerate", "hf_slideformer")},
        },
    }


def _host_memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024 ** 2, 1)
    except OSError:
        pass
    return None


# ---------------------------------------------------------------------------------------------
# table
# ---------------------------------------------------------------------------------------------
def format_table(rows: Iterable[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """A GitHub-markdown table. columns: (key, header, format spec); None prints as '-'."""
    header = [h for _, h, _ in columns]
    body = []
    for row in rows:
        cells = []
        for key, _, spec in columns:
            value = row.get(key)
            if value is None or (isinstance(value, float) and math.isnan(value)):
                cells.append("-")
            elif spec:
                cells.append(format(value, spec))
            else:
                cells.append(str(value))
        body.append(cells)
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(header)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"
    out = [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in body]
    return "\n".join(out)
