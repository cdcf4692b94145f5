"""triton_ops.gated_delta: the chunked gated delta rule equals transformers' torch path (output,
final state, every gradient), its scan's backward passes a float64 gradient check, and a Qwen3.5
model patched with it trains as the unpatched one."""
import copy
import importlib

import pytest
import torch
from transformers import AutoModelForCausalLM

import triton_ops
from helpers import family_config
from triton_ops.gated_delta import _ChunkScan, chunk_gated_delta_rule

q35 = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")


def _hf_rule():
    """transformers' torch function (the hub wrapper falls back to it on CPU without fla)."""
    fn = q35.torch_chunk_gated_delta_rule
    assert fn is not chunk_gated_delta_rule, "a patch was left in place"
    return getattr(fn, "__wrapped__", fn)


def _inputs(batch, seq, k_heads, v_heads, k_dim, v_dim, dtype, initial):
    gen = torch.Generator().manual_seed(seq * 7 + v_heads)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).requires_grad_()

    g = (-torch.rand(batch, seq, v_heads, generator=gen) * 0.7).requires_grad_()      # log decays <= 0
    beta = torch.rand(batch, seq, v_heads, generator=gen).to(dtype).requires_grad_()
    state = rand(batch, v_heads, k_dim, v_dim).float().detach().requires_grad_() if initial else None
    return rand(batch, seq, k_heads, k_dim), rand(batch, seq, k_heads, k_dim), rand(batch, seq, v_heads, v_dim), \
        g, beta, state


@pytest.mark.parametrize("seq,k_heads,v_heads,dtype,initial,chunk", [
    (100, 2, 4, torch.float32, True, 16),       # a partial last chunk, grouped value heads
    (64, 3, 3, torch.float32, False, 16),
    (37, 1, 2, torch.bfloat16, True, 16),       # bf16 inputs, 3 chunks, the last one partial
    (70, 2, 2, torch.bfloat16, False, 64),
])
def test_equals_transformers_torch_path(seq, k_heads, v_heads, dtype, initial, chunk):
    xs = _inputs(2, seq, k_heads, v_heads, 8, 12, dtype, initial)
    leaves = [x for x in xs if x is not None]
    results = []
    # transformers 5.17's rule takes the heads repeated (its module repeats them), later ones repeat
    # them inside: repeated first, the reference is the same for both.
    repeat = v_heads // k_heads
    hf_xs = [x.repeat_interleave(repeat, dim=2) for x in xs[:2]] + list(xs[2:])
    for rule, args in ((_hf_rule(), hf_xs), (chunk_gated_delta_rule, xs)):
        out, state = rule(*args[:5], chunk_size=chunk, initial_state=args[5], output_final_state=True,
                          use_qk_l2norm_in_kernel=True)
        gen = torch.Generator().manual_seed(1)
        loss = (out.float() * torch.randn(out.shape, generator=gen)).sum() + \
            (state * torch.randn(state.shape, generator=gen)).sum()
        results.append((out, state, torch.autograd.grad(loss, leaves)))
    (ref_out, ref_state, ref_grads), (out, state, grads) = results
    assert out.dtype == ref_out.dtype and out.shape == ref_out.shape
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state, ref_state, rtol=1e-5, atol=1e-6)
    for name, grad, ref in zip("q k v g beta state".split(), grads, ref_grads):
        torch.testing.assert_close(grad, ref, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"d{n}: {m}")


def test_no_final_state_unless_asked():
    xs = _inputs(1, 20, 1, 1, 4, 4, torch.float32, False)
    out, state = chunk_gated_delta_rule(*xs[:5], chunk_size=8)
    assert state is None and out.shape == (1, 20, 1, 4)


def test_the_scan_backward_passes_a_float64_gradient_check():
    gen = torch.Generator().manual_seed(0)
    b, h, n, c, dk, dv = 1, 2, 3, 4, 3, 5

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

    args = [rand(b, h, n, c, dk), rand(b, h, n, c, dk), rand(b, h, n, c, dv), rand(b, h, n, c, dk),
            torch.randn(b, h, n, c, c, generator=gen, dtype=torch.float64).tril().requires_grad_(),
            torch.rand(b, h, n, generator=gen, dtype=torch.float64).requires_grad_(), rand(b, h, dk, dv)]
    assert torch.autograd.gradcheck(lambda *a: _ChunkScan.apply(*a), args)


def test_a_patched_qwen3_5_model_trains_as_the_unpatched_one():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config("qwen3_5_text")).float()
    patched = copy.deepcopy(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 75))
    ref = model(input_ids=ids, labels=ids).loss
    ref.backward()
    with triton_ops.patch(patched, cross_entropy=False) as handle:
        assert ("transformers.models.qwen3_5.modeling_qwen3_5", "torch_chunk_gated_delta_rule") in handle.functions
        assert q35.torch_chunk_gated_delta_rule is chunk_gated_delta_rule
        loss = patched(input_ids=ids, labels=ids).loss
        loss.backward()
    assert q35.torch_chunk_gated_delta_rule is not chunk_gated_delta_rule        # reverted
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    for (name, p), (_, r) in zip(patched.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_under_autocast_as_transformers_under_autocast():
    """bf16 autocast (the engine's bf16 compute): the products in bf16 forward and backward, as
    autograd runs transformers' ops; the results agree within bf16 rounding."""
    xs = _inputs(2, 50, 2, 2, 8, 8, torch.float32, False)
    results = []
    for rule in (_hf_rule(), chunk_gated_delta_rule):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, _ = rule(*xs[:5], chunk_size=16, use_qk_l2norm_in_kernel=True)
        grads = torch.autograd.grad(out.float().square().sum(), xs[:5])
        results.append((out, grads))
    (ref, ref_grads), (out, grads) = results
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), rtol=0.05, atol=0.02)
    for grad, ref_grad in zip(grads, ref_grads):
        assert ((grad.float() - ref_grad.float()).norm() / ref_grad.float().norm()) < 0.05
