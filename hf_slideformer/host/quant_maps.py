"""The 8-bit block-wise quantization of AdamW moments: the dynamic maps, the rounding table, and
a plain-torch quantize / dequantize.

The scheme is that of Dettmers et al., "8-bit Optimizers via Block-wise Quantization", as
bitsandbytes' blockwise 8-bit Adam keeps it: each block of `BLOCK` values of one parameter holds
one fp32 scale (its absmax) and 256-entry codes of the value divided by it. The signed dynamic
map codes `exp_avg`, the unsigned one `exp_avg_sq` (denser near zero: an exponent of 0..-6 and a
linear fraction in the remaining bits). A value is rounded to the code nearest to it on a grid of
65536 points of [-1, 1] (`quantize_lut`), as bitsandbytes' CPU kernel rounds: the table is built
once per map. The native update (csrc/host_adam8.c) reads it in its bucket form
(`code_search_table`), which a vector unit searches from registers. The torch functions below are
the same arithmetic, for tests, conversions and the checks of a loaded state.
"""
from __future__ import annotations

import functools

import torch

__all__ = ["BLOCK", "LUT_SIZE", "M64", "mix64", "rounding_key", "signed64", "dynamic_map", "quantize_lut",
           "quantize_blockwise", "dequantize_blockwise", "num_blocks", "block_at", "code_search_table", "SEARCH_LEVELS"]

BLOCK = 256
LUT_SIZE = 65536


def num_blocks(numel: int) -> int:
    """Blocks of one parameter of `numel` elements (its last block may be partial)."""
    return -(-numel // BLOCK)


def block_at(entries, offset: int) -> int:
    """The index, in the block arrays of a unit of parameters `entries` (each with its `offset` and
    `numel`, blocks from its own start), of the block that starts at flat `offset`: a block start
    of its parameter, or the end of one (then the next parameter's first block)."""
    b0 = 0
    for entry in entries:
        if offset <= entry.offset + entry.numel:
            return b0 + num_blocks(max(0, offset - entry.offset))
        b0 += num_blocks(entry.numel)
    return b0


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


# The code search's levels (shift, origin) over the rounding table's index: level 0 covers the
# whole grid in buckets of 256 points, level 1 the 8192 points about the middle (where the dynamic
# maps' codes crowd) in buckets of 32, level 2 the middle 256 points one by one.
SEARCH_LEVELS = ((8, 0), (5, LUT_SIZE // 2 - 4096), (0, LUT_SIZE // 2 - 128))
_SEARCH_ROWS = 5          # per level: the bucket's base code, then up to 4 thresholds


@functools.lru_cache(maxsize=None)
def code_search_table(signed: bool) -> torch.Tensor:
    """The rounding table `quantize_lut(signed)` (65536 bytes) followed by its bucket form, which a
    vector kernel looks up from registers instead of loading a byte per value (csrc/host_adam8.c).

    The bucket form gives the same code for every index i of the grid. The finest level whose
    region holds i gives its bucket `key = (i - origin) >> shift` and the offset `lo` in it; the code
    is `(base[key] + sum_k (lo >= t_k[key])) mod 256` over the level's thresholds (the offsets in
    the bucket where the table's code steps up; an unused threshold is 0 and its step is taken out
    of `base`). Layout after the table: for each level, `_SEARCH_ROWS` rows of 256 bytes (base, then
    the thresholds), then one byte per level: how many thresholds it uses (and one unused); then the
    map's codes as four planes of 256 bytes (byte b of each fp32 code, little-endian), which the
    kernel's dequantization looks up the same way. Checked exhaustively against the table when
    built.
    """
    lut = quantize_lut(signed).to(torch.int64)
    steps = torch.zeros(LUT_SIZE, dtype=torch.int64)
    steps[1:] = (lut[1:] != lut[:-1]).to(torch.int64)
    rows = torch.zeros(len(SEARCH_LEVELS), _SEARCH_ROWS, 256, dtype=torch.int64)
    counts = []
    for level, (shift, origin) in enumerate(SEARCH_LEVELS):
        width = 1 << shift
        inner = SEARCH_LEVELS[level + 1] if level + 1 < len(SEARCH_LEVELS) else None
        per = []
        for bucket in range(256):
            start = origin + bucket * width
            if start >= LUT_SIZE:
                per.append([])
                continue
            stop = min(start + width, LUT_SIZE)
            if inner is not None and start >= inner[1] and stop <= inner[1] + (256 << inner[0]):
                per.append([])                  # the finer level answers for this bucket
                continue
            per.append((steps[start + 1:stop].nonzero().view(-1) + 1).tolist())
            rows[level, 0, bucket] = lut[start]
        used = max(len(t) for t in per)
        if used > _SEARCH_ROWS - 1:
            raise AssertionError(f"code search level {level}: a bucket holds {used} thresholds")
        for bucket, ts in enumerate(per):
            for j in range(used):
                rows[level, 1 + j, bucket] = ts[j] if j < len(ts) else 0
            rows[level, 0, bucket] -= used - len(ts)     # each unused threshold (0) always steps up
        counts.append(used)
    rows %= 256
    planes = dynamic_map(signed).contiguous().view(torch.uint8).view(256, 4).t().to(torch.int64)
    table = torch.cat([lut, rows.view(-1), torch.tensor(counts + [0]), planes.reshape(-1)]).to(torch.uint8)
    if not torch.equal(_search(table, torch.arange(LUT_SIZE)), lut.to(torch.uint8)):
        raise AssertionError("the code search's buckets disagree with the rounding table")
    return table


def _search(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The bucket form's code of each grid index `idx` (what the vector kernel computes)."""
    rows = table[LUT_SIZE:LUT_SIZE + len(SEARCH_LEVELS) * _SEARCH_ROWS * 256].to(torch.int64).view(
        len(SEARCH_LEVELS), _SEARCH_ROWS, 256)
    at = LUT_SIZE + len(SEARCH_LEVELS) * _SEARCH_ROWS * 256
    counts = table[at:at + len(SEARCH_LEVELS)].tolist()
    code = torch.zeros_like(idx)
    for level, (shift, origin) in enumerate(SEARCH_LEVELS):
        off = idx - origin
        inside = (off >= 0) & (off < (256 << shift))
        key, lo = (off >> shift).clamp(0, 255), off & ((1 << shift) - 1)
        level_code = rows[level, 0, key].clone()
        for j in range(counts[level]):
            level_code += (lo >= rows[level, 1 + j, key]).to(torch.int64)
        code = torch.where(inside, level_code % 256, code)
    return code.to(torch.uint8)


def _lut_index(x: torch.Tensor) -> torch.Tensor:
    clamped = x.clamp(-1.0, 1.0)
    return ((((clamped + 1.0) * 0.5) * float(LUT_SIZE - 1)) + 0.5).to(torch.int64)


def quantize_blockwise(values: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and absmax of a flat fp32 tensor, blocks from its first element.

    Returns:
        (codes (n,) uint8, absmax (num_blocks(n),) fp32); an all-zero block has absmax 0, codes 0.
    """
    values = values.reshape(-1).to(torch.float32)
    n = values.numel()
    nb = num_blocks(n)
    pad = torch.zeros(nb * BLOCK, dtype=torch.float32)
    pad[:n] = values
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


M64 = (1 << 64) - 1


def signed64(value: int) -> int:
    """The int64 holding the bits of the unsigned 64-bit `value` (a key as a torch int64 holds it)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def mix64(x: int) -> int:
    """SplitMix64's finalizer on a Python int (mod 2^64): the stochastic rounding's key hash, as the
    native kernel and the torch-ops update compute it."""
    x &= M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def rounding_key(seed: int, unit_index: int, step: int) -> int:
    """The stochastic rounding's key of one unit's update at `step` (a pure function of the three)."""
    return mix64(mix64(mix64(seed) ^ unit_index) ^ step)
