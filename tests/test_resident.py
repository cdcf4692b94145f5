"""Resident layers (optimizer state on the compute device, updated there) against the host path."""
from types import MethodType

import torch
import pytest

import hf_slideformer as hs
from hf_slideformer.host.memory import release_pages
from hf_slideformer.engine.transfer import CudaStreams
from hf_slideformer.engine.resident import plan_resident
from hf_slideformer.checkpoints.train_checkpoint import load_training_state, save_training_state
from helpers import batches, make_pair
from test_engine import LR, PARAM_TOL, train_both

GiB = 1024 ** 3


def _train(slid, data, opt=None, sync_every=None):
    opt = opt or slid.create_optimizer(lr=LR, weight_decay=0.1)
    for k, b in enumerate(data):
        slid(**b).loss.backward()
        opt.step()
        opt.zero_grad()
        if sync_every and (k + 1) % sync_every == 0:
            slid.state_dict()                      # evicts; the next step makes them resident again
    return opt


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("embed", [False, True])
def test_resident_units_match_plain_training(tied, embed):
    ref, slid = make_pair("llama", tied, resident_layers=2, resident_embedding=embed)
    assert train_both(ref, slid, batches(4, pad=True, pad_left=True)) < PARAM_TOL


def test_resident_layers_bit_identical_to_host_updates():
    data = batches(4, pad=True)
    states = []
    for n, sync, embed in ((0, None, False), (2, None, False), (3, None, True), (0, None, True), (2, 1, True),
                           (99, 2, False)):
        _, slid = make_pair("qwen3", False, resident_layers=n, resident_embedding=embed)
        _train(slid, data, sync_every=sync)
        eng = slid.slide_engine
        if not sync:
            stats = slid.slide_stats()
            assert len(eng.residents.layers) == min(n, 3) and stats["resident_layers"] == min(n, 3)
            assert stats["resident_embedding"] == embed
            assert (stats["gpu_updated_params"] > 0) == (n > 0 or embed)
        states.append({k: v.clone() for k, v in slid.state_dict().items()})
        assert not eng.residents.layers                    # state_dict wrote them back
    for s in states[1:]:
        for k in states[0]:
            assert torch.equal(states[0][k], s[k]), k


@pytest.mark.parametrize("tied", [False, True])
def test_resident_units_checkpoint_round_trip(tmp_path, tied):
    data = batches(6, pad=True)
    kw = dict(resident_layers=2, resident_embedding=True)
    _, full = make_pair("llama", tied, **kw)
    _train(full, data)
    _, first = make_pair("llama", tied, **kw)
    opt = _train(first, data[:3])
    assert first.slide_engine.residents.layers and first.slide_engine.embedding.resident is not None
    save_training_state(str(tmp_path / "ck"), first, opt)
    _, second = make_pair("llama", tied, seed=5, **kw)
    opt2 = second.create_optimizer(lr=LR, weight_decay=0.1)
    load_training_state(str(tmp_path / "ck"), second, opt2)
    _train(second, data[3:], opt2)
    a, b = full.state_dict(), second.state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # The optimizer's own state dict carries the resident layers' moments too.
    sd = opt2.state_dict()
    assert any(float(s["exp_avg"].abs().sum()) > 0 for s in sd["state"].values())


def test_switching_to_clipping_writes_resident_state_back():
    data = batches(4, pad=True)
    states = []
    for n in (0, 2):
        _, slid = make_pair("llama", True, resident_layers=n, resident_embedding=n > 0)
        opt = _train(slid, data[:2])
        eng = slid.slide_engine
        assert len(eng.residents.layers) == n
        eng.configure_steps(1, 0.5)                # clipping: updates wait for the norm at step()
        assert not eng.residents.layers and eng.embedding.resident is None
        _train(slid, data[2:], opt)
        assert len(eng.residents.layers) == n and (eng.embedding.resident is not None) == (n > 0)   # resident again
        states.append({k: v.clone() for k, v in slid.state_dict().items()})
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]), k


@pytest.mark.parametrize("tied", [False, True])
def test_resident_units_with_clipping_match_plain_training(tied):
    ref, slid = make_pair("llama", tied, max_grad_norm=0.05, resident_layers=2, resident_embedding=True)
    assert train_both(ref, slid, batches(4, pad=True), clip=0.05) < PARAM_TOL
    assert slid.slide_stats()["gpu_updated_params"] > 0


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_resident_layers_with_accumulation_match_plain_training(tied, clip):
    """step_shape.py: [Why accumulation keeps resident layers opt-in]: the layers asked for sum
    their micro-batches on the device; the embedding stays on the host."""
    ref, slid = make_pair("llama", tied, gradient_accumulation_steps=2, max_grad_norm=clip, resident_layers=2,
                          resident_embedding=True)
    eng = slid.slide_engine
    made = []
    real = eng.residents.make_state
    eng.residents.make_state = lambda u, **k: made.append(u.name) or real(u, **k)
    assert train_both(ref, slid, batches(6, pad=True), ga=2, clip=clip) < PARAM_TOL
    assert made and set(made) == {eng.layer_units[0].name, eng.layer_units[1].name}, made   # never the embedding
    assert slid.slide_stats()["gpu_updated_params"] > 0


def test_resident_layers_with_accumulation_bit_identical_to_host_updates():
    """Without clipping the sums and the updates are the host path's, bit for bit; also with an
    eviction between micro-batches (the running sum moves to the host accumulator) and a step
    that ends before its last micro-batch."""
    data = batches(7, pad=True)
    states = []
    for layers, evict in ((0, False), (2, False), (3, True)):
        _, slid = make_pair("qwen3", False, gradient_accumulation_steps=2, resident_layers=layers)
        opt = slid.create_optimizer(lr=LR, weight_decay=0.1)
        for k, b in enumerate(data):
            slid(**b).loss.backward()
            if evict and k == 2:
                slid.state_dict()                 # mid-step: layers written back with their sums
            if k % 2 == 1 or k == len(data) - 1:  # the last step has one micro-batch of two
                opt.step()
                opt.zero_grad()
        assert len(slid.slide_engine.residents.layers) == min(layers, 3) or evict
        states.append({k: v.clone() for k, v in slid.state_dict().items()})
    for s in states[1:]:
        for k in states[0]:
            assert torch.equal(states[0][k], s[k]), k


@pytest.mark.parametrize("tied", [False, True])
def test_resident_layers_clip_an_early_accumulated_step_like_torch(tied):
    """A step that ends before its last micro-batch (a Trainer's epoch end) with clipping: the
    global norm takes the resident layers' sums from the device and the host units' from theirs."""
    from helpers import max_param_diff
    ref, slid = make_pair("llama", tied, gradient_accumulation_steps=2, max_grad_norm=0.05, resident_layers=2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    opt = slid.create_optimizer(lr=LR, weight_decay=0.0)
    for k, b in enumerate(batches(5, pad=True)):     # steps after micro-batches 2, 4 and (early) 5
        (ref(**b).loss / 2).backward()
        (slid(**b).loss / 2).backward()
        if k % 2 == 1 or k == 4:
            rn = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05))
            ropt.step(); ropt.zero_grad()
            opt.step(); opt.zero_grad()
            assert abs(slid.slide_engine.last_grad_norm() - rn) < 1e-4 * max(1.0, rn), (k, rn)
    assert slid.slide_stats()["gpu_updated_params"] > 0
    assert max_param_diff(ref, slid) < PARAM_TOL


def test_accumulation_keeps_resident_units_opt_in():
    ref, slid = make_pair("llama", True, gradient_accumulation_steps=2, max_grad_norm=0.5)
    assert slid.slide_engine.residents.plan() == (False, 0)


def test_plan_resident_layers_from_the_measured_peak():
    def plan_resident_layers(**kw):                # layers only
        return plan_resident(embed_numel=0, embed=False, **kw)[1]

    n = plan_resident_layers(limit_bytes=24 * GiB, peak_bytes=13 * GiB, layer_numel=100_000_000, n_layers=28,
                             dtype=torch.bfloat16)
    # 24 - 13 - 2.4 (margin) - 0.4 (gradient buffer) = 8.2 GiB at 1.4 GB per layer -> 6
    assert n == 6
    assert plan_resident_layers(limit_bytes=24 * GiB, peak_bytes=23 * GiB, layer_numel=10, n_layers=4,
                                dtype=torch.bfloat16) == 0
    assert plan_resident_layers(limit_bytes=140 * GiB, peak_bytes=1 * GiB, layer_numel=1000, n_layers=4,
                                dtype=torch.bfloat16) == 4


def test_plan_with_clipping_gives_each_layer_a_gradient():
    kw = dict(limit_bytes=24 * GiB, peak_bytes=13 * GiB, layer_numel=100_000_000, n_layers=28, embed_numel=0,
              dtype=torch.bfloat16, embed=False)
    # 8.6 GiB: 1.4 GB per layer and one shared 0.4 GB buffer -> 6; 1.8 GB per layer -> 5
    assert plan_resident(**kw) == (False, 6)
    assert plan_resident(clipping=True, **kw) == (False, 5)


def test_plan_puts_the_embedding_first():
    kw = dict(limit_bytes=24 * GiB, layer_numel=100_000_000, n_layers=28, embed_numel=394_000_000,
              dtype=torch.bfloat16)
    # 24 - 13 - 2.4 = 8.6 GiB: the embedding (394M x 18 B = 6.6 GiB), then one 1.4 GB layer
    assert plan_resident(peak_bytes=13 * GiB, **kw) == (True, 1)
    assert plan_resident(peak_bytes=16 * GiB, **kw) == (False, 4)       # 5.6 GiB: no embedding, 4 layers
    assert plan_resident(peak_bytes=13 * GiB, embed=False, **kw) == (False, 6)
    assert plan_resident(peak_bytes=13 * GiB, layers=0, **kw) == (True, 0)


def test_resident_layers_option_is_validated():
    for bad in (-1, "some", 1.5, True):
        with pytest.raises(ValueError, match="resident_layers"):
            hs.SlideConfig(device="cpu", resident_layers=bad)
    with pytest.raises(ValueError, match="resident_embedding"):
        hs.SlideConfig(device="cpu", resident_embedding="yes")


def test_release_pages_returns_memory_and_reads_zero():
    t = torch.ones(4 << 20)
    released = release_pages(t[1000:])
    assert released > 0
    assert float(t[:1000].sum()) == 1000.0         # the partial first page is kept
    assert float(t[1000 + 1024:-1024].sum()) == 0.0  # released pages read as zeros


def test_resident_options_from_trainer_and_launcher_strings(tmp_path):
    from hf_slideformer.accelerate_plugin import SlidePlugin
    args = hs.SlideArgs(output_dir=str(tmp_path), use_cpu=True, slide_resident_layers="3", report_to=[],
                        slide_resident_embedding="false")
    cfg = args.to_slide_config()
    assert cfg.resident_layers == 3 and cfg.resident_embedding is False
    cfg = SlidePlugin(resident_layers="auto", resident_embedding="true").to_slide_config("cpu")
    assert cfg.resident_layers == "auto" and cfg.resident_embedding is True


def test_longer_batch_than_planned_writes_resident_units_back():
    short, long = batches(2, seq=11, pad=True), batches(2, seq=17, pad=True, seed=3)
    states = []
    for n in (0, 2):
        _, slid = make_pair("llama", True, resident_layers=n, resident_embedding=n > 0)
        opt = _train(slid, short[:1])
        eng = slid.slide_engine
        eng.residents.peak, eng.residents.tokens = 1000, short[0]["input_ids"].numel()   # as measured on a GPU
        _train(slid, short[1:], opt)
        assert len(eng.residents.layers) == n
        slid(**long[0]).loss.backward()              # more tokens: the resident units went back first
        assert not eng.residents.layers and eng.embedding.resident is None
        assert eng.residents.tokens == long[0]["input_ids"].numel() and (n == 0 or eng.residents.peak > 1000)
        opt.step(); opt.zero_grad()
        assert len(eng.residents.layers) == n                # planned again after the step
        _train(slid, long[1:], opt)
        states.append({k: v.clone() for k, v in slid.state_dict().items()})
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]), k


def test_optimizer_state_dict_holds_resident_moments():
    data = batches(3, pad=True)
    sds = []
    for n, embed in ((0, False), (2, True)):
        _, slid = make_pair("llama", True, resident_layers=n, resident_embedding=embed)
        opt = _train(slid, data)
        assert len(slid.slide_engine.residents.layers) == n
        sds.append(opt.state_dict())                 # no model.state_dict() before: it must write them back
    a, b = sds
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(a["state"][k][name]), torch.as_tensor(b["state"][k][name])), (k, name)


def test_model_load_state_dict_reaches_resident_units():
    data = batches(4, pad=True)
    results = []
    for n, embed in ((0, False), (2, True)):
        _, slid = make_pair("llama", True, resident_layers=n, resident_embedding=embed)
        snapshot = {k: v.clone() for k, v in slid.state_dict().items()}
        opt = _train(slid, data[:2])
        assert len(slid.slide_engine.residents.layers) == n
        slid.load_state_dict(snapshot)               # back to the initial weights, moments kept
        _train(slid, data[2:], opt)
        results.append({k: v.clone() for k, v in slid.state_dict().items()})
    for k in results[0]:
        assert torch.equal(results[0][k], results[1][k]), k
    with pytest.raises(ValueError, match="assign"):
        slid.load_state_dict(results[1], assign=True)


def test_expandable_segments_follow_the_environment(monkeypatch):
    from hf_slideformer.host import memory
    calls = []
    monkeypatch.setattr(memory, "_set_allocator_settings", calls.append)
    monkeypatch.setattr(memory, "_expandable_set", False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64, expandable_segments:False")
    assert memory.enable_expandable_segments() is False and calls == []        # the user's choice stands
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    assert memory.enable_expandable_segments() is True and calls == []
    monkeypatch.delenv("PYTORCH_ALLOC_CONF")
    assert memory.expandable_segments_on() is False
    assert memory.enable_expandable_segments() is True and calls == ["expandable_segments:True"]
    assert memory.enable_expandable_segments() is True and len(calls) == 1      # once per process


@pytest.mark.parametrize("tied", [False, True])
def test_resident_embedding_gives_back_its_host_memory(monkeypatch, tied):
    """Once the embedding is resident, its host master, moments, dense gradient and row buffers are
    given back; an eviction writes the master back, and training goes on as on the host."""
    import hf_slideformer.engine.embedding as E
    import hf_slideformer.engine.resident as R
    released = []
    real = R.release_pages
    for module in (R, E):
        monkeypatch.setattr(module, "release_pages", lambda t: released.append(t.data_ptr()) or real(t))
    data = batches(4, pad=True)
    _, host = make_pair("llama", tied, resident_layers=0, resident_embedding=False)
    _train(host, data[:1])
    eng = host.slide_engine
    eng.worker.join()                       # the worker's embedding task has run
    assert eng.embedding.host_grad is not None           # what the resident one drops (its row scratch too, made with accumulation)
    _, slid = make_pair("llama", tied, resident_layers=0, resident_embedding=True)
    opt = _train(slid, data[:1])          # resident from the first step (the option says so)
    eng, u = slid.slide_engine, slid.slide_engine.embed_unit
    assert eng.embedding.resident is not None
    assert {u.master.data_ptr(), u.exp_avg.data_ptr(), u.exp_avg_sq.data_ptr()} <= set(released)
    assert eng.embedding.host_grad is None and eng.embedding.fwd_buf is None and all(b is None for b in eng.embedding.row_buffers)
    assert int((u.master == 0).sum()) >= 1024     # its whole pages read as zeros: nothing holds them
    _train(slid, data[1:2], opt, sync_every=1)      # evicts: the master is written back
    assert u.master.any()
    _train(slid, data[2:], opt)
    _train(host, data[1:])
    a, b = host.state_dict(), slid.state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_first_plan_decides_the_embedding_from_the_estimate(monkeypatch):
    """Before any step, "auto" asks the planner: 8B at 16 x 2048 under 24 GiB has room for the
    embedding (as the measured plan finds), 8B at 1 x 2048 under 8 GiB has not; without CUDA, no."""
    import json
    import os
    _, slid = make_pair("llama", False)
    eng = slid.slide_engine
    assert eng.residents.first_embed_plan(32768) is False                 # a CPU device: measure first
    with open(os.path.join(os.path.dirname(__file__), "..", "benchmarks", "configs", "llama3-8b.json")) as f:
        eng.residents.model_config = json.load(f)
    monkeypatch.setattr(eng.streams, "plan_resident", MethodType(CudaStreams.plan_resident, eng.streams))   # as on CUDA
    monkeypatch.setattr(eng.config, "activation_tier", "cpu")    # what "auto" is on CUDA
    for cap, tokens, want in ((24, 16 * 2048, True), (8, 2048, False)):
        monkeypatch.setattr(eng.config, "gpu_memory_limit", cap)
        assert eng.residents.first_embed_plan(tokens) is want, (cap, tokens)
    monkeypatch.setattr(eng.config, "resident_embedding", False)
    assert eng.residents.first_embed_plan(16 * 2048) is False             # the option decides when set
    eng.residents.model_config = {"model_type": "llama"}                  # unreadable: measure first
    monkeypatch.setattr(eng.config, "resident_embedding", "auto")
    assert eng.residents.first_embed_plan(16 * 2048) is False


@pytest.mark.parametrize("name,per,layers", [("adamw", 12, 1), ("adamw_8bit", 6.03125, 2), ("adamw_8bit_bf16", 8.03125, 1)])
def test_the_measured_plan_sizes_layers_by_the_format_s_bytes_and_says_what_it_read(monkeypatch, name, per, layers):
    """The engine's plan from one measured peak: a resident layer takes its format's GPU bytes (fp32
    compute here: the fp32 master is the weights; a bf16 master keeps fp32 weights beside it), so a
    compact format keeps at least as many layers as fp32 AdamW in the same room; slide_stats()
    reports what the plan read."""
    from hf_slideformer.engine import resident
    from hf_slideformer.host.memory import GiB
    _, slid = make_pair("llama", False, optimizer_state=name, resident_embedding=False)
    eng = slid.slide_engine
    numel = max(u.numel for u in eng.layer_units)
    budget = int(4 * numel + 12 * numel * 1.2)                    # one shared gradient, 1.2 fp32 layers
    monkeypatch.setattr(eng.streams, "plan_resident", MethodType(CudaStreams.plan_resident, eng.streams))   # as on CUDA
    monkeypatch.setattr(eng.config, "gpu_memory_limit", 4)
    monkeypatch.setattr(resident, "measured_peak", lambda device: 2 * GiB - budget)     # the margin: 2 GiB
    monkeypatch.setattr(resident, "allocated_peak", lambda device: GiB)
    assert eng.residents.plan() == (False, layers)
    stats = slid.slide_stats()["resident_plan"]
    assert stats == {"limit_bytes": 4 * GiB, "peak_bytes": 2 * GiB - budget, "allocated_peak_bytes": GiB,
                     "layer_bytes_per_param": per, "held_bytes": 0, "embedding": False, "layers": layers}
    # A share updated in the backward holds one layer's gradients more (device_update.py): less room.
    monkeypatch.setattr(eng.config, "device_update_share", 0.5)
    fewer = eng.residents.plan()[1]
    held = slid.slide_stats()["resident_plan"]["held_bytes"]
    assert held == numel * eng.dtype.itemsize and fewer == int((budget - 4 * numel - held) // (numel * per)) <= layers


def test_resident_embedding_from_the_first_step_never_uses_host_gradients():
    data = batches(3, pad=True)
    _, slid = make_pair("llama", True, resident_layers=0, resident_embedding=True)
    opt = slid.create_optimizer(lr=1e-2)
    slid(**data[0]).loss.backward()
    eng = slid.slide_engine
    assert eng.embedding.resident is not None            # before the first update
    opt.step()
    opt.zero_grad()
    assert eng.embedding.grad is None and eng.embedding.host_grad is None and all(b is None for b in eng.embedding.row_buffers)


def _resident_pages(t: torch.Tensor) -> int:
    """Pages of the whole pages inside CPU tensor `t` that are backed by memory (mincore)."""
    import ctypes
    import mmap
    page = mmap.PAGESIZE
    a = (t.data_ptr() + page - 1) // page * page
    b = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    n = max(0, (b - a) // page)
    if n == 0:
        return 0
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(a), ctypes.c_size_t(b - a), vec) == 0
    return sum(v & 1 for v in vec)


def test_resident_units_never_touch_their_host_moments_and_accumulators():
    """With clipping, resident layers keep their gradient on the device: their host accumulators
    and moments are never written, so (mapped, not zeroed) they take no host memory; the host-held
    layers' do."""
    from transformers import AutoModelForCausalLM
    import copy
    from hf_slideformer.demo import tiny_config
    torch.manual_seed(0)
    cfg = tiny_config("llama", vocab_size=97, hidden_size=128, intermediate_size=256, num_hidden_layers=3)
    model = AutoModelForCausalLM.from_config(cfg).float()
    slid = hs.slide(copy.deepcopy(model), hs.SlideConfig(device="cpu", dtype=torch.float32, max_grad_norm=1.0,
                                                         resident_layers=1, resident_embedding=True))
    _train(slid, batches(2, pad=True))
    eng = slid.slide_engine
    assert 0 in eng.residents.layers
    res, host = eng.layer_units[0], eng.layer_units[2]
    assert _resident_pages(res.grad) == 0 and _resident_pages(host.grad) > 0
    assert _resident_pages(eng.embed_unit.exp_avg) == 0 and _resident_pages(host.exp_avg) > 0


@pytest.mark.parametrize("tied,layers", [(False, 0), (True, 0), (False, 1)])
def test_first_layer_input_gathered_again_from_the_resident_embedding(tied, layers):
    """activations.py: [Why the first layer's input can be gathered again]: the cpu tier keeps a
    recipe for x_0, not a copy; training is bit-identical to the host embedding's, also when the
    embedding leaves the device between a forward and its backward (state_dict() mid-step)."""
    data = batches(4, pad=True)
    states = []
    for embed, evict_at in ((False, None), (True, None), (True, 1)):
        _, slid = make_pair("llama", tied, resident_layers=layers if embed else 0, resident_embedding=embed,
                            activation_tier="cpu")
        eng, opt = slid.slide_engine, slid.create_optimizer(lr=LR, weight_decay=0.1)
        for k, b in enumerate(data):
            loss = slid(**b).loss
            assert (0 in eng.tier.remade) == embed
            if embed and evict_at is None:
                assert 0 not in eng.tier.host
            if k == evict_at:
                slid.state_dict()                  # writes the embedding back: x_0 is saved first
                assert not eng.tier.remade and 0 in eng.tier.host
            loss.backward()
            opt.step()
            opt.zero_grad()
        states.append({k: v.clone() for k, v in slid.state_dict().items()})
    for s in states[1:]:
        for k in states[0]:
            assert torch.equal(states[0][k], s[k]), k


def test_scaled_embedding_input_is_saved_as_a_tensor(monkeypatch):
    """A model that changes the embedding's output before layer 0 (Gemma scales it) gets x_0 saved."""
    _, slid = make_pair("llama", False, resident_layers=0, resident_embedding=True, activation_tier="cpu")
    eng = slid.slide_engine
    real = eng.embedding.forward
    monkeypatch.setattr(eng.embedding, "forward", lambda *a, **k: real(*a, **k) * 2.0)
    slid.create_optimizer(lr=LR)
    (b,) = batches(1)
    slid(**b).loss.backward()
    assert 0 in eng.tier.host and not eng.tier.remade
