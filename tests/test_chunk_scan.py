"""triton_ops/kernels/chunk_scan.py: the gated delta rule's scan over chunks, one kernel each way.

The kernel path of `gated_delta._ChunkScan` (fp32, where the kernels apply) against the same
function's torch loop in float64 on the CPU: output, final state and the gradient of each of its
seven inputs, on chunk lengths 16 and 64, key and value widths below, between and above the
kernels' tiles (8, 12, 20, 33, 40) and at Qwen3.5's (128), with and without a gradient for the
final state. The kernel tests run on CUDA, or on the CPU in the interpreter's child run of
test_triton_ops.py (`-k kernel`).
"""
from __future__ import annotations

import pytest
import torch

from test_triton_ops import KERNEL_DEVICE, _fp64, _leaf, assert_close, needs_kernels
from triton_ops.gated_delta import _ChunkScan

NAMES = ("query", "key", "new_values", "k_cumdecay", "attn", "chunk_decay", "initial_state")
# (batch, heads, chunks, chunk length, key width, value width); the last one at Qwen3.5's tiles
SHAPES = [(2, 2, 3, 16, 8, 12), (1, 3, 2, 16, 33, 20), (1, 1, 2, 64, 16, 40), (1, 2, 2, 64, 128, 128)]


def _inputs(b, h, n, c, dk, dv, seed=0):
    """The scan's inputs at the magnitudes the rule gives them: unit-norm rows, decays in (0.3, 1)."""
    g = torch.Generator().manual_seed(seed)

    def rows(*shape):
        x = torch.randn(*shape, generator=g)
        return x / x.norm(dim=-1, keepdim=True)

    attn = torch.randn(b, h, n, c, c, generator=g).tril() * 0.3
    decay = 0.3 + 0.7 * torch.rand(b, h, n, generator=g)
    return (rows(b, h, n, c, dk), rows(b, h, n, c, dk), torch.randn(b, h, n, c, dv, generator=g),
            rows(b, h, n, c, dk) * 0.5, attn, decay, torch.randn(b, h, dk, dv, generator=g))


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the kernels' calls, so that a test sees the kernel path taken, not the loop twice."""
    from triton_ops.kernels import chunk_scan
    calls = []
    for name in ("scan_forward", "scan_backward"):
        fn = getattr(chunk_scan, name)
        monkeypatch.setattr(chunk_scan, name, lambda *a, _fn=fn, _name=name: calls.append(_name) or _fn(*a))
    return calls


@needs_kernels
@pytest.mark.parametrize("with_final", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_chunk_scan_forward_and_gradients(shape, with_final, kernel_calls):
    xs = _inputs(*shape)
    gen = torch.Generator().manual_seed(1)
    d_out = torch.randn(xs[0].shape[:4] + (shape[-1],), generator=gen)
    d_final = torch.randn(xs[-1].shape, generator=gen)
    leaves, refs = [_leaf(x.to(KERNEL_DEVICE)) for x in xs], [_fp64(x) for x in xs]
    results = []
    for args, device in ((leaves, KERNEL_DEVICE), (refs, "cpu")):
        out, final = _ChunkScan.apply(*args)
        grads = [d_out.to(device, out.dtype)] + ([d_final.to(device, final.dtype)] if with_final else [])
        torch.autograd.backward([out, final][:len(grads)], grads)
        results.append((out, final))
    assert kernel_calls == ["scan_forward", "scan_backward"]
    (out, final), (ref_out, ref_final) = results
    assert_close(out, ref_out, torch.float32, "out")
    assert_close(final, ref_final, torch.float32, "final state")
    for name, leaf, ref in zip(NAMES, leaves, refs):
        assert_close(leaf.grad, ref.grad, torch.float32, f"d {name}", scale=2.0)


@needs_kernels
def test_kernel_the_rule_takes_the_scan_kernels_and_equals_transformers(kernel_calls):
    """`chunk_gated_delta_rule` in fp32 where the kernels apply goes through both kernels (its
    triangular solves hand over column-major chunks) and keeps transformers' results to fp32
    rounding: output, final state and every gradient."""
    from test_gated_delta import _hf_rule, _inputs as rule_inputs
    from triton_ops.gated_delta import chunk_gated_delta_rule

    xs = [None if x is None else _leaf(x.to(KERNEL_DEVICE)) for x in rule_inputs(2, 100, 2, 2, 8, 12, torch.float32, True)]
    refs = [None if x is None else _fp64(x) for x in xs]
    results = []
    for rule, args in ((chunk_gated_delta_rule, xs), (_hf_rule(), refs)):
        out, state = rule(*args[:5], chunk_size=16, initial_state=args[5], output_final_state=True,
                          use_qk_l2norm_in_kernel=True)
        gen = torch.Generator().manual_seed(1)
        loss = (out * torch.randn(out.shape, generator=gen).to(out)).sum() + \
            (state * torch.randn(state.shape, generator=gen).to(state)).sum()
        loss.backward()
        results.append((out, state))
    assert kernel_calls == ["scan_forward", "scan_backward"]
    (out, state), (ref_out, ref_state) = results
    assert_close(out, ref_out, torch.float32, "out")
    assert_close(state, ref_state, torch.float32, "final state")
    for name, x, ref in zip("q k v g beta state".split(), xs, refs):
        assert_close(x.grad, ref.grad, torch.float32, f"d{name}", scale=2.0)


@needs_kernels
def test_kernel_chunk_scan_comparison_fails_without_the_chunks_decay():
    """A scan that forgot y_c (every decay 1) is told apart from the one that applies it."""
    from triton_ops.kernels import chunk_scan
    q, k, u, w, a, y, s0 = (x.to(KERNEL_DEVICE) for x in _inputs(2, 2, 3, 16, 8, 12))
    _, _, final = chunk_scan.scan_forward(k, u, w, torch.ones_like(y), s0)
    _, ref_final = _ChunkScan.apply(*(_fp64(x) for x in (q, k, u, w, a, y, s0)))
    with pytest.raises(AssertionError, match="final"):
        assert_close(final, ref_final, torch.float32, "final")


def test_the_kernels_take_fp32_chunks_of_a_power_of_two_from_16():
    """float64, a chunk length below 16 or not a power of two, keys wider than 256: the loop runs them."""
    import triton_ops
    if not triton_ops.is_triton_available():
        pytest.skip("triton is not installed")
    from triton_ops.kernels import chunk_scan

    def takes(shape, dtype=torch.float32):
        _, k, u, w, _, _, s0 = _inputs(*shape)
        return chunk_scan.supported(k.to(dtype), u.to(dtype), w.to(dtype), s0.to(dtype))

    assert takes((1, 1, 2, 16, 8, 8)) and takes((1, 1, 2, 64, 8, 8))
    assert not takes((1, 1, 2, 16, 8, 8), torch.float64)
    assert not takes((1, 1, 2, 8, 8, 8)) and not takes((1, 1, 2, 24, 8, 8))
    assert takes((1, 1, 1, 16, 256, 8)) and not takes((1, 1, 1, 16, 257, 8))
