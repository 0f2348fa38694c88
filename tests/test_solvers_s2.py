"""The pairing LP bound for 2 slots per GPU (bounds.pairing_lp_bound) against brute force."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_place.solvers.bounds import layer_lower_bound, pairing_lp_bound, pairing_lp_infeasible
from moe_place.solvers.bruteforce import brute_force_layer


def _random_layer(rng: np.random.Generator) -> tuple[np.ndarray, int]:
    gpus = int(rng.integers(1, 5))
    experts = int(rng.integers(max(2, gpus), min(8, 2 * gpus) + 1))
    loads = np.round(rng.pareto(1.2, experts) * 10)
    return loads, gpus


def test_pairing_bound_never_above_brute_force_and_often_tighter():
    rng = np.random.default_rng(7)
    tighter = 0
    for _ in range(80):
        loads, gpus = _random_layer(rng)
        optimum, _ = brute_force_layer(loads, gpus, 2)
        lower = layer_lower_bound(loads, gpus, 2 * gpus)
        bound = pairing_lp_bound(loads, gpus, 2 * gpus, lower, 1.5 * optimum + 1, rel_tol=1e-6)
        assert lower <= bound <= optimum * (1 + 1e-9), (loads, gpus, optimum, bound)
        tighter += bound > lower * (1 + 1e-6)
    assert tighter >= 5  # it proves more than bounds 1-3 on a good share of layers


def test_pairing_test_accepts_the_optimum_and_rejects_below_the_bound():
    rng = np.random.default_rng(3)
    for _ in range(30):
        loads, gpus = _random_layer(rng)
        optimum, _ = brute_force_layer(loads, gpus, 2)
        assert not pairing_lp_infeasible(loads, gpus, 2 * gpus, optimum)
        if optimum > 0:
            assert pairing_lp_infeasible(loads, gpus, 2 * gpus, 0.5 * loads.sum() / gpus)


def test_eight_experts_on_four_gpus():
    loads = np.array([600, 560, 120, 120, 20, 10, 10, 10], dtype=np.float64)
    optimum, _ = brute_force_layer(loads, 4, 2)
    lower = layer_lower_bound(loads, 4, 8)
    bound = pairing_lp_bound(loads, 4, 8, lower, 2 * optimum, rel_tol=1e-7)
    assert lower <= bound <= optimum * (1 + 1e-9)


def test_pairing_bound_needs_two_slots():
    with pytest.raises(ValueError):
        pairing_lp_bound(np.ones(6), 2, 6, 1.0, 5.0)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4).flatmap(lambda g: st.tuples(
    st.just(g), st.lists(st.integers(0, 60), min_size=max(2, g), max_size=min(8, 2 * g)))))
def test_pairing_bound_property(case):
    gpus, raw = case
    loads = np.array(raw, dtype=np.float64)
    optimum, _ = brute_force_layer(loads, gpus, 2)
    lower = layer_lower_bound(loads, gpus, 2 * gpus)
    bound = pairing_lp_bound(loads, gpus, 2 * gpus, lower, 2 * optimum + 1, rel_tol=1e-6)
    assert bound <= optimum * (1 + 1e-9)
