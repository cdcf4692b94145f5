"""Host memory: pinning large slabs once, and the up-front check that the store fits."""
from __future__ import annotations

import logging
import os
import weakref

import torch

logger = logging.getLogger(__name__)

__all__ = ["available_host_bytes", "estimate_host_bytes", "check_host_memory", "pin_slab", "unpin_slab",
           "PinnedBuffers", "HostMemoryError", "release_pages", "lazy_zeros", "enable_expandable_segments",
           "expandable_segments_on", "GiB", "COPY_CHUNK"]

GiB = 1024 ** 3
# Elements per step of a chunked copy (256 MiB of fp32): the on-GPU fp32 staging buffers hold at
# most this many, and a slot is filled at most this many elements at a time.
COPY_CHUNK = 1 << 26


class HostMemoryError(MemoryError):
    """The host store would not fit in the memory available."""


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def estimate_host_bytes(numel: int, *, deferred: bool) -> int:
    """Bytes the host store needs: fp32 master + Adam m + v (+ fp32 gradient accumulator)."""
    per_param = 12 + (4 if deferred else 0)
    return numel * per_param


def check_host_memory(numel: int, *, deferred: bool, config, need: int | None = None, frozen: bool = False) -> None:
    """Fail before allocating when the store cannot fit, with the estimate and what to change.

    `need`: the bytes the store takes in host memory when some layers keep their state on disk
    (`SlideConfig.host_memory_limit`), a frozen base or a compact optimizer state; default all of
    it, `estimate_host_bytes`. `frozen`: some units are a frozen base (LoRA)."""
    full = estimate_host_bytes(numel, deferred=deferred)
    need = full if need is None else need
    avail = available_host_bytes()
    if avail is None or need <= avail:
        return
    hint = ("set gradient_accumulation_steps=1 and max_grad_norm=None to drop the gradient accumulator "
            "(4 bytes/param), " if deferred else "")
    if frozen and config.host_memory_limit is None:
        what = f"of host memory for {numel / 1e9:.2f}B parameters (a frozen base in the compute dtype, no moments)"
    elif need < full and config.host_memory_limit is not None:
        what = (f"of host memory for the part of the state of {numel / 1e9:.2f}B parameters kept there "
                f"(host_memory_limit={config.host_memory_limit!r} puts the rest on disk)")
        hint += "lower host_memory_limit (or 'auto'), "
    else:
        what = (f"of host memory for {numel / 1e9:.2f}B parameters (about {round(need / numel)} bytes each: "
                f"master and optimizer state ({getattr(config, 'optimizer_state', 'adamw')})"
                f"{' and gradient accumulator' if deferred else ''})")
        hint += "set host_memory_limit (GiB, or 'auto') and nvme_path to keep the last layers' state on disk, "
    raise HostMemoryError(
        f"hf_slideformer needs about {need / GiB:.1f} GiB {what}, but only {avail / GiB:.1f} GiB is available. "
        f"To fit: {hint}free host memory, use a machine with more RAM, or train a smaller model. "
        "Pass SlideConfig(check_host_memory=False) to try anyway."
    )


def pin_slab(tensor: torch.Tensor) -> bool:
    """Page-lock an existing CPU tensor in place (cudaHostRegister), without the caching host
    allocator's power-of-two rounding that would waste up to half of a large buffer.

    Returns whether the memory is now pinned (a failure only costs speed, so it is logged)."""
    if tensor.numel() == 0:
        return False
    nbytes = tensor.numel() * tensor.element_size()
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
    if int(err) != 0:
        logger.warning("cudaHostRegister of %d bytes (%.2f GiB) failed: %s; transfers from it will be slower",
                       nbytes, nbytes / GiB, _cuda_error(err))
        return False
    return True


def _cuda_error(err) -> str:
    """A CUDA runtime error code in words (torch's enum does not name every code)."""
    code = int(err)
    try:
        return f"{torch.cuda.CudaError(code)}"
    except Exception:                               # noqa: BLE001 - a code the bindings do not know
        return f"CUDA error {code}"


def unpin_slab(tensor: torch.Tensor) -> None:
    """Undo pin_slab (call once no copy reads or writes `tensor` any more)."""
    torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())


class PinnedBuffers:
    """Host buffers page-locked with pin_slab, released (unregistered) explicitly or at close()."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._held: list[torch.Tensor] = []
        # Collected without close(): unregister first, or a later registration of the freed
        # addresses fails (slide_build.py: [Why a failed slide() releases what it took]).
        weakref.finalize(self, _unpin_all, self._held)

    def empty(self, *shape, dtype=torch.float32) -> torch.Tensor:
        tensor = torch.empty(*shape, dtype=dtype)
        if self.enabled and pin_slab(tensor):
            self._held.append(tensor)
        return tensor

    def adopt(self, tensor: torch.Tensor) -> torch.Tensor:
        """Pin an existing tensor and release it with the others."""
        if self.enabled and pin_slab(tensor):
            self._held.append(tensor)
        return tensor

    def release(self, tensor: torch.Tensor) -> None:
        """Unpin one buffer; the caller guarantees that no copy still uses it."""
        for index, held in enumerate(self._held):
            if held is tensor:
                unpin_slab(held)
                del self._held[index]
                return

    def close(self) -> None:
        _unpin_all(self._held)


def _unpin_all(held: list) -> None:
    for tensor in held:
        unpin_slab(tensor)
    held.clear()


class PrivateHostMemory:
    """The host store's memory in one process: pinned buffers for what the copies read (`empty`),
    lazily backed zeros for the moments (`zeros`). `data_parallel.SharedHostMemory` is the same
    for ranks that share one copy."""

    def __init__(self, pinned: PinnedBuffers):
        self.pinned = pinned

    def empty(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.pinned.empty(numel, dtype=dtype)

    def zeros(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return lazy_zeros(numel, dtype)


def lazy_zeros(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A zero-filled CPU tensor whose pages take host memory only once written.

    Note: [Why the moments are mapped, not zeroed] torch.zeros writes every page, so all the
    moments would be resident from the start, also those of units that are updated on the GPU
    only (a resident embedding's, which the first step's host peak would carry). A private anonymous
    mapping reads as zeros and is backed page by page as the updates write it.
    """
    import mmap

    nbytes = numel * dtype.itemsize
    if nbytes == 0 or not hasattr(mmap, "MAP_ANONYMOUS"):      # no anonymous mappings (not POSIX)
        return torch.zeros(numel, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype)        # the tensor keeps the mapping alive


def release_pages(tensor: torch.Tensor) -> int:
    """Give the physical pages under a CPU tensor back to the OS (they read as zeros afterwards).

    Only the whole pages inside the tensor are released; returns the bytes released (0 where
    madvise is unavailable or the tensor is pinned, whose pages must stay).
    """
    import ctypes
    import mmap

    if tensor.device.type != "cpu" or tensor.numel() == 0 or tensor.is_pinned():
        return 0
    page = mmap.PAGESIZE
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    aligned_start = (start + page - 1) // page * page
    aligned_end = end // page * page
    if aligned_end <= aligned_start:
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        MADV_DONTNEED = 4
        if libc.madvise(ctypes.c_void_p(aligned_start), ctypes.c_size_t(aligned_end - aligned_start),
                        MADV_DONTNEED) != 0:
            return 0
    except (OSError, AttributeError):
        return 0
    return aligned_end - aligned_start


_ALLOC_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_expandable_set = False


def _env_expandable() -> bool | None:
    """expandable_segments as the allocator's environment variables set it (None: not mentioned)."""
    for key in _ALLOC_ENV:
        for item in os.environ.get(key, "").replace(" ", "").lower().split(","):
            if item.startswith("expandable_segments:"):
                return item.split(":", 1)[1] == "true"
    return None


def _set_allocator_settings(settings: str) -> None:
    """The allocator's runtime settings call (torch >= 2.9 names it per accelerator)."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings
    setter(settings)


def expandable_segments_on() -> bool:
    """Whether the CUDA caching allocator uses expandable segments (set by the environment or by us)."""
    env = _env_expandable()
    return env if env is not None else _expandable_set


def enable_expandable_segments() -> bool:
    """Turn expandable segments on for this process unless the environment decides; returns the state.

    Segments allocated before the call keep their fixed size; every later one can grow, so the
    memory freed by one buffer size serves the next instead of staying reserved.
    """
    global _expandable_set
    if _env_expandable() is not None or _expandable_set:
        return expandable_segments_on()
    try:
        _set_allocator_settings("expandable_segments:True")
    except (AttributeError, RuntimeError) as exc:      # an allocator without them: fixed segments
        logger.info("expandable segments unavailable (%s); the resident plan measures reserved memory", exc)
        return False
    _expandable_set = True
    return True
