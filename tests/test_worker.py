"""The CPU worker: tasks in submission order, their events set even when they fail, a failure
re-raised in the caller with the worker's traceback, close() dropping what is pending."""
import threading
import time

import pytest

from hf_slideformer.errors import NonFiniteGradientError
from hf_slideformer.host.worker import CpuWorker, WorkerError


@pytest.fixture
def worker():
    w = CpuWorker(1)
    yield w
    w.close()


def test_tasks_run_in_submission_order_and_set_their_events(worker):
    seen, events = [], [threading.Event() for _ in range(20)]
    gate = threading.Event()
    worker.submit(gate.wait)                          # everything below queues behind it
    for k, ev in enumerate(events):
        worker.submit(seen.append, k, done=(ev,))
    assert not any(ev.is_set() for ev in events)
    gate.set()
    worker.wait(events[-1])
    assert seen == list(range(20)) and all(ev.is_set() for ev in events)
    worker.join()


def test_a_failure_sets_its_events_and_is_raised_at_the_next_call(worker):
    def boom():
        raise ValueError("bad shard")

    done, later = threading.Event(), threading.Event()
    ran = []
    worker.submit(boom, done=(done,))
    worker.submit(ran.append, 1, done=(later,))
    assert done.wait(5) and later.wait(5)             # nobody waits forever on a failed task
    assert ran == []                                  # tasks after a failure do not run
    for call in (lambda: worker.wait(done), worker.join, lambda: worker.submit(ran.append, 2),
                 worker.raise_if_failed, worker.check_alive):
        with pytest.raises(WorkerError, match="bad shard") as info:
            call()
        assert "worker traceback" in str(info.value) and "in boom" in str(info.value)
        assert isinstance(info.value.__cause__, ValueError)


def test_a_non_finite_gradient_keeps_its_type(worker):
    def judge():
        raise NonFiniteGradientError("step 3: the gradient norm is inf")

    done = threading.Event()
    worker.submit(judge, done=(done,))
    with pytest.raises(NonFiniteGradientError, match="step 3"):
        worker.wait(done)


def test_busy_time_and_the_tracing_hook(worker):
    spans = []
    worker.on_task = lambda label, t0, t1: spans.append((label, t1 - t0))
    worker.submit(time.sleep, 0.05)
    worker.join()
    assert spans[0][0] == "sleep" and spans[0][1] >= 0.04 and worker.busy_s >= 0.04


def test_close_drops_pending_tasks_and_refuses_new_ones():
    w = CpuWorker(1)
    gate, ran = threading.Event(), []
    dropped = threading.Event()
    w.submit(gate.wait)
    w.submit(ran.append, 1, done=(dropped,))
    threading.Timer(0.3, gate.set).start()            # the running task finishes once close() has begun
    w.close()
    assert ran == [] and dropped.is_set()
    with pytest.raises(WorkerError, match="not running"):
        w.submit(ran.append, 2)
