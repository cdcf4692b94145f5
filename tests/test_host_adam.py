"""The host AdamW kernel (host_adam.py) against torch.optim.AdamW, and its bf16-gradient route."""
from __future__ import annotations

import copy
import logging
import os

import pytest
import torch

import hf_slideformer as hs
from hf_slideformer.host import host_adam
from hf_slideformer.host.host_adam import HostAdam, NativeKernelError

from helpers import batches, family_config

try:
    host_adam.native_library()
    HAS_NATIVE = True
except NativeKernelError:
    HAS_NATIVE = False
needs_native = pytest.mark.skipif(not HAS_NATIVE, reason="no C compiler")

HP = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "maximize": False}


def _state(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-2, torch.rand(n, generator=g) * 1e-4,
            torch.randn(n, generator=g))


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between two fp32 tensors."""
    ia, ib = a.view(torch.int32).long(), b.view(torch.int32).long()
    ia = torch.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return int((ia - ib).abs().max()) if a.numel() else 0


@needs_native
@pytest.mark.parametrize("n", [4096, 5 * 123 * 123, 3 * 65536 + 4103, 17, 1])
@pytest.mark.parametrize("hp", [HP, dict(HP, weight_decay=0.1), dict(HP, maximize=True, betas=(0.5, 0.9)),
                                dict(HP, betas=(0.3, 0.95), lr=0.05)], ids=["plain", "wd", "max", "small-beta1"])
def test_native_matches_torch_adamw(n, hp):
    """Three steps with the lr changing, against torch.optim.AdamW(fused=True) on the same tensors:
    bit-identical on torch's vector body, within one ulp in its scalar tail (its last n % 16,
    where that build's compiler contracts differently), each step from torch's state."""
    p0, _, _, _ = _state(n)
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref], lr=hp["lr"], betas=hp["betas"], eps=hp["eps"], weight_decay=hp["weight_decay"],
                            maximize=hp["maximize"], fused=True)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    step = torch.zeros(())
    k = HostAdam("native", threads=2)
    for i in range(3):
        g = torch.randn(n, generator=torch.Generator().manual_seed(10 + i))
        lr = hp["lr"] * (1.0 - 0.3 * i)
        opt.param_groups[0]["lr"] = lr
        ref.grad = g.clone()
        opt.step()
        step += 1
        k.step(dict(hp, lr=lr), [p], [g], [m], [v], [step])
        st = opt.state[ref]
        body = n - n % 16
        for got, want in ((p, ref.detach()), (m, st["exp_avg"]), (v, st["exp_avg_sq"])):
            assert torch.equal(got[:body], want[:body])
            assert _ulps(got[body:], want[body:]) <= 1
            got.copy_(want)


@needs_native
def test_several_groups_and_entries_in_one_call():
    """Entries of different sizes and step counts in one call, each as torch updates it alone."""
    k = HostAdam("native", threads=3)
    sizes = [64, 1000, 48]
    states = [_state(n, seed=i) for i, n in enumerate(sizes)]
    steps = [torch.tensor(float(s)) for s in (1, 7, 2)]
    hp = dict(HP, weight_decay=0.05)
    got = [[t.clone() for t in s[:3]] for s in states]
    k.step(hp, [s[0] for s in got], [s[3] for s in states], [s[1] for s in got], [s[2] for s in got], steps)
    for (p, m, v, g), (gp, gm, gv), st in zip(states, got, steps):
        p, m, v = p.clone(), m.clone(), v.clone()
        torch._fused_adamw_([p], [g.clone()], [m], [v], [], [st], lr=hp["lr"], beta1=0.9, beta2=0.999,
                            weight_decay=0.05, eps=1e-8, amsgrad=False, maximize=False)
        body = p.numel() - p.numel() % 16
        assert torch.equal(gp[:body], p[:body]) and torch.equal(gm[:body], m[:body]) and torch.equal(gv[:body], v[:body])


@needs_native
@pytest.mark.parametrize("threads", [1, 2, 5])
def test_bf16_gradient_equals_widening_it_first(threads):
    """The bf16 route is bit-identical to widening the gradient to fp32 first, with a clip factor and
    a loss scale, whatever the thread split; the bf16 weight copy is the rounded master."""
    n = 3 * 4096 + 7
    p0, m0, v0, g = _state(n)
    gb = g.bfloat16()
    k = HostAdam("native", threads=threads)
    a = [t.clone() for t in (p0, m0, v0)]
    b = [t.clone() for t in (p0, m0, v0)]
    out16 = torch.empty(n, dtype=torch.bfloat16)
    step = [torch.tensor(4.0)]
    hp = dict(HP, weight_decay=0.01)
    k.step(hp, [a[0]], [gb], [a[1]], [a[2]], step, grad_scale=1 / 0.37, grad_mul=0.25, out16=[out16])
    wide = gb.float().mul_(0.25)
    k.step(hp, [b[0]], [wide], [b[1]], [b[2]], step, grad_scale=1 / 0.37)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert torch.equal(out16, a[0].bfloat16())


@pytest.mark.parametrize("mode", [pytest.param("native", marks=needs_native), "torch"])
@pytest.mark.parametrize("h,threads", [(64, 1), (37, 3), (4096, 2)])
@pytest.mark.parametrize("with_sums,zero_grad", [(False, False), (True, False), (True, True)])
def test_a_table_updated_in_two_sets_of_rows_equals_one_whole_update(mode, h, threads, with_sums, zero_grad):
    """`step_rows` on every row but a batch's (`exclude`), then on the batch's rows with the batch's sums
    added to their gradient, equals one `step` of the whole table with those sums added first,
    bit for bit; the gradient's batch rows are zeroed when asked, the rest of it kept."""
    V, n = 50, 13
    gen = torch.Generator().manual_seed(h)
    tables = [torch.randn(V, h, generator=gen), torch.randn(V, h, generator=gen) * 1e-2,
              torch.rand(V, h, generator=gen) * 1e-4]
    grad = torch.randn(V, h, generator=gen)
    grad[3] = 0.0                                                 # a row without gradient, as most are
    rows = torch.randperm(V, generator=gen)[:n].sort().values     # distinct, like torch.unique's
    others = torch.ones(V, dtype=torch.bool)
    others[rows] = False
    others = others.nonzero().view(-1)
    sums = torch.randn(n, h, generator=gen) if with_sums else None
    step = torch.tensor(5.0)
    hp = dict(HP, weight_decay=0.02, lr=3e-3)
    k = HostAdam(mode, threads=threads)
    got_t, got_g = [t.clone() for t in tables], grad.clone()
    k.step_rows(hp, got_t, got_g, rows, step, exclude=True)      # every row but the batch's
    if mode == "native":                                          # the same as naming them
        named = [t.clone() for t in tables]
        k.step_rows(hp, named, grad.clone(), others, step)
        assert all(torch.equal(a, b) for a, b in zip(named, got_t))
    k.step_rows(hp, got_t, got_g, rows, step, sums=sums, zero_grad=zero_grad)
    want_t, full = [t.clone().view(-1) for t in tables], grad.clone()
    if sums is not None:
        full.index_add_(0, rows, sums)
    HostAdam(mode, threads=1).step(hp, [want_t[0]], [full.view(-1)], [want_t[1]], [want_t[2]], [step])
    for a, b in zip(got_t, want_t):
        assert torch.equal(a.view(-1), b)
    want_g = grad.clone()
    if zero_grad:
        want_g[rows] = 0.0
    assert torch.equal(got_g, want_g)
    with pytest.raises(ValueError, match="exclude"):
        k.step_rows(hp, got_t, got_g, rows, step, zero_grad=True, exclude=True)


def _backed_bytes(t: torch.Tensor) -> int:
    """Rss of the mapping holding `t` (/proc/self/smaps): the pages backed by memory."""
    p, cur = t.data_ptr(), False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                cur = lo <= p < hi
            elif cur and line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no mapping holds the tensor")


@needs_native
@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads smaps (Linux)")
def test_clearing_rows_of_a_gradient_that_is_zero_backs_no_page():
    """`zero_grad` writes a row back only when it holds a nonzero value: a lazily mapped dense
    gradient that only ever reads as zeros (an untied embedding's with one backward per step) stays
    unbacked, and a row that held a value is cleared (embedding.py: [Why only a tied embedding's
    dense gradient is pinned])."""
    from hf_slideformer.host.memory import lazy_zeros

    V, h = 4096, 1024                              # 16 MiB of fp32 gradient
    tables = [torch.randn(V, h), torch.zeros(V, h), torch.zeros(V, h)]
    grad = lazy_zeros(V * h).view(V, h)
    rows = torch.arange(0, V, 3)
    sums = torch.randn(rows.numel(), h)
    k = HostAdam("native", threads=2)
    before = _backed_bytes(grad)          # the mapping may hold the other tensors too (merged), all written
    k.step_rows(HP, tables, grad, rows, torch.tensor(1.0), sums=sums, zero_grad=True)
    assert _backed_bytes(grad) - before <= 64 * 1024
    assert bool((tables[1][rows] != 0).any())       # the rows did step
    grad[6, 5] = 2.0
    k.step_rows(HP, tables, grad, rows, torch.tensor(2.0), sums=sums, zero_grad=True)
    assert not bool(grad.any())


@needs_native
def test_torch_route_equals_native_on_bf16_gradients():
    """The fallback (torch's fused kernel on the widened gradient) gives the native results."""
    n = 8192
    p0, m0, v0, g = _state(n)
    gb = g.bfloat16()
    a = [t.clone() for t in (p0, m0, v0)]
    b = [t.clone() for t in (p0, m0, v0)]
    step = [torch.tensor(2.0)]
    HostAdam("native", 2).step(HP, [a[0]], [gb], [a[1]], [a[2]], step, grad_scale=torch.tensor(2.5), grad_mul=0.5)
    HostAdam("torch").step(HP, [b[0]], [gb], [b[1]], [b[2]], step, grad_scale=torch.tensor(2.5), grad_mul=0.5)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@needs_native
@pytest.mark.parametrize("h,threads", [(1, 1), (13, 3), (4096, 2)])
def test_the_bf16_gather_equals_gathering_then_casting(h, threads):
    """The forward's host gather of rows rounded to bf16 is bit for bit torch's cast of the fp32
    rows (nearest even), ties, infinities and subnormals included, repeated rows too."""
    V = 37
    table = torch.randn(V, h) * torch.logspace(-40, 38, V)[:, None]
    flat = table.view(-1)
    flat[:4] = torch.tensor([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, float("inf"), -float("inf")])[:min(4, flat.numel())]
    ids = torch.tensor([5, 0, 36, 5, 17, 1, 0], dtype=torch.int64)
    out = torch.full((ids.numel(), h), 7.0, dtype=torch.bfloat16)
    HostAdam("native", threads).gather_bf16(table, ids, out)
    assert torch.equal(out.view(torch.int16), table[ids].bfloat16().view(torch.int16))
    with pytest.raises(ValueError, match="need"):
        HostAdam("native", 1).gather_bf16(table, ids.int(), out)


def test_without_a_compiler_auto_falls_back_with_a_notice(monkeypatch, caplog):
    monkeypatch.setattr(host_adam, "_LIB", None)
    monkeypatch.setattr(host_adam, "_compiler", lambda: None)
    with caplog.at_level(logging.WARNING, logger="hf_slideformer.host.host_adam"):
        k = HostAdam("auto", threads=2)
    assert k.name == "torch"
    assert "native host AdamW is not available" in caplog.text
    with pytest.raises(NativeKernelError, match="no C compiler"):
        HostAdam("native")
    p, m, v, g = _state(64)
    k.step(HP, [p], [g.bfloat16()], [m], [v], [torch.tensor(1.0)])      # still trains
    assert torch.isfinite(p).all()


def test_a_failing_build_names_the_compiler_output(monkeypatch, tmp_path):
    monkeypatch.setattr(host_adam, "_LIB", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(host_adam, "_FLAGS", host_adam._FLAGS + ["-fno-such-flag-anywhere"])
    if host_adam._compiler() is None:
        pytest.skip("no C compiler")
    with pytest.raises(NativeKernelError, match="building the host AdamW failed"):
        host_adam.native_library()
    assert not list(tmp_path.rglob("*.so"))           # no half-written library left behind


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="host_adam"):
        HostAdam("fast")
    with pytest.raises(ValueError, match="host_adam"):
        hs.SlideConfig(device="cpu", host_adam="fast")


def _slid_bf16(mode, **kw):
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(family_config("llama", kw.pop("tied", False))).float()
    model.config.use_cache = False
    return hs.slide(model, hs.SlideConfig(device="cpu", dtype=torch.bfloat16, host_adam=mode, **kw))


@needs_native
@pytest.mark.parametrize("kw", [{}, {"tied": True}, {"max_grad_norm": 0.5}, {"gradient_accumulation_steps": 2},
                                {"gradient_accumulation_steps": 2, "max_grad_norm": 0.5, "tied": True}],
                         ids=["plain", "tied", "clip", "accumulate", "accumulate-clip-tied"])
def test_engine_with_bf16_gradients_native_equals_torch_route(kw):
    """With bf16 compute the layers' gradients cross in bf16; updated by the native kernel or by
    torch's fused AdamW on the widened gradient, every master is bit-identical after three steps
    (scaled losses included: the head's gradient is widened, then scaled)."""
    models = [_slid_bf16(mode, **dict(kw)) for mode in ("native", "torch")]
    assert models[0].slide_engine.grad_ring.dtype == torch.bfloat16
    assert models[0].slide_engine.host_adam.name == "native"
    assert models[1].slide_engine.host_adam.name == "torch"
    ga = kw.get("gradient_accumulation_steps", 1)
    opts = [m.create_optimizer(lr=1e-3, weight_decay=0.01) for m in models]
    for b in batches(3 * ga, pad=True):
        for m, o in zip(models, opts):
            (m(**b).loss * 0.7).backward()
        if all(m.slide_engine.micro == ga for m in models):
            for o in opts:
                o.step()
                o.zero_grad()
    sd = [m.state_dict() for m in models]
    for name in sd[0]:
        assert torch.equal(sd[0][name], sd[1][name]), name


def test_a_missing_source_falls_back_with_a_notice(monkeypatch, tmp_path, caplog):
    """An install without the C source (a packaging mistake) degrades to torch's kernel, not a crash."""
    monkeypatch.setattr(host_adam, "_LIB", None)
    monkeypatch.setattr(host_adam, "_SOURCE", tmp_path / "missing.c")
    with caplog.at_level(logging.WARNING, logger="hf_slideformer.host.host_adam"):
        assert HostAdam("auto").name == "torch"
    assert "source" in caplog.text


def test_the_source_ships_with_the_package():
    """setup.py's package_data carries csrc/*.c and the header they share, so a wheel install can
    build the kernel."""
    from pathlib import Path
    setup = (Path(__file__).resolve().parent.parent / "setup.py").read_text()
    assert '"host/csrc/*.c"' in setup and '"host/csrc/*.h"' in setup and host_adam._SOURCE.exists()
    assert all(host_adam._SOURCE.with_name(h).exists() for h in host_adam._HEADERS)


@needs_native
def test_the_update_does_not_depend_on_the_thread_count():
    """The native kernel hands out blocks of 64k elements as threads free up: every element is
    computed alike whichever thread takes it, so any thread count gives the same bits."""
    n = 4 * 65536 + 4103
    p0, m0, v0, g = _state(n, seed=3)
    gb = g.bfloat16()
    outs = []
    for threads in (1, 2, 7):
        p, m, v = p0.clone(), m0.clone(), v0.clone()
        HostAdam("native", threads=threads).step(dict(HP, weight_decay=0.01), [p], [gb], [m], [v], [torch.tensor(2.0)])
        outs.append((p, m, v))
    for got in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, outs[0]))
