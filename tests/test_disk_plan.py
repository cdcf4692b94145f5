"""The split under host_memory_limit on its own: which layers keep which part of their state on
disk (disk_plan.split_layers; through slide() in tests/test_disk_placement.py)."""
from hf_slideformer.disk_plan import DiskSplit, split_layers
from hf_slideformer.disk_store import MOMENTS, WHOLE, pool_buffers, record_bytes


def test_the_split_takes_the_fewest_last_layers_that_fit():
    """Moments first, the fewest last layers; then every layer's moments and the whole state of
    the fewest last layers (disk_plan.split_layers)."""
    layers = [100_000] * 6
    per, mom = record_bytes(100_000), record_bytes(100_000, MOMENTS)
    assert per == 3 * 401408 and 2 * 401408 <= mom <= 2 * 401408 + 8192
    assert pool_buffers(6) == 4 and pool_buffers(2) == 2
    assert split_layers(12 * 600_000, 0, layers) == DiskSplit(0, 0)                # everything fits
    # one to four layers' moments on disk take as much as they free (a buffer of one layer's
    # moments each): five
    assert split_layers(12 * 600_000 - 1, 0, layers) == DiskSplit(5, 0)
    five = 12 * 100_000 + 4 * 5 * 100_000 + 4 * mom
    assert split_layers(five, 0, layers) == DiskSplit(5, 0) and split_layers(five - 1, 0, layers) == DiskSplit(6, 0)
    six = 4 * 6 * 100_000 + 4 * mom
    assert split_layers(six, 0, layers) == DiskSplit(6, 0)
    # whole records in the buffers: the fourth whole layer is the first to free more than they take
    assert split_layers(six - 1, 0, layers) == DiskSplit(2, 4)
    assert split_layers(4 * per, 0, layers) == DiskSplit(0, 6) and split_layers(4 * per - 1, 0, layers) is None
    assert split_layers(4 * per + 7, 7, layers) == DiskSplit(0, 6)                 # what stays whatever split
    assert DiskSplit(2, 4).parts(7) == [None, MOMENTS, MOMENTS, WHOLE, WHOLE, WHOLE, WHOLE]
