"""Which decoder layers keep state on disk, and which part: the split under `host_memory_limit`.

`split_layers` is the arithmetic (moments first, then whole layers; its docstring says why) and
`plan_disk_units` applies it to a model's units at `slide()`; the planner calls the same
functions, so the engine and the plan cannot drift apart. The records themselves and their
residency are `disk_store.py`'s.
"""
from __future__ import annotations

import logging
from typing import NamedTuple, Sequence

from .disk_store import MOMENTS, WHOLE, pool_buffers, record_bytes
from .memory import GiB, HostMemoryError, available_host_bytes

# `Unit` in the annotations is `store.Unit`, which imports this module (annotations are not evaluated).

logger = logging.getLogger(__name__)

__all__ = ["DiskSplit", "split_layers", "host_limit_bytes", "plan_disk_units", "AUTO_MARGIN", "AUTO_MARGIN_SHARE"]

# host_memory_limit="auto": the host's available memory, less this share (at least AUTO_MARGIN)
# for the rest of the process (the layer inputs, the gradient ring, Python and the CUDA runtime).
AUTO_MARGIN_SHARE = 0.2
AUTO_MARGIN = 4 * GiB
# Host bytes per parameter of a trainable layer's state: in host memory, with its moments on
# disk, with all of it on disk.
_HOST_BYTES = {None: 12, MOMENTS: 4, WHOLE: 0}



def _size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB // 10 else f"{n / 2 ** 20:.2f} MiB"


class DiskSplit(NamedTuple):
    """Which of the last trainable layers keep state on disk: the last `whole` layers all of it
    (master and moments), the `moments` layers before them their moments alone."""

    moments: int = 0
    whole: int = 0

    @property
    def layers(self) -> int:
        """Layers with any state on disk."""
        return self.moments + self.whole

    def parts(self, n: int) -> list[str | None]:
        """Per layer of `n`, in schedule order: None (in host memory), MOMENTS or WHOLE."""
        return [None] * (n - self.layers) + [MOMENTS] * self.moments + [WHOLE] * self.whole


def _host_bytes(fixed: int, layer_numels: Sequence[int], split: DiskSplit) -> int:
    """What the host gives the state with `split`: `fixed`, each layer's bytes per parameter by
    where its state is, and the pool (its buffers the size of the largest record)."""
    parts = split.parts(len(layer_numels))
    pool = max((record_bytes(n, p) for n, p in zip(layer_numels, parts) if p), default=0)
    return (fixed + sum(_HOST_BYTES[p] * n for n, p in zip(layer_numels, parts))
            + pool_buffers(split.layers) * pool)


def split_layers(limit: int, fixed: int, layer_numels: Sequence[int]) -> DiskSplit | None:
    """Which part of which of the last layers goes to disk so that the host's part of the state
    is at most `limit` bytes (None when even every layer's whole state on disk is too much).

    Moments first: moving a layer's moments to disk frees 8 bytes per parameter for 16 bytes of
    disk traffic per step (read and written once around its update), 2 per byte freed; moving
    its whole state frees 12 for 28 with one micro-batch (its master read for the forward's copy,
    the whole record for the backward's, written after the update), 2.3 per byte freed, and the
    4 bytes of its master that the moments tier kept cost 12 more. So the moments of the fewest last
    layers that fit; when the moments of every layer are not enough, the whole state of the
    fewest last layers besides. The pool's buffers hold the largest record: the first whole
    layer makes each of them 4 bytes per parameter of one layer larger, and each whole layer
    frees its master's 4, so with four buffers the fifth is the first that frees more.

    Args:
        limit: bytes the host may give the unit state.
        fixed: bytes of it that stay on the host whatever the split (the embedding's and the
            head's state, the gradient accumulators of every unit).
        layer_numels: the layers that may go to disk, in schedule order.
    """
    n = len(layer_numels)
    for split in [DiskSplit(k, 0) for k in range(n + 1)] + [DiskSplit(n - w, w) for w in range(1, n + 1)]:
        if _host_bytes(fixed, layer_numels, split) <= limit:
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
    fixed = 12 * (total - sum(u.numel for u in layers)) + accumulators
    if config.optimizer_state != "adamw":
        return _compact_fits(units, config, limit, accumulators)
    numels = [u.numel for u in layers]
    split = split_layers(limit, fixed, numels)
    if split is None:
        floor = _host_bytes(fixed, numels, DiskSplit(0, len(layers)))
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
            f"{pool_buffers(len(layers))} pinned buffers of one layer's state). Raise host_memory_limit, or set it "
            "to None to keep every unit in host memory.")
    out = [(u, p) for u, p in zip(layers, split.parts(len(layers))) if p]
    for part, what, per in ((MOMENTS, "the moments", 8), (WHOLE, "the whole state", 12)):
        some = [u for u, p in out if p == part]
        if some:
            logger.info("host_memory_limit: %s of %s (%.2f GiB) go to disk", what, _span(some),
                        per * sum(u.numel for u in some) / GiB)
    return out


def _compact_fits(units: list[Unit], config, limit: int, accumulators: int) -> list:
    """A compact optimizer state keeps no layer on disk: the limit must hold it all (its bytes per
    parameter as each unit's format declares them, `host_optim.unit_format`)."""
    from .host_optim import unit_format

    need = accumulators + sum(int(u.numel * unit_format(u, config).bytes_per_param)
                              for u in units)
    if need > limit:
        raise HostMemoryError(
            f"SlideConfig.host_memory_limit={config.host_memory_limit!r} ({_size(limit)}) is below the {_size(need)} "
            f"the host store takes with optimizer_state={config.optimizer_state!r}, which keeps no state on disk: "
            "raise host_memory_limit, set it to None, or use optimizer_state='adamw' (its last layers' state can go "
            "to disk)")
    return []
