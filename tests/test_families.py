"""The families with quirks of their own (models/registry.py): Gemma 3, Phi-3, OLMo 2 / 3, SmolLM3,
Granite, Qwen3.5, and the mixtures of experts Qwen3-MoE, Mixtral, Qwen3.5-MoE, gpt-oss, each a tiny model with its quirks switched on (helpers.FAMILY_FEATURES), against
plain HF + torch.optim.AdamW in fp32; the kernels each entry lists, through the CPU references
held to the kernels' in-place contracts; and the families the engine refuses."""
import copy
import dataclasses
import math

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

import hf_slideformer as hs
import triton_ops
from hf_slideformer.models import FAMILIES as REGISTRY
from helpers import QUIRK_FAMILIES, QUIRK_VARIANTS, batches, family_config, make_pair, model_type_of
from test_engine import LR, PARAM_TOL, train_both
from triton_ops import reference

GA, CLIP = 2, 0.5
# Gemma 4's tiny models are chaotic under Adam at the tests' lr: the first step moves elements
# whose gradient is near eps by a full lr, so last-bit differences of the kernels grow to 2e-4 of
# HF's own third-step gradient norm (dense and MoE, tied, transformers 5.25). At lr 1e-3 they stay
# under 3e-5, so they train there, held to the same bounds relative to that lr.
LR_OF = {"gemma4_text": 1e-3}


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("family", QUIRK_VARIANTS)
@pytest.mark.parametrize("tied", [False, True])
def test_sliding_equals_hf_with_accumulation_and_clipping(family, tied):
    """Three optimizer steps of two micro-batches each, clipped: every loss within 1e-5, every
    weight but one in 500 within 5% of one lr step, those within one step (right padding: left-padded tiny OLMo 2 runs are chaotic,
    a 1e-7 change of the weights moves HF's own second-step norm by 1e-3)."""
    ref, slid = make_pair(family, tied, gradient_accumulation_steps=GA, max_grad_norm=CLIP)
    assert (slid.lm_head.weight is slid.model.embed_tokens.weight) == tied
    lr = LR_OF.get(model_type_of(family), LR)
    train_both(ref, slid, batches(3 * GA, pad=True), ga=GA, clip=CLIP, lr=lr)
    theirs = ref.state_dict()
    for name, w in slid.state_dict().items():
        # Where an element's first moment crosses zero, Adam's m / sqrt(v) amplifies the last-bit
        # differences of HF's and the engine's kernels (which change with the thread count): one
        # element in 500 may be up to one lr step apart; a wrong gradient moves most of them.
        diff = (w - theirs[name]).abs()
        assert (diff > PARAM_TOL * lr / LR).float().mean() <= 2e-3 and diff.max() < lr, (name, diff.max())


@pytest.mark.parametrize("family", QUIRK_VARIANTS)
def test_save_reloads_with_auto_model_and_from_pretrained(tmp_path, family):
    tied = model_type_of(family) in ("gemma3_text", "gemma4_text", "granite")   # the tied checkpoints of the list
    _, slid = make_pair(family, tied)
    opt = slid.create_optimizer(lr=LR)
    for b in batches(2, pad=True):
        slid(**b).loss.backward()
        opt.step()
        opt.zero_grad()
    slid.save_pretrained(tmp_path)
    b = batches(1, seed=3)[0]
    with torch.no_grad():
        expected = slid(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
        torch.testing.assert_close(hf(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits,
                                   expected, rtol=1e-5, atol=1e-5)
        again = hs.SlideModel.from_pretrained(tmp_path, slide_config=hs.SlideConfig(device="cpu"))
        torch.testing.assert_close(again(**b).loss, slid(**b).loss, rtol=0, atol=0)


@pytest.mark.parametrize("family", QUIRK_VARIANTS)
def test_resume_equals_the_uninterrupted_run(tmp_path, family):
    from hf_slideformer.checkpoints.train_checkpoint import load_training_state, save_training_state
    data = batches(4 * GA, pad=True)
    kw = dict(gradient_accumulation_steps=GA, max_grad_norm=CLIP)

    def train(model, opt, chunk):
        for n, b in enumerate(chunk):
            (model(**b).loss / GA).backward()
            if (n + 1) % GA == 0:
                opt.step()
                opt.zero_grad()

    _, full = make_pair(family, **kw)
    train(full, full.create_optimizer(lr=LR, weight_decay=0.1), data)
    _, first = make_pair(family, **kw)
    opt1 = first.create_optimizer(lr=LR, weight_decay=0.1)
    train(first, opt1, data[:2 * GA])
    save_training_state(str(tmp_path / "ck"), first, opt1)
    _, second = make_pair(family, seed=7, **kw)
    opt2 = second.create_optimizer(lr=LR, weight_decay=0.1)
    load_training_state(str(tmp_path / "ck"), second, opt2)
    train(second, opt2, data[2 * GA:])
    a, b = _state(full), _state(second)
    assert all(torch.equal(a[k], b[k]) for k in a)


LORA_TARGETS = {"qwen3_moe": dict(target_modules=["q_proj", "v_proj", "o_proj"])}


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_5_text", "qwen3_moe"])
def test_lora_equals_peft(family):
    """PEFT LoRA on the attention and MLP projections (Qwen3.5: its full-attention layer and
    every MLP; Qwen3-MoE: the attention), slid against PEFT alone, accumulation and clipping on."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(family_config(family, tied=True)).float()
    base.config.use_cache = False
    targets = LORA_TARGETS.get(family, dict(target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"]))
    cfg = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **targets)
    ref = get_peft_model(base, cfg)
    slid = hs.slide(copy.deepcopy(ref), hs.SlideConfig(device="cpu", dtype=torch.float32,
                                                       gradient_accumulation_steps=GA, max_grad_norm=CLIP))
    ropt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    opt = slid.create_optimizer(lr=LR, weight_decay=0.0)
    data = batches(3 * GA, pad=True)
    for k in range(0, len(data), GA):
        for b in data[k:k + GA]:
            r, s = ref(**b).loss, slid(**b).loss
            assert math.isclose(s.item(), r.item(), rel_tol=1e-5), (s.item(), r.item())
            (r / GA).backward()
            (s / GA).backward()
        torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], CLIP)
        for o in (ropt, opt):
            o.step()
            o.zero_grad()
    slid.slide_engine.synchronize()
    a = {n: p for n, p in ref.named_parameters() if "lora_" in n}
    b = {n: p for n, p in slid.named_parameters() if "lora_" in n}
    assert set(a) == set(b) and a
    assert max((a[n] - b[n].detach()).abs().max().item() for n in a) < PARAM_TOL


# ---------------------------------------------------------------- the kernels each entry lists
class _NormContract(torch.autograd.Function):
    """`reference.rms_norm` held to the kernel's contract: with `in_place_backward`, dx is
    written over the incoming gradient (triton_ops/kernels/rms_norm.py)."""

    @staticmethod
    def forward(ctx, x, weight, eps, in_place, offset):
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.in_place, ctx.offset = eps, in_place, offset
        return reference.rms_norm(x, weight, eps, offset)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            xl, wl = x.detach().requires_grad_(), weight.detach().requires_grad_()
            dx, dw = torch.autograd.grad(reference.rms_norm(xl, wl, ctx.eps, ctx.offset), (xl, wl), dy)
        if ctx.in_place:
            dx = dy.copy_(dx)
        return dx, dw, None, None, None


class _GatedContract(torch.autograd.Function):
    """`reference.swiglu` / `reference.geglu` held to the kernels' contract: with
    `in_place_backward`, the gradients are written over gate and up (their versions bumped, so a
    node that saved either fails loudly; triton_ops/kernels/swiglu.py, geglu.py)."""

    @staticmethod
    def forward(ctx, gate, up, in_place, op):
        ctx.save_for_backward(gate, up)
        ctx.in_place, ctx.op = in_place, op
        return op(gate, up)

    @staticmethod
    def backward(ctx, dc):
        gate, up = ctx.saved_tensors
        with torch.enable_grad():
            gl, ul = gate.detach().requires_grad_(), up.detach().requires_grad_()
            da, db = torch.autograd.grad(ctx.op(gl, ul), (gl, ul), dc)
        if ctx.in_place:
            da, db = gate.copy_(da), up.copy_(db)
        return da, db, None, None


class _RopeContract(torch.autograd.Function):
    """`reference.rope` held to the kernel's contract: q and k rotated in place (their version
    bumped), the incoming gradients rotated back in place (triton_ops/kernels/rope.py)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, dim):
        rq, rk = reference.rope(q, k, cos, sin, dim)
        q.copy_(rq)
        k.copy_(rk)
        ctx.save_for_backward(cos, sin)
        ctx.dim = dim
        return q.view_as(q), k.view_as(k)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq, dk = dq.contiguous(), dk.contiguous()
        rq, rk = reference.rope(dq, dk, cos, -sin, ctx.dim)        # the transposed rotation
        return dq.copy_(rq), dk.copy_(rk), None, None, None


@pytest.fixture
def kernel_contracts(monkeypatch):
    monkeypatch.setattr(triton_ops, "rms_norm", lambda x, w, eps=1e-6, in_place_backward=False, offset=False:
                        _NormContract.apply(x, w, eps, in_place_backward, offset))
    for name in ("swiglu", "geglu"):
        monkeypatch.setattr(triton_ops, name, lambda a, b, in_place_backward=False, op=getattr(reference, name):
                            _GatedContract.apply(a, b, in_place_backward, op))
    monkeypatch.setattr(triton_ops, "rope", lambda q, k, cos, sin, dim=1: _RopeContract.apply(q, k, cos, sin, dim))


def _patched_against_hf(family):
    """Loss and every gradient of a tiny model patched by `triton_ops.patch`, against HF's."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(family_config(family, tied=False)).float()
    patched = copy.deepcopy(hf)
    b = batches(1, pad=True)[0]
    with triton_ops.patch(patched) as handle:
        losses = [m(**b).loss for m in (hf, patched)]
        for loss in losses:
            loss.backward()
        assert handle.forwards
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    grads = {n: p.grad for n, p in patched.named_parameters()}
    return max(((p.grad - grads[n]).abs().max() / (p.grad.abs().max() + 1e-12)).item()
               for n, p in hf.named_parameters())


@pytest.mark.parametrize("family", [f for f in QUIRK_FAMILIES if REGISTRY[f].kernels])
def test_the_kernels_an_entry_lists_keep_the_family_math(family, kernel_contracts):
    assert _patched_against_hf(family) < 1e-4


def test_the_contract_catches_a_norm_whose_output_feeds_the_residual(kernel_contracts, monkeypatch):
    """OLMo 2's post-norms feed the residual add: the in-place norm backward would corrupt the
    residual's gradient (note [Why a residual norm's backward is out of place])."""
    wrong = dataclasses.replace(REGISTRY["olmo2"], kernels=("rms_norm", "rope", "swiglu"))
    monkeypatch.setitem(REGISTRY, "olmo2", wrong)
    assert _patched_against_hf("olmo2") > 1e-2


def test_the_contract_catches_a_gemma_post_norm_patched(kernel_contracts, monkeypatch):
    """Gemma 3's post-norms feed the residual add: patched with the in-place backward, they corrupt
    the residual's gradient (note [Why a residual norm's backward is out of place])."""
    wrong = dataclasses.replace(REGISTRY["gemma3_text"], residual_norms=())
    monkeypatch.setitem(REGISTRY, "gemma3_text", wrong)
    assert _patched_against_hf("gemma3_text") > 1e-2


def test_gemma_takes_geglu_and_the_offset_norm_where_the_norm_feeds_linears():
    from triton_ops.patching import patched_op
    model = AutoModelForCausalLM.from_config(family_config("gemma3_text"))
    layer = model.model.layers[0]
    with triton_ops.patch(model):
        assert patched_op(layer.mlp) == "geglu"                       # not taken for a SwiGLU
        for norm in (layer.input_layernorm, layer.pre_feedforward_layernorm, layer.self_attn.q_norm,
                     layer.self_attn.k_norm, model.model.norm):
            assert patched_op(norm) == "offset_rms_norm"              # not the Llama-cast kernel
        for norm in (layer.post_attention_layernorm, layer.post_feedforward_layernorm):
            assert patched_op(norm) == "residual_offset_rms_norm"       # its backward out of place


# ---------------------------------------------------------------- refusals (the counts: test_registry.py)
def test_a_multimodal_checkpoint_is_refused_naming_its_text_model():
    from transformers import Gemma3Config
    cfg = Gemma3Config(text_config=family_config("gemma3_text").to_dict())
    with torch.device("meta"):                     # refused before any weight is read
        model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match="text model"):
        hs.slide(model, hs.SlideConfig(device="cpu"))


@pytest.mark.parametrize("kw,part", [(dict(hidden_size_per_layer_input=8), "per-layer inputs"),
                                     (dict(num_kv_shared_layers=1), "shared KV layers")])
def test_gemma4_parts_the_engine_does_not_slide_are_refused(kw, part):
    """Gemma 4 E2B / E4B: per-layer inputs and shared KV layers, each refused by name at slide()."""
    with torch.device("meta"):                     # refused before any weight is read
        model = AutoModelForCausalLM.from_config(family_config("gemma4_text", **kw))
    with pytest.raises(NotImplementedError, match=part):
        hs.slide(model, hs.SlideConfig(device="cpu"))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen3_5_moe_text", "gpt_oss"])
def test_the_router_aux_loss_is_hf_s(family):
    """The aux loss is HF's (the padding masked), in the loss and beside it; without it the loss is
    the cross-entropy alone (the equivalence above trains with it on)."""
    ref, slid = make_pair(family)
    b = batches(1, pad=True)[0]
    with torch.no_grad():
        r, s = ref(**b), slid(**b)
    assert r.aux_loss is not None and s.aux_loss is not None
    torch.testing.assert_close(s.aux_loss, r.aux_loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(s.loss, r.loss, rtol=1e-5, atol=1e-7)
    ref, slid = make_pair(family, cfg_kw=dict(output_router_logits=False))
    with torch.no_grad():
        torch.testing.assert_close(slid(**b).loss, ref(**b).loss, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_the_fused_head_path_returns_a_differentiable_aux_loss(family):
    """TRL's SFT loss: -sum(log_probs) / tokens + coef * aux_loss, the aux asked for by the forward
    (`output_router_logits=True`, the config's off), trains as HF's loss with the aux: three
    steps, every weight within 5% of one lr step; a loss without the aux trains without it."""
    ref, slid = make_pair(family, cfg_kw=dict(output_router_logits=False))
    coef = ref.config.router_aux_loss_coef
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    opt = slid.create_optimizer(lr=LR, weight_decay=0.0)
    for b in batches(3, pad=True):
        ref(**b, output_router_logits=True).loss.backward()
        out = slid(**b, fused_lm_head=True, output_router_logits=True)
        assert out.aux_loss is not None and out.aux_loss.requires_grad
        (-out.log_probs.sum() / out.label_mask.sum() + coef * out.aux_loss).backward()
        for o in (ropt, opt):
            o.step()
            o.zero_grad()
    slid.slide_engine.synchronize()
    from helpers import max_param_diff
    assert max_param_diff(ref, slid) < PARAM_TOL
    b = batches(1, seed=5, pad=True)[0]
    assert slid(**b, fused_lm_head=True).aux_loss is None            # neither the config nor the forward asks


def test_a_layer_the_family_does_not_prove_is_refused():
    """A Llama whose second layer is another class (here: an OLMo 2 layer, whose MLP feeds a norm)."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2DecoderLayer
    model = AutoModelForCausalLM.from_config(family_config("llama"))
    model.model.layers[1] = Olmo2DecoderLayer(family_config("olmo2"), 1)
    with pytest.raises(NotImplementedError, match="Olmo2DecoderLayer"):
        hs.slide(model, hs.SlideConfig(device="cpu"))


def test_a_dropout_of_the_family_is_refused():
    model = AutoModelForCausalLM.from_config(family_config("phi3", resid_pdrop=0.1))
    with pytest.raises(NotImplementedError, match="resid_pdrop"):
        hs.slide(model, hs.SlideConfig(device="cpu"))


@pytest.mark.parametrize("family", ["gemma3_text", "granite"])
def test_per_token_statistics_take_the_logit_transform(family):
    """TRL's fused-head fields from the engine's head: log p(label) and the entropy of the
    soft-capped (Gemma) or divided (Granite) logits, as HF's logits give them."""
    ref, slid = make_pair(family)
    b = batches(1, pad=True)[0]
    with torch.no_grad():
        out = slid(**b, fused_lm_head=True)
        logp = torch.log_softmax(ref(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits, -1)
    labels = b["labels"][:, 1:]
    valid = labels != -100
    expected = logp[:, :-1].gather(-1, labels.clamp(min=0)[..., None])[..., 0] * valid
    torch.testing.assert_close(out.log_probs, expected, rtol=1e-5, atol=1e-5)
    entropy = -(logp[:, :-1].exp() * logp[:, :-1]).sum(-1) * valid
    torch.testing.assert_close(out.entropy, entropy, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["gemma3_text", "granite"])
def test_trl_fused_head_asking_for_the_family_transform_is_the_engine_head(family):
    """TRL reads the soft-cap / logit scale from the config; the engine's head applies the same."""
    utils = pytest.importorskip("trl.trainer.utils")
    _, slid = make_pair(family)
    utils.add_fused_lm_head(slid, outputs=("log_probs", "entropy"))
    assert "forward" not in slid.__dict__


def test_misaligned_expert_weights_leave_grouped_mm_for_batched_mm(caplog):
    """torch's grouped GEMM needs 16-byte aligned operands: with 8 experts the 4 attention sinks
    and the 8-element router bias leave the tiny gpt_oss's expert weights at an offset of 4 bf16
    elements in the slot, so the experts switch to HF's batched_mm (the same loss); with 4 the
    router bias realigns them and grouped_mm stays."""
    from hf_slideformer.engine.slide_checks import align_grouped_experts

    _, aligned = make_pair("gpt_oss", False)
    assert not align_grouped_experts(aligned, aligned.slide_engine.store.units, torch.bfloat16)
    assert aligned.config._experts_implementation == "grouped_mm"
    ref, slid = make_pair("gpt_oss", False, cfg_kw=dict(num_local_experts=8))
    with caplog.at_level("WARNING", logger="hf_slideformer.engine.slide_checks"):
        assert align_grouped_experts(slid, slid.slide_engine.store.units, torch.bfloat16)
    assert slid.config._experts_implementation == "batched_mm" and "batched_mm" in caplog.text
    b = batches(1)[0]
    with torch.no_grad():
        torch.testing.assert_close(slid(**b).loss, ref(**b).loss, rtol=1e-5, atol=1e-6)
