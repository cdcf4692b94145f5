"""RMSNorm with the casting of Hugging Face's LlamaRMSNorm / Qwen2RMSNorm / Qwen3RMSNorm, or,
with `offset`, with the (1 + w) scale and the casting of Gemma3RMSNorm.

Forward, per row x (H,):
    rstd = 1 / sqrt(mean(x_f32**2) + eps)
    Llama:  n = (x_f32 * rstd).to(x.dtype)         # HF rounds the normalized row to the input dtype
            y = (w_f32 * n_f32).to(out dtype)       # out dtype = promote(x.dtype, w.dtype)
    offset: n = x_f32 * rstd                        # no rounding before the product
            y = (n * (1 + w_f32)).to(x.dtype)
Backward, with x_hat = x_f32 * rstd and s = w (Llama) or 1 + w (offset), fp32 throughout:
    dn = dy * s
    dx = rstd * (dn - x_hat * mean(dn * x_hat))
    dw = sum over rows of dy * n
Rows are processed in tiles of R rows (R > 1 when H is small, e.g. Qwen3's per-head q/k norm).
The weight gradient is reduced in two stages: one fp32 partial per program, then a sum.

`RMSNormRowsFunction` is the same norm for an output that FP8 GEMMs read next: the forward
kernel also writes y's e4m3 form with one power-of-two scale per row, bit for bit
`triton_ops.reference.fp8_quantize_rows(y)` (`kernels.fp8_quant`'s recipe), from the rows it
already holds; its backward is the plain norm's.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .fp8_quant import _pow2_scale

__all__ = ["RMSNormFunction", "RMSNormRowsFunction", "rms_norm", "rms_norm_rows"]


# Note: [Why the norm's FP8 rows are a runtime switch] `quant` is an argument, not a constexpr,
# and not specialized: the plain norm and the one that also writes FP8 rows run one compiled
# kernel, so their y is the same bits. Two compilations may lay out the row's sum of squares
# differently, and rstd then moves by an ulp (seen at H = 4096 on the H200).
@triton.jit(do_not_specialize=["quant"])
def _rms_norm_fwd_kernel(
    x_ptr, y_ptr, w_ptr, rstd_ptr, q_ptr, inv_ptr,
    n_rows, H, eps, quant,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    OFFSET: tl.constexpr,
):
    """y = w * (x * rstd).to(x.dtype) (OFFSET: (x * rstd * (1 + w)).to(x.dtype)) for a tile of
    BLOCK_R rows; stores rstd (n_rows,) fp32. With quant != 0 also q (n_rows, H) e4m3 and inv
    (n_rows,) fp32: y's rows quantized (the fp8 recipe)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]   # (R, 1)
    cols = tl.arange(0, BLOCK_H)[None, :]                                              # (1, BH)
    mask = (rows < n_rows) & (cols < H)
    x = tl.load(x_ptr + rows * H + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / H + eps)                                  # (R,)
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    if OFFSET:
        y = (x * rstd[:, None] * (1.0 + w)).to(y_ptr.dtype.element_ty)
    else:
        n = (x * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
        y = (w * n).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rows * H + cols, y, mask=mask)
    tl.store(rstd_ptr + rows, rstd[:, None], mask=rows < n_rows)
    if quant != 0:
        yf = y.to(tl.float32)                          # the rounded output, as a separate pass reads it
        scale, inv = _pow2_scale(tl.max(tl.abs(yf), axis=1))           # masked columns are 0
        tl.store(q_ptr + rows * H + cols, tl.clamp(yf * scale[:, None], -448.0, 448.0).to(tl.float8e4nv), mask=mask)
        tl.store(inv_ptr + rows, inv[:, None], mask=rows < n_rows)


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr,
    n_rows, H, rows_per_program,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    OFFSET: tl.constexpr,
):
    """dx for rows [pid * rows_per_program, ...) and this program's partial dw (BLOCK_H,) fp32.

    dx may alias dy: each tile is read completely before it is written.
    """
    pid = tl.program_id(0)
    first = pid.to(tl.int64) * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    cols = tl.arange(0, BLOCK_H)[None, :]
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    if OFFSET:
        w = 1.0 + w                  # the scale; masked columns read dy = 0
    dw_acc = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    for start in range(first, last, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)[:, None]
        mask = (rows < last) & (cols < H)
        x = tl.load(x_ptr + rows * H + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows * H + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rows < last, other=0.0)              # (R, 1)
        x_hat = x * rstd
        if OFFSET:
            n = x_hat
        else:
            n = x_hat.to(x_ptr.dtype.element_ty).to(tl.float32)
        dw_acc += dy * n
        dn = dy * w
        c = tl.sum(dn * x_hat, axis=1)[:, None] / H
        dx = rstd * (dn - x_hat * c)
        tl.store(dx_ptr + rows * H + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_partial_ptr + pid * H + cols, tl.sum(dw_acc, axis=0)[None, :], mask=cols < H)


def _tile(H: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_H, num_warps): about 4096 elements per tile, one row at least."""
    block_h = triton.next_power_of_2(H)
    block_r = max(1, min(64, 4096 // block_h))
    elems = block_r * block_h
    num_warps = 16 if elems >= 16384 else (8 if elems >= 4096 else 4)
    return block_r, block_h, num_warps


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_programs(x: torch.Tensor, n_rows: int) -> int:
    """One backward program per SM (each loops over its rows): a (SMs, H) fp32 partial dw."""
    sms = _sm_count(x.device.index if x.device.index is not None else torch.cuda.current_device()) if x.is_cuda else 8
    return max(1, min(n_rows, sms))


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, quant: bool = False,
                     offset: bool = False) -> tuple[torch.Tensor, torch.Tensor, tuple | None]:
    """Launch the forward on x (..., H). Returns y (..., H), rstd (N,) fp32, and with `quant` y's
    rows in e4m3 (q (N, H) float8_e4m3fn, inv (N, 1) fp32), else None. `offset`: Gemma's norm."""
    shape = x.shape
    H = shape[-1]
    x2 = x.reshape(-1, H).contiguous()                                                # (N, H)
    n_rows = x2.shape[0]
    out_dtype = x.dtype if offset else torch.promote_types(x.dtype, weight.dtype)
    y = torch.empty(shape, dtype=out_dtype, device=x.device)    # not a view: callers may transpose it
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    rows = None
    if quant:
        rows = (torch.empty((n_rows, H), dtype=torch.float8_e4m3fn, device=x.device),
                torch.empty((n_rows, 1), dtype=torch.float32, device=x.device))
    # Unused without quant, but of the same dtypes: [Why the norm's FP8 rows are a runtime switch]
    q, inv = rows if quant else (y.view(torch.float8_e4m3fn), rstd)
    block_r, block_h, num_warps = _tile(H)
    _rms_norm_fwd_kernel[(triton.cdiv(n_rows, block_r),)](
        x2, y, weight, rstd, q, inv, n_rows, H, eps, int(quant), BLOCK_R=block_r, BLOCK_H=block_h,
        OFFSET=offset, num_warps=num_warps,
    )
    return y, rstd, rows


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                      in_place: bool = True, offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward. Returns dx (shape and dtype of x) and dw (dtype of weight).

    With `in_place`, dx is written over dy when they share a dtype (saves one activation).
    """
    shape = x.shape
    H = shape[-1]
    x2 = x.reshape(-1, H)
    dy2 = dy.reshape(-1, H).contiguous()
    n_rows = x2.shape[0]
    dx = dy2 if in_place and dy2.dtype == x.dtype else torch.empty_like(x2)
    block_r, block_h, num_warps = _tile(H)
    programs = _num_programs(x, n_rows)
    rows_per_program = triton.cdiv(n_rows, programs)
    dw_partial = torch.empty((programs, H), dtype=torch.float32, device=x.device)
    _rms_norm_bwd_kernel[(programs,)](
        dy2, x2, weight, rstd, dx, dw_partial, n_rows, H, rows_per_program,
        BLOCK_R=block_r, BLOCK_H=block_h, OFFSET=offset, num_warps=num_warps,
    )
    return dx.view(shape), dw_partial.sum(0).to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    """y = weight * (x * rsqrt(mean(x**2) + eps)).to(x.dtype), or with `offset`
    (x * rsqrt(mean(x**2) + eps) * (1 + weight)).to(x.dtype); x (..., H), weight (H,).

    Saves x and rstd (N,) fp32. With `in_place_backward` the backward writes dx over the
    incoming gradient when the dtypes allow: right when that gradient is not shared with
    another node, as in the HF decoder layers (the norm feeds linear layers only).
    """

    @staticmethod
    def forward(ctx, x, weight, eps, in_place_backward, offset=False):
        x = x.contiguous()
        y, rstd, _ = rms_norm_forward(x, weight, eps, offset=offset)
        ctx.save_for_backward(x, weight, rstd)
        ctx.in_place_backward, ctx.offset = in_place_backward, offset
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        # A non-contiguous (or expanded) dy is copied first, so only a dense dy is overwritten.
        dx, dw = rms_norm_backward(dy, x, weight, rstd, in_place=ctx.in_place_backward, offset=ctx.offset)
        return dx, (dw if ctx.needs_input_grad[1] else None), None, None, None


class RMSNormRowsFunction(torch.autograd.Function):
    """`RMSNormFunction` whose forward also returns y's rows in e4m3: (y, q, inv), q and inv
    without gradient. The backward is the plain norm's."""

    @staticmethod
    def forward(ctx, x, weight, eps, in_place_backward):
        x = x.contiguous()
        y, rstd, (q, inv) = rms_norm_forward(x, weight, eps, quant=True)
        ctx.save_for_backward(x, weight, rstd)
        ctx.in_place_backward, ctx.offset = in_place_backward, False
        ctx.mark_non_differentiable(q, inv)
        return y, q, inv

    @staticmethod
    def backward(ctx, dy, _dq, _dinv):
        return RMSNormFunction.backward(ctx, dy)[:4]


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                  in_place_backward: bool = False) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """`rms_norm` that also returns its output's rows in e4m3, as the fp8 recipe quantizes them.

    Returns:
        y (..., H), and (q (N, H) float8_e4m3fn, inv (N, 1) float32) with N = y.numel() // H.
    """
    y, q, inv = RMSNormRowsFunction.apply(x, weight, eps, in_place_backward)
    return y, (q, inv)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
             in_place_backward: bool = False, offset: bool = False) -> torch.Tensor:
    """Triton RMSNorm over the last dimension; see `triton_ops.reference.rms_norm` for the math.

    Args:
        x: (..., H) input.
        weight: (H,) scale.
        eps: added to the mean square.
        in_place_backward: let the backward overwrite the incoming gradient with dx (only
            where no other node reads that gradient).
        offset: scale by (1 + weight) with Gemma's casting (`Gemma3RMSNorm`).

    Returns:
        (..., H) tensor of dtype promote(x.dtype, weight.dtype), x.dtype with `offset`.
    """
    return RMSNormFunction.apply(x, weight, eps, in_place_backward, offset)
