"""`DiskLayer`: the placement of a decoder layer whose AdamW moments, or master and moments,
live on disk.

It is a `HostLayer` whose record (`disk_record.StateRecord`: the moments, or the whole state, in
the arrays of its optimizer state format) is resident in host memory only around its uses
(`disk_store.DiskStates`): the CPU worker updates it with the same host AdamW, from the same
gradient ring, so training is bit-identical to the host store's (`tests/test_disk_placement.py`,
`tests/test_disk_record.py`).

Note: [When a disk layer's state is in memory] the record is read into a pool buffer for each
use and written back after each update:

- a slot copy (the forward's prefetch a window ahead, or the recompute's reload) of a layer whose
  master is on disk: pinned, read (the master alone unless the copy's backward updates:
  disk_store.py, [Why a copy reads the master alone]), copied into the slot (waiting for the update's finished
  prefix as a host layer does), unpinned; the buffer stays until that copy has completed on the
  device. A layer with only its moments on disk copies its master from the host store, as a
  host layer does, and reads nothing for it;
- an update in backward: pinned by the main thread when the gradient is taken (the read starts
  then, beside the gradient's copy), unpinned by the worker's task once its write is queued;
- a deferred update (clipping, or a step that ends early): pinned by the worker's task itself;
- `state_dict()`, `load_state_dict()`, checkpoints and `save_pretrained` read and write it
  through `HostStore.unit_state` (this layer's module hooks for the first two, where the master
  is on disk; otherwise the parameters are the host masters, as a host layer's).

While it is resident every use shares the one buffer, and one that finds it resident reads
nothing: the update a forward's copy waits for is the one in that buffer. Units not held are
evicted least recently used first, and the records next needed (in the forward the next layers
whose master is on disk, and at its last disk layer the first ones its backward updates; in
backward the previous ones, those whose master is on disk when it does not update; the next of
a deferred update's order) are read ahead into idle buffers, so the disk works while the GPU
and the worker do.
"""
from __future__ import annotations

import contextlib
import weakref

import torch

from .disk_store import DiskStates
from ..engine.placements import DeferredStep, HostLayer
from ..host.store import Unit

__all__ = ["DiskLayer"]


def _relative_names(module: torch.nn.Module, unit: Unit) -> list[tuple[str, object]]:
    """(name inside `module`, entry) of every holder of the unit's parameters in `module`."""
    where = {id(m): n for n, m in module.named_modules(remove_duplicate=False)}
    out = []
    for entry in unit.entries:
        for mod, attr in entry.holders:
            if id(mod) in where:
                out.append((f"{where[id(mod)]}.{attr}" if where[id(mod)] else attr, entry))
    return out


class DiskLayer(HostLayer):
    """Moments, or master and moments, in a file on disk, resident in a pinned buffer around each
    update and each copy of a master on disk (the module's Note); updated by the CPU worker like a
    `HostLayer`.

    Args:
        engine: the SlideEngine.
        unit: the layer's unit (one of `states`).
        states: the disk layers' file, buffers and residency.
        module: the layer's HF module: where the master is on disk, its `state_dict()` reads it
            from there and its `load_state_dict()` writes it there.
    """

    host_state = False
    device_updatable = False

    def __init__(self, engine, unit: Unit, states: DiskStates, module: torch.nn.Module):
        super().__init__(engine, unit)
        self.states = states
        self.record = states.record(unit)
        states.check = engine.worker.check_alive
        states.event = engine.stats.event
        self._hooks = ()
        if not self.record.master:                   # the parameters view the host master
            return
        self._names = _relative_names(module, unit)
        # The module's hooks do not keep the placement alive.
        save_method = weakref.WeakMethod(self._state_dict_hook)
        load_method = weakref.WeakMethod(self._load_state_dict_hook)

        def save_hook(*args):
            method = save_method()
            if method is not None:
                method(*args)

        def load_hook(*args):
            method = load_method()
            if method is not None:
                method(*args)
        self._hooks = (module.register_state_dict_post_hook(save_hook),
                       module.register_load_state_dict_pre_hook(load_hook))

    # ------------------------------------------------------------- weights (main thread)
    def weights(self, busy: tuple = ()):
        self.states.read_ahead(*self._needed_next())  # the schedule is at this layer: what it needs next
        self._copy_in(busy)
        return super().weights(busy)                 # the slot holds it now

    def prefetch(self, busy: tuple = ()) -> None:
        # The window's look-ahead copies alone: a read-ahead from here, a layer beyond the one
        # the schedule is at, would evict that layer's record before its update pins it.
        self._copy_in(busy)

    def _copy_in(self, busy) -> None:
        engine, unit, states = self.engine, self.unit, self.states
        if engine.slots.find((unit,)) is not None:
            return
        if not self.record.master:
            engine.slots.load((unit,), busy)                 # the master is in the host store: a host layer's copy
            return
        # [Why a copy reads the master alone]
        states.pin(unit, whole=engine.in_backward and engine.backward_plan.updates)
        try:
            states.ready(unit)
            engine.slots.load((unit,), busy)                 # waits for the update's finished prefix, as a host layer
        finally:
            states.unpin(unit)                               # the buffer stays until the copy is done (u.readers)

    def _needed_next(self) -> tuple[list, bool]:
        """The disk records the schedule needs next, nearest first, from this layer on, and
        whether whole (for updates) or their masters alone (for copies)."""
        engine, unit, states, depth = self.engine, self.unit, self.states, self.states.read_ahead_count
        if engine.in_backward:                            # this layer (when it updates here), then down
            plan = engine.backward_plan
            return (plan.updating.updated_here([unit]) + states.ahead(unit, -1, depth, masters=not plan.updates),
                    plan.updates)
        if not states.ahead(unit, 1, 1) and engine.live_generation is not None and not engine.config.deferred:
            # the forward's last disk layer: its backward, which updates, starts with it and goes down
            return [unit] + states.ahead(unit, -1, depth - 1), True
        return states.ahead(unit, 1, depth, masters=True), False     # the forward's next copies

    # ------------------------------------------------------------- gradient and update
    def take_gradient(self, grads: list) -> None:
        if not self.engine.backward_plan.updates:
            super().take_gradient(grads)             # only moved into the host accumulator
            return
        self.states.pin(self.unit)                   # the read starts beside the gradient's copy
        try:
            super().take_gradient(grads)             # queues exactly one update task, which unpins
        except BaseException:
            self.states.unpin(self.unit)
            raise

    def step(self, deferred: DeferredStep) -> None:
        engine = self.engine
        engine.begin_update(self.unit)
        engine.worker.submit(self._deferred_task, deferred.hp, deferred.grads_ev, done=(self.unit.updated,))

    # ------------------------------------------------------------- worker side
    @contextlib.contextmanager
    def _updating(self):
        """Around an update of the pinned unit: its read has landed and its previous write is
        done before; its write is queued and its pin released after, even when the update raised
        (the buffer is the state while it is resident)."""
        states, unit = self.states, self.unit
        try:
            states.ready(unit)
            states.before_update(unit)
        except BaseException:
            states.unpin(unit)
            raise
        try:
            yield
        finally:
            try:
                states.write_behind(unit)
            finally:
                states.unpin(unit)

    def layer_task(self, src, done, update, host_norms, hp, marks=None, norm=None) -> None:
        if not update:
            super().layer_task(src, done, update, host_norms, hp, marks, norm)
            return
        with self._updating():
            super().layer_task(src, done, update, host_norms, hp, marks, norm)

    def _accumulated_update_task(self, done, hp, norm=None) -> None:
        with self._updating():
            super()._accumulated_update_task(done, hp, norm)

    def _deferred_task(self, hp, grads_ev) -> None:
        """The update at optimizer.step(); pinned here, on the worker ([Why pinning cannot deadlock])."""
        states, unit = self.states, self.unit
        states.read_ahead([unit] + states.ahead(unit, 1, states.read_ahead_count))
        states.pin(unit)
        with self._updating():
            self.engine.host_updates.deferred_task(unit, hp, grads_ev)

    # ------------------------------------------------------------- the module's state_dict
    def _state_dict_hook(self, module, state_dict, prefix, local_metadata) -> None:
        """`module.state_dict()`: the layer's masters (in their format's dtype), read from disk (copies)."""
        keys = [(prefix + n, e) for n, e in self._names if prefix + n in state_dict]
        if not keys:
            return
        unit = self.unit
        self.engine.clock.wait(unit.updated, "update")
        with self.engine.store.unit_state(unit):
            for key, entry in keys:
                state_dict[key] = entry.view(unit.master).clone()

    def _load_state_dict_hook(self, module, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        """`module.load_state_dict()`: the layer's weights written to disk; the entries become meta
        tensors, so the default copy into the meta parameters is a no-op (shape errors are its)."""
        keys = [(prefix + n, e) for n, e in self._names
                if prefix + n in state_dict and tuple(state_dict[prefix + n].shape) == tuple(e.shape)]
        if not keys:
            return
        unit = self.unit
        self.engine.clock.wait(unit.updated, "update")
        with torch.no_grad(), self.engine.store.unit_state(unit, write=True):
            for key, entry in keys:
                entry.view(unit.master).copy_(state_dict[key])
                state_dict[key] = torch.empty(entry.shape, device="meta")
        unit.version += 1                               # device copies of the old weights are stale
