"""The host side of the schedule: the CPU worker's updates of host-held units.

`HostUpdates` folds a micro-batch's gradient of a unit into its host accumulator and, when the
step ends, runs the host AdamW (`HostAdam`) on the unit's masters and moments, piece by piece so
that the slot loader can copy a finished prefix while the rest is updated. It also holds the
step's verdict on non-finite gradients and the clip factor the worker computes. The placements
(placements.py), the embedding and the head submit their tasks to the worker; those tasks call
these methods, only on the worker thread.
"""
from __future__ import annotations

import logging
import math
import time

import torch

from . import optim
from ..errors import NonFiniteGradientError
from .store import Unit

logger = logging.getLogger(__name__)

__all__ = ["HostUpdates", "UPDATE_PIECE", "FOLD_PIECE"]

# Elements per AdamW call of a host update (32 MiB of fp32 master). The worker reports each
# finished prefix of the unit (`Unit.set_progress`), and the slot loader copies that prefix to
# the GPU while the rest is updated: the next forward's first layer, whose gradient is the last
# of the backward, then waits for its update plus one piece's copy instead of the whole copy.
UPDATE_PIECE = 1 << 23
# Elements per step of a scaled fold into an accumulator (16 MiB of fp32 scratch).
FOLD_PIECE = 1 << 22


def _both(first, second):
    def call(progress: int) -> None:
        first(progress)
        second(progress)
    return call


class HostUpdates:
    """The CPU worker's side of the host updates.

    Args:
        engine: the SlideEngine (config, stats, the host AdamW kernel, the pinned norm scalars).

    Attributes:
        poisoned: this step has met a non-finite gradient (worker side).
        norm_sq: squared norms of the units' summed gradients, taken by the worker this step
            (accumulation or an early step; with one backward per step the norm is the device's).
        clip_coef: the clip factor the worker computed for this step (`clip_task`).
    """

    def __init__(self, engine):
        self.engine = engine
        self.poisoned = False
        self.step_no = 0
        self.norm_sq: list[float] = []
        self.clip_coef = 1.0
        self._fold_buf: torch.Tensor | None = None

    # Note: [Why a non-finite gradient stops the host updates after it] the worker judges the norm
    # it has for each unit before updating it (the running norm of the backward with one
    # micro-batch, a unit's own sum with accumulation, the global norm with clipping). From the
    # first one that is not finite, no host update of the step writes anything (`update`), so no
    # master takes a NaN; with clipping the norm is known before any update, and the whole step
    # is skipped. Device updates skip on the device by the same norm (`StepNorm.found_inf`).
    def begin_step_task(self, step_no: int) -> None:
        self.poisoned, self.step_no = False, step_no

    def check_norm(self, sq: float, where: str) -> None:
        if not math.isfinite(sq):
            self.poison(where)

    def poison(self, where: str) -> None:
        if self.poisoned:
            return
        self.poisoned = True
        msg = f"step {self.step_no}: {where} is not finite (inf or NaN)"
        if self.engine.config.nonfinite_grads == "raise":
            raise NonFiniteGradientError(f"{msg}; no update of it was applied after that point "
                                         "(SlideConfig.nonfinite_grads='raise'): reload or resume from a checkpoint")
        logger.warning("%s: the step's updates not yet applied are skipped (SlideConfig.nonfinite_grads='skip')",
                       msg)

    def step_check_task(self, ev, norm) -> None:
        """After a step whose updates ran in backward: its whole norm, resident units' included."""
        self.sync(ev, "wait_d2h:norm")
        self.check_norm(float(norm[0]), "the gradient norm")

    def sync(self, ev, label: str) -> None:
        """Block the worker on a CUDA event (a copy it consumes or a reader it must not overtake), timed."""
        t0 = time.perf_counter()
        ev.synchronize()
        t1 = time.perf_counter()
        stats = self.engine.stats
        stats.worker_wait_s += t1 - t0
        if t1 - t0 > 1e-4:
            stats.event(label, t0, t1)

    def consume(self, unit: Unit, src: torch.Tensor, update: bool, host_norms: bool, hp, on_progress=None,
                grad_mul: float = 1.0, span: tuple[int, int] | None = None) -> None:
        """Fold this micro-batch's gradient of `unit` (times `grad_mul`) in, and update when the step
        ends here. With `span` (a data-parallel rank's shard [lo, hi)), `src` is that range's
        gradient and only that range is folded and updated."""
        if unit.grad is None:                      # no accumulator: GA == 1, no clipping
            grad = src
        else:
            if unit.host_write is not None:        # a device update's copies have read it (device_update.py)
                self.sync(unit.host_write, f"wait_readers:{unit.name}")
            acc = unit.grad if span is None else unit.grad[span[0]:span[1]]
            self.fold(acc, src, grad_mul, first=not unit.grad_valid)
            unit.grad_valid = True
            grad, grad_mul = acc, 1.0
        if host_norms:                             # the plan's (schedule.py: BackwardPlan)
            sq = float(torch.linalg.vector_norm(grad)) ** 2
            if span is not None:                # every rank's verdict from the whole unit's norm
                sq = self.engine.dp.worker_sum(sq)
            self.norm_sq.append(sq)
            self.check_norm(self.norm_sq[-1], f"the gradient of {unit.name}")
        if update:
            self.update(unit, grad, hp, on_progress=on_progress, grad_mul=grad_mul, span=span)
            unit.grad_valid = False

    def fold(self, acc: torch.Tensor, src: torch.Tensor, mul: float, first: bool = False) -> None:
        """acc += src * mul (acc = src * mul when `first`), with src widened to fp32 and multiplied
        in fp32 before the add (the same roundings whether src crossed as bf16 or fp32)."""
        if first:
            acc.copy_(src)
            if mul != 1.0:
                acc.mul_(mul)
            return
        if mul == 1.0:
            acc.add_(src)
            return
        if self._fold_buf is None:
            self._fold_buf = torch.empty(FOLD_PIECE, dtype=torch.float32)
        for lo in range(0, src.numel(), FOLD_PIECE):
            hi = min(lo + FOLD_PIECE, src.numel())
            scaled = self._fold_buf[:hi - lo]
            scaled.copy_(src[lo:hi]).mul_(mul)
            acc[lo:hi].add_(scaled)

    def update(self, unit: Unit, grad: torch.Tensor, hp, arrived=None, clip_coef=None, on_progress=None,
               grad_mul: float = 1.0, span: tuple[int, int] | None = None) -> None:
        """AdamW of `unit`'s host state with the flat gradient `grad`, in pieces (see UPDATE_PIECE); with
        `span`, of that shard alone (`grad` holds its range)."""
        if self.poisoned:               # [Why a non-finite gradient stops the host updates after it]
            return
        self._wait_readers(unit)
        t0 = time.perf_counter()
        if span is not None:
            # A shard's prefix is not the unit's: readers wait for every rank (data_parallel.py).
            on_piece = on_progress
        else:
            on_piece = unit.set_progress if on_progress is None else _both(unit.set_progress, on_progress)
        optim.apply_adamw(unit, grad, *hp, piece=UPDATE_PIECE, on_piece=on_piece, before_piece=arrived,
                          clip_coef=clip_coef, kernel=self.engine.host_adam, grad_mul=grad_mul, span=span)
        self._count(unit, t0, unit.numel if span is None else span[1] - span[0])

    def _wait_readers(self, unit: Unit) -> None:
        # Note: [Why the update waits for the readers] h2d copies of the old master may still be in
        # flight; the master is rewritten only once every one of them has completed.
        readers, unit.readers = unit.readers, []
        for ev in readers:
            self.sync(ev, f"wait_readers:{unit.name}")

    def _count(self, unit: Unit, t0: float, params: int) -> None:
        """An update of `params` parameters of `unit` that began at `t0` has ended: time and count it."""
        t1 = time.perf_counter()
        stats = self.engine.stats
        stats.adam_s += t1 - t0
        stats.event(f"adam:{unit.name}", t0, t1)
        stats.updated_params += params

    def update_rows(self, unit: Unit, grad: torch.Tensor, rows: torch.Tensor, hp, *, advance: bool,
                    sums: torch.Tensor | None = None, zero_grad: bool = False, exclude: bool = False) -> bool:
        """AdamW of some rows of a one-entry (V, H) unit (the embedding table), in place, with the
        gradient's rows (plus `sums`), or of every row but `rows` (`exclude`); the step counter
        advances first when `advance` (the first set of rows of the step). Returns whether it
        ran: a non-finite step, or a table outside the optimizer's groups or not requiring grad,
        leaves everything as it is."""
        if self.poisoned:               # [Why a non-finite gradient stops the host updates after it]
            return False
        (entry,) = unit.entries
        groups, group_of = hp
        gi = group_of.get(id(entry.param))
        if gi is None:                   # in no group, or frozen when the update was queued (`snapshot`)
            return False
        self._wait_readers(unit)
        if advance:
            unit.steps[0].add_(1)
        shape = grad.shape
        t0 = time.perf_counter()
        unit.state_format.run_rows(self.engine.host_adam, groups[gi], unit, grad, rows, unit.steps[0], sums=sums,
                                zero_grad=zero_grad, exclude=exclude)    # the unit's format (host_optim.py)
        self._count(unit, t0, ((shape[0] - rows.numel()) if exclude else rows.numel()) * shape[1])
        return True

    def clip_task(self, early: bool, norm_ev, grads_ev=None, host_grads=()) -> None:
        """The clip factor of this step. `host_grads`: the summed gradients whose norms the worker
        takes (a step that ends before its last micro-batch); `norm_ev`'s value holds the norms
        taken on the device: the whole running norm with one backward per step (the worker took
        none: `norm_sq` is empty), else the layers' part (accumulate.py) or the resident sums'."""
        engine = self.engine
        if early:   # the step ends before gradient_accumulation_steps: norms were not taken yet
            if grads_ev is not None:
                self.sync(grads_ev, "wait_d2h:grads")
            self.norm_sq = [float(torch.linalg.vector_norm(g)) ** 2 for g in host_grads]
            if engine.dp is not None:     # the ranks' shards of the sums
                self.norm_sq = [engine.dp.worker_sum(sum(self.norm_sq))]
        dev = 0.0
        if norm_ev is not None:
            self.sync(norm_ev, "wait_d2h:norm")
            dev = float(engine.norm.host_sq[0])
        norm = (sum(self.norm_sq) + dev) ** 0.5
        self.check_norm(norm, "the gradient norm")
        mx = engine.config.max_grad_norm
        self.clip_coef = min(mx / (norm + 1e-6), 1.0) if mx is not None else 1.0

    def deferred_task(self, unit: Unit, hp, grads_ev=None, grad: torch.Tensor | None = None, after=None,
                      span: tuple[int, int] | None = None) -> None:
        """The update at optimizer.step() from the step's summed gradient (`grad`, default the
        unit's accumulator; with `span`, the shard of it), with the worker's clip factor;
        `after()` runs once it is done."""
        # The clip factor is applied inside the fused AdamW (its grad_scale): a separate multiply
        # was a full pass over the gradient, 8 ms per 3B layer on the path of the next forward.
        if grads_ev is not None:           # the device's last copy into the accumulator (accumulate.py)
            self.sync(grads_ev, f"wait_d2h:{unit.name}")
        if grad is None:
            grad = unit.grad if span is None else unit.grad[span[0]:span[1]]
        self.update(unit, grad, hp, clip_coef=self.clip_coef, span=span)
        if after is not None:
            after()
        else:
            unit.grad_valid = False
