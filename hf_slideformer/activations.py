"""Layer-input checkpoints: each decoder layer's input is kept between forward and backward in
one of three tiers behind one interface: the device itself, pinned host memory, or files.

Only x_i (B, S, H) per layer is kept; the layer is recomputed from it in backward.
"""
from __future__ import annotations

import os
import tempfile

import torch

from .transfer import Streams

__all__ = ["ActivationTier", "DeviceTier", "PinnedCpuTier", "FileTier", "make_tier"]


class ActivationTier:
    """Interface: save(i, x) in forward; prefetch(i) ahead of use; load(i) -> x in backward."""

    def __init__(self, streams: Streams, counter=None):
        self.streams = streams
        self.count = counter or (lambda kind, n: None)

    def save(self, i: int, x: torch.Tensor) -> None:
        raise NotImplementedError

    def prefetch(self, i: int) -> None:
        pass

    def load(self, i: int) -> torch.Tensor:
        raise NotImplementedError

    def drop(self, i: int) -> None:
        pass

    def clear(self) -> None:
        pass


class DeviceTier(ActivationTier):
    """Keep x_i on the compute device (fastest; costs L * B*S*H elements of device memory)."""

    def __init__(self, streams, counter=None):
        super().__init__(streams, counter)
        self.saved: dict[int, torch.Tensor] = {}

    def save(self, i, x):
        self.saved[i] = x

    def load(self, i):
        return self.saved[i]

    def drop(self, i):
        self.saved.pop(i, None)

    def clear(self):
        self.saved.clear()


class PinnedCpuTier(ActivationTier):
    """Copy x_i to pinned host memory on the d2h stream; bring it back on the h2d stream.

    Host buffers are allocated once per layer and reused while the activation shape allows.
    """

    def __init__(self, streams, counter=None):
        super().__init__(streams, counter)
        self.host: dict[int, torch.Tensor] = {}
        self.meta: dict[int, tuple] = {}
        self.saved_ev: dict[int, object] = {}
        self.loaded: dict[int, tuple[torch.Tensor, object]] = {}

    def _buffer(self, i, numel, dtype):
        buf = self.host.get(i)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = torch.empty(numel, dtype=dtype, pin_memory=self.streams.cuda)
            self.host[i] = buf
        return buf[:numel]

    def save(self, i, x):
        st = self.streams
        buf = self._buffer(i, x.numel(), x.dtype)
        # Note: [Why the d2h waits for the compute event] x_i is produced on the compute stream.
        st.wait(st.record(), st.d2h)
        with st.on(st.d2h):
            buf.copy_(x.reshape(-1), non_blocking=True)
        if st.cuda:
            x.record_stream(st.d2h)           # keep x's memory alive until the copy has run
        self.saved_ev[i] = st.record(st.d2h)
        self.meta[i] = (x.shape, x.dtype)
        self.count("act_d2h", x.numel() * x.element_size())

    def prefetch(self, i):
        if i in self.loaded or i not in self.meta:
            return
        st = self.streams
        shape, dtype = self.meta[i]
        n = shape.numel()
        st.wait(self.saved_ev[i], st.h2d)
        with st.on(st.h2d):
            x = torch.empty(shape, dtype=dtype, device=st.device)
            x.view(-1).copy_(self.host[i][:n], non_blocking=True)
        self.loaded[i] = (x, st.record(st.h2d))
        self.count("act_h2d", n * x.element_size())

    def load(self, i):
        self.prefetch(i)
        x, ev = self.loaded.pop(i)
        st = self.streams
        st.wait(ev)
        if st.cuda:
            x.record_stream(st.compute)
        return x

    def drop(self, i):
        self.loaded.pop(i, None)

    def clear(self):
        self.loaded.clear()


class FileTier(PinnedCpuTier):
    """Spill x_i to a file under `path` through a pinned bounce buffer (NVMe tier).

    The file is written synchronously after the d2h copy and read back on prefetch; host memory
    holds one bounce buffer per in-flight layer, not L activations.
    """

    def __init__(self, streams, path: str, counter=None):
        super().__init__(streams, counter)
        os.makedirs(path, exist_ok=True)
        self.dir = tempfile.mkdtemp(prefix="slide-act-", dir=path)

    def _file(self, i):
        return os.path.join(self.dir, f"x{i}.bin")

    def save(self, i, x):
        super().save(i, x)
        self.saved_ev[i].synchronize()
        n = x.numel()
        buf = self.host.pop(i)[:n]
        with open(self._file(i), "wb") as f:
            f.write(buf.view(torch.uint8).numpy().tobytes() if buf.dtype != torch.bfloat16
                    else buf.view(torch.int16).numpy().tobytes())
        self._spare = buf

    def prefetch(self, i):
        if i in self.loaded or i not in self.meta:
            return
        shape, dtype = self.meta[i]
        n = shape.numel()
        buf = self._buffer(i, n, dtype)
        raw = buf.view(torch.int16) if dtype == torch.bfloat16 else buf.view(torch.uint8)
        with open(self._file(i), "rb") as f:
            f.readinto(raw.numpy())
        super().prefetch(i)


def make_tier(config, streams: Streams, counter=None) -> ActivationTier:
    """The tier named by `config.activation_tier`."""
    if config.activation_tier == "device":
        return DeviceTier(streams, counter)
    if config.activation_tier == "cpu":
        return PinnedCpuTier(streams, counter)
    if config.activation_tier == "nvme":
        return FileTier(streams, config.nvme_path, counter)
    raise ValueError(f"unknown activation tier {config.activation_tier!r}")
