"""Row-wise e4m3 quantization for FP8 GEMMs: one pass over a bf16 (or fp32) tensor writes its
float8_e4m3fn values and one float32 scale per row of the GEMM's reduction.

The math is `triton_ops.reference.fp8_quantize_rows` / `fp8_quantize_cols_t` (torchao's float8
"rowwise" recipe), bit for bit:

    amax_r  = max_k |x[r, k]|                               (float32)
    scale_r = pow2_floor(fp32(448 / max(amax_r, 1e-12)))    (correctly rounded division)
    q[r, k] = e4m3(clamp(x[r, k] * scale_r, -448, 448))     (round to nearest even)
    inv_r   = 1 / scale_r                                   (exact: a power of two)

`fp8_quantize_rows` reduces along the last dimension and keeps the layout (the first operand of
`torch._scaled_mm`, and a weight's forward operand): one program per row, which reads it once.
`fp8_quantize_cols_t` reduces along the first dimension and writes the result transposed, (C, R)
row-major, which is the column-major second operand the dgrad / wgrad GEMMs take; its R may be
padded with zeros to a multiple of 16. It runs over tiles in two launches (the column maxima,
folded with an atomic max, then the scaled, transposed tiles), so that a tall operand (the
tokens of a micro-batch) spreads over every SM; given the column maxima (`amax`), it is one
launch and one read.
`fp8_quantize_rows_col_amax` is the row quantization of an operand whose columns are quantized
next (a projection's output gradient: rows for dgrad, columns for wgrad): a fixed number of
programs each loop over a band of rows, quantize each row as the row kernel does and keep the
band's column maxima in registers, written as one partial per program and reduced by a max
(exact, so the scales equal the separate column pass's). The gradient is then read twice for its
two forms instead of three times.
The autograd tier of these kernels is `hf_slideformer.compute.fp8.Fp8Linear`, which calls them through
`hf_slideformer.compute.fp8.CudaFp8`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["fp8_quantize_rows", "fp8_quantize_cols_t", "fp8_quantize_rows_col_amax"]

_E4M3_MAX = 448.0
_EPS = 1e-12
_ROW_BLOCK = 2048              # the two-pass row kernel's chunk, for rows longer than _ONE_PASS_MAX
_ONE_PASS_MAX = 16384         # rows up to this length are read once, kept in registers
_AMAX_BLOCK_R = 256           # rows per tile of the column-maxima pass
_COL_BLOCK = 64               # tile side of the transposed quantization
_BAND_PROGRAMS_PER_SM = 4     # programs of the row kernel that also keeps column maxima


@triton.jit
def _pow2_scale(amax):
    """scale = 448 / max(amax, eps) rounded down to a power of two, and its exact inverse."""
    s = tl.math.div_rn(tl.full(amax.shape, 448.0, tl.float32), tl.maximum(amax, 1e-12))
    bits = s.to(tl.int32, bitcast=True) & 0x7F800000
    scale = bits.to(tl.float32, bitcast=True)
    # 2^(e - 127) -> 2^(127 - e): the exponent field mirrored around the bias.
    inv = ((254 - (bits >> 23)) << 23).to(tl.float32, bitcast=True)
    return scale, inv


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, inv_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
    """One program per row r of x (M, K): amax over the row, then q[r, :] and inv[r]. With
    ONE_PASS (K <= BLOCK) the row is read once and kept in registers."""
    r = tl.program_id(0).to(tl.int64)
    x_row, q_row = x_ptr + r * stride_x, q_ptr + r * stride_q
    if ONE_PASS:
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        scale, inv = _pow2_scale(tl.max(tl.abs(x), axis=0))
        tl.store(q_row + offs, tl.clamp(x * scale, -448.0, 448.0).to(tl.float8e4nv), mask=offs < K)
    else:
        amax = tl.zeros((BLOCK,), tl.float32)
        for k in range(0, K, BLOCK):
            offs = k + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale, inv = _pow2_scale(tl.max(amax, axis=0))
        for k in range(0, K, BLOCK):
            offs = k + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            tl.store(q_row + offs, tl.clamp(x * scale, -448.0, 448.0).to(tl.float8e4nv), mask=offs < K)
    tl.store(inv_ptr + r, inv)


@triton.jit
def _quant_rows_col_amax_kernel(x_ptr, q_ptr, inv_ptr, part_ptr, M, K, stride_x, stride_q, rows_per_program,
                                BLOCK: tl.constexpr):
    """Rows [pid * rows_per_program, ...) of x (M, K <= BLOCK), each read once: q and inv as the
    row kernel writes them, and the band's column maxima of |x| into part[pid, :]."""
    pid = tl.program_id(0)
    first = pid.to(tl.int64) * rows_per_program
    last = tl.minimum(first + rows_per_program, M)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    cmax = tl.zeros((BLOCK,), tl.float32)
    for r in range(first, last):
        x = tl.load(x_ptr + r * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        ax = tl.abs(x)
        cmax = tl.maximum(cmax, ax)
        scale, inv = _pow2_scale(tl.max(ax, axis=0))
        tl.store(q_ptr + r * stride_q + offs, tl.clamp(x * scale, -448.0, 448.0).to(tl.float8e4nv), mask=mask)
        tl.store(inv_ptr + r, inv)
    tl.store(part_ptr + pid.to(tl.int64) * K + offs, cmax, mask=mask)


@triton.jit
def _col_amax_kernel(x_ptr, amax_ptr, R, C, stride_x, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """One program per (BLOCK_R, BLOCK_C) tile of x (R, C): its column maxima of |x|, folded into
    amax (C,) (float32, zero-initialised) with an atomic max."""
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = (r[:, None] < R) & (c[None, :] < C)
    x = tl.load(x_ptr + r[:, None] * stride_x + c[None, :], mask=m, other=0.0).to(tl.float32)
    tl.atomic_max(amax_ptr + c, tl.max(tl.abs(x), axis=0), mask=c < C)


@triton.jit
def _quant_cols_t_kernel(x_ptr, amax_ptr, q_ptr, R, C, R_out, stride_x, stride_q,
                         BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """One program per (BLOCK_R, BLOCK_C) tile of x (R, C): q[c, r] = the tile scaled by its columns'
    scales, written transposed into q (C, R_out); rows r in [R, R_out) are written as zeros."""
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    scale, inv = _pow2_scale(tl.load(amax_ptr + c, mask=cmask, other=1.0))
    m = (r[:, None] < R) & cmask[None, :]
    x = tl.load(x_ptr + r[:, None] * stride_x + c[None, :], mask=m, other=0.0).to(tl.float32)
    q = tl.trans(tl.clamp(x * scale[None, :], -448.0, 448.0).to(tl.float8e4nv))       # (BLOCK_C, BLOCK_R)
    out = q_ptr + c[:, None].to(tl.int64) * stride_q + r[None, :]
    tl.store(out, q, mask=cmask[:, None] & (r[None, :] < R_out))


@triton.jit
def _inverse_kernel(amax_ptr, inv_ptr, C, BLOCK: tl.constexpr):
    """inv (C,) = the inverse scales of the column maxima amax (C,)."""
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    scale, inv = _pow2_scale(tl.load(amax_ptr + c, mask=c < C, other=1.0))
    tl.store(inv_ptr + c, inv, mask=c < C)


def fp8_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the row kernel on x (M, K) with unit stride along K. Returns (q (M, K), inv (M, 1))."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    inv = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M:
        one_pass = K <= _ONE_PASS_MAX
        block = triton.next_power_of_2(max(K, 16)) if one_pass else _ROW_BLOCK
        warps = 16 if block >= 8192 else 8 if block >= 2048 else 4
        _quant_rows_kernel[(M,)](x, q, inv, K, x.stride(0), q.stride(0), BLOCK=block, ONE_PASS=one_pass,
                                 num_warps=warps)
    return q, inv


def fp8_quantize_cols_t(x: torch.Tensor, pad_to: int = 1,
                        amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the column kernels on x (R, C): the column maxima (unless `amax` (C,) float32 gives
    them, exactly), then the transposed quantization. Returns (q (C, R padded to `pad_to`), inv (C, 1))."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    R, C = x.shape
    r_out = R + (-R % pad_to)
    q = torch.empty((C, r_out), dtype=torch.float8_e4m3fn, device=x.device)
    inv = torch.empty((C, 1), dtype=torch.float32, device=x.device)
    if C:
        if amax is None:
            amax = torch.zeros(C, dtype=torch.float32, device=x.device)
            if R:
                _col_amax_kernel[(triton.cdiv(R, _AMAX_BLOCK_R), triton.cdiv(C, _COL_BLOCK))](
                    x, amax, R, C, x.stride(0), BLOCK_R=_AMAX_BLOCK_R, BLOCK_C=_COL_BLOCK, num_warps=4)
        elif amax.shape != (C,) or amax.dtype != torch.float32 or not amax.is_contiguous():
            raise ValueError(f"amax must be a contiguous ({C},) float32 tensor, got {tuple(amax.shape)} {amax.dtype}")
        if r_out:
            _quant_cols_t_kernel[(triton.cdiv(r_out, _COL_BLOCK), triton.cdiv(C, _COL_BLOCK))](
                x, amax, q, R, C, r_out, x.stride(0), q.stride(0), BLOCK_R=_COL_BLOCK, BLOCK_C=_COL_BLOCK,
                num_warps=4)
        _inverse_kernel[(triton.cdiv(C, 1024),)](amax, inv, C, BLOCK=1024, num_warps=4)
    return q, inv


def _band_programs(x: torch.Tensor, M: int) -> int:
    if not x.is_cuda:
        return max(1, min(M, 3))          # the interpreter: a few bands, the last one short
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    return max(1, min(M, _BAND_PROGRAMS_PER_SM * sms))


def fp8_quantize_rows_col_amax(x: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """x (M, K) quantized per row, and its column maxima of |x| from the same read (K up to
    16384; a longer row takes the row kernel and the column-maxima kernel, two reads).

    Returns:
        ((q (M, K), inv (M, 1)), amax (K,) float32): `fp8_quantize_rows(x)` and the maxima that
        `fp8_quantize_cols_t(x, amax=...)` takes.
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    if K > _ONE_PASS_MAX or not M:
        amax = torch.zeros(K, dtype=torch.float32, device=x.device)
        if M and K:
            _col_amax_kernel[(triton.cdiv(M, _AMAX_BLOCK_R), triton.cdiv(K, _COL_BLOCK))](
                x, amax, M, K, x.stride(0), BLOCK_R=_AMAX_BLOCK_R, BLOCK_C=_COL_BLOCK, num_warps=4)
        return fp8_quantize_rows(x), amax
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    inv = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    programs = _band_programs(x, M)
    rows_per_program = triton.cdiv(M, programs)
    programs = triton.cdiv(M, rows_per_program)
    part = torch.empty((programs, K), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(max(K, 16))
    warps = 16 if block >= 8192 else 8 if block >= 2048 else 4
    _quant_rows_col_amax_kernel[(programs,)](x, q, inv, part, M, K, x.stride(0), q.stride(0), rows_per_program,
                                             BLOCK=block, num_warps=warps)
    return (q, inv), part.amax(0)
