"""The slot queue's chunked loads (CPU: the same code path, every event already complete)."""
import torch

from hf_slideformer.engine.slots import SlotQueue, staged_copy
from hf_slideformer.host.store import ParamEntry, Unit
from hf_slideformer.engine.transfer import Streams


def _unit(name, numel, seed):
    u = Unit(name, "head", 0, [ParamEntry(name + ".w", torch.Size([numel]), 0, numel, [])], numel=numel)
    u.master = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    return u


def test_chunked_load_fills_the_slot_only_when_finished():
    q = SlotQueue(1, 64, torch.float32, Streams.for_device(torch.device("cpu")))
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
    q = SlotQueue(1, 64, torch.float32, Streams.for_device(torch.device("cpu")))
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
    q = SlotQueue(1, 64, torch.float32, Streams.for_device(torch.device("cpu")), waiter=waiter)
    q.chunk = 20
    slot = q.load((a,))
    assert seen == [0, 12, 20, 32, 40]              # chunk [0, 20): 0-12, 12-20; [20, 40): 20-32, 32-40; [40, 50)
    assert torch.equal(slot.views(a)[0], final)


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
    q = SlotQueue(1, 64, torch.bfloat16, Streams.for_device(torch.device("cpu")), staging=torch.empty(5))
    a = _unit("a", 23, 0)
    slot = q.load((a,))
    assert torch.equal(slot.views(a)[0], a.master.to(torch.bfloat16))
