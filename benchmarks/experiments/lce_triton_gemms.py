"""Experimental Triton GEMMs for the loss head's projection and weight-gradient update.

Two persistent Triton kernels that load their operands through TMA descriptors (Hopper and
newer; Triton's interpreter runs them on the CPU):

    logits = h_c @ W.T        (C, V) = (C, H) x (V, H).T   `project_`
    dW    += G_c.T @ h_c      (V, H) = (C, V).T x (C, H)   `accumulate_dw_`

The question they answer (benchmarks/experiments/lce_triton_probe.py; benchmarks/NOTEBOOK.md, "The loss
head's GEMMs"): can the chunked loss head beat cuBLAS where cuBLAS is weakest, the dW update with a
reduction of only K = C tokens per chunk, which reads and writes the whole (V, H) gradient once
per chunk? The update's read-modify-write is tried three ways: the old tile loaded before the
mainloop (into registers or through TMA), and a TMA reduction (`cp.reduce.async.bulk`) that adds
the rounded tile in L2 while the SM moves on. Measured on the H200, none is faster than cuBLAS's
addmm, and the projection is within the run-to-run spread of cuBLAS's; the op therefore keeps
cuBLAS, and these kernels stay here as the measured alternative.

All operands need rows TMA can address: 16-byte aligned base and row stride (`tma_compatible`).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from triton_ops.kernels.cross_entropy import cast_rne

__all__ = ["GemmConfig", "accumulate_dw_", "project_", "tma_compatible"]


class GemmConfig:
    """Tile sizes and launch parameters of one kernel launch."""

    def __init__(self, bm: int, bn: int, bk: int, stages: int, warps: int, ws: bool = False):
        self.bm, self.bn, self.bk, self.stages, self.warps, self.ws = bm, bn, bk, stages, warps, ws

    def __repr__(self) -> str:
        return f"{self.bm}x{self.bn}x{self.bk}/s{self.stages}/w{self.warps}{'/ws' if self.ws else ''}"


# Measured best on the H200 at T = 16384, H = 4096, V = 128256 (docs/benchmarks.md).
PROJECT_CONFIG = GemmConfig(128, 256, 64, 3, 8)
DW_CONFIG = GemmConfig(128, 256, 64, 3, 8)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sms(t: torch.Tensor) -> int:
    return _num_sms(t.device.index if t.device.index is not None else torch.cuda.current_device()) \
        if t.is_cuda else 4


def tma_compatible(*tensors: torch.Tensor) -> bool:
    """Whether TMA can address these 2-D tensors: unit last stride, 16-byte aligned rows and base."""
    for t in tensors:
        if t.dim() != 2 or t.stride(1) != 1 or t.dtype not in (torch.bfloat16, torch.float16):
            return False
        if (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return False
    return True


def _dot_f32(t: torch.Tensor) -> bool:
    # Triton's interpreter (CPU tensors) multiplies bf16 tiles wrongly in tl.dot (Triton 3.9);
    # fp32 tiles are exact there, and the products of bf16 values are exact in fp32.
    return not t.is_cuda


def _check(*tensors: torch.Tensor) -> None:
    if not tma_compatible(*tensors):
        raise ValueError("the TMA GEMMs need 2-D bf16/fp16 tensors with a unit last stride and 16-byte aligned "
                         "base and rows (a hidden size and logits row stride that are multiples of 8)")


def _desc(t: torch.Tensor, block: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), block)


@triton.jit
def _project_kernel(a_desc, b_desc, out_desc, m_ptr, s_ptr, M, N, K,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_SMS: tl.constexpr,
                    M_FASTEST: tl.constexpr, STATS: tl.constexpr, WS: tl.constexpr, DOT_F32: tl.constexpr):
    """out (M, N) = a (M, K) @ b (N, K).T, fp32 accumulation, rounded to out's dtype.

    Persistent: program p takes tiles p, p + NUM_SMS, ...; with M_FASTEST the row tiles of one
    column tile run together (they share b's tile), otherwise the column tiles of one row tile.
    STATS (out = logits.T, M = V, N = tokens): per column, the max m over the tile's rows and
    sum(exp(x - m)) of the rounded values, stored at [pid_m, column] of m_ptr / s_ptr (N wide).
    """
    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BK)
    for tile in tl.range(start, num_tiles, NUM_SMS, flatten=True, warp_specialize=WS):
        if M_FASTEST:
            pid_m = tile % num_pid_m
            pid_n = tile // num_pid_m
        else:
            pid_n = tile % num_pid_n
            pid_m = tile // num_pid_n
        off_m = pid_m * BM
        off_n = pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([off_m, ki * BK])                  # (BM, BK)
            b = b_desc.load([off_n, ki * BK])                  # (BN, BK)
            if DOT_F32:                                        # the interpreter (see _dot_f32)
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b.T, acc)
        x = cast_rne(acc, out_desc.dtype, DOT_F32)
        out_desc.store([off_m, off_n], x)
        if STATS:
            rows = off_m + tl.arange(0, BM)
            cols = off_n + tl.arange(0, BN)
            xf = tl.where(rows[:, None] < M, x.to(tl.float32), float("-inf"))
            mx = tl.max(xf, axis=0)                            # (BN,)
            sx = tl.sum(tl.exp(xf - mx[None, :]), axis=0)      # (BN,)
            tl.store(m_ptr + pid_m * N + cols, mx, mask=cols < N)
            tl.store(s_ptr + pid_m * N + cols, sx, mask=cols < N)


@triton.jit
def _dw_kernel(a_desc, b_desc, dw_desc, dw_ptr, M, N, K,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_SMS: tl.constexpr,
               A_T: tl.constexpr, ACCUMULATE: tl.constexpr, REDUCE: tl.constexpr, OLD_PTR: tl.constexpr,
               PREFETCH: tl.constexpr, WS: tl.constexpr, DOT_F32: tl.constexpr):
    """dw (M, N) (+)= A (M, K) @ b (K, N): M = V, N = H, K = the chunk's tokens.

    A is a_desc's tile as stored ((BM, BK), the logits.T layout) or, with A_T, transposed from
    a (BK, BM) tile (the logits layout). The old tile of dw is loaded before the mainloop with
    PREFETCH (its latency hides behind the dots), through TMA or, with OLD_PTR, straight into
    registers, and added in fp32 once; the sum is rounded to dw's dtype, as cuBLAS's addmm with
    beta = 1 does. Column-tile-fastest order: the programs that share one tile of A run together.
    """
    start = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BN)
    num_tiles = tl.cdiv(M, BM) * num_pid_n
    k_tiles = tl.cdiv(K, BK)
    for tile in tl.range(start, num_tiles, NUM_SMS, flatten=True, warp_specialize=WS):
        pid_n = tile % num_pid_n
        pid_m = tile // num_pid_n
        off_m = pid_m * BM
        off_n = pid_n * BN
        rows = off_m + tl.arange(0, BM)
        cols = off_n + tl.arange(0, BN)
        if ACCUMULATE and PREFETCH and not REDUCE:
            if OLD_PTR:
                old = tl.load(dw_ptr + rows[:, None] * N + cols[None, :],
                              mask=(rows[:, None] < M) & (cols[None, :] < N), other=0.0)
            else:
                old = dw_desc.load([off_m, off_n])
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            if A_T:
                a = a_desc.load([ki * BK, off_m]).T            # (BM, BK) from (BK, BM)
            else:
                a = a_desc.load([off_m, ki * BK])              # (BM, BK)
            b = b_desc.load([ki * BK, off_n])                  # (BK, BN)
            if DOT_F32:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)
        if ACCUMULATE and REDUCE:
            if DOT_F32:
                # The interpreter has no TMA reduction: the same sum, old + rounded tile, rounded.
                old = dw_desc.load([off_m, off_n])
                part = cast_rne(acc, dw_desc.dtype, DOT_F32).to(tl.float32)
                dw_desc.store([off_m, off_n], cast_rne(old.to(tl.float32) + part, dw_desc.dtype, DOT_F32))
            else:
                dw_desc.atomic_add([off_m, off_n], acc.to(dw_desc.dtype))
        elif ACCUMULATE:
            if not PREFETCH:
                if OLD_PTR:
                    old = tl.load(dw_ptr + rows[:, None] * N + cols[None, :],
                                  mask=(rows[:, None] < M) & (cols[None, :] < N), other=0.0)
                else:
                    old = dw_desc.load([off_m, off_n])
            acc += old.to(tl.float32)
            dw_desc.store([off_m, off_n], cast_rne(acc, dw_desc.dtype, DOT_F32))
        else:
            dw_desc.store([off_m, off_n], cast_rne(acc, dw_desc.dtype, DOT_F32))


def project_(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, config: GemmConfig | None = None,
             m_fastest: bool = True, stats: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """out (M, N) = a (M, K) @ b (N, K).T; all three `tma_compatible`.

    With `stats` = (m, s), two fp32 (cdiv(M, bm), N) buffers: each column's max and sum of exp
    per row tile (see `_project_kernel`).
    """
    _check(a, b, out)
    cfg = config or PROJECT_CONFIG
    M, K = a.shape
    N = b.shape[0]
    if M == 0 or N == 0:
        return
    tiles = triton.cdiv(M, cfg.bm) * triton.cdiv(N, cfg.bn)
    sms = _sms(a)
    m_buf, s_buf = stats if stats is not None else (out, out)
    _project_kernel[(min(sms, tiles),)](
        _desc(a, [cfg.bm, cfg.bk]), _desc(b, [cfg.bn, cfg.bk]), _desc(out, [cfg.bm, cfg.bn]), m_buf, s_buf,
        M, N, K, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, NUM_SMS=sms, M_FASTEST=m_fastest, STATS=stats is not None,
        WS=cfg.ws, DOT_F32=_dot_f32(a), num_stages=cfg.stages, num_warps=cfg.warps)


def accumulate_dw_(a: torch.Tensor, b: torch.Tensor, dw: torch.Tensor, accumulate: bool,
                   config: GemmConfig | None = None, a_transposed: bool = False, reduce: bool = True,
                   old_ptr: bool = True, prefetch: bool = True) -> None:
    """dw (V, H) = [dw +] a (V, C) @ b (C, H), or a.T @ b for `a_transposed` a (C, V); all `tma_compatible`."""
    _check(a, b, dw)
    cfg = config or DW_CONFIG
    M, N = dw.shape
    K = b.shape[0]
    tiles = triton.cdiv(M, cfg.bm) * triton.cdiv(N, cfg.bn)
    sms = _sms(dw)
    a_block = [cfg.bk, cfg.bm] if a_transposed else [cfg.bm, cfg.bk]
    _dw_kernel[(min(sms, tiles),)](
        _desc(a, a_block), _desc(b, [cfg.bk, cfg.bn]), _desc(dw, [cfg.bm, cfg.bn]), dw,
        M, N, K, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, NUM_SMS=sms, A_T=a_transposed, ACCUMULATE=accumulate,
        REDUCE=reduce, OLD_PTR=old_ptr, PREFETCH=prefetch, WS=cfg.ws, DOT_F32=_dot_f32(dw),
        num_stages=cfg.stages, num_warps=cfg.warps)
