"""The streams chosen once for a device: the CPU's behaviour, and the interface both kinds share."""
from types import SimpleNamespace

import pytest
import torch

from hf_slideformer.engine.telemetry import StepStats
from hf_slideformer.engine.transfer import CudaStreams, HostStreams, Streams

CPU = torch.device("cpu")


class _Stats:
    def __init__(self):
        self.bytes = {}

    def add_bytes(self, kind, nbytes):
        self.bytes[kind] = self.bytes.get(kind, 0) + nbytes


def test_the_factory_picks_host_streams_on_the_cpu():
    streams = Streams.for_device(CPU)
    assert isinstance(streams, HostStreams) and isinstance(streams, Streams)
    assert streams.h2d is None and streams.d2h is None and streams.compute is None
    assert streams.record().query() and streams.timing_event() is None
    with streams.on(streams.h2d):
        pass
    streams.hand_over([torch.ones(3)], streams.record())
    assert streams.owed == 0


def test_both_kinds_implement_the_whole_interface():
    assert not HostStreams.__abstractmethods__ and not CudaStreams.__abstractmethods__
    with pytest.raises(TypeError):
        Streams(CPU)                                  # the interface alone: use Streams.for_device


def test_host_streams_decide_on_the_host():
    streams = Streams.for_device(CPU)
    assert streams.skip_on_host(torch.tensor(1.0)) == (True, None)
    assert streams.skip_on_host(torch.tensor(0.0)) == (False, None)
    coef = streams.clip_coef(1.0, torch.tensor(16.0))
    assert isinstance(coef, float) and coef == 1.0 / (4.0 + 1e-6)
    assert streams.clip_coef(10.0, torch.tensor(16.0)) == 1.0
    assert streams.copy_marks() is None
    assert streams.balanced_update_share(SimpleNamespace(enabled=True)) == 0.0
    assert streams.plan_resident((False, 0), lambda: pytest.fail("measured on a CPU device")) == (False, 0)
    table = torch.arange(12.0).view(4, 3)
    ids = torch.tensor([2, 0])
    rows = streams.gather_rows(table, ids, lambda *args: pytest.fail("staged on a CPU device"))
    assert torch.equal(rows, table[ids])


def test_host_gradients_to_host_are_plain_copies():
    streams, stats = Streams.for_device(CPU), _Stats()
    grads = [torch.full((2, 2), 1.5, dtype=torch.bfloat16), None]
    dsts = [torch.empty(4), torch.ones(3)]
    norm, norm_dst = torch.tensor(9.0), torch.zeros(1)
    done = streams.gradients_to_host(grads, dsts, None, None, norm, norm_dst, None, stats)
    assert done.query()
    assert torch.equal(dsts[0], torch.full((4,), 1.5)) and torch.equal(dsts[1], torch.zeros(3))
    assert float(norm_dst[0]) == 9.0 and stats.bytes == {}        # no link crossed
    with pytest.raises(RuntimeError, match="without rounding"):
        streams.gradients_to_host([torch.ones(2)], [torch.empty(2, dtype=torch.bfloat16)], None, None, norm, None,
                                  None, stats)


class _Stream:
    def __init__(self, *args, **kwargs):
        self.waited = []

    def wait_event(self, event):
        self.waited.append(event)


def test_a_hand_over_is_settled_at_the_hand_over_its_hold_ends(monkeypatch):
    # device_update.py: [Why an update in the backward has streams of its own] a device layer's
    # gradients are held two hand-overs, every other copy source one.
    compute = _Stream()
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    streams = CudaStreams(torch.device("cuda", 0))
    assert streams.update_h2d is not streams.h2d and streams.update_d2h is not streams.d2h
    streams.hand_over([torch.ones(1)], "update", hold=2)
    streams.hand_over([torch.ones(1), torch.ones(1)], "layer")
    assert compute.waited == [] and streams.owed == 3             # the update is held past the next one
    streams.hand_over([torch.ones(1)], "next layer")
    assert compute.waited == ["update", "layer"] and streams.owed == 1
    streams.settle()
    assert compute.waited == ["update", "layer", "next layer"] and streams.owed == 0
    streams.hand_over([torch.ones(1)], "one")
    streams.hand_over([torch.ones(1)], "two")
    assert compute.waited[-1] == "one" and streams.owed == 1          # the default: the next hand-over


def test_copy_spans_are_timed_only_while_a_gpu_trace_is_recorded(monkeypatch):
    """`copy_span_start` records a timing event on the copy stream only while the tracer records a
    GPU trace; `copy_span_end` closes it with a second event on the stream it names and hands both,
    with the label, to the tracer. The CPU's streams record nothing."""
    compute = _Stream()
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    recorded = []

    class _Event:
        def __init__(self, enable_timing=False):
            self.timing = enable_timing

        def record(self, stream):
            recorded.append((self, stream))

    class _Tracer:
        tracing_gpu = False

        def __init__(self):
            self.spans = []

        def copy_span(self, start, end, label):
            self.spans.append((start, end, label))

    monkeypatch.setattr(torch.cuda, "Event", _Event)
    streams, tracer = CudaStreams(torch.device("cuda", 0)), _Tracer()
    assert streams.copy_span_start(streams.h2d) is None                  # no tracer yet
    streams.tracer = tracer
    assert streams.copy_span_start(streams.h2d) is None and not recorded  # not tracing
    streams.copy_span_end(None, streams.h2d, "fill:layer.0")
    tracer.tracing_gpu = True
    start = streams.copy_span_start(streams.update_h2d)
    assert start.timing and recorded == [(start, streams.update_h2d)]
    streams.copy_span_end(start, streams.update_d2h, "update:layer.3")
    (first, end, label), = tracer.spans
    assert first is start and end.timing and recorded[-1] == (end, streams.update_d2h) and label == "update:layer.3"
    host, stats = HostStreams(CPU), StepStats(cuda=False)
    host.tracer = stats
    stats.start_trace()
    assert host.copy_span_start(None) is None               # a CPU trace has no GPU spans to time
    assert stats.stop_trace() == []
