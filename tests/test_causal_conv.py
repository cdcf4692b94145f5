"""`triton_ops.causal_conv`: the linear-attention layers' causal depthwise convolution (+ SiLU).

The reference is transformers' own `causal_conv1d_fn` (its torch path), checked bit for bit; the
kernel against it on odd shapes and in the layers' layout ((B, T, C) transposed), forward and every
gradient, in float64 oracles' tolerances (test_triton_ops.assert_close). The kernel tests run on
CUDA, or on the CPU in the interpreter's child run of test_triton_ops.py (`-k kernel`).
"""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_5 import modeling_qwen3_5 as q35

import triton_ops
from helpers import family_config
from test_triton_ops import DTYPES, KERNEL_DEVICE, _fp64, _leaf, assert_close, needs_kernels
from triton_ops import reference

# (B, T, C, K): T below, at and across the kernel's 32-position tiles, C across its 128-channel tiles.
SHAPES = [(2, 37, 50, 4), (1, 5, 130, 3), (3, 70, 33, 4), (1, 1, 7, 4), (2, 64, 256, 2)]


def _inputs(B, T, C, K, dtype, device, layout, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=g).to(device, dtype)
    x = x.transpose(1, 2) if layout == "layers" else x.transpose(1, 2).contiguous()
    w = (0.5 * torch.randn(C, K, generator=g)).to(device, dtype)
    dy = torch.randn(B, C, T, generator=g).to(device, dtype)
    return x, w, dy


@pytest.mark.parametrize("silu", [True, False])
def test_the_reference_is_transformers_causal_conv1d_fn(silu):
    x, w, _ = _inputs(2, 19, 24, 4, torch.float32, "cpu", "layers")
    assert not q35.causal_conv1d_fn.__module__.startswith("triton_ops"), "a patch was left in place"
    expected = q35.causal_conv1d_fn(x, w, None, activation="silu" if silu else None)
    torch.testing.assert_close(reference.causal_conv(x, w, silu), expected, rtol=0, atol=0)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["layers", "contiguous"])
@pytest.mark.parametrize("silu", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_causal_conv_forward_and_gradients(shape, silu, layout, dtype):
    x, w, dy = _inputs(*shape, dtype, KERNEL_DEVICE, layout)
    xk, wk = _leaf(x), _leaf(w)
    y = triton_ops.causal_conv(xk, wk, silu)
    assert y.dtype == dtype and y.stride() == x.stride()
    y.backward(dy)
    x64, w64 = _fp64(x), _fp64(w)
    ref = reference.causal_conv(x64, w64, silu)
    ref.backward(dy.double().cpu())
    assert_close(y, ref, dtype, "y")
    assert_close(xk.grad, x64.grad, dtype, "dx")
    assert_close(wk.grad, w64.grad, dtype, "dw", scale=2.0)


@needs_kernels
def test_kernel_causal_conv_comparison_fails_when_the_window_is_shifted():
    """The forward comparison is sharp enough to see the window one position off (an
    anti-causal tap), so the tests above could fail."""
    x, w, _ = _inputs(2, 37, 50, 4, torch.float32, KERNEL_DEVICE, "layers")
    y = triton_ops.causal_conv(x, w, True)
    shifted = reference.causal_conv(torch.nn.functional.pad(x[..., 1:], (0, 1)), w, True)
    with pytest.raises(AssertionError):
        assert_close(y, shifted, torch.float32, "y shifted")


def _train_once(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss


@pytest.mark.parametrize("on", ["reference", "kernel"])
def test_kernel_patched_qwen3_5_trains_as_transformers(on):
    """A tiny Qwen3.5 (linear and full layers) patched with the convolution alone: loss and every
    gradient as the unpatched model's; on the CPU without the interpreter the patch runs the
    reference, bit for bit."""
    if on == "kernel" and KERNEL_DEVICE is None:
        pytest.skip("kernels run on CUDA, or on CPU under TRITON_INTERPRET=1 (child run)")
    if on == "reference" and KERNEL_DEVICE == "cpu":
        pytest.skip("under the interpreter the patch runs the kernel on the CPU too")
    device = KERNEL_DEVICE if on == "kernel" else "cpu"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config("qwen3_5_text")).float().to(device)
    patched = copy.deepcopy(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 45), device=device)
    ref = _train_once(model, ids)
    original = q35.causal_conv1d_fn
    with triton_ops.patch(patched, rms_norm=False, rope=False, swiglu=False, gated_delta=False,
                          cross_entropy=False) as handle:
        assert handle.functions == [("transformers.models.qwen3_5.modeling_qwen3_5", "causal_conv1d_fn")]
        assert q35.causal_conv1d_fn is not original
        loss = _train_once(patched, ids)
    assert q35.causal_conv1d_fn is original
    exact = on == "reference"
    torch.testing.assert_close(loss, ref, rtol=0 if exact else 1e-6, atol=0)
    for (name, p), (_, r) in zip(patched.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=0 if exact else 1e-4, atol=0 if exact else 1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_a_call_the_kernel_does_not_cover_runs_transformers_function():
    model = AutoModelForCausalLM.from_config(family_config("qwen3_5_text")).float()
    x, w, _ = _inputs(1, 9, 8, 4, torch.float32, "cpu", "layers")
    bias = torch.randn(8)
    original = q35.causal_conv1d_fn
    expected = original(x, w, bias, activation="silu")
    with triton_ops.patch(model):
        torch.testing.assert_close(q35.causal_conv1d_fn(x, w, bias, activation="silu"), expected, rtol=0, atol=0)
        gelu = q35.causal_conv1d_fn(x, w, None, activation="gelu")
    torch.testing.assert_close(gelu, original(x, w, None, activation="gelu"), rtol=0, atol=0)


@pytest.mark.parametrize("case", ["mixed dtypes", "autocast"])
def test_calls_the_kernel_does_not_mirror_run_the_reference(case):
    """transformers casts x to the weight's dtype before the convolution, and under autocast the
    convolution runs in autocast's dtype: both go to the reference, bit for bit, on every device."""
    device = KERNEL_DEVICE or "cpu"
    x, w, _ = _inputs(2, 19, 24, 4, torch.float32, device, "layers")
    if case == "mixed dtypes":
        w = w.to(torch.bfloat16)
        got, want = triton_ops.causal_conv(x, w, True), reference.causal_conv(x, w, True)
    else:
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            got, want = triton_ops.causal_conv(x, w, True), reference.causal_conv(x, w, True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
