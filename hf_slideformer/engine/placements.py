"""Placements: where one decoder layer's weights and optimizer state live, and where it is updated.

Every decoder layer has one placement object (`SlideEngine.places[i]`), chosen between optimizer
steps and swapped whole when the plan moves the layer:

| placement | state | weights for a forward | gradient | deferred update |
|---|---|---|---|---|
| `HostLayer` | host store | a slot, filled from the master | d2h into the ring; the CPU worker folds and/or updates | CPU worker |
| `DeviceUpdateLayer` (device_update.py) | host store | a slot its pending update fills | with clipping d2h into its pinned accumulator; without, updated on the GPU at once | GPU, as it is copied in |
| `ResidentLayer` (resident.py) | GPU | its device copy | summed and/or updated on the GPU | GPU |
| `DiskLayer` (disk_placement.py) | a file on disk, in a pinned buffer around each use | a slot, filled from the buffer | as `HostLayer`, the state read in beside the copy and written back after | CPU worker |
| `ShardedHostLayer` (sharded.py) | host store shared by the ranks | a slot, filled from the master | summed over the ranks on the devices; d2h of this rank's shard | CPU worker, this rank's shard |

The schedule (`schedule.py`) asks the placement and never which case a layer is in:

    forward:   ws, slot = place.weights(busy); window.prefetch(busy); y = layer(x, ws); place.after_forward(slot)
    backward:  ws, slot = place.weights(busy); place.before_recompute(); ...; place.after_recompute(slot);
               place.take_gradient(grads)
    step:      place.step(deferred)          (clipping, or a step that ends before its last micro-batch)

`FrozenLayer` is a layer whose own weights do not train (the base under LoRA): they stream in,
and the backward takes only the input's gradient and the adapters' (`lora.AdapterSet`).

A new place for a layer's state (a frozen base under LoRA, unit state on disk, a shard of a
data-parallel group) is a new subclass of `LayerPlacement`, not a new set of branches.
`Placements` (`SlideEngine.places`) is the one owner that assigns them and the one place that
asks which kind a placement is (the class attributes below); every other part asks it.

Methods named `*_task` run on the CPU worker thread; the others on the main thread.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..compute.functions import leaves as _leaves
from ..host.optim import sq_norm as _sq_norm
from ..host.store import Unit
from .end_training import choose as choose_training

__all__ = ["UnitPlacement", "LayerPlacement", "HostLayer", "FrozenLayer", "NoUpdate", "DeferredStep", "Placements"]


@dataclass
class DeferredStep:
    """What a deferred update needs at `optimizer.step()`: the hyper-parameters, the clip factor
    wherever it lives, and the events it waits for.

    Attributes:
        hp: the optimizer's hyper-parameter snapshot.
        grads_ev: d2h event after every gradient copy into the host accumulators.
        scale, ready: the device updates' gradient scale (the clip factor's reciprocal, a device
            scalar) and the compute event after which it is valid; None with accumulation.
        clip_done: set once the worker's clip task has run (accumulation with device-held sums).
        known: set once the worker has judged the step's norm (the device updates wait for it).
        device_clip: callable -> (clip factor, found_inf) for updates on the compute stream
            (resident units), computed on first use and kept.
    """

    hp: tuple
    grads_ev: object = None
    scale: object = None
    ready: object = None
    clip_done: object = None
    known: object = None
    device_clip: object = None
    _clip: tuple | None = field(default=None, repr=False)

    def resident_clip(self) -> tuple:
        if self._clip is None:
            self._clip = self.device_clip()
        return self._clip


class UnitPlacement(Protocol):
    """What the schedule asks of every unit's place at `optimizer.step()`: each layer's
    (`LayerPlacement`), the embedding's (`embedding.Embedding`) and the head's (`head.LossHead`)."""

    unit: Unit

    def step(self, deferred: DeferredStep) -> None:
        """`optimizer.step()` after a backward that did not update: queue the update where it runs."""


class LayerPlacement:
    """One decoder layer's place. The base holds the weights in the host store and brings them
    into a slot of the window; subclasses say where the gradient goes and where the update runs.

    Args:
        engine: the SlideEngine (streams, slots, worker, the backward's mode and norms).
        unit: the layer's unit.
    """

    # What the assigner (`Placements`) asks; no other code reads these.
    resident = False         # its weights are on the device: no slot, no copy in
    trainable = True         # its weights take gradients (the plan may move it)
    host_state = True        # its state is in the host store (the plan may make it resident or device-updated)
    device_updatable = False  # the plan may update it on the device instead (device_update.py)
    updates_on_device = False  # its update streams through the GPU (device_update.py)

    def __init__(self, engine, unit: Unit):
        self.engine, self.unit = engine, unit

    def leaves(self, ws: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """For the recompute: (the weights to compute with, those whose gradient it takes)."""
        ws = _leaves(ws)
        return ws, ws

    # ------------------------------------------------------------- weights (main thread)
    def weights(self, busy: tuple = ()) -> tuple[list[torch.Tensor], object]:
        """The layer's compute-dtype weights on the device, and the slot holding them (or None)."""
        slot = self.engine.slots.acquire((self.unit,), busy)
        return slot.views(self.unit), slot

    def prefetch(self, busy: tuple = ()) -> None:
        """Start bringing the weights in (the window's look-ahead)."""
        self.engine.slots.load((self.unit,), busy=busy)

    def fill(self, dst: torch.Tensor):
        """SlotQueue hook: an iterator that writes the weights into `dst` one step at a time, or
        None to copy the master."""
        return None

    def after_forward(self, slot) -> None:
        self.engine.slots.release(slot)

    def after_recompute(self, slot) -> None:
        self.engine.slots.release(slot)

    def before_recompute(self) -> None:
        """Backward of this layer is next: start what its gradient's path needs."""

    # ------------------------------------------------------------- gradient and update
    def take_gradient(self, grads: list) -> None:
        """This micro-batch's parameter gradients (entry order, None where unused), just computed
        on the compute stream, in the backward's mode (`engine.backward_plan`)."""
        raise NotImplementedError

    def step(self, deferred: DeferredStep) -> None:
        """`optimizer.step()` after a backward that did not update: queue the update where it runs."""
        raise NotImplementedError


class HostLayer(LayerPlacement):
    """State in the host store, updated by the CPU worker (`HostAdam`).

    The gradient crosses into a ring buffer and a worker task updates from it as it lands; with
    accumulation the GPU adds the running sum (`DeviceAccumulator`) and the worker updates from
    the host accumulator.
    """

    device_updatable = True

    def __init__(self, engine, unit: Unit):
        super().__init__(engine, unit)
        self.grad_ev = None       # d2h event: the last copy into the host accumulator

    def before_recompute(self) -> None:
        self.engine.accumulator.prefetch(self)     # accumulation: the running sum comes in meanwhile

    def take_gradient(self, grads: list) -> None:
        engine, unit, plan = self.engine, self.unit, self.engine.backward_plan
        plan.norm.add(_sq_norm, [g for g in grads if g is not None])
        if engine.accumulator.active(unit):                 # accumulation: the GPU adds (accumulate.py)
            done = engine.accumulator.fold(self, grads)
            plan.updating.queue(engine, unit, self._accumulated_update_task, done, engine.hp, engine.norm.slot(unit))
            return
        # late_updates.py: [Why the top layers are updated late]
        late = plan.updating.late_buffer(engine.late)
        if late is None:
            ring_no = engine.grad_ring.claim_next(unit.name)
            buf, free = engine.grad_ring.buffers[ring_no], engine.grad_ring.free[ring_no]
        else:
            buf, free = engine.late.buffers[late], engine.late.free[late]
        # Per-gradient events let the update start on the unit's front while its back is copied
        # (HostStore lays the entries out in order, so copy order is offset order).
        marks = engine.streams.copy_marks()
        norm = plan.norm.slot(unit)
        done = engine.grad_ring.d2h(grads, [x.view(buf) for x in unit.entries],
                                    [x.offset + x.numel for x in unit.entries],
                               marks, norm_dst=norm)
        plan.updating.begin(engine, unit)
        args = (buf[:unit.numel], done, plan.updates, plan.host_norms, engine.hp, marks, norm)
        done = (free,) + plan.updating.signals(unit)
        layer_no = engine.layer_no(unit)
        if late is not None or (layer_no == 0 and plan.holds_layer0):
            engine.late.hold(layer_no, self.layer_task, args, done=done)
        else:
            engine.worker.submit(self.layer_task, *args, done=done)

    def step(self, deferred: DeferredStep) -> None:
        engine = self.engine
        engine.begin_update(self.unit)
        engine.worker.submit(engine.host_updates.deferred_task, self.unit, deferred.hp, deferred.grads_ev,
                             done=(self.unit.updated,))

    # ------------------------------------------------------------- worker side
    def layer_task(self, src, done, update, host_norms, hp, marks=None, norm=None) -> None:
        """Fold the gradient in ring buffer `src` into the accumulator and/or update from it."""
        engine, unit = self.engine, self.unit
        if norm is not None:
            # the running norm is copied before the gradient (GradientRing.d2h)
            engine.host_updates.sync(marks[0][1] if marks else done, f"wait_d2h:{unit.name}")
            engine.host_updates.check_norm(float(norm[0]),
                                           f"a gradient of the layers from the head down to {unit.name}")
        if marks and update and unit.grad is None and not host_norms:
            # The gradient is used as it lands (no accumulator, no norm to take first): each piece
            # of the update waits only for the copies that cover it.
            pending = list(marks)

            def arrived(end: int) -> None:
                while pending and pending[0][0] < end:
                    engine.host_updates.sync(pending.pop(0)[1], f"wait_d2h:{unit.name}")
                if pending:
                    engine.host_updates.sync(pending[0][1], f"wait_d2h:{unit.name}")
            engine.host_updates.update(unit, src, hp, arrived)
            engine.host_updates.sync(done, f"wait_d2h:{unit.name}")
            return
        engine.host_updates.sync(done, f"wait_d2h:{unit.name}")
        engine.host_updates.consume(unit, src, update, host_norms, hp)

    def _accumulated_update_task(self, done, hp, norm=None) -> None:
        """The last micro-batch's update in backward of a layer whose sum the device accumulated."""
        engine, unit = self.engine, self.unit
        engine.host_updates.sync(done, f"wait_d2h:{unit.name}")
        if norm is not None:
            engine.host_updates.check_norm(float(norm[0]),
                                           f"a gradient sum of the layers from the head down to {unit.name}")
        engine.host_updates.update(unit, unit.grad, hp)
        unit.grad_valid = False


class FrozenLayer(LayerPlacement):
    """A layer none of whose own parameters train (the base under LoRA): its weights stream in
    like a host layer's, the backward computes the input's gradient only (and the adapters',
    which stay on the device, `AdapterSet`), and nothing crosses back or is updated."""

    trainable = False

    def leaves(self, ws):
        return list(ws), []

    def take_gradient(self, grads: list) -> None:
        pass

    def step(self, deferred: DeferredStep) -> None:
        pass


class NoUpdate:
    """The update at `optimizer.step()` of an embedding or a head whose unit does not train: none.

    Args:
        unit: the frozen unit.
    """

    def __init__(self, unit: Unit):
        self.unit = unit

    def step(self, deferred: DeferredStep) -> None:
        """Nothing to update."""


class Placements(list):
    """The decoder layers' placements in layer order (`SlideEngine.places`): the one owner that
    assigns them, and the one place that asks which kind a layer's placement is. It also knows
    the embedding's and the head's places (`attach_ends`), so that every unit's update is found
    in one place (`updater_of`), and chooses whether they train (`refresh_ends`).

    Args:
        units: the layer units in layer order.
        make: unit -> its first placement.
    """

    def __init__(self, units: list[Unit], make):
        super().__init__(make(unit) for unit in units)
        self._layer_no = {id(unit): i for i, unit in enumerate(units)}
        self._ends: dict[int, UnitPlacement] = {}
        self._embedding = self._head = None

    def attach_ends(self, embedding: UnitPlacement, head: UnitPlacement) -> None:
        """The embedding's and the head's places (embedding.py, head.py), made once at `slide()`,
        and whether they train (`refresh_ends`)."""
        self._ends = {id(embedding.unit): embedding, id(head.unit): head}
        self._embedding, self._head = embedding, head
        self.refresh_ends()

    def refresh_ends(self) -> None:
        """Whether the embedding and the head train, as their units are now (end_training.py): at
        `slide()`, at the start of every forward and before the resident plan moves the embedding
        (`requires_grad` may change after `slide()`)."""
        choose_training(self._embedding, self._head)

    def updater_of(self, unit: Unit) -> UnitPlacement:
        """What runs unit `unit`'s deferred update: its layer's placement, or the embedding or
        the head while its unit trains (else `NoUpdate`: asked at the step itself)."""
        end = self._ends.get(id(unit))
        if end is None:
            return self.of(unit)
        return end if unit.trainable else NoUpdate(unit)

    def layer_no(self, unit: Unit) -> int:
        """The index of layer unit `unit` in the model."""
        return self._layer_no[id(unit)]

    def of(self, unit: Unit) -> LayerPlacement:
        """The placement of layer unit `unit`."""
        return self[self._layer_no[id(unit)]]

    def assign(self, unit: Unit, place: LayerPlacement) -> None:
        """Give layer unit `unit` another placement (between optimizer steps)."""
        self[self._layer_no[id(unit)]] = place

    # ------------------------------------------------------------- which layers are placed how
    def resident(self) -> list[LayerPlacement]:
        """The placements whose weights are on the device, in layer order."""
        return [place for place in self if place.resident]

    def first_streamed(self) -> LayerPlacement | None:
        """The first placement whose weights stream into a slot, or None."""
        return next((place for place in self if not place.resident), None)

    def any_streamed_trainable(self, count: int) -> bool:
        """Does one of the first `count` layers train with its weights streamed in?"""
        return any(not place.resident and place.trainable for place in self[:count])

    def residency_candidates(self, count: int) -> list[LayerPlacement]:
        """Of the first `count` layers, those the resident plan may move to the device: trainable,
        streamed, with their state in the host store."""
        return [place for place in self[:count] if not place.resident and place.trainable and place.host_state]

    def device_updated(self) -> list[LayerPlacement]:
        """The placements whose update streams through the GPU."""
        return [place for place in self if place.updates_on_device]

    def device_updatable(self, units: list[Unit]) -> list[Unit]:
        """Of `units`, those the device updater may take (plain host layers)."""
        return [unit for unit in units if self.of(unit).device_updatable]

    def trainable_match_units(self) -> bool:
        """Does every placement train exactly when its unit does?"""
        return all(place.trainable == place.unit.trainable for place in self)

    def newly_frozen(self) -> list[LayerPlacement]:
        """The placements that train while their unit no longer does (LoRA froze the base)."""
        return [place for place in self if place.trainable and not place.unit.trainable]
