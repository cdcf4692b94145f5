"""The host optimizer's state formats: what AdamW keeps per parameter, and the update of a range.

A `StateFormat` declares the arrays it keeps for a unit (named, with their dtype and whether they
hold one value per parameter or one per block of a parameter), its bytes per parameter, and
updates a range of a unit from its gradient. The host store allocates what the format declares,
the checkpoints save and check it, the planner and the memory checks count its bytes; nothing
else assumes two fp32 moments.

| name | master | moments | bytes / param | update |
|---|---|---|---|---|
| `adamw` (default) | fp32 | fp32 `exp_avg`, `exp_avg_sq` | 12 | torch.optim.AdamW, bit for bit |
| `adamw_8bit` | fp32 | 8-bit block-wise, fp32 absmax per 256 | 6.03 | bitsandbytes' blockwise 8-bit AdamW |
| `adamw_8bit_bf16` | bf16, rounded stochastically | as `adamw_8bit` | 4.03 | the same, master rounded to bf16 |

The embedding keeps the units' format where its rows are whole blocks (`embed_format`: row-wise
`run_rows`), else fp32 AdamW, as a resident embedding does. docs/host_state.md compares them.
"""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch

from .host_adam import torch_fused_adamw
from .quant_maps import BLOCK, M64, code_search_table, dynamic_map, num_blocks, rounding_key, signed64

__all__ = ["StateArray", "StateFormat", "AdamW32", "AdamW8bit", "AdamW8bitBf16", "FORMATS", "state_format",
           "embed_format", "unit_format", "formats_holding", "optimizer_state_of", "TRAINER_8BIT_NAMES",
           "StateFormatMismatchError", "CorruptOptimizerStateError", "round_bf16_stochastic"]


class StateFormatMismatchError(ValueError):
    """Optimizer state of one format offered to a model configured with another."""


class CorruptOptimizerStateError(ValueError):
    """A loaded optimizer state holds values its format cannot hold (a non-finite or negative scale)."""


@dataclass(frozen=True)
class StateArray:
    """One array of a unit's optimizer state: `per` is "param" (one value per parameter, laid out as
    the master) or "block" (one per block of `BLOCK` values of each parameter, from its start)."""

    name: str
    dtype: torch.dtype
    per: str = "param"


class StateFormat:
    """What the host AdamW keeps per parameter and how it updates a range (see the module)."""

    name: str = ""
    master_dtype: torch.dtype = torch.float32
    arrays: tuple[StateArray, ...] = ()

    @property
    def bytes_per_param(self) -> float:
        """Host bytes per trainable parameter: master and moments (block scales amortised)."""
        total = self.master_dtype.itemsize
        for array in self.arrays:
            total += array.dtype.itemsize / (BLOCK if array.per == "block" else 1)
        return total

    def sizes(self, unit) -> dict[str, int]:
        """Elements of each array of `unit`."""
        blocks = sum(num_blocks(e.numel) for e in unit.entries)
        return {a.name: (blocks if a.per == "block" else unit.numel) for a in self.arrays}

    def state_bytes(self, unit) -> int:
        """Host bytes of `unit`'s moments (its master not included)."""
        return sum(n * a.dtype.itemsize for a, n in zip(self.arrays, self.sizes(unit).values()))

    def allocate(self, units, zeros) -> None:
        """Give each unit its zeroed arrays, carved from one `zeros(numel, dtype)` slab per array."""
        for array in self.arrays:
            sizes = [self.sizes(u)[array.name] for u in units]
            slab = zeros(sum(sizes), array.dtype)
            off = 0
            for unit, size in zip(units, sizes):
                setattr(unit, array.name, slab[off:off + size])
                off += size
        for unit in units:
            unit.state_format = self

    def tensors(self, unit) -> dict[str, torch.Tensor]:
        """`unit`'s master and arrays by name (what a checkpoint holds)."""
        return {"master": unit.master, **{a.name: getattr(unit, a.name) for a in self.arrays}}

    def entry_state(self, unit, index: int, src=None) -> dict[str, torch.Tensor]:
        """Views of entry `index`'s part of each array (the optimizer's per-parameter state); of `src`
        (another holder of the arrays in `unit`'s layout) when given."""
        src = unit if src is None else src
        entry, out = unit.entries[index], {}
        b0 = sum(num_blocks(x.numel) for x in unit.entries[:index])
        for array in self.arrays:
            tensor = getattr(src, array.name)
            out[array.name] = entry.view(tensor) if array.per == "param" else tensor[b0:b0 + num_blocks(entry.numel)]
        return out

    def check(self, name: str, values: torch.Tensor, where: str) -> None:
        """Raise `CorruptOptimizerStateError` when array `name` holds values the format cannot hold."""

    def run(self, kernel, hp: dict, unit, state, ranges, grads, steps, scale, grad_mul: float = 1.0,
            found_inf=None) -> None:
        """One AdamW step of the flat ranges [(entry index, lo, hi)] of `unit`'s `state` (the unit, or a
        holder of its arrays), with `grads[i]` the gradient of range i and `steps[i]` its counter
        (advanced) or `prepare_steps`' of it. `scale`: divide the gradient by it (the clip factor's reciprocal)."""
        raise NotImplementedError

    def prepare_steps(self, groups: list[dict], by_group: dict[int, list[int]], unit, counters: list, scale,
                      device) -> list:
        """The host step `counters` (per entry of `unit`, advanced; `by_group`: group index -> entries)
        as `run` takes them in an update on `device` of many pieces with one `scale`, made once (on
        the current stream). Here: the counters themselves on the CPU, device copies on a GPU."""
        if torch.device(device).type == "cpu":
            return counters
        # pinned: a copy from pageable memory would block this thread until the stream's queue has run
        return list(torch.stack(counters).pin_memory().to(device, non_blocking=True).unbind())

    def run_rows(self, kernel, hp: dict, unit, grad: torch.Tensor, rows: torch.Tensor, step, *,
                 sums: torch.Tensor | None = None, zero_grad: bool = False, exclude: bool = False) -> None:
        """One AdamW step of some rows of the one-entry (V, H) `unit` (the embedding), in place:
        `HostAdam.step_rows`'s contract (`grad` the dense (V, H) fp32 gradient, `rows` distinct,
        `sums` added to their gradient, the rows cleared after with `zero_grad`, every row but
        `rows` with `exclude`), `step` the counter (already advanced)."""
        raise NotImplementedError(f"optimizer_state={self.name!r} has no row-wise update")

    def rows_fit(self, hidden: int) -> bool:
        """Can a (V, hidden) table keep this format and take row-wise updates?"""
        return True


class AdamW32(StateFormat):
    """fp32 master and moments: torch.optim.AdamW's step bit for bit (host_adam.py)."""

    name = "adamw"
    arrays = (StateArray("exp_avg", torch.float32), StateArray("exp_avg_sq", torch.float32))

    def run(self, kernel, hp, unit, state, ranges, grads, steps, scale, grad_mul=1.0, found_inf=None) -> None:
        ps = [state.master[a:b] for _, a, b in ranges]
        ms = [state.exp_avg[a:b] for _, a, b in ranges]
        vs = [state.exp_avg_sq[a:b] for _, a, b in ranges]
        if kernel is None:
            torch_fused_adamw(hp, ps, grads, ms, vs, steps, scale, found_inf)
        else:
            kernel.step(hp, ps, grads, ms, vs, steps, grad_scale=scale, grad_mul=grad_mul)

    def run_rows(self, kernel, hp, unit, grad, rows, step, *, sums=None, zero_grad=False, exclude=False) -> None:
        shape = grad.shape
        kernel.step_rows(hp, [t.view(shape) for t in (unit.master, unit.exp_avg, unit.exp_avg_sq)], grad, rows, step,
                         sums=sums, zero_grad=zero_grad, exclude=exclude)


class _HP8(ctypes.Structure):
    _fields_ = [(n, ctypes.c_float) for n in
                ("gmul", "gclip", "sign", "wd_mul", "beta1", "c1", "beta2", "c2", "bc2", "eps", "neg_step")] + [
        ("pad_", ctypes.c_int32), ("seed", ctypes.c_uint64)]


def _bind(lib):
    fn = lib.slide_adamw8
    if getattr(fn, "_bound", False):
        return fn
    fn.argtypes = ([ctypes.c_void_p] * 7 + [ctypes.c_int64] + [ctypes.c_void_p] * 4
                   + [ctypes.POINTER(_HP8), ctypes.c_uint64, ctypes.c_int, ctypes.c_int, ctypes.c_int])
    fn.restype = None
    lib.slide_round_bf16_stochastic.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64,
                                                ctypes.c_uint64, ctypes.c_int]
    lib.slide_round_bf16_stochastic.restype = None
    lib.slide_adamw8_rows.argtypes = ([ctypes.c_void_p] * 7 + [ctypes.c_int64] * 2 + [ctypes.c_void_p, ctypes.c_int]
                                      + [ctypes.c_void_p] * 4 + [ctypes.POINTER(_HP8), ctypes.c_int, ctypes.c_int])
    lib.slide_adamw8_rows.restype = None
    fn._bound = True
    return fn


def round_bf16_stochastic(values: torch.Tensor, key: int, ctr: int = 0, threads: int = 1) -> torch.Tensor:
    """bf16 of fp32 `values` (flat) rounded stochastically as a bf16 master is: element i with the hash
    of (key, ctr + i). Native kernel only."""
    from .host_adam import native_library

    lib = native_library()
    _bind(lib)
    values = values.reshape(-1).contiguous().to(torch.float32)
    out = torch.empty(values.numel(), dtype=torch.bfloat16)
    lib.slide_round_bf16_stochastic(values.data_ptr(), out.data_ptr(), values.numel(), key & M64, ctr & M64, threads)
    return out


class AdamW8bit(StateFormat):
    """8-bit block-wise moments (bitsandbytes' blockwise 8-bit AdamW), fp32 master.

    The update is one pass per block of 256 (csrc/host_adam8.c): it dequantizes the moments, takes
    the step with the unquantized new moments, and stores them requantized with the block's new
    absmax, as bitsandbytes' CPU update does. A range must start at a block of its parameter.
    """

    name = "adamw_8bit"
    arrays = (StateArray("exp_avg", torch.uint8), StateArray("exp_avg_sq", torch.uint8),
              StateArray("exp_avg_absmax", torch.float32, "block"),
              StateArray("exp_avg_sq_absmax", torch.float32, "block"))
    seed = 0

    def __init__(self):
        self._tables = None

    def tables(self):
        """The maps and rounding tables of exp_avg (signed) and exp_avg_sq (unsigned)."""
        if self._tables is None:
            self._tables = tuple(t.contiguous() for t in (dynamic_map(True), dynamic_map(False),
                                                          code_search_table(True), code_search_table(False)))
        return self._tables

    def check(self, name, values, where) -> None:
        if name.endswith("_absmax"):
            bad = ~torch.isfinite(values) | (values < 0)
            if bool(bad.any()):
                first = int(bad.nonzero()[0])
                raise CorruptOptimizerStateError(
                    f"{where}: {name} holds {int(bad.sum())} invalid block scale(s) "
                    f"(block {first}: {float(values[first])!r}; "
                    "a scale is a finite absmax >= 0): the optimizer state is damaged, load a good checkpoint")

    def run(self, kernel, hp, unit, state, ranges, grads, steps, scale, grad_mul=1.0, found_inf=None) -> None:
        if kernel is None or not kernel.native or found_inf is not None or state.master.device.type != "cpu":
            self._run_torch(hp, unit, state, ranges, grads, steps, scale, grad_mul, found_inf)
            return
        fn = _bind(kernel.lib)
        code1, code2, lut1, lut2 = self.tables()
        native_hp = _hp8(hp, scale, grad_mul)
        starts, b0 = [], 0
        for entry in unit.entries:
            starts.append(b0)
            b0 += num_blocks(entry.numel)
        mbf = int(state.master.dtype == torch.bfloat16)
        for (index, lo, hi), grad, st in zip(ranges, grads, steps):
            entry = unit.entries[index]
            if (lo - entry.offset) % BLOCK:
                raise ValueError(f"an 8-bit update must start at a block of {BLOCK}: {unit.name} [{lo}, {hi})")
            _set_step8(native_hp, hp, float(st), rounding_key(self.seed, unit.index, int(float(st))))
            blk = starts[index] + (lo - entry.offset) // BLOCK
            assert grad.is_contiguous() and grad.numel() == hi - lo and grad.dtype in (torch.float32, torch.bfloat16)
            fn(state.master[lo:hi].data_ptr(), state.exp_avg[lo:hi].data_ptr(), state.exp_avg_sq[lo:hi].data_ptr(),
               state.exp_avg_absmax[blk:].data_ptr(), state.exp_avg_sq_absmax[blk:].data_ptr(), grad.data_ptr(), None,
               hi - lo, code1.data_ptr(), code2.data_ptr(), lut1.data_ptr(), lut2.data_ptr(), ctypes.byref(native_hp),
               lo, int(grad.dtype == torch.bfloat16), mbf, kernel.threads)

    def prepare_steps(self, groups, by_group, unit, counters, scale, device) -> list:
        """Per entry its update's constants (`adam8_torch.Hyper8` from the counter's value: bias
        corrections, gradient scale, rounding key), shared by its pieces, on `device` as one table
        (`Hyper8.share_kernel_args`: [Why a device update's constants cross as one table])."""
        from .adam8_torch import Hyper8

        out, made = list(counters), []
        for gi, entries in by_group.items():
            for index in entries:
                step = int(float(counters[index]))
                key = torch.tensor(signed64(rounding_key(self.seed, unit.index, step)), dtype=torch.int64)
                out[index] = Hyper8(groups[gi], scale, 1.0, step, key)
                made.append(out[index])
        Hyper8.share_kernel_args(made, device)
        return out

    def _run_torch(self, hp, unit, state, ranges, grads, steps, scale, grad_mul, found_inf) -> None:
        """`run` in torch ops on the state's device (adam8_torch.py): device state, or no native
        kernel. A holder of part of a unit's arrays says where they start by `base` = (element
        offset, block offset) in the unit. A step may be its prepared constants (`prepare_steps`)."""
        from .adam8_torch import Hyper8, adamw8_range, rounding_key_t

        base, bbase = getattr(state, "base", (0, 0))
        starts, b0 = [], 0
        for entry in unit.entries:
            starts.append(b0)
            b0 += num_blocks(entry.numel)
        for (index, lo, hi), grad, st in zip(ranges, grads, steps):
            entry = unit.entries[index]
            if (lo - entry.offset) % BLOCK:
                raise ValueError(f"an 8-bit update must start at a block of {BLOCK}: {unit.name} [{lo}, {hi})")
            blk = starts[index] + (lo - entry.offset) // BLOCK - bbase
            nb = num_blocks(hi - lo)
            start, stop = lo - base, hi - base
            hyper = st if isinstance(st, Hyper8) else Hyper8(hp, scale, grad_mul, st,
                                                             rounding_key_t(self.seed, unit.index, st))
            adamw8_range(hp, state.master[start:stop], state.exp_avg[start:stop], state.exp_avg_sq[start:stop],
                         state.exp_avg_absmax[blk:blk + nb], state.exp_avg_sq_absmax[blk:blk + nb], grad, None, None,
                         lo, found_inf=found_inf, hyper=hyper)

    def rows_fit(self, hidden: int) -> bool:
        return hidden % BLOCK == 0             # a block never spans two rows

    def run_rows(self, kernel, hp, unit, grad, rows, step, *, sums=None, zero_grad=False, exclude=False) -> None:
        if kernel is None or not kernel.native:
            raise RuntimeError(f"optimizer_state={self.name!r} updates on the host with the native kernel only")
        if exclude and (sums is not None or zero_grad):
            raise ValueError("run_rows(exclude=True) takes no sums and zero_grad")
        V, width = grad.shape
        if not self.rows_fit(width) or len(unit.entries) != 1:
            raise ValueError(f"a row-wise 8-bit update needs one (V, H) table with H a multiple of {BLOCK}: {unit.name}")
        if exclude:
            keep = torch.ones(V, dtype=torch.bool)
            keep[rows] = False
            rows = keep.nonzero().view(-1)
        if rows.numel() == 0:
            return
        assert grad.dtype == torch.float32 and grad.is_contiguous()
        if sums is not None:
            assert sums.dtype == torch.float32 and sums.is_contiguous() and sums.shape == (rows.numel(), width)
        rows = rows.to(torch.int64).contiguous()
        _bind(kernel.lib)
        code1, code2, lut1, lut2 = self.tables()
        native_hp = _hp8(hp, None, 1.0)
        _set_step8(native_hp, hp, float(step), rounding_key(self.seed, unit.index, int(float(step))))
        kernel.lib.slide_adamw8_rows(
            unit.master.data_ptr(), unit.exp_avg.data_ptr(), unit.exp_avg_sq.data_ptr(), unit.exp_avg_absmax.data_ptr(),
            unit.exp_avg_sq_absmax.data_ptr(), grad.data_ptr(), rows.data_ptr(), rows.numel(), width,
            None if sums is None else sums.data_ptr(), int(zero_grad), code1.data_ptr(), code2.data_ptr(),
            lut1.data_ptr(), lut2.data_ptr(), ctypes.byref(native_hp), int(unit.master.dtype == torch.bfloat16),
            kernel.threads)


def _hp8(hp: dict, scale, grad_mul: float) -> _HP8:
    """The 8-bit kernel's constants of param group `hp` (the step's are set by `_set_step8`)."""
    beta1, beta2 = (float(b) for b in hp["betas"])
    lr, wd = float(hp["lr"]), float(hp["weight_decay"])
    fp32 = lambda x: ctypes.c_float(x).value                              # noqa: E731 - fp32 as torch casts
    return _HP8(gmul=grad_mul, gclip=1.0 if scale is None else 1.0 / float(scale),
                sign=-1.0 if hp.get("maximize", False) else 1.0, wd_mul=fp32(1.0 - lr * wd) if wd > 0.0 else 1.0,
                beta1=beta1, c1=fp32(1.0 - beta1), beta2=beta2, c2=fp32(1.0 - beta2), eps=float(hp["eps"]))


def _set_step8(native_hp: _HP8, hp: dict, step: float, key: int) -> None:
    beta1, beta2 = (float(b) for b in hp["betas"])
    native_hp.bc2 = math.sqrt(1.0 - beta2 ** step)
    native_hp.neg_step = -float(hp["lr"]) / (1.0 - beta1 ** step)
    native_hp.seed = key


class AdamW8bitBf16(AdamW8bit):
    """8-bit block-wise moments and a bf16 master rounded stochastically (unbiased: the expected
    rounding of each update is its fp32 value, so small updates are not lost to round-to-nearest).

    The rounding of element i of unit u at step t uses a counter-based hash of (seed, u, t, i):
    the same for a seed whatever the threads or the cut of the update into pieces.
    """

    name = "adamw_8bit_bf16"
    master_dtype = torch.bfloat16


ADAMW = AdamW32()
FORMATS: dict[str, StateFormat] = {f.name: f for f in (ADAMW, AdamW8bit(), AdamW8bitBf16())}


def state_format(name: str) -> StateFormat:
    """The format registered under `name` (`SlideConfig.optimizer_state`)."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown optimizer_state {name!r}; one of {sorted(FORMATS)}") from None


# The Trainer's 8-bit AdamW names (`TrainingArguments.optim`): 8-bit block-wise moments are those
# optimizers' scheme; "paged" has no meaning for host state, which never is on the GPU.
TRAINER_8BIT_NAMES = ("adamw_8bit", "adamw_bnb_8bit", "adamw_torch_8bit", "paged_adamw_8bit")
TRAINER_FP32_NAMES = ("adamw_torch", "adamw_torch_fused")


def optimizer_state_of(optim: str) -> str:
    """`SlideConfig.optimizer_state` for a format's name or one of the Trainer's AdamW names."""
    named = {**{n: "adamw_8bit" for n in TRAINER_8BIT_NAMES}, **{n: "adamw" for n in TRAINER_FP32_NAMES}}
    if optim in FORMATS or optim in named:
        return optim if optim in FORMATS else named[optim]
    raise ValueError(f"optim={optim!r}: one of {', '.join(FORMATS)}, or the Trainer's "
                     f"{', '.join(TRAINER_FP32_NAMES + TRAINER_8BIT_NAMES)}")


def formats_holding(arrays: dict[str, torch.dtype]) -> list[str]:
    """The names of the formats whose moments are exactly `arrays` (name -> dtype)."""
    return [f.name for f in FORMATS.values() if {a.name: a.dtype for a in f.arrays} == arrays]


def embed_format(name: str, hidden: int, resident: bool = False) -> StateFormat:
    """The format the (V, `hidden`) token embedding keeps under `optimizer_state` = `name`: the
    units' where it updates whole rows (`rows_fit`: an 8-bit block never spans two rows), else fp32
    AdamW; fp32 AdamW when `resident` too (its state moves to the GPU, whose update is fp32 AdamW)."""
    fmt = state_format(name)
    return ADAMW if resident or not fmt.rows_fit(hidden) else fmt


def unit_format(unit, config) -> StateFormat:
    """The format `unit` keeps under `config` (a SlideConfig); the embedding's is `embed_format`'s."""
    if unit.kind != "embed":
        return state_format(config.optimizer_state)
    return embed_format(config.optimizer_state, int(unit.entries[0].shape[-1]), config.resident_embedding is True)


