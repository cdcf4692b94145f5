"""`triton_ops.patch` on Hugging Face models, and the reference ops against HF's own modules.

The convergence tests train a tiny model of each family with and without the fused ops and
compare the loss curves step by step: float32 to 1e-4 on CPU (kernels through Triton's
interpreter, in the child run of test_triton_ops.py), bfloat16 to 2e-2 on the GPU.
"""
from __future__ import annotations

import os

import pytest
import torch
import transformers

import triton_ops
from triton_ops import reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else ("cpu" if INTERPRET else None)
needs_kernels = pytest.mark.skipif(KERNEL_DEVICE is None,
                                   reason="kernels run on CUDA, or on CPU under TRITON_INTERPRET=1 (child run)")
CONFIGS = {
    "llama": transformers.LlamaConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    "mistral": transformers.MistralConfig,
    "gemma3_text": transformers.Gemma3TextConfig,     # GeGLU, (1 + w) norms, post-norms kept HF's
}


def tiny_model(family: str, dtype=torch.float32, device="cpu", seed=0):
    config = CONFIGS[family](
        vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.to(device=device, dtype=dtype)


def _batch(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 257, (2, 24), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100
    return ids.to(device), labels.to(device)


def _loss_curve(model, steps, device):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    curve = []
    for step in range(steps):
        ids, labels = _batch(device, seed=step)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        curve.append(loss.item())
    return curve


# ---------------------------------------------------------------- reference == HF modules

def test_reference_ops_match_hf_llama_modules():
    from transformers.models.llama import modeling_llama as ml

    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 5, 64).to(dtype)
        norm = ml.LlamaRMSNorm(64, eps=1e-5).to(dtype)
        norm.weight.data.uniform_(0.5, 1.5)
        torch.testing.assert_close(reference.rms_norm(x, norm.weight, 1e-5), norm(x), rtol=0, atol=0)
        q, k = torch.randn(2, 4, 7, 16).to(dtype), torch.randn(2, 2, 7, 16).to(dtype)
        cos, sin = torch.randn(2, 7, 16).to(dtype), torch.randn(2, 7, 16).to(dtype)
        for ours, theirs in zip(reference.rope(q, k, cos, sin), ml.apply_rotary_pos_emb(q, k, cos, sin)):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
        g, u = torch.randn(4, 9).to(dtype), torch.randn(4, 9).to(dtype)
        torch.testing.assert_close(reference.swiglu(g, u), torch.nn.SiLU()(g) * u, rtol=0, atol=0)


# ---------------------------------------------------------------- patch / unpatch

def test_patch_and_revert_restore_the_model():
    model = tiny_model("qwen3")
    from transformers.models.qwen3 import modeling_qwen3 as mq

    original_rope = mq.apply_rotary_pos_emb
    ids, labels = _batch("cpu")
    with torch.no_grad():
        before = model(input_ids=ids, labels=labels).loss
    handle = triton_ops.patch(model)
    assert mq.apply_rotary_pos_emb is not original_rope
    assert "forward" in model.__dict__ and "forward" in model.model.norm.__dict__
    assert "forward" in model.model.layers[0].mlp.__dict__
    with pytest.raises(RuntimeError):
        triton_ops.patch(model)
    second = tiny_model("qwen3", seed=1)
    with triton_ops.patch(second):
        pass                                   # another model's revert keeps this model's rope
    assert mq.apply_rotary_pos_emb is not original_rope
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)
    assert out.logits is None
    torch.testing.assert_close(out.loss, before, rtol=1e-5, atol=1e-5)
    triton_ops.unpatch(model)
    assert mq.apply_rotary_pos_emb is original_rope
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert handle.forwards == []
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, labels=labels).loss, before, rtol=0, atol=0)
        assert model(input_ids=ids).logits is not None


def test_patch_rejects_unsupported_families():
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50)
    with pytest.raises(ValueError, match="supports"):
        triton_ops.patch(transformers.GPT2LMHeadModel(config))


def test_patched_forward_without_labels_returns_logits():
    model = tiny_model("llama")
    ids, _ = _batch("cpu")
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        with triton_ops.patch(model):
            torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- convergence

@needs_kernels
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text"])
def test_patched_kernel_model_follows_the_same_loss_curve(family):
    dtype = torch.bfloat16 if KERNEL_DEVICE == "cuda" else torch.float32
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    steps = 8 if KERNEL_DEVICE == "cuda" else 3
    plain = _loss_curve(tiny_model(family, dtype, KERNEL_DEVICE), steps, KERNEL_DEVICE)
    model = tiny_model(family, dtype, KERNEL_DEVICE)
    with triton_ops.patch(model):
        fused = _loss_curve(model, steps, KERNEL_DEVICE)
    for step, (a, b) in enumerate(zip(plain, fused)):
        assert abs(a - b) <= tol * abs(a), f"step {step}: {a} (HF) vs {b} (kernels)"


@needs_kernels
@pytest.mark.parametrize("family", ["mistral", "gemma3_text"])
def test_patched_kernel_model_gradients_match_hf(family):
    model = tiny_model(family, torch.float32, KERNEL_DEVICE)
    ids, labels = _batch(KERNEL_DEVICE)
    model(input_ids=ids, labels=labels).loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with triton_ops.patch(model):
        model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(40)).loss.backward()
    scale = (labels[..., 1:] != -100).sum().item() / 40   # the patched loss is a sum over 40
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name] * scale, rtol=2e-4, atol=2e-5, msg=name)


def test_rows_forward_gives_the_same_output_and_its_fp8_rows():
    from triton_ops.patching import patched_op, rows_forward
    model = tiny_model("qwen3", dtype=torch.bfloat16)
    layer = model.model.layers[0]
    handle = triton_ops.patch(model)
    assert patched_op(layer.input_layernorm) == "rms_norm" and patched_op(layer.mlp) == "swiglu"
    assert patched_op(layer.self_attn.q_proj) is None and rows_forward(layer.self_attn.q_proj, print) is None
    x = torch.randn(2, 5, 64).bfloat16()
    for module in (layer.input_layernorm, layer.mlp):
        given = []
        out = rows_forward(module, lambda t, rows: given.append((t, rows)))(x)
        assert torch.equal(out, module(x))
        (t, (q, inv)), = given
        inner = t.reshape(-1, t.shape[-1])
        rq, rinv = reference.fp8_quantize_rows(inner)
        assert t.shape[-1] == (64 if module is layer.input_layernorm else 96)     # the norm's output, the activation
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(inv, rinv)
    handle.revert()
    assert patched_op(layer.input_layernorm) is None
