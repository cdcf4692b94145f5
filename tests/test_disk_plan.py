"""The split under host_memory_limit on its own: which layers keep which part of their state on
disk (disk_plan.split_layers; through slide() in tests/test_disk_placement.py)."""
import pytest

from hf_slideformer.disk.disk_plan import DiskSplit, split_layers
from hf_slideformer.disk.disk_record import StateRecord, layer_host_bytes
from hf_slideformer.disk.disk_store import MOMENTS, WHOLE, pool_buffers, record_bytes
from hf_slideformer.host.host_optim import state_format


def test_the_split_takes_the_fewest_last_layers_that_fit():
    """Moments first, the fewest last layers; then every layer's moments and the whole state of
    the fewest last layers (disk_plan.split_layers)."""
    layers = [100_000] * 6
    per, mom = record_bytes(100_000), record_bytes(100_000, MOMENTS)
    assert per == 3 * 401408 and mom == 2 * 401408
    assert pool_buffers(6) == 4 and pool_buffers(2) == 2
    assert split_layers(12 * 600_000, 0, layers) == DiskSplit(0, 0)                # everything fits
    # one to four layers' moments on disk take as much as they free (a buffer of one layer's
    # moments each): five
    assert split_layers(12 * 600_000 - 1, 0, layers) == DiskSplit(5, 0)
    five = 12 * 100_000 + 4 * 5 * 100_000 + 4 * mom
    assert split_layers(five, 0, layers) == DiskSplit(5, 0) and split_layers(five - 1, 0, layers) == DiskSplit(6, 0)
    six = 4 * 6 * 100_000 + 4 * mom
    assert split_layers(six, 0, layers) == DiskSplit(6, 0)
    # whole records in the buffers: the fifth whole layer is the first to free more than they take
    assert split_layers(six - 1, 0, layers) == DiskSplit(1, 5)
    assert split_layers(4 * per, 0, layers) == DiskSplit(0, 6) and split_layers(4 * per - 1, 0, layers) is None
    assert split_layers(4 * per + 7, 7, layers) == DiskSplit(0, 6)                 # what stays whatever split
    assert DiskSplit(2, 4).parts(7) == [None, MOMENTS, MOMENTS, WHOLE, WHOLE, WHOLE, WHOLE]


@pytest.mark.parametrize("name,master", [("adamw_8bit", 4), ("adamw_8bit_bf16", 2)])
def test_a_compact_format_s_records_hold_its_arrays_and_the_split_follows_their_bytes(name, master):
    """A compact format's record holds its 8-bit moments and their block scales (and its master
    in its dtype for the whole state), and the split counts those bytes: for the same limit it
    puts fewer layers on disk than fp32 AdamW, and none where the compact state fits whole."""
    fmt, n = state_format(name), 100_000                 # 391 blocks of 256
    mom = StateRecord(n, MOMENTS, fmt)
    assert mom.arrays == ("exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax")
    assert mom.nbytes == 2 * 102400 + 2 * 4096 == record_bytes(n, MOMENTS, fmt)   # 8-bit: 2 B/param, not 8
    whole = StateRecord(n, WHOLE, fmt)
    assert whole.arrays[0] == "master" and whole.layout[0] == (fmt.master_dtype, n)
    assert whole.nbytes == mom.nbytes + (401408 if master == 4 else 200704) and whole.master_bytes == whole.nbytes - mom.nbytes
    assert layer_host_bytes(n, None, fmt) == n * master + 2 * n + 2 * 4 * 391
    assert layer_host_bytes(n, MOMENTS, fmt) == n * master and layer_host_bytes(n, WHOLE, fmt) == 0
    layers = [n] * 6
    all_in = 6 * layer_host_bytes(n, None, fmt)
    assert split_layers(all_in, 0, layers, fmt) == DiskSplit(0, 0)
    for limit in (all_in, all_in - 1, 5 * n * master + 4 * mom.nbytes, 4 * whole.nbytes):
        compact, fp32 = split_layers(limit, 0, layers, fmt), split_layers(limit, 0, layers)   # fp32: 12 B/param
        assert compact is not None and (fp32 is None or (compact.whole <= fp32.whole and compact.layers <= fp32.layers
                                                         and compact != fp32))
    # as under fp32, one to four layers' moments take a buffer each of what they free: five
    assert split_layers(all_in - 1, 0, layers, fmt) == DiskSplit(5, 0)
    assert split_layers(4 * whole.nbytes - 1, 0, layers, fmt) is None
