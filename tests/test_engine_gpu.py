"""The engine on CUDA: fp32 equivalence through the real streams, bf16 against fp32 training with
stated tolerances, bit-identical results under artificially slow streams, and the offload tiers."""
import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_slideformer as hs
from hf_slideformer.demo import tiny_config
from helpers import batches, max_param_diff

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_tf32")]
LR = 1e-3


def _pair(dtype, tied=False, model_type="llama", **kw):
    torch.manual_seed(0)
    cfg = tiny_config(model_type, vocab_size=1001, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=tied)
    ref = AutoModelForCausalLM.from_config(cfg).float()
    slid = hs.slide(copy.deepcopy(ref), hs.SlideConfig(device="cuda", dtype=dtype, **kw))
    return ref.cuda(), slid


def _run(ref, slid, data, clip=None):
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    opt = slid.create_optimizer(lr=LR, weight_decay=0.01)
    losses = []
    for b in data:
        b = {k: v.cuda() for k, v in b.items()}
        r = ref(**b).loss
        r.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ropt.step(); ropt.zero_grad()
        s = slid(**b).loss
        s.backward(); opt.step(); opt.zero_grad()
        losses.append((s.item(), r.item()))
    return losses




HOST_ONLY = {"resident_layers": 0, "resident_embedding": False}


@pytest.mark.parametrize("tied,clip,resident", [(False, None, HOST_ONLY), (False, None, {}), (True, None, HOST_ONLY),
                                                (True, None, {"resident_layers": 2}), (True, 0.5, {}),
                                                (False, 0.5, dict(HOST_ONLY, device_update_share=0.5)),
                                                (True, 0.5, {"resident_layers": 1, "device_update_share": 1.0}),
                                                (False, None, dict(HOST_ONLY, device_update_share=0.5)),
                                                (True, None, {"resident_layers": 1, "device_update_share": 1.0})])
def test_fp32_cuda_matches_plain_pytorch(tied, clip, resident):
    ref, slid = _pair(torch.float32, tied, max_grad_norm=clip, use_kernels=False, **resident)
    losses = _run(ref, slid, batches(4, bsz=3, seq=67, vocab=1001, pad=True), clip)
    for s, r in losses:
        assert math.isclose(s, r, rel_tol=1e-4), losses
    assert max_param_diff(ref.cpu(), slid) < 0.05 * LR


@pytest.mark.parametrize("kernels", [False, True])
def test_bf16_tracks_fp32_training(kernels):
    """bf16 compute with fp32 masters vs fp32 training: losses within 2% per step, the mean
    parameter difference under 5% of one lr step, the largest under 2 lr steps per step."""
    ref, slid = _pair(torch.bfloat16, True, use_kernels=kernels)
    steps = 4
    losses = _run(ref, slid, batches(steps, bsz=4, seq=128, vocab=1001, pad=True))
    for s, r in losses:
        assert abs(s - r) / r < 2e-2, losses
    sd, rsd = slid.state_dict(), ref.cpu().state_dict()
    diffs = torch.cat([(sd[k] - rsd[k]).abs().flatten() for k in rsd])
    assert diffs.mean().item() < 0.05 * LR and diffs.max().item() < 2 * LR * steps, (diffs.mean(), diffs.max())


def _train_state(slow: bool, tier="cpu", steps=4, models=None, ga=1, **kw):
    import hf_slideformer.engine.slide_engine as E
    import hf_slideformer.engine.slots as S
    _, slid = _pair(torch.bfloat16, False, activation_tier=tier, gradient_accumulation_steps=ga, **kw)
    if models is not None:
        models.append(slid)
    opt = slid.create_optimizer(lr=LR)
    if slow:
        # Note: [Why the slot waits for the compute event] and friends: make the compute and the
        # copy streams slow on purpose; a buffer reused before its reader finished changes the result.
        from hf_slideformer.engine.device_update import DeviceUpdater
        from hf_slideformer.engine.device_pieces import PieceSets
        from hf_slideformer.engine.grad_ring import GradientRing
        from hf_slideformer.engine.resident import ResidentLayer
        call, load_steps, d2h = E.SlideEngine.call_layer, S.SlotQueue.load_steps, GradientRing.d2h
        res = ResidentLayer.take_gradient

        def slow_call(self, *a, **k):
            torch.cuda._sleep(3_000_000)
            return call(self, *a, **k)

        def slow_load_steps(self, *a, **k):       # every chunk of every slot copy (load() uses it)
            steps = load_steps(self, *a, **k)
            while True:
                with torch.cuda.stream(self.streams.h2d):
                    torch.cuda._sleep(1_000_000)
                try:
                    next(steps)
                except StopIteration:
                    return
                yield

        def slow_d2h(self, *a, **k):
            with torch.cuda.stream(self.engine.streams.d2h):
                torch.cuda._sleep(2_000_000)
            return d2h(self, *a, **k)

        def slow_res(self, *a, **k):
            with torch.cuda.stream(self.engine.streams.d2h):
                torch.cuda._sleep(2_000_000)
            return res(self, *a, **k)

        dev_run, dev_piece = DeviceUpdater.run, PieceSets.update

        def slow_dev_run(self, *a, **k):          # each piece's write-back starts late
            for _ in dev_run(self, *a, **k):
                with torch.cuda.stream(self.engine.streams.d2h):
                    torch.cuda._sleep(1_000_000)
                yield

        def slow_dev_piece(self, *a, **k):        # each piece's copies in and its write-back start late
            for s in (self.streams.h2d, self.streams.d2h):
                with torch.cuda.stream(s):
                    torch.cuda._sleep(1_000_000)
            return dev_piece(self, *a, **k)

        E.SlideEngine.call_layer, S.SlotQueue.load_steps, GradientRing.d2h = slow_call, slow_load_steps, slow_d2h
        ResidentLayer.take_gradient = slow_res
        DeviceUpdater.run, PieceSets.update = slow_dev_run, slow_dev_piece
    try:
        for n, b in enumerate(batches(steps, bsz=4, seq=128, vocab=1001, pad=True)):
            slid(**{k: v.cuda() for k, v in b.items()}).loss.backward()
            if (n + 1) % ga == 0:
                opt.step(); opt.zero_grad()
    finally:
        if slow:
            E.SlideEngine.call_layer, S.SlotQueue.load_steps, GradientRing.d2h = call, load_steps, d2h
            ResidentLayer.take_gradient = res
            DeviceUpdater.run, PieceSets.update = dev_run, dev_piece
    return {k: v.clone() for k, v in slid.state_dict().items()}


@pytest.mark.parametrize("kw", [HOST_ONLY, {"resident_layers": 2}, {"max_grad_norm": 1.0},
                                {"window": 3}, {"ga": 2, "steps": 6}, {"ga": 3, "steps": 6, "max_grad_norm": 1.0}])
def test_slow_streams_bit_identical(kw):
    fast, slow = _train_state(False, **kw), _train_state(True, **kw)
    for k in fast:
        assert torch.equal(fast[k], slow[k]), k


def _slow_copies_out(monkeypatch, cycles=30_000_000):
    """Every gradient and layer-input copy to the host starts late (about 15 ms), the compute
    stream runs at full speed."""
    from hf_slideformer.engine.activations import PinnedCpuTier
    from hf_slideformer.engine.grad_ring import GradientRing
    d2h, act = GradientRing.d2h, PinnedCpuTier._d2h

    def late(streams):
        with torch.cuda.stream(streams.d2h):
            torch.cuda._sleep(cycles)

    def slow_d2h(self, *a, **k):
        late(self.engine.streams)
        return d2h(self, *a, **k)

    def slow_act(self, *a, **k):
        late(self.streams)
        return act(self, *a, **k)

    monkeypatch.setattr(GradientRing, "d2h", slow_d2h)
    monkeypatch.setattr(PinnedCpuTier, "_d2h", slow_act)


@pytest.mark.parametrize("kw", [HOST_ONLY, {"ga": 2, "steps": 6}, {"max_grad_norm": 1.0}])
def test_copy_sources_wait_for_their_copies(monkeypatch, kw):
    """transfer.py: [Why copy sources are handed over, not recorded]: with the copies to the host
    held back and the compute stream at full speed, a gradient or layer input whose memory served a
    later tensor before its copy ran would change the result; and after each backward nothing is
    owed to a copy."""
    fast = _train_state(False, **kw)
    models = []
    _slow_copies_out(monkeypatch)
    slow = _train_state(False, models=models, **kw)
    for k in fast:
        assert torch.equal(fast[k], slow[k]), k
    assert models[0].slide_engine.streams.owed == 0


@pytest.mark.parametrize("ga,clip,optim", [(1, 1.0, "adamw"), (2, 1.0, "adamw"), (1, None, "adamw"),
                                           (1, None, "adamw_8bit_bf16")])
def test_device_updates_under_slow_streams(monkeypatch, ga, clip, optim):
    """Half the layers updated on the GPU in pieces of 16 k elements through the two alternating
    sets of device buffers: with clipping as they are copied in (and with accumulation, the
    worker folding the micro-batches into the pinned accumulators), without it in the backward
    from the gradients on the device. With the compute, h2d and d2h streams slowed down on purpose
    the result is bit-identical."""
    from hf_slideformer.engine import device_update
    monkeypatch.setattr(device_update, "DEVICE_PIECE", 1 << 14)
    kw = dict(HOST_ONLY, max_grad_norm=clip, device_update_share=0.5, ga=ga, steps=4 * ga, optimizer_state=optim)
    models = []
    fast, slow = _train_state(False, models=models, **kw), _train_state(True, models=models, **kw)
    for m in models:
        assert m.slide_engine.device_updates.units and m.slide_stats()["gpu_updated_params"] > 0
    for k in fast:
        assert torch.equal(fast[k], slow[k]), k


def test_a_non_finite_gradient_skips_the_device_updates_in_backward():
    """Without clipping a device layer's update runs in the backward and skips on the device where
    the running norm is not finite: its weights, moments and step counters stay as they were."""
    _, slid = _pair(torch.bfloat16, False, device_update_share=1.0, **HOST_ONLY)
    opt = slid.create_optimizer(lr=LR)
    data = [{k: v.cuda() for k, v in b.items()} for b in batches(3, bsz=2, seq=64, vocab=1001, pad=True)]
    for b in data[:2]:
        slid(**b).loss.backward(); opt.step(); opt.zero_grad()
    assert len(slid.slide_engine.device_updates.units) == 4
    before = {k: v.clone() for k, v in slid.state_dict().items()}
    state = opt.state_dict()["state"]
    moments = {i: {k: torch.as_tensor(v).clone() for k, v in st.items()} for i, st in state.items()}
    (slid(**data[2]).loss * float("nan")).backward()
    opt.step(); opt.zero_grad()
    after = slid.state_dict()
    for k in before:
        if ".layers." in k:
            assert torch.equal(before[k], after[k]), k
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(v), moments[i][k]), (i, k)
    # and the next finite step trains again
    slid(**data[0]).loss.backward(); opt.step(); opt.zero_grad()
    assert not torch.equal(slid.state_dict()["model.layers.0.mlp.up_proj.weight"],
                           before["model.layers.0.mlp.up_proj.weight"])


@pytest.mark.parametrize("part", ["all", "moments"])
@pytest.mark.parametrize("kw", [{}, {"max_grad_norm": 1.0}, {"ga": 2, "steps": 6, "max_grad_norm": 1.0}])
def test_layers_on_disk_bit_identical_on_gpu_under_slow_streams(monkeypatch, tmp_path, kw, part):
    """Three of four layers' state ("all": master and moments; "moments": the moments alone, the
    masters in pinned host memory) on disk through two pinned buffers (every step evicts, reads and
    writes behind): with the compute and copy streams slowed down, a buffer reused before the slot
    copy that reads it has run would change the result (disk_store.py: [Why a disk unit's state is
    in one place at a time])."""
    from hf_slideformer.disk import disk_store
    from hf_slideformer.host import store
    monkeypatch.setattr(disk_store, "STATE_BUFFERS", 2)
    monkeypatch.setattr(store, "plan_disk_units", lambda units, config: [
        (u, part) for u in [u for u in units if u.kind == "layer"][1:]] if config.host_memory_limit is not None else [])
    # No layer updated on the device in either run (a disk layer never is): the same host AdamW.
    kw = dict(HOST_ONLY, device_update_share=0.0, **kw)
    host = _train_state(False, **kw)
    models = []
    on_disk = _train_state(True, models=models, host_memory_limit=1.0, nvme_path=str(tmp_path), **kw)
    stats = models[0].slide_stats()
    assert stats["disk_layers"] == 3 and stats["disk_moment_layers"] == (3 if part == "moments" else 0)
    for k in host:
        assert torch.equal(host[k], on_disk[k]), k


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_offload_tiers_bit_identical_on_gpu(tier, tmp_path):
    a = _train_state(False, tier="device")
    b = _train_state(False, tier=tier, nvme_path=str(tmp_path))
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("clip,resident", [(None, "auto"), (0.5, "auto"), (None, 2), (0.5, 2)])
def test_fp32_accumulation_on_cuda_matches_plain_pytorch(clip, resident):
    """Gradient accumulation through the device (accumulate.py), with and without clipping, and
    with two resident layers summing their micro-batches on the device (resident.py)."""
    ref, slid = _pair(torch.float32, True, gradient_accumulation_steps=2, max_grad_norm=clip, use_kernels=False,
                      resident_layers=resident)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    opt = slid.create_optimizer(lr=LR, weight_decay=0.01)
    for n, b in enumerate(batches(6, bsz=3, seq=67, vocab=1001, pad=True)):
        b = {k: v.cuda() for k, v in b.items()}
        (ref(**b).loss / 2).backward()
        (slid(**b).loss / 2).backward()
        if n % 2 == 1:
            norm = (torch.nn.utils.clip_grad_norm_(ref.parameters(), clip) if clip else
                    torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters()])))
            ropt.step(); ropt.zero_grad()
            opt.step(); opt.zero_grad()
            assert math.isclose(opt.last_grad_norm, float(norm), rel_tol=1e-4)
    assert max_param_diff(ref.cpu(), slid) < 0.05 * LR


def test_resident_layers_track_host_updates_on_gpu():
    """bf16 with layers updated on the GPU vs all updated by the CPU: the same fp32 AdamW on two
    devices; rounding differences may flip a bf16 weight and so a later update, hence a mean
    difference under 1% of an lr step and none above 2 steps per step."""
    a = _train_state(False, **HOST_ONLY)
    _, slid = _pair(torch.bfloat16, False, resident_layers="auto")
    opt = slid.create_optimizer(lr=LR)
    for b in batches(4, bsz=4, seq=128, vocab=1001, pad=True):
        slid(**{k: v.cuda() for k, v in b.items()}).loss.backward()
        opt.step(); opt.zero_grad()
    stats = slid.slide_stats()
    assert stats["resident_layers"] == 4 and stats["resident_embedding"], stats
    b = slid.state_dict()
    diffs = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
    assert diffs.mean().item() < 0.01 * LR and diffs.max().item() < 2 * LR * 4, (diffs.mean(), diffs.max())


def test_first_layer_loads_while_its_update_runs(monkeypatch):
    """With the embedding on the GPU, the next forward's layer 0 is copied piece by piece while the
    CPU worker still updates it (slowed down here): the copies read only finished pieces, so the
    state is bit-identical to whole-unit updates."""
    import time as _time
    from hf_slideformer.host import host_optim, host_tasks
    kw = {"resident_layers": 0, "resident_embedding": True}
    ref = _train_state(False, **kw)
    monkeypatch.setattr(host_tasks, "UPDATE_PIECE", 1 << 12)
    orig_run = host_optim.AdamW32.run
    monkeypatch.setattr(host_optim.AdamW32, "run", lambda *a, **k: (_time.sleep(0.001), orig_run(*a, **k))[1])
    partial = []
    from hf_slideformer.engine.telemetry import MainClock
    orig_wait = MainClock.wait_master

    def wait_master(self, u, start):
        ready = orig_wait(self, u, start)
        partial.append(ready < u.numel)
        return ready
    monkeypatch.setattr(MainClock, "wait_master", wait_master)
    got = _train_state(False, **kw)
    assert any(partial), "no copy overlapped an update"
    for k in ref:
        assert torch.equal(ref[k], got[k]), k


def test_embedding_resident_from_the_first_step():
    """With room on the card (the planner's estimate), "auto" makes the embedding resident before
    the first update: its host gradient is never made, and the measured plan that follows the
    first step leaves out what the resident embedding held."""
    _, slid = _pair(torch.bfloat16, False)
    opt = slid.create_optimizer(lr=LR)
    eng = slid.slide_engine
    data = batches(2, bsz=4, seq=128, vocab=1001)
    slid(**{k: v.cuda() for k, v in data[0].items()}).loss.backward()
    assert eng.embedding.resident is not None and eng.embedding.grad is None
    held = eng.residents.resident_bytes()
    opt.step(); opt.zero_grad()
    assert eng.residents.peak is not None and eng.residents.peak <= torch.cuda.max_memory_reserved() - held
    slid(**{k: v.cuda() for k, v in data[1].items()}).loss.backward()
    opt.step(); opt.zero_grad()
    assert eng.embedding.resident is not None and eng.embedding.grad is None


@pytest.mark.parametrize("kernels", [False, True])
def test_generate_on_cuda(kernels):
    """generate() with the KV cache on the GPU, the prompt on the CPU (as from a tokenizer): in fp32
    without the kernels the tokens equal plain HF's on the GPU; with the kernels (bf16) it runs and
    returns the prompt plus the new tokens on the prompt's device."""
    dtype = torch.bfloat16 if kernels else torch.float32
    ref, slid = _pair(dtype, False, use_kernels=kernels)
    b = batches(1, bsz=2, seq=17, vocab=1001, seed=3)[0]
    ids, mask = b["input_ids"], b["attention_mask"]
    got = slid.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert got.device.type == "cpu" and got.shape == (2, 25) and torch.equal(got[:, :17], ids)
    if not kernels:
        with torch.no_grad():
            want = ref.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=8, do_sample=False,
                                pad_token_id=0)
        assert torch.equal(got, want.cpu())


def test_the_step_trace_times_the_copies():
    """With a step trace on, the slot fills, layer inputs, gradients out and backward updates are
    timed on their streams as "copy" spans, which add nothing to the compute time."""
    _, slid = _pair(torch.bfloat16, False, device_update_share=0.5, **HOST_ONLY)
    opt = slid.create_optimizer(lr=LR)
    data = [{k: v.cuda() for k, v in b.items()} for b in batches(3, bsz=2, seq=64, vocab=1001, pad=True)]
    stats = slid.slide_engine.stats
    slid(**data[0]).loss.backward(); opt.step(); opt.zero_grad()
    stats.start_trace()
    for b in data[1:]:
        slid(**b).loss.backward(); opt.step(); opt.zero_grad()
    events = stats.stop_trace()
    copies = [e for e in events if e[0] == "copy"]
    kinds = {label.split(":")[0] for _, label, _, _ in copies}
    assert {"fill", "input", "gradients", "update"} <= kinds, kinds
    assert all(t1 >= t0 for _, _, t0, t1 in copies)
    assert any(label == "fill:layer.0" for _, label, _, _ in copies)
    assert not slid.slide_engine.streams.copy_span_start(slid.slide_engine.streams.h2d)   # trace off: no event
