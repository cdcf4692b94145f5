"""FP8 linear layers: torchao's float8 "rowwise" recipe as one autograd Function.

Every GEMM of a linear layer (forward y = x W^T, dgrad dx = dy W, wgrad dW = dy^T x) quantizes
both of its operands to e4m3 with one power-of-two scale per row of its reduction dimension
(`triton_ops.reference.fp8_scales`) and multiplies them with `torch._scaled_mm`, accumulating in
float32 and writing the compute dtype. As torchao's recipe: every operand is quantized from the
high-precision tensor, along the GEMM's own reduction dimension (so the weight has one form for
the forward, scaled per output feature, and one for dgrad, scaled per input feature; the
gradient and the input one for wgrad, scaled per feature over the tokens); the forward GEMM uses
fast accumulation, the two gradient GEMMs do not.

torchao's "rowwise_with_gw_hp" recipe (`SlideConfig.matmuls='fp8_gw_hp'`) keeps the forward and
changes the backward: dgrad multiplies the row-wise e4m3 gradient by the weight quantized with one
scale for the whole tensor (tensor-wise), and wgrad runs in the compute dtype from the unquantized
gradient and input, so the weight gradient that AdamW reads carries no FP8 error (and wgrad runs
at the bf16 rate).

Two implementations of the primitives (quantize rows, quantize rows and take the column maxima in
the same read, quantize columns transposed, scaled GEMM), chosen once: `CudaFp8` (the Triton kernels of `triton_ops.kernels.fp8_quant` and
`torch._scaled_mm`) and `EmulatedFp8` (the pure-torch reference, and a scaled GEMM emulated as
dequantize + float32 matmul), which runs anywhere and is how the CPU tests exercise the logic.
"""
from __future__ import annotations

import torch

from triton_ops import reference

__all__ = ["Fp8Ops", "CudaFp8", "EmulatedFp8", "QuantizedWeight", "SharedInputs", "Fp8Linear", "fp8_linear", "fp8_unsupported",
           "tensorwise_cols_t", "GEMM_ALIGN"]

GEMM_ALIGN = 16          # torch._scaled_mm needs every dimension of its operands a multiple of 16 bytes


class Fp8Ops:
    """The primitives of the recipe (see the module docstring)."""

    def quantize_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (M, K) -> (q (M, K) e4m3, inverse scales (M, 1) float32)."""
        raise NotImplementedError

    def quantize_cols_t(self, x: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x (R, C) -> (q (C, R padded to GEMM_ALIGN) e4m3, inverse scales (C, 1) float32); `amax`:
        x's column maxima of |x| (C,) float32 when already known (exactly those)."""
        raise NotImplementedError

    def quantize_rows_col_amax(self, x: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        """x (M, K) -> (`quantize_rows(x)`, x's column maxima (K,) float32), from one read where the
        kernels can (an output gradient, whose columns are quantized next for wgrad)."""
        raise NotImplementedError

    def mm(self, a: tuple, b_t: tuple, out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
        """a = (q (M, K), inv (M, 1)), b_t = (q (N, K), inv (N, 1)): (M, N) = a @ b_t^T, dequantized."""
        raise NotImplementedError


class EmulatedFp8(Fp8Ops):
    """The reference: quantization in torch ops, the scaled GEMM as dequantize + float32 matmul."""

    def quantize_rows(self, x):
        return reference.fp8_quantize_rows(x)

    def quantize_cols_t(self, x, amax=None):
        return reference.fp8_quantize_cols_t(x, GEMM_ALIGN, amax)

    def quantize_rows_col_amax(self, x):
        return self.quantize_rows(x), x.detach().float().abs().amax(0)

    def mm(self, a, b_t, out_dtype, fast_accum):
        (qa, sa), (qb, sb) = a, b_t
        return ((qa.float() * sa) @ (qb.float() * sb).t()).to(out_dtype)


class CudaFp8(Fp8Ops):
    """The Triton quantization kernels and `torch._scaled_mm` (CUDA capability 8.9 or newer)."""

    def quantize_rows(self, x):
        from triton_ops.kernels.fp8_quant import fp8_quantize_rows
        return fp8_quantize_rows(x)

    def quantize_cols_t(self, x, amax=None):
        from triton_ops.kernels.fp8_quant import fp8_quantize_cols_t
        return fp8_quantize_cols_t(x, GEMM_ALIGN, amax)

    def quantize_rows_col_amax(self, x):
        from triton_ops.kernels.fp8_quant import fp8_quantize_rows_col_amax
        return fp8_quantize_rows_col_amax(x)

    def mm(self, a, b_t, out_dtype, fast_accum):
        (qa, sa), (qb, sb) = a, b_t
        return torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb.t(), out_dtype=out_dtype,
                                use_fast_accum=fast_accum)


class QuantizedWeight:
    """A weight W (N, K) in its two FP8 forms: `rows` for the forward (scaled per output feature)
    and `cols_t` for dgrad (W^T (K, N), scaled per input feature, or with one scale for the whole
    weight where `tensorwise_dgrad`: the gw_hp recipe's). Each is made on first use and
    can be dropped once its last reader ran (`drop_rows` after the recompute, `drop_cols_t` after
    the backward): a dropped form is made again if it is read again, so dropping is never wrong,
    and the forms of a slot's weights hold GPU memory only while they serve."""

    def __init__(self, weight: torch.Tensor, ops: Fp8Ops, tensorwise_dgrad: bool = False):
        self.weight, self.ops, self.tensorwise_dgrad = weight.detach(), ops, tensorwise_dgrad
        self._rows = self._cols_t = None

    @property
    def rows(self) -> tuple:
        if self._rows is None:
            self._rows = self.ops.quantize_rows(self.weight)
        return self._rows

    @property
    def cols_t(self) -> tuple:
        if self._cols_t is None:
            self._cols_t = (tensorwise_cols_t(self.ops, self.weight) if self.tensorwise_dgrad
                            else self.ops.quantize_cols_t(self.weight))
        return self._cols_t

    def drop_rows(self) -> None:
        self._rows = None

    def drop_cols_t(self) -> None:
        self._cols_t = None


def tensorwise_cols_t(ops: Fp8Ops, weight: torch.Tensor) -> tuple:
    """`weight` (N, K) transposed and quantized with one scale, its largest |value| (torchao's
    tensor-wise cast): every column's scale made from the same maximum."""
    amax = weight.abs().amax().float().expand(weight.shape[1]).contiguous()
    return ops.quantize_cols_t(weight, amax)


class SharedInputs:
    """The FP8 forms of the inputs that several projections of one layer call read (q, k and v the
    same normed hidden states, gate and up the same): each is quantized once per form.

    It is also the hand-off of an activation that arrives already quantized: the kernel that
    produced it (the fused RMSNorm / SwiGLU, `triton_ops.rms_norm_rows` / `swiglu_rows`) `provide`s
    its per-token form, and the projections that read it skip their own quantization pass.

    An entry holds its tensor, so that the tensor's id is not reused while the entry lives, and
    its version: a tensor written in place since is quantized again. It counts its readers (each
    projection call that reads the tensor, `hold`) and is dropped when the last of them has run
    its backward (`release`): the tensor and its wgrad form then live no longer than autograd
    keeps the tensor itself.
    """

    def __init__(self, ops: Fp8Ops):
        self.ops = ops
        self.entries: dict[int, list] = {}

    def _entry(self, x: torch.Tensor) -> list:
        entry = self.entries.get(id(x))
        if entry is None or entry[0] is not x or entry[1] != x._version:
            entry = self.entries[id(x)] = [x, x._version, None, None,
                                           entry[4] if entry is not None and entry[0] is x else 0]
        return entry

    def provide(self, x: torch.Tensor, rows: tuple) -> None:
        """Take x's per-token form (q (M, K) e4m3, inverse scales (M, 1) float32, M = x.numel() // K)
        from the kernel that wrote x; it must equal `ops.quantize_rows` of x bit for bit."""
        self._entry(x)[2] = rows

    def hold(self, x: torch.Tensor) -> None:
        """A projection call that reads x (and will `release` it after its backward)."""
        self._entry(x)[4] += 1

    def release(self, x: torch.Tensor) -> None:
        """That call's backward has run: with its last reader, x's entry goes."""
        entry = self.entries.get(id(x))
        if entry is not None and entry[0] is x:
            entry[4] -= 1
            if entry[4] <= 0:
                del self.entries[id(x)]

    def rows(self, x: torch.Tensor) -> tuple:
        """x (..., K) quantized per token (the forward's first operand)."""
        entry = self._entry(x)
        if entry[2] is None:
            entry[2] = self.ops.quantize_rows(x.detach().reshape(-1, x.shape[-1]))
        return entry[2]

    def drop_rows(self) -> None:
        """Free the per-token forms once the layer's forward has run (only wgrad's are read later)."""
        for entry in self.entries.values():
            entry[2] = None

    def cols_t(self, x: torch.Tensor) -> tuple:
        """x (..., K) quantized per feature over the tokens, transposed (wgrad's second operand)."""
        entry = self._entry(x)
        if entry[3] is None:
            entry[3] = self.ops.quantize_cols_t(x.detach().reshape(-1, x.shape[-1]))
        return entry[3]


class Fp8Linear(torch.autograd.Function):
    """y = x W^T + b with every GEMM in FP8 (the recipe above).

    Args of `apply`: x (..., K), weight (N, K), bias (N,) or None, `QuantizedWeight` of the weight
    or None (quantized here), the `Fp8Ops`, `output`: False returns zeros of the output's shape
    without the forward GEMM (the engine's recompute of a layer's last projection, whose product
    nothing reads: docs/engine.md) while the backward is the same, a `SharedInputs` (or
    None) that the projections reading the same input share, and `hp_wgrad`: the
    "rowwise_with_gw_hp" backward (a tensor-wise weight for dgrad, wgrad in the compute dtype).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, qweight, ops, output, shared=None, hp_wgrad=False):
        shared = shared if shared is not None else SharedInputs(ops)
        ctx.save_for_backward(weight)
        ctx.x, ctx.shared = x, shared       # x is an input, never this node's output: no reference cycle
        ctx.ops, ctx.qweight, ctx.has_bias, ctx.hp_wgrad = ops, qweight, bias is not None, hp_wgrad
        shared.hold(x)
        lead, out_features = x.shape[:-1], weight.shape[0]
        if not output:
            return x.new_zeros(*lead, out_features)
        w_rows = qweight.rows if qweight is not None else ops.quantize_rows(weight.detach())
        y = ops.mm(shared.rows(x), w_rows, x.dtype, fast_accum=True)
        if bias is not None:
            y = y + bias
        return y.view(*lead, out_features)

    @staticmethod
    def backward(ctx, gy):
        (weight,), x = ctx.saved_tensors, ctx.x
        ops = ctx.ops
        g2 = gy.reshape(-1, gy.shape[-1])                        # (M, N)
        if g2.stride(-1) != 1:
            g2 = g2.contiguous()                                 # once, for both of its forms
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gx = gw = gb = g_amax = None
        fp8_wgrad = need_dw and not ctx.hp_wgrad
        if need_dx:
            # With an FP8 wgrad to follow, the read that quantizes dy's rows also takes its column maxima.
            g_rows, g_amax = ops.quantize_rows_col_amax(g2) if fp8_wgrad else (ops.quantize_rows(g2), None)
            qweight = ctx.qweight if ctx.qweight is not None else QuantizedWeight(weight, ops, ctx.hp_wgrad)
            w_cols = qweight.cols_t
            gx = ops.mm(g_rows, w_cols, gy.dtype, fast_accum=False)     # (M, K)
            gx = gx.view(*gy.shape[:-1], weight.shape[1])
            del g_rows, w_cols, qweight
            if ctx.qweight is not None:
                ctx.qweight.drop_cols_t()          # one backward per fill reads it (made again if not)
        if fp8_wgrad:
            # dW (N, K) = dy^T x: both reduced over the tokens, so both quantized along them.
            gw = ops.mm(ops.quantize_cols_t(g2, g_amax), ctx.shared.cols_t(x), weight.dtype, fast_accum=False)
        elif need_dw:
            gw = torch.mm(g2.t(), x.detach().reshape(-1, x.shape[-1]).to(g2.dtype)).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        ctx.shared.release(x)
        ctx.qweight = ctx.x = ctx.shared = None
        return gx, gw, gb, None, None, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               ops: Fp8Ops | None = None, qweight: QuantizedWeight | None = None, hp_wgrad: bool = False) -> torch.Tensor:
    """`F.linear` in FP8 (`Fp8Linear`; `hp_wgrad`: the "rowwise_with_gw_hp" backward); `ops` defaults
    to `CudaFp8` on CUDA, `EmulatedFp8` elsewhere."""
    if ops is None:
        ops = CudaFp8() if x.is_cuda else EmulatedFp8()
    return Fp8Linear.apply(x, weight, bias, qweight, ops, True, None, hp_wgrad)


def fp8_unsupported(device: torch.device) -> str | None:
    """Why FP8 GEMMs cannot run on `device` (a sentence naming the requirement), or None when they can."""
    device = torch.device(device)
    if not (hasattr(torch, "_scaled_mm") and hasattr(torch, "float8_e4m3fn")):
        return (f"torch {torch.__version__} lacks torch._scaled_mm or torch.float8_e4m3fn: FP8 needs torch 2.4 or "
                "newer (2.5+ for row-wise scales)")
    if device.type != "cuda":
        return (f"FP8 GEMMs need a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); the "
                f"device is {device}")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        return (f"FP8 GEMMs need a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); {name} "
                f"is {major}.{minor}")
    from triton_ops import is_triton_available
    if not is_triton_available():
        return "FP8 mode quantizes with Triton kernels: install triton"
    return None
