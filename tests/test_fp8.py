"""The FP8 recipe (hf_slideformer/compute/fp8.py, triton_ops.reference's fp8 quantization): scales and values
against a float64 oracle, the FP8 linear's forward and gradients against the exact linear, and
the same far off when the scaling is broken on purpose."""
import math
import os

import pytest
import torch

from hf_slideformer.compute import fp8
from hf_slideformer.compute.fp8 import EmulatedFp8, Fp8Linear, QuantizedWeight, SharedInputs, fp8_linear, fp8_unsupported
from triton_ops import reference

SHAPES = [(5, 123), (37, 4099), (1, 16), (64, 48)]
# e4m3 keeps 3 mantissa bits: one rounding is within 2^-4 of a value, and a power-of-two scale
# leaves the row's largest value in [224, 448]. Each GEMM output then carries the quantization
# error of two operands summed over K random terms: relative Frobenius error ~ 2^-4 / sqrt(3) *
# sqrt(2) ~ 5%; the bound is that with a margin.
LINEAR_RTOL = 0.08


def oracle_rows(x: torch.Tensor):
    """float64 oracle of the row-wise recipe: scale = 2^floor(log2(448 / amax))."""
    xd = x.double()
    amax = xd.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    scale = torch.exp2(torch.floor(torch.log2(448.0 / amax)))
    return scale, (xd * scale).clamp(-448, 448)


@pytest.mark.parametrize("shape", SHAPES)
def test_row_scales_are_the_float64_powers_of_two(shape):
    torch.manual_seed(0)
    x = (torch.randn(*shape) * torch.logspace(-6, 3, shape[0])[:, None]).bfloat16()
    q, inv = reference.fp8_quantize_rows(x)
    scale, scaled = oracle_rows(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and inv.shape == (shape[0], 1)
    assert torch.equal(inv.double(), 1.0 / scale)                        # exact: powers of two
    # every value is the e4m3 neighbour of its scaled value: within half a step (2^-4 relative)
    err = (q.double() - scaled).abs()
    assert bool((err <= scaled.abs() * 2.0 ** -4 + 2.0 ** -10).all())
    amax = (q.double() * inv.double()).abs().amax(dim=-1)
    assert bool(((q.double().abs().amax(dim=-1) >= 224) | (x.double().abs().amax(dim=-1) == 0)).all()), amax


@pytest.mark.parametrize("shape", SHAPES)
def test_cols_t_is_the_rows_of_the_transpose_padded(shape):
    torch.manual_seed(1)
    x = torch.randn(*shape).bfloat16()
    q, inv = reference.fp8_quantize_cols_t(x, pad_to=16)
    qr, invr = reference.fp8_quantize_rows(x.t())
    rows = shape[0]
    assert q.shape == (shape[1], rows + (-rows % 16)) and q.is_contiguous()
    assert torch.equal(q[:, :rows].view(torch.uint8), qr.view(torch.uint8)) and torch.equal(inv, invr)
    assert not bool(q[:, rows:].float().any())


def test_cols_t_takes_the_column_maxima_it_is_given():
    torch.manual_seed(4)
    x = (torch.randn(40, 24) * torch.logspace(-3, 2, 24)).bfloat16()
    amax = x.float().abs().amax(0)
    q, inv = reference.fp8_quantize_cols_t(x, 16, amax)
    rq, rinv = reference.fp8_quantize_cols_t(x, 16)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(inv, rinv)
    # maxima off by a power of two give scales off by it: the given maxima are the ones used
    assert torch.equal(reference.fp8_quantize_cols_t(x, 16, amax * 2)[1], rinv * 2)
    (eq, einv), eamax = EmulatedFp8().quantize_rows_col_amax(x)
    assert torch.equal(eamax, amax) and torch.equal(einv, reference.fp8_quantize_rows(x)[1])


def test_zero_row_and_saturation():
    x = torch.zeros(2, 32)
    x[1, 0] = 3.0e38                          # near float32's largest: the scale is tiny, nothing overflows
    q, inv = reference.fp8_quantize_rows(x)
    assert not bool(q[0].float().any()) and math.isfinite(inv[0].item())
    assert q[1, 0].float().item() <= 448 and q[1, 0].float().item() >= 224


def _exact(x, w, b, gy):
    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
    y = torch.nn.functional.linear(xd, wd, bd)
    y.backward(gy.double())
    return [y.detach(), xd.grad, wd.grad, bd.grad]


def _fp8_run(x, w, b, gy, ops):
    xs, ws, bs = (t.detach().bfloat16().requires_grad_() for t in (x, w, b))
    y = fp8_linear(xs, ws, bs, ops=ops)
    y.backward(gy.bfloat16())
    return [y.detach(), xs.grad, ws.grad, bs.grad]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


class ScaleOfOne(EmulatedFp8):
    """The recipe with its scaling broken: every scale 1 (values cast as they are)."""

    def quantize_rows(self, x):
        q = x.float().clamp(-448, 448).to(torch.float8_e4m3fn)
        return q, torch.ones(x.shape[0], 1)

    def quantize_cols_t(self, x, amax=None):
        return self.quantize_rows(x.t().contiguous())


@pytest.mark.parametrize("shape", [(3, 7, 64, 48), (2, 5, 128, 32)])
def test_fp8_linear_forward_and_every_gradient(shape):
    b_, s_, k, n = shape
    torch.manual_seed(2)
    # small weights and gradients (below e4m3's smallest value, 2^-9, unless scaled), as in a trained layer
    x, w, bias = torch.randn(b_, s_, k), torch.randn(n, k) * 5e-4, torch.randn(n) * 1e-5
    gy = torch.randn(b_, s_, n) * 1e-4
    exact = _exact(x, w, bias, gy)
    good = _fp8_run(x, w, bias, gy, EmulatedFp8())
    broken = _fp8_run(x, w, bias, gy, ScaleOfOne())
    for name, e, g, bad in zip(("y", "dx", "dw", "db"), exact, good, broken):
        assert _rel(g, e) < LINEAR_RTOL, (name, _rel(g, e))
        if name != "db":               # the bias gradient is a sum in the compute dtype: no GEMM
            assert _rel(bad, e) > 0.5, (name, _rel(bad, e))


def test_gw_hp_recipe_keeps_the_weight_gradient_in_the_compute_dtype():
    """torchao's rowwise_with_gw_hp: the forward is rowwise's; dgrad multiplies dy's rows by the
    weight quantized with one scale (its largest |value|), within the recipe's error of the exact
    dx and bit for bit that oracle; wgrad is the compute dtype's dy^T x, the weight gradient a
    plain bf16 linear gives."""
    torch.manual_seed(4)
    ops = EmulatedFp8()
    x, w, gy = torch.randn(3, 7, 64), torch.randn(48, 64) * 5e-4, torch.randn(3, 7, 48) * 1e-4
    w[5, 3] = 4e-3                                  # one large entry: the tensor-wise scale is its
    exact = _exact(x, w, torch.zeros(48), gy)
    xs, ws = (t.bfloat16().requires_grad_() for t in (x, w))
    y = fp8_linear(xs, ws, ops=ops, hp_wgrad=True)
    assert torch.equal(y, fp8_linear(xs, ws, ops=ops))                     # the forward is rowwise's
    dx, dw = torch.autograd.grad(y, [xs, ws], gy.bfloat16())
    xb, wb = (t.bfloat16().requires_grad_() for t in (x, w))
    plain_dw = torch.autograd.grad(torch.nn.functional.linear(xb, wb), [wb], gy.bfloat16())[0]
    assert torch.equal(dw, plain_dw)
    assert _rel(dx, exact[1]) < LINEAR_RTOL and _rel(dw, exact[2]) < 0.01
    # dgrad's weight form: one power-of-two scale from the largest |w| (the oracle), every column alike
    q, inv = QuantizedWeight(ws, ops, tensorwise_dgrad=True).cols_t
    scale, values = oracle_rows(w.bfloat16().float().abs().amax().expand(1, 1))
    assert torch.all(inv == 1 / scale.float()) and inv.shape == (64, 1)
    g_rows = ops.quantize_rows(gy.bfloat16().reshape(-1, 48))
    assert torch.equal(dx.reshape(-1, 64), ops.mm(g_rows, (q, inv), torch.bfloat16, False))
    # the rowwise recipe's weight gradient is FP8's: farther from the exact one
    rowwise_dw = torch.autograd.grad(fp8_linear(xs, ws, ops=ops), [ws], gy.bfloat16())[0]
    assert _rel(rowwise_dw, exact[2]) > 3 * _rel(dw, exact[2])


def test_cached_weight_gives_the_same_result_and_output_free_forward():
    torch.manual_seed(3)
    ops = EmulatedFp8()
    x = torch.randn(4, 32).bfloat16().requires_grad_()
    w = (torch.randn(16, 32) * 0.1).bfloat16().requires_grad_()
    qw = QuantizedWeight(w, ops)
    y1 = Fp8Linear.apply(x, w, None, qw, ops, True)
    y2 = Fp8Linear.apply(x, w, None, None, ops, True)
    assert torch.equal(y1, y2)
    gy = torch.randn(4, 16).bfloat16()
    g1 = torch.autograd.grad(y1, [x, w], gy)
    z = Fp8Linear.apply(x, w, None, qw, ops, False)            # output-free: zeros, same backward
    assert not bool(z.any())
    g2 = torch.autograd.grad(z, [x, w], gy)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


def test_shared_inputs_quantize_once_and_follow_in_place_writes():
    calls = []

    class Counting(EmulatedFp8):
        def quantize_rows(self, x):
            calls.append("rows")
            return super().quantize_rows(x)

    ops = Counting()
    shared = SharedInputs(ops)
    x = torch.randn(2, 3, 32).bfloat16().requires_grad_()
    ws = [(torch.randn(16, 32) * 0.1).bfloat16().requires_grad_() for _ in range(3)]
    ys = [Fp8Linear.apply(x, w, None, QuantizedWeight(w, ops), ops, True, shared) for w in ws]
    assert calls.count("rows") == 3 + 1                      # one per weight, one for the shared input
    alone = [Fp8Linear.apply(x, w, None, None, EmulatedFp8(), True) for w in ws]
    assert all(torch.equal(a, b) for a, b in zip(ys, alone))
    assert len(shared.entries) == 1
    ga = torch.autograd.grad(sum(y.float().sum() for y in ys), [x, *ws])
    gb = torch.autograd.grad(sum(y.float().sum() for y in alone), [x, *ws])
    assert all(torch.equal(a, b) for a, b in zip(ga, gb))
    assert not shared.entries                                 # the last reader's backward dropped x's forms


def test_a_shared_entry_lives_until_its_last_reader_ran_backward():
    ops = EmulatedFp8()
    shared = SharedInputs(ops)
    x = torch.randn(6, 32).bfloat16().requires_grad_()
    w1, w2 = ((torch.randn(16, 32) * 0.1).bfloat16().requires_grad_() for _ in range(2))
    y1 = Fp8Linear.apply(x, w1, None, None, ops, True, shared)
    y2 = Fp8Linear.apply(x, w2, None, None, ops, True, shared)
    y1.float().sum().backward()
    assert shared.entries[id(x)][3] is not None               # the wgrad form, for y2's backward
    y2.float().sum().backward()
    assert not shared.entries
    first = shared.rows(x)
    with torch.no_grad():
        x.mul_(2)                                             # written in place: quantized again
    assert shared.rows(x) is not first


def test_unsupported_names_the_requirement(monkeypatch):
    assert "capability 8.9" in fp8_unsupported(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100")
    msg = fp8_unsupported(torch.device("cuda", 0))
    assert "8.9" in msg and "A100" in msg and "8.0" in msg
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert fp8_unsupported(torch.device("cuda", 0)) is None
    monkeypatch.delattr(torch, "_scaled_mm")
    assert "torch._scaled_mm" in fp8_unsupported(torch.device("cuda", 0))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the kernels on CPU need Triton's interpreter")
def test_kernel_scales_under_the_interpreter():
    # Triton 3.9's interpreter casts to e4m3 by another rounding than the GPU; the scales and the
    # layout are held here, the values bit for bit on the GPU (tests/test_fp8_gpu.py).
    from triton_ops.kernels import fp8_quant as k
    for shape in ((37, 409), (3, 20000)):          # one pass; two passes over a row longer than 16384
        x = torch.randn(*shape).bfloat16()
        assert torch.equal(k.fp8_quantize_rows(x)[1], reference.fp8_quantize_rows(x)[1])
    x = torch.randn(37, 409).bfloat16()
    q, inv = k.fp8_quantize_cols_t(x, 16)
    assert q.shape == (409, 48) and torch.equal(inv, reference.fp8_quantize_cols_t(x, 16)[1])


def test_recipe_constants():
    assert reference.E4M3_MAX == torch.finfo(torch.float8_e4m3fn).max
    assert fp8.GEMM_ALIGN == 16
