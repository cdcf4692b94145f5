"""The host update's rate measurement (host_rate.py): it times the route the engine takes."""

import pytest

from hf_slideformer.host import host_rate
from hf_slideformer.host.host_adam import HostAdam


@pytest.mark.parametrize("mode", ["auto", "torch"])
def test_measure_rate_times_the_route_the_engine_takes(mode):
    r = host_rate.measure_rate(mode, threads=1, params=1 << 16, repeat=2)
    assert r.route == HostAdam(mode, threads=1).name
    assert (r.threads, r.params) == (1, 1 << 16)
    assert 0 < r.params_per_s < float("inf")
    assert r.describe() == f"measured here: the {r.route} route, 1 threads"


def test_measure_rate_refuses_bad_sizes():
    with pytest.raises(ValueError, match="params"):
        host_rate.measure_rate(params=10)
    with pytest.raises(ValueError, match="repeat"):
        host_rate.measure_rate(params=1 << 12, repeat=0)
    with pytest.raises(ValueError, match="host_adam"):
        host_rate.measure_rate("fast", params=1 << 12)


def test_measure_rate_takes_less_on_a_small_machine(monkeypatch):
    from hf_slideformer.host import memory

    monkeypatch.setattr(memory, "available_host_bytes", lambda: 4 * host_rate.STATE_BYTES * 5000)
    r = host_rate.measure_rate("torch", threads=1, params=1 << 20, repeat=1)
    assert r.params == 5000 and r.params_per_s > 0
