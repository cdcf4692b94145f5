"""Which decoder layers keep state on disk, and which part: the split under `host_memory_limit`.

`split_layers` is the arithmetic (moments first, then whole layers; its docstring says why) and
`plan_disk_units` applies it to a model's units at `slide()`; the planner calls the same
functions, so the engine and the plan cannot drift apart. Every byte is the layers' optimizer
state format's (`host_optim.py`): the records themselves are `disk_record.py`'s, their residency
`disk_store.py`'s.
"""
from __future__ import annotations

import logging
from typing import NamedTuple, Sequence

from .disk_record import MOMENTS, WHOLE, StateRecord, layer_host_bytes, record_bytes
from .disk_store import pool_buffers
from .unit_state import record_layout
from ..host.host_optim import StateFormat, unit_format
from ..host.quant_maps import num_blocks
from ..host.memory import GiB, HostMemoryError, available_host_bytes

# `Unit` in the annotations is `store.Unit`, which imports this module (annotations are not evaluated).

logger = logging.getLogger(__name__)

__all__ = ["DiskSplit", "split_layers", "host_limit_bytes", "plan_disk_units", "AUTO_MARGIN", "AUTO_MARGIN_SHARE"]

# host_memory_limit="auto": the host's available memory, less this share (at least AUTO_MARGIN)
# for the rest of the process (the layer inputs, the gradient ring, Python and the CUDA runtime).
AUTO_MARGIN_SHARE = 0.2
AUTO_MARGIN = 4 * GiB

def _size(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB // 10 else f"{nbytes / 2 ** 20:.2f} MiB"


class DiskSplit(NamedTuple):
    """Which of the last trainable layers keep state on disk: the last `whole` layers all of it
    (master and moments), the `moments` layers before them their moments alone."""

    moments: int = 0
    whole: int = 0

    @property
    def layers(self) -> int:
        """Layers with any state on disk."""
        return self.moments + self.whole

    def parts(self, num_layers: int) -> list[str | None]:
        """Per layer of `num_layers`, in schedule order: None (in host memory), MOMENTS or WHOLE."""
        return [None] * (num_layers - self.layers) + [MOMENTS] * self.moments + [WHOLE] * self.whole

    def host_items(self, layer_numel: int, fmt: StateFormat) -> dict[str, int]:
        """The planner's host items of these layers, each of `layer_numel` parameters in format
        `fmt`: the masters of the layers whose moments alone are on disk, the pool's buffers."""
        out = {}
        if self.moments:
            master_bytes = fmt.master_dtype.itemsize
            out[f"masters of the layers with moments on disk ({master_bytes} B/param)"] = \
                master_bytes * self.moments * layer_numel
        if self.layers:
            buffers = pool_buffers(self.layers)
            part, what = (WHOLE, "whole state") if self.whole else (MOMENTS, "moments")
            out[f"state buffers of the layers on disk ({buffers} x one layer's {what}, pinned)"] = \
                buffers * record_bytes(layer_numel, part, fmt)
        return out

    def file_bytes(self, layer_numel: int, fmt: StateFormat) -> int:
        """Bytes of the state file of these layers, each of `layer_numel` parameters in format `fmt`
        (one record each: the engine's file is not kept, disk/unit_state.py)."""
        if not self.layers:
            return 0
        head, _, sizes = record_layout([StateRecord(layer_numel, part, fmt).layout
                                        for part in self.parts(self.layers)], slots=1)
        return head + sum(sizes)

    def traffic(self, layer_numel: int, fmt: StateFormat, N: int, deferred: bool) -> int:
        """Bytes these layers read and write on disk per optimizer step of N micro-batches. A layer
        with its moments on disk reads them once for its update and writes them once after it: 2
        records of its moments (8 B/param under 'adamw', 2.03 under the 8-bit formats), whatever N.
        A layer with its whole state there reads its master alone for each copy (disk_store.py: [Why
        a copy reads the master alone]) and its whole record for its update, and writes it once
        after: updating in backward, the forward's copy (4 B/param) then the recompute's copy, which
        the update shares (12), per micro-batch; deferred, the forward's and the recompute's copies
        (4 + 4) per micro-batch and the whole record once for the update at the step. Evictions in
        between are assumed (the pool holds four records), so a record read for the forward is read
        again."""
        rec = StateRecord(layer_numel, WHOLE, fmt)
        master, full = rec.master_bytes, rec.nbytes
        whole = N * 2 * master + full if deferred else N * (master + full)
        return self.moments * 2 * record_bytes(layer_numel, MOMENTS, fmt) + self.whole * (whole + full)


def _host_bytes(fixed: int, layer_numels: Sequence[int], split: DiskSplit, fmt: StateFormat | None = None,
                blocks: Sequence[int] | None = None) -> int:
    """What the host gives the state with `split`: `fixed`, each layer's bytes by where its state
    is (`disk_record.layer_host_bytes`), and the pool (its buffers the size of the largest record)."""
    parts = split.parts(len(layer_numels))
    blocks = [None] * len(layer_numels) if blocks is None else blocks
    pool = max((record_bytes(n, p, fmt, b) for n, p, b in zip(layer_numels, parts, blocks) if p), default=0)
    return (fixed + sum(layer_host_bytes(n, p, fmt, b) for n, p, b in zip(layer_numels, parts, blocks))
            + pool_buffers(split.layers) * pool)


def split_layers(limit: int, fixed: int, layer_numels: Sequence[int], fmt: StateFormat | None = None,
                 blocks: Sequence[int] | None = None) -> DiskSplit | None:
    """Which part of which of the last layers goes to disk so that the host's part of the state
    is at most `limit` bytes (None when even every layer's whole state on disk is too much).

    Moments first. Under 'adamw', moving a layer's moments to disk frees 8 bytes per parameter for
    16 bytes of disk traffic per step (read and written once around its update), 2 per byte freed;
    moving its whole state frees 12 for 28 with one micro-batch (its master read for the forward's
    copy, the whole record for the backward's, written after the update), 2.3 per byte freed, and
    the 4 bytes of its master that the moments tier kept cost 12 more. A compact format's records
    keep the order: 8-bit moments and their scales free about 2.03 bytes per parameter for 4.06 of
    traffic, 2 per byte freed, and its master (4 or 2 bytes) costs its own bytes three times. So
    the moments of the fewest last layers that fit; when the moments of every layer are not
    enough, the whole state of the fewest last layers besides. The pool's buffers hold the largest
    record, so the first whole layers may free less than their buffers grow. Every byte comes from
    the format's declaration (`disk_record.py`): a compact format fits more layers in host memory.

    Args:
        limit: bytes the host may give the unit state.
        fixed: bytes of it that stay on the host whatever the split (the embedding's and the
            head's state, the gradient accumulators of every unit).
        layer_numels: the layers that may go to disk, in schedule order.
        fmt: their optimizer state format (default fp32 AdamW).
        blocks: each layer's blocks of the format's per-block arrays (default one parameter's).
    """
    num_layers = len(layer_numels)
    splits = ([DiskSplit(k, 0) for k in range(num_layers + 1)]
              + [DiskSplit(num_layers - w, w) for w in range(1, num_layers + 1)])
    for split in splits:
        if _host_bytes(fixed, layer_numels, split, fmt, blocks) <= limit:
            return split
    return None


def host_limit_bytes(value) -> int | None:
    """`SlideConfig.host_memory_limit` in bytes: GiB, 'auto' (what the host has available, less
    the margin), or None (no limit; also 'auto' where the available memory cannot be read)."""
    if value is None:
        return None
    if value == "auto":
        avail = available_host_bytes()
        if avail is None:
            logger.warning("host_memory_limit='auto': this host's available memory cannot be read; no limit applied")
            return None
        return avail - max(AUTO_MARGIN, int(AUTO_MARGIN_SHARE * avail))
    return int(float(value) * GiB)


def _span(units: Sequence[Unit]) -> str:
    return f"{units[0].name}..{units[-1].name}" if len(units) > 1 else units[0].name


def plan_disk_units(units: list[Unit], config) -> list[tuple[Unit, str]]:
    """The layer units that keep state on disk under `config.host_memory_limit`, each with its
    part on disk (MOMENTS or WHOLE), in schedule order: the split of `split_layers`, the last
    layers first (docs/disk.md says why). Frozen layers (a LoRA base) stay on the host.

    Raises:
        HostMemoryError: the limit is below what stays on the host even with every layer on disk.
    """
    limit = host_limit_bytes(config.host_memory_limit)
    if limit is None:
        return []
    layers = [u for u in units if u.kind == "layer" and u.trainable]
    total = sum(u.numel for u in units)
    embed = sum(u.numel for u in units if u.kind == "embed")
    accumulators = 4 * (total - embed) if config.deferred else 0
    fmt = unit_format(layers[0], config) if layers else None
    fixed = sum(_unit_host_bytes(u, config) for u in units if not any(u is x for x in layers)) + accumulators
    numels, blocks = [u.numel for u in layers], [sum(num_blocks(e.numel) for e in u.entries) for u in layers]
    split = split_layers(limit, fixed, numels, fmt, blocks)
    if split is None:
        floor = _host_bytes(fixed, numels, DiskSplit(0, len(layers)), fmt, blocks)
        acc = ", the gradient accumulators of every unit" if accumulators else ""
        if not layers:
            raise HostMemoryError(
                f"SlideConfig.host_memory_limit={config.host_memory_limit!r} ({_size(limit)}) is below the "
                f"{_size(fixed)} the host store needs, and no decoder layer can go to disk (a frozen LoRA base stays "
                "in host memory). Raise host_memory_limit, or set it to None.")
        raise HostMemoryError(
            f"SlideConfig.host_memory_limit={config.host_memory_limit!r} ({_size(limit)}) is below what stays "
            f"in host memory with the state of all {len(layers)} trainable decoder layers on disk: "
            f"{_size(floor)} (the embedding's and the head's master and moments{acc}, and "
            f"{pool_buffers(len(layers))} pinned buffers of one layer's state, optimizer_state="
            f"{config.optimizer_state!r}). Raise host_memory_limit, or set it to None to keep every unit in host "
            "memory.")
    out = [(u, p) for u, p in zip(layers, split.parts(len(layers))) if p]
    if out and not config.nvme_path:
        raise ValueError(
            f"SlideConfig.host_memory_limit={config.host_memory_limit!r} ({_size(limit)}) puts the state of "
            f"{len(out)} of {len(layers)} decoder layers on disk ({_span([u for u, _ in out])}), but nvme_path is "
            "not set: give nvme_path (a directory on a fast disk), raise host_memory_limit, or set it to None.")
    for part, what in ((MOMENTS, "the moments"), (WHOLE, "the whole state")):
        some = [u for u, p in out if p == part]
        if some:
            logger.info("host_memory_limit: %s of %s (%.2f GiB, %s) go to disk", what, _span(some),
                        sum(record_bytes(u.numel, part, fmt) for u in some) / GiB, config.optimizer_state)
    return out


def _unit_host_bytes(unit: Unit, config) -> int:
    """Host bytes of a unit's master and optimizer state in its format (`host_optim.unit_format`),
    counted for a frozen unit too (at most what the store gives it)."""
    fmt = unit_format(unit, config)
    return unit.numel * fmt.master_dtype.itemsize + fmt.state_bytes(unit)
