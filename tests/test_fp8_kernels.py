"""The kernels that write FP8 rows (triton_ops.rms_norm_rows, swiglu_rows, and
kernels.fp8_quant.fp8_quantize_rows_col_amax) bit for bit against the unfused path: the op's own
kernel, then the row quantization kernel (and the column maxima, exactly). On CUDA also against
the reference quantization; on CPU through Triton's interpreter (the child run of
test_triton_ops.test_kernels_under_interpreter), which rounds both paths' e4m3 casts alike. The
same checks run on the GPU from tests/test_fp8_gpu.py."""
from __future__ import annotations

import math

import pytest
import torch

import triton_ops
from triton_ops import reference
from test_triton_ops import DTYPES, KERNEL_DEVICE, _leaf, needs_kernels


def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _same(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    assert torch.equal(_bits(a), _bits(b)), (what, int((_bits(a) != _bits(b)).sum()))


def _spread_rows(shape, dtype, device, seed):
    """Rows of magnitudes from 1e-4 to 1e3 (every scale differs), a zero row start."""
    g = torch.Generator().manual_seed(seed)
    rows = math.prod(shape[:-1])
    x = torch.randn(shape, generator=g) * torch.logspace(-4, 3, rows).reshape(*shape[:-1], 1)
    return x.to(device, dtype)


def check_fused_rms_norm_rows(device, shape, dtype, exact_reference):
    """triton_ops.rms_norm_rows against the unfused path (the norm kernel, then the row
    quantization kernel) bit for bit: y, q, the inverse scales, dx and dw. With `exact_reference`
    (CUDA) q is also `reference.fp8_quantize_rows(y)`'s bit for bit; the scales always are."""
    from triton_ops.kernels.fp8_quant import fp8_quantize_rows
    x = _spread_rows(shape, dtype, device, 5)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=torch.Generator().manual_seed(6))).to(device, dtype)
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(7)).to(device, dtype)
    xa, wa, xb, wb = _leaf(x), _leaf(w), _leaf(x), _leaf(w)
    y, (q, inv) = triton_ops.rms_norm_rows(xa, wa, 1e-5, in_place_backward=True)
    y_ref = triton_ops.rms_norm(xb, wb, 1e-5, in_place_backward=True)
    q_ref, inv_ref = fp8_quantize_rows(y_ref.detach().reshape(-1, shape[-1]))
    _same(y, y_ref, "y")
    _same(q, q_ref, "q")
    _same(inv, inv_ref, "inv")
    _same(inv, reference.fp8_quantize_rows(y.detach().reshape(-1, shape[-1]))[1], "inv vs reference")
    if exact_reference:
        _same(q, reference.fp8_quantize_rows(y.detach().reshape(-1, shape[-1]))[0], "q vs reference")
    y.backward(dy.clone())
    y_ref.backward(dy.clone())
    _same(xa.grad, xb.grad, "dx")
    _same(wa.grad, wb.grad, "dw")


def check_fused_swiglu_rows(device, shape, dtype, exact_reference):
    """triton_ops.swiglu_rows against the unfused path (the SwiGLU kernel, then the row
    quantization kernel) bit for bit: c, q, the inverse scales, d gate and d up (as
    `check_fused_rms_norm_rows`)."""
    from triton_ops.kernels.fp8_quant import fp8_quantize_rows
    a0 = _spread_rows(shape, dtype, device, 8)
    b0 = torch.randn(shape, generator=torch.Generator().manual_seed(9)).to(device, dtype)
    dc = torch.randn(shape, generator=torch.Generator().manual_seed(10)).to(device, dtype)
    a, b, ar, br = _leaf(a0), _leaf(b0), _leaf(a0), _leaf(b0)
    c, (q, inv) = triton_ops.swiglu_rows(a * 1, b * 1, in_place_backward=True)
    c_ref = triton_ops.swiglu(ar * 1, br * 1, in_place_backward=True)
    q_ref, inv_ref = fp8_quantize_rows(c_ref.detach().reshape(-1, shape[-1]))
    _same(c, c_ref, "c")
    _same(q, q_ref, "q")
    _same(inv, inv_ref, "inv")
    _same(inv, reference.fp8_quantize_rows(c.detach().reshape(-1, shape[-1]))[1], "inv vs reference")
    if exact_reference:
        _same(q, reference.fp8_quantize_rows(c.detach().reshape(-1, shape[-1]))[0], "q vs reference")
    c.backward(dc)
    c_ref.backward(dc)
    _same(a.grad, ar.grad, "d gate")
    _same(b.grad, br.grad, "d up")


def check_rows_col_amax(device, shape, exact_reference):
    """fp8_quantize_rows_col_amax against the row kernel and the exact column maxima, bit for bit;
    the transposed quantization given those maxima against the one that takes its own."""
    from triton_ops.kernels import fp8_quant as k
    x = _spread_rows(shape, torch.bfloat16, device, 11)
    x[:, 0] = x[:, 0] * 0                                        # a zero column
    (q, inv), amax = k.fp8_quantize_rows_col_amax(x)
    q_ref, inv_ref = k.fp8_quantize_rows(x)
    _same(q, q_ref, "q")
    _same(inv, inv_ref, "inv")
    _same(amax, x.float().abs().amax(0), "column maxima")
    _same(k.fp8_quantize_cols_t(x, 16, amax)[0], k.fp8_quantize_cols_t(x, 16)[0], "cols_t given the maxima")
    _same(k.fp8_quantize_cols_t(x, 16, amax)[1], k.fp8_quantize_cols_t(x, 16)[1], "cols_t scales")
    if exact_reference:
        _same(q, reference.fp8_quantize_rows(x)[0], "q vs reference")
        _same(k.fp8_quantize_cols_t(x, 16, amax)[0], reference.fp8_quantize_cols_t(x, 16)[0], "cols_t vs reference")


ROWS_COL_AMAX_SHAPES = [(37, 409), (1000, 48), (5, 20000)]     # bands with a short last one; past one pass


@needs_kernels
@pytest.mark.parametrize("shape", ROWS_COL_AMAX_SHAPES)
def test_fp8_rows_col_amax_kernel_is_the_two_passes(shape):
    check_rows_col_amax(KERNEL_DEVICE, shape, exact_reference=KERNEL_DEVICE == "cuda")


FUSED_NORM_SHAPES = [(3, 41, 257), (2, 1000), (65, 48)]        # rows not a multiple of the tile, H odd
FUSED_SWIGLU_SHAPES = [(3, 7, 301), (5, 176), (2, 20000)]     # the last past the one-pass row length


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", FUSED_NORM_SHAPES)
def test_rms_norm_rows_kernel_is_the_unfused_path(dtype, shape):
    check_fused_rms_norm_rows(KERNEL_DEVICE, shape, dtype, exact_reference=KERNEL_DEVICE == "cuda")


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", FUSED_SWIGLU_SHAPES)
def test_swiglu_rows_kernel_is_the_unfused_path(dtype, shape):
    check_fused_swiglu_rows(KERNEL_DEVICE, shape, dtype, exact_reference=KERNEL_DEVICE == "cuda")


def test_rows_dispatch_without_kernels_is_the_reference():
    x, w = torch.randn(5, 40).bfloat16(), torch.rand(40).bfloat16()
    if triton_ops.kernels_apply(x):
        pytest.skip("the kernels run on CPU tensors here")
    y, (q, inv) = triton_ops.rms_norm_rows(x, w, 1e-6)
    _same(y, reference.rms_norm(x, w, 1e-6), "y")
    rq, rinv = reference.fp8_quantize_rows(y)
    _same(q, rq, "q")
    _same(inv, rinv, "inv")
    c, (q, inv) = triton_ops.swiglu_rows(x, x)
    _same(c, reference.swiglu(x, x), "c")
    _same(q, reference.fp8_quantize_rows(c)[0], "q")
