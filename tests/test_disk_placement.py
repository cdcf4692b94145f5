"""Decoder layers whose moments, or whole state, live on disk (`DiskLayer`, `DiskStates`): training,
checkpoints and the model's state dicts are bit-identical to the host store's; the split, the
file's life and a full disk are as docs/disk.md says."""
import copy
import os
import time
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_slideformer as hs
from hf_slideformer.disk import disk_plan, disk_store
from hf_slideformer.host import store as store_module
from hf_slideformer.engine.device_update import DeviceUpdateLayer
from hf_slideformer.disk import DiskSpaceError, UnitStateFile
from hf_slideformer.disk.disk_placement import DiskLayer
from hf_slideformer.disk.disk_plan import DiskSplit
from hf_slideformer.disk.disk_store import MOMENTS, WHOLE
from hf_slideformer.host.memory import GiB, HostMemoryError
from hf_slideformer.engine.placements import HostLayer
from hf_slideformer.engine.resident import ResidentLayer
from hf_slideformer.checkpoints.train_checkpoint import load_training_state, save_training_state
from hf_slideformer.demo import tiny_config
from helpers import batches, family_config, make_pair, max_param_diff, open_fds

LR = 1e-2


@pytest.fixture(autouse=True)
def two_buffers(monkeypatch):
    """Two buffers for three or more disk layers: every step evicts, reads and writes behind, and
    the worker's deferred updates pin while the main thread holds a copy's pin (disk_store.py:
    [Why pinning cannot deadlock])."""
    monkeypatch.setattr(disk_store, "STATE_BUFFERS", 2)


def force_parts(monkeypatch, parts):
    """Test hook: the store puts the last len(parts) layers on disk, with these parts (MOMENTS or
    WHOLE, in schedule order), whatever the limit."""
    def plan(units, config):
        layers = [u for u in units if u.kind == "layer" and u.trainable]
        if config.host_memory_limit is None or not parts:
            return []
        return list(zip(layers[len(layers) - len(parts):], parts))
    monkeypatch.setattr(store_module, "plan_disk_units", plan)


# The tiny models have three layers: the parts of their last layers, M for the moments, A for all.
PARTS = {"MM": [MOMENTS] * 2, "MMM": [MOMENTS] * 3, "MAA": [MOMENTS, WHOLE, WHOLE], "MMA": [MOMENTS, MOMENTS, WHOLE],
         "AAA": [WHOLE] * 3}


def disk_pair(tmp_path, monkeypatch, k=3, seed=0, part=WHOLE, parts=None, **kw):
    """(slid model with its last k layers' `part` on disk, or its last layers' `parts`, slid model
    all on the host), same weights."""
    force_parts(monkeypatch, [part] * k if parts is None else PARTS[parts])
    tmp_path.mkdir(parents=True, exist_ok=True)
    _, on_disk = make_pair("llama", False, seed=seed, host_memory_limit=1.0, nvme_path=str(tmp_path / "nvme"), **kw)
    _, on_host = make_pair("llama", False, seed=seed, **kw)
    return on_disk, on_host


def train(model, data, ga=1, opt=None):
    opt = opt or model.create_optimizer(lr=LR, weight_decay=0.1)
    for i, b in enumerate(data):
        model(**b).loss.backward()
        if (i + 1) % ga == 0:
            opt.step()
            opt.zero_grad()
    return opt


def same_optimizer_state(a, b) -> bool:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert set(sa) == set(sb)
    return all(torch.equal(torch.as_tensor(sa[i][k]), torch.as_tensor(sb[i][k]))
               for i in sb for k in ("step", "exp_avg", "exp_avg_sq"))


# ------------------------------------------------------------------ exactness
@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("ga,clip", [(1, None), (1, 0.5), (2, None), (2, 0.5)])
def test_training_with_layers_on_disk_equals_the_host_store_bit_for_bit(tmp_path, monkeypatch, k, ga, clip):
    on_disk, on_host = disk_pair(tmp_path, monkeypatch, k, gradient_accumulation_steps=ga, max_grad_norm=clip)
    eng = on_disk.slide_engine
    assert [type(p) for p in eng.places] == [HostLayer] * (3 - k) + [DiskLayer] * k
    data = batches(3 * ga)
    a, b = train(on_disk, data, ga), train(on_host, data, ga)
    assert max_param_diff(on_disk, on_host) == 0.0
    assert same_optimizer_state(a, b)
    stats = on_disk.slide_stats()
    assert stats["disk_layers"] == k and stats["disk_buffers"] == 2
    # written back after every update; read in again every step when two buffers serve three layers
    assert stats["disk_write_bytes"] >= 3 * k * eng.store.disk.file.payload_bytes(0)
    assert (stats["disk_read_bytes"] > 0) == (k > 2)


@pytest.mark.parametrize("parts", ["MM", "MMM", "MAA", "MMA"])
@pytest.mark.parametrize("ga,clip", [(1, None), (1, 0.5), (2, None), (2, 0.5)])
def test_training_with_moments_on_disk_equals_the_host_store_bit_for_bit(tmp_path, monkeypatch, parts, ga, clip):
    """The moments of the last layers on disk, their masters in host memory (and the whole state
    of the last ones in a mixed plan): the same bits as the host store. A layer with its moments
    alone there reads them once per step at most (for its update), never for a slot copy."""
    on_disk, on_host = disk_pair(tmp_path, monkeypatch, parts=parts, gradient_accumulation_steps=ga,
                                 max_grad_norm=clip)
    eng = on_disk.slide_engine
    k, m = len(PARTS[parts]), PARTS[parts].count(MOMENTS)
    assert [type(p) for p in eng.places] == [HostLayer] * (3 - k) + [DiskLayer] * k
    moments = eng.layer_units[3 - k:3 - k + m]
    assert all(not p.is_meta for u in moments for e in u.entries for p in [e.param])    # the host masters
    assert all(e.param.is_meta for u in eng.layer_units[3 - k + m:] for e in u.entries)
    data = batches(3 * ga)
    a, b = train(on_disk, data, ga), train(on_host, data, ga)
    assert max_param_diff(on_disk, on_host) == 0.0
    assert same_optimizer_state(a, b)
    stats = on_disk.slide_stats()
    assert stats["disk_layers"] == k and stats["disk_moment_layers"] == m
    disk = eng.store.disk
    assert stats["disk_write_bytes"] >= 3 * sum(disk.file.payload_bytes(j) for j in range(k))
    if m == k:                                   # the moments alone: at most one read per layer and step
        assert stats["disk_read_bytes"] <= 3 * sum(disk.file.payload_bytes(j) for j in range(k))
        assert (stats["disk_read_bytes"] > 0) == (k > 2)


@pytest.mark.parametrize("parts", ["MMM", "MAA"])
def test_a_moments_layer_copies_its_master_from_host_memory(tmp_path, monkeypatch, parts):
    """A forward copies a moments-only layer's master from the host store, with no pin and no
    read; a whole-state layer's from its buffer, pinned, its master alone read (disk_store.py:
    [Why a copy reads the master alone])."""
    on_disk, _ = disk_pair(tmp_path, monkeypatch, parts=parts)
    train(on_disk, batches(1))
    on_disk.slide_engine.synchronize()
    disk = on_disk.slide_engine.store.disk
    pinned, read = [], disk.read_bytes
    monkeypatch.setattr(disk, "pin", lambda u, whole=True, _pin=disk.pin: (pinned.append((u.name, whole)),
                                                                            _pin(u, whole))[1])
    with torch.no_grad():
        on_disk(**batches(1, seed=5)[0])
    whole = [u for u in disk.units if disk.record(u).master]
    assert {n for n, _ in pinned} == {u.name for u in whole} and not any(w for _, w in pinned)
    k = {id(u): j for j, u in enumerate(disk.units)}
    assert disk.read_bytes - read <= sum(disk.file.array_bytes(k[id(u)]) for u in whole)


@pytest.mark.parametrize("parts", ["AAA", "MMM", "MAA"])
@pytest.mark.parametrize("ga,clip", [(1, None), (2, 0.5)])
def test_slow_disk_io_changes_nothing(tmp_path, monkeypatch, ga, clip, parts):
    """Reads and writes that take long (so that copies, updates and evictions wait on them) give
    the same bits (disk_store.py: [Why a disk unit's state is in one place at a time])."""
    for name in ("_read", "_write"):
        orig = getattr(UnitStateFile, name)

        def slow(self, *args, _orig=orig):
            time.sleep(0.01)
            return _orig(self, *args)
        monkeypatch.setattr(UnitStateFile, name, slow)
    on_disk, on_host = disk_pair(tmp_path, monkeypatch, parts=parts, gradient_accumulation_steps=ga,
                                 max_grad_norm=clip)
    data = batches(3 * ga)
    a, b = train(on_disk, data, ga), train(on_host, data, ga)
    assert max_param_diff(on_disk, on_host) == 0.0 and same_optimizer_state(a, b)
    assert on_disk.slide_stats()["wait_disk_s"] > 0


# ------------------------------------------------------------------ the split
def test_a_limit_puts_the_moments_of_the_fewest_last_layers_on_disk_first(tmp_path):
    """The moments of the fewest last layers that fit; when every layer's moments are not enough,
    their moments and the whole state of the fewest last ones (disk_plan.split_layers)."""
    cfg = tiny_config("llama", vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=6)
    model = AutoModelForCausalLM.from_config(cfg).float()
    units = [u for u in hs.slide(copy.deepcopy(model), hs.SlideConfig(device="cpu")).slide_engine.store.units]
    layers = [u.numel for u in units if u.kind == "layer"]
    n = layers[0]
    fixed = 12 * sum(u.numel for u in units if u.kind != "layer")
    mom, whole = disk_store.record_bytes(n, MOMENTS), disk_store.record_bytes(n, WHOLE)
    need = fixed + 12 * n + 4 * 5 * n + 2 * mom                  # the moments of the last 5 layers (two buffers)
    assert disk_plan.split_layers(need, fixed, layers) == DiskSplit(5, 0)
    assert disk_plan.split_layers(need - 1, fixed, layers) == DiskSplit(6, 0)
    tight = fixed + 4 * 3 * n + 2 * whole                         # every layer's moments, the last 3 whole
    assert disk_plan.split_layers(tight, fixed, layers) == DiskSplit(3, 3)
    assert disk_plan.split_layers(tight - 1, fixed, layers) == DiskSplit(2, 4)

    slid = hs.slide(copy.deepcopy(model), hs.SlideConfig(device="cpu", host_memory_limit=need / GiB,
                                                          nvme_path=str(tmp_path / "a")))
    eng = slid.slide_engine
    assert [type(p) for p in eng.places] == [HostLayer] + [DiskLayer] * 5
    assert slid.slide_stats()["disk_moment_layers"] == 5 and eng.store.disk.file.payload_bytes(0) == mom
    assert eng.store.host_numel == sum(u.numel for u in eng.store.units)         # every master in host memory
    assert eng.store.moments_numel == eng.store.host_numel - 5 * n
    assert not any(p.is_meta for p in slid.model.parameters())

    slid = hs.slide(model, hs.SlideConfig(device="cpu", host_memory_limit=tight / GiB, nvme_path=str(tmp_path / "b")))
    eng = slid.slide_engine
    stats = slid.slide_stats()
    assert [type(p) for p in eng.places] == [DiskLayer] * 6
    assert stats["disk_layers"] == 6 and stats["disk_moment_layers"] == 3
    assert eng.store.host_numel == sum(u.numel for u in eng.store.units) - 3 * n
    assert eng.store.master_slab.numel() == eng.store.host_numel - eng.embed_unit.numel
    assert eng.store.moments_numel == eng.store.host_numel - 3 * n
    assert all(p.is_meta for p in slid.model.layers[5].parameters())
    assert not any(p.is_meta for p in slid.model.layers[2].parameters())


def test_no_limit_changes_nothing(tmp_path):
    _, slid = make_pair("llama", False, nvme_path=str(tmp_path))
    eng = slid.slide_engine
    assert eng.store.disk is None and all(type(p) is HostLayer for p in eng.places)
    assert "disk_layers" not in slid.slide_stats() and os.listdir(tmp_path) == []


def test_auto_is_what_the_host_has_available_less_a_margin(tmp_path, monkeypatch):
    _, plain = make_pair("llama", False)
    state = 12 * sum(u.numel for u in plain.slide_engine.store.units)
    monkeypatch.setattr(disk_plan, "available_host_bytes", lambda: disk_plan.AUTO_MARGIN + state - 1)
    _, slid = make_pair("llama", False, host_memory_limit="auto", nvme_path=str(tmp_path))
    assert isinstance(slid.slide_engine.places[-1], DiskLayer)
    monkeypatch.setattr(disk_plan, "available_host_bytes", lambda: disk_plan.AUTO_MARGIN + state)
    _, slid = make_pair("llama", False, host_memory_limit="auto", nvme_path=str(tmp_path))
    assert slid.slide_engine.store.disk is None
    monkeypatch.setattr(disk_plan, "available_host_bytes", lambda: None)       # unknown: no limit
    assert disk_plan.host_limit_bytes("auto") is None and disk_plan.host_limit_bytes(2) == 2 * GiB


def test_nvme_path_is_needed_only_where_the_split_puts_a_layer_on_disk(tmp_path, monkeypatch):
    """A limit the whole state fits under slides without a disk; one that puts a layer on disk
    without nvme_path is refused at slide(), naming both settings."""
    _, plain = make_pair("llama", False)
    state = 12 * sum(u.numel for u in plain.slide_engine.store.units)
    _, slid = make_pair("llama", False, host_memory_limit=state / GiB)
    assert slid.slide_engine.store.disk is None and all(type(p) is HostLayer for p in slid.slide_engine.places)
    with pytest.raises(ValueError, match=r"SlideConfig\.host_memory_limit=.* puts the state of [1-3] of 3 decoder "
                                         r"layers on disk .*nvme_path is not set"):
        make_pair("llama", False, host_memory_limit=(state - 1) / GiB)
    monkeypatch.setattr(disk_plan, "available_host_bytes", lambda: disk_plan.AUTO_MARGIN + state)
    _, slid = make_pair("llama", False, host_memory_limit="auto")                   # 'auto' that fits
    assert slid.slide_engine.store.disk is None


def test_a_limit_below_the_floor_is_refused_naming_the_field(tmp_path):
    with pytest.raises(HostMemoryError, match=r"SlideConfig\.host_memory_limit=1e-06 .* all 3 trainable decoder "
                                              r"layers on disk: .*MiB .*Raise host_memory_limit"):
        make_pair("llama", False, host_memory_limit=1e-6, nvme_path=str(tmp_path))


# ------------------------------------------------------------------ state dicts and checkpoints
@pytest.mark.parametrize("part", [WHOLE, MOMENTS])
def test_state_dict_and_load_state_dict_read_and_write_the_disk(tmp_path, monkeypatch, part):
    on_disk, on_host = disk_pair(tmp_path, monkeypatch, 2, part=part)
    train(on_disk, batches(2))
    train(on_host, batches(2))
    sd = on_disk.state_dict()
    assert not any(t.is_meta for t in sd.values()) and max_param_diff(on_disk, on_host) == 0.0
    layer = on_disk.model.layers[2].state_dict()                      # a layer alone, and with keep_vars
    assert all(torch.equal(t, on_host.model.layers[2].state_dict()[n]) for n, t in layer.items())
    assert not any(t.is_meta for t in on_disk.state_dict(keep_vars=True).values())
    fresh, _ = disk_pair(tmp_path / "b", monkeypatch, 2, seed=7, part=part)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                                # no "copying into a meta parameter"
        fresh.load_state_dict(on_host.state_dict())
    assert max_param_diff(fresh, on_host) == 0.0
    with pytest.raises(RuntimeError, match="size mismatch"):
        fresh.load_state_dict({**on_host.state_dict(), "model.layers.2.mlp.up_proj.weight": torch.zeros(3, 3)})


@pytest.mark.parametrize("parts", ["AAA", "MMM", "MAA"])
def test_the_optimizer_state_dict_reads_and_writes_the_disk(tmp_path, monkeypatch, parts):
    on_disk, on_host = disk_pair(tmp_path, monkeypatch, parts=parts)
    a, b = train(on_disk, batches(2)), train(on_host, batches(2))
    assert same_optimizer_state(a, b)
    fresh, _ = disk_pair(tmp_path / "b", monkeypatch, seed=7, parts=parts)
    opt = fresh.create_optimizer(lr=LR, weight_decay=0.1)
    fresh.load_state_dict(on_host.state_dict())
    opt.load_state_dict(b.state_dict())
    more = batches(2, seed=3)
    train(fresh, more, opt=opt)
    train(on_host, more, opt=b)
    assert max_param_diff(fresh, on_host) == 0.0 and same_optimizer_state(opt, b)


@pytest.mark.parametrize("parts", ["AAA", "MMM", "MAA"])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_resume_from_a_training_checkpoint_equals_the_uninterrupted_run(tmp_path, monkeypatch, clip, parts):
    on_disk, on_host = disk_pair(tmp_path, monkeypatch, parts=parts, max_grad_norm=clip)
    first, then = batches(2), batches(2, seed=3)
    opt = train(on_disk, first)
    host_opt = train(on_host, first)
    save_training_state(str(tmp_path / "ckpt"), on_disk, opt)
    train(on_disk, then, opt=opt)                                      # the uninterrupted run
    for target_on_disk in (True, False):
        resumed, _ = disk_pair(tmp_path / f"r{target_on_disk}", monkeypatch, 0, seed=7, max_grad_norm=clip,
                               parts=parts if target_on_disk else None)
        ropt = resumed.create_optimizer(lr=LR, weight_decay=0.1)
        load_training_state(str(tmp_path / "ckpt"), resumed, ropt)
        train(resumed, then, opt=ropt)
        assert max_param_diff(resumed, on_disk) == 0.0 and same_optimizer_state(ropt, opt)
    save_training_state(str(tmp_path / "host"), on_host, host_opt)    # a host checkpoint resumes on disk too
    resumed, _ = disk_pair(tmp_path / "h", monkeypatch, seed=7, max_grad_norm=clip, parts=parts)
    ropt = resumed.create_optimizer(lr=LR, weight_decay=0.1)
    load_training_state(str(tmp_path / "host"), resumed, ropt)
    train(resumed, then, opt=ropt)
    assert max_param_diff(resumed, on_disk) == 0.0


@pytest.mark.parametrize("part", [WHOLE, MOMENTS])
@pytest.mark.parametrize("shard", ["5GB", "20KB"])
def test_save_pretrained_and_from_pretrained_go_through_the_disk(tmp_path, monkeypatch, shard, part):
    on_disk, on_host = disk_pair(tmp_path, monkeypatch, 2, part=part)
    train(on_disk, batches(2))
    train(on_host, batches(2))
    on_disk.save_pretrained(tmp_path / "out", max_shard_size=shard)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert max_param_diff(on_host, hf) == 0.0
    again = hs.SlideModel.from_pretrained(tmp_path / "out", slide_config=hs.SlideConfig(
        device="cpu", dtype=torch.float32, host_memory_limit=1.0, nvme_path=str(tmp_path / "again")))
    assert isinstance(again.slide_engine.places[-1], DiskLayer) and max_param_diff(again, on_host) == 0.0


# ------------------------------------------------------------------ the file, the disk, the other placements
def _open_state_files(directory) -> list[str]:
    return open_fds(lambda target: target.startswith(str(directory)) and "slide-state-" in target)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_the_state_file_has_no_name_and_its_space_comes_back_at_close(tmp_path, monkeypatch):
    on_disk, _ = disk_pair(tmp_path, monkeypatch, 3)
    train(on_disk, batches(1))
    nvme = tmp_path / "nvme"
    assert os.listdir(nvme) == []                                      # the name went when it was opened
    assert [t.endswith("(deleted)") for t in _open_state_files(nvme)] == [True]
    on_disk.slide_engine.close()
    assert _open_state_files(nvme) == []


def test_a_full_disk_is_reported_when_the_model_is_slid(tmp_path, monkeypatch):
    import collections
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr("hf_slideformer.disk.space.shutil.disk_usage", lambda path: usage(10 ** 6, 10 ** 6, 1000))
    with pytest.raises(DiskSpaceError, match=r"needs \d+ bytes .* has 1000 bytes .* free.*nvme_path"):
        disk_pair(tmp_path, monkeypatch, 2)
    assert os.listdir(tmp_path / "nvme") == []


@pytest.mark.parametrize("part", [WHOLE, MOMENTS])
def test_a_failed_write_stops_training_with_the_error(tmp_path, monkeypatch, part):
    on_disk, _ = disk_pair(tmp_path, monkeypatch, 3, part=part)
    opt = train(on_disk, batches(1))

    def broken(self, *args):
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(UnitStateFile, "_write", broken)
    with pytest.raises(Exception, match="Input/output error"):
        train(on_disk, batches(2), opt=opt)


def test_disk_layers_are_neither_resident_nor_updated_on_the_device(tmp_path, monkeypatch):
    on_disk, _ = disk_pair(tmp_path, monkeypatch, 2, resident_layers=3)
    train(on_disk, batches(2))
    assert [type(p) for p in on_disk.slide_engine.places] == [ResidentLayer, DiskLayer, DiskLayer]
    on_disk, on_host = disk_pair(tmp_path / "b", monkeypatch, 2, max_grad_norm=0.5, device_update_share=1.0)
    train(on_disk, batches(2))
    train(on_host, batches(2))
    assert [type(p) for p in on_disk.slide_engine.places] == [DeviceUpdateLayer, DiskLayer, DiskLayer]
    assert max_param_diff(on_disk, on_host) == 0.0


def test_a_lora_base_stays_in_host_memory(tmp_path):
    """slide() of a PEFT model: its frozen base layers never go to disk, and a limit below them is named."""
    peft = pytest.importorskip("peft")
    base = AutoModelForCausalLM.from_config(family_config("llama")).float()
    pm = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    slid = hs.slide(copy.deepcopy(pm), hs.SlideConfig(device="cpu", host_memory_limit=1.0, nvme_path=str(tmp_path)))
    assert slid.base_model.model.slide_engine.store.disk is None
    with pytest.raises(HostMemoryError, match="no decoder layer can go to disk .*frozen LoRA base"):
        hs.slide(copy.deepcopy(pm), hs.SlideConfig(device="cpu", host_memory_limit=1e-6, nvme_path=str(tmp_path)))


def test_lora_on_a_model_with_layers_on_disk_is_refused(tmp_path, monkeypatch):
    peft = pytest.importorskip("peft")
    on_disk, _ = disk_pair(tmp_path, monkeypatch, 2)
    p = peft.get_peft_model(on_disk, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(hs.SlideStateError, match="keep their state on disk .*get_peft_model before slide"):
        p.create_optimizer(lr=LR)
    with pytest.raises(hs.SlideStateError, match="keep their state on disk"):     # a forward first: the same
        p(**batches(1)[0])


# ------------------------------------------------------------------ a killed process
_KILLED = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import torch
from hf_slideformer.disk import disk_store
from hf_slideformer.host import host_tasks, store as store_module
from hf_slideformer.disk import UnitStateFile
from hf_slideformer.disk.disk_store import MOMENTS, WHOLE
from hf_slideformer.checkpoints.train_checkpoint import save_training_state
from helpers import batches, make_pair

disk_store.STATE_BUFFERS = 2
parts = {parts!r}
def plan(units, config):
    layers = [u for u in units if u.kind == "layer" and u.trainable]
    return list(zip(layers[len(layers) - len(parts):], parts)) if config.host_memory_limit is not None else []
store_module.plan_disk_units = plan
_, model = make_pair("llama", False, seed=0, host_memory_limit=1.0, nvme_path={nvme!r}, max_grad_norm={clip!r})
opt = model.create_optimizer(lr={lr!r}, weight_decay=0.1)
def step(b):
    model(**b).loss.backward()
    opt.step()
    opt.zero_grad()
for b in batches(2):
    step(b)
save_training_state({ckpt!r}, model, opt)

def kill(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)
if {where!r} == "update":          # in the middle of the next step, on the worker, as it updates a layer
    host_tasks.HostUpdates.update = kill
else:                               # as a layer's state is written back to disk
    UnitStateFile._write = kill
for b in batches(2, seed=3):
    step(b)
"""


@pytest.mark.parametrize("where", ["update", "write"])
@pytest.mark.parametrize("clip,parts", [(None, "MAA"), (0.5, "AAA")])
def test_a_kill_in_the_middle_of_a_step_resumes_as_the_uninterrupted_run(tmp_path, monkeypatch, where, clip, parts):
    """SIGKILL in the middle of a step with state on disk (on the worker's update, or as a record
    is written back), then resume from the last training checkpoint: equal to the uninterrupted
    run bit for bit, and no state file is left behind."""
    import signal
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    code = _KILLED.format(tests=tests, parts=PARTS[parts], nvme=str(tmp_path / "nvme"), clip=clip, lr=LR,
                          ckpt=str(tmp_path / "ckpt"), where=where)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))      # the threads of this process: the same sums
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert os.listdir(tmp_path / "nvme") == []                         # the state file had no name

    on_disk, _ = disk_pair(tmp_path / "a", monkeypatch, parts=parts, max_grad_norm=clip)
    opt = train(on_disk, batches(2))
    train(on_disk, batches(2, seed=3), opt=opt)                        # the uninterrupted run
    resumed, _ = disk_pair(tmp_path / "b", monkeypatch, seed=7, parts=parts, max_grad_norm=clip)
    ropt = resumed.create_optimizer(lr=LR, weight_decay=0.1)
    load_training_state(str(tmp_path / "ckpt"), resumed, ropt)
    train(resumed, batches(2, seed=3), opt=ropt)
    assert max_param_diff(resumed, on_disk) == 0.0 and same_optimizer_state(ropt, opt)
