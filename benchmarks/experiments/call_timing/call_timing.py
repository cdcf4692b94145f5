"""Where the backward's thread spends its time inside a device update (`DeviceUpdater.update_now`):
each of its parts wrapped with a timer, and every tensor copy it queues timed by kind; a table of
totals, calls, means and maxima printed when the process ends.

A step timeline (`SLIDE_TRACE`) shows how long `update_now` takes; this shows which of its calls
the time is in: a call that waits for the GPU (a full queue of pending operations, a copy from
pageable memory) stands out by its mean against its siblings'. Run any benchmark with this
directory on PYTHONPATH and CALL_TIMING set (its `sitecustomize.py` loads this module in every
process, the benchmark's worker included):

    CALL_TIMING=1 PYTHONPATH=$PYTHONPATH:benchmarks/experiments/call_timing \\
        python benchmarks/bench_train.py --model llama3-3b --providers slide_8bit_bf16 --batch 8 \\
        --offload-batches 8 --cap-gib 8 --slide-config '{"device_update_share": 0.5}' ...

The timers cost about a microsecond a call; the calls timed are the ones below that exist in the
tree (an older tree lacks some).
"""
from __future__ import annotations

import atexit
import collections
import functools
import threading
import time

import torch

from hf_slideformer.engine import device_pieces, device_update, transfer
from hf_slideformer.host import adam8_torch, host_optim

_inside = threading.local()
_total: dict[str, float] = collections.defaultdict(float)
_calls: collections.Counter = collections.Counter()
_most: dict[str, float] = collections.defaultdict(float)


def _add(label: str, seconds: float) -> None:
    _total[label] += seconds
    _calls[label] += 1
    _most[label] = max(_most[label], seconds)


def _wrap(owner, name: str, label: str, outer: bool = False) -> None:
    fn = getattr(owner, name, None)
    if fn is None:
        return

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        if not (outer or getattr(_inside, "on", False)):
            return fn(*args, **kwargs)
        if outer:
            _inside.on = True
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _add(label, time.perf_counter() - start)
            if outer:
                _inside.on = False
    setattr(owner, name, timed)


def _kind(tensor: torch.Tensor) -> str:
    pinned = tensor.device.type == "cpu" and tensor.is_pinned()
    return tensor.device.type + ("(pinned)" if pinned else "")


def _install() -> None:
    _wrap(device_update.DeviceUpdater, "update_now", "update_now", outer=True)
    for owner, name, label in (
            (device_update.DeviceUpdater, "settle", "settle"),
            (device_update.DeviceUpdater, "_advance_steps", "advance the counters"),
            (device_update.DeviceUpdater, "_ensure_sets", "ensure the piece buffers"),
            (host_optim.StateFormat, "prepare_steps", "prepare_steps (fp32)"),
            (host_optim.AdamW8bit, "prepare_steps", "prepare_steps (8-bit)"),
            (device_pieces.PieceSets, "update", "a piece"),
            (device_pieces.Piece, "pairs", "a piece: its views"),
            (device_pieces.EntryGrads, "copy_into", "a piece: its gradient"),
            (device_pieces.Piece, "update", "a piece: the update"),
            (host_optim.AdamW8bit, "run", "a piece: the 8-bit format's run"),
            (adam8_torch.Hyper8, "kernel_args", "a piece: the kernel's arguments"),
            (adam8_torch, "adamw8_range_triton", "a piece: the Triton launch"),
            (transfer.CudaStreams, "wait", "stream wait"),
            (transfer.CudaStreams, "record", "event record"),
            (transfer.CudaStreams, "hand_over", "hand over")):
        _wrap(owner, name, label)
    copy = torch.Tensor.copy_

    def timed_copy(self, src, non_blocking=False):
        if not getattr(_inside, "on", False):
            return copy(self, src, non_blocking)
        start = time.perf_counter()
        try:
            return copy(self, src, non_blocking)
        finally:
            _add(f"copy {_kind(src)} -> {_kind(self)}{' non_blocking' if non_blocking else ''}",
                 time.perf_counter() - start)
    torch.Tensor.copy_ = timed_copy


@atexit.register
def _report() -> None:
    if not _total:
        return
    print("call timing inside DeviceUpdater.update_now (the backward's thread, every call):", flush=True)
    for label in sorted(_total, key=lambda k: -_total[k]):
        print(f"  {label:52s} total {_total[label] * 1e3:9.1f} ms  calls {_calls[label]:6d}  "
              f"mean {_total[label] / _calls[label] * 1e3:8.3f} ms  max {_most[label] * 1e3:8.1f} ms", flush=True)


_install()
