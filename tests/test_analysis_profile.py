"""Per-layer expert-load profile: hand-computed values, degenerate layers, bad input."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from moe_place.analysis.profile import load_profile, max_over_mean, top_share
from moe_place.errors import InputError


def test_profile_of_a_hand_computed_layer():
    # loads 8, 4, 4, 0: mean 4, max 8, population std sqrt(8), one idle expert, top-1 share 8/16
    prof = load_profile(np.array([[8, 4, 4, 0], [1, 1, 1, 1]]), top_n=1)
    np.testing.assert_allclose(prof.max_over_mean, [2.0, 1.0])
    np.testing.assert_allclose(prof.cv, [np.sqrt(8) / 4, 0.0])
    np.testing.assert_array_equal(prof.zero_load_experts, [1, 0])
    np.testing.assert_allclose(prof.top_share, [0.5, 0.25])


def test_top_share_counts_the_n_largest_whatever_their_position():
    loads = np.array([[1, 9, 3, 7, 0]])
    np.testing.assert_allclose(top_share(loads, 2), [16 / 20])
    np.testing.assert_allclose(top_share(loads, 5), [1.0])


def test_an_idle_layer_counts_as_balanced():
    prof = load_profile(np.zeros((1, 6), dtype=np.int64), top_n=2)
    assert prof.max_over_mean[0] == 1.0 and prof.cv[0] == 0.0 and prof.top_share[0] == 0.0
    assert prof.zero_load_experts[0] == 6


@pytest.mark.parametrize("loads, top_n", [
    (np.array([[1.0, np.nan]]), 1),
    (np.array([[1, -1]]), 1),
    (np.array([1, 2, 3]), 1),
    (np.array([[1, 2, 3]]), 4),
    (np.array([[1, 2, 3]]), 0),
])
def test_bad_loads_or_top_n_raise_input_error(loads, top_n):
    with pytest.raises(InputError):
        load_profile(loads, top_n)


@settings(max_examples=60, deadline=None)
@given(arrays(np.int64, st.tuples(st.integers(1, 4), st.integers(1, 40)), elements=st.integers(0, 1000)),
       st.integers(1, 40))
def test_profile_invariants(loads, top_n):
    top_n = min(top_n, loads.shape[1])
    prof = load_profile(loads, top_n)
    assert (prof.max_over_mean >= 1 - 1e-12).all()
    assert (prof.max_over_mean <= loads.shape[1] + 1e-9).all()
    assert ((prof.top_share >= 0) & (prof.top_share <= 1 + 1e-12)).all()
    busy = loads.sum(axis=1) > 0
    # the hottest top_n carry at least their fair share top_n/E of a busy layer
    assert (prof.top_share[busy] >= top_n / loads.shape[1] - 1e-12).all()
    np.testing.assert_allclose(max_over_mean(loads.astype(float))[busy],
                               loads.max(axis=1)[busy] / loads.mean(axis=1)[busy])
