"""Persistence of hot experts over windows, and window summing."""

import numpy as np
import pytest

from moe_place.analysis.persistence import hot_overlap, hot_sets, persistence, run_lengths
from moe_place.analysis.windows import window_loads
from moe_place.errors import InputError


def test_hot_sets_take_the_top_n_and_break_ties_by_lower_id():
    hot = hot_sets(np.array([[5, 1, 5, 3], [0, 0, 0, 0]]), 2)
    np.testing.assert_array_equal(hot, [[True, False, True, False], [True, True, False, False]])


def test_run_lengths_of_a_hand_pattern():
    # windows x experts; expert 0 hot in windows 0,1 then 3; expert 1 in 1,2,3; expert 2 never
    hot = np.array([[1, 0, 0], [1, 1, 0], [0, 1, 0], [1, 1, 0]], dtype=bool)
    assert sorted(run_lengths(hot).tolist()) == [1, 2, 3]
    np.testing.assert_allclose(hot_overlap(hot), [1 / 1, 1 / 2, 1 / 1])


def test_persistence_of_a_fixed_hot_set_and_of_a_rotating_one():
    windows, experts = 6, 16
    fixed = np.ones((windows, 1, experts))
    fixed[:, 0, [3, 7]] = 50
    moving = np.ones((windows, 1, experts))
    for w in range(windows):
        moving[w, 0, [2 * w, 2 * w + 1]] = 50  # a new pair of hot experts every window
    steady = persistence(np.concatenate([fixed, moving], axis=1), top_n=2)
    np.testing.assert_allclose(steady.mean_run, [6, 1])
    np.testing.assert_allclose(steady.max_run, [6, 1])
    np.testing.assert_allclose(steady.mean_overlap, [1.0, 0.0])
    assert steady.num_windows == windows


def test_one_window_has_no_overlap():
    pers = persistence(np.arange(8).reshape(1, 1, 8), top_n=3)
    assert np.isnan(pers.mean_overlap[0]) and pers.mean_run[0] == 1


def test_window_loads_sum_consecutive_steps_and_drop_a_partial_window():
    counts = np.arange(5 * 2 * 3).reshape(5, 2, 3)
    windows = window_loads(counts, 2)
    assert windows.shape == (2, 2, 3)
    np.testing.assert_array_equal(windows[1], counts[2] + counts[3])
    np.testing.assert_array_equal(window_loads(counts, 1), counts)
    with pytest.raises(InputError):
        window_loads(counts, 6)
    with pytest.raises(InputError):
        window_loads(counts, 0)


@pytest.mark.parametrize("seed", range(5))
def test_per_layer_run_statistics_match_a_loop_over_each_experts_windows(seed):
    rng = np.random.default_rng(seed)
    windows, layers, experts, top_n = int(rng.integers(1, 9)), int(rng.integers(1, 6)), 12, int(rng.integers(1, 5))
    loads = rng.integers(0, 4, size=(windows, layers, experts))  # small values: many ties
    pers = persistence(loads, top_n)
    for layer in range(layers):
        runs = []
        for expert in range(experts):
            hot = [expert in np.argsort(-loads[w, layer], kind="stable")[:top_n] for w in range(windows)]
            length = 0
            for flag in hot + [False]:
                if flag:
                    length += 1
                elif length:
                    runs.append(length)
                    length = 0
        assert pers.mean_run[layer] == pytest.approx(sum(runs) / len(runs))
        assert pers.median_run[layer] == pytest.approx(float(np.median(runs)))
        assert pers.max_run[layer] == max(runs)
