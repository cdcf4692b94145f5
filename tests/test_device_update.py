"""Clipping-mode updates of part of the layers on the device, as they are copied in for the next
forward (device_update.py). On the CPU device the same code path runs with CPU tensors and the
CPU's fused AdamW, cut into the same pieces as the worker's: results are bit-identical to the
host path, which is what these tests hold it to."""
import math

import pytest
import torch

import hf_slideformer as hs
from hf_slideformer.engine import device_update
from hf_slideformer.engine.device_update import balanced_share, pick_device_units
from helpers import batches, make_pair
from test_engine import PARAM_TOL, train_both


def _state(slid):
    return {k: v.clone() for k, v in slid.state_dict().items()}


@pytest.mark.parametrize("tied", [False, True])
def test_device_updates_bit_identical_to_host_updates(tied, monkeypatch):
    data = batches(4, pad=True)
    ref, host = make_pair("llama", tied, max_grad_norm=0.3, device_update_share=0.0)
    assert train_both(ref, host, data, clip=0.3) < PARAM_TOL
    assert not host.slide_engine.device_updates.units
    # Small pieces: several per layer, through both sets of device buffers.
    monkeypatch.setattr(device_update, "DEVICE_PIECE", 256)
    for share, expect in ((0.5, [1, 3]), (1.0, [1, 2, 3])):
        ref2, dev = make_pair("llama", tied, max_grad_norm=0.3, device_update_share=share)
        assert train_both(ref2, dev, data, clip=0.3) < PARAM_TOL
        eng = dev.slide_engine
        assert sorted(eng.device_updates.units) == expect       # unit indices: the embedding is unit 0
        assert eng.stats.gpu_adam_params > 0
        a, b = _state(host), _state(dev)
        for k in a:
            assert torch.equal(a[k], b[k]), k


def test_pending_device_updates_are_flushed_before_the_state_is_read():
    """After optimizer.step() the device layers' updates wait for the next forward; the state dict,
    a checkpoint or a mode change must see them applied."""
    data = batches(3, pad=True)
    _, host = make_pair("llama", False, max_grad_norm=0.3, device_update_share=0.0)
    _, dev = make_pair("llama", False, max_grad_norm=0.3, device_update_share=1.0)
    opts = [m.create_optimizer(lr=1e-2) for m in (host, dev)]
    for b in data[:2]:
        for m, o in zip((host, dev), opts):
            m(**b).loss.backward(); o.step(); o.zero_grad()
    eng = dev.slide_engine
    assert eng.device_updates.pending()
    a, b = _state(host), _state(dev)                 # flushes
    assert not eng.device_updates.pending()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    sa, sb = opts[0].state_dict()["state"], opts[1].state_dict()["state"]
    for i in sa:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(sa[i][key]), torch.as_tensor(sb[i][key])), (i, key)
    # Switching clipping off flushes and drops the device layers; the next step picks them again
    # (their updates then run in the backward); training goes on identically.
    for m, o in zip((host, dev), opts):
        m(**data[2]).loss.backward(); o.step(); o.zero_grad()
        m.slide_engine.configure_steps(1, None)
        m(**data[0]).loss.backward(); o.step(); o.zero_grad()
        m(**data[1]).loss.backward(); o.step(); o.zero_grad()
    assert sorted(eng.device_updates.units) == [1, 2, 3]
    a, b = _state(host), _state(dev)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("optim", ["adamw", "adamw_8bit", "adamw_8bit_bf16"])
@pytest.mark.parametrize("tied", [False, True])
def test_updates_in_backward_on_the_device_bit_identical_to_host_updates(tied, optim, monkeypatch):
    """Without clipping (one backward per step) a device layer is updated in the backward, from its
    gradient still on the device: the same state as the worker's update, step counters included."""
    data = batches(4, pad=True)
    monkeypatch.setattr(device_update, "DEVICE_PIECE", 256)
    _, host = make_pair("llama", tied, device_update_share=0.0, optimizer_state=optim)
    _, dev = make_pair("llama", tied, device_update_share=0.5, optimizer_state=optim)
    opts = [m.create_optimizer(lr=1e-2) for m in (host, dev)]
    for b in data:
        for m, o in zip((host, dev), opts):
            loss = m(**b).loss
            loss.backward(); o.step(); o.zero_grad()
        assert host.slide_engine.last_grad_norm() == dev.slide_engine.last_grad_norm()
    eng = dev.slide_engine
    assert sorted(eng.device_updates.units) == [1, 3]
    assert eng.stats.gpu_adam_params > 0 and not host.slide_engine.stats.gpu_adam_params
    a, b = _state(host), _state(dev)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    sa, sb = opts[0].state_dict()["state"], opts[1].state_dict()["state"]
    for i in sa:
        assert sa[i].keys() == sb[i].keys()
        for key in sa[i]:
            assert torch.equal(torch.as_tensor(sa[i][key]), torch.as_tensor(sb[i][key])), (i, key)


def test_a_large_layer_is_cut_into_larger_pieces(monkeypatch):
    """A layer of more than DEVICE_PIECES_MAX pieces is cut into larger ones (budget.py: [Why a large
    layer's pieces are larger]): the device buffers grow with them and the state stays the worker's."""
    from hf_slideformer.planner import budget

    data = batches(3, pad=True)
    monkeypatch.setattr(device_update, "DEVICE_PIECE", 256)
    monkeypatch.setattr(budget, "DEVICE_PIECES_MAX", 4)
    _, host = make_pair("llama", False, device_update_share=0.0, optimizer_state="adamw_8bit_bf16")
    _, dev = make_pair("llama", False, device_update_share=0.5, optimizer_state="adamw_8bit_bf16")
    opts = [m.create_optimizer(lr=1e-2) for m in (host, dev)]
    for b in data:
        for m, o in zip((host, dev), opts):
            m(**b).loss.backward(); o.step(); o.zero_grad()
    eng = dev.slide_engine
    largest = max(u.numel for u in eng.layer_units)
    piece = budget.device_piece(largest, 256)
    assert piece > 256 and largest <= 4 * piece < 2 * largest
    assert eng.device_updates.pieces.sets[0].numel == min(2 * piece, largest)
    assert eng.stats.gpu_adam_params > 0
    a, b = _state(host), _state(dev)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_updates_in_backward_match_hf_adamw():
    ref, dev = make_pair("llama", False, device_update_share=1.0)
    assert train_both(ref, dev, batches(3, pad=True)) < PARAM_TOL
    assert sorted(dev.slide_engine.device_updates.units) == [1, 2, 3]


def test_a_non_finite_gradient_skips_the_device_update_in_backward(caplog):
    """A non-finite running norm leaves a device layer's master, moments and step counter as they
    were (nonfinite_grads='skip'), as the worker does for its layers."""
    data = batches(3, pad=True)
    _, dev = make_pair("llama", False, device_update_share=1.0)
    opt = dev.create_optimizer(lr=1e-2)
    for b in data[:2]:
        dev(**b).loss.backward(); opt.step(); opt.zero_grad()
    before = _state(dev)
    steps = {i: torch.as_tensor(st["step"]).clone() for i, st in opt.state_dict()["state"].items()}
    loss = dev(**data[2]).loss
    (loss * float("nan")).backward()
    opt.step(); opt.zero_grad()
    after = _state(dev)
    layer_keys = [k for k in before if ".layers." in k]
    assert layer_keys
    for k in layer_keys:
        assert torch.equal(before[k], after[k]), k
    for i, st in opt.state_dict()["state"].items():
        assert torch.equal(torch.as_tensor(st["step"]), steps[i]), i


def test_balanced_share_and_pick():
    # The H200 host: 43 GB/s both ways, 2.5 G parameters/s of CPU AdamW with the clip factor.
    assert math.isclose(balanced_share(43e9, 2.5e9), 33 / 73)
    assert balanced_share(10e9, 5e9) == 0.0 and balanced_share(1e12, 1e6) == pytest.approx(1.0, abs=1e-4)
    units = list(range(10))
    assert pick_device_units(units, 0.5) == [0, 2, 4, 6, 8]
    assert pick_device_units(units, 0.4) == [0, 2, 5, 7]
    assert pick_device_units(units, 1.0) == units and pick_device_units(units, 0.0) == []


@pytest.mark.parametrize("bad", [-0.1, 1.5, "half", True])
def test_device_update_share_validated(bad):
    with pytest.raises(ValueError, match="device_update_share"):
        hs.SlideConfig(device="cpu", device_update_share=bad)


@pytest.mark.parametrize("tied", [False, True])
def test_device_updates_with_accumulation(tied, monkeypatch):
    """Accumulation and clipping: the worker folds each micro-batch into the device layers' pinned
    accumulators and takes the norm; the device update waits for its clip factor. The worker is
    slowed down so that optimizer.step() returns before it has folded the last micro-batch in."""
    import time
    from hf_slideformer.host.host_tasks import HostUpdates
    monkeypatch.setattr(device_update, "DEVICE_PIECE", 256)
    consume = HostUpdates.consume
    monkeypatch.setattr(HostUpdates, "consume", lambda *a, **k: (time.sleep(0.01), consume(*a, **k))[1])
    data = batches(6, pad=True)
    states = []
    for share in (0.0, 0.5):
        ref, slid = make_pair("llama", tied, gradient_accumulation_steps=3, max_grad_norm=0.5,
                              device_update_share=share)
        assert train_both(ref, slid, data, ga=3, clip=0.5) < PARAM_TOL
        assert sorted(slid.slide_engine.device_updates.units) == ([] if share == 0 else [1, 3])
        states.append(_state(slid))
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]), k


def test_device_layers_beside_resident_layers(monkeypatch):
    """Layer 0 resident (updated on the device from its own copy), the others device-updated from
    pinned host buffers: the same state as the host path with the same resident layer."""
    monkeypatch.setattr(device_update, "DEVICE_PIECE", 512)
    data = batches(4, pad=True)
    states = []
    for share in (0.0, 1.0):
        ref, slid = make_pair("llama", True, max_grad_norm=0.3, resident_layers=1, resident_embedding=True,
                              device_update_share=share)
        assert train_both(ref, slid, data, clip=0.3) < PARAM_TOL
        assert sorted(slid.slide_engine.device_updates.units) == ([] if share == 0 else [2, 3])
        states.append(_state(slid))
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]), k


@pytest.mark.parametrize("ga", [1, 2])
def test_checkpoint_with_pending_device_updates_resumes_bit_identically(tmp_path, ga, monkeypatch):
    """A training checkpoint taken right after optimizer.step(), with the device layers' updates
    still pending, holds them applied; a fresh process resumes from it to the same weights."""
    from hf_slideformer.checkpoints.train_checkpoint import load_training_state, save_training_state
    monkeypatch.setattr(device_update, "DEVICE_PIECE", 512)
    data = batches(4 * ga, pad=True)
    kw = dict(gradient_accumulation_steps=ga, max_grad_norm=0.3, device_update_share=1.0)

    def train(model, opt, chunk):
        for n, b in enumerate(chunk):
            (model(**b).loss / ga).backward()
            if (n + 1) % ga == 0:
                opt.step(); opt.zero_grad()

    _, full = make_pair("llama", False, **kw)
    opt = full.create_optimizer(lr=1e-2, weight_decay=0.1)
    train(full, opt, data)
    _, first = make_pair("llama", False, **kw)
    opt1 = first.create_optimizer(lr=1e-2, weight_decay=0.1)
    train(first, opt1, data[:2 * ga])
    assert first.slide_engine.device_updates.pending()
    save_training_state(str(tmp_path / "ck"), first, opt1)
    _, second = make_pair("llama", False, seed=7, **kw)
    opt2 = second.create_optimizer(lr=1e-2, weight_decay=0.1)
    load_training_state(str(tmp_path / "ck"), second, opt2)
    train(second, opt2, data[2 * ga:])
    assert second.slide_engine.device_updates.units
    a, b = _state(full), _state(second)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_device_update_stopped_half_way_resumes(monkeypatch):
    """An error in the middle of a device update (here: the third piece's AdamW call) leaves its
    slot unfilled; the next forward finishes the update and loads the whole layer, so training
    goes on as if nothing had happened."""
    from hf_slideformer.host import optim
    monkeypatch.setattr(device_update, "DEVICE_PIECE", 256)
    data = batches(4, pad=True)
    _, host = make_pair("llama", False, max_grad_norm=0.3, device_update_share=0.0)
    _, dev = make_pair("llama", False, max_grad_norm=0.3, device_update_share=1.0)
    opts = [m.create_optimizer(lr=1e-2) for m in (host, dev)]
    for m, o in zip((host, dev), opts):
        for b in data[:2]:
            m(**b).loss.backward(); o.step(); o.zero_grad()
    calls, real = [0], optim.apply_batch

    def failing(*a, **k):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("injected")
        return real(*a, **k)
    monkeypatch.setattr(optim, "apply_batch", failing)
    with pytest.raises(RuntimeError, match="injected"):
        dev(**data[2]).loss.backward()
    assert any(done for _, done in dev.slide_engine.device_updates.pending())
    for slot in dev.slide_engine.slots.slots:       # what the stopped fill wrote there must not count
        slot.flat.zero_()
    for m, o in zip((host, dev), opts):
        for b in data[2:]:
            m(**b).loss.backward(); o.step(); o.zero_grad()
    a, b = _state(host), _state(dev)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("optim", ["adamw", "adamw_8bit_bf16"])
def test_checkpoint_of_updates_in_backward_resumes_bit_identically(tmp_path, optim, monkeypatch):
    """Without clipping: a training checkpoint after some steps with layers updated on the device in
    the backward resumes in a fresh model to the uninterrupted run's weights (the step counters
    the device advanced included)."""
    from hf_slideformer.checkpoints.train_checkpoint import load_training_state, save_training_state
    monkeypatch.setattr(device_update, "DEVICE_PIECE", 512)
    data = batches(4, pad=True)
    kw = dict(device_update_share=0.5, optimizer_state=optim)

    def train(model, opt, chunk):
        for b in chunk:
            model(**b).loss.backward(); opt.step(); opt.zero_grad()

    _, full = make_pair("llama", False, **kw)
    opt = full.create_optimizer(lr=1e-2, weight_decay=0.1)
    train(full, opt, data)
    _, first = make_pair("llama", False, **kw)
    opt1 = first.create_optimizer(lr=1e-2, weight_decay=0.1)
    train(first, opt1, data[:2])
    assert first.slide_engine.device_updates.units
    save_training_state(str(tmp_path / "ck"), first, opt1)
    _, second = make_pair("llama", False, seed=7, **kw)
    opt2 = second.create_optimizer(lr=1e-2, weight_decay=0.1)
    load_training_state(str(tmp_path / "ck"), second, opt2)
    train(second, opt2, data[2:])
    assert second.slide_engine.device_updates.units
    a, b = _state(full), _state(second)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_updates_in_backward_beside_resident_and_disk_layers(tmp_path, monkeypatch):
    """Without clipping, device layers are picked among the plain host layers only: a resident
    layer and the layers whose state is on disk keep their own update; the result is the host
    run's."""
    from hf_slideformer.host import store
    monkeypatch.setattr(store, "plan_disk_units", lambda units, config: [
        (u, "moments") for u in [u for u in units if u.kind == "layer"][2:]] if config.host_memory_limit else [])
    data = batches(3, pad=True)
    kw = dict(resident_layers=1, host_memory_limit=1.0, nvme_path=str(tmp_path))
    _, host = make_pair("llama", False, device_update_share=0.0, **kw)
    _, dev = make_pair("llama", False, device_update_share=1.0, **kw)
    opts = [m.create_optimizer(lr=1e-2) for m in (host, dev)]
    for b in data:
        for m, o in zip((host, dev), opts):
            m(**b).loss.backward(); o.step(); o.zero_grad()
    assert sorted(dev.slide_engine.device_updates.units) == [2]      # layer 1: layer 0 resident, layer 2 on disk
    stats = dev.slide_stats()
    assert stats["disk_layers"] == 1 and stats["resident_layers"] == 1 and stats["device_updated_layers"] == 1
    a, b = _state(host), _state(dev)
    for k in a:
        assert torch.equal(a[k], b[k]), k
