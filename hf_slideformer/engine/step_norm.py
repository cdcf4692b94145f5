"""The step's gradient norm: where it is taken, where it lands, and the clip factor from it.

With one backward per step the norm is summed on the GPU as the gradients are made (`dev`), for
free; with accumulation the worker takes each unit's summed gradient's norm on the host
(`HostUpdates.norm_sq`) and the device adds the layers' part (`dev_valid`).

Note: [Why each host task reads the running norm] with one backward per step the norm of the
gradients so far is on the GPU; a copy of it lands beside each gradient the worker updates from
(`slot(u)`: one pinned scalar per unit), so a non-finite gradient stops the host updates that
follow it without a host sync.
"""
from __future__ import annotations

import torch

from ..host.optim import grad_scale

__all__ = ["StepNorm"]


class StepNorm:
    """The running squared gradient norm of a step and its pinned copies.

    Args:
        engine: the SlideEngine (config, streams, the units, the worker's norms).

    Attributes:
        dev: () fp32 on the device: the squared norm of this backward's gradients so far (one
            backward per step), or of the layers' summed gradients (accumulation, `dev_valid`).
        host_sq: (1,) pinned: `dev` copied for the worker's clip task.
        dev_valid: with accumulation, `dev` holds the layers' part of this step's norm.
    """

    def __init__(self, engine):
        self.engine = engine
        pin = engine.config.pin_memory and engine.config.is_cuda
        self.dev = torch.zeros((), dtype=torch.float32, device=engine.device)
        self.host_sq = torch.zeros(1, dtype=torch.float32, pin_memory=pin)
        self.dev_valid = False
        self._snap = torch.zeros(len(engine.store.units), dtype=torch.float32, pin_memory=pin)
        self._snap_of = {id(u): k for k, u in enumerate(engine.store.units)}
        self._steps = torch.zeros(4, dtype=torch.float32, pin_memory=pin)

    def slot(self, unit) -> torch.Tensor:
        """The pinned scalar that receives the running norm with `unit`'s gradient. Written again only
        by `unit`'s next backward, which follows its update (the forward in between waits for it)."""
        index = self._snap_of[id(unit)]
        return self._snap[index:index + 1]

    def step_slot(self, step_no: int) -> torch.Tensor:
        """A pinned scalar for the whole norm of step `step_no` (one per step in flight)."""
        index = step_no % self._steps.numel()
        return self._steps[index:index + 1]

    def copy(self, dst: torch.Tensor):
        """`dev` into the pinned scalar `dst`, without a host sync; the compute event after it."""
        st = self.engine.streams
        st.copy_unsynced(dst, self.dev.reshape(1))
        return st.record()

    def found_inf(self) -> torch.Tensor:
        """1.0 on the device where the running norm of this backward's gradients is not finite
        (the device updates' skip flag, decided without a host sync), else 0.0."""
        return (~torch.isfinite(self.dev)).to(torch.float32)

    def clip_coef(self):
        """The clip factor from the GPU-side norm of a one-backward step (`Streams.clip_coef`): on CUDA
        a device scalar (no sync, torch's clip_grad_norm_ arithmetic), on the CPU a float with the
        host tasks' own arithmetic (see HostUpdates.clip_task), so that the results are identical
        there."""
        engine = self.engine
        return engine.streams.clip_coef(engine.config.max_grad_norm, self.dev)

    def grad_scale(self):
        """The clip factor's reciprocal for the device updates (the fused kernel's grad_scale), and
        the compute-stream event after which it is valid."""
        engine = self.engine
        return grad_scale(self.clip_coef(), engine.device), engine.streams.record()

    def last(self) -> float:
        """The L2 norm of the last step's gradients (before clipping): where it is depends on the
        step's shape (step_shape.py)."""
        return self.engine.step_shape.last_norm(self)

    def running_last(self) -> float:
        """`last` with one backward per step: on the GPU, no need to wait for the CPU updates."""
        self.engine.worker.raise_if_failed()
        return float(self.dev) ** 0.5

    def summed_last(self) -> float:
        """`last` with accumulation: the worker's norms of the sums, and the device's part."""
        engine = self.engine
        engine.worker.join()
        norm_sq = engine.host_updates.norm_sq
        if not norm_sq and not self.dev_valid:
            return float("nan")
        return (sum(norm_sq) + (float(self.dev) if self.dev_valid else 0.0)) ** 0.5
