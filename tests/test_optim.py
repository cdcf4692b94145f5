"""`optim.apply_adamw`: the fused AdamW on a unit's flat master, whole or piece by piece."""
import torch

import hf_slideformer as hs
from hf_slideformer.host import optim
from hf_slideformer.host.store import ParamEntry, Unit


def test_piecewise_adamw_is_bit_identical_and_reports_prefixes():
    sizes = [(300, 37), (5,), (1000,), (64, 70)]
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in sizes]
    entries, off = [], 0
    for i, s in enumerate(sizes):
        n = int(torch.Size(s).numel())
        entries.append(ParamEntry(f"p{i}", torch.Size(s), off, n, [], params[i]))
        off += n

    def unit():
        g = torch.Generator().manual_seed(4)
        u = Unit("u", "layer", 0, entries, numel=off)
        u.master, u.exp_avg = torch.randn(off, generator=g), 0.1 * torch.randn(off, generator=g)
        u.exp_avg_sq = 0.01 * torch.rand(off, generator=g)
        u.steps = [torch.tensor(2.0) for _ in entries]
        return u
    grad = torch.randn(off)
    groups = [dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1),
              dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0)]
    group_of = {id(p): i % 2 for i, p in enumerate(params) if i != 1}     # p1 is not updated
    whole = unit()
    optim.apply_adamw(whole, grad, groups, group_of)
    for piece in (1024, 4096, 1 << 20):
        u, prefixes = unit(), []
        optim.apply_adamw(u, grad, groups, group_of, piece=piece, on_piece=prefixes.append)
        for name in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(getattr(u, name), getattr(whole, name)), (piece, name)
        assert [float(s) for s in u.steps] == [float(s) for s in whole.steps] == [3.0, 2.0, 3.0, 3.0]
        assert prefixes == sorted(prefixes) and prefixes[-1] == off
        assert len(prefixes) >= off // piece
    try:
        optim.apply_adamw(unit(), grad, groups, group_of, piece=1000)
    except ValueError as e:
        assert "power of two" in str(e)
    else:
        raise AssertionError("a piece that is not a power of two must be refused")


def _unit_of(params, seed=0):
    entries, off = [], 0
    for i, p in enumerate(params):
        entries.append(ParamEntry(f"p{i}", p.shape, off, p.numel(), [], p))
        off += p.numel()
    u = Unit("u", "layer", 0, entries, numel=off)
    u.master = torch.cat([p.detach().reshape(-1) for p in params])
    u.exp_avg, u.exp_avg_sq = torch.zeros(off), torch.zeros(off)
    u.steps = [torch.tensor(0.0) for _ in entries]
    return u


def test_apply_adamw_follows_torch_adamw_with_clipping_and_a_skipped_step():
    """Three steps against torch.optim.AdamW (fp32, the reference's own arithmetic: rtol 1.3e-6),
    the clip factor applied as a gradient scale, and a step whose found_inf is set left out."""
    g = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(5, 123, generator=g)), torch.nn.Parameter(torch.randn(7, generator=g))]
    u = _unit_of(params)
    hp = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref = torch.optim.AdamW(params, **hp)
    groups, group_of = [dict(hp, maximize=False)], {id(p): 0 for p in params}
    for step, coef in enumerate((1.0, 0.25, 0.5)):
        grads = [torch.randn(p.shape, generator=g) for p in params]
        if step == 1:                                    # skipped: neither side moves
            optim.apply_adamw(u, torch.cat([x.reshape(-1) for x in grads]), groups, group_of,
                              found_inf=torch.tensor(1.0))
            continue
        for p, x in zip(params, grads):
            p.grad = x * coef
        ref.step()
        optim.apply_adamw(u, torch.cat([x.reshape(-1) for x in grads]), groups, group_of, clip_coef=coef)
    assert [float(s) for s in u.steps] == [2.0, 2.0]
    torch.testing.assert_close(u.master, torch.cat([p.detach().reshape(-1) for p in params]), rtol=1.3e-6, atol=1e-7)
    torch.testing.assert_close(u.exp_avg_sq, torch.cat([ref.state[p]["exp_avg_sq"].reshape(-1) for p in params]),
                               rtol=1.3e-6, atol=1e-9)


def test_one_default_weight_decay():
    """`model.create_optimizer()` and `SlideOptimizer(...)` decay alike by default (0.0, the HF Trainer's)."""
    from helpers import make_pair

    _, slid = make_pair("llama")
    built = slid.create_optimizer().defaults["weight_decay"]
    direct = hs.SlideOptimizer(list(slid.parameters()), slid.slide_engine).defaults["weight_decay"]
    assert built == direct == 0.0


def test_a_part_frozen_right_after_step_keeps_that_step_s_update():
    """With clipping the step's updates run on the worker after `optimizer.step()` returns: freezing
    a parameter then must not take it out of that step, as it does not in torch's AdamW (the groups
    a step updates are read when it is queued, not when the worker runs it)."""
    import threading

    from helpers import batches, make_pair, max_param_diff

    ref, slid = make_pair("llama", tied=False, max_grad_norm=1.0)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    opt = slid.create_optimizer(lr=1e-2, weight_decay=0.0)
    engine = slid.slide_engine
    for batch in batches(2):
        ref(**batch).loss.backward()
        slid(**batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ropt.step(); ropt.zero_grad()
        release = threading.Event()
        engine.worker.submit(release.wait)          # the step's updates queue behind this
        opt.step(); opt.zero_grad()
        for model in (ref, slid):                   # frozen once the step has returned
            for param in (model.get_input_embeddings().weight, model.model.layers[0].mlp.up_proj.weight):
                param.requires_grad_(False)
        release.set()
        engine.synchronize()
        for model in (ref, slid):
            for param in model.parameters():
                param.requires_grad_(True)
    assert max_param_diff(ref, slid) < 0.05 * 1e-2
