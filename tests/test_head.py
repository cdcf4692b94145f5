"""The loss head (`head.py`): its gradient borrows the gradient ring, or a buffer of its own."""
import pytest
import torch

import hf_slideformer as hs
from helpers import batches, slow_down
from test_engine import LR, PARAM_TOL, train_both


def _wide_head_pair(tied=False, **slide_kw):
    """(reference, slid) llama whose lm_head (301 x 32) is about two layers' worth of parameters."""
    import copy
    from transformers import AutoModelForCausalLM
    from hf_slideformer.demo import tiny_config
    torch.manual_seed(0)
    cfg = tiny_config("llama", vocab_size=301, hidden_size=32, intermediate_size=16, num_hidden_layers=3,
                      tie_word_embeddings=tied)
    ref = AutoModelForCausalLM.from_config(cfg).float()
    ref.config.use_cache = False
    slid = hs.slide(copy.deepcopy(ref), hs.SlideConfig(device="cpu", dtype=torch.float32, **slide_kw))
    return ref, slid


@pytest.mark.parametrize("buffers,in_ring", [(2, False), (3, True), (4, True)])
@pytest.mark.parametrize("slow_head", [False, True])
def test_head_gradient_borrows_the_ring(buffers, in_ring, slow_head, monkeypatch):
    """With clipping the head's gradient lands in the first ring buffers when they hold it (else
    in a buffer of its own); the layers' gradients take the other buffers first, then wait for the
    head's task to hand its buffers back. A slowed head task must not see its gradient overwritten."""
    from hf_slideformer.engine.head import LossHead
    if slow_head:
        slow_down(monkeypatch, LossHead, "_head_task", 0.05)
    ref, slid = _wide_head_pair(grad_buffers=buffers, max_grad_norm=0.5)
    eng = slid.slide_engine
    n = eng.head_unit.numel
    assert -(-n // eng.grad_ring.size) == 3            # the head spans three ring buffers
    data = batches(4, pad=True, vocab=301)
    assert train_both(ref, slid, data, clip=0.5) < PARAM_TOL
    assert (eng.head.host_grad.data_ptr() == eng.grad_ring.slab.data_ptr()) is in_ring
    assert (eng.head.own_buffer is None) is in_ring
    assert all(ev.is_set() for ev in eng.grad_ring.free) and eng.head.ring == ()


@pytest.mark.parametrize("slow", ["none", "head_task", "update_task"])
def test_untied_head_is_updated_last_from_a_buffer_of_its_own(slow, monkeypatch):
    """Updates in backward: an untied head's update runs after the embedding's (the next forward
    needs the embedding and layer 0 first), from its own buffer (the ring is the layers'), and
    training equals the reference; slowed tasks change nothing."""
    from hf_slideformer.engine.head import LossHead
    from helpers import record_updates
    if slow != "none":
        slow_down(monkeypatch, LossHead, "_" + slow, 0.05)
    order = record_updates(monkeypatch)
    ref, slid = _wide_head_pair(grad_buffers=3)
    eng = slid.slide_engine
    assert eng.head.updates_last
    data = batches(3, pad=True, vocab=301)
    assert train_both(ref, slid, data) < PARAM_TOL
    eng.synchronize()
    assert eng.head.own_buffer is not None and eng.head.host_grad.data_ptr() != eng.grad_ring.slab.data_ptr()
    assert all(ev.is_set() for ev in eng.grad_ring.free) and eng.head.host_free.is_set()
    head, embed = eng.head_unit.name, eng.embed_unit.name
    steps, cur = [], []
    for name in order:
        cur.append(name)
        if name == head:
            steps, cur = steps + [cur], []
    assert len(steps) == len(data) and cur == [], order
    for step in steps:                  # per step: the embedding's table, the layers and its rows, then the head
        assert step[0] == embed and step.count(head) == 1 and len(step) == 3 + len(eng.layer_units), step
    # tied, or with clipping or accumulation: the head's update keeps its place at the front
    for kw in (dict(tied=True), dict(max_grad_norm=0.5), dict(gradient_accumulation_steps=2)):
        assert not _wide_head_pair(**kw)[1].slide_engine.head.updates_last


def test_head_ring_buffers_come_back_after_a_forward_without_backward():
    ref, slid = _wide_head_pair(grad_buffers=3, max_grad_norm=0.5)
    opt = slid.create_optimizer(lr=LR)
    data = batches(3, vocab=301)
    slid(**data[0])                                # gradients copied out, never consumed
    assert slid.slide_engine.head.ring == (0, 1, 2)
    loss = slid(**data[1]).loss                    # the stale ones are dropped, the ring reclaimed
    loss.backward()
    opt.step()
    slid.slide_engine.synchronize()                # every queued update has run
    assert all(ev.is_set() for ev in slid.slide_engine.grad_ring.free)


@pytest.mark.parametrize("clip", [None, 0.5])
def test_head_interrupted_before_its_copies_leaves_no_buffer_claimed(monkeypatch, clip):
    """An error (or Ctrl-C) while the head's gradients are being sent gives the ring buffers (with
    clipping) or its own buffer back: the next step runs instead of waiting for them forever."""
    ref, slid = _wide_head_pair(grad_buffers=3, max_grad_norm=clip)
    opt = slid.create_optimizer(lr=LR)
    eng = slid.slide_engine
    data = batches(2, vocab=301)
    real = type(eng.grad_ring).d2h

    def broken(self, grads, dsts, *a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(type(eng.grad_ring), "d2h", broken)
    with pytest.raises(KeyboardInterrupt):
        slid(**data[0])
    monkeypatch.setattr(type(eng.grad_ring), "d2h", real)
    assert eng.head.ring == () and all(ev.is_set() for ev in eng.grad_ring.free) and eng.head.host_free.is_set()
    slid(**data[1]).loss.backward()
    opt.step()
    eng.synchronize()


@pytest.mark.parametrize("buffers,in_ring", [(2, False), (3, True)])
def test_tied_head_gradient_with_accumulation_in_the_ring_or_its_own_buffer(buffers, in_ring):
    """With accumulation a tied lm_head's gradient joins the head's (norm + the (V, H) table): three
    ring buffers hold it, two do not and the head gets a buffer of its own; the same training either way."""
    ref, slid = _wide_head_pair(tied=True, grad_buffers=buffers, gradient_accumulation_steps=2, max_grad_norm=0.5)
    assert train_both(ref, slid, batches(4, pad=True, vocab=301), ga=2, clip=0.5) < PARAM_TOL
    eng = slid.slide_engine
    assert (eng.head.own_buffer is None) is in_ring
    assert eng.head.host_grad.numel() == eng.head_unit.numel + eng.embed_unit.numel


def test_removed_options_are_refused():
    """head_update='device' and update_order 'forward' / 'hybrid' measured no faster and were removed."""
    for name, value in (("head_update", "device"), ("update_order", "forward")):
        with pytest.raises(TypeError, match=name):
            hs.SlideConfig(device="cpu", **{name: value})


def test_a_forward_right_after_the_step_reads_the_head_updated(monkeypatch):
    """The untied head's update is still queued (slowed) when optimizer.step() returns: the next
    forward's head waits for it, and the loss is the reference's after the same step."""
    import math
    from hf_slideformer.engine.head import LossHead
    from helpers import losses_after_each_step, slow_down
    from test_engine import LOSS_RTOL
    slow_down(monkeypatch, LossHead, "_update_task", 0.2)
    ref, slid = _wide_head_pair(grad_buffers=3)
    data = batches(3, pad=True, vocab=301)
    for r, s in losses_after_each_step(ref, slid, data[:2], data[2], LR):
        assert math.isclose(s, r, rel_tol=LOSS_RTOL, abs_tol=1e-6), (s, r)
