"""The device copies of a resident unit's optimizer state, in the unit's state format.

A resident unit (resident.py) keeps on the GPU what its host store keeps: the master and the
arrays its `StateFormat` declares (fp32 moments for `adamw`; 8-bit codes and fp32 block scales
for the compact formats, so their GPU bytes per parameter are the host's), its step counters and
its weights in the compute dtype (the master itself where that is the master's dtype). Its
update there is the format's (`StateFormat.run` with no host kernel: torch's fused CUDA AdamW for
fp32, adam8_torch.py for the compact ones).
"""
from __future__ import annotations

import torch

from ..host.host_optim import ADAMW
from ..host.store import Unit

__all__ = ["ResidentState", "resident_bytes_per_param_of"]


def resident_bytes_per_param_of(fmt, dtype: torch.dtype) -> float:
    """GPU bytes per parameter of a unit resident in format `fmt`: its master and arrays, and the
    weights in `dtype` unless the master is in it."""
    fmt = fmt or ADAMW
    return fmt.bytes_per_param + (dtype.itemsize if dtype != fmt.master_dtype else 0)


class ResidentState:
    """Device copies of one unit's master, format arrays, step counters and compute weights."""

    def __init__(self, unit: Unit, dtype: torch.dtype, device: torch.device, with_grad: bool = False):
        self.unit = unit
        self.format = fmt = unit.state_format or ADAMW
        self.master = torch.empty(unit.numel, dtype=fmt.master_dtype, device=device)
        for array, size in zip(fmt.arrays, fmt.sizes(unit).values()):
            setattr(self, array.name, torch.empty(size, dtype=array.dtype, device=device))
        self.weights = torch.empty(unit.numel, dtype=dtype, device=device) if dtype != self.master.dtype else self.master
        self.steps = [torch.zeros((), dtype=torch.float32, device=device) for _ in unit.entries]
        # The step's gradient, kept until optimizer.step() when it clips, or summed over the
        # micro-batches with accumulation (layers in-backward with one backward share one).
        self.grad = torch.empty(unit.numel, dtype=torch.float32, device=device) if with_grad else None
        self.grad_valid = False           # with accumulation: `grad` holds this step's running sum

    def _pairs(self):
        """(device tensor, host tensor) of the master, the format's arrays and each step counter."""
        unit = self.unit
        return [(getattr(self, k), t) for k, t in self.format.tensors(unit).items()] + list(zip(self.steps, unit.steps))

    def tensors(self) -> list[torch.Tensor]:
        """The device tensors this state holds (each once)."""
        ts = [getattr(self, k) for k in self.format.tensors(self.unit)] + [self.grad]
        return ts + ([self.weights] if self.weights is not self.master else [])

    def load_from_host(self) -> None:
        for dev, host in self._pairs():
            dev.copy_(host)
        if self.weights is not self.master:
            self.weights.copy_(self.master)

    def store_to_host(self) -> None:
        """Write the arrays, counters and master back (the caller has synchronized the device)."""
        for dev, host in self._pairs():
            host.copy_(dev)

    def release_host(self, release_pages) -> None:
        """Give back the host pages of the arrays (not read until `store_to_host` writes them)."""
        for array in self.format.arrays:
            release_pages(getattr(self.unit, array.name))

    def views(self) -> list[torch.Tensor]:
        return self.unit.views(self.weights)
