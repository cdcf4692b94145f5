"""Disk records in a compact optimizer state format (disk_record.py): a layer whose moments, or
whole state, are on disk trains, saves and resumes bit-identically to the same format in host
memory, moves the format's bytes, and a torn or damaged record is a named error."""
import pytest
import torch

from hf_slideformer.disk import disk_store

from hf_slideformer.host import store as store_module
from hf_slideformer.disk import DiskIOError, UnitStateError
from hf_slideformer.disk.records import array_offsets
from hf_slideformer.disk.disk_placement import DiskLayer
from hf_slideformer.disk.disk_record import MOMENTS, WHOLE, StateRecord, record_bytes
from hf_slideformer.host.host_optim import CorruptOptimizerStateError, state_format
from hf_slideformer.engine.placements import HostLayer
from hf_slideformer.checkpoints.train_checkpoint import load_training_state, save_training_state

from helpers import batches, make_pair, max_param_diff

COMPACT = ["adamw_8bit", "adamw_8bit_bf16"]
PARTS = {"MMM": [MOMENTS] * 3, "AAA": [WHOLE] * 3, "MAA": [MOMENTS, WHOLE, WHOLE]}
# Layers of 295,424 parameters (rows of 256: the embedding keeps the format too).
CFG = dict(hidden_size=256, intermediate_size=128)
LR = 1e-2


@pytest.fixture(autouse=True)
def two_buffers(monkeypatch):
    """Two buffers for three disk layers: every step evicts, reads and writes behind."""
    monkeypatch.setattr(disk_store, "STATE_BUFFERS", 2)


def force_parts(monkeypatch, parts):
    """The store puts the last len(parts) layers on disk with these parts, whatever the limit."""
    def plan(units, config):
        layers = [u for u in units if u.kind == "layer" and u.trainable]
        if config.host_memory_limit is None or not parts:
            return []
        return list(zip(layers[len(layers) - len(parts):], parts))
    monkeypatch.setattr(store_module, "plan_disk_units", plan)


def slid(tmp_path, monkeypatch, name, parts=None, seed=0, **kw):
    """A slid model in format `name`, its last layers' `parts` (a PARTS key) on disk, or none."""
    force_parts(monkeypatch, PARTS[parts] if parts else [])
    disk = dict(host_memory_limit=1.0, nvme_path=str(tmp_path / "nvme")) if parts else {}
    tmp_path.mkdir(parents=True, exist_ok=True)
    return make_pair(seed=seed, cfg_kw=CFG, optimizer_state=name, **disk, **kw)[1]


def train(model, data, ga=1, opt=None):
    opt = opt or model.create_optimizer(lr=LR, weight_decay=0.1)
    for i, b in enumerate(data):
        (model(**b).loss / ga).backward()
        if (i + 1) % ga == 0:
            opt.step()
            opt.zero_grad()
    return opt


def same_state(a, b) -> None:
    """Every optimizer state tensor of the two (the format's arrays and the step) the same bits."""
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert set(sa) == set(sb)
    for i in sb:
        assert set(sa[i]) == set(sb[i]) and {"exp_avg_absmax", "exp_avg"} <= set(sb[i])
        for k in sb[i]:
            assert torch.equal(torch.as_tensor(sa[i][k]), torch.as_tensor(sb[i][k])), (i, k)


@pytest.mark.parametrize("name", COMPACT)
@pytest.mark.parametrize("parts", ["MMM", "AAA", "MAA"])
@pytest.mark.parametrize("ga,clip", [(1, None), (2, 0.5)])
def test_compact_records_on_disk_train_as_the_same_format_in_host_memory(tmp_path, monkeypatch, name, parts, ga, clip):
    """Several steps, with accumulation and clipping: the same bits as the format in host memory;
    the records hold the format's arrays in its dtypes and move its bytes (8-bit moments: about
    2 bytes per parameter each way, not fp32's 8)."""
    on_disk = slid(tmp_path, monkeypatch, name, parts, gradient_accumulation_steps=ga, max_grad_norm=clip)
    in_ram = slid(tmp_path / "ram", monkeypatch, name, gradient_accumulation_steps=ga, max_grad_norm=clip)
    eng, fmt = on_disk.slide_engine, state_format(name)
    assert [type(p) for p in eng.places] == [DiskLayer] * 3
    disk = eng.store.disk
    for j, (u, part) in enumerate(zip(disk.units, PARTS[parts])):
        rec = disk.record(u)
        assert rec.format is fmt and rec.part == part and disk.file.layouts[j] == rec.layout
        assert [d for d, _ in rec.layout] == ([fmt.master_dtype] if part == WHOLE else []) + [
            torch.uint8, torch.uint8, torch.float32, torch.float32]
        assert rec.nbytes == disk.file.payload_bytes(j) < record_bytes(u.numel, part) * (0.3 if part == MOMENTS else 0.6)
    data = batches(3 * ga)
    a, b = train(on_disk, data, ga), train(in_ram, data, ga)
    assert max_param_diff(on_disk, in_ram) == 0.0
    same_state(a, b)
    stats = on_disk.slide_stats()
    written = sum(disk.file.payload_bytes(j) for j in range(3))
    assert 3 * written <= stats["disk_write_bytes"] <= 4 * written     # once per step (and once when created)
    assert stats["disk_read_bytes"] > 0                        # two buffers for three: read in again


@pytest.mark.parametrize("name", COMPACT)
@pytest.mark.parametrize("parts", ["MMM", "MAA"])
def test_resume_of_compact_records_on_disk_equals_the_uninterrupted_run(tmp_path, monkeypatch, name, parts):
    """A checkpoint of a model whose compact state is partly on disk resumes bit-identically,
    into the same placement and into host memory alone; one of host memory resumes on disk."""
    on_disk = slid(tmp_path, monkeypatch, name, parts, max_grad_norm=0.5)
    first, then = batches(2), batches(2, seed=3)
    opt = train(on_disk, first)
    save_training_state(str(tmp_path / "ck"), on_disk, opt)
    train(on_disk, then, opt=opt)                              # the uninterrupted run
    for target in (parts, None):
        resumed = slid(tmp_path / f"r{target}", monkeypatch, name, target, seed=7, max_grad_norm=0.5)
        ropt = resumed.create_optimizer(lr=LR, weight_decay=0.1)
        load_training_state(str(tmp_path / "ck"), resumed, ropt)
        train(resumed, then, opt=ropt)
        assert max_param_diff(resumed, on_disk) == 0.0
        same_state(ropt, opt)
    ram = slid(tmp_path / "ram", monkeypatch, name, max_grad_norm=0.5)
    ram_opt = train(ram, first)
    save_training_state(str(tmp_path / "ram_ck"), ram, ram_opt)
    resumed = slid(tmp_path / "h", monkeypatch, name, parts, seed=7, max_grad_norm=0.5)
    ropt = resumed.create_optimizer(lr=LR, weight_decay=0.1)
    load_training_state(str(tmp_path / "ram_ck"), resumed, ropt)
    train(resumed, then, opt=ropt)
    assert max_param_diff(resumed, on_disk) == 0.0


def _damage_scale(disk, u, value: float) -> None:
    """Overwrite the first exp_avg_sq scale of `u`'s record in the state file (the buffer not resident)."""
    k = disk.units.index(u)
    rec = disk.record(u)
    j = rec.arrays.index("exp_avg_sq_absmax")
    off = disk.file.slot_offset(k, 0) + 4096 + array_offsets(rec.layout)[j]
    disk.file.handle.pwrite(torch.tensor([value], dtype=torch.float32).view(torch.uint8), 4, off).result()


@pytest.mark.parametrize("name", COMPACT)
@pytest.mark.parametrize("bad", [float("nan"), -1.0])
def test_a_damaged_block_scale_on_disk_is_a_named_error(tmp_path, monkeypatch, name, bad):
    """A scale damaged in the file (its payload has no CRC) raises `CorruptOptimizerStateError`
    naming the unit and the array when the record is read in, before any update uses it."""
    on_disk = slid(tmp_path, monkeypatch, name, "MMM")
    opt = train(on_disk, batches(1))
    disk = on_disk.slide_engine.store.disk
    u = next(u for u in disk.units if not disk.is_resident(u))
    _damage_scale(disk, u, bad)
    with pytest.raises(CorruptOptimizerStateError, match=f"{u.name}'s record.*exp_avg_sq_absmax"):
        with disk.access(u):
            pass
    with pytest.raises(Exception, match="exp_avg_sq_absmax"):      # training stops with it too
        train(on_disk, batches(2, seed=3), opt=opt)


@pytest.mark.parametrize("name", COMPACT)
def test_a_torn_compact_record_is_a_named_error(tmp_path, monkeypatch, name):
    """A write that fails part-way names the file; the record it overwrote reads as lost, never
    as a mix of two generations."""
    on_disk = slid(tmp_path, monkeypatch, name, "MAA")
    train(on_disk, batches(1))
    on_disk.slide_engine.synchronize()
    disk = on_disk.slide_engine.store.disk
    disk.flush()                                              # no write of the training in flight
    u = disk.units[0]
    k = disk.units.index(u)
    start = disk.file.slot_offset(k, 0)
    orig, calls = disk.file.handle.pwrite, []

    def torn(buf, nbytes, offset):
        if start <= offset < start + 4096 + disk.file.payload_bytes(k):
            calls.append(offset)
            if len(calls) == 2:                               # the second piece of the unit's payload
                raise DiskIOError(5, f"write of {nbytes} bytes at offset {offset} of {disk.file.path} failed: simulated")
        return orig(buf, nbytes, offset)
    monkeypatch.setattr(disk.file.handle, "pwrite", torn)
    with pytest.raises(DiskIOError, match=f"{disk.file.path}.*simulated"):
        disk.file.write(k, tuple(torch.zeros(n, dtype=d) for d, n in disk.record(u).layout)).result()
    monkeypatch.setattr(disk.file.handle, "pwrite", orig)
    with pytest.raises(UnitStateError, match=f"unit {k} of .*state is lost; resume from the last checkpoint"):
        disk.file.read(k, tuple(torch.zeros(n, dtype=d) for d, n in disk.record(u).layout)).result()


def test_a_record_of_a_unit_holds_its_parameters_blocks():
    """A unit's per-block arrays count each parameter's blocks from its start (as the host store's)."""
    from hf_slideformer.host.store import ParamEntry, Unit
    u = Unit("layer.0", "layer", 1, [ParamEntry("a", torch.Size([300]), 0, 300, []),
                                      ParamEntry("b", torch.Size([10]), 300, 10, [])], numel=310)
    u.state_format = state_format("adamw_8bit_bf16")
    rec = StateRecord.of(u, WHOLE)
    assert rec.layout == ((torch.bfloat16, 310), (torch.uint8, 310), (torch.uint8, 310), (torch.float32, 3),
                          (torch.float32, 3))
    assert array_offsets(rec.layout) == [0, 4096, 8192, 12288, 16384] and rec.nbytes == 5 * 4096
    assert StateRecord(310, WHOLE).layout == ((torch.float32, 310),) * 3          # fp32 AdamW by default


@pytest.mark.gpu
@pytest.mark.parametrize("name", COMPACT)
@pytest.mark.parametrize("parts", ["MMM", "MAA"])
def test_compact_records_on_disk_train_as_in_host_memory_on_cuda(tmp_path, monkeypatch, name, parts):
    """On CUDA the records go through pinned buffers (and kvikio where it is installed), and a
    whole layer's slot copy reads its master (bf16 under adamw_8bit_bf16) from the pinned buffer:
    bf16 compute, clipping and accumulation give the same bits as the format in host memory
    (updated there too: a resident or device-updated layer's torch-ops update may round otherwise)."""
    import copy

    import hf_slideformer as hs
    from helpers import family_config
    from transformers import AutoModelForCausalLM

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(family_config("llama", **CFG)).float()
    ref.config.use_cache = False
    runs = []
    for target in (parts, None):
        force_parts(monkeypatch, PARTS[target] if target else [])
        disk = dict(host_memory_limit=1.0, nvme_path=str(tmp_path / "nvme")) if target else {}
        model = hs.slide(copy.deepcopy(ref), hs.SlideConfig(
            device="cuda", dtype=torch.bfloat16, optimizer_state=name, max_grad_norm=0.5,
            gradient_accumulation_steps=2, resident_layers=0, device_update_share=0.0, **disk))
        opt = model.create_optimizer(lr=LR, weight_decay=0.1)
        for i, b in enumerate(batches(6, bsz=2, seq=33)):
            (model(**{k: v.cuda() for k, v in b.items()}).loss / 2).backward()
            if i % 2:
                opt.step()
                opt.zero_grad()
        runs.append((model, opt))
    (on_disk, a), (in_ram, b) = runs
    stats = on_disk.slide_stats()
    assert stats["disk_layers"] == 3 and stats["disk_read_bytes"] > 0
    assert on_disk.slide_engine.store.disk.pool.count == 2
    sd_disk, sd_ram = on_disk.state_dict(), in_ram.state_dict()
    for k in sd_ram:
        assert torch.equal(sd_disk[k], sd_ram[k]), k
    same_state(a, b)
