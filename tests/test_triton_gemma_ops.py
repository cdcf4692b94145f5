"""Gemma's ops in `triton_ops`: the GeGLU kernel and the (1 + w) RMSNorm (`rms_norm(offset=True)`).

Each kernel against `triton_ops.reference` in float64 and against HF's own modules
(`Gemma3MLP`'s `gelu_pytorch_tanh` activation, `Gemma3RMSNorm`) on odd shapes, forward and every
gradient, float32 and bfloat16. The kernels run on CUDA, or on the CPU through Triton's
interpreter in the child run of test_triton_ops.py (`test_kernels_under_interpreter`, `-k kernel`).
Tolerances (test_triton_ops.assert_close) are relative to the largest reference magnitude:
float32 1e-5, bfloat16 2e-2.
"""
from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

import triton_ops
from test_triton_ops import DTYPES, KERNEL_DEVICE, _fp64, _leaf, assert_close, needs_kernels
from triton_ops import reference

SHAPES = [(5, 123, 123), (3, 41, 257), (2, 3, 7, 256), (4099,)]
NORM_SHAPES = [(5, 123, 123), (3, 41, 257), (2, 3, 7, 256), (2, 1000)]   # (..., H): odd H, a head_dim


def _gemma_norm(weight: torch.Tensor, eps: float) -> Gemma3RMSNorm:
    norm = Gemma3RMSNorm(weight.shape[-1], eps=eps).to(device=weight.device, dtype=weight.dtype)
    norm.weight.data.copy_(weight)
    return norm


# ---------------------------------------------------------------- the references are HF's modules

@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_ops_match_hf_gemma_modules(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, generator=g).to(dtype)
    w = (0.3 * torch.randn(64, generator=g)).to(dtype)
    torch.testing.assert_close(reference.rms_norm(x, w, 1e-6, offset=True), _gemma_norm(w, 1e-6)(x), rtol=0, atol=0)
    a, b = torch.randn(4, 9, generator=g).to(dtype), torch.randn(4, 9, generator=g).to(dtype)
    torch.testing.assert_close(reference.geglu(a, b), ACT2FN["gelu_pytorch_tanh"](a) * b, rtol=0, atol=0)


def test_offset_reference_is_not_the_llama_norm():
    """With w = 0 the Gemma norm is the plain normalization; with w != 0 it scales by 1 + w."""
    x = torch.randn(4, 32)
    plain = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(reference.rms_norm(x, torch.zeros(32), 1e-6, offset=True), plain)
    w = torch.full((32,), 0.5)
    torch.testing.assert_close(reference.rms_norm(x, w, 1e-6, offset=True), 1.5 * plain)
    torch.testing.assert_close(reference.rms_norm(x, w, 1e-6), 0.5 * plain)


# ---------------------------------------------------------------- GeGLU

@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("in_place", [False, True])
def test_geglu_kernel(dtype, shape, in_place):
    g = torch.Generator().manual_seed(4)
    a0, b0, dc = ((2 * torch.randn(shape, generator=g)).to(KERNEL_DEVICE, dtype) for _ in range(3))
    a, b = _leaf(a0), _leaf(b0)
    c = triton_ops.geglu(a * 1, b * 1, in_place_backward=in_place)    # temporaries, as in the MLP
    c.backward(dc)
    assert c.dtype == dtype and c.shape == a0.shape
    ar, br = _fp64(a0), _fp64(b0)
    reference.geglu(ar, br).backward(dc.double().cpu())
    assert_close(c, reference.geglu(ar, br), dtype, "c")
    assert_close(a.grad, ar.grad, dtype, "d gate")
    assert_close(b.grad, br.grad, dtype, "d up")


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_geglu_kernel_against_hf_gemma_activation(dtype):
    """HF's `act_fn(gate) * up` in the same dtype: the kernel rounds where it does."""
    g = torch.Generator().manual_seed(5)
    a0, b0, dc = ((2 * torch.randn(5, 123, 123, generator=g)).to(KERNEL_DEVICE, dtype) for _ in range(3))
    a, b = _leaf(a0), _leaf(b0)
    c = triton_ops.geglu(a * 1, b * 1, in_place_backward=True)
    c.backward(dc)
    ah, bh = _leaf(a0), _leaf(b0)
    ch = ACT2FN["gelu_pytorch_tanh"](ah) * bh
    ch.backward(dc)
    assert_close(c, ch, dtype, "c")
    assert_close(a.grad, ah.grad, dtype, "d gate")
    assert_close(b.grad, bh.grad, dtype, "d up")


@needs_kernels
def test_geglu_kernel_in_place_backward_writes_over_its_inputs():
    a, b = torch.randn(3, 50, device=KERNEL_DEVICE), torch.randn(3, 50, device=KERNEL_DEVICE)
    gate, up = _leaf(a), _leaf(b)
    g2, u2 = gate * 1, up * 1
    triton_ops.geglu(g2, u2, in_place_backward=True).sum().backward()
    torch.testing.assert_close(g2.detach(), gate.grad, rtol=0, atol=0)       # the gradient took its place
    torch.testing.assert_close(u2.detach(), up.grad, rtol=0, atol=0)


# ---------------------------------------------------------------- (1 + w) RMSNorm

@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
@pytest.mark.parametrize("in_place", [False, True])
def test_offset_rms_norm_kernel(dtype, shape, in_place):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(shape, generator=g).to(KERNEL_DEVICE, dtype)
    w = (0.5 * torch.randn(shape[-1], generator=g)).to(KERNEL_DEVICE, dtype)    # Gemma's weights sit near 0
    dy = torch.randn(shape, generator=g).to(KERNEL_DEVICE, dtype)
    xl, wl = _leaf(x), _leaf(w)
    y = triton_ops.rms_norm(xl, wl, 1e-6, in_place_backward=in_place, offset=True)
    y.backward(dy.clone())
    xr, wr = _fp64(x), _fp64(w)
    yr = reference.rms_norm(xr, wr, 1e-6, offset=True)
    yr.backward(dy.double().cpu())
    assert y.dtype == dtype
    assert_close(y, yr, dtype, "y")
    assert_close(xl.grad, xr.grad, dtype, "dx")
    assert_close(wl.grad, wr.grad, dtype, "dw")


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 123, 123), (2, 4, 9, 256)])
def test_offset_rms_norm_kernel_against_hf_gemma3_norm(dtype, shape):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=g).to(KERNEL_DEVICE, dtype)
    w = (0.5 * torch.randn(shape[-1], generator=g)).to(KERNEL_DEVICE, dtype)
    dy = torch.randn(shape, generator=g).to(KERNEL_DEVICE, dtype)
    xl, wl = _leaf(x), _leaf(w)
    y = triton_ops.rms_norm(xl, wl, 1e-6, in_place_backward=True, offset=True)
    y.backward(dy.clone())
    norm, xh = _gemma_norm(w, 1e-6), _leaf(x)
    yh = norm(xh)
    yh.backward(dy)
    assert y.dtype == yh.dtype
    assert_close(y, yh, dtype, "y")
    assert_close(xl.grad, xh.grad, dtype, "dx")
    assert_close(wl.grad, norm.weight.grad, dtype, "dw")


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_offset_rms_norm_kernel_scales_by_one_plus_weight(dtype):
    """A kernel that dropped the offset (y = w * x_hat) fails here: w = 0.5 gives 1.5 x_hat."""
    x = torch.randn(7, 123).to(KERNEL_DEVICE, dtype)
    plain = reference.rms_norm(x.double().cpu(), torch.zeros(123, dtype=torch.float64), 1e-6, offset=True)
    w = torch.full((123,), 0.5).to(KERNEL_DEVICE, dtype)
    wl = _leaf(w)
    y = triton_ops.rms_norm(x, wl, 1e-6, offset=True)
    assert_close(y, 1.5 * plain, dtype, "y = (1 + w) x_hat")
    xl = _leaf(x)
    triton_ops.rms_norm(xl, w, 1e-6, offset=True).backward(torch.ones_like(x))
    # d/dx of sum((1 + w) x_hat) is (1 + w) times that of sum(x_hat): the offset is in dx too.
    xp = _fp64(x)
    (1.5 * reference.rms_norm(xp, torch.zeros(123, dtype=torch.float64), 1e-6, offset=True)).sum().backward()
    assert_close(xl.grad, xp.grad, dtype, "dx")


@needs_kernels
def test_offset_rms_norm_kernel_on_a_transposed_head_view():
    """Gemma's q_norm reads the (B, S, H, D) projection as a (B, H, S, D) view."""
    q = torch.randn(2, 9, 4, 256, device=KERNEL_DEVICE).transpose(1, 2)
    w = 0.3 * torch.randn(256, device=KERNEL_DEVICE)
    assert_close(triton_ops.rms_norm(q, w, 1e-6, offset=True), _gemma_norm(w, 1e-6)(q), torch.float32, "y")


# ---------------------------------------------------------------- GPU: the Gemma-3 4B shapes

@pytest.mark.gpu
def test_geglu_offset_norm_gemma3_4b_shapes_bf16():
    dt = torch.bfloat16
    x, dy = torch.randn(2, 2048, 2560, device="cuda", dtype=dt), torch.randn(2, 2048, 2560, device="cuda", dtype=dt)
    w = (0.3 * torch.randn(2560, device="cuda")).to(dt)
    xl, wl = _leaf(x), _leaf(w)
    triton_ops.rms_norm(xl, wl, 1e-6, in_place_backward=True, offset=True).backward(dy.clone())
    xr, wr = _leaf(x.float()), _leaf(w.float())
    reference.rms_norm(xr, wr, 1e-6, offset=True).backward(dy.float())
    assert_close(xl.grad, xr.grad, dt, "norm dx")
    assert_close(wl.grad, wr.grad, dt, "norm dw")
    q = torch.randn(2, 2048, 8, 256, device="cuda", dtype=dt).transpose(1, 2)          # q_norm's input
    wq = (0.3 * torch.randn(256, device="cuda")).to(dt)
    assert_close(triton_ops.rms_norm(q, wq, 1e-6, offset=True), _gemma_norm(wq.float(), 1e-6)(q.float()), dt, "q_norm")
    a0, b0 = (torch.randn(2, 2048, 10240, device="cuda", dtype=dt) for _ in range(2))
    dc = torch.randn(2, 2048, 10240, device="cuda", dtype=dt)
    a, b = _leaf(a0), _leaf(b0)
    c = triton_ops.geglu(a * 1, b * 1, in_place_backward=True)
    c.backward(dc)
    ar, br = _leaf(a0.float()), _leaf(b0.float())
    cr = reference.geglu(ar, br)
    cr.backward(dc.float())
    assert_close(c, cr, dt, "geglu")
    assert_close(a.grad, ar.grad, dt, "geglu d gate")
    assert_close(b.grad, br.grad, dt, "geglu d up")


# ---------------------------------------------------------------- compiled for Hopper, without a GPU

def _hopper_compiler():
    """Triton's compile for sm_90 (its bundled ptxas), or a skip where this Triton has no such backend."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        pytest.skip("this Triton has no ahead-of-time compile interface")
    import triton

    def compile_for_hopper(fn, signature: dict, constexprs: dict) -> str:
        if not hasattr(fn, "cache_key"):           # TRITON_INTERPRET=1: this process interprets kernels
            pytest.skip("the kernels are interpreted in this process, not compiled")
        try:
            kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                    target=GPUTarget("cuda", 90, 32))
        except FileNotFoundError as err:            # no ptxas in this Triton build
            pytest.skip(f"no CUDA toolchain in this Triton: {err}")
        return kernel.asm["ptx"]
    return compile_for_hopper


@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
@pytest.mark.parametrize("offset", [True, False])
def test_gemma_kernels_compile_for_hopper(dtype, offset):
    """The interpreter runs a kernel's Python, not its compilation: an op that Triton cannot lower
    (a type mismatch across a constexpr branch, an intrinsic this release lacks) shows only when
    compiled. Compiled here for sm_90 on the CPU, the GeGLU kernels and both forms of the norm's."""
    import importlib

    compile_for_hopper = _hopper_compiler()
    geglu = importlib.import_module("triton_ops.kernels.geglu")
    norm = importlib.import_module("triton_ops.kernels.rms_norm")
    flat = {"n": "i64", "BLOCK": "constexpr"}
    assert compile_for_hopper(geglu._geglu_fwd_kernel, {"a_ptr": dtype, "b_ptr": dtype, "c_ptr": dtype, **flat},
                              {"BLOCK": 4096})
    assert compile_for_hopper(geglu._geglu_bwd_kernel, {"dc_ptr": dtype, "a_ptr": dtype, "b_ptr": dtype,
                                                        "da_ptr": dtype, "db_ptr": dtype, **flat}, {"BLOCK": 4096})
    tiles = {"BLOCK_R": "constexpr", "BLOCK_H": "constexpr", "OFFSET": "constexpr"}
    assert compile_for_hopper(norm._rms_norm_fwd_kernel, {
        "x_ptr": dtype, "y_ptr": dtype, "w_ptr": dtype, "rstd_ptr": "*fp32", "q_ptr": "*fp8e4nv", "inv_ptr": "*fp32",
        "n_rows": "i32", "H": "i32", "eps": "fp32", "quant": "i32", **tiles},
        {"BLOCK_R": 1, "BLOCK_H": 4096, "OFFSET": offset})
    assert compile_for_hopper(norm._rms_norm_bwd_kernel, {
        "dy_ptr": dtype, "x_ptr": dtype, "w_ptr": dtype, "rstd_ptr": "*fp32", "dx_ptr": dtype, "dw_partial_ptr": "*fp32",
        "n_rows": "i32", "H": "i32", "rows_per_program": "i32", **tiles},
        {"BLOCK_R": 4, "BLOCK_H": 256, "OFFSET": offset})
