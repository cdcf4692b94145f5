"""Placements: every layer's place is one object, and the schedule goes through it alone."""
import torch

import hf_slideformer as hs
from hf_slideformer.engine.device_update import DeviceUpdateLayer
from hf_slideformer.engine.placements import HostLayer, LayerPlacement
from hf_slideformer.engine.resident import ResidentLayer
from helpers import batches, make_pair, max_param_diff

LR = 1e-2


def _train(model, data, **opt_kw):
    opt = model.create_optimizer(lr=LR, **opt_kw)
    for b in data:
        model(**b).loss.backward()
        opt.step()
        opt.zero_grad()
    return opt


def test_layers_start_on_the_host_and_move_whole():
    """Every layer starts as a HostLayer; the plan swaps in ResidentLayers (keeping the host
    placement to return to), and writing the state back swaps them out again."""
    _, slid = make_pair("llama", False, resident_layers=2)
    eng = slid.slide_engine
    assert all(type(p) is HostLayer for p in eng.places)
    _train(slid, batches(2))
    assert [type(p) for p in eng.places[:2]] == [ResidentLayer, ResidentLayer]
    assert all(type(p) is HostLayer for p in eng.places[2:])
    assert sorted(eng.residents.layers) == [0, 1] and eng.residents.layers[0] is eng.places[0].state
    host = eng.places[0].replaced
    slid.state_dict()                                 # writes the resident state back
    assert eng.places[0] is host and not eng.residents.layers


def test_device_updated_layers_are_placements():
    """With clipping and a device-update share, the chosen layers become DeviceUpdateLayers; a
    change of the clipping mode gives them back to the host."""
    _, slid = make_pair("llama", False, max_grad_norm=1.0, device_update_share=0.5)
    eng = slid.slide_engine
    _train(slid, batches(2))
    chosen = [i for i, p in enumerate(eng.places) if isinstance(p, DeviceUpdateLayer)]
    assert chosen and eng.device_updates.units == {eng.layer_units[i].index for i in chosen}
    eng.configure_steps(1, None)
    assert not any(isinstance(p, DeviceUpdateLayer) for p in eng.places)


class Recording(HostLayer):
    """A HostLayer that logs what the schedule asks of it."""

    log: list = []

    def weights(self, busy=()):
        self.log.append(("weights", self.unit.name))
        return super().weights(busy)

    def take_gradient(self, grads):
        self.log.append(("take_gradient", self.unit.name))
        super().take_gradient(grads)

    def step(self, deferred):
        self.log.append(("step", self.unit.name))
        super().step(deferred)


def test_a_new_placement_is_one_subclass():
    """A subclass put in `places` is asked for the weights of every forward and recompute, gets
    every gradient and every deferred update, and the training is the same as without it."""
    ref, slid = make_pair("llama", False, max_grad_norm=0.5)
    _, plain = make_pair("llama", False, max_grad_norm=0.5)
    eng = slid.slide_engine
    eng.places[1] = Recording(eng, eng.layer_units[1])
    Recording.log = []
    data = batches(3)
    _train(slid, data)
    _train(plain, data)
    name = eng.layer_units[1].name
    assert Recording.log.count(("weights", name)) == 6          # 3 forwards + 3 recomputes
    assert Recording.log.count(("take_gradient", name)) == 3
    assert Recording.log.count(("step", name)) == 3             # clipping: the update waits for step()
    assert max_param_diff(slid, plain) == 0.0


def test_the_base_placement_names_what_a_subclass_must_give():
    eng = make_pair("llama", False)[1].slide_engine
    p = LayerPlacement(eng, eng.layer_units[0])
    for call in (lambda: p.take_gradient([]), lambda: p.step(None)):
        try:
            call()
        except NotImplementedError:
            continue
        raise AssertionError("the base placement must not take a gradient or an update")


def test_layer_update_waits_only_for_the_gradient_copies_it_reads(monkeypatch):
    """With one d2h event per gradient (CUDA), each piece of a layer's update first waits for the
    copies covering it, and no later one: checked with stand-in events on the CPU."""
    from hf_slideformer.host import host_tasks
    monkeypatch.setattr(host_tasks, "UPDATE_PIECE", 256)
    results = []
    for with_marks in (False, True):
        _, slid = make_pair("llama", False)
        eng = slid.slide_engine
        opt = slid.create_optimizer(lr=LR, weight_decay=0.1)
        hp = opt.snapshot()
        u = eng.layer_units[0]
        src = torch.randn(u.numel, generator=torch.Generator().manual_seed(5))
        log = []

        class Ev:
            def __init__(self, end):
                self.end = end

            def synchronize(self):
                log.append(("sync", self.end))
        ends = [e.offset + e.numel for e in u.entries]
        marks = [(end, Ev(end)) for end in ends] if with_marks else None
        orig = u.set_progress
        u.set_progress = lambda n: (log.append(("done", n)), orig(n))
        eng.begin_update(u)
        # update=True, host_norms=False: one backward per step (BackwardPlan)
        eng.places[0].layer_task(src, Ev(u.numel), True, False, hp, marks)
        results.append(u.master.clone())
        if with_marks:
            synced = 0
            for kind, n in log:
                if kind == "sync":
                    synced = max(synced, n)
                elif n > 0:
                    assert synced >= n, log          # a finished prefix never runs ahead of its copies
            first_piece = next(n for kind, n in log if kind == "done" and n > 0)
            early = [n for kind, n in log[:log.index(("done", first_piece))] if kind == "sync"]
            assert max(early) < max(ends)            # it started before the last copy was waited for
    assert torch.equal(results[0], results[1])
