"""Sliding window, hot-spot persistence and the double-buffered map switch."""

import numpy as np
import pytest

from moe_place.errors import InputError
from moe_place.online.switch import MapSwitch
from moe_place.online.window import HotSpotTracker, SlidingWindow
from moe_place.placement import Placement


def test_sliding_window_keeps_the_last_steps_in_order():
    w = SlidingWindow(3, 1, 2)
    for i in range(5):
        w.push(np.array([[i, 10 * i]]))
    assert w.num_steps == 3
    np.testing.assert_array_equal(w.last(3)[:, 0, 0], [2, 3, 4])
    np.testing.assert_array_equal(w.last(2)[:, 0, 1], [30, 40])
    np.testing.assert_array_equal(w.total(), [[9, 90]])
    with pytest.raises(InputError):
        w.push(np.zeros((2, 2)))


def test_hot_spot_persistence_is_measured_from_runs():
    tracker = HotSpotTracker(hot_factor=2.0, prior_steps=50, min_runs=2, interval_steps=10)
    load = np.ones((1, 4))
    # expert 0 hot for steps 0..30 (checked every 10 steps), then cold; twice
    step = 0
    for _ in range(2):
        for _ in range(4):
            tracker.update(step, np.array([[10.0, 1, 1, 1]]))
            step += 10
        tracker.update(step, load)
        step += 10
    runs = tracker.runs
    np.testing.assert_array_equal(runs, [40, 40])  # hot at 4 checks 10 steps apart
    assert tracker.expected_remaining_steps(0.0) == pytest.approx(runs[0])
    assert tracker.expected_remaining_steps(runs[0] / 2) == pytest.approx(runs[0] / 2)
    assert HotSpotTracker(prior_steps=77).expected_duration_steps() == 77


def _placement(row, gpus=2):
    return Placement(np.array([row]), 4, gpus)


def test_map_switch_keeps_the_old_map_until_in_flight_batches_drain():
    old, new = _placement([0, 1, 2, 3]), _placement([0, 2, 1, 3])
    switch = MapSwitch(old, drain_steps=2)
    assert switch.map_for_step(0) is old
    effective = switch.schedule(new, decided_at_step=0, staging_bytes=123)
    assert effective == 3 and switch.busy and switch.latest is new
    assert switch.map_for_step(1) is old and switch.map_for_step(2) is old
    with pytest.raises(InputError, match="one at a time"):
        switch.schedule(old, decided_at_step=2)
    assert switch.map_for_step(3) is new and not switch.busy
    with pytest.raises(InputError, match="shape"):
        switch.schedule(Placement(np.array([[0, 1, 2, 3, 0, 1]]), 4, 2), decided_at_step=4)
