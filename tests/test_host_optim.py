"""The host optimizer's state formats (host_optim.py): the 8-bit AdamW held to bitsandbytes' blockwise
AdamW8bit step by step, the stochastic rounding of a bf16 master, and what each format declares."""
import pytest
import torch

from hf_slideformer.host.host_adam import HostAdam
from hf_slideformer.host.host_optim import (FORMATS, AdamW8bit, round_bf16_stochastic, rounding_key, state_format)
from hf_slideformer.host.quant_maps import BLOCK, dequantize_blockwise, dynamic_map, quantize_blockwise
from hf_slideformer.host.store import ParamEntry, Unit

bnb = pytest.importorskip("bitsandbytes")

SHAPES = [(37, 41), (300,), (1000, 3), (256,), (5,)]     # partial blocks, one exact block, a tiny one
GROUPS = [dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1),
          dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0)]
GROUP_OF = [0, 1, 0, 1, 0]                                  # the group of each shape


def make_unit(fmt, params, index=1):
    """A host unit holding `params` back to back, its state allocated by `fmt`."""
    entries, off = [], 0
    for k, p in enumerate(params):
        entries.append(ParamEntry(name=f"p{k}", shape=p.shape, offset=off, numel=p.numel(), holders=[]))
        off += p.numel()
    u = Unit(name="layer", kind="layer", index=index, entries=entries, numel=off)
    u.master = torch.cat([p.reshape(-1) for p in params]).to(fmt.master_dtype)
    fmt.allocate([u], lambda n, dtype: torch.zeros(n, dtype=dtype))
    u.steps = [torch.zeros(()) for _ in entries]
    return u


def step(fmt, kernel, u, grads, groups, piece=None):
    """One update of every entry, group by group (cut at multiples of `piece` when given)."""
    for gi, hp in enumerate(groups):
        ranges = []
        for k, e in enumerate(u.entries):
            if GROUP_OF[k] != gi:
                continue
            u.steps[k].add_(1)
            cut = piece or e.numel
            ranges += [(k, e.offset + a, e.offset + min(a + cut, e.numel)) for a in range(0, e.numel, cut)]
        fmt.run(kernel, hp, u, u, ranges, [grads[a:b] for _, a, b in ranges], [u.steps[k] for k, _, _ in ranges],
                None)


def test_the_maps_and_the_rounding_are_bitsandbytes():
    import bitsandbytes.functional as F

    g = torch.Generator().manual_seed(0)
    for signed in (True, False):
        code = F.create_dynamic_map(signed=signed)
        assert torch.equal(dynamic_map(signed), code)
        for n in (5, 256, 1000, 4099):
            x = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 6     # values over many decades
            x = x if signed else x.abs()
            x[: min(n, 256)] *= 0 if n > 512 else 1                              # an all-zero block
            ref, state = F.quantize_blockwise(x, code=code, blocksize=BLOCK)
            codes, absmax = quantize_blockwise(x, signed)
            assert torch.equal(codes, ref.view(-1)) and torch.equal(absmax, state.absmax)
            assert torch.equal(dequantize_blockwise(codes, absmax, signed), F.dequantize_blockwise(ref, state).view(-1))


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_8bit_adamw_follows_bitsandbytes_step_by_step(grad_dtype):
    """Odd sizes, two groups (one with weight decay), the lr changed every step, bf16 or fp32 gradients.

    Tolerance: the codes and block scales are bitsandbytes' exactly (the same rounding table and
    the same operation order); each step's master within 4 ulp of the larger term of its last sum
    (the decayed weight or the step): torch's vectorized addcdiv_ rounds the step in another order
    than the kernel (value * m / d against value * (m / d), up to 2 ulp of the step apart), and the
    decay and the sum round once each; where the step cancels most of the weight, those are many
    ulps of the result, so the bound is on the terms, not on the result. Plain fp32 AdamW (the quantization switched
    off) is checked to miss the same master tolerance by far, so that the comparison can fail."""
    torch.manual_seed(0)
    params = [torch.randn(s) for s in SHAPES]
    ref = [torch.nn.Parameter(p.clone()) for p in params]
    fp32 = [torch.nn.Parameter(p.clone()) for p in params]
    groups = [dict(g) for g in GROUPS]
    ref_opt = bnb.optim.AdamW8bit([{"params": [r for r, gi in zip(ref, GROUP_OF) if gi == k], **g}
                                   for k, g in enumerate(groups)], min_8bit_size=0)
    fp32_opt = torch.optim.AdamW([{"params": [r for r, gi in zip(fp32, GROUP_OF) if gi == k], **g}
                                  for k, g in enumerate(groups)])
    fmt = FORMATS["adamw_8bit"]
    u = make_unit(fmt, params)
    kernel = HostAdam("native", 2)
    worst_fp32 = 0.0
    for t in range(6):
        for hp, rg, fg in zip(groups, ref_opt.param_groups, fp32_opt.param_groups):
            hp["lr"] = rg["lr"] = fg["lr"] = hp["lr"] * 0.7               # a schedule
        grads = [torch.randn(s).to(grad_dtype) for s in SHAPES]
        for r, f, g in zip(ref, fp32, grads):
            r.grad, f.grad = g.float(), g.float()
        before = [r.detach().clone() for r in ref]
        ref_opt.step()
        fp32_opt.step()
        step(fmt, kernel, u, torch.cat([g.reshape(-1) for g in grads]), groups)
        for k, (r, f) in enumerate(zip(ref, fp32)):
            s, ours = ref_opt.state[r], fmt.entry_state(u, k)
            assert torch.equal(ours["exp_avg"].reshape(-1), s["state1"].reshape(-1)), (t, k)
            assert torch.equal(ours["exp_avg_sq"].reshape(-1), s["state2"].reshape(-1)), (t, k)
            assert torch.equal(ours["exp_avg_absmax"], s["absmax1"]), (t, k)
            assert torch.equal(ours["exp_avg_sq_absmax"], s["absmax2"]), (t, k)
            w = u.entries[k].view(u.master)
            terms = torch.maximum(before[k].abs(), (r.detach() - before[k]).abs())
            tol = 4 * torch.finfo(torch.float32).eps * terms + 1e-12
            assert ((w - r.detach()).abs() <= tol).all(), (t, k, (w - r.detach()).abs().max())
            worst_fp32 = max(worst_fp32, float(((f.detach() - r.detach()).abs() / tol).max()))
            r.data.copy_(w.view_as(r))          # each step is held to its own rounding, not the sum of all
    assert worst_fp32 > 100          # fp32 moments are far outside the tolerance: the test sees quantization


@pytest.mark.parametrize("name", ["adamw_8bit", "adamw_8bit_bf16"])
def test_an_update_in_pieces_or_on_other_threads_is_bit_identical(name):
    fmt = FORMATS[name]
    torch.manual_seed(1)
    params = [torch.randn(s) for s in SHAPES]
    units = [make_unit(fmt, params) for _ in range(3)]
    kernels = [HostAdam("native", 1), HostAdam("native", 2), HostAdam("native", 2)]
    for _ in range(3):
        g = torch.randn(units[0].numel).to(torch.bfloat16)
        for u, kernel, piece in zip(units, kernels, (None, None, BLOCK)):
            step(fmt, kernel, u, g, GROUPS, piece=piece)
    for u in units[1:]:
        for name, t in fmt.tensors(u).items():
            assert torch.equal(t, fmt.tensors(units[0])[name]), name


def test_a_bf16_master_is_rounded_stochastically_without_bias_and_reproducibly():
    lo = 1.0
    x = torch.full((200_000,), lo + 2 ** -10)        # between the bf16 neighbours 1 and 1 + 2^-7
    r = round_bf16_stochastic(x, key=rounding_key(0, 3, 7))
    assert set(r.float().unique().tolist()) == {1.0, 1.0 + 2 ** -7}
    p = 2 ** -10 / 2 ** -7                           # the probability of rounding up
    up = float((r.float() > lo).double().mean())
    assert abs(up - p) < 5 * (p * (1 - p) / x.numel()) ** 0.5            # five standard deviations
    assert torch.equal(r, round_bf16_stochastic(x, key=rounding_key(0, 3, 7), threads=2))   # threads: same
    assert not torch.equal(r, round_bf16_stochastic(x, key=rounding_key(1, 3, 7)))          # another seed
    assert not torch.equal(r, round_bf16_stochastic(x, key=rounding_key(0, 3, 8)))          # another step
    exact = torch.tensor([1.0, -2.5, 0.0, float("inf"), float("-inf")])
    assert torch.equal(round_bf16_stochastic(exact, key=5).float(), exact)                  # bf16 values stay


def test_small_updates_survive_a_bf16_master_on_average():
    """An update 1/16 of a bf16 ulp rounds away with nearest; stochastic rounding keeps its mean."""
    torch.manual_seed(0)
    fmt = FORMATS["adamw_8bit_bf16"]
    u = make_unit(fmt, [torch.ones(4096)])
    kernel = HostAdam("native", 2)
    hp = dict(lr=2 ** -7 / 16, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    for t in range(16):
        u.steps[0].add_(1)
        fmt.run(kernel, hp, u, u, [(0, 0, 4096)], [torch.full((4096,), -1.0)], u.steps, None)
    # Each step moves a weight by lr (Adam's step of a constant gradient): 16 of them make one ulp.
    mean = float(u.master.float().mean())
    assert abs(mean - (1.0 + 16 * hp["lr"])) < 0.1 * 2 ** -7


def test_each_format_declares_its_bytes():
    assert state_format("adamw").bytes_per_param == 12
    assert state_format("adamw_8bit").bytes_per_param == 4 + 2 + 8 / 256
    assert state_format("adamw_8bit_bf16").bytes_per_param == 2 + 2 + 8 / 256
    u = make_unit(FORMATS["adamw_8bit"], [torch.zeros(300), torch.zeros(5)])
    assert FORMATS["adamw_8bit"].sizes(u) == {"exp_avg": 305, "exp_avg_sq": 305, "exp_avg_absmax": 3,
                                              "exp_avg_sq_absmax": 3}
    with pytest.raises(ValueError, match="adamw_8bit"):
        state_format("adam8")


def test_a_damaged_block_scale_is_named():
    fmt = AdamW8bit()
    fmt.check("exp_avg_absmax", torch.tensor([0.0, 1.0]), "here")
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(Exception, match="invalid block scale") as e:
            fmt.check("exp_avg_sq_absmax", torch.tensor([1.0, bad]), "unit 3")
        assert type(e.value).__name__ == "CorruptOptimizerStateError" and "unit 3" in str(e.value)


@pytest.mark.parametrize("name", ["adamw_8bit", "adamw_8bit_bf16"])
@pytest.mark.parametrize("with_sums,zero_grad", [(False, False), (True, True)])
def test_a_table_updated_in_two_sets_of_rows_equals_one_whole_update(name, with_sums, zero_grad):
    """The 8-bit row-wise update (`run_rows`, the embedding's): every row but a batch's, then the
    batch's rows with their sums added, equals one update of the whole table with the sums added
    first, bit for bit (codes, scales, master and its stochastic rounding); the gradient's batch
    rows are cleared when asked, the rest kept; a row that is not whole blocks is refused."""
    fmt = FORMATS[name]
    V, h, n = 40, 2 * BLOCK, 11
    gen = torch.Generator().manual_seed(3)
    table = torch.randn(V, h, generator=gen)
    rows = torch.randperm(V, generator=gen)[:n].sort().values
    kernel = HostAdam("native", 2)
    hp = dict(GROUPS[0])
    got, want = make_unit(fmt, [table]), make_unit(fmt, [table])
    got.kind = want.kind = "embed"
    for t in range(3):
        grad = torch.randn(V, h, generator=gen) * 10 ** -t
        grad[5] = 0.0
        sums = torch.randn(n, h, generator=gen) if with_sums else None
        got.steps[0].add_(1)
        g = grad.clone()
        fmt.run_rows(kernel, hp, got, g, rows, got.steps[0], exclude=True)
        fmt.run_rows(kernel, hp, got, g, rows, got.steps[0], sums=sums, zero_grad=zero_grad)
        full = grad.clone()
        if sums is not None:
            full.index_add_(0, rows, sums)
        want.steps[0].add_(1)
        fmt.run(kernel, hp, want, want, [(0, 0, V * h)], [full.view(-1)], [want.steps[0]], None)
        for a in ("master", "exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax"):
            assert torch.equal(getattr(got, a), getattr(want, a)), (t, a)
        kept = grad.clone()
        if zero_grad:
            kept[rows] = 0.0
        assert torch.equal(g, kept)
    odd = make_unit(fmt, [torch.randn(4, BLOCK + 8)])
    with pytest.raises(ValueError, match="multiple of"):
        fmt.run_rows(kernel, hp, odd, torch.zeros(4, BLOCK + 8), torch.tensor([1]), odd.steps[0].add_(1))


@pytest.mark.parametrize("name", ["adamw_8bit", "adamw_8bit_bf16"])
def test_the_kernels_code_search_equals_the_rounding_table_at_every_grid_point(name):
    """With beta1 = beta2 = 0 and lr 0 the update stores m = g and v = g * g quantized: blocks of
    one 1.0 (the absmax) and values on and between every point of the 65536-point grid, and values
    over many decades, each coded as the rounding table codes it (the vector search included)."""
    from hf_slideformer.host.quant_maps import LUT_SIZE

    fmt = state_format(name)
    gen = torch.Generator().manual_seed(3)
    grid = torch.arange(LUT_SIZE, dtype=torch.float32) * 2.0 / (LUT_SIZE - 1) - 1.0
    between = grid[:-1] + (grid[1:] - grid[:-1]) * torch.rand(LUT_SIZE - 1, generator=gen)
    decades = torch.sign(torch.randn(1 << 17, generator=gen)) * 10.0 ** (-9 * torch.rand(1 << 17, generator=gen))
    vals = torch.cat([grid, between, decades, grid.abs().sqrt(), between.abs().sqrt()])
    vals = vals[torch.randperm(vals.numel(), generator=gen)]
    per = BLOCK - 1
    nb = -(-vals.numel() // per)
    rest = torch.zeros(nb * per)
    rest[:vals.numel()] = vals
    blocks = torch.cat([torch.ones(nb, 1), rest.view(nb, per)], dim=1)
    g = blocks.view(-1)[: nb * BLOCK - 7].contiguous()            # a partial last block
    u = make_unit(fmt, [torch.zeros(g.numel())])
    hp = dict(lr=0.0, betas=(0.0, 0.0), eps=1e-8, weight_decay=0.0)
    u.steps[0].add_(1)
    fmt.run(HostAdam("native", 2), hp, u, u, [(0, 0, g.numel())], [g], u.steps, None)
    for arr, x, signed in (("exp_avg", g, True), ("exp_avg_sq", g * g, False)):
        codes, absmax = quantize_blockwise(x, signed)
        assert torch.equal(getattr(u, arr + "_absmax"), absmax)
        assert torch.equal(getattr(u, arr), codes), arr
