"""Host memory: the store's size estimate and up-front check, lazily backed zeros, giving pages
back, and pinned buffers switched off on the CPU."""
import mmap

import pytest
import torch

from hf_slideformer.host import memory
from hf_slideformer.config import SlideConfig
from hf_slideformer.host.memory import (GiB, HostMemoryError, PinnedBuffers, check_host_memory, estimate_host_bytes,
                                   lazy_zeros, release_pages)


def test_estimate_counts_master_moments_and_the_accumulator():
    assert estimate_host_bytes(1000, deferred=False) == 12_000
    assert estimate_host_bytes(1000, deferred=True) == 16_000


def test_check_refuses_with_the_estimate_and_the_fixes(monkeypatch):
    config = SlideConfig(device="cpu")
    monkeypatch.setattr(memory, "available_host_bytes", lambda: 10 * GiB)
    check_host_memory(GiB // 2, deferred=True, config=config)           # 8 GiB needed: fits
    with pytest.raises(HostMemoryError) as info:
        check_host_memory(GiB, deferred=True, config=config)           # 16 GiB
    msg = str(info.value)
    assert "16.0 GiB" in msg and "10.0 GiB is available" in msg and "gradient_accumulation_steps=1" in msg
    assert "check_host_memory=False" in msg
    with pytest.raises(HostMemoryError) as info:
        check_host_memory(GiB, deferred=False, config=config)          # 12 GiB, no accumulator to drop
    assert "12 bytes each" in str(info.value) and "gradient_accumulation_steps" not in str(info.value)
    with pytest.raises(HostMemoryError) as info:                      # no accumulator for the embedding
        check_host_memory(GiB, deferred=True, config=config, need=15 * GiB)
    assert "15 bytes each" in str(info.value) and "frozen base" not in str(info.value)
    with pytest.raises(HostMemoryError) as info:
        check_host_memory(GiB, deferred=False, config=config, need=11 * GiB, frozen=True)
    assert "frozen base" in str(info.value)
    monkeypatch.setattr(memory, "available_host_bytes", lambda: None)   # unknown: not refused
    check_host_memory(100 * GiB, deferred=True, config=config)


def test_lazy_zeros_read_as_zeros_and_take_writes():
    for dtype in (torch.float32, torch.bfloat16):
        t = lazy_zeros(3 * mmap.PAGESIZE, dtype)
        assert t.dtype == dtype and t.numel() == 3 * mmap.PAGESIZE and not t.any()
        t[5] = 2.0
        assert t[5] == 2.0 and t.sum() == 2.0
    assert lazy_zeros(0).numel() == 0


def test_release_pages_gives_back_whole_pages_only():
    page = mmap.PAGESIZE
    t = lazy_zeros(4 * page // 4)                    # four pages of fp32, page-aligned
    t.fill_(1.0)
    assert release_pages(t) == 4 * page
    assert not t.any()                               # released pages read as zeros
    inner = t[1:]                                    # starts one element into the first page
    inner.fill_(3.0)
    assert release_pages(inner) == 3 * page
    assert inner[: page // 4 - 1].eq(3.0).all() and not inner[page // 4 - 1:].any()
    assert release_pages(torch.ones(10)) == 0        # smaller than a page


def test_pinned_buffers_off_on_the_cpu():
    pinned = PinnedBuffers(False)
    t = pinned.empty(16, dtype=torch.bfloat16)
    assert t.shape == (16,) and t.dtype == torch.bfloat16 and not t.is_pinned()
    assert pinned.adopt(t) is t
    pinned.release(t)
    pinned.close()
