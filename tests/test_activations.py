"""Activation tiers: every tier gives back exactly what was saved (bit-exact, dtype and shape),
in any order of prefetch and load; the last layer's input and a recipe skip the host; the file
tier's failures reach the caller."""
import os

import pytest
import torch

from hf_slideformer.engine.activations import DeviceTier, FileTier, PinnedCpuTier, make_tier
from hf_slideformer.config import SlideConfig
from hf_slideformer.engine.transfer import Streams

CPU = Streams.for_device(torch.device("cpu"))


def _inputs(n, dtype, shape=(2, 5, 8), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(n)]


def _tier(kind, tmp_path, counter=None, buffers=3):
    if kind == "device":
        return DeviceTier(CPU, counter)
    if kind == "cpu":
        return PinnedCpuTier(CPU, counter)
    return FileTier(CPU, str(tmp_path), counter, buffers=buffers)


@pytest.fixture(params=["device", "cpu", "nvme"])
def kind(request):
    return request.param


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_save_load_round_trip_is_bit_exact(kind, dtype, tmp_path):
    tier = _tier(kind, tmp_path)
    try:
        for step in range(2):                          # buffers reused by the next forward
            xs = _inputs(6, dtype, seed=step)
            kept = [x.clone() for x in xs]
            tier.clear()
            for i, x in enumerate(xs):
                tier.save(i, x)
            for i in reversed(range(6)):               # backward order, with read-ahead
                tier.prefetch(i)
                y = tier.load(i)
                assert y.dtype == dtype and y.shape == kept[i].shape
                assert torch.equal(y, kept[i]), (step, i)
                tier.drop(i)
    finally:
        tier.close()


def test_loads_in_any_order(kind, tmp_path):
    tier = _tier(kind, tmp_path)
    try:
        xs = _inputs(5, torch.bfloat16)
        for i, x in enumerate(xs):
            tier.save(i, x)
        for i in (2, 4, 0, 3, 1):
            assert torch.equal(tier.load(i), xs[i]), i
    finally:
        tier.close()


@pytest.mark.parametrize("kind", ["cpu", "nvme"])
def test_host_tiers_count_their_copies_and_skip_the_kept_input(kind, tmp_path):
    counts = {}
    tier = _tier(kind, tmp_path, counter=lambda k, n: counts.__setitem__(k, counts.get(k, 0) + n))
    try:
        tier.keep_index = 3                            # [Why the last layer's input stays on the device]
        xs = _inputs(4, torch.bfloat16)
        for i, x in enumerate(xs):
            tier.save(i, x)
        nbytes = xs[0].numel() * 2
        assert counts == {"act_d2h": 3 * nbytes}
        assert tier.load(3) is xs[3]
        for i in (2, 1, 0):
            assert torch.equal(tier.load(i), xs[i])
        assert counts == {"act_d2h": 3 * nbytes, "act_h2d": 3 * nbytes}
    finally:
        tier.close()


@pytest.mark.parametrize("kind", ["cpu", "nvme"])
def test_a_recipe_is_kept_until_materialized(kind, tmp_path):
    """[Why the first layer's input can be gathered again]: the tier keeps the recipe; once
    materialized, x_0 is a saved tensor and no longer follows its source."""
    tier = _tier(kind, tmp_path)
    try:
        source = torch.randn(2, 5, 8)
        tier.save(0, source.clone(), remake=lambda: source.clone())
        assert torch.equal(tier.load(0), source)
        want = source.clone()
        tier.materialize()
        source.add_(1.0)                               # what the recipe read changes
        assert torch.equal(tier.load(0), want)
    finally:
        tier.close()


def test_file_tier_failure_names_the_way_out(tmp_path):
    tier = FileTier(CPU, str(tmp_path), buffers=2)
    try:
        x = torch.randn(2, 5, 8)
        tier.save(0, x)
        tier.save(1, x)
        tier.jobs.join()                               # both written
        assert os.listdir(tmp_path) == []              # the files have no name (disk/names.py)
        os.ftruncate(tier.files[0].fileno(), 0)        # the disk loses layer 0's input
        with pytest.raises(RuntimeError, match="nvme activation tier failed.*activation_tier='cpu'"):
            tier.load(0)
    finally:
        tier.close()
    assert os.listdir(tmp_path) == []


def test_make_tier_follows_the_config(tmp_path):
    for name, cls in (("device", DeviceTier), ("cpu", PinnedCpuTier), ("nvme", FileTier)):
        tier = make_tier(SlideConfig(device="cpu", activation_tier=name, nvme_path=str(tmp_path)), CPU)
        assert type(tier) is cls
        tier.close()


def test_file_tier_moves_its_files_through_the_disk_backend(tmp_path):
    """The nvme tier's file reads and writes go through hf_slideformer.disk's backend (kvikio where
    it is installed), here a plain one that splits each file into several tasks."""
    from hf_slideformer.disk import PlainFileBackend

    calls = []

    class Counting(PlainFileBackend):
        def open(self, path):
            f = super().open(path)
            part = os.path.basename(path).rsplit("-", 1)[1]          # slide-act-...-<layer>.bin
            write, read = f.pwrite, f.pread
            f.pwrite = lambda buf, n, off: (calls.append(("write", part, n)), write(buf, n, off))[1]
            f.pread = lambda buf, n, off: (calls.append(("read", part, n)), read(buf, n, off))[1]
            return f

    tier = FileTier(CPU, str(tmp_path), buffers=2, backend=Counting(threads=2, task_bytes=64))
    try:
        xs = _inputs(2, torch.bfloat16)
        for i, x in enumerate(xs):
            tier.save(i, x)
        for i in (1, 0):
            assert torch.equal(tier.load(i), xs[i]), i
        nbytes = xs[0].numel() * 2
        assert sorted(calls) == [("read", "0.bin", nbytes), ("read", "1.bin", nbytes),
                                 ("write", "0.bin", nbytes), ("write", "1.bin", nbytes)]
    finally:
        tier.close()
        tier.backend.close()                        # a backend passed in is the caller's to close
