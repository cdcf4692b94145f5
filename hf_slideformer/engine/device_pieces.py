"""What a device update's pieces run in (device_update.py): the two sets of device buffers a piece's
master, state and gradient are copied into (`Piece`), and where a piece's gradient comes from: the
layer's pinned host accumulator (`HostGrad`), or, for a layer updated in its backward, the device
tensors read in the unit's flat layout (`EntryGrads`). A source's `copy_into` is queued on the
current stream and returns the bytes it moved host-to-device."""
from __future__ import annotations

import torch

from ..host import optim as _optim
from ..host.host_optim import ADAMW
from ..host.quant_maps import block_at, num_blocks

__all__ = ["EntryGrads", "HostGrad", "Piece"]


class Piece:
    """One set of device buffers of a piece update: the gradient (fp32) and the state format's
    master and arrays for up to `numel` elements (a block array: their blocks, a piece spanning up
    to `entries` parameters' partial blocks)."""

    def __init__(self, fmt, numel: int, entries: int, device):
        self.format, self.numel = fmt, numel
        self.grad = torch.empty(numel, dtype=torch.float32, device=device)
        self.master = torch.empty(numel, dtype=fmt.master_dtype, device=device)
        blocks = num_blocks(numel) + entries
        self.arrays = {a.name: torch.empty(numel if a.per == "param" else blocks, dtype=a.dtype, device=device)
                       for a in fmt.arrays}
        self.base = (0, 0)

    def pairs(self, unit, lo: int, hi: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(device view, host view) of the master and each array for [lo, hi) of unit `u`."""
        b0, b1 = block_at(unit.entries, lo), block_at(unit.entries, hi)
        self.base = (lo, b0)
        out = [(self.master[:hi - lo], unit.master[lo:hi])]
        for a in self.format.arrays:
            i, j = (lo, hi) if a.per == "param" else (b0, b1)
            out.append((self.arrays[a.name][:j - i], getattr(unit, a.name)[i:j]))
        return out

    def __getattr__(self, name):                   # the format's arrays, as `StateFormat.run` reads them
        arrays = self.__dict__.get("arrays", {})
        if name in arrays:
            return arrays[name]
        raise AttributeError(name)

    def update(self, unit, batch: dict, lo: int, grad, steps, groups: list[dict], scale, found_inf=None) -> None:
        """The format's update of one `piece_batches` batch starting at `lo` (after `pairs`)."""
        if self.format is ADAMW:
            _optim.apply_batch(batch, lo, self.master, grad, self.arrays["exp_avg"], self.arrays["exp_avg_sq"],
                               steps, groups, scale, found_inf)
            return
        for gi, ranges in batch.items():
            self.format.run(None, groups[gi], unit, self, ranges, [grad[a - lo:b - lo] for _, a, b in ranges],
                            [steps[k] for k, _, _ in ranges], scale, found_inf=found_inf)


class EntryGrads:
    """A layer's gradients still on the device, one per entry (None where unused), read as the
    unit's flat layout."""

    def __init__(self, unit, grads: list):
        self.unit, self.grads = unit, grads

    def copy_into(self, out: torch.Tensor, lo: int, hi: int) -> int:
        """out[:hi - lo] = the flat gradient [lo, hi), widened to out's dtype (zeros where unused); 0
        bytes crossed."""
        for entry, g in zip(self.unit.entries, self.grads):
            a, b = max(lo, entry.offset), min(hi, entry.offset + entry.numel)
            if a >= b:
                continue
            if g is None:
                out[a - lo:b - lo].zero_()
            else:
                out[a - lo:b - lo].copy_(g.reshape(-1)[a - entry.offset:b - entry.offset])
        return 0


class HostGrad:
    """A layer's gradient in its pinned host accumulator (flat, the unit's layout)."""

    def __init__(self, grad: torch.Tensor):
        self.grad = grad

    def copy_into(self, out: torch.Tensor, lo: int, hi: int) -> int:
        """out[:hi - lo] = grad[lo:hi], copied in; the bytes that crossed."""
        out.copy_(self.grad[lo:hi], non_blocking=True)
        return (hi - lo) * self.grad.element_size()
