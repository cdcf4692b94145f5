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

from .memory import GiB
from .optim import sq_norm as _sq_norm

logger = logging.getLogger(__name__)

__all__ = ["DeviceAccumulation"]


class DeviceAccumulation:
    """Engine-side methods of the device accumulation (a mixin of SlideEngine: they share its state)."""

    def _init_device_accumulation(self) -> None:
        self._acc_buf: torch.Tensor | None = None      # device fp32: one layer's running sum
        self._acc_unit = None                           # the unit whose sum is being brought into it
        self._acc_ready = None                          # h2d event: it is in
        self._acc_free = None                           # d2h event: the last sum has left it
        self._acc_pinned = False

    def _accumulates_on_device(self, u) -> bool:
        return not self.single_micro and u.grad is not None and u.kind == "layer"

    def _pin_accumulators(self) -> None:
        """Pin the layers' host accumulators once (they are read and written by DMA every micro-batch)."""
        if self._acc_pinned:
            return
        self._acc_pinned = True
        slab = getattr(self.store, "grad_slab", None)
        if slab is None or not self.pinned.enabled or slab.is_pinned():
            return
        t0 = time.perf_counter()
        self.pinned.adopt(slab)
        logger.info("gradient accumulation: pinned the %.1f GiB of host accumulators in %.1f s",
                    slab.numel() * 4 / GiB, time.perf_counter() - t0)

    def _prefetch_accumulator(self, u) -> None:
        """Backward of layer `u`, a micro-batch after its first: bring its running sum in on the
        h2d stream while the layer is recomputed."""
        if not self._accumulates_on_device(u) or not u.grad_valid or self._acc_unit is u:
            return
        st = self.streams
        if self._acc_buf is None:
            n = max(x.numel for x in self.layer_units)
            self._acc_buf = torch.empty(n, dtype=torch.float32, device=self.device)
        st.wait(self._acc_free, st.h2d)                   # the previous layer's sum has left the buffer
        st.wait(self._grad_ev.get(u.index), st.h2d)       # this layer's last copy out has landed
        with st.on(st.h2d):
            self._acc_buf[:u.numel].copy_(u.grad, non_blocking=True)
        self._acc_ready = st.record(st.h2d)
        self._acc_unit = u
        self.stats.add_h2d(u.numel * 4)

    def _accumulate(self, u, grads: list):
        """Fold this micro-batch's gradient of layer `u` into its host accumulator through the
        device; the d2h event after which the accumulator holds the sum."""
        self._pin_accumulators()
        st = self.streams
        # The last micro-batch's running norm lands with the sum (HostTasks: [Why a non-finite
        # gradient stops the host updates after it]).
        norm = self._norm_slot(u) if self.mode.ends_step else None
        if not u.grad_valid:
            total = grads
            if norm is not None:
                self.norm_dev += _sq_norm([g for g in total if g is not None])
            done = self._d2h(grads, [e.view(u.grad) for e in u.entries], norm_dst=norm)
        else:
            self._prefetch_accumulator(u)                 # a no-op when layer_backward already did it
            st.wait(self._acc_ready)
            acc = self._acc_buf[:u.numel]
            for e, g in zip(u.entries, grads):
                if g is not None:
                    e.view(acc).add_(g)
            total = [acc]
            if norm is not None:
                self.norm_dev += _sq_norm(total)
            done = self._d2h(total, [u.grad], norm_dst=norm)
            self._acc_free = done
            self._acc_unit = None
        u.grad_valid = True
        self._grad_ev[u.index] = done
        return done

    def _reset_accumulator(self) -> None:
        self._acc_unit = None
