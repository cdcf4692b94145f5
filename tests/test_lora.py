"""LoRA on a streamed frozen base: a PEFT model through the sliding engine against PEFT alone."""
import copy
import math
import os
import warnings

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

import hf_slideformer as hs
from hf_slideformer.engine.placements import FrozenLayer
from helpers import batches, family_config, trainer_args

LR = 1e-2
LOSS_RTOL = 1e-5
TARGETS = ["q_proj", "v_proj", "gate_proj", "down_proj"]


def _base(model_type="llama", tied=True, seed=0):
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_config(family_config(model_type, tied)).float()
    base.config.use_cache = False
    return base


def lora_pair(model_type="llama", tied=True, targets=TARGETS, **slide_kw):
    """(PEFT model, slid deep copy of it) with identical weights; nonzero B so that every adapter
    gradient is nonzero from the first step."""
    pm = get_peft_model(_base(model_type, tied), LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                           init_lora_weights=False))
    slid = hs.slide(copy.deepcopy(pm), hs.SlideConfig(device="cpu", dtype=torch.float32, **slide_kw))
    return pm, slid


def _adapters(model):
    """The trained parameters by name: the LoRA adapters and the modules_to_save copies (of a slid
    model once its queued host updates have run)."""
    if hs.is_slid(model):
        model.slide_engine.synchronize()
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()
            if "lora_" in n or "modules_to_save" in n}


def assert_same_training(a, b, data):
    """Two slid models trained side by side: the same loss at every step and the same adapters
    after, bit for bit."""
    opts = [m.create_optimizer(lr=LR) for m in (a, b)]
    for batch in data:
        losses = []
        for m, opt in zip((a, b), opts):
            loss = m(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[0] == losses[1]
    x, y = _adapters(a), _adapters(b)
    assert all(torch.equal(x[n], y[n]) for n in x)


def train_both(ref, slid, data, ga=1, clip=None, after_step=None):
    ropt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, weight_decay=0.1)
    opt = slid.create_optimizer(lr=LR, weight_decay=0.1)
    for k in range(0, len(data), ga):
        for b in data[k:k + ga]:
            r, s = ref(**b).loss, slid(**b).loss
            assert math.isclose(s.item(), r.item(), rel_tol=LOSS_RTOL), (s.item(), r.item())
            (r / ga).backward()
            (s / ga).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], clip)
        ropt.step()
        ropt.zero_grad()
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step()
    a, b = _adapters(ref), _adapters(slid)
    assert set(a) == set(b) and a
    return max((a[n] - b[n]).abs().max().item() for n in a)


@pytest.mark.parametrize("model_type,tied", [("llama", True), ("qwen3", False)])
@pytest.mark.parametrize("ga,clip", [(1, None), (2, None), (1, 0.05), (2, 0.05)])
def test_lora_through_sliding_equals_peft(model_type, tied, ga, clip):
    ref, slid = lora_pair(model_type, tied, gradient_accumulation_steps=ga, max_grad_norm=clip)
    assert train_both(ref, slid, batches(3 * ga, pad=True), ga=ga, clip=clip) < 0.05 * LR


def test_the_frozen_base_sends_nothing_back_and_never_changes():
    ref, slid = lora_pair()
    eng = slid.slide_engine
    assert all(isinstance(p, FrozenLayer) for p in eng.places)
    before = {n: p.detach().clone() for n, p in slid.named_parameters() if "lora_" not in n}
    train_both(ref, slid, batches(2))
    stats = slid.slide_stats()
    assert stats["d2h_bytes"] == 0 and stats["cpu_adam_s"] == 0.0
    after = {n: p.detach() for n, p in slid.named_parameters() if "lora_" not in n}
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert all(p.grad is None for n, p in slid.named_parameters() if "lora_" not in n)


def test_get_peft_model_on_a_slid_model_trains_the_adapters():
    """The adapters a PEFT model adds to a model already slid (as after SlideModel.from_pretrained)
    are taken onto the device when the optimizer is built."""
    base = _base()
    pm = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                        init_lora_weights=False))
    slid = get_peft_model(hs.slide(copy.deepcopy(base), hs.SlideConfig(device="cpu", dtype=torch.float32)),
                          LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))
    slid.load_state_dict(pm.state_dict())                     # the same adapter weights
    assert train_both(pm, slid, batches(3)) < 0.05 * LR


def test_adapters_added_after_the_optimizer_raise():
    """The silent case: adapters added after create_optimizer would never train."""
    m = hs.slide(_base(), hs.SlideConfig(device="cpu", dtype=torch.float32))
    m.create_optimizer(lr=LR)
    p = get_peft_model(m, LoraConfig(r=4, target_modules=TARGETS))
    with pytest.raises(hs.SlideStateError, match="after its optimizer was built"):
        p(**batches(1)[0])


@pytest.mark.parametrize("kw,match", [
    (dict(use_dora=True), "DoRA"),
    # modules_to_save of anything but the embedding and the lm_head: a norm, a module inside the layers
    (dict(modules_to_save=["model.norm"]), "model.norm is not supported.*Supported: the input embedding"),
    (dict(modules_to_save=["lm_head", "post_attention_layernorm"]),
     "post_attention_layernorm is not supported.*Supported: the input embedding"),
])
def test_unsupported_lora_settings_raise(kw, match):
    pm = get_peft_model(_base(), LoraConfig(r=4, target_modules=TARGETS, **kw))
    with pytest.raises(ValueError, match=match):
        hs.slide(pm, hs.SlideConfig(device="cpu"))


def test_lora_outside_the_layers_raises():
    pm = get_peft_model(_base(tied=False), LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ValueError, match="outside the decoder layers"):
        hs.slide(pm, hs.SlideConfig(device="cpu"))


def test_saved_adapter_loads_with_peft_and_gives_the_same_logits(tmp_path):
    ref, slid = lora_pair()
    train_both(ref, slid, batches(2))
    slid.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    plain = PeftModel.from_pretrained(_base(), tmp_path / "adapter")
    b = batches(1)[0]
    with torch.no_grad():
        want = plain(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        got = slid(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------- the Trainer
def _trainer_args(tmp_path, name, **kw):
    return trainer_args(tmp_path, name, **{"max_steps": 4, **kw})


def _trainer_data(n=16, seq=12):
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": (x := torch.randint(2, 97, (seq,), generator=g)), "labels": x.clone()} for _ in range(n)]


def test_slide_trainer_trains_a_peft_model_as_the_plain_trainer(tmp_path):
    """Accumulation (2), active clipping, decay groups and a schedule: a PEFT model through
    SlideTrainer against the same PEFT model through the plain Trainer."""
    from transformers import Trainer, TrainingArguments
    pm = get_peft_model(_base(), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))
    ref, model = pm, copy.deepcopy(pm)
    data = _trainer_data()
    plain = Trainer(model=ref, args=TrainingArguments(**_trainer_args(tmp_path, "plain")), train_dataset=data)
    plain.train()
    slid = hs.SlideTrainer(model=model, args=hs.SlideArgs(**_trainer_args(tmp_path, "slide")), train_dataset=data)
    slid.train()
    assert hs.is_slid(slid.model)
    want = [h["loss"] for h in plain.state.log_history if "loss" in h]
    got = [h["loss"] for h in slid.state.log_history if "loss" in h]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5)
    a, b = _adapters(ref), _adapters(model)
    assert max((a[n] - b[n]).abs().max().item() for n in a) < 0.05 * 1e-2


def _resume_against_uninterrupted(tmp_path, make, saved):
    """Six steps through SlideTrainer with a checkpoint at step 3, then steps 4-6 resumed from it
    on a fresh `make()`: the checkpoint's slide_state holds `saved`, the trained parameters and
    the last three losses are equal. Returns the trained parameters."""
    def run(name, resume=None):
        pm = make()
        args = hs.SlideArgs(**_trainer_args(tmp_path, name, max_steps=6, save_strategy="steps", save_steps=3))
        t = hs.SlideTrainer(model=pm, args=args, train_dataset=_trainer_data(24))
        t.train(resume_from_checkpoint=resume)
        return t, pm

    full, full_model = run("full")
    ckpt = tmp_path / "full" / "checkpoint-3"
    assert sorted(os.listdir(ckpt / "slide_state")) == saved
    resumed, resumed_model = run("resumed", resume=str(ckpt))
    a, b = _adapters(full_model), _adapters(resumed_model)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert [h["loss"] for h in resumed.state.log_history if "loss" in h][-3:] == \
        [h["loss"] for h in full.state.log_history if "loss" in h][-3:]
    return a


def test_peft_resume_equals_uninterrupted(tmp_path):
    # the adapters and their moments; the frozen base is named in the index, never written
    _resume_against_uninterrupted(
        tmp_path, lambda: get_peft_model(_base(), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                             init_lora_weights=False)),
        ["adapters.safetensors", "index.json"])


# ---------------------------------------------------------------------- on the GPU
@pytest.mark.gpu
@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize("modules", [None, ["lm_head"], ["embed_tokens", "lm_head"]])
def test_bf16_lora_on_the_gpu_tracks_fp32_peft(kernels, clip, modules):
    """bf16 compute on the streamed base with fp32 adapters on the device, against fp32 PEFT on the
    GPU: losses within 2% per step, the adapters (and the modules_to_save copies, trained on the
    host) within a few lr steps; without copies nothing crosses back."""
    from hf_slideformer.demo import tiny_config
    torch.manual_seed(0)
    cfg = tiny_config("llama", vocab_size=1001, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=modules is None)
    pm = get_peft_model(AutoModelForCausalLM.from_config(cfg).float(),
                        LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS + ["up_proj", "o_proj"],
                                   init_lora_weights=False, modules_to_save=list(modules) if modules else None))
    slid = hs.slide(copy.deepcopy(pm), hs.SlideConfig(device="cuda", dtype=torch.bfloat16, use_kernels=kernels,
                                                      max_grad_norm=clip))
    ref = pm.cuda()
    ropt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3)
    opt = slid.create_optimizer(lr=1e-3)
    for b in batches(4, bsz=4, seq=128, vocab=1001, pad=True):
        b = {k: v.cuda() for k, v in b.items()}
        r = ref(**b).loss
        r.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], clip)
        ropt.step(); ropt.zero_grad()
        s = slid(**b).loss
        s.backward(); opt.step(); opt.zero_grad()
        assert abs(s.item() - r.item()) / r.item() < 2e-2, (s.item(), r.item())
    a, b = _adapters(ref), _adapters(slid)
    diffs = torch.cat([(a[n] - b[n]).abs().flatten() for n in a])
    assert diffs.mean().item() < 0.1 * 1e-3 and diffs.max().item() < 2 * 4 * 1e-3, (diffs.mean(), diffs.max())
    assert (slid.slide_stats()["d2h_bytes"] == 0) == (modules is None)


def test_merged_model_saves_as_a_full_hf_checkpoint(tmp_path):
    """After training, merge_and_unload gives the slid base with the adapters merged: its logits
    equal PEFT's own merge of the same adapters, and save_pretrained writes a plain HF checkpoint."""
    ref, slid = lora_pair()
    train_both(ref, slid, batches(2))
    want_model = ref.merge_and_unload()
    merged = hs.merge_and_unload(slid)
    assert hs.is_slid(merged) and not any("lora_" in n for n, _ in merged.named_parameters())
    b = batches(1)[0]
    with torch.no_grad():
        want = want_model(input_ids=b["input_ids"]).logits
        got = merged(input_ids=b["input_ids"]).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    merged.save_pretrained(tmp_path / "merged")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=b["input_ids"]).logits, want, rtol=1e-5, atol=1e-5)


def test_the_frozen_base_is_kept_in_the_compute_dtype():
    """With bf16 compute the frozen base is stored in bf16 (2 bytes per parameter) and copied in
    as it is: training equals a frozen base kept in fp32 and cast on its way in, bit for bit, and
    half the bytes cross per copy."""
    cfg = hs.SlideConfig(device="cpu", dtype=torch.bfloat16)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    base = _base()
    low = hs.slide(get_peft_model(copy.deepcopy(base), lora), cfg)                 # frozen at slide(): bf16
    wide = get_peft_model(hs.slide(copy.deepcopy(base), cfg), lora)                # frozen after it: fp32
    wide.load_state_dict(low.state_dict(), strict=False)                           # the same adapters
    eng_low, eng_wide = low.slide_engine, wide.slide_engine
    assert {u.master.dtype for u in eng_low.layer_units + [eng_low.head_unit]} == {torch.bfloat16}
    assert eng_low.embed_unit.master.dtype == torch.float32
    assert {u.master.dtype for u in eng_wide.layer_units} == {torch.float32}
    assert_same_training(low, wide, batches(3))
    h2d = [m.slide_stats()["h2d_bytes"] for m in (low, wide)]
    assert h2d[0] < 0.6 * h2d[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_from_pretrained_with_a_peft_config_equals_sliding_the_peft_model(tmp_path, dtype):
    """SlideModel.from_pretrained(path, peft_config=...) builds the PEFT model on the meta device
    and reads the checkpoint into a frozen store: the same training as sliding the PEFT model of
    the loaded checkpoint (the adapters copied across), with the base in the compute dtype."""
    _base().save_pretrained(tmp_path / "base")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS)
    cfg = hs.SlideConfig(device="cpu", dtype=dtype)
    loaded = hs.SlideModel.from_pretrained(tmp_path / "base", cfg, peft_config=lora)
    assert isinstance(loaded, PeftModel)
    adapters = _adapters(loaded)
    assert any(bool(t.abs().sum()) for n, t in adapters.items() if "lora_A" in n)       # initialised, not empty
    assert all(not t.any() for n, t in adapters.items() if "lora_B" in n)             # PEFT's zeros
    eng = loaded.slide_engine
    assert {u.master.dtype for u in eng.layer_units} == {dtype}
    other = hs.slide(get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), lora), cfg)
    other.load_state_dict(loaded.state_dict(), strict=False)
    assert_same_training(loaded, other, batches(2))


@pytest.mark.parametrize("after,chunk", [(False, None), (True, None), (False, 4)])
def test_lora_dropout_draws_the_same_masks_in_the_recompute(after, chunk):
    """With lora_dropout the recompute in backward replays the random state its forward started
    from: the same masks, so the same training as PEFT without sliding (same seed, same order of
    draws); also for adapters added to a model already slid."""
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.3, init_lora_weights=False)
    base = _base()
    ref = get_peft_model(copy.deepcopy(base), lora)
    cfg = hs.SlideConfig(device="cpu", dtype=torch.float32, mlp_chunk_tokens=chunk)
    if chunk:           # chunked, the masks are drawn a chunk at a time: the reference chunks its MLPs too
        from hf_slideformer.compute.tiled_mlp import tile_mlps
        tile_mlps(ref.get_base_model().model.layers, chunk)
    if after:
        slid = get_peft_model(hs.slide(copy.deepcopy(base), cfg), lora)
    else:
        slid = hs.slide(get_peft_model(copy.deepcopy(base), lora), cfg)
    slid.load_state_dict(ref.state_dict(), strict=False)
    ref.train()
    slid.train()
    ropt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR)
    opt = slid.create_optimizer(lr=LR)
    for k, b in enumerate(batches(3)):
        torch.manual_seed(100 + k)
        r = ref(**b).loss
        r.backward()
        torch.manual_seed(100 + k)
        s = slid(**b).loss
        s.backward()
        assert math.isclose(s.item(), r.item(), rel_tol=LOSS_RTOL), (s.item(), r.item())
        ropt.step(); ropt.zero_grad(); opt.step(); opt.zero_grad()
    a, b = _adapters(ref), _adapters(slid)
    assert max((a[n] - b[n]).abs().max().item() for n in a) < 0.05 * LR


def test_lora_with_chunked_mlps_equals_peft():
    """The MLP's adapters (gate, down) get their gradients through the chunked MLP's recompute."""
    ref, slid = lora_pair(mlp_chunk_tokens=4)
    assert train_both(ref, slid, batches(3)) < 0.05 * LR


def test_an_early_step_with_accumulation_updates_the_adapters():
    """optimizer.step() before the last micro-batch (a Trainer at an epoch's end): the frozen base
    and embedding have no gradient to take a norm of; the adapters update as PEFT's do."""
    ref, slid = lora_pair(gradient_accumulation_steps=2, max_grad_norm=0.05)
    ropt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR)
    opt = slid.create_optimizer(lr=LR)
    b = batches(1)[0]
    (ref(**b).loss / 2).backward()
    (slid(**b).loss / 2).backward()
    torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], 0.05)
    ropt.step()
    opt.step()
    a, c = _adapters(ref), _adapters(slid)
    assert max((a[n] - c[n]).abs().max().item() for n in a) < 0.05 * LR


def test_the_frozen_base_holds_nothing_it_does_not_need():
    """No fp32 resident-gradient buffer for layers that cannot be resident, and one reader event
    per frozen unit however many steps ran."""
    ref, slid = lora_pair(resident_layers=2)
    train_both(ref, slid, batches(3))
    eng = slid.slide_engine
    assert eng.residents.shared_grad is None and not eng.residents.layers
    assert all(len(u.readers) <= 1 for u in eng.store.units)


# ---------------------------------------------------------------------- modules_to_save
def mts_pair(modules, model_type="qwen3", tied=False, ensure_tying=False, **slide_kw):
    """(PEFT model, slid deep copy of it): LoRA adapters plus the trainable copies of `modules`
    (PEFT's modules_to_save), nonzero B as in `lora_pair`."""
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False,
                      modules_to_save=list(modules), ensure_weight_tying=ensure_tying)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")             # PEFT warns that it unties a tied model's copies
        pm = get_peft_model(_base(model_type, tied), lora)
    slid = hs.slide(copy.deepcopy(pm), hs.SlideConfig(device="cpu", dtype=torch.float32, **slide_kw))
    return pm, slid


@pytest.mark.parametrize("modules", [["lm_head"], ["embed_tokens"], ["embed_tokens", "lm_head"]])
@pytest.mark.parametrize("ga,clip", [(1, None), (2, None), (1, 0.05), (2, 0.05)])
def test_modules_to_save_through_sliding_equals_peft(modules, ga, clip):
    """The copies of modules_to_save are the head (and embedding) units of the host store, trained
    in full as in full fine-tuning, beside the adapters on the device and the frozen layers: the
    loss, the adapters and the copies equal PEFT's without sliding."""
    ref, slid = mts_pair(modules, gradient_accumulation_steps=ga, max_grad_norm=clip)
    eng = slid.slide_engine
    assert eng.head_unit.trainable == ("lm_head" in modules)
    assert eng.embed_unit.trainable == ("embed_tokens" in modules)
    assert all(isinstance(p, FrozenLayer) for p in eng.places)
    before = _adapters(slid)
    assert train_both(ref, slid, batches(3 * ga, pad=True), ga=ga, clip=clip) < 0.05 * LR
    after = _adapters(slid)
    copies = [n for n in after if "modules_to_save" in n]
    assert len(copies) == len(modules) and not any(torch.equal(before[n], after[n]) for n in copies)
    assert slid.slide_stats()["cpu_adam_s"] > 0                 # the copies' host updates


@pytest.mark.parametrize("modules,ensure_tying,tied", [
    (["lm_head"], True, True),                    # one trained table for both ends: the slid model stays tied
    (["lm_head"], False, False),                  # PEFT unties: the lm_head's copy trains, the embedding is frozen
    (["embed_tokens", "lm_head"], False, False),  # two copies, trained apart
])
@pytest.mark.parametrize("ga,clip", [(1, None), (2, 0.05)])
def test_modules_to_save_of_a_tied_model_train_as_peft_ties_them(modules, ensure_tying, tied, ga, clip):
    """A tied model: with ensure_weight_tying PEFT's lm_head copy shares the embedding copy's
    weight, else each copy trains on its own; the slid model does the same as PEFT."""
    ref, slid = mts_pair(modules, "llama", tied=True, ensure_tying=ensure_tying,
                         gradient_accumulation_steps=ga, max_grad_norm=clip)
    assert slid.slide_engine.tied == tied
    assert train_both(ref, slid, batches(3 * ga, pad=True), ga=ga, clip=clip) < 0.05 * LR


@pytest.mark.parametrize("model_type,tied,ensure_tying", [("qwen3", False, False), ("llama", True, True)])
@pytest.mark.parametrize("clip", [None, 0.05])
def test_a_resident_embedding_copy_trains_as_peft(model_type, tied, ensure_tying, clip):
    """The embedding's copy kept on the device and updated there (resident_embedding, one backward
    per step), as the engine does for a fully trained embedding."""
    ref, slid = mts_pair(["embed_tokens", "lm_head"], model_type, tied, ensure_tying, resident_embedding=True,
                         max_grad_norm=clip)
    resident = []
    assert train_both(ref, slid, batches(3, pad=True), clip=clip,
                      after_step=lambda: resident.append(slid.slide_stats()["resident_embedding"])) < 0.05 * LR
    assert all(resident)


def _copy_weights(model) -> dict[str, torch.Tensor]:
    """The trained copies' weights under the keys PEFT's adapter file gives them."""
    base = model.get_base_model()
    return {f"base_model.model.{n}.weight": m.modules_to_save["default"].weight.detach().clone()
            for n, m in base.named_modules() if type(m).__name__ == "ModulesToSaveWrapper"}


@pytest.mark.parametrize("modules,tied,ensure_tying", [
    (["lm_head"], False, False), (["embed_tokens", "lm_head"], False, False),
    (["lm_head"], True, True), (["lm_head"], True, False),
])
def test_saved_modules_to_save_load_with_peft_and_give_the_same_logits(tmp_path, modules, tied, ensure_tying):
    """save_pretrained writes the trained copies into the adapter file; PEFT loads it on a plain
    model, which then gives the slid model's logits."""
    from safetensors.torch import load_file
    ref, slid = mts_pair(modules, "llama", tied, ensure_tying)
    train_both(ref, slid, batches(2))
    slid.save_pretrained(tmp_path / "adapter")
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    copies = _copy_weights(slid)
    assert {k for k in saved if "lora_" not in k} == set(copies)
    assert all(torch.equal(saved[k], t) for k, t in copies.items())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = PeftModel.from_pretrained(_base("llama", tied), tmp_path / "adapter")
    b = batches(1)[0]
    with torch.no_grad():
        want = plain(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        got = slid(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("modules,tied,ensure_tying", [
    (["embed_tokens", "lm_head"], False, False), (["lm_head"], True, False), (["lm_head"], True, True),
])
def test_merged_modules_to_save_are_the_trained_copies(tmp_path, modules, tied, ensure_tying):
    """hs.merge_and_unload puts the trained copies in their wrappers' place, as PEFT's own merge
    does (a tied model they untied is saved untied); the full checkpoint loads with HF alone."""
    ref, slid = mts_pair(modules, "llama", tied, ensure_tying)
    train_both(ref, slid, batches(2))
    copies = _copy_weights(slid)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want_model = ref.merge_and_unload()
        merged = hs.merge_and_unload(slid)
    assert all(torch.equal(merged.get_submodule(k.removeprefix("base_model.model.")[:-len(".weight")]).weight, t)
               for k, t in copies.items())
    assert merged.config.tie_word_embeddings == want_model.config.tie_word_embeddings
    b = batches(1)[0]
    with torch.no_grad():
        want = want_model(input_ids=b["input_ids"]).logits
        torch.testing.assert_close(merged(input_ids=b["input_ids"]).logits, want, rtol=1e-5, atol=1e-5)
    merged.save_pretrained(tmp_path / "merged")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=b["input_ids"]).logits, want, rtol=1e-5, atol=1e-5)


def test_slide_trainer_trains_modules_to_save_as_the_plain_trainer(tmp_path):
    """Accumulation, active clipping, decay groups and a schedule, with the lm_head's copy trained
    in full: SlideTrainer against the plain Trainer on the same PEFT model."""
    from transformers import Trainer, TrainingArguments
    ref, _ = mts_pair(["lm_head"], "llama")
    model = copy.deepcopy(ref)
    data = _trainer_data()
    plain = Trainer(model=ref, args=TrainingArguments(**_trainer_args(tmp_path, "plain")), train_dataset=data)
    plain.train()
    slid = hs.SlideTrainer(model=model, args=hs.SlideArgs(**_trainer_args(tmp_path, "slide")), train_dataset=data)
    slid.train()
    want = [h["loss"] for h in plain.state.log_history if "loss" in h]
    got = [h["loss"] for h in slid.state.log_history if "loss" in h]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5)
    a, b = _adapters(ref), _adapters(model)
    assert any("modules_to_save" in n for n in a)
    assert max((a[n] - b[n]).abs().max().item() for n in a) < 0.05 * 1e-2


def test_modules_to_save_resume_equals_uninterrupted(tmp_path):
    # the trained embedding and head units with their moments, and the adapters; the frozen layers
    # are named in the index, never written
    trained = _resume_against_uninterrupted(
        tmp_path, lambda: mts_pair(["embed_tokens", "lm_head"], "llama")[0],
        ["adapters.safetensors", "index.json", "unit-00000.safetensors", "unit-00004.safetensors"])
    assert any("modules_to_save" in n for n in trained)


@pytest.mark.parametrize("modules,tied,ensure_tying,dtype", [
    (["embed_tokens", "lm_head"], False, False, torch.float32),
    (["lm_head"], False, False, torch.bfloat16),
    (["lm_head"], True, False, torch.float32),     # the untied lm_head's copy starts as the checkpoint's table
    (["lm_head"], True, True, torch.float32),
])
def test_from_pretrained_with_modules_to_save_equals_sliding_the_peft_model(tmp_path, modules, tied, ensure_tying,
                                                                              dtype):
    """The meta build: the copies start as the checkpoint's weights, the originals beside them are
    filled (no meta tensor is left), and training equals sliding the PEFT model of the loaded
    checkpoint; a trained head is kept in fp32 masters whatever the compute dtype."""
    _base("llama", tied).save_pretrained(tmp_path / "base")

    def lora():
        return LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, modules_to_save=list(modules),
                          ensure_weight_tying=ensure_tying)
    cfg = hs.SlideConfig(device="cpu", dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = hs.SlideModel.from_pretrained(tmp_path / "base", cfg, peft_config=lora())
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
        other = hs.slide(get_peft_model(copy.deepcopy(plain), lora()), cfg)
    assert not any(p.is_meta for p in loaded.parameters())
    table = plain.get_input_embeddings().weight
    assert all(torch.equal(t, table if "embed_tokens" in k else plain.lm_head.weight)
               for k, t in _copy_weights(loaded).items())
    eng = loaded.slide_engine
    assert eng.head_unit.master.dtype == torch.float32 and {u.master.dtype for u in eng.layer_units} == {dtype}
    other.load_state_dict(loaded.state_dict(), strict=False)
    assert_same_training(loaded, other, batches(2))


def test_modules_to_save_misuse_raises():
    """A forward with the adapter disabled would need the originals the engine does not compute
    with; modules_to_save added to a model already slid would never train."""
    _, slid = mts_pair(["lm_head"])
    b = batches(1)[0]
    with slid.disable_adapter(), pytest.raises(hs.SlideStateError, match="disable_adapter"):
        slid(**b)
    slid(**b)                                                  # enabled again: fine
    late = get_peft_model(hs.slide(_base(tied=False), hs.SlideConfig(device="cpu", dtype=torch.float32)),
                          LoraConfig(r=4, target_modules=TARGETS, modules_to_save=["lm_head"]))
    with pytest.raises(ValueError, match="modules_to_save, in the PEFT model given to slide"):
        late(**b)
