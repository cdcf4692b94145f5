"""The block-wise 8-bit AdamW in torch ops: the compact formats' update where the state is not on
the host (resident layers, the device-updated share: `AdamW8bit.run` with no host kernel).

It is the arithmetic of the native kernel (csrc/host_adam8.c), operation by operation in fp32, on
any device: the moments dequantized per block, the AdamW step with the new, unquantized moments,
each block's new absmax and the codes of the rounding table (`quant_maps.quantize_lut`), a bf16
master rounded stochastically with the kernel's hash of (key, element). The square root is taken in
fp64 (then exact in fp32), and the two fused multiply-adds are taken in fp64 and rounded once to fp32, which equals the fused result but
where the fp64 sum itself rounds at a tie of fp32 (double rounding: about one value in 2^29). So
on the CPU it equals the native kernel code for code and bit for bit up to those
(`tests/test_adam8_torch.py` holds them to within one code step on a few elements). Blocks are
processed `CHUNK_BLOCKS` at a time, which bounds the temporaries on a GPU under a memory cap.

`adamw8_range` runs the same arithmetic as one Triton kernel where Triton runs for the tensors
(`triton_ops.kernels.adamw8`: one pass over the range, no temporaries, bit for bit this module's
result, `tests/test_adam8_triton.py`); the torch ops (`adamw8_range_torch`) are the reference and
the fallback.
"""
from __future__ import annotations

import functools
import math

import torch

from .quant_maps import BLOCK, dynamic_map, mix64, quantize_lut, signed64

__all__ = ["CHUNK_BLOCKS", "adamw8_range", "adamw8_range_torch", "adamw8_range_triton", "rounding_key_t",
           "round_bf16_stochastic_t", "Hyper8"]

CHUNK_BLOCKS = 1 << 14             # 4 M elements: about 200 MB of temporaries
_M32 = 0xFFFFFFFF


def _shr(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift (by `shift` bits) of int64 `x` as the 64-bit unsigned value its bits hold."""
    return (x >> shift) & ((1 << (64 - shift)) - 1)


def _mix64_t(x: torch.Tensor) -> torch.Tensor:
    """quant_maps.mix64 on int64 tensors (products wrap mod 2^64, as the unsigned ones)."""
    x = (x ^ _shr(x, 30)) * signed64(0xBF58476D1CE4E5B9)
    x = (x ^ _shr(x, 27)) * signed64(0x94D049BB133111EB)
    return x ^ _shr(x, 31)


def rounding_key_t(seed: int, unit_index: int, step: torch.Tensor) -> torch.Tensor:
    """`quant_maps.rounding_key(seed, unit_index, int(step))` from the step counter tensor (on its
    device, without reading it on the host): an int64 scalar holding the 64-bit key's bits."""
    return _mix64_t(step.to(torch.int64) ^ signed64(mix64(mix64(seed) ^ unit_index)))


def _hash32(x: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor) -> torch.Tensor:
    """The kernel's hash32 on int64 tensors holding uint32 values."""
    x = ((x ^ k1) * 0x9E3779B1) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    x = x ^ (x >> 16)
    return x ^ k2


def round_bf16_stochastic_t(values: torch.Tensor, key: torch.Tensor, ctr: torch.Tensor) -> torch.Tensor:
    """bf16 of fp32 `values` rounded as the kernel's f2b_stochastic: element i with the hash of
    (key, ctr[i]) (`ctr` int64, the elements' counters)."""
    k1, k2 = key & _M32, _shr(key, 32) & _M32
    noise = _hash32(ctr & _M32, k1, k2) & 0xFFFF
    bits = values.contiguous().view(torch.int32).to(torch.int64) & _M32
    summed = bits + noise
    keep = ((bits & 0x7F800000) == 0x7F800000) | ((summed & 0x7F800000) == 0x7F800000)   # inf / NaN, or a carry into it
    hi = (torch.where(keep, bits, summed) >> 16) & 0xFFFF
    return torch.where(hi >= 1 << 15, hi - (1 << 16), hi).to(torch.int16).view(torch.bfloat16)


@functools.lru_cache(maxsize=None)
def _tables(device: torch.device):
    return tuple(t.to(device) for t in (dynamic_map(True), dynamic_map(False), quantize_lut(True).to(torch.int64),
                                         quantize_lut(False).to(torch.int64)))


class Hyper8:
    """The update's fp32 constants (as `host_optim._hp8` / `_set_step8` give the native kernel).

    `step` is the step counter: a tensor on the state's device (the step's constants are then 0-dim
    tensors there, not read on the host), or its value as a host number (then Python floats holding
    fp32 values, the native kernel's own arithmetic, and `key` an int64 CPU scalar).
    """

    def __init__(self, hp: dict, scale, grad_mul: float, step, key: torch.Tensor):
        fp32 = lambda x: torch.tensor(x, dtype=torch.float32).item()       # noqa: E731 - fp32 as the kernel holds it
        beta1, beta2 = (float(b) for b in hp["betas"])
        lr, wd = float(hp["lr"]), float(hp["weight_decay"])
        sign = -1.0 if hp.get("maximize", False) else 1.0
        if torch.is_tensor(scale):          # on the device (the clip factor's reciprocal): not read here
            where = step.device if torch.is_tensor(step) else scale.device
            gclip = (1.0 / scale.to(where, torch.float64)).to(torch.float32)
            self.gscale = (gclip * fp32(grad_mul)) * sign
        else:                               # Python floats holding fp32 values: the same products
            gclip = 1.0 if scale is None else fp32(1.0 / float(scale))
            self.gscale = fp32(fp32(fp32(grad_mul) * gclip) * sign)
        self.wd_mul = fp32(1.0 - lr * wd) if wd > 0.0 else 1.0
        self.beta1, self.c1, self.beta2, self.c2 = fp32(beta1), fp32(1.0 - beta1), fp32(beta2), fp32(1.0 - beta2)
        self.eps = fp32(float(hp["eps"]))
        if torch.is_tensor(step):
            step64 = step.to(torch.float64)
            self.bc2 = torch.sqrt(1.0 - beta2 ** step64).to(torch.float32)
            self.neg_step = (-lr / (1.0 - beta1 ** step64)).to(torch.float32)
        else:
            self.bc2 = fp32(math.sqrt(1.0 - beta2 ** float(step)))
            self.neg_step = fp32(-lr / (1.0 - beta1 ** float(step)))
        self.key = key
        self._kernel_args = None

    def kernel_args(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The Triton kernel's (3,) fp32 scalars (the gradient's scale, sqrt(1 - beta2^t),
        -lr / (1 - beta1^t)) and its 0-dim int64 key, on `device`: made once, on the current
        stream, for every range on that device the constants serve (or `share_kernel_args`' row)."""
        if self._kernel_args is None or self._kernel_args[0].device != torch.device(device):
            scalars = torch.stack([_dev_scalar(self.gscale, device), _dev_scalar(self.bc2, device),
                                   _dev_scalar(self.neg_step, device)])
            self._kernel_args = (scalars, self.key.to(device, torch.int64).reshape(()))
        return self._kernel_args

    @staticmethod
    def share_kernel_args(hypers: list["Hyper8"], device) -> None:
        """Give `hypers`, made from host step values for one update of many pieces, their kernel
        arguments on `device` as rows of one table: two copies (and, for a gradient scale on the device,
        its column written there) on the current stream.

        Note: [Why a device update's constants cross as one table] a device-updated layer queues its
        whole update while the GPU still runs the layer's backward; the device holds a bounded queue of
        pending operations (about 2,000 on an H100: benchmarks/experiments/device_issue_probe.py), past
        which the queuing thread waits for the GPU, and the next layer's recompute is queued late. The
        constants made as device scalars took about thirty operations per entry and five more per range.
        """
        device = torch.device(device)
        if not hypers:
            return
        on_device = [torch.is_tensor(h.gscale) for h in hypers]
        rows = [[0.0 if dev else h.gscale, h.bc2, h.neg_step] for h, dev in zip(hypers, on_device)]
        scalars = torch.tensor(rows, dtype=torch.float32)
        keys = torch.stack([h.key.reshape(()) for h in hypers]).to(torch.int64)
        if device.type == "cuda":            # pinned: a copy from pageable memory waits for the stream's queue
            scalars, keys = scalars.pin_memory(), keys.pin_memory()
        scalars, keys = scalars.to(device, non_blocking=True), keys.to(device, non_blocking=True)
        if any(on_device):
            index = [i for i, dev in enumerate(on_device) if dev]
            scalars[index, 0] = torch.stack([hypers[i].gscale.to(device).reshape(()) for i in index])
        for row, hyper in enumerate(hypers):
            hyper._kernel_args = (scalars[row], keys[row])


def _fma(a: torch.Tensor, b, c: torch.Tensor) -> torch.Tensor:
    """fmaf(a, b, c): the exact a * b (fp64 holds it) plus c, rounded (see the module)."""
    return (a.to(torch.float64) * b + c.to(torch.float64)).to(torch.float32)


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """sqrtf, correctly rounded: through fp64, which rounds once more without a tie (torch's fp32 sqrt
    on the CPU is not correctly rounded)."""
    return x.to(torch.float64).sqrt().to(torch.float32)


def _codes(blocks: torch.Tensor, mx: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """The rounding table's codes of `blocks` (rows) of absmax `mx`; 0 for an all-zero block."""
    inv = torch.where(mx > 0, 1.0 / torch.where(mx > 0, mx, 1.0), 0.0)
    scaled = (blocks * inv[:, None]).clamp(-1.0, 1.0)
    idx = ((((scaled + 1.0) * 0.5) * 65535.0) + 0.5).to(torch.int64)
    return torch.where((mx > 0)[:, None], lut[idx], 0).to(torch.uint8)


def _blocks(hyper: Hyper8, master, q1, q2, a1, a2, grad, ctr0: int, skip) -> None:
    """The update of rows of blocks in place: master, q1, q2, grad (rows, L); a1, a2 (rows,)."""
    code1, code2, lut1, lut2 = _tables(master.device)
    grad = grad.to(torch.float32) * hyper.gscale
    moment1 = _fma(grad, hyper.c1, (code1[q1.long()] * a1[:, None]) * hyper.beta1)
    moment2 = _fma(grad * hyper.c2, grad, (code2[q2.long()] * a2[:, None]) * hyper.beta2)
    param = master.to(torch.float32) * hyper.wd_mul
    param = param + (hyper.neg_step * moment1) / (_sqrt(moment2) / hyper.bc2 + hyper.eps)
    mx1, mx2 = moment1.abs().amax(dim=1), moment2.abs().amax(dim=1)
    new = [_codes(moment1, mx1, lut1), _codes(moment2, mx2, lut2), mx1, mx2]
    if master.dtype == torch.bfloat16:
        ctr = ctr0 + torch.arange(master.numel(), dtype=torch.int64, device=master.device).view(master.shape)
        new.append(round_bf16_stochastic_t(param, hyper.key, ctr))
    else:
        new.append(param)
    for dst, src in zip((q1, q2, a1, a2, master), new):
        dst.copy_(src if skip is None else torch.where(skip, dst, src))


def adamw8_range(hp: dict, master, q1, q2, a1, a2, grad, step: torch.Tensor | None, key: torch.Tensor | None, ctr: int,
                 scale=None, grad_mul: float = 1.0, found_inf: torch.Tensor | None = None,
                 hyper: Hyper8 | None = None) -> None:
    """One 8-bit AdamW step of a flat range from a block of its parameter, in place: the Triton
    kernel (adam8_triton.py) where it runs for these tensors (CUDA, or Triton's interpreter), else
    `adamw8_range_torch`; the two agree bit for bit.

    Args:
        hp: the param group. master (n,) fp32 or bf16, q1, q2 (n,) uint8 codes, a1, a2
            (ceil(n / BLOCK),) fp32 absmax, grad (n,) fp32 or bf16: the range's views.
        step: its fp32 step counter (advanced); key: `rounding_key_t`'s for this update;
            ctr: the range's first element's counter (its offset in the unit).
        scale: divide the gradient by it (a float or a scalar tensor), None for 1.
        found_inf: where nonzero, nothing changes (decided on the device).
        hyper: the update's constants made once for several ranges of one step (`Hyper8` of hp,
            scale, grad_mul, step and key; then step and key are not read), else made here.
    """
    from triton_ops import kernels_apply

    hyper = hyper or Hyper8(hp, scale, grad_mul, step, key)
    if kernels_apply(master) and all(t.is_contiguous() for t in (master, q1, q2, a1, a2, grad)):
        adamw8_range_triton(hp, master, q1, q2, a1, a2, grad, step, key, ctr, scale, grad_mul, found_inf, hyper)
    else:
        adamw8_range_torch(hp, master, q1, q2, a1, a2, grad, step, key, ctr, scale, grad_mul, found_inf, hyper)


def _dev_scalar(value, device) -> torch.Tensor:
    """`value` (a Python float or a 0-dim tensor) as a 0-dim fp32 tensor on `device`, not read on the host."""
    if torch.is_tensor(value):
        return value.to(device, torch.float32).reshape(())
    return torch.full((), value, dtype=torch.float32, device=device)


def adamw8_range_triton(hp: dict, master, q1, q2, a1, a2, grad, step: torch.Tensor | None, key: torch.Tensor | None,
                        ctr: int, scale=None, grad_mul: float = 1.0, found_inf: torch.Tensor | None = None,
                        hyper: Hyper8 | None = None) -> None:
    """`adamw8_range` in one launch of the Triton kernel (`triton_ops.kernels.adamw8`): its tensors
    contiguous, on CUDA (or on the CPU under Triton's interpreter)."""
    from triton_ops.kernels.adamw8 import adamw8_blocks

    hyper, dev = hyper or Hyper8(hp, scale, grad_mul, step, key), master.device
    scalars, key_dev = hyper.kernel_args(dev)
    adamw8_blocks(master, q1, q2, a1, a2, grad, scalars, key_dev, _tables(dev), ctr,
                  (hyper.wd_mul, hyper.beta1, hyper.c1, hyper.beta2, hyper.c2, hyper.eps), BLOCK, found_inf)


def adamw8_range_torch(hp: dict, master, q1, q2, a1, a2, grad, step: torch.Tensor | None, key: torch.Tensor | None,
                       ctr: int, scale=None, grad_mul: float = 1.0, found_inf: torch.Tensor | None = None,
                       hyper: Hyper8 | None = None) -> None:
    """`adamw8_range` in torch ops, `CHUNK_BLOCKS` blocks at a time: the reference."""
    hyper = hyper or Hyper8(hp, scale, grad_mul, step, key)
    skip = None if found_inf is None else (found_inf != 0)
    numel = master.numel()
    full = numel // BLOCK
    for b0 in range(0, full, CHUNK_BLOCKS):
        b1 = min(full, b0 + CHUNK_BLOCKS)
        lo, hi = b0 * BLOCK, b1 * BLOCK
        _blocks(hyper, *(t[lo:hi].view(-1, BLOCK) for t in (master, q1, q2)), a1[b0:b1], a2[b0:b1],
                grad[lo:hi].view(-1, BLOCK), ctr + lo, skip)
    if numel > full * BLOCK:
        lo = full * BLOCK
        _blocks(hyper, *(t[lo:].view(1, -1) for t in (master, q1, q2)), a1[full:full + 1], a2[full:full + 1],
                grad[lo:].view(1, -1), ctr + lo, skip)
