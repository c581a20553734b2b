"""The state-dict questions every layer asks, answered once in pipeline.core.arrays."""
import numpy as np

from pipeline import averaging
from pipeline.core import arrays
from pipeline.outputs import checkpoint
from pipeline.core.state import HostState


def test_one_is_float_and_one_first_nonfinite_behind_every_front():
    assert averaging.is_float is arrays.is_float
    assert averaging.first_nonfinite is arrays.first_nonfinite


def test_a_complex_nan_is_found_by_the_averaging_front_and_by_checkpoints_alike():
    state = {"/W": np.ones(2, np.float32), "/z": np.array([1j, complex("nan")]),
             "/N": np.array(3)}
    assert averaging.first_nonfinite(state) == "/z" and not averaging.is_finite(state)
    assert checkpoint.first_nonfinite(HostState(0, [state], [None], None)) == "/z"
    assert averaging.first_nonfinite({"/W": np.ones(2), "/N": np.array(3)}) is None
