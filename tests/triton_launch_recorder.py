"""A pytest plugin for the interpreter run (test_triton_ops.py, `test_kernels_under_interpreter`):
it records each Triton kernel launch's specialization (the kernel, its arguments' types, its
constexpr values) and writes the distinct ones as JSON to `$TRITON_LAUNCH_RECORD` at the end, so
that the parent compiles every kernel the CPU tests ran, for the GPU, without a GPU."""
from __future__ import annotations

import inspect
import json
import os

import torch

_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
           torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5", torch.int64: "i64", torch.int32: "i32",
           torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}
_SEEN: dict[str, dict] = {}


def _arg_type(value) -> str | None:
    """Triton's signature type of a runtime argument; None for one it takes as a constexpr."""
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
    if isinstance(value, float):
        return "fp32"
    return None                                   # None and the like: specialized as constexprs


def _record(fn, args, kwargs) -> None:
    params = inspect.signature(fn).parameters
    values = dict(zip(params, args), **kwargs)
    signature, constexprs = {}, {}
    for name, param in params.items():
        if name not in values:
            continue
        value = values[name]
        kind = None if "constexpr" in str(param.annotation) else _arg_type(value)
        if kind is None:
            signature[name], constexprs[name] = "constexpr", value
        else:
            signature[name] = kind
    spec = {"module": fn.__module__, "name": fn.__name__, "signature": signature, "constexprs": constexprs}
    _SEEN.setdefault(json.dumps(spec, sort_keys=True, default=str), spec)


def pytest_configure(config):
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        _record(self.fn, args, {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")})
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run


def pytest_sessionfinish(session, exitstatus):
    with open(os.environ["TRITON_LAUNCH_RECORD"], "w") as out:
        json.dump(list(_SEEN.values()), out, default=str)
