"""The training step, in the order it runs: one layer's forward, its backward, and the updates.

`Schedule` is the loop a reader follows, from the first layer's forward to the last update
(docs/engine.md, "How a step flows", walks it line for line):

    forward     layer_forward(i) for i = 0 .. L-1       weights from the placement, prefetch the
                                                        window and a head-slot chunk, save x_i
    backward    begin_backward()                        the BackwardPlan: does it update, which
                                                        updates are held for the end
                layer_backward(i) for i = L-1 .. 0      recompute from x_i, differentiate, hand the
                                                        gradient to the layer's placement
                end_backward()                          queue the held updates in forward order
    step        optimizer_step()                        the StepPlan: the clip task, then each
                                                        unit's deferred update in forward order

The two plans are made once, where the modes are read (accumulation, clipping, the LoRA
adapters, the resident and device-updated units, several ranks); the parts do what the plan
says: what they give the step's norm is an object the backward's plan hands them
(`RunningNorm`, or `NoRunningNorm` with accumulation), not a flag they test, and so is what they
do with a unit's update (`UpdatesInBackward`, or `UpdatesAtStep`: mode.py). What a placement
does with a gradient is its own (placements.py); where an update is held is `LateUpdates`
(late_updates.py), filled as this plan says.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import torch

from ..errors import SlideStateError
from ..compute.functions import swapped
from .mode import UPDATES_AT_STEP, UPDATES_IN_BACKWARD, BackwardMode, UpdatesAtStep, UpdatesInBackward
from ..host.optim import sq_norm
from .placements import DeferredStep

__all__ = ["BackwardPlan", "StepPlan", "Schedule", "RunningNorm", "NoRunningNorm"]


class RunningNorm:
    """The step's running norm on the device, kept with one backward per step: each gradient's
    squared norm joins it as the gradient is taken (`add`), and it is copied out beside the
    gradient into the unit's pinned slot (`slot`), which the worker judges before the unit's update.

    Args:
        step_norm: the engine's `StepNorm` (step_norm.py).
    """

    def __init__(self, step_norm):
        self.step_norm = step_norm

    def add(self, squared, *args) -> None:
        """Add `squared(*args)`, a device scalar (computed only where a running norm is kept)."""
        self.step_norm.dev += squared(*args)

    def slot(self, unit) -> torch.Tensor:
        """The pinned scalar the running norm is copied into with `unit`'s gradient."""
        return self.step_norm.slot(unit)


class NoRunningNorm:
    """No running norm (accumulation: the norm is taken from the step's sums): nothing is added,
    no slot is copied."""

    def add(self, squared, *args) -> None:
        pass

    def slot(self, unit) -> None:
        return None


NO_RUNNING_NORM = NoRunningNorm()


@dataclass(frozen=True)
class BackwardPlan:
    """What one backward does, decided when it begins (`BackwardPlan.make`).

    Attributes:
        ends_step: this backward is the optimizer step's last micro-batch.
        updates: the units are updated during this backward, as their gradients land (it ends the
            step and no clipping norm is needed first); else the gradients wait for `optimizer.step()`.
        updating: what the parts do with a unit's update as they take its gradient (mode.py):
            `UpdatesInBackward` when `updates`, else `UpdatesAtStep`.
        running_norm: the step has one backward: each gradient's squared norm joins a running
            norm on the device, copied out beside the gradient and judged by the worker before the
            unit's update (with accumulation the norm is taken from the step's sums).
        host_norms: the worker takes each unit's summed gradient's norm as it lands (the step's last
            backward, with accumulation: there is no running norm to judge it by); a unit whose
            gradient is used as it lands is updated from the whole gradient, after its norm.
        late_layers: how many of the first host layers of the backward land in buffers of their
            own and are updated when it ends (late_updates.py: [Why the top layers are updated late]).
        norm: what the parts give the step's norm as they take a gradient: a `RunningNorm` when
            `running_norm`, else `NoRunningNorm`.
        sums_norm: what the parts that sum gradients on the device (the accumulated layers, the
            adapters) give it: `norm` with one backward per step; with accumulation, the step's
            last backward adds the sums' norms to the device's part (`StepNorm.dev_valid`), the
            others nothing.
    """

    ends_step: bool = False
    updates: bool = False
    updating: UpdatesInBackward | UpdatesAtStep = UPDATES_AT_STEP
    running_norm: bool = False
    host_norms: bool = False
    late_layers: int = 0
    norm: RunningNorm | NoRunningNorm = NO_RUNNING_NORM
    sums_norm: RunningNorm | NoRunningNorm = NO_RUNNING_NORM

    @property
    def holds_layer0(self) -> bool:
        """Layer 0's update (from the ring) is held to run after the embedding's rows, when this
        backward holds updates (late_updates.py: [Why layer 0 is updated after the embedding's rows])."""
        return self.late_layers > 0

    @classmethod
    def make(cls, engine) -> "BackwardPlan":
        """The plan of the backward starting now (backward number `engine.micro` of its step)."""
        cfg = engine.config
        mode = BackwardMode.of(engine.micro, cfg.gradient_accumulation_steps, clipping=cfg.max_grad_norm is not None)
        single = engine.single_micro
        running = RunningNorm(engine.norm)
        return cls(ends_step=mode.ends_step, updates=mode.updates,
                   updating=UPDATES_IN_BACKWARD if mode.updates else UPDATES_AT_STEP, running_norm=single,
                   host_norms=mode.ends_step and not single,
                   late_layers=_late_layers(engine, mode.updates and single),
                   norm=running if single else NO_RUNNING_NORM,
                   sums_norm=running if single or mode.ends_step else NO_RUNNING_NORM)


def _late_layers(engine, updates_alone: bool) -> int:
    """How many layers a backward updates late (`SlideConfig.late_layer_updates`): "auto", enough
    to cover the embedding's whole-table update at the worker's front, when there is one."""
    want = engine.config.late_layer_updates
    if (want == 0 or not updates_alone or engine.config.max_grad_norm is not None or engine.dp is not None
            or not engine.embedding.table.updates_on_worker()
            or any(engine.store.on_disk(u) for u in engine.layer_units)):   # disk-bound: no gain to pay memory for
        return 0
    return math.ceil(engine.embed_unit.numel / engine.late.size) if want == "auto" else int(want)


@dataclass(frozen=True)
class StepPlan:
    """What `optimizer.step()` does, decided when it is called (`StepPlan.make`).

    Attributes:
        deferred: the updates did not run in backward: the clip task, then every unit's update, run now.
        early: the step ends before its last micro-batch (a shorter window, the end of an epoch).
        sums_on_device: with `early` and clipping, the norm is retaken now from every unit's sum,
            the resident layers' and the adapters' being on the device.
        clip_event: the device-side updates (device-updated layers, resident units, adapters)
            wait for the worker's clip task (accumulation only).
        device_updates: some layers are updated by the GPU as they are copied in: they wait for
            the worker's verdict on the norm (`DeferredStep.known`).
        device_scale: with one backward per step, the device updates take the clip factor from
            the device norm (`StepNorm.grad_scale`).
        host_sums: the worker takes the norm from the host's sums of the step so far (`early` with
            accumulation).
        running_norm: the step had one backward: its norm is the device's running norm (the worker's
            clip task reads its copy; the device-side updates take their clip factor from it), not
            the sums' norms the worker took.
        check_after: the updates ran in backward with one backward per step: the worker judges
            the whole step's norm after them, to report a non-finite step once.
        adapters_after: the updates ran in backward and the LoRA adapters (on the device) update now.
    """

    deferred: bool
    early: bool
    sums_on_device: bool
    clip_event: bool
    device_updates: bool
    device_scale: bool
    host_sums: bool
    running_norm: bool
    check_after: bool
    adapters_after: bool

    @classmethod
    def make(cls, engine) -> "StepPlan":
        """The plan of the optimizer step called now (after `DeviceUpdater.prepare` with a deferred step)."""
        single = engine.single_micro
        adapters = bool(engine.lora.params)
        if engine.updated_in_backward:
            return cls(deferred=False, early=False, sums_on_device=False, clip_event=False, device_updates=False,
                       device_scale=False, host_sums=False, running_norm=single, check_after=single,
                       adapters_after=adapters)
        early = engine.micro < engine.config.gradient_accumulation_steps
        resident = bool(engine.residents.layers)
        device = engine.device_updates.on
        return cls(deferred=True, early=early,
                   sums_on_device=early and (resident or adapters) and engine.config.max_grad_norm is not None,
                   clip_event=(device or resident or adapters) and not single, device_updates=device,
                   device_scale=device and single, host_sums=early and not single, running_norm=single,
                   check_after=False, adapters_after=False)


class Schedule:
    """The step's order over the engine's parts.

    Args:
        engine: the SlideEngine whose parts the schedule drives.
    """

    def __init__(self, engine):
        self.engine = engine
        self._backward_t0 = 0.0

    # ----------------------------------------------------------------- forward
    def layer_forward(self, layer_no: int, hidden: torch.Tensor, args, kwargs, save: bool) -> torch.Tensor:
        """Layer `layer_no`'s forward of `hidden` without a graph, on its placement's weights; saves its
        input when training."""
        engine = self.engine
        place = engine.places[layer_no]
        ws, slot = place.weights()
        busy = (slot,) if slot is not None else ()
        for ahead in range(layer_no + 1, min(layer_no + engine.config.window, len(engine.layer_units))):
            engine.places[ahead].prefetch(busy)
        engine.head.prefetch()                  # head.py: [Why the head slot is loaded in chunks during the forward]
        if save:
            engine.tier.save(layer_no, hidden, engine.embedding.remake_input(layer_no, hidden))
            if any(m.training for m in engine.dropouts[layer_no]):
                engine.rng.save(layer_no)
        span = engine.clock.span_start()
        with torch.no_grad(), swapped(place.unit, ws), engine.matmuls.forward(layer_no, slot):
            out = engine.call_layer(layer_no, hidden, args, kwargs)
        engine.clock.span_end(span)
        place.after_forward(slot)
        return out

    # ----------------------------------------------------------------- backward
    def begin_backward(self) -> None:
        """The loss's backward starts (at the head): plan it and open the step's norm."""
        engine = self.engine
        if engine.optimizer is None:
            raise SlideStateError("call model.create_optimizer(...) (or build a SlideOptimizer) before backward(): "
                                  "the engine updates the weights during backward")
        ga = engine.config.gradient_accumulation_steps
        if engine.micro >= ga:
            raise SlideStateError(
                f"backward() number {engine.micro + 1} since the last optimizer step, but "
                f"SlideConfig.gradient_accumulation_steps={ga}: call optimizer.step() after every {ga} backward passes")
        engine.worker.raise_if_failed()
        if engine.micro == 0:
            engine.worker.submit(engine.host_updates.begin_step_task, engine.step_no + 1)
        engine.guard.open = True
        engine.backward_plan = plan = BackwardPlan.make(engine)
        engine.hp = engine.optimizer.snapshot()
        engine.late.begin(plan.late_layers)
        if plan.ends_step:
            engine.host_updates.norm_sq = []
            engine.norm.dev_valid = not plan.running_norm
        if plan.running_norm or plan.ends_step:
            engine.norm.dev.zero_()
        self._backward_t0 = time.perf_counter()
        engine.stats.event("backward_begin", self._backward_t0)

    def layer_backward(self, layer_no: int, gy: torch.Tensor, args, kwargs) -> torch.Tensor:
        """Layer `layer_no`'s backward of the output gradient `gy`: recompute from its saved input with
        gradients, prefetch the layer below, and hand the parameter gradients to the placement and the
        adapters; the input's gradient."""
        engine = self.engine
        place = engine.places[layer_no]
        ws, slot = place.weights()
        place.before_recompute()
        if layer_no > 0:
            if engine.config.window > 1:
                engine.places[layer_no - 1].prefetch((slot,) if slot is not None else ())
            engine.tier.prefetch(layer_no - 1)
        hidden = engine.tier.load(layer_no).detach().requires_grad_()
        ws, wrt = place.leaves(ws)
        extra = engine.lora.by_layer[layer_no]
        span = engine.clock.span_start()
        skip = engine.output_projections[layer_no] if engine.skip_output_projection else None
        with torch.enable_grad(), swapped(place.unit, ws), engine.matmuls.recompute(layer_no, slot, skip), \
                engine.rng.replay(layer_no):
            out = engine.call_layer(layer_no, hidden, args, kwargs)
            aux = engine.router_aux.surrogate(layer_no) if engine.router_aux is not None else None
        outs, gouts = ([out], [gy]) if aux is None else ([out, aux], [gy, torch.ones_like(aux)])
        grads = torch.autograd.grad(outs, [hidden] + wrt + extra, gouts, allow_unused=True)
        engine.clock.span_end(span)
        place.after_recompute(slot)
        engine.tier.drop(layer_no)
        place.take_gradient(list(grads[1:1 + len(wrt)]))
        engine.lora.take_gradient(layer_no, grads[1 + len(wrt):])
        return grads[0]

    def end_backward(self) -> None:
        """The embedding's backward is done: queue the held updates, close the backward."""
        engine = self.engine
        engine.late.finish()
        engine.streams.settle()          # the last gradients' memory serves the next forward (transfer.py)
        engine.guard.open = False
        engine.micro += 1
        engine.live_generation = None
        engine.updated_in_backward = engine.backward_plan.updates
        engine.stats.backward_s += time.perf_counter() - self._backward_t0
        engine.stats.event("backward_end", time.perf_counter())

    # ----------------------------------------------------------------- optimizer step
    def optimizer_step(self) -> None:
        """`optimizer.step()`: the deferred updates, or the checks after updates in backward."""
        engine = self.engine
        engine.worker.raise_if_failed()
        engine.guard.check()
        if engine.micro == 0:
            raise SlideStateError("optimizer.step() without a backward pass since the last step")
        engine.device_updates.prepare()               # the first step picks the device-updated layers
        plan = StepPlan.make(engine)
        if plan.deferred:
            self._deferred_updates(plan)
        elif plan.check_after:
            slot = engine.norm.step_slot(engine.step_no)
            engine.worker.submit(engine.host_updates.step_check_task, engine.norm.copy(slot), slot)
        if plan.adapters_after:
            engine.lora.step(engine.hp, found_inf=engine.norm.found_inf())
        if engine.dp is not None:
            # The next forward copies whole units: every rank's shard of every update must be in.
            engine.worker.join()
            engine.worker.raise_if_failed()
            engine.dp.barrier()
        engine.finish_step()

    def _deferred_updates(self, plan: StepPlan) -> None:
        """The clip task, then the device updates (resident units, adapters), then each unit's
        update where its placement runs it, in forward order (embedding, layers, head)."""
        engine = self.engine
        hp = engine.optimizer.snapshot()
        grads_ev = engine.streams.record(engine.streams.d2h)   # every gradient copy into the host accumulators
        resident = engine.residents.layers
        if plan.early:
            engine.norm.dev_valid = False
            if plan.sums_on_device:
                # The host accumulators of resident layers read as zeros: their sums and the
                # adapters' are on the device.
                engine.norm.dev.zero_()
                engine.norm.dev += sq_norm([r.grad for r in resident.values() if r.grad_valid])
                if engine.lora.params and engine.lora.sq_norm() is not None:
                    engine.norm.dev += engine.lora.sq_norm()
                engine.norm.dev_valid = True
        norm_ev = engine.norm.copy(engine.norm.host_sq) if plan.running_norm or engine.norm.dev_valid else None
        clip_done = threading.Event() if plan.clip_event else None
        # `known`: the worker has judged the step's norm (a device update is skipped when it is
        # not finite, see HostUpdates.clip_task)
        known = threading.Event() if plan.device_updates else None
        on_device = {id(r.unit) for r in resident.values()}
        host_grads = [grad for u in engine.store.units if id(u) not in on_device and u.trainable
                      and (grad := engine.step_sum(u)) is not None] if plan.host_sums else ()
        engine.worker.submit(engine.host_updates.clip_task, plan.early, norm_ev, grads_ev, host_grads,
                        done=tuple(ev for ev in (clip_done, known) if ev is not None))
        # the device-side updates' clip factor: from the running norm, or from the worker's clip task
        device_clip = (engine.residents.clip_by_running_norm if plan.running_norm
                       else lambda: engine.residents.clip_by_worker(clip_done))
        deferred = DeferredStep(hp, grads_ev, clip_done=clip_done, known=known, device_clip=device_clip)
        span = engine.clock.span_start()
        on_device = engine.residents.step(deferred)
        if engine.lora.params:
            engine.lora.step(hp, *deferred.resident_clip())
        if plan.device_scale:
            deferred.scale, deferred.ready = engine.norm.grad_scale()
        engine.clock.span_end(span)
        for unit in engine.store.units:
            if id(unit) not in on_device:
                engine.updater_of(unit).step(deferred)
