"""What one disk layer's record holds: the arrays of its state format's declaration on disk.

A layer keeps on disk either its moments alone (MOMENTS: the master stays in host memory) or its
whole state (WHOLE: the master too). The arrays are those its optimizer state format declares
(`host_optim.StateFormat`): for 'adamw', fp32 `exp_avg` and `exp_avg_sq` (8 bytes per parameter)
and an fp32 master; for the compact formats, 8-bit `exp_avg` and `exp_avg_sq` with their fp32
per-block scales (about 2.03 bytes per parameter) and the format's master (fp32, or bf16 under
'adamw_8bit_bf16'). The record lists them master first, then the format's arrays in its order;
each starts on a 4096-byte boundary of the payload (`disk/records.py`), so a pool buffer holds
the record as the file does and the unit's arrays are views of the buffer while it is resident.

`record_bytes` is the arithmetic of the records, which `disk_plan.py` and the planner share.
"""
from __future__ import annotations

import torch

from .records import Layout, array_offsets, payload_bytes
from ..host.host_optim import ADAMW, StateFormat
from ..host.quant_maps import num_blocks

# `Unit` in the annotations is `store.Unit` (annotations are not evaluated).

__all__ = ["StateRecord", "MOMENTS", "WHOLE", "record_bytes", "layer_host_bytes"]

# The part of a layer's state on disk: its AdamW moments alone, or its whole state.
MOMENTS, WHOLE = "moments", "all"


class StateRecord:
    """What one disk unit's record holds, and where its arrays sit in a buffer.

    Args:
        numel: the unit's parameter count.
        part: MOMENTS (the format's arrays) or WHOLE (the master, then those arrays).
        fmt: the unit's optimizer state format (default fp32 AdamW).
        blocks: the unit's blocks of the format's per-block arrays (`quant_maps.num_blocks` of
            each parameter, summed: `StateRecord.of`); default that of one parameter of `numel`.
    """

    __slots__ = ("numel", "part", "format", "arrays", "layout")

    def __init__(self, numel: int, part: str = WHOLE, fmt: StateFormat | None = None, blocks: int | None = None):
        if part not in (MOMENTS, WHOLE):
            raise ValueError(f"a record holds {MOMENTS!r} or {WHOLE!r}, not {part!r}")
        fmt = fmt or ADAMW
        self.numel, self.part, self.format = int(numel), part, fmt
        blocks = num_blocks(self.numel) if blocks is None else int(blocks)
        arrays = [("master", fmt.master_dtype, self.numel)] if part == WHOLE else []
        arrays += [(a.name, a.dtype, blocks if a.per == "block" else self.numel) for a in fmt.arrays]
        self.arrays: tuple[str, ...] = tuple(n for n, _, _ in arrays)
        self.layout: Layout = tuple((d, n) for _, d, n in arrays)

    @classmethod
    def of(cls, unit: Unit, part: str) -> StateRecord:
        """The record of unit `u` (its `state_format`, its parameters' blocks)."""
        return cls(unit.numel, part, unit.state_format, sum(num_blocks(e.numel) for e in unit.entries))

    @property
    def master(self) -> bool:
        """Does the record hold the master (a slot copy then reads the buffer)?"""
        return self.part == WHOLE

    @property
    def nbytes(self) -> int:
        """Bytes of the record in a buffer, and moved by each read or write (the file's payload)."""
        return payload_bytes(self.layout)

    @property
    def master_bytes(self) -> int:
        """Bytes of the record's first array in a buffer, its master's where it holds one (what a
        slot copy reads)."""
        dtype, count = self.layout[0]
        return payload_bytes(((dtype, count),))

    def attach(self, unit: Unit, buf) -> None:
        """Make the unit's arrays of this record views of `buf` (a tensor or a `HostBuffer`)."""
        flat = getattr(buf, "tensor", buf).detach().reshape(-1).view(torch.uint8)
        for name, (dtype, count), offset in zip(self.arrays, self.layout, array_offsets(self.layout)):
            setattr(unit, name, flat[offset:offset + dtype.itemsize * count].view(dtype))

    def check(self, unit: Unit, where: str) -> None:
        """Raise `host_optim.CorruptOptimizerStateError` when an array of the record, attached to
        `unit`, holds values the format cannot hold (disk_store.py: [Why a record read is checked])."""
        for name in self.arrays:
            self.format.check(name, getattr(unit, name), where)

    def detach(self, unit: Unit) -> None:
        """The record left its buffer: its arrays are no longer in memory."""
        for name in self.arrays:
            setattr(unit, name, None)


def record_bytes(numel: int, part: str = WHOLE, fmt: StateFormat | None = None, blocks: int | None = None) -> int:
    """Bytes of one unit's record of `numel` parameters in a buffer (the file's payload): the
    arrays `fmt` declares (MOMENTS), and its master before them (WHOLE), each rounded up to 4096."""
    return StateRecord(numel, part, fmt, blocks).nbytes


def layer_host_bytes(numel: int, part: str | None, fmt: StateFormat | None = None, blocks: int | None = None) -> int:
    """Host bytes of a trainable layer's state (master and the arrays `fmt` declares) with `part`
    on disk: all of it in host memory (None), its master alone (MOMENTS), nothing (WHOLE).
    `blocks` as for `StateRecord`."""
    if part == WHOLE:
        return 0
    fmt = fmt or ADAMW
    held = numel * fmt.master_dtype.itemsize
    if part is None:
        blocks = num_blocks(numel) if blocks is None else blocks
        held += sum((blocks if a.per == "block" else numel) * a.dtype.itemsize for a in fmt.arrays)
    return held
