"""The compact formats' update in torch ops (adam8_torch.py), what resident and device-updated
units run: on CPU tensors it equals the native host kernel (csrc/host_adam8.c) step by step."""
import pytest
import torch

from hf_slideformer.host.adam8_torch import Hyper8, adamw8_range, round_bf16_stochastic_t, rounding_key_t
from hf_slideformer.host.host_adam import HostAdam, NativeKernelError
from hf_slideformer.host.host_optim import round_bf16_stochastic, rounding_key, state_format
from hf_slideformer.host.store import ParamEntry, Unit

try:
    KERNEL = HostAdam("native", 2)
except NativeKernelError:                    # pragma: no cover - a machine without a C compiler
    KERNEL = None
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no native host kernel here")

SHAPES = [(37, 41), (300,), (1000, 3), (256,), (5,)]
GROUPS = [dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1),
          dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0, maximize=True)]
GROUP_OF = [0, 1, 0, 1, 0, 1]       # the parameter ranges' groups (the CUDA test adds a sixth)


def make_unit(fmt, params, index=3):
    entries, off = [], 0
    for k, p in enumerate(params):
        entries.append(ParamEntry(name=f"p{k}", shape=p.shape, offset=off, numel=p.numel(), holders=[]))
        off += p.numel()
    u = Unit(name="layer", kind="layer", index=index, entries=entries, numel=off)
    u.master = torch.cat([p.reshape(-1) for p in params]).to(fmt.master_dtype)
    fmt.allocate([u], lambda n, dtype: torch.zeros(n, dtype=dtype))
    u.steps = [torch.zeros(()) for _ in entries]
    return u


def step(fmt, kernel, u, grads, groups, scale=None):
    for gi, hp in enumerate(groups):
        ks = [k for k in range(len(u.entries)) if GROUP_OF[k] == gi]
        for k in ks:
            u.steps[k].add_(1)
        ranges = [(k, u.entries[k].offset, u.entries[k].offset + u.entries[k].numel) for k in ks]
        fmt.run(kernel, hp, u, u, ranges, [grads[a:b] for _, a, b in ranges], [u.steps[k] for k in ks], scale)


def arrays(fmt, u):
    return {k: v.clone() for k, v in fmt.tensors(u).items()}


@needs_kernel
@pytest.mark.parametrize("name", ["adamw_8bit", "adamw_8bit_bf16"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_the_torch_update_equals_the_native_kernel_step_by_step(name, grad_dtype):
    """Codes, block scales and master bit for bit over steps with weight decay, maximize, a clip
    scale and a changing lr (the fp64 fused multiply-adds round as fmaf but at fp32 ties, which
    these values do not meet)."""
    fmt = state_format(name)
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen) for s in SHAPES]
    native, ref = make_unit(fmt, params), make_unit(fmt, params)
    for t in range(6):
        grads = (torch.randn(native.numel, generator=gen) * (1 + t)).to(grad_dtype)
        groups = [dict(g, lr=g["lr"] * (0.5 ** t)) for g in GROUPS]
        scale = None if t % 2 else 1.7
        step(fmt, KERNEL, native, grads, groups, scale)
        step(fmt, None, ref, grads, groups, scale)
        a, b = arrays(fmt, native), arrays(fmt, ref)
        for k in a:
            assert torch.equal(a[k], b[k]), (t, k)


@pytest.mark.parametrize("name", ["adamw_8bit", "adamw_8bit_bf16"])
def test_a_device_update_s_constants_from_the_host_counters_are_the_device_counters(name):
    """`prepare_steps` makes each entry's constants from its counter's value on the host, and their
    kernel arguments as rows of one table: the same fp32 values, key and arguments as constants made
    from the counter as a device tensor, for any step, group and gradient scale."""
    fmt = state_format(name)
    u = make_unit(fmt, [torch.randn(s) for s in SHAPES])
    by_group = {0: [0, 2], 1: [1, 3]}
    for t, scale in ((1, None), (2, torch.tensor(1.7)), (97, None), (12345, torch.tensor(0.3))):
        counters = [torch.tensor(float(t + k)) for k in range(len(u.entries))]
        prepared = fmt.prepare_steps(GROUPS, by_group, u, counters, scale, "cpu")
        for gi, entries in by_group.items():
            for k in entries:
                want = Hyper8(GROUPS[gi], scale, 1.0, counters[k], rounding_key_t(fmt.seed, u.index, counters[k]))
                got = prepared[k]
                for attr in ("gscale", "bc2", "neg_step", "wd_mul", "beta1", "c1", "beta2", "c2", "eps"):
                    assert float(getattr(got, attr)) == float(getattr(want, attr)), (t, k, attr)
                assert int(got.key) == int(want.key)
                for a, b in zip(got.kernel_args("cpu"), want.kernel_args("cpu")):
                    assert torch.equal(a, b), (t, k)
        assert prepared[4] is counters[4]         # not in a group: left as it was


def test_without_quantization_the_states_part():
    """The test above is not vacuous: the same steps with fp32 AdamW's moments (no quantization)
    end elsewhere than the 8-bit update by far more than a code step."""
    fmt = state_format("adamw_8bit")
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen) for s in SHAPES]
    u8, u32 = make_unit(fmt, params), make_unit(state_format("adamw"), params)
    for t in range(6):
        grads = torch.randn(u8.numel, generator=gen) * (1 + t)
        step(fmt, None, u8, grads, GROUPS)
        step(state_format("adamw"), None, u32, grads, GROUPS)
    assert not torch.equal(u8.master, u32.master)
    assert (u8.master - u32.master).abs().max() > 1e-5


def test_the_rounding_key_and_the_stochastic_rounding_are_the_kernels():
    for seed, unit, st in ((0, 0, 1), (7, 31, 12345), (2 ** 40 + 3, 5, 2 ** 20)):
        key = rounding_key_t(seed, unit, torch.tensor(float(st)))
        assert int(key) & ((1 << 64) - 1) == rounding_key(seed, unit, st)
    if KERNEL is None:
        return
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(10_000, generator=gen) * 10.0 ** torch.randint(-30, 30, (10_000,), generator=gen)
    x[:4] = torch.tensor([float("inf"), float("-inf"), float("nan"), 3.3895e38])
    key = rounding_key(3, 4, 5)
    want = round_bf16_stochastic(x, key, ctr=77)
    got = round_bf16_stochastic_t(x, torch.tensor(key - (1 << 64) if key >= 1 << 63 else key), 77 + torch.arange(x.numel()))
    assert torch.equal(got.view(torch.int16)[3:], want.view(torch.int16)[3:])
    assert torch.isnan(got[2]) and torch.equal(got[:2], want[:2])


@pytest.mark.parametrize("name", ["adamw_8bit", "adamw_8bit_bf16"])
def test_a_found_inf_leaves_the_state_as_it_was(name):
    fmt = state_format(name)
    gen = torch.Generator().manual_seed(2)
    u = make_unit(fmt, [torch.randn(700, generator=gen)])
    step(fmt, None, u, torch.randn(700, generator=gen), GROUPS[:1])
    before = arrays(fmt, u)
    u.steps[0].add_(1)
    adamw8_range(GROUPS[0], u.master, u.exp_avg, u.exp_avg_sq, u.exp_avg_absmax, u.exp_avg_sq_absmax,
                 torch.randn(700, generator=gen), u.steps[0], rounding_key_t(0, 3, u.steps[0]), 0,
                 found_inf=torch.tensor(1.0))
    after = arrays(fmt, u)
    assert all(torch.equal(before[k], after[k]) for k in before)


@needs_kernel
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["adamw_8bit", "adamw_8bit_bf16"])
def test_the_update_on_cuda_equals_the_native_kernel(name):
    """On CUDA the same arithmetic: codes and scales as the host kernel's but where the fp64 powers
    of the bias corrections round otherwise (none here), the master within one ulp."""
    fmt = state_format(name)
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen) for s in SHAPES + [(4096, 300)]]
    native, dev = make_unit(fmt, params), make_unit(fmt, params)
    for k, t in fmt.tensors(dev).items():
        setattr(dev, k, t.cuda())
    dev.steps = [s.cuda() for s in dev.steps]
    for t in range(4):
        grads = torch.randn(native.numel, generator=gen) * (1 + t)
        step(fmt, KERNEL, native, grads, GROUPS, 1.3 if t % 2 else None)
        step(fmt, None, dev, grads.cuda(), GROUPS, 1.3 if t % 2 else None)
    a, b = arrays(fmt, native), {k: v.cpu() for k, v in arrays(fmt, dev).items()}
    for k in a:
        if k == "master":
            ulp = (a[k].float().view(torch.int32) - b[k].float().view(torch.int32)).abs()
            assert int(ulp.max()) <= (1 << 16 if name.endswith("bf16") else 1), k
        elif k.endswith("absmax"):
            torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=0)
        else:
            assert float((a[k] != b[k]).float().mean()) <= 1e-4, k


@pytest.mark.gpu
@pytest.mark.parametrize("clip", [0.5, None])
@pytest.mark.parametrize("name", ["adamw_8bit", "adamw_8bit_bf16"])
def test_resident_and_device_layers_on_cuda_equal_the_host_run(name, clip):
    """A tiny model on the GPU: resident layers and the device-updated share in a compact format
    against the host-only run of the format (the forward and backward are the same kernels; the
    updates agree to the rounding of the bias corrections). Without clipping the device layers
    are updated in the backward."""
    import hf_slideformer as hs
    from helpers import batches, family_config
    from transformers import AutoModelForCausalLM

    data = [{k: v.cuda() for k, v in b.items()} for b in batches(4, pad=True)]
    out = []
    for kw in (dict(resident_layers=0, device_update_share=0.0), dict(resident_layers=2, device_update_share=0.0),
               dict(resident_layers=0, device_update_share=1.0)):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(family_config("llama", False)).float()
        slid = hs.slide(model, hs.SlideConfig(device="cuda", dtype=torch.float32, optimizer_state=name,
                                              max_grad_norm=clip, **kw))
        opt = slid.create_optimizer(lr=1e-2, weight_decay=0.1)
        for b in data:
            slid(**b).loss.backward()
            opt.step()
            opt.zero_grad()
        eng = slid.slide_engine
        assert bool(eng.residents.layers) == (kw["resident_layers"] > 0)
        assert bool(eng.device_updates.units) == (kw["device_update_share"] > 0)
        out.append({k: v.float().cpu() for k, v in slid.state_dict().items()})
    for s in out[1:]:
        for k in out[0]:
            torch.testing.assert_close(s[k], out[0][k], rtol=0, atol=2e-2 if name.endswith("bf16") else 2e-3)
