"""The host side of the schedule: what the CPU worker thread runs for the engine.

Each task folds a micro-batch's gradient of one unit into the host buffers and, when the step
ends in this backward, runs torch's fused AdamW on the unit's masters and moments. The methods
belong to `SlideEngine` (a mixin: they share its state); only the worker thread calls them.
"""
from __future__ import annotations

import logging
import math
import time

import torch

from . import optim
from .errors import NonFiniteGradientError
from .store import Unit

logger = logging.getLogger(__name__)

__all__ = ["HostTasks"]

# Elements per AdamW call of a host update (32 MiB of fp32 master). The worker reports each
# finished prefix of the unit (`Unit.set_progress`), and the slot loader copies that prefix to
# the GPU while the rest is updated: the next forward's first layer, whose gradient is the last
# of the backward, then waits for its update plus one piece's copy instead of the whole copy.
UPDATE_PIECE = 1 << 23
# Elements per step of a scaled fold into an accumulator (16 MiB of fp32 scratch).
FOLD_PIECE = 1 << 22


def _both(f, g):
    def call(n: int) -> None:
        f(n)
        g(n)
    return call


class HostTasks:
    """Worker-side methods of SlideEngine."""

    # Note: [Why a non-finite gradient stops the host updates after it] the worker judges the norm
    # it has for each unit before updating it (the running norm of the backward with one
    # micro-batch, a unit's own sum with accumulation, the global norm with clipping). From the
    # first one that is not finite, no host update of the step writes anything (`_update`), so no
    # master takes a NaN; with clipping the norm is known before any update, and the whole step
    # is skipped. Device updates skip on the device by the same norm (`_found_inf_dev`).
    def _begin_step_task(self, step_no: int) -> None:
        self._poisoned, self._worker_step = False, step_no

    def _check_norm(self, sq: float, where: str) -> None:
        if not math.isfinite(sq):
            self._poison(where)

    def _poison(self, where: str) -> None:
        if self._poisoned:
            return
        self._poisoned = True
        msg = f"step {self._worker_step}: {where} is not finite (inf or NaN)"
        if self.config.nonfinite_grads == "raise":
            raise NonFiniteGradientError(f"{msg}; no update of it was applied after that point "
                                         "(SlideConfig.nonfinite_grads='raise'): reload or resume from a checkpoint")
        logger.warning("%s: the step's updates not yet applied are skipped (SlideConfig.nonfinite_grads='skip')",
                       msg)

    def _step_check_task(self, ev, norm) -> None:
        """After a step whose updates ran in backward: its whole norm, resident units' included."""
        self._sync(ev, "wait_d2h:norm")
        self._check_norm(float(norm[0]), "the gradient norm")

    def _sync(self, ev, label: str) -> None:
        """Block the worker on a CUDA event (a copy it consumes or a reader it must not overtake), timed."""
        t0 = time.perf_counter()
        ev.synchronize()
        t1 = time.perf_counter()
        self.stats.worker_wait_s += t1 - t0
        if t1 - t0 > 1e-4:
            self.stats.event(label, t0, t1)

    def _rows_buffer(self, k: int, n: int) -> torch.Tensor:
        """Persistent (n, H) fp32 scratch number k of the worker's embedding-row work.

        Note: [Why the row buffers persist] a fresh 100-400 MB tensor per step is a fresh mmap whose
        pages fault in on first touch: 16k rows of 3072 fp32 gathered from a (128256, 3072) table
        took 228 ms into a new tensor and 13 ms into one already in memory (2-core machine). The buffers grow to the largest batch seen and stay.
        """
        bufs = self._row_bufs
        if bufs[k] is None or bufs[k].shape[0] < n:
            grow = n if bufs[k] is None else max(n, bufs[k].shape[0] * 5 // 4)
            bufs[k] = torch.empty(grow, self.hidden, dtype=torch.float32)
        return bufs[k][:n]

    def _embed_task(self, sums, rows, done, update, ends_step, hp, norm=None):
        """Fold the batch's per-row gradient sums (distinct rows) into the embedding's gradient."""
        self._sync(done, "wait_d2h:embed")
        if norm is not None:
            self._check_norm(float(norm[0]), "the gradient of the embedding (or of a layer)")
        elif not self.single_micro and not bool(torch.isfinite(sums).all()):
            # judged now: the sum it joins is read by the next micro-batch's early bulk update
            self._poison("the gradient of the embedding")
        u = self.embed_unit
        g = self.embed_grad.view(self.vocab, self.hidden)
        grad_rows = torch.index_select(g, 0, rows, out=self._rows_buffer(0, rows.numel())).add_(sums)
        rows_update = update and self._bulk is not None
        if not rows_update or (ends_step and not self.single_micro):
            # Written back unless only the rows update below reads them (it takes grad_rows), on
            # the path to the next forward: the table's rows are then reset or overwritten.
            g.index_copy_(0, rows, grad_rows)
        self.touched.append(rows)
        if ends_step and not self.single_micro:
            self._norm_sq.append(float(torch.linalg.vector_norm(self.embed_grad)) ** 2)
            self._check_norm(self._norm_sq[-1], "the gradient of the embedding")
        if update:
            if self._bulk is not None:
                self._embed_rows_update(hp, grad_rows)
            else:
                self._update(u, self.embed_grad, hp)
            self._reset_embed_grad()

    # Note: [Why the embedding is updated in two parts] with updates in backward, the embedding's
    # gradient is final for every row but the batch's own tokens as soon as the head is done (a
    # tied lm_head's dW, else zero). So the head task runs AdamW over the whole table early,
    # having saved the batch rows' old (param, m, v); the last task of the backward restores those
    # rows and updates them again with their full gradient. Same mathematics, and the next
    # forward waits for a few thousand rows instead of the whole (V, H) table.
    def _embed_bulk_update(self, rows: torch.Tensor, hp) -> None:
        u = self.embed_unit
        views = [t.view(self.vocab, self.hidden) for t in (u.master, u.exp_avg, u.exp_avg_sq)]
        saved = [torch.index_select(v, 0, rows, out=self._rows_buffer(1 + k, rows.numel()))
                 for k, v in enumerate(views)]
        self._update(u, self.embed_grad, hp)
        self._bulk = (rows, saved, u.steps[0].clone())

    def _embed_rows_update(self, hp, grad: torch.Tensor) -> None:
        """AdamW of the batch's rows again from their saved state, with `grad` their full gradient."""
        u = self.embed_unit
        rows, (w, m, v), step = self._bulk
        self._bulk = None
        groups, group_of = hp
        gi = group_of.get(id(u.entries[0].param))
        if gi is None or not u.entries[0].param.requires_grad or self._poisoned:
            return
        self.host_adam.step(groups[gi], [w], [grad], [m], [v], [step])
        for dst, src in zip((u.master, u.exp_avg, u.exp_avg_sq), (w, m, v)):
            dst.view(self.vocab, self.hidden).index_copy_(0, rows, src)

    def _reset_embed_grad(self):
        if self.embed_grad is None:                  # never on the host since it was made
            self.touched = []
            self.embed_unit.grad_valid = False
            return
        g = self.embed_grad.view(self.vocab, self.hidden)
        if self.tied:
            pass  # the head's contribution overwrites every row first at the next step
        else:
            for ids in self.touched:
                g.index_fill_(0, ids, 0.0)
        self.touched = []
        self.embed_unit.grad_valid = False

    def _head_task(self, done, scale_ev, update, ends_step, hp, touch=None, embed_on_host=True, ring=(), norm=None):
        self._sync(done, "wait_d2h:head")
        self._sync(scale_ev, "wait_d2h:scale")
        if norm is not None:
            self._check_norm(float(norm[0]), "the gradient of the head")
        scale = float(self.scale_host[0])
        hu = self.head_unit
        # The head's gradient (in the ring's dtype) times the loss gradient `scale`: each element
        # is widened to fp32, then multiplied, wherever that happens (the update, the accumulator).
        src = self.head_host[:hu.numel]
        if self.tied and embed_on_host:
            eu = self.embed_unit
            if self.single_micro:            # already in place (see head_forward)
                if scale != 1.0:
                    self.embed_grad.mul_(scale)
            else:
                tied = self.head_host[hu.numel:]
                self._fold(self.embed_grad, tied, scale, first=not eu.grad_valid)
                eu.grad_valid = True
        # Read by the update alone, front to back: each ring buffer goes back once it is passed.
        returned = self._ring_returner(ring) if ring and hu.grad is None else None
        self._consume(hu, src, update, ends_step, hp, returned, grad_mul=scale)
        if update and touch is not None:
            self._embed_bulk_update(touch, hp)

    def _ring_returner(self, ring: tuple):
        """on_progress callback: give ring buffer k back once an update has passed its end."""
        pending = list(ring)

        def returned(n: int) -> None:
            for k in self._ring_passed(pending, n):
                self.ring_free[k].set()
        return returned

    def _layer_task(self, u, src, done, update, ends_step, hp, marks=None, norm=None):
        if norm is not None:
            # the running norm is copied before the gradient (engine._d2h)
            self._sync(marks[0][1] if marks else done, f"wait_d2h:{u.name}")
            self._check_norm(float(norm[0]), f"a gradient of the layers from the head down to {u.name}")
        if marks and update and u.grad is None and (self.single_micro or not ends_step):
            # The gradient is used as it lands (no accumulator, no norm to take first): each piece
            # of the update waits only for the copies that cover it.
            pending = list(marks)

            def arrived(end: int) -> None:
                while pending and pending[0][0] < end:
                    self._sync(pending.pop(0)[1], f"wait_d2h:{u.name}")
                if pending:
                    self._sync(pending[0][1], f"wait_d2h:{u.name}")
            self._update(u, src, hp, arrived)
            self._sync(done, f"wait_d2h:{u.name}")
            return
        self._sync(done, f"wait_d2h:{u.name}")
        self._consume(u, src, update, ends_step, hp)

    def _consume(self, u: Unit, src: torch.Tensor, update: bool, ends_step: bool, hp, on_progress=None,
                 grad_mul: float = 1.0) -> None:
        """Worker side: fold this micro-batch's gradient of `u` (times `grad_mul`) in, and update
        when the step ends here."""
        if u.grad is None:                      # no accumulator: GA == 1, no clipping
            g = src
        else:
            if u.host_write is not None:        # a device update's copies have read it (device_update.py)
                self._sync(u.host_write, f"wait_readers:{u.name}")
            self._fold(u.grad, src, grad_mul, first=not u.grad_valid)
            u.grad_valid = True
            g, grad_mul = u.grad, 1.0
        if ends_step and not self.single_micro:
            self._norm_sq.append(float(torch.linalg.vector_norm(g)) ** 2)
            self._check_norm(self._norm_sq[-1], f"the gradient of {u.name}")
        if update:
            self._update(u, g, hp, on_progress=on_progress, grad_mul=grad_mul)
            u.grad_valid = False

    def _fold(self, acc: torch.Tensor, src: torch.Tensor, mul: float, first: bool = False) -> None:
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
        for a in range(0, src.numel(), FOLD_PIECE):
            b = min(a + FOLD_PIECE, src.numel())
            w = self._fold_buf[:b - a]
            w.copy_(src[a:b]).mul_(mul)
            acc[a:b].add_(w)

    def _update(self, u: Unit, g: torch.Tensor, hp, arrived=None, clip_coef=None, on_progress=None,
                grad_mul: float = 1.0) -> None:
        if self._poisoned:              # [Why a non-finite gradient stops the host updates after it]
            return
        # Note: [Why the update waits for the readers] h2d copies of the old master may still be in
        # flight; the master is rewritten only once every one of them has completed.
        readers, u.readers = u.readers, []
        for ev in readers:
            self._sync(ev, f"wait_readers:{u.name}")
        t0 = time.perf_counter()
        on_piece = u.set_progress if on_progress is None else _both(u.set_progress, on_progress)
        optim.apply_adamw(u, g, *hp, piece=UPDATE_PIECE, on_piece=on_piece, before_piece=arrived,
                          clip_coef=clip_coef, kernel=self.host_adam, grad_mul=grad_mul)
        t1 = time.perf_counter()
        self.stats.adam_s += t1 - t0
        self.stats.event(f"adam:{u.name}", t0, t1)
        self.stats.updated_params += u.numel

    def _clip_task(self, early: bool, norm_ev, grads_ev=None, on_device=frozenset()) -> None:
        """The clip factor of this step; `on_device`: ids of the units whose gradient sums are on the
        device (resident layers), whose norms `norm_ev`'s value holds."""
        if self.single_micro:
            self._sync(norm_ev, "wait_d2h:norm")
            norm = float(self.norm_host[0]) ** 0.5
        elif early:     # the step ends before gradient_accumulation_steps: norms were not taken yet
            if grads_ev is not None:
                self._sync(grads_ev, "wait_d2h:grads")
            self._norm_sq = [float(torch.linalg.vector_norm(self._grad_of(u))) ** 2 for u in self.store.units
                             if id(u) not in on_device]
            dev = 0.0
            if norm_ev is not None:          # the resident layers' sums, taken on the device
                self._sync(norm_ev, "wait_d2h:norm")
                dev = float(self.norm_host[0])
            norm = (sum(self._norm_sq) + dev) ** 0.5
        else:           # the layers' part was taken on the device (accumulate.py), the others' here
            dev = 0.0
            if norm_ev is not None:
                self._sync(norm_ev, "wait_d2h:norm")
                dev = float(self.norm_host[0])
            norm = (sum(self._norm_sq) + dev) ** 0.5
        self._check_norm(norm, "the gradient norm")
        mx = self.config.max_grad_norm
        self._clip_coef = min(mx / (norm + 1e-6), 1.0) if mx is not None else 1.0

    def _grad_of(self, u: Unit) -> torch.Tensor:
        return self.embed_grad if u is self.embed_unit else u.grad

    def _accumulated_update_task(self, u: Unit, done, hp, norm=None) -> None:
        """The last micro-batch's update in backward of a layer whose sum the device accumulated."""
        self._sync(done, f"wait_d2h:{u.name}")
        if norm is not None:
            self._check_norm(float(norm[0]), f"a gradient sum of the layers from the head down to {u.name}")
        self._update(u, u.grad, hp)
        u.grad_valid = False

    def _deferred_task(self, u: Unit, hp, grads_ev=None) -> None:
        # The clip factor is applied inside the fused AdamW (its grad_scale): a separate multiply
        # was a full pass over the gradient, 8 ms per 3B layer on the path of the next forward.
        if grads_ev is not None:           # the device's last copy into the accumulator (accumulate.py)
            self._sync(grads_ev, f"wait_d2h:{u.name}")
        self._update(u, self._grad_of(u), hp, clip_coef=self._clip_coef)
        if u is self.embed_unit:
            self._reset_embed_grad()
        else:
            u.grad_valid = False
