"""FP8 on CUDA (capability 8.9+): the Triton quantization kernels bit for bit against the reference,
the RMSNorm / SwiGLU kernels that write FP8 rows bit for bit against the unfused path and the
reference, the FP8 linear through torch._scaled_mm against the emulation and the exact linear, a
slid model in FP8 against bf16 and against itself without the fused producers, and the
slowed-stream test with the mode on."""
import copy
import math

import pytest
import torch

import hf_slideformer as hs
from hf_slideformer.compute.fp8 import CudaFp8, EmulatedFp8, fp8_linear, fp8_unsupported
from triton_ops import reference
from test_engine_gpu import HOST_ONLY, _pair, _train_state
from test_fp8 import LINEAR_RTOL, _exact, _rel
from test_fp8_kernels import (FUSED_NORM_SHAPES, FUSED_SWIGLU_SHAPES, ROWS_COL_AMAX_SHAPES, check_fused_rms_norm_rows,
                             check_fused_swiglu_rows, check_rows_col_amax)
from helpers import batches

pytestmark = [pytest.mark.gpu]


def _need_fp8():
    if not torch.cuda.is_available() or fp8_unsupported(torch.device("cuda")):
        pytest.skip("needs a CUDA GPU of compute capability 8.9+")


@pytest.mark.parametrize("shape", [(5, 123), (37, 4099), (2048, 4096), (111, 704)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernels_bit_equal_to_the_reference(shape, dtype):
    _need_fp8()
    from triton_ops.kernels import fp8_quant as k
    torch.manual_seed(0)
    x = (torch.randn(*shape, device="cuda") * torch.logspace(-5, 3, shape[0], device="cuda")[:, None]).to(dtype)
    x[0, :7] = 0
    for kernel, ref in ((k.fp8_quantize_rows, reference.fp8_quantize_rows),
                        (lambda t: k.fp8_quantize_cols_t(t, 16), lambda t: reference.fp8_quantize_cols_t(t, 16))):
        (q, inv), (rq, rinv) = kernel(x), ref(x)
        assert q.shape == rq.shape and q.is_contiguous()
        assert torch.equal(inv, rinv)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), int((q.view(torch.uint8) != rq.view(torch.uint8)).sum())


@pytest.mark.parametrize("shape", ROWS_COL_AMAX_SHAPES + [(32768, 4096), (4099, 14336)])
def test_rows_col_amax_bit_equal_on_cuda(shape):
    _need_fp8()
    check_rows_col_amax("cuda", shape, exact_reference=True)


@pytest.mark.parametrize("shape", FUSED_NORM_SHAPES + [(2, 2048, 4096)])
def test_rms_norm_rows_bit_equal_on_cuda(shape):
    _need_fp8()
    check_fused_rms_norm_rows("cuda", shape, torch.bfloat16, exact_reference=True)


@pytest.mark.parametrize("shape", FUSED_SWIGLU_SHAPES + [(2, 1024, 14336), (3, 8192)])
def test_swiglu_rows_bit_equal_on_cuda(shape):
    _need_fp8()
    check_fused_swiglu_rows("cuda", shape, torch.bfloat16, exact_reference=True)


def test_fused_producers_train_bit_identical_to_the_unfused_path():
    _need_fp8()
    from hf_slideformer.compute.layer_matmuls import Fp8Matmuls
    data = batches(3, bsz=2, seq=96, vocab=1001)
    states = []
    for fused in (True, False):
        _, slid = _pair(torch.bfloat16, matmuls="fp8", **HOST_ONLY)
        engine = slid.slide_engine
        engine.matmuls = Fp8Matmuls(engine.layers, CudaFp8(), fused=fused)
        assert bool(engine.matmuls.producers[0]) == fused      # the layers run the project's kernels
        opt = slid.create_optimizer(lr=1e-3)
        losses = []
        for b in data:
            loss = slid(**{key: v.cuda() for key, v in b.items()}).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        states.append((losses, {k: v.detach().float().cpu() for k, v in slid.state_dict().items()}))
    (la, sa), (lb, sb) = states
    assert la == lb
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("hp_wgrad", [False, True])
@pytest.mark.parametrize("lead, k, n", [((3, 37), 256, 704), ((2, 2048), 4096, 1024)])
def test_fp8_linear_on_cuda(lead, k, n, hp_wgrad):
    _need_fp8()
    torch.manual_seed(1)
    x = torch.randn(*lead, k, device="cuda")
    w, b = torch.randn(n, k, device="cuda") * 0.02, torch.randn(n, device="cuda") * 0.02
    gy = torch.randn(*lead, n, device="cuda") * 1e-4
    exact = _exact(x, w, b, gy)
    runs = []
    for ops in (CudaFp8(), EmulatedFp8()):
        xs, ws, bs = (t.detach().bfloat16().requires_grad_() for t in (x, w, b))
        y = fp8_linear(xs, ws, bs, ops=ops, hp_wgrad=hp_wgrad)
        y.backward(gy.bfloat16())
        runs.append([y.detach(), xs.grad, ws.grad, bs.grad])
    for name, e, c, m in zip(("y", "dx", "dw", "db"), exact, *runs):
        assert _rel(c, e) < LINEAR_RTOL, (name, _rel(c, e))
        # the same quantized operands; only the GEMM's accumulation order and the bf16 rounding differ
        assert _rel(c, m) < 1e-2, (name, _rel(c, m))


def test_slid_model_in_fp8_trains_close_to_bf16():
    _need_fp8()
    data = batches(4, bsz=4, seq=128, vocab=1001)
    losses = {}
    for mode in ("dtype", "fp8", "fp8_gw_hp"):
        _, slid = _pair(torch.bfloat16, matmuls=mode)
        opt = slid.create_optimizer(lr=1e-3)
        out = []
        for b in data:
            loss = slid(**{key: v.cuda() for key, v in b.items()}).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        losses[mode] = out
        if mode != "dtype":
            assert slid.slide_config.matmuls == mode and slid.slide_engine.matmuls.cache
    assert losses["dtype"] != losses["fp8"] and losses["fp8"] != losses["fp8_gw_hp"]
    for mode in ("fp8", "fp8_gw_hp"):
        for a, b in zip(losses["dtype"], losses[mode]):
            assert math.isclose(a, b, rel_tol=0.02), (mode, losses)


@pytest.mark.parametrize("kw", [HOST_ONLY, {"resident_layers": 2}, {"window": 3}])
def test_slow_streams_bit_identical_in_fp8(kw):
    # [Why FP8 weights are cached by the slot's fill]: a stale cache entry read after a refill, or a
    # quantization racing the slot's copy, changes the result under slowed streams.
    _need_fp8()
    fast = _train_state(False, matmuls="fp8", **kw)
    slow = _train_state(True, matmuls="fp8", **kw)
    for key in fast:
        assert torch.equal(fast[key], slow[key]), key
