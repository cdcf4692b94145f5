"""The chunked gated delta rule's scan over chunks (`triton_ops.gated_delta`), one kernel each way.

A program owns one (batch x head, tile of value columns) pair: it holds that tile of the recurrent
state in registers and walks the chunks, so the state is read and written once per chunk by its
program instead of by a copy, a product, a decay and a sum each a pass of its own. A tile of state
columns depends only on the same columns of U, F and P (below), so the tiles are independent.

With gated_delta's symbols (W the decayed keys solved, U the values solved, K the keys decayed to
the chunk's end, y the chunk's decay), forward per chunk c:
    states[c] = S;   V_c = U_c - W_c S;   S <- y_c S + K_c^T V_c
and backward from the last chunk, with F_c = A_c^T dO_c and P_c = Q_c^T dO_c computed before:
    next[c] = G;   dV_c = F_c + K_c G;   G <- y_c G + P_c - W_c^T dV_c
The products are fp32 (`input_precision=PREC`: no TF32) and each update sums in the torch loop's
order; the products' own summation order is the kernel's, so results agree with the loop to fp32
rounding, not bit for bit. Every tensor is fp32 (read row-major: a column-major one is copied
first); the chunk length is a power of two of at least 16 and the key width at most 256
(`supported`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["scan_backward", "scan_forward", "supported"]

# Launch settings (block of value columns, warps, pipeline stages, the products' precision).
# benchmarks/experiments/chunk_scan_probe.py times others against the torch loop.
CONFIG = {"block_v": 32, "num_warps": 4, "num_stages": 1, "precision": "ieee"}


@triton.jit
def _offsets(DK, DV, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr):
    """This program's batch x head, key rows, value columns, chunk rows, their masks, and its state
    tile's offsets within a (DK, DV) state and mask."""
    bh = tl.program_id(0).to(tl.int64)
    kr = tl.arange(0, BK)
    vc = tl.program_id(1) * BV + tl.arange(0, BV)
    mk, mv = kr < DK, vc < DV
    return bh, kr, vc, tl.arange(0, C), mk, mv, kr[:, None] * DV + vc[None, :], mk[:, None] & mv[None, :]


@triton.jit
def _fwd_kernel(w_ptr, u_ptr, k_ptr, y_ptr, s0_ptr, states_ptr, v_ptr, final_ptr, N, DK, DV,
                C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    bh, kr, vc, t, mk, mv, s_at, ms = _offsets(DK, DV, BK, BV, C)
    s = tl.load(s0_ptr + bh * DK * DV + s_at, mask=ms, other=0.0)
    for c in range(N):
        chunk = bh * N + c
        tl.store(states_ptr + chunk * DK * DV + s_at, s, mask=ms)
        w = tl.load(w_ptr + chunk * C * DK + t[:, None] * DK + kr[None, :], mask=mk[None, :], other=0.0)
        u = tl.load(u_ptr + chunk * C * DV + t[:, None] * DV + vc[None, :], mask=mv[None, :], other=0.0)
        v = u - tl.dot(w, s, input_precision=PREC)
        tl.store(v_ptr + chunk * C * DV + t[:, None] * DV + vc[None, :], v, mask=mv[None, :])
        kt = tl.load(k_ptr + chunk * C * DK + kr[:, None] + t[None, :] * DK, mask=mk[:, None], other=0.0)
        s = s * tl.load(y_ptr + chunk) + tl.dot(kt, v, input_precision=PREC)
    tl.store(final_ptr + bh * DK * DV + s_at, s, mask=ms)


@triton.jit
def _bwd_kernel(k_ptr, w_ptr, y_ptr, f_ptr, p_ptr, gn_ptr, next_ptr, dv_ptr, g0_ptr, N, DK, DV,
                C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    bh, kr, vc, t, mk, mv, s_at, ms = _offsets(DK, DV, BK, BV, C)
    g = tl.load(gn_ptr + bh * DK * DV + s_at, mask=ms, other=0.0)
    for i in range(N):
        chunk = bh * N + (N - 1 - i)
        tl.store(next_ptr + chunk * DK * DV + s_at, g, mask=ms)
        k = tl.load(k_ptr + chunk * C * DK + t[:, None] * DK + kr[None, :], mask=mk[None, :], other=0.0)
        f = tl.load(f_ptr + chunk * C * DV + t[:, None] * DV + vc[None, :], mask=mv[None, :], other=0.0)
        dv = f + tl.dot(k, g, input_precision=PREC)
        tl.store(dv_ptr + chunk * C * DV + t[:, None] * DV + vc[None, :], dv, mask=mv[None, :])
        wt = tl.load(w_ptr + chunk * C * DK + kr[:, None] + t[None, :] * DK, mask=mk[:, None], other=0.0)
        p = tl.load(p_ptr + chunk * DK * DV + s_at, mask=ms, other=0.0)
        g = g * tl.load(y_ptr + chunk) + p - tl.dot(wt, dv, input_precision=PREC)
    tl.store(g0_ptr + bh * DK * DV + s_at, g, mask=ms)


def supported(key: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """Whether the kernels take the key (b, h, n, C, Dk) and these tensors: fp32, C a power of two
    >= 16, Dk <= 256 (a program holds Dk state rows in registers)."""
    chunk = key.shape[3]
    return (chunk >= 16 and chunk & (chunk - 1) == 0 and key.shape[-1] <= 256
            and all(t.dtype == torch.float32 for t in (key, *tensors)))


def _launch(kernel, key: torch.Tensor, dv: int, *args) -> None:
    b, h, n, chunk, dk = key.shape
    if key.numel() and dv:
        cfg = CONFIG
        grid = (b * h, triton.cdiv(dv, cfg["block_v"]))
        kernel[grid](*args, n, dk, dv, C=chunk, BK=triton.next_power_of_2(max(dk, 16)), BV=cfg["block_v"],
                     PREC=cfg["precision"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def scan_forward(key, new_values, k_cumdecay, chunk_decay, initial_state):
    """(states entering each chunk (b, h, n, Dk, Dv), corrected values V (b, h, n, C, Dv), final state)."""
    b, h, n, _, dk = key.shape
    dv = new_values.shape[-1]
    states = key.new_empty((b, h, n, dk, dv))
    corrected = key.new_empty(new_values.shape)             # row-major, as the kernel writes it
    final = key.new_empty((b, h, dk, dv))
    # The solves return column-major chunks (LAPACK's and cuBLAS's layout): made row-major here.
    _launch(_fwd_kernel, key, dv, *(t.contiguous() for t in (k_cumdecay, new_values, key, chunk_decay, initial_state)),
            states, corrected, final)
    return states, corrected, final


def scan_backward(key, k_cumdecay, chunk_decay, from_out, q_out, d_final):
    """(the state's gradient after each chunk (b, h, n, Dk, Dv), dV (b, h, n, C, Dv), the initial
    state's gradient) from F = A^T dO, P = Q^T dO and the final state's gradient (None: zero)."""
    b, h, n, _, dk = key.shape
    dv = from_out.shape[-1]
    g_final = key.new_zeros((b, h, dk, dv)) if d_final is None else d_final.contiguous()
    next_grads = key.new_empty((b, h, n, dk, dv))
    d_corrected = key.new_empty(from_out.shape)
    g0 = key.new_empty((b, h, dk, dv))
    _launch(_bwd_kernel, key, dv, *(t.contiguous() for t in (key, k_cumdecay, chunk_decay, from_out, q_out)),
            g_final, next_grads, d_corrected, g0)
    return next_grads, d_corrected, g0
