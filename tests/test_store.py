"""The host store: units carved back to back out of one slab, parameters bound as views of the
masters (ties kept), optimizer state and gradient accumulators allocated on demand."""
import pytest
import torch
from torch import nn

from hf_slideformer.host import memory
from hf_slideformer.config import SlideConfig
from hf_slideformer.host.memory import HostMemoryError
from hf_slideformer.host.store import HostStore, ParamEntry, Unit


class Tiny(nn.Module):
    """An embedding tied to a head, and one layer between (3 units)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 3)
        self.lin = nn.Linear(3, 5)
        self.out = nn.Linear(3, 7, bias=False)
        self.out.weight = self.emb.weight


def _units(m: Tiny) -> list[Unit]:
    def entry(name, mod, attr, *more):
        p = getattr(mod, attr)
        return ParamEntry(name, p.shape, 0, p.numel(), [(mod, attr), *more], p)

    return [Unit("embed", "embed", 0, [entry("emb.weight", m.emb, "weight", (m.out, "weight"))]),
            Unit("layer.0", "layer", 1, [entry("lin.weight", m.lin, "weight"), entry("lin.bias", m.lin, "bias")]),
            Unit("head", "head", 2, [])]


def _store(m, **kw):
    return HostStore(_units(m), SlideConfig(device="cpu", dtype=torch.float32, check_host_memory=False, **kw))


def test_units_are_carved_back_to_back():
    m = Tiny()
    s = _store(m)
    embed, layer, head = s.units
    assert [e.offset for e in layer.entries] == [0, 15] and layer.numel == 20
    assert embed.numel == 21 and head.numel == 0 and s.numel == 41
    # the layers share one slab; the embedding's master is a buffer of its own
    assert layer.master.data_ptr() == s.master_slab.data_ptr() and s.master_slab.numel() == 20
    assert embed.master.numel() == 21 and embed.master.data_ptr() != s.master_slab.data_ptr()
    views = layer.views(layer.master)
    assert [v.shape for v in views] == [torch.Size([5, 3]), torch.Size([5])]
    assert views[1].data_ptr() == layer.master.data_ptr() + 15 * 4


def test_bound_parameters_are_the_masters_and_ties_are_kept():
    m = Tiny()
    m.lin.bias.requires_grad_(False)
    want = {n: p.detach().clone() for n, p in m.named_parameters(remove_duplicate=False)}
    s = _store(m)
    for u in s.units:                      # what slide() does: the masters take the weights, then bind
        for e, v in zip(u.entries, u.views(u.master)):
            v.copy_(e.param.detach())
    s.bind_parameters()
    embed, layer, _ = s.units
    assert m.out.weight is m.emb.weight                       # still one parameter
    assert m.emb.weight.data_ptr() == embed.master.data_ptr()
    assert m.lin.bias.data_ptr() == layer.master.data_ptr() + 15 * 4
    assert not m.lin.bias.requires_grad and m.lin.weight.requires_grad
    for n, p in m.named_parameters(remove_duplicate=False):
        assert torch.equal(p, want[n]), n
    layer.master[0] = 42.0                                    # a write to the master is a write to the model
    assert m.lin.weight[0, 0] == 42.0
    assert [p for p in s.params()] == [m.emb.weight, m.lin.weight, m.lin.bias]


def test_optimizer_state_is_allocated_once_and_zero():
    m = Tiny()
    s = _store(m)
    s.allocate_optimizer_state()
    embed, layer, _ = s.units
    for u in (embed, layer):
        assert u.exp_avg.shape == u.exp_avg_sq.shape == (u.numel,)
        assert not u.exp_avg.any() and not u.exp_avg_sq.any()
        assert [float(t) for t in u.steps] == [0.0] * len(u.entries)
        assert u.grad is None                                 # no accumulation, no clipping
    first = layer.exp_avg
    s.allocate_optimizer_state()
    assert layer.exp_avg is first


@pytest.mark.parametrize("kw", [dict(gradient_accumulation_steps=2), dict(max_grad_norm=1.0)])
def test_deferred_updates_get_gradient_accumulators_except_the_embedding(kw):
    m = Tiny()
    s = _store(m, **kw)
    s.allocate_optimizer_state()
    embed, layer, head = s.units
    assert embed.grad is None                                 # the engine's own
    assert layer.grad.shape == (20,) and not layer.grad.any() and head.grad.numel() == 0
    assert s.deferred


def test_a_store_that_cannot_fit_is_refused_before_allocating(monkeypatch):
    monkeypatch.setattr(memory, "available_host_bytes", lambda: 100)
    with pytest.raises(HostMemoryError, match="GiB of host memory"):
        HostStore(_units(Tiny()), SlideConfig(device="cpu", dtype=torch.float32))
