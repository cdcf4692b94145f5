"""BackwardMode and BackwardGuard (mode.py): one backward's mode, and an interrupted backward's mark."""
import dataclasses

import pytest

import hf_slideformer as hs
from hf_slideformer.engine.mode import BackwardMode


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


def test_guard_marks_an_interrupted_backward_until_both_halves_are_restored():
    from hf_slideformer.engine.mode import BackwardGuard
    released = []
    guard = BackwardGuard(lambda: released.append(1))
    guard.check()                                 # nothing open: fine
    guard.open = True                             # a backward began ... and an error stopped it
    with pytest.raises(hs.SlideStateError, match="interrupted"):
        guard.check()
    assert released == [1] and not guard.open
    guard.note_restored(weights=True)
    with pytest.raises(hs.SlideStateError):
        guard.check()                             # the optimizer state is still the interrupted step's
    guard.note_restored(optimizer=True)
    guard.check()
    assert released == [1]                        # released once
