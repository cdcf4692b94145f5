"""The 8-bit AdamW update's Triton kernel (triton_ops/kernels/adamw8.py, through
adam8_torch.adamw8_range_triton) against its torch-ops reference
(adam8_torch.adamw8_range_torch), bit for bit: on CUDA, and on the CPU through Triton's
interpreter (TRITON_INTERPRET must be set before Triton compiles anything, so the CPU run is a
child pytest of this file's `kernel` tests)."""
import os
import subprocess
import sys

import pytest
import torch

import triton_ops
from hf_slideformer.host import adam8_torch
from hf_slideformer.host.adam8_torch import adamw8_range, adamw8_range_torch, adamw8_range_triton, rounding_key_t
from hf_slideformer.host.quant_maps import BLOCK, num_blocks

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ON_GPU = torch.cuda.is_available()
KERNEL_DEVICE = "cuda" if ON_GPU else ("cpu" if INTERPRET and triton_ops.is_triton_available() else None)
needs_kernels = pytest.mark.skipif(KERNEL_DEVICE is None,
                                   reason="the kernel runs on CUDA, or on CPU under TRITON_INTERPRET=1 (child run)")
HP = [dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1),
      dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0, maximize=True)]


def state(n: int, master_dtype, device, seed: int = 0) -> dict:
    """A range's master and 8-bit state after a few torch-reference steps (codes and scales not zero)."""
    gen = torch.Generator().manual_seed(seed)
    st = dict(master=torch.randn(n, generator=gen).to(master_dtype), q1=torch.zeros(n, dtype=torch.uint8),
              q2=torch.zeros(n, dtype=torch.uint8), a1=torch.zeros(num_blocks(n)), a2=torch.zeros(num_blocks(n)))
    st = {k: v.to(device) for k, v in st.items()}
    step = torch.zeros((), device=device)
    for _ in range(2):
        step += 1
        adamw8_range_torch(HP[0], *st.values(), torch.randn(n, generator=gen).to(device), step,
                           rounding_key_t(0, 1, step), 0)
    return st


def run_both(st: dict, grad, hp, step, ctr, scale=None, found_inf=None):
    """(kernel's arrays, reference's arrays) after one step of each from the same state."""
    ker = {k: v.clone() for k, v in st.items()}
    ref = {k: v.clone() for k, v in st.items()}
    key = rounding_key_t(7, 3, step)
    adamw8_range_triton(hp, *ker.values(), grad, step, key, ctr, scale=scale, found_inf=found_inf)
    adamw8_range_torch(hp, *ref.values(), grad, step, key, ctr, scale=scale, found_inf=found_inf)
    return ker, ref


def assert_same(ker: dict, ref: dict, what=""):
    for k in ref:
        a, b = ker[k], ref[k]
        if a.is_floating_point():
            a, b = a.view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32), \
                b.view(torch.int16 if b.dtype == torch.bfloat16 else torch.int32)
        bad = (a != b).nonzero()
        assert bad.numel() == 0, f"{what} {k}: {bad.shape[0]} values differ, first at {bad[0].tolist()}"


@needs_kernels
@pytest.mark.parametrize("master_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [5, BLOCK, 3 * BLOCK + 77, 8 * BLOCK * 3 + 1])
def test_kernel_equals_the_torch_update_bit_for_bit(n, grad_dtype, master_dtype):
    """Codes, block scales and master (a bf16 one rounded stochastically) bit for bit, on ranges of a
    partial block, one block, a partial last block and several programs' worth, with weight
    decay or maximize, a clip scale as a float and as a device tensor, and a counter offset."""
    dev = KERNEL_DEVICE
    gen = torch.Generator().manual_seed(n)
    st = state(n, master_dtype, dev)
    for t, (hp, scale) in enumerate([(HP[0], None), (HP[1], 1.7), (HP[0], torch.tensor(0.37, device=dev))]):
        grad = (torch.randn(n, generator=gen) * 10.0 ** (t - 1)).to(grad_dtype).to(dev)
        step = torch.tensor(float(3 + t), device=dev)
        ker, ref = run_both(st, grad, hp, step, ctr=1000 * t, scale=scale)
        assert_same(ker, ref, f"step {t}")
        assert not torch.equal(ker["q1"], st["q1"])
        st = ref


@needs_kernels
def test_kernel_with_found_inf_changes_nothing_and_zero_blocks_code_zero():
    dev = KERNEL_DEVICE
    st = state(700, torch.float32, dev)
    step = torch.tensor(3.0, device=dev)
    ker, ref = run_both(st, torch.randn(700).to(dev), HP[0], step, 0, found_inf=torch.tensor(1.0, device=dev))
    assert_same(ker, st, "skipped")
    assert_same(ref, st, "skipped (reference)")
    zero = {k: torch.zeros_like(v) for k, v in st.items()}
    ker, ref = run_both(zero, torch.zeros(700, device=dev), HP[0], step, 0)
    assert_same(ker, ref, "zeros")
    assert not ker["a1"].any() and not ker["q1"].any()


@needs_kernels
def test_the_dispatch_takes_the_kernel_and_a_broken_kernel_is_seen(monkeypatch):
    """adamw8_range runs the kernel for these tensors; with the kernel's weight decay switched off the
    comparison above fails (the test can fail)."""
    dev = KERNEL_DEVICE
    st = state(600, torch.float32, dev)
    grad, step = torch.randn(600).to(dev), torch.tensor(3.0, device=dev)
    calls = []
    real = adam8_torch.adamw8_range_triton
    monkeypatch.setattr(adam8_torch, "adamw8_range_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = {k: v.clone() for k, v in st.items()}
    adamw8_range(HP[0], *got.values(), grad, step, rounding_key_t(7, 3, step), 0)
    assert calls
    ker, ref = run_both(st, grad, HP[0], step, 0)
    assert_same(got, ref)
    broken = dict(HP[0], weight_decay=0.0)
    ker, _ = run_both(st, grad, broken, step, 0)
    with pytest.raises(AssertionError):
        assert_same(ker, ref)


@pytest.mark.skipif(KERNEL_DEVICE != "cpu", reason="the CPU device under the interpreter (on CUDA: test_adam8_torch)")
@pytest.mark.parametrize("name", ["adamw_8bit", "adamw_8bit_bf16"])
def test_kernel_in_resident_and_device_updated_layers_equals_the_host_run(name, monkeypatch):
    """The engine's GPU placements on the CPU device take the kernel (the interpreter runs it there):
    resident layers, and the device-updated share in pieces, end bit for bit where the host-only
    run of the format ends (its native kernel)."""
    from hf_slideformer.engine import device_update
    from helpers import batches, make_pair
    from test_resident_state import _equal, _state, _train
    monkeypatch.setattr(device_update, "DEVICE_PIECE", 256)
    calls = []
    real = adam8_torch.adamw8_range_triton
    monkeypatch.setattr(adam8_torch, "adamw8_range_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    data = batches(3, pad=True)
    states = []
    for kw in (dict(resident_layers=0), dict(resident_layers=2),
               dict(resident_layers=0, max_grad_norm=0.3, device_update_share=1.0)):
        _, slid = make_pair("llama", False, optimizer_state=name, **kw)
        states.append(_state(slid, _train(slid, data)))
    assert calls
    _equal(states[0], states[1])
    _, slid = make_pair("llama", False, optimizer_state=name, resident_layers=0, max_grad_norm=0.3)
    _equal(_state(slid, _train(slid, data)), states[2])


@pytest.mark.skipif(ON_GPU or INTERPRET, reason="the kernel runs in this process")
def test_kernels_under_interpreter():
    if not triton_ops.is_triton_available():
        pytest.skip("triton is not installed")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not gpu", "-k", "kernel",
           os.path.join(here, "test_adam8_triton.py")]
    proc = subprocess.run(cmd, env=env, cwd=os.path.dirname(here), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("master_dtype", [torch.float32, torch.bfloat16])
def test_kernel_on_a_3b_layer_equals_the_torch_update_and_is_faster(master_dtype):
    """A Llama-3.2-3B layer's 100.7 M parameters on CUDA: bit for bit the torch update, and the
    times of both (printed; the kernel is one pass over 10-12 bytes a parameter)."""
    n = 100_663_296
    gen = torch.Generator(device="cuda").manual_seed(0)
    st = {"master": torch.randn(n, device="cuda", generator=gen).to(master_dtype),
          "q1": torch.randint(0, 256, (n,), device="cuda", dtype=torch.uint8, generator=gen),
          "q2": torch.randint(0, 256, (n,), device="cuda", dtype=torch.uint8, generator=gen),
          "a1": torch.rand(num_blocks(n), device="cuda", generator=gen),
          "a2": torch.rand(num_blocks(n), device="cuda", generator=gen) * 1e-3}
    grad = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
    step = torch.tensor(5.0, device="cuda")
    ker, ref = run_both(st, grad, HP[0], step, 123)
    assert_same(ker, ref, "3B layer")
    times = {}
    key = rounding_key_t(7, 3, step)
    for name, fn in (("triton", lambda: adamw8_range_triton(HP[0], *ker.values(), grad, step, key, 0)),
                     ("torch", lambda: adamw8_range_torch(HP[0], *ref.values(), grad, step, key, 0))):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            fn()
        end.record()
        torch.cuda.synchronize()
        times[name] = start.elapsed_time(end) / 3
    print(f"\n8-bit AdamW of {n / 1e6:.1f} M parameters, {master_dtype}: triton {times['triton']:.2f} ms, "
          f"torch {times['torch']:.2f} ms ({times['torch'] / times['triton']:.1f}x)")
    assert times["triton"] < times["torch"]
