"""`triton_ops.gated_rms_norm`: Qwen3.5's gated norm of the linear attention's output.

The reference is transformers' `Qwen3_5RMSNormGated`, checked bit for bit; the kernel against it in
float64 on odd shapes, forward and every gradient (test_triton_ops.assert_close). The kernel tests
run on CUDA, or on the CPU in the interpreter's child run of test_triton_ops.py (`-k kernel`).
"""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

import triton_ops
from helpers import family_config
from test_triton_ops import DTYPES, KERNEL_DEVICE, _fp64, _leaf, assert_close, needs_kernels
from triton_ops import reference

SHAPES = [(3, 7, 128), (5, 33), (2, 3, 5, 100), (130, 128)]    # a head's 128, odd H, rows across tiles


def _inputs(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, z, dy = (torch.randn(shape, generator=g).to(device, dtype) for _ in range(3))
    w = (1 + 0.3 * torch.randn(shape[-1], generator=g)).to(device, dtype)
    return x, z, w, dy


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_reference_is_transformers_gated_norm(dtype):
    x, z, w, _ = _inputs((4, 6, 64), dtype, "cpu")
    module = Qwen3_5RMSNormGated(64, eps=1e-6).to(dtype)
    module.weight.data.copy_(w)
    torch.testing.assert_close(reference.gated_rms_norm(x, z, w, 1e-6), module(x, z), rtol=0, atol=0)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_gated_norm_forward_and_gradients(shape, dtype):
    x, z, w, dy = _inputs(shape, dtype, KERNEL_DEVICE)
    xk, zk, wk = _leaf(x), _leaf(z), _leaf(w)
    y = triton_ops.gated_rms_norm(xk, zk, wk, 1e-6)
    assert y.dtype == dtype and y.shape == x.shape
    y.backward(dy)
    x64, z64, w64 = _fp64(x), _fp64(z), _fp64(w)
    ref = reference.gated_rms_norm(x64, z64, w64, 1e-6)
    ref.backward(dy.double().cpu())
    assert_close(y, ref, dtype, "y")
    for what, got, want in (("dx", xk.grad, x64.grad), ("dgate", zk.grad, z64.grad), ("dw", wk.grad, w64.grad)):
        assert_close(got, want, dtype, what, scale=2.0)


@needs_kernels
def test_kernel_gated_norm_comparison_fails_without_the_gate():
    x, z, w, _ = _inputs((3, 7, 128), torch.float32, KERNEL_DEVICE)
    y = triton_ops.gated_rms_norm(x, z, w, 1e-6)
    with pytest.raises(AssertionError):
        assert_close(y, reference.gated_rms_norm(x, torch.full_like(z, 30.0), w, 1e-6), torch.float32, "ungated")


def test_mixed_dtypes_run_the_reference():
    x, z, _, _ = _inputs((3, 16), torch.bfloat16, "cpu")
    w = torch.ones(16)
    torch.testing.assert_close(triton_ops.gated_rms_norm(x, z, w), reference.gated_rms_norm(x, z, w, 1e-6),
                               rtol=0, atol=0)


def test_kernel_patched_qwen3_5_norms_train_as_transformers():
    """A tiny Qwen3.5 with only its gated norms patched: loss and every gradient as the unpatched
    model's (the kernel on CUDA or under the interpreter, else the reference, bit for bit)."""
    device = KERNEL_DEVICE or "cpu"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config("qwen3_5_text")).float().to(device)
    patched = copy.deepcopy(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 45), device=device)
    ref = model(input_ids=ids, labels=ids).loss
    ref.backward()
    with triton_ops.patch(patched, rms_norm=False, rope=False, swiglu=False, gated_delta=False, causal_conv=False,
                          cross_entropy=False) as handle:
        norms = [m for m in patched.modules() if type(m).__name__.endswith("RMSNormGated")]
        assert norms and all(m in handle.forwards for m in norms)
        loss = patched(input_ids=ids, labels=ids).loss
        loss.backward()
    assert all("forward" not in m.__dict__ for m in norms)
    exact = KERNEL_DEVICE is None
    torch.testing.assert_close(loss, ref, rtol=0 if exact else 1e-6, atol=0)
    for (name, p), (_, r) in zip(patched.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=0 if exact else 1e-4, atol=0 if exact else 1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")
