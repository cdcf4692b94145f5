"""The 8-bit block-wise quantization of AdamW moments: the dynamic maps, the rounding table, and
a plain-torch quantize / dequantize.

The scheme is that of Dettmers et al., "8-bit Optimizers via Block-wise Quantization", as
bitsandbytes' blockwise 8-bit Adam keeps it: each block of `BLOCK` values of one parameter holds
one fp32 scale (its absmax) and 256-entry codes of the value divided by it. The signed dynamic
map codes `exp_avg`, the unsigned one `exp_avg_sq` (denser near zero: an exponent of 0..-6 and a
linear fraction in the remaining bits). A value is rounded to the code nearest to it on a grid of
65536 points of [-1, 1] (`quantize_lut`), as bitsandbytes' CPU kernel rounds: the table is built
once per map, and a lookup costs a multiply, an add and a load, which keeps the native update
memory-bound (csrc/host_adam8.c). The torch functions below are the same arithmetic, for tests,
conversions and the checks of a loaded state.
"""
from __future__ import annotations

import functools

import torch

__all__ = ["BLOCK", "LUT_SIZE", "dynamic_map", "quantize_lut", "quantize_blockwise", "dequantize_blockwise",
           "num_blocks"]

BLOCK = 256
LUT_SIZE = 65536


def num_blocks(numel: int) -> int:
    """Blocks of one parameter of `numel` elements (its last block may be partial)."""
    return -(-numel // BLOCK)


@functools.lru_cache(maxsize=None)
def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256 sorted fp32 codes of the dynamic map (signed: 127 negative, 0, 128 positive up to 1).

    For each exponent e of 0..6, 2**e (signed) or 2**(e + 1) (unsigned) values: the midpoints of an
    even split of [0.1, 1] times 10**(e - 6), in fp32 arithmetic; then 0 and 1.
    """
    values: list[float] = []
    for e in range(7):
        items = (2 ** e if signed else 2 ** (e + 1)) + 1
        edges = torch.linspace(0.1, 1.0, items, dtype=torch.float32)
        mids = ((edges[:-1] + edges[1:]) / 2.0) * (10.0 ** (e - 6))         # fp32 throughout
        values += mids.tolist()
        if signed:
            values += (-mids).tolist()
    values += [0.0, 1.0]
    assert len(values) == 256
    return torch.tensor(sorted(values), dtype=torch.float32)


@functools.lru_cache(maxsize=None)
def quantize_lut(signed: bool) -> torch.Tensor:
    """(LUT_SIZE,) uint8: the nearest code of `dynamic_map(signed)` to each point -1 + 2 i / 65535.

    Nearest by the fp32 midpoints of consecutive codes; a point on a midpoint takes the lower code.
    """
    code = dynamic_map(signed)
    mids = (code[:-1] + code[1:]) * 0.5
    grid = (2.0 * torch.arange(LUT_SIZE, dtype=torch.float32)) / float(LUT_SIZE - 1) + -1.0
    return torch.searchsorted(mids, grid, right=False).to(torch.uint8)


def _lut_index(x: torch.Tensor) -> torch.Tensor:
    y = x.clamp(-1.0, 1.0)
    return ((((y + 1.0) * 0.5) * float(LUT_SIZE - 1)) + 0.5).to(torch.int64)


def quantize_blockwise(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and absmax of a flat fp32 tensor, blocks from its first element.

    Returns:
        (codes (n,) uint8, absmax (num_blocks(n),) fp32); an all-zero block has absmax 0, codes 0.
    """
    x = x.reshape(-1).to(torch.float32)
    n = x.numel()
    nb = num_blocks(n)
    pad = torch.zeros(nb * BLOCK, dtype=torch.float32)
    pad[:n] = x
    blocks = pad.view(nb, BLOCK)
    absmax = blocks.abs().amax(dim=1)
    inv = torch.where(absmax > 0, 1.0 / torch.where(absmax > 0, absmax, 1.0), 0.0)
    codes = quantize_lut(signed)[_lut_index(blocks * inv[:, None])]
    codes[absmax == 0] = 0
    return codes.view(-1)[:n].clone(), absmax


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 values of `codes` (n,) with the blocks' `absmax`: code * absmax."""
    codes = codes.reshape(-1)
    n = codes.numel()
    scale = absmax.repeat_interleave(BLOCK)[:n]
    return dynamic_map(signed)[codes.long()] * scale
