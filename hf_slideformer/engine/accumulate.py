"""Gradient accumulation on the device: the running sum of a layer's gradient crosses PCIe
instead of being folded in by the CPU.

Note: [Why the GPU adds the micro-batches] folding every micro-batch into the layer's fp32 host
accumulator on the CPU worker (a copy out of the gradient ring for the first micro-batch, an add
for the others, a norm pass for the last one: 24 bytes of host memory traffic per parameter over
two micro-batches) makes the worker, not the GPU, pace the backward (docs/benchmarks.md,
"Measurements behind the engine's notes"). So the first micro-batch's gradient is copied straight
into the (pinned) accumulator, and for each later one the accumulator is brought back in while
the layer is recomputed (4 bytes per parameter of h2d), the new gradient added on the GPU, the
last micro-batch's squared norm taken there, and the sum copied out again (4 bytes of d2h). The
worker only updates. The embedding and the head keep the host path (their gradients are folded
in by their own tasks).
"""
from __future__ import annotations

import logging
import time

import torch

from ..host.memory import GiB
from ..host.optim import sq_norm as _sq_norm

logger = logging.getLogger(__name__)

__all__ = ["DeviceAccumulator"]


class DeviceAccumulator:
    """The device side of gradient accumulation for host-held layers: one fp32 device buffer
    that a layer's running sum is brought into while the layer is recomputed.

    Args:
        engine: the SlideEngine (streams, store, the backward's mode, the step's norm, the gradient ring).
    """

    def __init__(self, engine):
        self.engine = engine
        self.buf: torch.Tensor | None = None      # device fp32: one layer's running sum
        self.unit = None                          # the unit whose sum is being brought into it
        self.ready = None                         # h2d event: it is in
        self.free = None                          # d2h event: the last sum has left it
        self._pinned = False

    def active(self, unit) -> bool:
        """Does the GPU add `u`'s micro-batches (accumulation, a layer with a host accumulator)?"""
        return not self.engine.single_micro and unit.grad is not None and unit.kind == "layer"

    def _pin_accumulators(self) -> None:
        """Pin the layers' host accumulators once (they are read and written by DMA every micro-batch)."""
        if self._pinned:
            return
        self._pinned = True
        engine = self.engine
        slab = getattr(engine.store, "grad_slab", None)
        if slab is None or not engine.pinned.enabled or slab.is_pinned():
            return
        t0 = time.perf_counter()
        engine.pinned.adopt(slab)
        logger.info("gradient accumulation: pinned the %.1f GiB of host accumulators in %.1f s",
                    slab.numel() * 4 / GiB, time.perf_counter() - t0)

    def prefetch(self, place) -> None:
        """Backward of layer `place.unit`, a micro-batch after its first: bring its running sum in
        on the h2d stream while the layer is recomputed."""
        unit = place.unit
        if not self.active(unit) or not unit.grad_valid or self.unit is unit:
            return
        engine = self.engine
        st = engine.streams
        if self.buf is None:
            self.buf = torch.empty(max(x.numel for x in engine.layer_units), dtype=torch.float32, device=engine.device)
        st.wait(self.free, st.h2d)                 # the previous layer's sum has left the buffer
        st.wait(place.grad_ev, st.h2d)             # this layer's last copy out has landed
        with st.on(st.h2d):
            self.buf[:unit.numel].copy_(unit.grad, non_blocking=True)
        self.ready = st.record(st.h2d)
        self.unit = unit
        engine.stats.add_h2d(unit.numel * 4)

    def fold(self, place, grads: list):
        """Fold this micro-batch's gradient of layer `place.unit` into its host accumulator through
        the device; the d2h event after which the accumulator holds the sum."""
        self._pin_accumulators()
        engine, unit = self.engine, place.unit
        st = engine.streams
        # The last micro-batch's running norm lands with the sum (host_tasks: [Why a non-finite
        # gradient stops the host updates after it]).
        sums_norm = engine.backward_plan.sums_norm
        norm = sums_norm.slot(unit)
        if not unit.grad_valid:
            sums_norm.add(lambda: _sq_norm([g for g in grads if g is not None]))
            done = engine.grad_ring.d2h(grads, [x.view(unit.grad) for x in unit.entries], norm_dst=norm)
        else:
            self.prefetch(place)                   # a no-op when the recompute already started it
            st.wait(self.ready)
            acc = self.buf[:unit.numel]
            for entry, grad in zip(unit.entries, grads):
                if grad is not None:
                    entry.view(acc).add_(grad)
            sums_norm.add(lambda: _sq_norm([acc]))
            done = engine.grad_ring.d2h([acc], [unit.grad], norm_dst=norm)
            self.free = done
            self.unit = None
        unit.grad_valid = True
        place.grad_ev = done
        return done

    def reset(self) -> None:
        """Between steps: no sum is in the buffer."""
        self.unit = None

    def drop(self) -> None:
        """The mode changed: give the device buffer back (a plan measures after this)."""
        self.buf = None
        self.unit = None
