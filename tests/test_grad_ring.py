"""The gradient ring: buffers taken in turn, and the d2h copy that never narrows a gradient."""
import pytest
import torch

from helpers import make_pair


def _ring(**kw):
    return make_pair("llama", False, grad_buffers=3, **kw)[1].slide_engine.grad_ring


def test_buffers_are_taken_in_turn_and_held_until_freed():
    ring = _ring()
    assert len(ring.buffers) == 3 and all(b.numel() == ring.size for b in ring.buffers)
    taken = [ring.claim_next() for _ in range(3)]
    assert taken == [0, 1, 2] and not any(ev.is_set() for ev in ring.free)
    ring.free[0].set()
    assert ring.claim_next() == 0 and not ring.free[0].is_set()


def test_a_wait_for_a_buffer_names_the_buffer_and_its_next_holder_in_the_trace(monkeypatch):
    import threading
    from hf_slideformer.engine.telemetry import MainClock, StepStats

    class Worker:                                  # the CPU worker as the clock sees it
        def raise_if_failed(self):
            pass

        def wait(self, event):
            event.wait()
    ring = _ring()
    stats = StepStats(cuda=False)
    stats.trace = []
    monkeypatch.setattr(ring.engine, "clock", MainClock(stats, None, Worker()))
    for _ in range(3):
        ring.claim_next("layer.5")
    threading.Timer(0.05, ring.free[0].set).start()            # the worker frees buffer 0 later
    assert ring.claim_next("layer.3") == 0
    (thread, label, t0, t1), = [e for e in stats.trace if e[1].startswith("main_wait:")]
    assert label == "main_wait:grad_buffer.ring0:layer.3" and t1 - t0 >= 0.04
    assert stats.wait_s["grad_buffer"] >= 0.04                   # slide_stats keeps one reason


def test_d2h_copies_as_is_or_widens_and_zeros_missing_gradients():
    ring = _ring()
    g16 = torch.randn(7, 5).to(torch.bfloat16)
    g32 = torch.randn(11)
    wide, same, missing = torch.empty(35), torch.empty(11), torch.full((4,), 3.0)
    ring.d2h([g16, g32, None], [wide, same, missing])
    assert torch.equal(wide, g16.float().reshape(-1))              # widening a bf16 value is exact
    assert torch.equal(same, g32) and torch.equal(missing, torch.zeros(4))


def test_d2h_never_narrows():
    ring = _ring()
    with pytest.raises(RuntimeError, match="without rounding"):
        ring.d2h([torch.randn(4)], [torch.empty(4, dtype=torch.bfloat16)])


def test_the_running_norm_lands_first():
    ring = _ring()
    eng = ring.engine
    eng.norm.dev.fill_(2.5)
    dst = torch.zeros(1)
    ring.d2h([torch.ones(3)], [torch.empty(3)], norm_dst=dst)
    assert float(dst) == 2.5
