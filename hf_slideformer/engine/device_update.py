"""Updates on the device of a share of the host-held layers, beside the CPU worker: with clipping
as they are copied in for the next forward, without it in the backward.

Note: [Why part of the clipping-mode update runs on the GPU] the clip factor needs the global
gradient norm, known only when the backward ends, so with clipping no host update can overlap
the backward: the CPU AdamW of every host layer runs after it and paces the next forward
(the CPU's time per layer is several times the GPU's; docs/benchmarks.md). Meanwhile the PCIe link and the GPU are mostly idle. A device layer's
update is streamed through the GPU instead: its fp32 master, moments and gradient go in
(16 bytes per parameter), torch's fused CUDA AdamW updates them, the new weights are cast
straight into the layer's slot, and master and moments go back to the host store (12 bytes per
parameter, on the other copy engine); under a compact state format the layer's master, codes and
block scales go in and back instead, and its update is the format's in torch ops (adam8_torch.py).
The CPU updates the other layers meanwhile, 4 bytes per parameter of h2d each. With the CPU's rate r and the link's B (both ways at once), a share

    f = (B - 4 r) / (B + 12 r)

of the layers makes the two finish together (`budget.balanced_share`, from the rates
`budget.PCIE_BOTH_WAYS` and `budget.CPU_ADAMW_RATE`: about 0.32 on the H200 host).

The device layers are picked once, at the first step with a share, spread evenly over the layers the
GPU does not keep resident; their host moments and gradient accumulator move to pinned buffers
(page-locked, as the masters already are), and their gradients are copied straight into the
accumulator by the backward (with accumulation the worker folds every micro-batch in, as for the
other layers, and the update waits for the worker's clip factor). The update runs in pieces cut like the CPU worker's (power-of-two
multiples from each parameter's start), so on the CPU device the results are bit-identical to
the host path's; on CUDA they are torch's fused CUDA AdamW's, as for resident units.

While an update is pending (`DeviceUpdateLayer.pending`, from `optimizer.step()` until the unit
is next copied in) the host store holds the previous step's state for that unit: everything that
reads the host state flushes pending updates first (`engine.synchronize()`, making a unit
resident, changing the clipping mode).

Note: [Why a layer may be updated on the GPU without clipping] without clipping and with one
backward per step the host updates overlap the backward, so they bound the step only when the
CPU's AdamW of every host layer takes longer than the GPU's step (a compact state format's
update is compute-bound on the CPU; a large model under a small cap updates many parameters per
token). A numeric `device_update_share` then takes that share of the layers off the CPU: a device
layer's update runs in its own backward, as soon as its gradients are computed, from the
gradients still on the device (`EntryGrads`): its master and state go in on a stream of the
updates' own (`update_h2d`), the format's update runs there, and they go back on `update_d2h`
([Why an update in the backward has streams of its own]), so no gradient crosses to the
host and no host accumulator is needed; the next forward's slot copy waits for the write-back
(`unit.host_write`). Per parameter that moves the state's bytes each way (4 under
`adamw_8bit_bf16`, 12 under fp32 AdamW) instead of a gradient out. The skip of a non-finite step
is decided on the device from the running norm (`StepNorm.found_inf`), as the worker decides it
for its layers from the same norm; the host step counters advance when the update is queued and
are taken back if the device skipped it, read once the flag has reached the host (`settle`,
before the next update of the layer and before any reader of the host state).
"""
from __future__ import annotations

import logging
import time

import torch

from ..host import optim as _optim
from ..planner.budget import DEVICE_PIECE, balanced_share, device_piece, pick_device_units
from ..host.host_optim import ADAMW
from .device_pieces import EntryGrads, HostGrad, PieceSets, Pending, pieces_of
from ..host.memory import release_pages
from .placements import DeferredStep, HostLayer

logger = logging.getLogger(__name__)

__all__ = ["DeviceUpdateLayer", "DeviceUpdater", "balanced_share", "pick_device_units", "DEVICE_PIECE"]

class DeviceUpdateLayer(HostLayer):
    """A host-held layer whose update is streamed through the GPU: with clipping as the layer is
    copied in for the next forward, without it (one backward per step) in its backward (the
    module notes). With accumulation it is a `HostLayer` until the update: the worker folds its
    micro-batches in."""

    device_updatable = False
    updates_on_device = True

    def __init__(self, engine, unit):
        super().__init__(engine, unit)
        self.pending: Pending | None = None    # the update `step` scheduled, run by the next `fill`
        # An update in backward whose skip flag (found_inf) is still on its way to the host: the
        # entries whose counters it advanced and the event after the flag's copy (`settle`).
        self.unsettled: tuple[list[int], object] | None = None
        self.skip_flag: torch.Tensor | None = None

    def take_gradient(self, grads: list) -> None:
        # step_shape.py: with accumulation the worker folds it in, as a host layer's
        self.engine.step_shape.device_layer_gradient(self, grads)

    def fold_gradient(self, grads: list) -> None:
        """With accumulation: the gradient is a host layer's (`HostLayer.take_gradient`)."""
        super().take_gradient(grads)

    def take_step_gradient(self, grads: list) -> None:
        """One backward per step: the gradient's norm joins the running norm; the update runs now
        without clipping ([Why a layer may be updated on the GPU without clipping]), else at the
        next copy in, from the pinned accumulator the gradient goes straight into."""
        engine, unit, plan = self.engine, self.unit, self.engine.backward_plan
        plan.norm.add(_optim.sq_norm, [g for g in grads if g is not None])
        if self.pending is not None:            # never the case in a well-formed step: a guard
            engine.device_updates.flush(unit)
        plan.updating.update_or_keep(lambda: self._update_in_backward(grads), lambda: self._keep_for_step(grads))

    def _update_in_backward(self, grads: list) -> None:
        """The backward updates: the layer's update streamed through the GPU now, from `grads`."""
        engine, unit = self.engine, self.unit
        engine.begin_update(unit)
        engine.device_updates.update_now(self, grads, engine.hp, engine.norm.found_inf())
        unit.updated.set()

    def _keep_for_step(self, grads: list) -> None:
        """The gradient crosses into the unit's pinned accumulator, for the update at the next copy in."""
        unit = self.unit
        self.grad_ev = self.engine.grad_ring.d2h(grads, [x.view(unit.grad) for x in unit.entries])
        unit.grad_valid = True

    def step(self, deferred: DeferredStep) -> None:
        """The update runs when the unit is next copied in (`fill`)."""
        engine, unit = self.engine, self.unit
        engine.begin_update(unit)
        self.pending = Pending(deferred.hp, deferred.scale, deferred.ready, self.grad_ev, deferred.clip_done,
                                    deferred.known)
        self.grad_ev = None
        unit.updated.set()                          # readers of the host state flush it (see the module note)

    def fill(self, dst):
        """The pending update writing the new weights into `dst` one piece per step, or None."""
        engine = self.engine
        if self.pending is None or engine.device_updates.skipped(self):
            return None
        return engine.device_updates.run(self, dst)


class DeviceUpdater:
    """The device updates of one engine: which layers are updated on the GPU (`DeviceUpdateLayer`
    placements), the device buffers their pieces run in (`PieceSets`), and the pending updates'
    runs.

    Args:
        engine: the SlideEngine (streams, config, places, worker, the optimizer and the resident plan).
    """

    def __init__(self, engine):
        self.engine = engine
        self._chosen = False
        self.pieces = PieceSets(engine.streams, engine.stats, engine.device)

    @property
    def units(self) -> set[int]:
        """Unit.index of the device-updated layers."""
        return {place.unit.index for place in self.engine.places.device_updated()}

    @property
    def on(self) -> bool:
        """Are some layers updated on the device at optimizer.step() (with clipping; without it
        they are updated in the backward and the step has nothing of theirs to do)?"""
        return (bool(self.engine.places.device_updated())
                and self.engine.config.max_grad_norm is not None)

    def _ensure_sets(self, numel: int) -> None:
        """Device buffers for pieces of up to `numel` elements of the layers' state format."""
        engine = self.engine
        fmt = engine.layer_units[0].state_format or ADAMW
        entries = max(len(u.entries) for u in engine.layer_units)
        self.pieces.ensure(fmt, min(2 * device_piece(numel, DEVICE_PIECE), numel), entries)

    def share(self) -> float:
        """The share of the host-held layers to update on the device (the config's, or balanced)."""
        engine = self.engine
        config = engine.config
        if config.max_grad_norm is None:
            # Without clipping only a share given as a number, with one backward per step: the
            # updates then run in the backward, and pay only where the CPU's bound the step.
            if config.device_update_share == "auto" or engine.dp is not None:
                return 0.0
            return engine.step_shape.share_in_backward(float(config.device_update_share))   # step_shape.py
        if config.device_update_share == "auto":
            # 0.0 unless the copies are DMA from pinned memory (Streams.balanced_update_share)
            return engine.streams.balanced_update_share(engine.pinned)
        return float(config.device_update_share)

    def held_gradient_bytes(self) -> int:
        """Device memory a share updated in the backward holds beyond a step without it: one layer's
        gradients, kept a layer longer ([Why an update in the backward has streams of its own])."""
        engine = self.engine
        if engine.config.max_grad_norm is not None or self.share() <= 0:
            return 0
        return max(u.numel for u in engine.layer_units) * engine.dtype.itemsize

    def prepare(self) -> None:
        """At the first step with a share: allocate the device buffers, plan the resident units (the
        device layers are picked among the others), pick the layers and pin their host state."""
        engine = self.engine
        if self._chosen or engine.optimizer is None:
            return
        share = self.share()
        if share <= 0:
            return
        self._chosen = True
        engine.worker.join()                  # the backward's gradient copies into the accumulators have landed
        self._ensure_sets(max(u.numel for u in engine.layer_units))
        first = engine.residents.target()[1]
        chosen = pick_device_units(engine.places.device_updatable(engine.layer_units[first:]), share)
        if not chosen:
            self.pieces.drop()
            return
        t0 = time.perf_counter()
        self._pin_units(chosen)
        for unit in chosen:
            engine.set_place(unit, DeviceUpdateLayer(engine, unit))
        logger.info("%d of %d layers updated on the device (share %.2f); pinning their host state took "
                    "%.1f s", len(chosen), len(engine.layer_units), share, time.perf_counter() - t0)

    def _pin_units(self, units: list) -> None:
        """Move the moments and gradient accumulator of `units` into pinned buffers of their own
        (the masters are pinned already); the pageable pages they leave are given back.

        Note: [Why the state moves instead of being pinned in place] registering the pages of a
        unit's range inside the shared slab also registers the boundary pages it shares with its
        neighbours, and a copy of a neighbour's range that is then partly pinned and partly
        pageable fails (cudaErrorInvalidValue, seen when a neighbouring layer was made resident).
        """
        engine = self.engine
        opt_state = engine.optimizer.state if engine.optimizer is not None else {}
        for unit in units:
            fmt = unit.state_format or ADAMW
            for attr in [a.name for a in fmt.arrays] + ["grad"]:
                old = getattr(unit, attr)
                if old is None or (engine.pinned.enabled and old.is_pinned()):  # pinned: the accumulators
                    continue                                             # with accumulation (accumulate.py)
                new = engine.pinned.empty(old.numel(), dtype=old.dtype)
                new.copy_(old)
                setattr(unit, attr, new)
                release_pages(old)
            for index, entry in enumerate(unit.entries):
                st = opt_state.get(entry.param)
                if st is not None:                       # the optimizer's state views the new buffers
                    st.update(fmt.entry_state(unit, index))

    def reset(self) -> None:
        """Flush and forget the device layers (the clipping or accumulation mode changed; picked again at
        the next step)."""
        engine = self.engine
        self.flush()
        engine.streams.synchronize()
        for place in engine.places.device_updated():
            engine.set_place(place.unit, HostLayer(engine, place.unit))
        self._chosen = False
        self.pieces.drop()

    def pending(self) -> list[tuple]:
        """(unit, pieces done) of each device-updated layer whose update waits for its next copy in."""
        return [(place.unit, place.pending.next) for place in self.engine.places.device_updated()
                if place.pending is not None]

    def drop_pending(self) -> None:
        """Forget the pending updates without running them (the engine closes)."""
        for place in self.engine.places.device_updated():
            place.pending = None

    def skipped(self, place: DeviceUpdateLayer) -> bool:
        """Drop the pending device update of `place` when the worker found the step's norm not
        finite (host_tasks: [Why a non-finite gradient stops the host updates after it]); the slot
        then copies the unchanged master."""
        pending = place.pending
        if pending.batches is not None or pending.known is None:
            return False
        engine = self.engine
        engine.clock.wait(pending.known, "update")
        if not engine.host_updates.poisoned:
            return False
        place.pending = None
        place.unit.grad_valid = False
        return True

    def flush(self, unit=None) -> None:
        """Run the pending device updates (of layer unit `unit`, else all) without a slot, and
        settle the step counters of the updates that ran in backward."""
        for place in self.engine.places.device_updated():
            if unit is not None and place.unit is not unit:
                continue
            if place.pending is not None and not self.skipped(place):
                for _ in self.run(place, None):
                    pass
            self.settle(place)

    def update_now(self, place: DeviceUpdateLayer, grads: list, hp, found_inf) -> None:
        """The update of `place` in the backward (no clipping, one backward per step): its state
        streamed through the GPU piece by piece and updated from `grads`, its gradients still on the
        device (entry order, None where unused); nothing where `found_inf` is nonzero."""
        engine, unit, st = self.engine, place.unit, self.engine.streams
        issued = time.perf_counter()
        self.settle(place)
        # On the CPU the skip is decided on the host: nothing changes, counters included; on CUDA
        # the device decides it from `found_inf`.
        skip_now, found_inf = st.skip_on_host(found_inf)
        if skip_now:
            return
        groups, group_of = hp
        by_group, advanced, steps = self._advance_steps(unit, group_of)
        self._ensure_sets(unit.numel)
        # Note: [Why an update in the backward has streams of its own] an update is as long as a
        # layer's backward. On h2d / d2h the next layers' weights and the host layers' gradients
        # queued behind it, and the compute stream waited for it at the next hand-over (the GPU
        # then idles beside each device layer: docs/host_state.md). On streams of its own it
        # shares the link, not the queues; its gradients are held two hand-overs (one layer's
        # gradients of device memory, `held_gradient_bytes`).
        into, back = lanes = (st.update_h2d, st.update_d2h)
        st.wait(st.record(), into)              # the gradients and the flag are made on the compute stream
        for ev in unit.readers:                 # the h2d copies of the old master that the write-backs follow
            st.wait(ev, into)
        unit.readers = []
        st.wait(unit.host_write, into)
        span = st.copy_span_start(into)
        with st.on(into):            # what every piece of an entry shares, made once
            steps = (unit.state_format or ADAMW).prepare_steps(groups, by_group, unit, steps, None, engine.device)
        source = EntryGrads(unit, grads)
        for lo, hi, batch in pieces_of(unit, by_group, DEVICE_PIECE):
            if hi > lo:
                self.pieces.update(unit, lo, hi, batch, source, steps, groups, found_inf=found_inf, lanes=lanes)
        st.copy_span_end(span, back, f"update:{unit.name}")     # from its first copy in to its last write-back
        if found_inf is not None:
            if place.skip_flag is None:
                place.skip_flag = engine.pinned.empty(1, dtype=torch.float32)
            # After the last piece's update: the gradients' and the flag's last reader, so one
            # event hands them over (transfer.py: [Why copy sources are handed over, not
            # recorded]) without the compute stream waiting for the write-backs.
            with st.on(into):
                place.skip_flag.copy_(found_inf.reshape(1), non_blocking=True)
            place.unsettled = (advanced, st.record(into))
            st.hand_over([found_inf] + [g for g in grads if g is not None], place.unsettled[1], hold=2)
        engine.stats.event("device_update", issued, time.perf_counter())     # the main thread's time issuing it

    def _advance_steps(self, unit, group_of: dict) -> tuple[dict, list[int], list]:
        """Advance the host step counters of `unit`'s entries in the optimizer's groups (the host
        counters are the state: the optimizer's state_dict reads them). Returns the entries by
        group, the advanced entries, and the counters (the format's `prepare_steps` makes them what
        the update reads)."""
        by_group = _optim.groups_of(unit, group_of)
        advanced = [k for ks in by_group.values() for k in ks]
        torch._foreach_add_([unit.steps[k] for k in advanced], 1)
        return by_group, advanced, unit.steps

    def settle(self, place: DeviceUpdateLayer) -> None:
        """The host step counters of `place`'s last update in backward: taken back if the device
        skipped it (its gradients' running norm was not finite)."""
        if place.unsettled is None:
            return
        advanced, ev = place.unsettled
        place.unsettled = None
        ev.synchronize()
        if float(place.skip_flag[0]):
            torch._foreach_sub_([place.unit.steps[k] for k in advanced], 1)

    def run(self, place: DeviceUpdateLayer, dst):
        """The pending update of `place`, one piece per step; the new weights cast into `dst` if given."""
        engine, unit = self.engine, place.unit
        pending = place.pending
        st = engine.streams
        groups, group_of = pending.hp
        if pending.batches is None:
            if pending.clip_done is not None:
                # The worker has folded every micro-batch in and taken the norm: the factor is known.
                engine.clock.wait(pending.clip_done, "update")
                with st.on(st.h2d):
                    pending.scale = _optim.grad_scale(engine.host_updates.clip_coef, engine.device)
            # This update consumes the accumulator: the next backward overwrites it (the worker is
            # done with it, see above; with one backward per step it never touches it).
            unit.grad_valid = False
            by_group, _, pending.steps = self._advance_steps(unit, group_of)
            pending.batches = list(pieces_of(unit, by_group, DEVICE_PIECE))
        # Earlier h2d reads of the old master are ahead of these copies on the h2d stream, and the
        # write-backs wait for these copies: stream order covers the readers.
        unit.readers = []
        for ev in (pending.ready_ev, pending.grad_ev, unit.host_write):
            st.wait(ev, st.h2d)
        if dst is not None and pending.next:
            # Resumed after an error stopped an earlier fill half way (its slot was dropped): the
            # pieces done then are final in the host store; copy them into this slot.
            done = pending.batches[pending.next][0] if pending.next < len(pending.batches) else unit.numel
            with st.on(st.h2d):
                dst[:done].copy_(unit.master[:done].to(engine.device, non_blocking=True))
        st.used_by(pending.scale, st.h2d)
        if pending.prepared is None:
            with st.on(st.h2d):      # after the waits: the scale is the clip factor's, made on another stream
                pending.prepared = (unit.state_format or ADAMW).prepare_steps(
                    groups, _optim.groups_of(unit, group_of), unit, pending.steps, pending.scale, engine.device)
        while pending.next < len(pending.batches):
            lo, hi, batch = pending.batches[pending.next]
            numel = hi - lo
            if numel:
                self.pieces.update(unit, lo, hi, batch, HostGrad(unit.grad), pending.prepared, groups,
                                   scale=pending.scale, dst=dst)
            pending.next += 1
            yield
        place.pending = None
