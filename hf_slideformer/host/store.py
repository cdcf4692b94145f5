"""Host store: the fp32 master weights, Adam moments and accumulated gradients, per unit.

A *unit* is what slides as one piece: the token embedding, one decoder layer, or the head (final
norm + an untied lm_head). Each unit's parameters are laid out back to back in one flat fp32
buffer, a view of one large slab; the HF module's `nn.Parameter`s are views into that buffer, so
`model.parameters()` and `model.state_dict()` *are* the masters, and nothing else holds a copy.

Under `SlideConfig.host_memory_limit` the last decoder layers may keep their AdamW moments, or
their master and moments, on disk instead (`disk_store.DiskStates`, `store.disk`). A layer whose
master is on disk has meta tensors for parameters (the master is not in memory) and
`model.state_dict()` reads it from disk; one with only its moments there keeps its master here,
like a host unit. Whoever reads a unit's state outside the schedule goes through `unit_state(u)`.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..disk.disk_plan import plan_disk_units
from ..disk.disk_record import WHOLE, StateRecord
from ..disk.disk_store import DiskStates, pool_buffers
from .host_optim import state_format, unit_format
from .memory import PinnedBuffers, PrivateHostMemory, check_host_memory, lazy_zeros

logger = logging.getLogger(__name__)

__all__ = ["ParamEntry", "Unit", "HostStore"]


@dataclass
class ParamEntry:
    """One parameter of a unit: its HF name(s), where it sits in the flat buffer, who holds it."""

    name: str                                   # canonical HF name (first one found)
    shape: torch.Size
    offset: int
    numel: int
    holders: list[tuple[nn.Module, str]]        # (module, attribute) pairs that reference it
    param: nn.Parameter | None = None
    # PEFT adapts it through torch's parametrize (LoRA `target_parameters`, lora.py): the device
    # tensor standing in for it must be an nn.Parameter (functions.swapped).
    parametrized: bool = False

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.offset:self.offset + self.numel].view(self.shape)


@dataclass
class Unit:
    """A slice of the model that moves and is updated as one piece."""

    name: str
    kind: str                                   # "embed" | "layer" | "head"
    index: int                                  # position in the schedule order
    entries: list[ParamEntry]
    numel: int = 0
    master: torch.Tensor | None = None          # (numel,) fp32 (bf16 under adamw_8bit_bf16), pinned on CUDA
    # The optimizer state the unit's `state_format` declares (host_optim.py): fp32 or 8-bit moments,
    # and the 8-bit moments' per-block scales.
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None
    exp_avg_absmax: torch.Tensor | None = None
    exp_avg_sq_absmax: torch.Tensor | None = None
    state_format: object = None
    grad: torch.Tensor | None = None            # (numel,) fp32 accumulated gradient (deferred mode)
    grad_valid: bool = False                    # `grad` holds this step's sum so far
    steps: list = field(default_factory=list)    # per-entry AdamW step counters (fp32 scalars)
    version: int = 0                            # bumped by every update: device copies check it
    updated: threading.Event = field(default_factory=threading.Event)
    readers: list = field(default_factory=list)  # device events of in-flight reads of `master`
    # While `updated` is clear: how many leading elements of `master` already hold the update in
    # progress (the worker updates a unit in offset order, piece by piece; see `set_progress`).
    progress: int = 0
    progress_cv: threading.Condition = field(default_factory=threading.Condition)
    # The device event after which the host store holds the last write a device update made to
    # it (device_update.py): every reader of the host state waits for it, whatever the unit's
    # placement is by then (the update's own state is its placement's, `DeviceUpdateLayer.pending`).
    host_write: object = None

    def __post_init__(self):
        self.updated.set()

    def set_progress(self, progress: int) -> None:
        """Worker side: the first `progress` elements of `master` are final for this update."""
        with self.progress_cv:
            self.progress = progress
            self.progress_cv.notify_all()

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [e.view(flat) for e in self.entries]

    @property
    def trainable(self) -> bool:
        """Does any of its parameters train (a frozen base under LoRA does not)?"""
        return any(e.param is None or e.param.requires_grad for e in self.entries)

    def add_reader(self, event) -> None:
        """A device copy of `master` ends at `event` (on the h2d stream, in copy order)."""
        # The CPU worker waits for this before it writes the master again (its update empties
        # the list). A frozen unit is never updated: it keeps only the latest event, which
        # covers the earlier ones (every copy is on the one h2d stream).
        if self.trainable:
            self.readers.append(event)
        else:
            self.readers = [event]


class HostStore:
    """Owns the host memory of the model: one slab of fp32 masters, moments and gradients.

    Args:
        units: the units in schedule order, each with its entries' holders filled and offsets unset.
        config: the SlideConfig.
        dp: the `DataParallel` of several ranks, whose masters and moments are one shared copy
            (`SharedHostMemory`); None for one process.
    """

    def __init__(self, units: list[Unit], config, dp=None):
        self.units = units
        self.config = config
        self.dp = dp
        off = 0
        for unit in units:
            unit.numel = 0
            for entry in unit.entries:
                entry.offset = unit.numel
                unit.numel += entry.numel
            off += unit.numel
        self.numel = off
        self.deferred = config.deferred
        for unit in units:                    # what each unit's optimizer keeps (host_optim.py)
            unit.state_format = unit_format(unit, config)
        # The last layers' moments, or whole state, on disk when host_memory_limit says so (disk_store.py).
        on_disk = plan_disk_units(units, config)                 # [(unit, part)]
        self._on_disk = {id(u) for u, _ in on_disk}
        self._master_on_disk = {id(u) for u, part in on_disk if part == WHOLE}
        self.host_numel = self.numel - sum(u.numel for u in units if self.master_on_disk(u))   # masters here
        self.moments_numel = self.numel - sum(u.numel for u, _ in on_disk)                       # moments here
        # Note: [Why a frozen unit is kept in the compute dtype] a layer or head none of whose
        # parameters train (the base under LoRA) is never updated and has no moments: its weights
        # need only the precision they are computed in. Kept in bf16 they take 2 bytes per
        # parameter of host memory instead of 4, and half the h2d bytes per copy (no cast on the GPU).
        low = config.dtype if config.dtype == torch.bfloat16 else None
        frozen = [u for u in units if low is not None and u.kind != "embed" and not u.trainable
                  and not self.on_disk(u)]
        self._frozen = {id(u) for u in frozen}
        frozen_numel = sum(u.numel for u in frozen)
        if config.check_host_memory:
            pool = pool_buffers(len(on_disk)) * max((StateRecord.of(u, part).nbytes for u, part in on_disk), default=0)
            held = [u for u in units if not self.on_disk(u) and id(u) not in self._frozen]
            need = (sum(u.numel * u.state_format.master_dtype.itemsize for u in held)
                    + sum(u.numel * u.state_format.master_dtype.itemsize for u in units
                          if self.on_disk(u) and not self.master_on_disk(u))
                    + sum(u.state_format.state_bytes(u) for u in held)
                    + 2 * frozen_numel + pool
                    + (4 * sum(u.numel for u in units if u.kind != "embed" and u.trainable) if self.deferred else 0))
            check_host_memory(self.numel, deferred=self.deferred, config=config, need=need, frozen=bool(frozen_numel))
        # Note: [Masters are pinned] the h2d copies read the masters directly, so they must be
        # page-locked (pageable DMA runs at a sixth of the speed). One slab, registered once.
        pin = bool(config.pin_memory and config.is_cuda)
        # The state file first: a disk too small is reported before any host memory is taken.
        self.disk = (DiskStates([u for u, _ in on_disk], config.nvme_path, parts=[p for _, p in on_disk], pin=pin)
                     if on_disk else None)
        self.pinned = PinnedBuffers(pin)
        if dp is not None:
            from ..engine.data_parallel import SharedHostMemory
            self.memory = SharedHostMemory(dp, self.pinned)
        else:
            self.memory = PrivateHostMemory(self.pinned)
        # The embedding's master is a buffer of its own: a resident embedding gives its host pages
        # back (unpinned, then released), and a registration can only be undone whole.
        own = [u for u in units if u.kind == "embed"]
        # One dtype per slab: the decoder layers' and head's format decides it (the embedding's is its own).
        master_dtype = state_format(config.optimizer_state).master_dtype
        self.master_slab = self.memory.empty(self.host_numel - sum(u.numel for u in own) - frozen_numel,
                                             dtype=master_dtype)
        self._carve(self.master_slab, "master", [u for u in units if not self.master_on_disk(u)], skip=own + frozen)
        for unit in own:              # in its format's dtype (bf16 under adamw_8bit_bf16, host_optim.embed_format)
            unit.master = self.memory.empty(unit.numel, dtype=unit.state_format.master_dtype)
        if frozen:
            self.frozen_slab = self.pinned.empty(frozen_numel, dtype=low)
            off = 0
            for unit in frozen:
                unit.master = self.frozen_slab[off:off + unit.numel]
                off += unit.numel
        self.optimizer_ready = False

    @staticmethod
    def _carve(slab: torch.Tensor, attr: str, units, skip=()) -> None:
        """Lay `slab` out over `units` (not those in `skip`)."""
        off = 0
        for unit in units:
            if any(unit is x for x in skip):
                continue
            setattr(unit, attr, slab[off:off + unit.numel])
            off += unit.numel

    # ------------------------------------------------------------------ units on disk
    def on_disk(self, unit: Unit) -> bool:
        """Does `unit` keep some of its state on disk (`self.disk`): its moments, or its master and moments?"""
        return id(unit) in self._on_disk

    def master_on_disk(self, unit: Unit) -> bool:
        """Does `unit` keep its master on disk too (its parameters are then meta tensors)?"""
        return id(unit) in self._master_on_disk

    @contextlib.contextmanager
    def unit_state(self, unit: Unit, write: bool = False):
        """`unit` with its master and moments in memory for the block: a host unit as it is, a disk
        unit's record read into a pool buffer (and written back after it with `write`). For readers
        outside the schedule (weights loading, state_dict, checkpoints); the engine is idle
        (`SlideEngine.synchronize`)."""
        if self.disk is None or not self.on_disk(unit):
            yield unit
            return
        with self.disk.access(unit, write=write):
            yield unit

    def flush(self) -> None:
        """Wait for the disk's reads and writes in flight (raising a failure)."""
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        """Close the state file of the units on disk (its space comes back) and unpin the slabs."""
        if self.disk is not None:
            self.disk.close()
        self.pinned.close()

    def allocate_optimizer_state(self) -> None:
        """Allocate zeroed Adam moments (and the gradient accumulator in deferred mode)."""
        if self.optimizer_ready:
            return
        held = [u for u in self.units if not self.on_disk(u)]   # a disk unit's moments are in its file
        by_format: dict[int, list[Unit]] = {}
        for unit in held:
            by_format.setdefault(id(unit.state_format), []).append(unit)
        for us in by_format.values():      # the arrays each format declares, one mapped slab per array
            us[0].state_format.allocate(us, self.memory.zeros)
        for unit in self.units:
            unit.steps = [torch.zeros((), dtype=torch.float32) for _ in unit.entries]
        if self.deferred:
            self.allocate_grad_accumulators()
        self.optimizer_ready = True

    def allocate_grad_accumulators(self) -> None:
        """fp32 gradient accumulators for accumulation / clipping (the embedding's belongs to the
        engine, except with several ranks: each rank's accumulators are its own, and it writes only
        its shard of each, so their pages add up to one copy)."""
        if getattr(self, "grad_slab", None) is not None:
            return
        layers = [u for u in self.units if u.kind != "embed" or self.dp is not None]
        # Mapped like the moments: a resident layer's accumulator (it keeps its gradient on the GPU)
        # is never written and takes no host memory.
        self.grad_slab = lazy_zeros(sum(u.numel for u in layers))
        off = 0
        for unit in layers:
            unit.grad = self.grad_slab[off:off + unit.numel]
            off += unit.numel
        self.deferred = True

    def bind_parameters(self) -> None:
        """Replace every held parameter by an nn.Parameter viewing its master (ties preserved); that
        of a unit whose master is on disk by a meta tensor of its shape (read through `unit_state`)."""
        for unit in self.units:
            for entry in unit.entries:
                view = torch.empty(entry.shape, device="meta") if self.master_on_disk(unit) else entry.view(unit.master)
                param = nn.Parameter(view, requires_grad=entry.param.requires_grad if entry.param is not None else True)
                for mod, attr in entry.holders:
                    mod._parameters[attr] = param
                entry.param = param

    def state_bytes(self) -> int:
        """Host bytes of the masters and optimizer state of the units held here (their formats'
        declarations; moments once allocated)."""
        out = 0
        for unit in self.units:
            if not self.master_on_disk(unit) and unit.master is not None:
                out += unit.numel * unit.master.element_size()
            if self.optimizer_ready and not self.on_disk(unit) and unit.trainable:
                out += unit.state_format.state_bytes(unit)
        return out

    def params(self):
        for unit in self.units:
            for entry in unit.entries:
                yield entry.param
