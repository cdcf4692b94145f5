"""The slot queue's chunked loads (CPU: the same code path, every event already complete)."""
import torch

from hf_slideformer.slots import SlotQueue, staged_copy
from hf_slideformer.store import ParamEntry, Unit
from hf_slideformer.transfer import Streams


def _unit(name, numel, seed):
    u = Unit(name, "head", 0, [ParamEntry(name + ".w", torch.Size([numel]), 0, numel, [])], numel=numel)
    u.master = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    return u


def test_chunked_load_fills_the_slot_only_when_finished():
    q = SlotQueue(1, 64, torch.float32, Streams(torch.device("cpu")))
    q.chunk = 7
    a, b = _unit("a", 23, 0), _unit("b", 30, 1)
    steps = q.load_steps((a, b))
    n = 0
    for _ in steps:
        n += 1
        if n < 8:
            assert q.find((a, b)) is None          # not usable while the copy is in flight
    assert n == 4 + 5                               # ceil(23 / 7) + ceil(30 / 7) chunks
    slot = q.find((a, b))
    assert slot is not None
    assert torch.equal(slot.views(a)[0], a.master) and torch.equal(slot.views(b)[0], b.master)
    assert list(q.load_steps((a, b))) == []         # already there: nothing to copy


def test_chunked_load_dropped_half_way_starts_over():
    q = SlotQueue(1, 64, torch.float32, Streams(torch.device("cpu")))
    q.chunk = 5
    a = _unit("a", 40, 2)
    steps = q.load_steps((a,))
    next(steps), next(steps)
    del steps                                       # a forward that stopped half way
    assert q.find((a,)) is None
    a.master.add_(1.0)                              # the next step's weights
    a.version += 1
    slot = q.acquire((a,))
    assert torch.equal(slot.views(a)[0], a.master)


def test_load_copies_each_finished_prefix_of_an_update_in_progress():
    """While the worker updates a unit piece by piece, the load copies what is final and waits for the rest."""
    a = _unit("a", 50, 3)
    final = a.master + 1.0                          # the update's result
    a.master.copy_(final)                           # (CPU: the copy reads it now; the progress is simulated)
    a.updated.clear()
    seen = []

    def waiter(u, start):                           # the worker finishes 12 more elements per wait
        seen.append(start)
        ready = min(u.numel, start + 12)
        if ready == u.numel:
            u.updated.set()
        return ready
    q = SlotQueue(1, 64, torch.float32, Streams(torch.device("cpu")), waiter=waiter)
    q.chunk = 20
    slot = q.load((a,))
    assert seen == [0, 12, 20, 32, 40]              # chunk [0, 20): 0-12, 12-20; [20, 40): 20-32, 32-40; [40, 50)
    assert torch.equal(slot.views(a)[0], final)


def test_piecewise_adamw_is_bit_identical_and_reports_prefixes():
    from hf_slideformer import optim
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


def test_staged_copy_casts_through_a_small_stage_bit_exactly():
    """Any stage size gives the direct cast: chunks of the stage, each cast once."""
    src = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    for m in (1, 7, 999, 1000, 4096):
        dst = torch.empty(1000, dtype=torch.bfloat16)
        staged_copy(dst, src, torch.empty(m))
        assert torch.equal(dst, src.to(torch.bfloat16))
    grad = torch.randn(12, 5, dtype=torch.bfloat16, generator=None)
    host = torch.empty(60)
    staged_copy(host, grad, torch.empty(8))              # the d2h direction: widened, never narrowed
    assert torch.equal(host, grad.reshape(-1).float())


def test_slot_with_a_staging_buffer_holds_the_cast_weights():
    q = SlotQueue(1, 64, torch.bfloat16, Streams(torch.device("cpu")), staging=torch.empty(5))
    a = _unit("a", 23, 0)
    slot = q.load((a,))
    assert torch.equal(slot.views(a)[0], a.master.to(torch.bfloat16))
