"""Layer-input checkpoints: each decoder layer's input is kept between forward and backward in
one of three tiers behind one interface: the device itself, pinned host memory, or files.

Only x_i (B, S, H) per layer is kept; the layer is recomputed from it in backward. The device and
pinned-memory tiers are in activation_tiers.py, the file tier in activation_file.py; `make_tier`
picks the one `SlideConfig.activation_tier` names.
"""
from __future__ import annotations

from .activation_file import FileTier
from .activation_tiers import ActivationTier, DeviceTier, PinnedCpuTier
from ..host.memory import PinnedBuffers
from .transfer import Streams

__all__ = ["ActivationTier", "DeviceTier", "PinnedCpuTier", "FileTier", "make_tier"]


def make_tier(config, streams: Streams, counter=None, pinned: PinnedBuffers | None = None) -> ActivationTier:
    """The tier named by `config.activation_tier`."""
    if config.activation_tier == "device":
        return DeviceTier(streams, counter, pinned)
    if config.activation_tier == "cpu":
        return PinnedCpuTier(streams, counter, pinned)
    if config.activation_tier == "nvme":
        return FileTier(streams, config.nvme_path, counter, pinned)
    raise ValueError(f"unknown activation tier {config.activation_tier!r}")
