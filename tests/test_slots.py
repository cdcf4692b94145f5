"""The slot queue's chunked loads (CPU: the same code path, every event already complete)."""
import torch

from hf_slideformer.slots import SlotQueue
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
