"""A copy through a device staging buffer: a cast between the host's and the device's dtypes made
on the device, in chunks of the buffer's size (the slots' fills, the gradients' copies out).
"""
from __future__ import annotations

import torch

__all__ = ["staged_copy"]


def staged_copy(dst: torch.Tensor, src: torch.Tensor, stage: torch.Tensor) -> None:
    """Copy `src` into `dst` (same numel, other dtype or device) through the device buffer `stage`.

    Chunks of `stage.numel()` elements: each is copied into the stage, then cast / copied from it
    into `dst`, both with `non_blocking` on the current stream. Note: [Why the staging chunk is safe
    to reuse] every copy is on one stream, so chunk k+1 lands in the stage only after chunk k's
    copy out of it has read it; the caller keeps `stage` to that one stream.

    Args:
        dst: (numel,) destination (the compute-dtype slot, or a host buffer).
        src: (numel,) source (a host master, or a device gradient).
        stage: (m,) device buffer of `src`'s or `dst`'s wider dtype, any m >= 1.
    """
    numel, cap = src.numel(), stage.numel()
    src, dst = src.reshape(-1), dst.view(-1)
    for start in range(0, numel, cap):
        end = min(start + cap, numel)
        chunk = stage[:end - start]
        chunk.copy_(src[start:end], non_blocking=True)
        dst[start:end].copy_(chunk, non_blocking=True)
