"""The sliding engine against plain HF training + torch.optim.AdamW, step by step, in fp32."""
import math

import pytest
import torch

import hf_slideformer as hs
from helpers import FAMILIES, batches, make_pair, max_param_diff

LR = 1e-2
PARAM_TOL = 0.05 * LR        # a few percent of one learning-rate step
LOSS_RTOL = 1e-5


def train_both(ref, slid, data, *, ga=1, clip=None, wd=0.0, sched=False, scale_by_ga=True, items=False, scale=1.0,
               lr=LR):
    ropt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=wd)
    opt = slid.create_optimizer(lr=lr, weight_decay=wd)
    scheds = []
    if sched:
        scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (ropt, opt)]
    norms = []
    for k in range(0, len(data), ga):
        window = data[k:k + ga]
        n_items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in window) if items else None
        for b in window:
            kw = dict(b, num_items_in_batch=torch.tensor(n_items)) if items else b
            r = ref(**kw).loss
            s = slid(**kw).loss
            assert math.isclose(s.item(), r.item(), rel_tol=LOSS_RTOL, abs_tol=1e-6), (s.item(), r.item())
            div = (ga if (scale_by_ga and not items) else 1) / scale
            (r / div).backward()
            (s / div).backward()
        if clip is not None:
            rn = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        else:
            rn = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters() if p.grad is not None]))
        ropt.step()
        ropt.zero_grad()
        opt.step()
        opt.zero_grad()
        for sc in scheds:
            sc.step()
        norms.append((opt.last_grad_norm, rn.item()))
    for a, b in norms:
        assert math.isclose(a, b, rel_tol=1e-4), norms
    return max_param_diff(ref, slid)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tied", [False, True])
def test_equivalence_families(family, tied):
    ref, slid = make_pair(family, tied)
    assert (slid.lm_head.weight is slid.model.embed_tokens.weight) == tied
    assert train_both(ref, slid, batches(4, pad=True, pad_left=True)) < PARAM_TOL


@pytest.mark.parametrize("tied", [False, True])
def test_accumulation_and_clipping(tied):
    ref, slid = make_pair("llama", tied, gradient_accumulation_steps=3, max_grad_norm=0.5)
    assert train_both(ref, slid, batches(6, pad=True), ga=3, clip=0.5) < PARAM_TOL


def test_accumulation_in_backward_updates_with_num_items():
    ref, slid = make_pair("qwen2", False, gradient_accumulation_steps=2)
    assert train_both(ref, slid, batches(6, pad=True), ga=2, items=True) < PARAM_TOL


def test_clipping_only_with_weight_decay_and_scheduler():
    ref, slid = make_pair("qwen3", True, max_grad_norm=0.1)
    assert train_both(ref, slid, batches(4), clip=0.1, wd=0.1, sched=True) < PARAM_TOL


@pytest.mark.parametrize("tied", [False, True])
def test_scaled_loss_single_backward_with_clipping(tied):
    """A loss scaled before backward (e.g. by a user's own normalization) scales every gradient,
    the head's (computed in forward) included, and the norm used for clipping."""
    ref, slid = make_pair("llama", tied, max_grad_norm=0.3)
    assert train_both(ref, slid, batches(3, pad=True), clip=0.3, scale=0.37) < PARAM_TOL


def test_param_groups_decay_split():
    ref, slid = make_pair("llama", False)
    def groups(m, opt_cls, **kw):
        decay = [p for n, p in m.named_parameters() if n.endswith("proj.weight")]
        rest = [p for n, p in m.named_parameters() if not n.endswith("proj.weight")]
        return [{"params": decay, "weight_decay": 0.3}, {"params": rest, "weight_decay": 0.0, "lr": LR / 2}]
    ropt = torch.optim.AdamW(groups(ref, None), lr=LR)
    opt = hs.SlideOptimizer(groups(slid, None), slid.slide_engine, lr=LR)
    for b in batches(3):
        ref(**b).loss.backward(); ropt.step(); ropt.zero_grad()
        slid(**b).loss.backward(); opt.step(); opt.zero_grad()
    assert max_param_diff(ref, slid) < PARAM_TOL


def test_eval_logits_and_no_grad_loss():
    ref, slid = make_pair("mistral", False)
    b = batches(1, pad=True)[0]
    with torch.no_grad():
        r = ref(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
        s = slid(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
        torch.testing.assert_close(s.logits, r.logits, rtol=1e-5, atol=1e-5)
        rl, sl = ref(**b).loss, slid(**b).loss
        assert math.isclose(sl.item(), rl.item(), rel_tol=LOSS_RTOL)
    out = slid(input_ids=b["input_ids"])          # no labels, grad enabled: logits for evaluation
    assert out.logits.shape == (*b["input_ids"].shape, 97)


def test_step_order_errors():
    _, slid = make_pair("llama", False)
    opt = slid.create_optimizer(lr=LR)
    b = batches(2)
    with pytest.raises(hs.SlideStateError, match="without a backward"):
        opt.step()
    slid(**b[0]).loss.backward()
    with pytest.raises(hs.SlideStateError, match="gradient_accumulation_steps=1"):
        slid(**b[1]).loss.backward()
    opt.step()
    opt.zero_grad()
    # a forward whose activations were replaced by a later forward cannot be backwarded
    l1 = slid(**b[0]).loss
    l2 = slid(**b[1]).loss
    with pytest.raises(hs.SlideStateError, match="later forward"):
        l1.backward()
    l2.backward()
    opt.step()


def test_backward_needs_optimizer():
    _, slid = make_pair("llama", False)
    with pytest.raises(hs.SlideStateError, match="create_optimizer"):
        slid(**batches(1)[0]).loss.backward()


def test_unsupported_architecture_names_supported_types():
    from transformers import GPT2Config, GPT2LMHeadModel
    m = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match=", ".join(hs.SUPPORTED_MODEL_TYPES)):
        hs.slide(m, hs.SlideConfig(device="cpu"))


def test_host_memory_check_fails_before_allocating(monkeypatch):
    import hf_slideformer.host.memory as mem
    monkeypatch.setattr(mem, "available_host_bytes", lambda: 1000)
    with pytest.raises(hs.HostMemoryError, match="GiB of host memory"):
        make_pair("llama", False)


def test_worker_failure_surfaces_without_hang(monkeypatch):
    _, slid = make_pair("llama", False)
    opt = slid.create_optimizer(lr=LR)
    def boom(*a, **k):
        raise RuntimeError("adam exploded")
    monkeypatch.setattr(hs.host.optim, "apply_adamw", boom)
    b = batches(2)
    with pytest.raises(hs.WorkerError, match="adam exploded"):   # at the latest within the next step
        for x in b:
            slid(**x).loss.backward()
            opt.step()


def _assert_tier_equals_device_tier(tier, tmp_path, steps):
    data = batches(steps, pad=True)
    results = []
    for t in ("device", tier):
        ref, slid = make_pair("llama", True, activation_tier=t, nvme_path=str(tmp_path))
        opt = slid.create_optimizer(lr=LR)
        for b in data:
            slid(**b).loss.backward(); opt.step(); opt.zero_grad()
        results.append({k: v.clone() for k, v in slid.state_dict().items()})
    for k in results[0]:
        assert torch.equal(results[0][k], results[1][k]), k


@pytest.mark.parametrize("tier", ["device", "cpu", "nvme"])
def test_activation_tiers_bit_identical(tier, tmp_path):
    _assert_tier_equals_device_tier(tier, tmp_path, 2)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_last_layer_input_stays_on_the_device(tier, tmp_path):
    """activations.py: [Why the last layer's input stays on the device]: only L-1 inputs leave."""
    ref, slid = make_pair("llama", False, activation_tier=tier, nvme_path=str(tmp_path))
    eng = slid.slide_engine
    L, (b,) = len(eng.layer_units), batches(1)
    opt = slid.create_optimizer(lr=LR)
    loss = slid(**b).loss
    assert set(eng.tier.kept) == {L - 1} and eng.tier.kept[L - 1].device.type == "cpu"
    if tier == "cpu":
        assert set(eng.tier.host) == set(range(L - 1))
    loss.backward(); opt.step()
    assert not eng.tier.kept                              # dropped once its backward has run
    tokens_h = b["input_ids"].numel() * eng.hidden
    # fp32 on this device: each of the L-1 offloaded inputs goes out and comes back once
    assert slid.slide_stats()["activation_bytes"] == 2 * (L - 1) * tokens_h * 4


def test_nvme_tier_file_work_on_its_own_thread(tmp_path, monkeypatch):
    """activations.py: [Why the nvme tier's file work is on its own thread]: with the disk slowed
    down (every write and read late), the result equals the device tier's, bit for bit."""
    import time
    from hf_slideformer.engine.activations import FileTier
    for name in ("_write", "_read"):
        real = getattr(FileTier, name)

        def slow(self, *a, _real=real, **k):
            time.sleep(0.01)
            return _real(self, *a, **k)
        monkeypatch.setattr(FileTier, name, slow)
    _assert_tier_equals_device_tier("nvme", tmp_path, 3)


def test_nvme_tier_reads_ahead_and_gives_back_its_buffers(tmp_path):
    from hf_slideformer.engine.activations import FileTier
    from hf_slideformer.engine.transfer import Streams
    tier = FileTier(Streams.for_device(torch.device("cpu")), str(tmp_path), buffers=4)
    xs = [torch.randn(3, 5 + i) for i in range(6)]          # sizes differ: buffers grow as needed
    for i, x in enumerate(xs):
        tier.save(i, x)
    tier.jobs.join()                                        # every file written, every buffer free
    tier.prefetch(5)
    assert sorted(tier.reads) == [3, 4, 5]                  # two ahead; one buffer left for a request
    for i in reversed(range(6)):
        assert torch.equal(tier.load(i), xs[i]), i
        tier.drop(i)
    tier.jobs.join()
    assert not tier.reads and tier.free.qsize() == 4
    tier.clear()
    tier.close()
    assert not any(tmp_path.iterdir())


def test_nvme_tier_disk_failure_is_a_clear_error(tmp_path, monkeypatch):
    from hf_slideformer.engine.activations import FileTier

    def full(self, *a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(FileTier, "_write", full)
    ref, slid = make_pair("llama", False, activation_tier="nvme", nvme_path=str(tmp_path))
    slid.create_optimizer(lr=LR)
    (b,) = batches(1)
    with pytest.raises(RuntimeError, match="nvme activation tier failed.*No space left"):
        slid(**b).loss.backward()


def test_window_sizes_agree():
    data = batches(2)
    states = []
    for w in (1, 2, 3):
        _, slid = make_pair("qwen3", False, window=w)
        opt = slid.create_optimizer(lr=LR)
        for b in data:
            slid(**b).loss.backward(); opt.step(); opt.zero_grad()
        states.append(slid.state_dict())
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]) and torch.equal(states[0][k], states[2][k]), k


def test_zero_grad_discards_accumulated():
    ref, slid = make_pair("llama", False, gradient_accumulation_steps=2)
    opt = slid.create_optimizer(lr=LR)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    b = batches(3)
    slid(**b[0]).loss.backward(); opt.zero_grad()      # discarded
    ref(**b[0]).loss.backward(); ropt.zero_grad()
    for x in b[1:]:
        (slid(**x).loss / 2).backward(); (ref(**x).loss / 2).backward()
    opt.step(); ropt.step()
    assert max_param_diff(ref, slid) < PARAM_TOL


def _interrupt_backward(monkeypatch, slid, batch) -> None:
    """Run a backward that an error stops at layer 1 (layers above it already updated)."""
    import hf_slideformer.engine.slide_engine as engine_mod
    real = engine_mod.SlideEngine.layer_backward

    def fail(self, i, *a, **k):
        if i == 1:
            raise RuntimeError("device lost")
        return real(self, i, *a, **k)
    monkeypatch.setattr(engine_mod.SlideEngine, "layer_backward", fail)
    with pytest.raises(RuntimeError, match="device lost"):
        slid(**batch).loss.backward()
    monkeypatch.setattr(engine_mod.SlideEngine, "layer_backward", real)


def test_interrupted_backward_is_reported_not_hung(monkeypatch):
    _, slid = make_pair("llama", True)
    opt = slid.create_optimizer(lr=LR)
    b = batches(2)
    _interrupt_backward(monkeypatch, slid, b[0])
    with pytest.raises(hs.SlideStateError, match="interrupted"):
        slid(**b[1]).loss.backward()
    # not once: every later training call refuses until the state is restored
    with pytest.raises(hs.SlideStateError, match="interrupted"):
        slid(**b[1]).loss.backward()
    with pytest.raises(hs.SlideStateError, match="interrupted"):
        opt.step()


@pytest.mark.parametrize("restore", ["training_state", "state_dicts", "weights_only"])
def test_after_an_interrupted_backward_a_restore_lets_training_go_on(monkeypatch, tmp_path, restore):
    """Restored before the next call (weights and optimizer state), training goes on with no stale
    error, from exactly the restored state; the weights alone are not enough."""
    _, slid = make_pair("llama", False)
    opt = slid.create_optimizer(lr=LR)
    b = batches(3)
    slid(**b[0]).loss.backward()
    opt.step()
    hs.save_training_state(str(tmp_path), slid, opt)
    weights = {k: v.clone() for k, v in slid.state_dict().items()}
    opt_state = opt.state_dict()
    _interrupt_backward(monkeypatch, slid, b[1])
    if restore == "training_state":
        hs.load_training_state(str(tmp_path), slid, opt)
    else:
        slid.load_state_dict(weights)
        if restore == "state_dicts":
            opt.load_state_dict(opt_state)
    if restore == "weights_only":
        with pytest.raises(hs.SlideStateError, match="interrupted"):
            slid(**b[1]).loss.backward()
        return
    for k, v in slid.state_dict().items():
        assert torch.equal(v, weights[k]), k
    slid(**b[1]).loss.backward()
    opt.step()
    assert all(torch.isfinite(v).all() for v in slid.state_dict().values())


def test_explicit_position_ids_match():
    """Packed sequences: position_ids restart inside a row; passed through to HF's RoPE."""
    ref, slid = make_pair("qwen3", False)
    b = batches(1, seq=12)[0]
    pos = torch.cat([torch.arange(5), torch.arange(7)]).repeat(2, 1)
    with torch.no_grad():
        r = ref(input_ids=b["input_ids"], position_ids=pos, labels=b["labels"]).loss
        s = slid(input_ids=b["input_ids"], position_ids=pos, labels=b["labels"]).loss
    assert math.isclose(s.item(), r.item(), rel_tol=LOSS_RTOL)
    data = [dict(b, position_ids=pos)] * 2
    assert train_both(ref, slid, data) < PARAM_TOL


@pytest.mark.parametrize("kw", [dict(tied=True, max_grad_norm=1.0),
                                dict(tied=False, resident_embedding=True, grad_buffers=1)])
def test_host_memory_flat_over_200_steps(kw):
    """No host leak in the steady state: RSS after 200 more steps stays where it was after 20 (with
    clipping; and with the embedding resident from the first step and the head's gradient in the ring)."""
    kw = dict(kw)
    _, slid = make_pair("llama", kw.pop("tied"), **kw)
    opt = slid.create_optimizer(lr=1e-3)
    data = batches(4, pad=True)

    def rss():
        return [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")][0] * 1024

    def run(n):
        for k in range(n):
            slid(**data[k % 4]).loss.backward(); opt.step(); opt.zero_grad()
        slid.slide_stats()

    run(20)
    before = rss()
    run(200)
    grew = rss() - before
    assert grew < 8 * 2 ** 20, grew / 2 ** 20


def test_exit_with_queued_updates_is_clean():
    """A script that ends right after a step whose deferred updates are still queued exits at once, cleanly."""
    import subprocess
    import sys
    import textwrap
    code = textwrap.dedent("""
        import sys, torch
        sys.path.insert(0, "tests")
        from helpers import batches, make_pair
        _, slid = make_pair("llama", True, max_grad_norm=0.5)
        opt = slid.create_optimizer(lr=1e-2)
        for b in batches(2):
            slid(**b).loss.backward(); opt.step()
        print("ok", flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (out.returncode, out.stdout, out.stderr[-2000:])
    assert "terminate" not in out.stderr, out.stderr[-2000:]


def test_forward_with_gradients_before_the_step_is_refused_and_harmless():
    """The step's pending gradients (clipping: all of them wait for step()) survive a refused forward."""
    data = batches(3, pad=True)
    states = []
    for intrude in (False, True):
        _, slid = make_pair("llama", True, max_grad_norm=0.5)
        opt = slid.create_optimizer(lr=LR)
        for k, b in enumerate(data):
            slid(**b).loss.backward()
            if intrude and k == 1:
                with pytest.raises(hs.SlideStateError, match="call optimizer.step"):
                    slid(**data[0])
                with torch.no_grad():
                    slid(**data[0])              # evaluation in between is fine
            opt.step(); opt.zero_grad()
        states.append({k: v.clone() for k, v in slid.state_dict().items()})
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]), k


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_recompute_without_the_output_projection_is_bit_identical(family):
    """The recompute skips down_proj's product (its value is never read): same bits as recomputing it."""
    from hf_slideformer.compute.functions import GradOnlyLinear
    data = batches(3, pad=True)
    states, calls = [], []
    for skip in (False, True):
        _, slid = make_pair(family, False)
        eng = slid.slide_engine
        eng.skip_output_projection = skip
        assert all(p is not None for p in eng.output_projections)
        opt = slid.create_optimizer(lr=LR, weight_decay=0.1)
        orig = GradOnlyLinear.forward
        GradOnlyLinear.forward = staticmethod(lambda ctx, *a: (calls.append(skip), orig(ctx, *a))[1])
        try:
            for b in data:
                slid(**b).loss.backward(); opt.step(); opt.zero_grad()
        finally:
            GradOnlyLinear.forward = staticmethod(orig)
        states.append({k: v.clone() for k, v in slid.state_dict().items()})
        assert not any("forward" in p.__dict__ for p in eng.output_projections)    # the swap is undone
    assert calls and all(calls)                    # it ran, and only when asked
    assert len(calls) == 3 * len(slid.slide_engine.layers)
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]), k


def test_output_projection_is_not_skipped_under_a_wrapper():
    from hf_slideformer.models.adapters import get_adapter
    _, slid = make_pair("llama", False)
    layer = slid.slide_engine.layers[0]
    ad = get_adapter("llama")
    assert ad.output_projection(layer) is layer.mlp.down_proj

    class Wrapped(torch.nn.Linear):                # e.g. a LoRA or quantized linear: left alone
        pass
    layer.mlp.down_proj.__class__ = Wrapped
    assert ad.output_projection(layer) is None


@pytest.mark.parametrize("tied", [False, True])
def test_head_slot_loaded_in_chunks_during_the_forward(tied):
    """The head slot's copy is spread over the forward's layers: same bits as one copy at the head."""
    data = batches(3, pad=True)
    states = []
    for chunk in (1 << 26, 97):
        _, slid = make_pair("llama", tied)
        eng = slid.slide_engine
        eng.head.slots.chunk = chunk
        layers_run, issued = [0], []
        orig_steps, orig_layer = eng.head.slots.load_steps, eng.layer_forward

        def counting(units, busy=()):
            for _ in orig_steps(units, busy):
                issued.append(layers_run[0])               # layers of this forward begun so far
                yield

        def layer_forward(i, *a, **k):
            layers_run[0] = i + 1
            return orig_layer(i, *a, **k)
        eng.head.slots.load_steps, eng.layer_forward = counting, layer_forward
        opt = slid.create_optimizer(lr=LR, weight_decay=0.1)
        for b in data:
            slid(**b).loss.backward(); opt.step(); opt.zero_grad()
        states.append({k: v.clone() for k, v in slid.state_dict().items()})
        stage = eng.head.slots.staging
        cap = chunk if stage is None else min(chunk, stage.numel())
        per_step = sum(-(-u.numel // cap) for u in eng.head.slot_units())
        assert len(issued) == len(data) * per_step          # every chunk of every step, none twice
        n = len(eng.layers)
        if chunk == 97:                                     # one chunk per layer, the rest at the head
            assert per_step > n and issued[:n] == list(range(1, n + 1))
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]), k


def test_piecewise_update_is_bit_identical(monkeypatch):
    """The worker updates each unit in pieces, reporting finished prefixes: same bits as one call.

    (On the CPU the embedding's update, the last of the backward, precedes the next forward, so
    no load overlaps an update here: tests/test_engine_gpu.py checks that with a resident embedding.)
    """
    from hf_slideformer.host import host_tasks
    data = batches(3, pad=True)
    states, reports = [], []
    for piece in (1 << 23, 256):
        monkeypatch.setattr(host_tasks, "UPDATE_PIECE", piece)
        _, slid = make_pair("llama", False)
        for u in slid.slide_engine.store.units:
            orig = u.set_progress
            u.set_progress = (lambda n, orig=orig, u=u: (reports.append((piece, u.name, n)), orig(n)))
        opt = slid.create_optimizer(lr=LR, weight_decay=0.1)
        for b in data:
            slid(**b).loss.backward(); opt.step(); opt.zero_grad()
        states.append({k: v.clone() for k, v in slid.state_dict().items()})
    big = [r for r in reports if r[0] == 1 << 23 and r[2] > 0]
    small = [r for r in reports if r[0] == 256 and r[2] > 0]
    assert len(small) > 3 * len(big) > 0           # many pieces per unit, each reported
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]), k
