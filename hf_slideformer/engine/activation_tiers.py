"""The layer-input tiers in memory: the interface every tier answers (`ActivationTier`), the
device itself (`DeviceTier`) and pinned host memory (`PinnedCpuTier`); the file tier builds on
the pinned one (activation_file.py). `activations.make_tier` picks one.
"""
from __future__ import annotations

import torch

from ..host.memory import PinnedBuffers
from .transfer import Streams

__all__ = ["ActivationTier", "DeviceTier", "PinnedCpuTier"]


class ActivationTier:
    """Interface: save(layer_no, hidden) in forward; prefetch(layer_no) ahead of use; load(layer_no) -> hidden in
    backward."""

    def __init__(self, streams: Streams, counter=None, pinned: PinnedBuffers | None = None):
        self.streams = streams
        self.count = counter or (lambda kind, n: None)
        self.pinned = pinned or PinnedBuffers(False)
        # Note: [Why the last layer's input stays on the device] backward starts with the layer
        # whose forward ran last, right after the head: its input would leave for the host and come
        # straight back. It stays where it is (B*S*H bf16 of device memory over the head's phase,
        # 0.27 GB at 8B, batch 16), which saves its copies both ways and its host buffer.
        self.keep_index: int | None = None
        self.kept: dict[int, torch.Tensor] = {}
        # Note: [Why the first layer's input can be gathered again] with the embedding resident on
        # the device, x_0 is a gather from its master, which nothing changes before layer 0's
        # backward (its update comes after): the tier keeps the recipe instead of the tensor
        # (`save(0, x, remake=...)`), one more B*S*H of host memory and copies saved. The engine
        # calls `materialize()` before the master leaves the device.
        self.remade: dict = {}

    def save(self, layer_no: int, hidden: torch.Tensor, remake=None) -> None:
        """Keep `hidden`, layer `layer_no`'s input x_i, for backward; `remake` (optional): a function that
        makes x_i again, exactly, on the compute stream (the tier may keep it instead of x_i)."""
        raise NotImplementedError

    def prefetch(self, layer_no: int) -> None:
        pass

    def load(self, layer_no: int) -> torch.Tensor:
        raise NotImplementedError

    def drop(self, layer_no: int) -> None:
        pass

    def clear(self) -> None:
        pass

    def materialize(self) -> None:
        """Save the inputs held as recipes as tensors (what they are made from is about to go)."""

    def close(self) -> None:
        """Release what the tier holds outside memory (files)."""

    def _host_buffer(self, old: torch.Tensor | None, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """`old` when large enough, else a new pinned buffer (the old one is unpinned once idle)."""
        if old is not None and old.numel() >= numel and old.dtype == dtype:
            return old
        if old is not None:
            self.streams.synchronize()   # rare: only when activations grow
            self.pinned.release(old)
        return self.pinned.empty(numel, dtype=dtype)


class DeviceTier(ActivationTier):
    """Keep x_i on the compute device (fastest; costs L * B*S*H elements of device memory)."""

    def __init__(self, streams, counter=None, pinned=None):
        super().__init__(streams, counter, pinned)
        self.saved: dict[int, torch.Tensor] = {}

    def save(self, layer_no, hidden, remake=None):
        self.saved[layer_no] = hidden

    def load(self, layer_no):
        return self.saved[layer_no]

    def drop(self, layer_no):
        self.saved.pop(layer_no, None)

    def clear(self):
        self.saved.clear()


class PinnedCpuTier(ActivationTier):
    """Copy x_i to pinned host memory on the d2h stream; bring it back on the h2d stream.

    Host buffers are allocated once per layer (registered, not rounded up to a power of two) and
    reused while the activation shape allows.
    """

    def __init__(self, streams, counter=None, pinned=None):
        super().__init__(streams, counter, pinned)
        self.host: dict[int, torch.Tensor] = {}
        self.meta: dict[int, tuple] = {}
        self.saved_ev: dict[int, object] = {}
        self.loaded: dict[int, tuple[torch.Tensor, object]] = {}

    def _d2h(self, hidden: torch.Tensor, buf: torch.Tensor):
        st = self.streams
        # Note: [Why the d2h waits for the compute event] x_i is produced on the compute stream.
        st.wait(st.record(), st.d2h)
        with st.on(st.d2h):
            buf.copy_(hidden.reshape(-1), non_blocking=True)
        done = st.record(st.d2h)
        st.hand_over([hidden], done)               # transfer.py: [Why copy sources are handed over, not recorded]
        self.count("act_d2h", hidden.numel() * hidden.element_size())
        return done

    def _h2d(self, layer_no: int, src: torch.Tensor):
        st = self.streams
        shape, dtype = self.meta[layer_no]
        # Note: [Why a loaded input is allocated on the compute stream] the caching allocator keeps
        # a pool per stream: made on the h2d stream, the inputs' memory could serve no other
        # tensor, and memory held apart is what pushes a tight cap into the allocator's
        # free-everything-and-retry path (a device synchronisation). Made on the compute stream,
        # the copy must first wait for the compute work issued so far (it may still read the
        # block's previous tensor): issued one layer ahead, that work ends before the input is needed.
        hidden = torch.empty(shape, dtype=dtype, device=st.device)
        st.wait(st.record(), st.h2d)
        span = st.copy_span_start(st.h2d)
        with st.on(st.h2d):
            hidden.view(-1).copy_(src[:shape.numel()], non_blocking=True)
        st.copy_span_end(span, st.h2d, f"input:layer.{layer_no}")
        self.count("act_h2d", shape.numel() * hidden.element_size())
        return hidden, st.record(st.h2d)

    def _keep(self, layer_no, hidden, remake) -> bool:
        """Held without a host copy: as a recipe, or on the device (the last layer's)."""
        if remake is not None:
            self.remade[layer_no] = remake
        elif layer_no == self.keep_index:
            self.kept[layer_no] = hidden
        else:
            return False
        self.meta[layer_no] = (hidden.shape, hidden.dtype)
        return True

    def save(self, layer_no, hidden, remake=None):
        if self._keep(layer_no, hidden, remake):
            return
        self.host[layer_no] = buf = self._host_buffer(self.host.get(layer_no), hidden.numel(), hidden.dtype)
        self.saved_ev[layer_no] = self._d2h(hidden, buf[:hidden.numel()])
        self.meta[layer_no] = (hidden.shape, hidden.dtype)

    def _on_host(self, layer_no) -> bool:
        """Layer `layer_no`'s input x_i went to the host and is not on its way back yet."""
        return (layer_no in self.meta and layer_no not in self.loaded and layer_no not in self.kept
                and layer_no not in self.remade)

    def prefetch(self, layer_no):
        if not self._on_host(layer_no):
            return
        self.streams.wait(self.saved_ev[layer_no], self.streams.h2d)
        self.loaded[layer_no] = self._h2d(layer_no, self.host[layer_no])

    def _bring(self, layer_no) -> None:
        """Make sure `loaded[layer_no]` holds x_i's device copy and its h2d event."""
        self.prefetch(layer_no)

    def load(self, layer_no):
        if layer_no in self.kept:
            return self.kept[layer_no]            # made on the compute stream: no event to wait for
        if layer_no in self.remade:
            return self.remade[layer_no]()
        self._bring(layer_no)
        hidden, ev = self.loaded.pop(layer_no)
        self.streams.wait(ev)
        return hidden

    def _unload(self, layer_no) -> None:
        """Forget a device copy that was brought back and not used: the compute stream first waits
        for the copy that writes it, so its memory serves no one before the copy has run."""
        hidden, ev = self.loaded.pop(layer_no)
        self.streams.wait(ev)

    def drop(self, layer_no):
        if layer_no in self.loaded:
            self._unload(layer_no)
        self.kept.pop(layer_no, None)
        self.remade.pop(layer_no, None)

    def clear(self):
        for layer_no in list(self.loaded):
            self._unload(layer_no)
        self.kept.clear()
        self.remade.clear()

    def materialize(self):
        for layer_no, remake in list(self.remade.items()):
            del self.remade[layer_no]
            self.save(layer_no, remake())
