"""What a device update's pieces run in (device_update.py): a scheduled update (`Pending`) and the
pieces it is cut into (`pieces_of`), the two sets of device buffers a piece's
master, state and gradient are copied into (`Piece`), their alternation and a piece's copies and
update on the streams (`PieceSets`), and where a piece's gradient comes from: the
layer's pinned host accumulator (`HostGrad`), or, for a layer updated in its backward, the device
tensors read in the unit's flat layout (`EntryGrads`). A source's `copy_into` is queued on the
current stream and returns the bytes it moved host-to-device."""
from __future__ import annotations

import torch

from ..host import optim as _optim
from ..host.host_optim import ADAMW
from ..host.quant_maps import block_at, num_blocks
from ..planner.budget import device_piece

__all__ = ["EntryGrads", "HostGrad", "Pending", "Piece", "PieceSets", "pieces_of"]


def pieces_of(unit, by_group: dict, least: int):
    """The pieces a device update of `unit` runs in (`piece_batches`), of at least `least` elements
    (budget.py: [Why a large layer's pieces are larger])."""
    return _optim.piece_batches(unit, by_group, device_piece(unit.numel, least), span=True)


class Pending:
    """A scheduled device update: the hyper-parameter snapshot, the gradient scale (the clip
    factor's reciprocal) and the events it waits for; `next` counts the pieces done."""

    def __init__(self, hp, scale, ready_ev, grad_ev, clip_done=None, known=None):
        self.hp, self.scale, self.ready_ev, self.grad_ev = hp, scale, ready_ev, grad_ev
        # With accumulation the clip factor comes from the worker's norms (its clip task sets this).
        self.clip_done = clip_done
        # Set once the worker has judged the step's norm: a non-finite one skips the update.
        self.known = known
        self.batches = None
        self.steps = None
        self.prepared = None                    # the steps as the format's update takes them (prepare_steps)
        self.next = 0


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
        """(device view, host view) of the master and each array for [lo, hi) of unit `unit`."""
        b0, b1 = block_at(unit.entries, lo), block_at(unit.entries, hi)
        self.base = (lo, b0)
        out = [(self.master[:hi - lo], unit.master[lo:hi])]
        for array in self.format.arrays:
            start, end = (lo, hi) if array.per == "param" else (b0, b1)
            out.append((self.arrays[array.name][:end - start], getattr(unit, array.name)[start:end]))
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


class PieceSets:
    """The two sets of device buffers (`Piece`) the pieces of device updates alternate between, and
    one piece's run on the streams.

    Args:
        streams: the engine's `Streams` (pieces copy in on h2d, update there, copy back on d2h, unless
            a piece names other lanes).
        stats: the engine's `StepStats` (bytes moved, parameters updated on the GPU).
        device: where the buffers live.
    """

    def __init__(self, streams, stats, device):
        self.streams, self.stats, self.device = streams, stats, device
        self.sets: list[Piece] | None = None
        self.free: list = [None, None]          # the d2h event after each set's last write-back
        self.turn = 0

    def ensure(self, fmt, numel: int, entries: int) -> None:
        """Two sets for pieces of `numel` elements of state format `fmt` (spanning up to `entries`
        parameters' partial blocks); reallocated, after the streams drain, if smaller."""
        if self.sets is None or self.sets[0].numel < numel:
            if self.sets is not None:
                self.streams.synchronize()
            self.sets = [Piece(fmt, numel, entries, self.device) for _ in range(2)]
            self.free = [None, None]

    def drop(self) -> None:
        """Release the buffers (allocated again by the next `ensure`)."""
        self.sets = None
        self.free = [None, None]

    def update(self, unit, lo: int, hi: int, batch, grad, steps, groups, scale=None, dst=None, found_inf=None,
               lanes: tuple | None = None):
        """One piece [lo, hi) of a device update of `unit`: master, gradient and state in on the
        first of `lanes` (the streams' `h2d` and `d2h` unless given; the gradient from `grad`: the
        host accumulator's `HostGrad`, or the device tensors' `EntryGrads`), the format's update
        there (the gradient divided by `scale`, nothing where `found_inf` is nonzero), the new
        weights cast into `dst` if given, master and state back on the second (`unit.host_write`
        then records it)."""
        st, numel = self.streams, hi - lo
        into, back = lanes if lanes is not None else (st.h2d, st.d2h)
        turn = self.turn
        self.turn ^= 1
        # Note: [Why a piece waits for the write-back two pieces earlier] the two sets of device
        # buffers alternate: set `turn` is overwritten once its last write-back has read it.
        st.wait(self.free[turn], into)
        piece = self.sets[turn]
        pairs = piece.pairs(unit, lo, hi)              # (device view, host view) of the master and arrays
        grad_dev = piece.grad[:numel]
        with st.on(into):
            grad_bytes = grad.copy_into(grad_dev, lo, hi)
            for dev, host in pairs:
                dev.copy_(host, non_blocking=True)
            piece.update(unit, batch, lo, grad_dev, steps, groups, scale, found_inf)
            if dst is not None:
                dst[lo:hi].copy_(pairs[0][0])       # the new weights, cast on the device
        st.wait(st.record(into), back)
        with st.on(back):
            for dev, host in pairs:
                host.copy_(dev, non_blocking=True)
        self.free[turn] = unit.host_write = st.record(back)
        moved = sum(dev.numel() * dev.element_size() for dev, _ in pairs)
        self.stats.add_h2d(moved + grad_bytes)
        self.stats.add_bytes("d2h", moved)
        self.stats.gpu_adam_params += numel


class EntryGrads:
    """A layer's gradients still on the device, one per entry (None where unused), read as the
    unit's flat layout."""

    def __init__(self, unit, grads: list):
        self.unit, self.grads = unit, grads

    def copy_into(self, out: torch.Tensor, lo: int, hi: int) -> int:
        """out[:hi - lo] = the flat gradient [lo, hi), widened to out's dtype (zeros where unused); 0
        bytes crossed."""
        for entry, grad in zip(self.unit.entries, self.grads):
            start, end = max(lo, entry.offset), min(hi, entry.offset + entry.numel)
            if start >= end:
                continue
            if grad is None:
                out[start - lo:end - lo].zero_()
            else:
                out[start - lo:end - lo].copy_(grad.reshape(-1)[start - entry.offset:end - entry.offset])
        return 0


class HostGrad:
    """A layer's gradient in its pinned host accumulator (flat, the unit's layout)."""

    def __init__(self, grad: torch.Tensor):
        self.grad = grad

    def copy_into(self, out: torch.Tensor, lo: int, hi: int) -> int:
        """out[:hi - lo] = grad[lo:hi], copied in; the bytes that crossed."""
        out.copy_(self.grad[lo:hi], non_blocking=True)
        return (hi - lo) * self.grad.element_size()
