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
    """Interface: save(i, x) in forward; prefetch(i) ahead of use; load(i) -> x in backward."""

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

    def save(self, i: int, x: torch.Tensor, remake=None) -> None:
        """Keep x_i for backward; `remake` (optional): a function that makes x_i again, exactly,
        on the compute stream (the tier may keep it instead of x_i)."""
        raise NotImplementedError

    def prefetch(self, i: int) -> None:
        pass

    def load(self, i: int) -> torch.Tensor:
        raise NotImplementedError

    def drop(self, i: int) -> None:
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

    def save(self, i, x, remake=None):
        self.saved[i] = x

    def load(self, i):
        return self.saved[i]

    def drop(self, i):
        self.saved.pop(i, None)

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

    def _d2h(self, x: torch.Tensor, buf: torch.Tensor):
        st = self.streams
        # Note: [Why the d2h waits for the compute event] x_i is produced on the compute stream.
        st.wait(st.record(), st.d2h)
        with st.on(st.d2h):
            buf.copy_(x.reshape(-1), non_blocking=True)
        done = st.record(st.d2h)
        st.hand_over([x], done)               # transfer.py: [Why copy sources are handed over, not recorded]
        self.count("act_d2h", x.numel() * x.element_size())
        return done

    def _h2d(self, i: int, src: torch.Tensor):
        st = self.streams
        shape, dtype = self.meta[i]
        # Note: [Why a loaded input is allocated on the compute stream] the caching allocator keeps
        # a pool per stream: made on the h2d stream, the inputs' memory could serve no other
        # tensor, and memory held apart is what pushes a tight cap into the allocator's
        # free-everything-and-retry path (a device synchronisation). Made on the compute stream,
        # the copy must first wait for the compute work issued so far (it may still read the
        # block's previous tensor): issued one layer ahead, that work ends before the input is needed.
        x = torch.empty(shape, dtype=dtype, device=st.device)
        st.wait(st.record(), st.h2d)
        with st.on(st.h2d):
            x.view(-1).copy_(src[:shape.numel()], non_blocking=True)
        self.count("act_h2d", shape.numel() * x.element_size())
        return x, st.record(st.h2d)

    def _keep(self, i, x, remake) -> bool:
        """Held without a host copy: as a recipe, or on the device (the last layer's)."""
        if remake is not None:
            self.remade[i] = remake
        elif i == self.keep_index:
            self.kept[i] = x
        else:
            return False
        self.meta[i] = (x.shape, x.dtype)
        return True

    def save(self, i, x, remake=None):
        if self._keep(i, x, remake):
            return
        self.host[i] = buf = self._host_buffer(self.host.get(i), x.numel(), x.dtype)
        self.saved_ev[i] = self._d2h(x, buf[:x.numel()])
        self.meta[i] = (x.shape, x.dtype)

    def _on_host(self, i) -> bool:
        """x_i went to the host and is not on its way back yet."""
        return i in self.meta and i not in self.loaded and i not in self.kept and i not in self.remade

    def prefetch(self, i):
        if not self._on_host(i):
            return
        self.streams.wait(self.saved_ev[i], self.streams.h2d)
        self.loaded[i] = self._h2d(i, self.host[i])

    def _bring(self, i) -> None:
        """Make sure `loaded[i]` holds x_i's device copy and its h2d event."""
        self.prefetch(i)

    def load(self, i):
        if i in self.kept:
            return self.kept[i]            # made on the compute stream: no event to wait for
        if i in self.remade:
            return self.remade[i]()
        self._bring(i)
        x, ev = self.loaded.pop(i)
        self.streams.wait(ev)
        return x

    def _unload(self, i) -> None:
        """Forget a device copy that was brought back and not used: the compute stream first waits
        for the copy that writes it, so its memory serves no one before the copy has run."""
        x, ev = self.loaded.pop(i)
        self.streams.wait(ev)

    def drop(self, i):
        if i in self.loaded:
            self._unload(i)
        self.kept.pop(i, None)
        self.remade.pop(i, None)

    def clear(self):
        for i in list(self.loaded):
            self._unload(i)
        self.kept.clear()
        self.remade.clear()

    def materialize(self):
        for i, remake in list(self.remade.items()):
            del self.remade[i]
            self.save(i, remake())
