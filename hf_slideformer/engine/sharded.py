"""The units of a data-parallel engine: each rank updates its shard of every unit (data_parallel.py).

| part | one process | `Sharded*`, N ranks |
|---|---|---|
| a layer (`ShardedHostLayer`) | d2h of its gradient; the worker folds / updates the unit | the ranks' gradients summed on the devices into shards (`reduce_scatter`), d2h of this rank's shard; the worker folds / updates that range |
| the embedding (`ShardedEmbedding`) | row sums to the host, folded into a dense host gradient, updated in two parts | the rows (and a tied lm_head's gradient) made dense on the device, reduced into shards like a layer; the shard updated in one part |
| the head (`ShardedHead`) | gradients sent to the host in the forward, scaled by the loss gradient on the worker | kept on the device until the backward, scaled there, reduced into shards |

The running norm of the step adds each rank's squared shard, summed over the ranks on the device
(`DataParallel.all_sum`), so every rank's worker judges the same norm and skips a non-finite step
at the same unit. Nothing here is updated on a GPU or kept resident.
"""
from __future__ import annotations

import threading

import torch

from .embedding import Embedding
from .head import LossHead
from ..host.optim import sq_norm as _sq_norm
from .placements import DeferredStep, HostLayer
from ..host.store import Unit

__all__ = ["ShardedHostLayer", "ShardedEmbedding", "ShardedHead"]


class _Shard:
    """The part of a sharded unit's path common to the three: the rank's span, its reduced
    gradient's norm, the copy out and the worker's fold / update of the range."""

    def __init__(self, engine, unit: Unit):
        self.engine, self.unit = engine, unit
        self.span = engine.dp.span(unit.numel)

    def send(self, shard: torch.Tensor, dst: torch.Tensor, free: threading.Event) -> None:
        """Main thread: this rank's reduced gradient `shard` (on the device) to the host buffer
        `dst`, and the worker's task on it; `free` is set once the worker is done with `dst`. With
        one backward per step the shard's squares, summed over the ranks, join the running norm
        first (the worker judges it before the update)."""
        engine, unit, plan = self.engine, self.unit, self.engine.backward_plan
        plan.norm.add(lambda: engine.dp.all_sum(_sq_norm([shard]).to(engine.norm.dev.device)))
        norm = plan.norm.slot(unit)
        done = engine.grad_ring.d2h([shard], [dst], norm_dst=norm)
        plan.updating.begin(engine, unit)
        engine.worker.submit(self.task, dst, done, plan.updates, plan.host_norms, engine.hp, norm,
                        done=(free,) + plan.updating.signals(unit))

    def task(self, src, done, update: bool, host_norms: bool, hp, norm=None) -> None:
        """Worker: fold the shard's gradient in `src` into the range and/or update it."""
        engine, unit = self.engine, self.unit
        engine.host_updates.sync(done, f"wait_d2h:{unit.name}")
        if norm is not None:
            engine.host_updates.check_norm(float(norm[0]), f"a gradient of the units from the head down to {unit.name}")
        engine.host_updates.consume(unit, src, update, host_norms, hp, span=self.span)

    def deferred(self, deferred: DeferredStep) -> None:
        """optimizer.step() after a backward that did not update: the worker updates the range."""
        engine, unit = self.engine, self.unit
        engine.begin_update(unit)
        engine.worker.submit(engine.host_updates.deferred_task, unit, deferred.hp, deferred.grads_ev, None, None,
                             self.span, done=(unit.updated,))


class ShardedHostLayer(HostLayer):
    """A decoder layer whose gradient is summed over the ranks on the devices, and whose shard this
    rank's worker updates (the module table)."""

    device_updatable = False

    def __init__(self, engine, unit: Unit):
        super().__init__(engine, unit)
        self.shard = _Shard(engine, unit)

    def before_recompute(self) -> None:
        pass                       # no device accumulation: each micro-batch's shard is folded on the host

    def take_gradient(self, grads: list) -> None:
        engine, unit = self.engine, self.unit
        dtype = next((g.dtype for g in grads if g is not None), engine.dtype)
        shard = engine.dp.reduce_grads(unit.numel, grads, [x.offset for x in unit.entries], dtype, engine.device)
        index = engine.grad_ring.claim_next()
        self.shard.send(shard, engine.grad_ring.buffers[index][:shard.numel()], engine.grad_ring.free[index])

    def step(self, deferred: DeferredStep) -> None:
        self.shard.deferred(deferred)


class _HostShard:
    """A pinned host buffer for one unit's shard gradient, reused step after step, and the event
    that says the worker is done with it."""

    def __init__(self, engine):
        self.engine = engine
        self.buf: torch.Tensor | None = None
        self.free = threading.Event()
        self.free.set()

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        engine = self.engine
        engine.clock.wait(self.free, "other")               # the worker is done with the previous one
        if self.buf is None or self.buf.numel() < numel or self.buf.dtype != dtype:
            if self.buf is not None:
                engine.pinned.release(self.buf)
            self.buf = engine.pinned.empty(max(numel, 1), dtype=dtype)
        self.free.clear()
        return self.buf[:numel]


class ShardedEmbedding(Embedding):
    """The embedding of a data-parallel engine: the batch rows' gradient (plus a tied lm_head's)
    made dense on the device and reduced into shards like a layer's (the module table)."""

    def __init__(self, engine, unit: Unit, module: torch.nn.Embedding):
        super().__init__(engine, unit, module)
        self.shard = _Shard(engine, unit)
        self.out = _HostShard(engine)
        self.dw = None              # a tied lm_head's gradient on the device, and its scale (ShardedHead)
        self.dw_scale = None

    def ensure_grad(self) -> None:
        pass                        # the unit's accumulator is the store's (its shard written), when needed

    def take_gradient(self, gx: torch.Tensor) -> None:
        """The batch rows' gradient made dense on the device, reduced into shards, this rank's sent."""
        engine, unit, dp = self.engine, self.unit, self.engine.dp
        num_tokens = gx.numel() // self.hidden
        uniq, inv, keep = self.rows_dev
        span = engine.clock.span_start()
        # Summed per distinct row first, as one process does ([Why the embedding gradient is summed
        # on the GPU]), then scattered into the dense layout the shards cut.
        token_grads = gx.reshape(num_tokens, self.hidden).float() * keep[:, None]
        row_sums = torch.zeros(uniq.numel(), self.hidden, dtype=torch.float32, device=gx.device)
        row_sums.index_put_((inv,), token_grads, accumulate=True)
        flat = torch.zeros(dp.per_rank(unit.numel) * dp.world, dtype=torch.float32, device=gx.device)
        dense_grad = flat[:unit.numel].view(self.vocab, self.hidden)
        dense_grad.index_add_(0, uniq, row_sums)
        if self.dw is not None:     # tied: the lm_head's gradient, widened, times the loss gradient
            dense_grad.add_(self.dw.float().mul_(self.dw_scale))
            self.dw = self.dw_scale = None
        shard = dp.reduce_flat(flat, unit.numel)
        del flat, dense_grad, row_sums, token_grads
        engine.clock.span_end(span)
        self.shard.send(shard, self.out.take(shard.numel(), shard.dtype), self.out.free)
        engine.end_backward()

    def step(self, deferred: DeferredStep) -> None:
        self.shard.deferred(deferred)


class ShardedHead(LossHead):
    """The head of a data-parallel engine: its gradients stay on the device until the backward,
    which scales them by the loss gradient and reduces them into shards (the module table)."""

    def __init__(self, engine, unit: Unit, lm_module, norm_fn, slots):
        super().__init__(engine, unit, lm_module, norm_fn, slots)
        self.shard = _Shard(engine, unit)
        self.out = _HostShard(engine)
        self.dev_grads: list | None = None

    def _send(self, pgrads: list) -> None:
        self.dev_grads = pgrads     # an earlier forward's, never consumed by a backward, are dropped
        self.done = None

    def backward(self, gloss: torch.Tensor) -> None:
        from ..errors import SlideStateError
        if not self.pending:
            raise SlideStateError("backward() without a matching forward")
        self.pending = False
        engine, hu, dp = self.engine, self.unit, self.engine.dp
        self.scale_dev = gloss.detach().float().reshape(())
        pgrads, self.dev_grads = self.dev_grads, None
        if pgrads is None:          # a frozen head computed none
            return
        own = pgrads[:len(hu.entries)]
        self.lm_weight.hand_to_shards(pgrads, self.scale_dev)
        dtype = next((g.dtype for g in own if g is not None), engine.dtype)
        shard = dp.reduce_grads(hu.numel, own, [x.offset for x in hu.entries], dtype, engine.device,
                                scale=self.scale_dev.to(dtype))
        self.shard.send(shard, self.out.take(shard.numel(), shard.dtype), self.out.free)

    def step(self, deferred) -> None:
        self.shard.deferred(deferred)
