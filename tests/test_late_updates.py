"""Late layer updates (late_updates.py): with updates in backward and the embedding on the host,
the first layers of a backward are updated when it ends, after the embedding, in forward order;
the training is the reference's either way."""

import pytest
import torch

from helpers import batches, losses_after_each_step, make_pair, record_updates, slow_down
from test_engine import PARAM_TOL, train_both


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("slow", [False, True])
def test_late_layers_are_updated_after_the_embedding_in_forward_order(tied, slow, monkeypatch):
    """An embedding of about two layers' parameters: the two top layers are late. Per step the
    worker updates the embedding's table (all but the batch's rows), the batch's rows, then layer
    0 (held behind them), layers 1 and 2 (late), in forward order, then an untied head (a tied one,
    the final norm, keeps its place at the front); with the worker's layer task slowed the result
    is the same, equal to plain PyTorch, and every buffer is free at the end."""
    from hf_slideformer.engine.placements import HostLayer
    if slow:
        slow_down(monkeypatch, HostLayer, "layer_task", 0.03)
    order = record_updates(monkeypatch)
    ref, slid = make_pair("llama", tied, cfg_kw=dict(vocab_size=301))
    eng = slid.slide_engine
    data = batches(3, pad=True)
    assert train_both(ref, slid, data) < PARAM_TOL
    eng.synchronize()
    assert eng.late.count == 2 and len(eng.late.buffers) == 2
    assert all(ev.is_set() for ev in eng.late.free) and all(ev.is_set() for ev in eng.grad_ring.free)
    names = [u.name for u in eng.layer_units]
    emb = eng.embed_unit.name
    step = [emb, emb + ":rows", names[0], names[1], names[2]]
    step = [eng.head_unit.name] + step if tied else step + [eng.head_unit.name]   # a tied head: its norm, first
    assert order == step * len(data), order


@pytest.mark.parametrize("kw", [dict(max_grad_norm=0.5), dict(gradient_accumulation_steps=2),
                                dict(resident_embedding=True, resident_layers=0)],
                         ids=["clip", "accumulate", "resident-embedding"])
def test_no_late_layers_without_a_whole_table_update_in_backward(kw, monkeypatch):
    """With clipping or accumulation the updates wait for optimizer.step(), and a resident
    embedding is updated on the device: no layer is late, and the updates keep backward order."""
    order = record_updates(monkeypatch)
    ref, slid = make_pair("llama", False, cfg_kw=dict(vocab_size=301), **kw)
    eng = slid.slide_engine
    ga = kw.get("gradient_accumulation_steps", 1)
    assert train_both(ref, slid, batches(2 * ga, pad=True), ga=ga, clip=kw.get("max_grad_norm")) < PARAM_TOL
    eng.synchronize()
    assert eng.late.count == 0 and eng.late.buffers == []
    if "resident_embedding" in kw:      # updates in backward, in backward order
        assert [n for n in order if n.startswith("layer")][:3] == ["layer.2", "layer.1", "layer.0"], order


def test_an_interrupted_backward_with_late_layers_held_goes_on_after_a_restore(monkeypatch, tmp_path):
    """An error below the late layers (their updates held, not yet queued): nothing hangs, the
    buffers come back, and after restoring the state training equals plain PyTorch's again."""
    import hf_slideformer as hs
    import hf_slideformer.engine.slide_engine as engine_mod
    ref, slid = make_pair("llama", False, cfg_kw=dict(vocab_size=301))
    eng = slid.slide_engine
    data = batches(3, pad=True)
    assert train_both(ref, slid, data[:1]) < PARAM_TOL
    opt = eng.optimizer                                    # train_both's
    hs.save_training_state(str(tmp_path), slid, opt)
    real = engine_mod.SlideEngine.layer_backward

    def fail(self, i, *a, **k):
        if i == 0:
            assert self.late.claimed == 2 and len(self.late.pending) == 3   # layers 2 and 1 held, and the head
            raise RuntimeError("device lost")
        return real(self, i, *a, **k)
    monkeypatch.setattr(engine_mod.SlideEngine, "layer_backward", fail)
    with pytest.raises(RuntimeError, match="device lost"):
        slid(**data[1]).loss.backward()
    monkeypatch.setattr(engine_mod.SlideEngine, "layer_backward", real)
    with pytest.raises(hs.SlideStateError, match="interrupted"):
        slid(**data[1]).loss.backward()
    assert eng.late.pending == [] and all(ev.is_set() for ev in eng.late.free)
    hs.load_training_state(str(tmp_path), slid, opt)
    slid(**data[1]).loss.backward()
    opt.step()
    opt.zero_grad()
    eng.synchronize()
    assert all(torch.isfinite(v).all() for v in slid.state_dict().values())


@pytest.mark.parametrize("setting,late", [(0, 0), (1, 1), (3, 3)])
def test_the_setting_picks_how_many_layers_are_late(setting, late, monkeypatch):
    """SlideConfig.late_layer_updates: 0 turns it off (backward order), N makes the top N layers
    late, and layer 0 then waits for the embedding's rows; the training is the reference's either way."""
    order = record_updates(monkeypatch)
    ref, slid = make_pair("llama", False, cfg_kw=dict(vocab_size=301), late_layer_updates=setting)
    eng = slid.slide_engine
    assert train_both(ref, slid, batches(2, pad=True)) < PARAM_TOL
    eng.synchronize()
    assert eng.late.count == late
    names = [u.name for u in eng.layer_units]
    emb = eng.embed_unit.name
    if late:                                         # layer 0 held behind the rows, then forward order
        step = [emb] + names[1:len(names) - late][::-1] + [emb + ":rows"] + names[:1] + names[max(1, len(names) - late):]
    else:                                            # backward order
        step = [emb] + names[::-1] + [emb + ":rows"]
    step += [eng.head_unit.name]
    assert order == step * 2, order


def test_a_forward_right_after_the_step_reads_the_late_layers_updated(monkeypatch):
    """optimizer.step() returns with the late layers' updates still queued (here slowed): a
    forward without gradients right after it waits for them, and its loss is the reference's
    after the same step; so is the next training step's."""
    import math

    from hf_slideformer.engine.placements import HostLayer
    from test_engine import LOSS_RTOL, LR
    slow_down(monkeypatch, HostLayer, "layer_task", 0.1)
    ref, slid = make_pair("llama", False, cfg_kw=dict(vocab_size=301))
    data = batches(3, pad=True)
    for r, s in losses_after_each_step(ref, slid, data[:2], data[2], LR):
        assert math.isclose(s, r, rel_tol=LOSS_RTOL, abs_tol=1e-6), (s, r)
    assert slid.slide_engine.late.count == 2
