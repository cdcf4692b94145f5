"""BackwardMode (mode.py): one backward's mode from the step's settings."""
import dataclasses

import pytest

from hf_slideformer.mode import BackwardMode


@pytest.mark.parametrize("micro,ga,clip,ends,updates", [
    (0, 1, False, True, True),      # one micro-batch, no clipping: updates as gradients land
    (0, 1, True, True, False),      # clipping needs the global norm first
    (0, 2, False, False, False),    # an early micro-batch only accumulates
    (1, 2, False, True, True),      # the last one updates in backward
    (1, 2, True, True, False),
])
def test_mode_of_a_backward(micro, ga, clip, ends, updates):
    m = BackwardMode.of(micro, ga, clipping=clip)
    assert (m.ends_step, m.updates) == (ends, updates)


def test_mode_is_frozen():
    m = BackwardMode.of(0, 1, clipping=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.updates = False
