"""Every Triton kernel of `triton_ops` against `triton_ops.reference`: forward and every gradient.

Where the kernels run:
- on CUDA, in this process (odd shapes here, real shapes in the `gpu` tests at the end);
- on CPU, through Triton's interpreter. TRITON_INTERPRET must be set before Triton is first
  imported, and other test modules import it earlier, so `test_kernels_under_interpreter` runs
  the kernel tests (`-k kernel`) of this file and of test_triton_patching.py in a child pytest
  with the variable set.
The oracle runs in float64 on the same (already rounded) inputs. Tolerances are relative to the
largest reference magnitude: float32 1e-5, bfloat16 2e-2 (a few bf16 ulps, 2**-7 = 7.8e-3 each).
"""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

import triton_ops
from triton_ops import reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ON_GPU = torch.cuda.is_available()
KERNEL_DEVICE = "cuda" if ON_GPU else ("cpu" if INTERPRET and triton_ops.is_triton_available() else None)
needs_kernels = pytest.mark.skipif(KERNEL_DEVICE is None,
                                   reason="kernels run on CUDA, or on CPU under TRITON_INTERPRET=1 (child run)")
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str, scale: float = 1.0):
    """max |actual - expected| <= tol(dtype) * scale * max |expected|."""
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = (actual - expected).abs().max().item()
    ref = expected.abs().max().item()
    assert err <= TOL[dtype] * scale * max(ref, 1e-12), f"{what}: max error {err:.3e} vs max |ref| {ref:.3e}"


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _fp64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float64).requires_grad_(True)


# ---------------------------------------------------------------- linear cross-entropy

LCE_OPTIONS = [
    {},
    {"softcap": 5.0},
    {"z_loss": 1e-3},
    {"reduction": "sum"},
    {"num_items_in_batch": 77},
    {"num_items_in_batch": "tensor"},
    {"softcap": 3.0, "z_loss": 1e-2, "chunk_tokens": None},
    {"token_weights": "tensor"},
    {"token_weights": "tensor", "softcap": 4.0},
]


def _lce_inputs(T, H, V, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(device, dtype)
    weight = (torch.randn(V, H, generator=g) / H ** 0.5 * 4).to(device, dtype)
    labels = torch.randint(0, V, (T,), generator=g)
    labels[::7] = -100
    labels[40:80] = -100                      # with chunk_tokens=40: one chunk entirely ignored
    return hidden, weight, labels.to(device)


def _check_lce(hidden, weight, labels, dtype, kwargs, grad_scale=1.0):
    h, w = _leaf(hidden), _leaf(weight)
    loss = triton_ops.linear_cross_entropy(h, w, labels, **kwargs)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    (loss * grad_scale).backward()
    hr, wr = _fp64(hidden), _fp64(weight)
    ref_kwargs = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in kwargs.items() if k != "chunk_tokens"}
    ref = reference.linear_cross_entropy(hr, wr, labels.cpu(), **ref_kwargs)
    (ref * grad_scale).backward()
    assert_close(loss, ref, dtype, "loss", scale=0.25)
    assert_close(h.grad, hr.grad, dtype, "d hidden")
    assert_close(w.grad, wr.grad, dtype, "d weight")


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("options", LCE_OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "mean")
def test_linear_cross_entropy_kernel_odd_shapes(dtype, options):
    hidden, weight, labels = _lce_inputs(123, 257, 1001, dtype, KERNEL_DEVICE)
    kwargs = {"chunk_tokens": 40, **options}
    if kwargs.get("num_items_in_batch") == "tensor":
        kwargs["num_items_in_batch"] = torch.tensor(91, device=KERNEL_DEVICE)
    if kwargs.get("token_weights") == "tensor":      # signed, as a per-sequence DPO weight can be
        kwargs["token_weights"] = torch.randn(123, generator=torch.Generator().manual_seed(3)).to(KERNEL_DEVICE)
    _check_lce(hidden, weight, labels, dtype, kwargs)


@needs_kernels
def test_linear_cross_entropy_kernel_scales_by_incoming_gradient_and_skips_frozen_weight():
    hidden, weight, labels = _lce_inputs(67, 33, 129, torch.float32, KERNEL_DEVICE, seed=1)
    _check_lce(hidden, weight, labels, torch.float32, {"chunk_tokens": 16}, grad_scale=3.0)
    h = _leaf(hidden)
    triton_ops.linear_cross_entropy(h, weight, labels, chunk_tokens=16).backward()
    hr = _fp64(hidden)
    reference.linear_cross_entropy(hr, weight.double().cpu(), labels.cpu()).backward()
    assert_close(h.grad, hr.grad, torch.float32, "d hidden, frozen weight")


@needs_kernels
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy_kernel_all_ignored(reduction):
    hidden, weight, labels = _lce_inputs(50, 32, 77, torch.float32, KERNEL_DEVICE)
    labels = torch.full_like(labels, -100)
    h, w = _leaf(hidden), _leaf(weight)
    loss = triton_ops.linear_cross_entropy(h, w, labels, reduction=reduction, chunk_tokens=16)
    loss.backward()
    # As F.cross_entropy: the mean over no tokens is NaN, the sum is 0; no gradient either way.
    assert torch.isnan(loss).item() if reduction == "mean" else loss.item() == 0.0
    assert torch.count_nonzero(h.grad).item() == 0 and torch.count_nonzero(w.grad).item() == 0


@needs_kernels
def test_cross_entropy_kernel_rounds_its_bf16_gradient_to_nearest():
    # The GPU rounds fp32 -> bf16 to nearest-even; Triton's interpreter truncates, so the kernel
    # rounds on the bits there (cast_rne). Either way the stored gradient is torch's rounding of
    # the fp32 gradient (truncation would match about half of the entries).
    from triton_ops.kernels.cross_entropy import cross_entropy_rows_

    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(6, 999, generator=g) * 3).to(KERNEL_DEVICE, torch.bfloat16)
    labels = torch.tensor([0, 5, 998, 17, 400, 3], device=KERNEL_DEVICE)
    grad = logits.clone()
    loss = torch.empty(6, device=KERNEL_DEVICE)
    cross_entropy_rows_(grad, labels, loss, torch.full((1,), 0.25, device=KERNEL_DEVICE))
    x = logits.float()
    expect = (torch.softmax(x, -1) - torch.nn.functional.one_hot(labels, 999)) * 0.25
    same = (grad == expect.to(torch.bfloat16)).float().mean().item()
    assert same > 0.98, f"only {same:.1%} of the bf16 gradient matches round-to-nearest"


def _triton_gemms_usable() -> bool:
    if KERNEL_DEVICE == "cuda":
        return torch.cuda.get_device_capability()[0] >= 9
    return KERNEL_DEVICE == "cpu"


needs_triton_gemms = pytest.mark.skipif(not _triton_gemms_usable(),
                                        reason="the experimental TMA GEMMs need Hopper or newer, or the interpreter")


@needs_kernels
@needs_triton_gemms
@pytest.mark.parametrize("a_transposed", [True, False])
def test_lce_triton_gemms_against_torch(a_transposed):
    # The loss head's experimental GEMMs (benchmarks/experiments/lce_triton_gemms.py, measured against cuBLAS
    # in docs/benchmarks.md): kept correct so that the measurement can be repeated.
    from benchmarks.experiments.lce_triton_gemms import GemmConfig, accumulate_dw_, project_

    g = torch.Generator().manual_seed(3)
    C, H, V = 72, 48, 200                                     # tails in every dimension for 32x64x16 tiles
    cfg = GemmConfig(32, 64, 16, 2, 4)
    dev, dt = KERNEL_DEVICE, torch.bfloat16
    h = torch.randn(C, H, generator=g).to(dev, dt)
    w = torch.randn(V, H, generator=g).to(dev, dt)
    out = torch.full((C, V + 8), 7.0, device=dev, dtype=dt)  # padded rows: the pad must stay untouched
    project_(h, w, out[:, :V], cfg)
    assert_close(out[:, :V], h.double() @ w.double().t(), dt, "projection")
    assert bool((out[:, V:] == 7).all()), "the projection wrote past its columns"
    outT = torch.empty(V, C, device=dev, dtype=dt)
    project_(w, h, outT, cfg, m_fastest=False)
    assert_close(outT, w.double() @ h.double().t(), dt, "projection, transposed, column tiles fastest")
    grad = (torch.randn(C, V, generator=g) * 0.1).to(dev, dt)
    a = grad if a_transposed else grad.t().contiguous()
    dw = torch.randn(V, H, generator=g).to(dev, dt)
    first = grad.double().t() @ h.double()
    accumulate_dw_(a, h, dw, accumulate=False, config=cfg, a_transposed=a_transposed)
    assert_close(dw, first, dt, "dW, first chunk")
    for reduce in (True, False):
        before = dw.clone()
        accumulate_dw_(a, h, dw, accumulate=True, config=cfg, a_transposed=a_transposed, reduce=reduce)
        assert_close(dw, before.double() + first, dt, f"dW += (reduce={reduce})")


def test_linear_cross_entropy_dispatch_keeps_reference_signature():
    assert inspect.signature(triton_ops.linear_cross_entropy) == inspect.signature(reference.linear_cross_entropy)
    if triton_ops.is_triton_available():
        from triton_ops.kernels import linear_cross_entropy as fused
        assert inspect.signature(fused) == inspect.signature(reference.linear_cross_entropy)


def test_linear_cross_entropy_reference_matches_materialized_logits():
    hidden, weight, labels = _lce_inputs(45, 16, 60, torch.float64, "cpu")
    for kwargs, expect in (
        ({}, lambda lg: torch.nn.functional.cross_entropy(lg, labels)),
        ({"reduction": "sum"}, lambda lg: torch.nn.functional.cross_entropy(lg, labels, reduction="sum")),
        ({"num_items_in_batch": 50}, lambda lg: torch.nn.functional.cross_entropy(lg, labels, reduction="sum") / 50),
    ):
        h, w = _leaf(hidden), _leaf(weight)
        loss = reference.linear_cross_entropy(h, w, labels, chunk_tokens=8, **kwargs)
        loss.backward()
        h2, w2 = _leaf(hidden), _leaf(weight)
        ref = expect(h2 @ w2.t())
        ref.backward()
        torch.testing.assert_close(loss, ref.float(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(h.grad, h2.grad)
        torch.testing.assert_close(w.grad, w2.grad)


def test_token_weights_give_the_gradient_of_a_weighted_token_loss():
    """With w, the loss is sum_t w_t CE_t: its gradients are those of any loss L(log p) with w = -dL/dlog p."""
    hidden, weight, labels = _lce_inputs(45, 16, 60, torch.float64, "cpu")
    w_tok = torch.randn(45, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    h, w = _leaf(hidden), _leaf(weight)
    reference.linear_cross_entropy(h, w, labels, chunk_tokens=8, token_weights=w_tok).backward()
    h2, w2 = _leaf(hidden), _leaf(weight)
    ce = torch.nn.functional.cross_entropy(h2 @ w2.t(), labels, reduction="none")     # 0 where ignored
    (w_tok * ce).sum().backward()
    torch.testing.assert_close(h.grad, h2.grad)
    torch.testing.assert_close(w.grad, w2.grad)
    h3 = _leaf(hidden)                               # and not the unweighted mean's
    reference.linear_cross_entropy(h3, weight, labels, chunk_tokens=8).backward()
    assert not torch.allclose(h3.grad, h2.grad)


def test_token_statistics_match_materialized_logits():
    hidden, weight, labels = _lce_inputs(45, 16, 60, torch.float64, "cpu")
    log_probs, entropy, is_top1, mean_logits, log_sum_sq = triton_ops.token_statistics(hidden, weight, labels,
                                                                                       chunk_tokens=8)
    logits = hidden @ weight.t()
    lsm = torch.log_softmax(logits, -1)
    valid = labels != -100
    safe = labels.clamp(min=0)
    torch.testing.assert_close(log_probs.double(), torch.where(valid, lsm.gather(1, safe[:, None])[:, 0], 0.0))
    torch.testing.assert_close(entropy.double(), torch.where(valid, -(lsm.exp() * lsm).sum(-1), 0.0))
    assert torch.equal(is_top1, valid & (lsm.argmax(-1) == labels))
    torch.testing.assert_close(mean_logits.double(), torch.where(valid, logits.mean(-1), 0.0))
    torch.testing.assert_close(log_sum_sq.double(), torch.where(valid, (lsm.exp() ** 2).sum(-1).log(), 0.0))
    assert not log_probs.requires_grad


def test_default_chunk_tokens_follows_the_hidden_state_budget():
    if not triton_ops.is_triton_available():
        pytest.skip("needs triton")
    from triton_ops.kernels import default_chunk_tokens
    # Llama-3 head, 16384 tokens: a (C, V) bf16 buffer as large as the (T, H) input -> 512 rows.
    assert default_chunk_tokens(16384, 4096, 128256, torch.bfloat16) == 512
    assert default_chunk_tokens(100, 64, 1000, torch.float32) == 100
    assert default_chunk_tokens(2048, 4096, 128256, torch.bfloat16) % 64 == 0


# ---------------------------------------------------------------- rms_norm, rope, swiglu

@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 41, 257), (5, 7, 4, 128), (2, 1000)])
@pytest.mark.parametrize("in_place", [False, True])
def test_rms_norm_kernel(dtype, shape, in_place):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(shape, generator=g).to(KERNEL_DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(KERNEL_DEVICE, dtype)
    dy = torch.randn(shape, generator=g).to(KERNEL_DEVICE, dtype)
    xl, wl = _leaf(x), _leaf(w)
    y = triton_ops.rms_norm(xl, wl, 1e-5, in_place_backward=in_place)
    y.backward(dy.clone())
    xr, wr = _fp64(x), _fp64(w)
    yr = reference.rms_norm(xr, wr, 1e-5)
    yr.backward(dy.double().cpu())
    assert y.dtype == dtype
    assert_close(y, yr, dtype, "y")
    assert_close(xl.grad, xr.grad, dtype, "dx")
    assert_close(wl.grad, wr.grad, dtype, "dw")
    # HF's own casting (x -> fp32 -> normalized -> x.dtype -> * weight): within two roundings.
    assert_close(y, reference.rms_norm(x, w, 1e-5), dtype, "y vs same-dtype reference")


@needs_kernels
def test_rms_norm_kernel_fp32_weight_on_bf16_input_promotes():
    x = torch.randn(6, 96).to(KERNEL_DEVICE, torch.bfloat16)
    w = torch.rand(96, device=KERNEL_DEVICE) + 0.5
    y = triton_ops.rms_norm(x, w, 1e-6)
    assert y.dtype == torch.float32
    # The normalized row is rounded to bf16 before the fp32 product, as in HF: bf16 tolerance.
    assert_close(y, reference.rms_norm(x, w, 1e-6), torch.bfloat16, "y")


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dims", [(2, 6, 2, 13, 16), (1, 5, 5, 7, 10), (3, 3, 1, 4, 128)],
                         ids=["gqa", "mha-odd-half", "mqa"])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_rope_kernel(dtype, dims, unsqueeze_dim):
    B, Hq, Hk, S, D = dims
    g = torch.Generator().manual_seed(3)
    q0, k0 = torch.randn(B, S, Hq, D, generator=g), torch.randn(B, S, Hk, D, generator=g)
    cos = torch.randn(B if B > 1 else 1, S, D, generator=g).to(KERNEL_DEVICE, dtype)
    sin = torch.randn(B if B > 1 else 1, S, D, generator=g).to(KERNEL_DEVICE, dtype)
    dq, dk = torch.randn(B, S, Hq, D, generator=g), torch.randn(B, S, Hk, D, generator=g)
    if unsqueeze_dim == 1:   # HF layout: a (B, H, S, D) view of the projection's (B, S, H, D)
        q0, k0, dq, dk = (t.transpose(1, 2) for t in (q0, k0, dq, dk))
    q_src, k_src = _leaf(q0.to(KERNEL_DEVICE, dtype)), _leaf(k0.to(KERNEL_DEVICE, dtype))
    q, k = q_src * 1, k_src * 1                             # non-leaf, as a projection output
    q_in = q.transpose(1, 2).transpose(1, 2) if unsqueeze_dim == 1 else q
    ptr = q_in.data_ptr()
    qo, ko = triton_ops.rope(q_in, k, cos, sin, unsqueeze_dim)
    assert qo.data_ptr() == ptr, "rope must rotate in place"
    ((qo * dq.to(KERNEL_DEVICE, dtype)).sum() + (ko * dk.to(KERNEL_DEVICE, dtype)).sum()).backward()
    qr, kr = _fp64(q0.to(dtype)), _fp64(k0.to(dtype))
    a, b = reference.rope(qr, kr, cos.double().cpu(), sin.double().cpu(), unsqueeze_dim)
    ((a * dq.to(dtype).double()).sum() + (b * dk.to(dtype).double()).sum()).backward()
    assert_close(qo, a, dtype, "q")
    assert_close(ko, b, dtype, "k")
    assert_close(q_src.grad, qr.grad, dtype, "dq")
    assert_close(k_src.grad, kr.grad, dtype, "dk")


@needs_kernels
def test_rope_kernel_refuses_to_corrupt_a_saved_tensor():
    # Note: [Why rope bumps the version instead of marking dirty] (triton_ops/kernels/rope.py)
    x = torch.randn(1, 2, 5, 8, device=KERNEL_DEVICE, requires_grad=True)
    q = torch.sigmoid(x)                      # sigmoid saves its output for backward
    k = torch.randn(1, 2, 5, 8, device=KERNEL_DEVICE)
    cos, sin = torch.randn(1, 5, 8, device=KERNEL_DEVICE), torch.randn(1, 5, 8, device=KERNEL_DEVICE)
    qo, _ = triton_ops.rope(q, k, cos, sin)
    with pytest.raises(RuntimeError, match="inplace"):
        qo.sum().backward()


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 7, 301), (4099,)])
@pytest.mark.parametrize("in_place", [False, True])
def test_swiglu_kernel(dtype, shape, in_place):
    g = torch.Generator().manual_seed(4)
    a0, b0, dc = (torch.randn(shape, generator=g).to(KERNEL_DEVICE, dtype) for _ in range(3))
    a, b = _leaf(a0), _leaf(b0)
    c = triton_ops.swiglu(a * 1, b * 1, in_place_backward=in_place)   # temporaries, as in the MLP
    c.backward(dc)
    ar, br = _fp64(a0), _fp64(b0)
    reference.swiglu(ar, br).backward(dc.double().cpu())
    assert_close(c, reference.swiglu(ar, br), dtype, "c")
    assert_close(a.grad, ar.grad, dtype, "d gate")
    assert_close(b.grad, br.grad, dtype, "d up")


# ---------------------------------------------------------------- CPU: the interpreter run

@pytest.mark.skipif(ON_GPU or INTERPRET, reason="kernels run in this process")
def test_kernels_under_interpreter(tmp_path):
    """The kernel tests under Triton's interpreter, in a child run; then every kernel launch it made
    (triton_launch_recorder.py) compiled for sm_90 here with Triton's bundled ptxas: the
    interpreter runs a kernel's Python, not its lowering, which otherwise fails first on a GPU."""
    if not triton_ops.is_triton_available():
        pytest.skip("triton is not installed")
    here = os.path.dirname(os.path.abspath(__file__))
    record = tmp_path / "launches.json"
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_LAUNCH_RECORD=str(record),
               PYTHONPATH=os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "triton_launch_recorder",
           "-m", "not gpu", "-k", "kernel",
           *(os.path.join(here, f"test_{m}.py") for m in ("triton_ops", "triton_gemma_ops", "triton_patching", "fp8_kernels", "fp8",
                                                        "causal_conv", "gated_norm", "qk_norm"))]
    proc = subprocess.run(cmd, env=env, cwd=os.path.dirname(here), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    _compile_for_hopper(json.loads(record.read_text()))


def _compile_for_hopper(launches: list[dict]) -> None:
    """Compile each recorded specialization for sm_90 (skipped where this Triton has no CUDA toolchain)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernels = {(spec["module"], spec["name"]) for spec in launches}
    assert len(kernels) >= 12, sorted(kernels)        # the recorder saw the kernels, not a few of them
    failures = []
    for spec in launches:
        fn = getattr(importlib.import_module(spec["module"]), spec["name"])
        try:
            triton.compile(ASTSource(fn=fn, signature=spec["signature"], constexprs=spec["constexprs"]),
                           target=GPUTarget("cuda", 90, 32))
        except FileNotFoundError as err:                 # no ptxas in this Triton build
            pytest.skip(f"no CUDA toolchain in this Triton: {err}")
        except Exception as err:                         # noqa: BLE001 - each failure is reported below
            failures.append(f"{spec['module']}.{spec['name']} {spec['signature']}: {type(err).__name__}: {err}"[:600])
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------- GPU: real shapes

@pytest.mark.gpu
def test_linear_cross_entropy_llama3_head_bf16():
    hidden, weight, labels = _lce_inputs(4096, 4096, 128256, torch.bfloat16, "cuda")
    h, w = _leaf(hidden), _leaf(weight)
    loss = triton_ops.linear_cross_entropy(h, w, labels)
    loss.backward()
    hr, wr = _leaf(hidden.float()), _leaf(weight.float())
    ref = reference.linear_cross_entropy(hr, wr, labels, chunk_tokens=1024)
    ref.backward()
    assert_close(loss, ref, torch.bfloat16, "loss", scale=0.25)
    assert_close(h.grad, hr.grad, torch.bfloat16, "d hidden")
    assert_close(w.grad, wr.grad, torch.bfloat16, "d weight")


@pytest.mark.gpu
def test_norm_rope_swiglu_llama3_8b_shapes_bf16():
    dt = torch.bfloat16
    x, dy = torch.randn(2, 2048, 4096, device="cuda", dtype=dt), torch.randn(2, 2048, 4096, device="cuda", dtype=dt)
    w = (1 + 0.1 * torch.randn(4096, device="cuda")).to(dt)
    xl, wl = _leaf(x), _leaf(w)
    triton_ops.rms_norm(xl, wl, 1e-5).backward(dy)
    xr, wr = _leaf(x.float()), _leaf(w.float())
    reference.rms_norm(xr, wr, 1e-5).backward(dy.float())
    assert_close(xl.grad, xr.grad, dt, "rms dx")
    assert_close(wl.grad, wr.grad, dt, "rms dw")
    q = torch.randn(2, 2048, 32, 128, device="cuda", dtype=dt).transpose(1, 2)
    k = torch.randn(2, 2048, 8, 128, device="cuda", dtype=dt).transpose(1, 2)
    ang = torch.arange(2048, device="cuda")[:, None] * torch.rand(64, device="cuda")[None]
    cos, sin = torch.cat([ang, ang], -1).cos()[None].to(dt), torch.cat([ang, ang], -1).sin()[None].to(dt)
    a, b = reference.rope(q.float(), k.float(), cos.float(), sin.float())
    qo, ko = triton_ops.rope(q.clone(), k.clone(), cos, sin)
    assert_close(qo, a, dt, "rope q")
    assert_close(ko, b, dt, "rope k")
    g, u = torch.randn(2, 2048, 14336, device="cuda", dtype=dt), torch.randn(2, 2048, 14336, device="cuda", dtype=dt)
    assert_close(triton_ops.swiglu(g, u), reference.swiglu(g.float(), u.float()), dt, "swiglu")
