"""Resident and device-updated layers under the compact state formats (resident_state.py,
device_update.py, adam8_torch.py): on the CPU device their update in torch ops is the host
kernel's bit for bit, so a run with those placements equals the host-only run of its format."""
import pytest
import torch

from hf_slideformer.engine import device_update
from hf_slideformer.checkpoints.train_checkpoint import load_training_state, save_training_state
from helpers import batches, make_pair

COMPACT = ["adamw_8bit", "adamw_8bit_bf16"]
LR = 1e-2


def _train(slid, data, opt=None):
    opt = opt or slid.create_optimizer(lr=LR, weight_decay=0.1)
    for b in data:
        slid(**b).loss.backward()
        opt.step()
        opt.zero_grad()
    return opt


def _state(slid, opt):
    out = {f"w/{k}": v.clone() for k, v in slid.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        out.update({f"s/{i}/{k}": torch.as_tensor(v).clone() for k, v in s.items()})
    return out


def _equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("name", COMPACT)
@pytest.mark.parametrize("clip", [None, 0.3])
def test_resident_layers_in_a_compact_format_equal_the_host_run(name, clip):
    data = batches(4, pad=True)
    states = []
    for n in (0, 2, 99):
        _, slid = make_pair("qwen3", False, optimizer_state=name, resident_layers=n, max_grad_norm=clip)
        opt = _train(slid, data)
        eng = slid.slide_engine
        layers = eng.residents.layers
        assert len(layers) == min(n, 3) and slid.slide_stats()["gpu_updated_params"] > 0 if n else True
        for r in layers.values():                 # the device copy keeps the format's arrays
            assert r.exp_avg.dtype == torch.uint8 and r.master.dtype == r.unit.master.dtype
        states.append(_state(slid, opt))
        assert not eng.residents.layers              # the state dict wrote them back
    for s in states[1:]:
        _equal(states[0], s)


@pytest.mark.parametrize("name", COMPACT)
def test_device_updated_layers_in_a_compact_format_equal_the_host_run(name, monkeypatch):
    monkeypatch.setattr(device_update, "DEVICE_PIECE", 256)      # several pieces a layer, both buffer sets
    data = batches(4, pad=True)
    states = []
    for share in (0.0, 0.5, 1.0):
        _, slid = make_pair("llama", False, optimizer_state=name, max_grad_norm=0.3, device_update_share=share)
        opt = _train(slid, data)
        eng = slid.slide_engine
        assert bool(eng.device_updates.units) == (share > 0)
        states.append(_state(slid, opt))
    for s in states[1:]:
        _equal(states[0], s)


@pytest.mark.parametrize("name", COMPACT)
@pytest.mark.parametrize("kw", [dict(resident_layers=2), dict(max_grad_norm=0.3, device_update_share=0.5)])
def test_compact_gpu_placements_resume_exactly(tmp_path, name, kw, monkeypatch):
    monkeypatch.setattr(device_update, "DEVICE_PIECE", 256)
    data = batches(6, pad=True)
    _, full = make_pair("llama", False, optimizer_state=name, **kw)
    opt_full = _train(full, data)
    _, first = make_pair("llama", False, optimizer_state=name, **kw)
    opt = _train(first, data[:3])
    eng = first.slide_engine
    assert eng.residents.layers or eng.device_updates.units
    save_training_state(str(tmp_path / "ck"), first, opt)
    _, second = make_pair("llama", False, seed=5, optimizer_state=name, **kw)
    opt2 = second.create_optimizer(lr=LR, weight_decay=0.1)
    load_training_state(str(tmp_path / "ck"), second, opt2)
    _train(second, data[3:], opt2)
    _equal(_state(full, opt_full), _state(second, opt2))
