"""The host update's rate on this machine: `measure_rate` (fp32 AdamW, or any update given) and
`measure_state_rate` (a state format's), as the engine's CPU worker runs them; the planner's
`--adam-gps host` and benchmarks/host_adam_rate.py read them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .host_optim import StateFormat

__all__ = ["STATE_BYTES", "HostRate", "measure_rate", "measure_state_rate", "rate_unit"]


STATE_BYTES = 14     # per parameter of `measure_rate`'s update: fp32 master, m, v and a bf16 gradient


@dataclass(frozen=True)
class HostRate:
    """This machine's host AdamW rate, as `measure_rate` found it."""

    route: str            # "native" or "torch": the route `HostAdam(mode)` took here
    threads: int
    params: int           # parameters per timed update
    params_per_s: float   # the fastest update's rate

    def describe(self) -> str:
        return f"measured here: the {self.route} route, {self.threads} threads"


def measure_rate(mode: str = "auto", threads: int | None = None, params: int = 1 << 26, repeat: int = 5,
                 update=None) -> HostRate:
    """Time the host AdamW as the engine's CPU worker runs it: one update of `params` fp32
    parameters (master, exp_avg, exp_avg_sq) from a bf16 gradient, the fastest of `repeat`
    updates after one warm-up (as STREAM reports bandwidth: the slower ones met other work on
    the machine; two runs on an H200 machine read 3.56 and 4.01 G/s with the median).

    Args:
        mode: `SlideConfig.host_adam` ("auto", "native", "torch").
        threads: the worker's threads (default: `SlideConfig.cpu_threads`'s default on this machine).
        params: parameters per update; the default (67 M, 0.9 GiB of state) is far larger than any
            CPU cache, so the rate is the memory-bound one of a layer's update. Fewer where a quarter
            of the memory available here would not hold them (`HostRate.params` says how many).
        repeat: timed updates.
        update: `update(kernel, params, hp, grad, step)` returns the callable timed, for another
            state than fp32 AdamW's (`measure_state_rate`); None: fp32 master and moments.

    Note: the rate is the kernel's alone on the machine. In a training step the host's memory
    also serves the copy engines (about 0.85 of this rate on the H200 machine, docs/engine.md);
    the planner's efficiency for the CPU term accounts for that.
    """
    from ..config import _host_cores, worker_threads
    from .memory import available_host_bytes

    if not (isinstance(params, int) and params >= 1024):
        raise ValueError(f"params must be an int >= 1024, got {params!r}")
    if not (isinstance(repeat, int) and repeat >= 1):
        raise ValueError(f"repeat must be an int >= 1, got {repeat!r}")
    threads = worker_threads(_host_cores()) if threads is None else int(threads)
    from .host_adam import HostAdam

    kernel = HostAdam(mode, threads)
    free = available_host_bytes()
    if free is not None and free < 4 * STATE_BYTES * params:   # a small machine: a quarter of what is free at most
        params = max(1024, free // (4 * STATE_BYTES))
    # Plain values (no subnormals): the update's time does not depend on them.
    grad = torch.full((params,), 1e-3, dtype=torch.bfloat16)
    hp = {"lr": 1e-5, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    step = [torch.tensor(1.0)]
    if update is None:
        param, exp_avg = torch.full((params,), 0.5), torch.full((params,), 1e-4)
        exp_avg_sq = torch.full((params,), 1e-6)

        def run():
            kernel.step(hp, [param], [grad], [exp_avg], [exp_avg_sq], step)
    else:
        run = update(kernel, params, hp, grad, step)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)        # the torch route's threads, as the worker sets them
    try:
        times = []
        for trial in range(repeat + 1):
            t0 = time.perf_counter()
            run()
            if trial:
                times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return HostRate(kernel.name, threads, params, params / min(times))


@dataclass
class _Range:
    offset: int
    numel: int


@dataclass
class _RateUnit:
    entries: list
    numel: int
    master: torch.Tensor
    name: str = "rate"
    index: int = 0


def rate_unit(fmt: StateFormat, numel: int):
    """A unit of one parameter of `numel` elements in `fmt`, its state plain values (the rate
    measurements: `measure_state_rate`, benchmarks/host_adam_rate.py)."""
    unit = _RateUnit([_Range(0, numel)], numel, torch.full((numel,), 0.5, dtype=fmt.master_dtype))
    fmt.allocate([unit], lambda n, dtype: torch.ones(n, dtype=dtype))
    for array in fmt.arrays:
        if array.per == "block":
            getattr(unit, array.name).fill_(1e-3)
    return unit


def measure_state_rate(optimizer_state: str = "adamw", mode: str = "auto", threads: int | None = None,
                       params: int = 1 << 26, repeat: int = 5):
    """`measure_rate` of the update of `optimizer_state` (its master and moments in their
    dtypes, a bf16 gradient): a `HostRate`."""
    from .host_optim import state_format

    if optimizer_state == "adamw":
        return measure_rate(mode=mode, threads=threads, params=params, repeat=repeat)
    fmt = state_format(optimizer_state)

    def update(kernel, numel, hp, grad, step):
        unit = rate_unit(fmt, numel)
        return lambda: fmt.run(kernel, hp, unit, unit, [(0, 0, numel)], [grad], step, None)
    return measure_rate(mode=mode, threads=threads, params=params, repeat=repeat, update=update)
