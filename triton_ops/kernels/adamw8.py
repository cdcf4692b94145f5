"""The block-wise 8-bit AdamW update as one Triton kernel: hf_slideformer's compact state formats'
update of a GPU unit (resident layers, the device-updated share) in one pass over memory.

Per block of `BLOCK` values (256) the kernel reads the gradient (fp32 or bf16), the master (fp32
or bf16), the two 8-bit codes and the two block scales, and writes the codes, scales and master
back: the arithmetic of `hf_slideformer.host.adam8_torch.adamw8_range_torch` operation by operation,
so its result is that one's bit for bit (which on CPU tensors is the native host kernel's,
hf_slideformer/host/csrc/host_adam8.c; tests/test_adam8_triton.py). For each block of m, v (the
moments), g (the scaled gradient), w (the master):

    m = fma64(g, 1 - beta1, (code1[q1] * absmax1) * beta1)        # rounded once to fp32
    v = fma64(g * (1 - beta2), g, (code2[q2] * absmax2) * beta2)
    w = w * (1 - lr wd) + (neg_step * m) / (sqrt_rn(v) / bc2 + eps)
    absmax = max |m| over the block (|v| for v); q = lut[(((m / absmax + 1) / 2) * 65535 + 0.5)]

fma64: the exact fp32 product plus the addend in fp64, rounded to fp32 (adam8_torch's `_fma`);
sqrt_rn in fp32 equals adam8_torch's fp64 square root rounded to fp32 (the double rounding of a
square root is exact at these widths). Divisions are `div_rn` and the kernel is compiled without
floating-point contraction, so no multiply and add fuse where torch rounds twice. A bf16 master is
rounded stochastically with the kernel's hash of (key, element counter).

The torch-ops update stays the reference and the fallback where Triton is not importable; this one
launches once per range instead of about sixty torch ops per chunk of blocks.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["adamw8_blocks", "ROWS"]

ROWS = 8                   # blocks per program: (ROWS, BLOCK) values, 2048 at a block of 256


@triton.jit
def _hash32(x, k1, k2):
    """The host kernel's hash32 on uint32 lanes (wrapping products)."""
    x = (x ^ k1) * 0x9E3779B1
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x ^ k2


@triton.jit
def _codes(x, mask, lut_ptr):
    """(absmax per row, the rounding table's codes of rows `x` (R, BLOCK)); 0 for an all-zero block."""
    mx = tl.max(tl.where(mask, tl.abs(x), 0.0), axis=1)                       # (R,)
    pos = mx > 0
    inv = tl.where(pos, tl.math.div_rn(tl.full(mx.shape, 1.0, tl.float32), tl.where(pos, mx, 1.0)), 0.0)
    y = tl.clamp(x * inv[:, None], -1.0, 1.0)
    idx = ((((y + 1.0) * 0.5) * 65535.0) + 0.5).to(tl.int32)
    q = tl.load(lut_ptr + idx, mask=mask, other=0)
    return mx, tl.where(pos[:, None], q, 0).to(tl.uint8)


@triton.jit
def _adamw8_kernel(w_ptr, q1_ptr, q2_ptr, a1_ptr, a2_ptr, g_ptr, code1_ptr, code2_ptr, lut1_ptr, lut2_ptr,
                   dev_ptr, key_ptr, skip_ptr, n, ctr0, wd_mul, beta1, c1, beta2, c2, eps,
                   ROWS: tl.constexpr, BLOCK: tl.constexpr, BF16: tl.constexpr, HAS_SKIP: tl.constexpr):
    """One AdamW step of blocks [pid * ROWS, pid * ROWS + ROWS) of a flat range of `n` values, in
    place. dev_ptr: fp32 (gradient scale, bc2, neg_step) on the device; key_ptr: the int64 rounding
    key; skip_ptr: nothing changes where it holds a nonzero value (HAS_SKIP)."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)            # (R,) block numbers
    offs = row[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]                  # (R, BLOCK)
    rmask = row * BLOCK < n
    if HAS_SKIP:                                  # a non-finite step: every store masked off
        rmask = rmask & (tl.load(skip_ptr + row * 0) == 0)
    mask = (offs < n) & rmask[:, None]
    gscale = tl.load(dev_ptr)
    bc2 = tl.load(dev_ptr + 1)
    neg_step = tl.load(dev_ptr + 2)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * gscale
    q1 = tl.load(q1_ptr + offs, mask=mask, other=0).to(tl.int32)
    q2 = tl.load(q2_ptr + offs, mask=mask, other=0).to(tl.int32)
    a1 = tl.load(a1_ptr + row, mask=rmask, other=0.0)
    a2 = tl.load(a2_ptr + row, mask=rmask, other=0.0)
    d1 = (tl.load(code1_ptr + q1) * a1[:, None]) * beta1
    d2 = (tl.load(code2_ptr + q2) * a2[:, None]) * beta2
    m = (g.to(tl.float64) * c1 + d1.to(tl.float64)).to(tl.float32)
    v = ((g * c2).to(tl.float64) * g.to(tl.float64) + d2.to(tl.float64)).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32) * wd_mul
    den = tl.math.div_rn(tl.sqrt_rn(v), tl.full(v.shape, 0.0, tl.float32) + bc2) + eps
    p = w + tl.math.div_rn(neg_step * m, den)
    mx1, new1 = _codes(m, mask, lut1_ptr)
    mx2, new2 = _codes(v, mask, lut2_ptr)
    tl.store(q1_ptr + offs, new1, mask=mask)
    tl.store(q2_ptr + offs, new2, mask=mask)
    tl.store(a1_ptr + row, mx1, mask=rmask)
    tl.store(a2_ptr + row, mx2, mask=rmask)
    if BF16:
        key = tl.load(key_ptr)
        k1 = (key & 0xFFFFFFFF).to(tl.uint32)
        k2 = ((key >> 32) & 0xFFFFFFFF).to(tl.uint32)
        r = _hash32(((ctr0 + offs) & 0xFFFFFFFF).to(tl.uint32), k1, k2) & 0xFFFF
        u = p.to(tl.uint32, bitcast=True)
        t = u + r
        keep = ((u & 0x7F800000) == 0x7F800000) | ((t & 0x7F800000) == 0x7F800000)   # inf / NaN, or a carry into it
        hi = (tl.where(keep, u, t) >> 16).to(tl.uint16)
        tl.store(w_ptr + offs, hi.to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(w_ptr + offs, p, mask=mask)


def adamw8_blocks(master, q1, q2, a1, a2, grad, dev: torch.Tensor, key: torch.Tensor, tables, ctr: int,
                  consts: tuple[float, ...], block: int, found_inf: torch.Tensor | None = None) -> None:
    """One 8-bit AdamW step of a flat range of blocks of `block` values, in place, in one launch.

    Args:
        master (n,) fp32 or bf16, q1, q2 (n,) uint8 codes, a1, a2 (ceil(n / block),) fp32 absmax,
            grad (n,) fp32 or bf16: contiguous, on one device.
        dev: (3,) fp32 on the device: the gradient's scale, sqrt(1 - beta2^t), -lr / (1 - beta1^t).
        key: the int64 rounding key (0-dim, on the device) of a bf16 master's stochastic rounding.
        tables: (code1, code2, lut1, lut2): the maps' 256 fp32 codes and the rounding tables
            (65536 entries, any integer dtype), on the device.
        ctr: the counter of the range's first element. consts: (1 - lr wd, beta1, 1 - beta1, beta2,
            1 - beta2, eps) as fp32 values. found_inf: where nonzero, nothing changes.
    """
    n = master.numel()
    if n == 0:
        return
    for t in (master, q1, q2, a1, a2, grad):
        assert t.is_contiguous() and t.device == master.device
    code1, code2, lut1, lut2 = tables
    grid = (triton.cdiv(triton.cdiv(n, block), ROWS),)
    _adamw8_kernel[grid](master, q1, q2, a1, a2, grad, code1, code2, lut1, lut2, dev, key,
                         found_inf if found_inf is not None else dev, n, int(ctr), *(float(c) for c in consts),
                         ROWS=ROWS, BLOCK=block, BF16=master.dtype == torch.bfloat16,
                         HAS_SKIP=found_inf is not None, num_warps=4, enable_fp_fusion=False)
