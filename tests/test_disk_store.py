"""DiskStates on its own: the records, residency (pins, reads, writes behind, least
recently used eviction), and failures. The notes cited are disk_store.py's."""
import threading
import time

import pytest
import torch

from hf_slideformer.disk import DiskIOError
from hf_slideformer.disk.disk_store import MOMENTS, WHOLE, DiskStates, record_bytes
from hf_slideformer.host.store import Unit


def _units(n=3, numel=1000):
    out = []
    for i in range(n):
        u = Unit(f"layer.{i}", "layer", i + 1, [])
        u.numel = numel
        out.append(u)
    return out


@pytest.fixture
def states(tmp_path):
    s = DiskStates(_units(), str(tmp_path), buffers=2)
    yield s
    s.close()


def _write(s, u, value):
    with s.access(u, write=True):
        u.master.fill_(value)
        u.exp_avg.fill_(value + 1)
        u.exp_avg_sq.fill_(value + 2)


def test_a_moments_record_holds_the_moments_and_never_the_master(tmp_path):
    a, b, c = _units(3, numel=10_000)
    s = DiskStates([a, b, c], str(tmp_path), parts=[MOMENTS, WHOLE, WHOLE], buffers=2)
    a.master = torch.full((10_000,), 7.0)                 # a moments unit's master is the host store's
    assert s.file.payload_bytes(0) == record_bytes(10_000, MOMENTS) < s.file.payload_bytes(1)
    with s.access(a, write=True):
        assert not a.exp_avg.any() and a.exp_avg.numel() == 10_000
        a.exp_avg.fill_(1.0)
        a.exp_avg_sq.fill_(2.0)
    a.readers.append(type("Pending", (), {"query": lambda self: False})())   # copies read the host master:
    for u in (b, c):                                                         # they do not hold the buffer
        with s.access(u):
            pass
    assert not s.is_resident(a) and a.exp_avg is None and (a.master == 7).all()
    with s.access(a):                                      # read back
        assert (a.exp_avg == 1).all() and (a.exp_avg_sq == 2).all() and (a.master == 7).all()
    assert s.read_bytes == s.file.payload_bytes(0)
    assert s.stats()["disk_moment_layers"] == 1 and s.stats()["disk_layers"] == 3
    s.close()
    assert a.exp_avg is None and (a.master == 7).all()    # the master never left the host


def test_a_copy_reads_the_master_alone_and_an_update_the_rest(states):
    """[Why a copy reads the master alone]: a pin for a copy reads the first array; a pin for an
    update then reads the rest into the same buffer; the partial residency is never written."""
    a = states.units[0]
    _write(states, a, 10.0)
    _evict_all(states)
    read = states.read_bytes
    states.pin(a, whole=False)
    states.ready(a)
    assert (a.master == 10).all() and states.read_bytes - read == states.file.array_bytes(0)
    with pytest.raises(RuntimeError, match="master alone"):
        states.write_behind(a)
    states.pin(a)                                          # an update's pin: the moments come in too
    states.ready(a)
    assert (a.exp_avg == 11).all() and (a.exp_avg_sq == 12).all() and (a.master == 10).all()
    assert states.read_bytes - read == states.file.payload_bytes(0)
    states.unpin(a)
    states.unpin(a)
    _evict_all(states)
    states.read_ahead([a], whole=False)                    # a read-ahead for a copy: the master alone too
    states.pin(a)
    states.ready(a)
    assert (a.exp_avg_sq == 12).all() and states.read_bytes - read == 2 * states.file.payload_bytes(0)
    states.unpin(a)


def _evict_all(states):
    """Fill the buffers with the other units, so that units[0] is evicted."""
    for u in states.units[1:]:
        with states.access(u):
            pass
    assert not states.is_resident(states.units[0])


def test_a_unit_never_written_is_zeros_and_reads_back_what_was_written(states):
    a, b, c = states.units
    with states.access(a):
        assert not a.master.any() and not a.exp_avg_sq.any() and a.master.numel() == 1000
    for k, u in enumerate(states.units):
        _write(states, u, float(k))
    assert not states.is_resident(a) and a.master is None               # two buffers, three units: evicted
    with states.access(a):
        assert (a.master == 0).all() and (a.exp_avg == 1).all() and (a.exp_avg_sq == 2).all()
    assert states.read_bytes == states.file.payload_bytes(0)
    states.flush()


def test_the_least_recently_used_idle_unit_is_evicted_and_a_held_one_never(states):
    a, b, c = states.units
    for u in (a, b, c):
        _write(states, u, 1.0)
    states.pin(b)
    states.pin(c)                                     # a evicted earlier; b held, c took the other buffer
    got = []
    t = threading.Thread(target=lambda: (states.pin(a), got.append(a.master.clone())))
    t.start()
    time.sleep(0.05)
    assert not got                                    # both buffers held: the pin waits ([Why pinning cannot deadlock])
    states.unpin(c)
    t.join(5)
    assert got and states.is_resident(a) and states.is_resident(b) and not states.is_resident(c)
    states.unpin(a)
    states.unpin(b)


def test_a_buffer_stays_while_a_device_copy_still_reads_it(states):
    """[Why a disk unit's state is in one place at a time]: an unpinned unit whose master a copy
    still reads (an event not yet complete in `readers`) is not evicted."""
    a, b, c = states.units

    class Pending:
        done = False

        def query(self):
            return self.done
    ev = Pending()
    _write(states, a, 1.0)
    _write(states, b, 2.0)
    a.readers.append(ev)
    states.read_ahead([c])                           # never waits: b was the idle one
    assert states.is_resident(a) and states.is_resident(c) and not states.is_resident(b)
    states.read_ahead([b])                           # c, only read ahead, is idle: it goes
    assert states.is_resident(a) and states.is_resident(b) and not states.is_resident(c)
    ev.done = True
    states.read_ahead([c])                           # now a, the least recently used, goes
    assert states.is_resident(c) and not states.is_resident(a)


def test_read_ahead_never_evicts_what_it_is_asked_for(states):
    a, b, c = states.units
    for u in (a, b, c):
        _write(states, u, 3.0)
    states.read_ahead([a, b, c])                     # a is not resident, b and c are asked for too: nothing
    assert not states.is_resident(a) and states.is_resident(b) and states.is_resident(c)
    states.read_ahead([a])
    assert states.is_resident(a) and not states.is_resident(b)
    with states.access(a):
        assert (a.master == 3).all()


def test_a_failed_write_keeps_the_buffer_and_is_raised(states, monkeypatch):
    a, b, c = states.units
    _write(states, a, 1.0)

    def broken(self, *args):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(type(states.file), "_write", broken)
    with pytest.raises(OSError, match="No space left"):
        _write(states, a, 5.0)
    assert states.is_resident(a) and (a.master == 5).all()    # the buffer is the state: never dropped
    with pytest.raises(OSError, match="No space left"):
        states.pin(b)
    with pytest.raises(DiskIOError, match="No space left"):
        states.flush()


def test_close_drops_the_views(tmp_path):
    s = DiskStates(_units(2), str(tmp_path), buffers=2)
    a, _ = s.units
    _write(s, a, 1.0)
    s.read_ahead([a])
    s.close()
    assert a.master is None and a.exp_avg is None
    with pytest.raises(Exception):
        s.pin(a)
