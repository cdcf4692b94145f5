"""`triton_ops.qk_l2norm`: the chunked gated delta rule's preparation of its queries and keys.

The reference is transformers' sequence (repeat the heads, heads first in fp32, l2norm, scale),
checked bit for bit; the kernel against it in float64 on odd shapes, repeats of 1 to 3 and a view
with the projection's strides, forward and gradient (test_triton_ops.assert_close). The kernel
tests run on CUDA, or on the CPU in the interpreter's child run of test_triton_ops.py (`-k kernel`;
the interpreter rounds to bf16 by truncation, within the bf16 tolerance).
"""
from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as q35

import triton_ops
from test_triton_ops import DTYPES, KERNEL_DEVICE, _fp64, _leaf, assert_close, needs_kernels
from triton_ops import reference

# (B, T, Hk, D, repeat): T across the kernel's 16-position tiles, odd D, Qwen3.5's 128.
SHAPES = [(2, 37, 1, 8, 2), (1, 16, 3, 33, 1), (2, 5, 2, 128, 3), (1, 70, 2, 12, 2)]


def _view(B, T, Hk, D, dtype, device, seed=0):
    """(B, T, Hk, D) as the layers hand it over: a slice of a wider (B, T, C) projection."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(B, T, 3 * Hk * D + 5, generator=g).to(device, dtype)
    return wide[..., 5:5 + Hk * D].reshape(B, T, Hk, D)


def test_the_reference_is_transformers_preparation():
    x = _view(2, 9, 2, 16, torch.float32, "cpu")
    expected = q35.l2norm(x.repeat_interleave(2, dim=2).transpose(1, 2).float().contiguous(), dim=-1, eps=1e-6) * 0.25
    torch.testing.assert_close(reference.qk_l2norm(x, 2, 0.25), expected, rtol=0, atol=0)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_qk_l2norm_forward_and_gradient(shape, dtype):
    *dims, repeat = shape
    x = _view(*dims, dtype, KERNEL_DEVICE)
    scale = dims[-1] ** -0.5
    xk = _leaf(x)
    y = triton_ops.qk_l2norm(xk, repeat, scale)
    assert y.dtype == torch.float32 and y.shape == (dims[0], dims[2] * repeat, dims[1], dims[3])
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(KERNEL_DEVICE)
    y.backward(dy)
    x64 = _fp64(x)
    ref = reference.qk_l2norm(x64, repeat, scale)
    ref.backward(dy.double().cpu())
    assert_close(y, ref, torch.float32, "y")
    assert_close(xk.grad, x64.grad, dtype, "dx", scale=2.0)


@needs_kernels
def test_kernel_qk_l2norm_comparison_fails_with_the_heads_unrepeated():
    """Each key head serves `repeat` consecutive value heads: the comparison sees an interleaving
    of the other kind (whole blocks of heads repeated)."""
    x = _view(2, 37, 2, 8, torch.float32, KERNEL_DEVICE)
    y = triton_ops.qk_l2norm(x, 2)
    tiled = reference.qk_l2norm(x.repeat(1, 1, 2, 1), 1)
    with pytest.raises(AssertionError):
        assert_close(y, tiled, torch.float32, "y tiled")


def test_bad_input_is_named():
    pytest.importorskip("triton")
    from triton_ops.kernels.qk_norm import qk_l2norm
    with pytest.raises(ValueError, match="qk_l2norm takes x"):
        qk_l2norm(torch.zeros(2, 3, 4), 1)
