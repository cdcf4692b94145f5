"""The slid model's HF surface (`model.py`): generation through the sliding engine."""
import pytest
import torch
import hf_slideformer as hs
from transformers import AutoModelForCausalLM

from helpers import FAMILIES, batches, make_pair


def _prompts(pad_left=False):
    b = batches(1, bsz=3, seq=9, pad=pad_left, pad_left=pad_left, seed=5)[0]
    return b["input_ids"], b["attention_mask"]


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_with_a_kv_cache_matches_plain_hf(family):
    """Greedy decoding with HF's KV cache: each new token slides the layers once, every layer
    appending its keys and values to the cache; the tokens equal the plain model's."""
    ref, slid = make_pair(family, False)
    ids, mask = _prompts()
    with torch.no_grad():
        want = ref.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    got = slid.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(want, got)
    nocache = slid.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                            use_cache=False)
    assert torch.equal(want, nocache)


def test_generate_left_padded_after_training():
    """Sample from the model being trained (the updates in flight are waited for), left padding."""
    _, slid = make_pair("llama", True)
    opt = slid.create_optimizer(lr=1e-2)
    for b in batches(3, pad=True):
        slid(**b).loss.backward()
        opt.step()
        opt.zero_grad()
    ids, mask = _prompts(pad_left=True)
    got = slid.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    plain = AutoModelForCausalLM.from_config(slid.config).float()
    plain.load_state_dict(slid.state_dict())
    plain.config.use_cache = True
    with torch.no_grad():
        want = plain.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(want, got)
    slid(**batches(1)[0]).loss.backward()           # training goes on after sampling
    opt.step()


def test_a_kv_cache_is_refused_for_training():
    _, slid = make_pair("llama", False)
    b = batches(1)[0]
    with pytest.raises(NotImplementedError, match="KV cache is for generation"):
        slid(**b, use_cache=True)


def test_parameters_added_after_slide_are_refused_not_trained_silently():
    """Trainable parameters added to a slid model after its optimizer was built would never be
    updated: a forward with gradients raises, naming them, instead of training without them;
    frozen additions are fine (tests/test_lora.py: adapters added before the optimizer train)."""
    import torch.nn as nn
    _, slid = make_pair("llama", False)
    slid.create_optimizer(lr=1e-3)
    (b,) = batches(1)
    proj = slid.model.layers[1].self_attn.q_proj
    proj.lora_A = nn.Linear(proj.in_features, 2, bias=False)
    with pytest.raises(hs.SlideStateError, match=r"after its optimizer was built \(.*lora_A"):
        slid(**b).loss.backward()
    proj.lora_A.weight.requires_grad_(False)
    slid(**b).loss.backward()


def test_a_peft_model_is_refused_by_slide():
    from transformers import AutoModelForCausalLM
    from helpers import family_config

    model = AutoModelForCausalLM.from_config(family_config("llama"))
    model.peft_config = {"default": object()}              # what PEFT's wrappers carry
    with pytest.raises(ValueError, match="PEFT model"):
        hs.slide(model, hs.SlideConfig(device="cpu"))


def test_load_state_dict_reaches_the_next_forward():
    """Weights loaded after a forward (which leaves copies in the slots) are what the next forward
    computes with."""
    from helpers import make_pair
    ref, slid = make_pair("llama", False)
    (b,) = batches(1)
    with torch.no_grad():
        slid(**b)
        halved = {k: v * 0.5 for k, v in ref.state_dict().items()}
        ref.load_state_dict(halved)
        slid.load_state_dict(halved)
        assert abs(slid(**b).loss.item() - ref(**b).loss.item()) < 1e-5


# ---------------------------------------------------------------------------------------- a failed slide()
def _failing_build(monkeypatch):
    """slide() fails late: after the store, the slots, the worker and the activation tier exist."""
    import hf_slideformer.engine.slide_engine as engine_mod

    def broken(engine):
        raise RuntimeError("injected failure")
    monkeypatch.setattr(engine_mod, "HostUpdates", broken)


def test_a_failed_slide_releases_its_threads_and_files_and_a_second_one_works(tmp_path, monkeypatch):
    import os
    import threading
    from helpers import family_config
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config("llama")).float()
    cfg = dict(device="cpu", activation_tier="nvme", nvme_path=str(tmp_path))
    threads = {t.ident for t in threading.enumerate()}
    with monkeypatch.context() as m:
        _failing_build(m)
        with pytest.raises(RuntimeError, match="injected failure"):
            hs.slide(model, hs.SlideConfig(**cfg))
    assert {t.ident for t in threading.enumerate() if t.is_alive()} <= threads      # the worker stopped
    assert os.listdir(tmp_path) == []
    assert not hs.is_slid(model)
    slid = hs.slide(model, hs.SlideConfig(**cfg))
    opt = slid.create_optimizer(lr=1e-3)
    b = batches(1)[0]
    slid(**b).loss.backward()
    opt.step()


@pytest.mark.gpu
def test_a_gpu_cap_below_one_layer_is_refused_then_a_failed_slide_then_one_that_works():
    """The cap is refused naming the minimum, before anything is allocated (torch's raw
    OutOfMemoryError, and a process whose next slide() died on host memory still registered);
    a slide() that fails after pinning releases its registrations; the next one trains."""
    from hf_slideformer.engine.slide_checks import GpuLimitError
    from helpers import family_config
    before = torch.cuda.get_per_process_memory_fraction()
    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(family_config("llama", hidden_size=256, intermediate_size=704,
                                                               vocab_size=32000)).float()
        with pytest.raises(GpuLimitError, match=r"gpu_memory_limit=0\.001 GiB is below the 0\.0\d+ GiB.*at least"):
            hs.slide(model, hs.SlideConfig(device="cuda", gpu_memory_limit=0.001))
        assert torch.cuda.get_per_process_memory_fraction() == before and not hs.is_slid(model)
        mp = pytest.MonkeyPatch()
        try:
            _failing_build(mp)
            with pytest.raises(RuntimeError, match="injected failure"):
                hs.slide(model, hs.SlideConfig(device="cuda", gpu_memory_limit=8))
        finally:
            mp.undo()
        assert torch.cuda.get_per_process_memory_fraction() == before
        slid = hs.slide(model, hs.SlideConfig(device="cuda", gpu_memory_limit=8))
        opt = slid.create_optimizer(lr=1e-3)
        ids = torch.randint(0, 32000, (2, 32))
        for _ in range(2):
            slid(input_ids=ids, labels=ids).loss.backward()
            opt.step()
        assert all(torch.isfinite(p).all() for p in slid.parameters())
        slid.slide_engine.close()
    finally:
        torch.cuda.set_per_process_memory_fraction(before)


def test_slide_synchronize_makes_parameters_read_directly_the_stepped_masters(monkeypatch):
    """optimizer.step() returns with the late layers' updates still queued (here slowed by 0.1 s
    each): after `slide_synchronize()`, every parameter read through `named_parameters()` is the
    reference's after the same step (a read before it would see some layers a step behind)."""
    from hf_slideformer.engine.placements import HostLayer

    from helpers import slow_down
    slow_down(monkeypatch, HostLayer, "layer_task", 0.1)
    ref, slid = make_pair("llama", False, max_grad_norm=1.0)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    opt = slid.create_optimizer(lr=1e-2, weight_decay=0.0)
    b = batches(1)[0]
    ref(**b).loss.backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    ropt.step()
    slid(**b).loss.backward()
    opt.step()
    theirs = dict(ref.named_parameters())
    behind = [n for n, p in slid.named_parameters() if not torch.allclose(p, theirs[n], rtol=0, atol=1e-5)]
    assert behind                                          # read at once: slowed updates still queued
    slid.slide_synchronize()
    for name, p in slid.named_parameters():
        torch.testing.assert_close(p, theirs[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("mode_at_slide", ["eval", "train"])
def test_a_loaded_model_computes_as_hf_after_a_mode_switch(tmp_path, mode_at_slide):
    """A model from from_pretrained, slid in either mode and switched to the other, computes HF's
    logits: transformers (5.25 on, with the `kernels` package) kernelizes a loaded model again at
    every train() / eval() switch, which must not drop the engine's forwards (the final norm is the
    head's: run twice, it moves the logits)."""
    ref, _ = make_pair("llama")
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))     # off 1: a norm applied twice shows
    ref.save_pretrained(tmp_path)
    loaded = getattr(AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32), mode_at_slide)()
    slid = hs.slide(loaded, hs.SlideConfig(device="cpu"))
    ids = batches(1)[0]["input_ids"]
    with torch.no_grad():
        expected = ref(input_ids=ids).logits
        for mode in ("train", "eval", "train"):
            getattr(slid, mode)()
            torch.testing.assert_close(slid(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
