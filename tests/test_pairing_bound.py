"""The pairing LP bound for 2 slots per GPU (bounds.pairing_lp_bound) against brute force."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_place.solvers.bounds import layer_lower_bound, pairing_lp_bound, pairing_lp_infeasible
from bruteforce import brute_force_layer  # tests/, beside this file


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


def test_pair_values_is_the_best_pairing_of_the_pieces():
    from itertools import permutations

    from moe_place.solvers.fast import pair_values

    rng = np.random.default_rng(11)
    for _ in range(20):
        gpus = int(rng.integers(1, 4))
        experts = int(rng.integers(1, 2 * gpus + 1))
        counts = np.ones(experts, dtype=np.int64)
        for e in rng.integers(0, experts, 2 * gpus - experts):
            counts[e] += 1
        values = rng.random(experts) * 10
        pieces = np.repeat(values, counts)
        best = min(max(p[2 * i] + p[2 * i + 1] for i in range(gpus)) for p in permutations(pieces))
        assert pair_values(values[None], counts[None], gpus)[0] == pytest.approx(best)


def test_fast_two_slots_matches_brute_force_often_and_never_beats_it():
    from moe_place.solvers.fast import fast_layer

    rng = np.random.default_rng(5)
    exact = 0
    for _ in range(40):
        loads, gpus = _random_layer(rng)
        optimum, _ = brute_force_layer(loads, gpus, 2)
        plan = fast_layer(loads, gpus, 2 * gpus).reshape(gpus, 2)
        assert (plan[:, 0] != plan[:, 1]).all()
        counts = np.bincount(plan.ravel(), minlength=loads.size)
        assert (counts >= 1).all()
        value = (loads / counts)[plan].sum(axis=1).max()
        assert value >= optimum * (1 - 1e-9)
        exact += value <= optimum * (1 + 1e-9)
    assert exact >= 36


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 12).flatmap(lambda g: st.tuples(
    st.just(g), st.lists(st.integers(0, 1000), min_size=g + 1, max_size=2 * g))))
def test_pair_replicas_keeps_counts_valid_and_never_worsens(case):
    from moe_place.solvers.bounds import apportion
    from moe_place.solvers.fast import pair_plan, pair_replicas, pair_values

    gpus, raw = case
    loads = np.array(raw, dtype=np.float64)
    start = apportion(loads[None], 2 * gpus, cap=gpus)[0]
    counts = pair_replicas(loads, start, gpus)
    assert counts.sum() == 2 * gpus and counts.min() >= 1 and counts.max() <= gpus
    value = pair_values((loads / counts)[None], counts[None], gpus)[0]
    assert value <= pair_values((loads / start)[None], start[None], gpus)[0] * (1 + 1e-12)
    plan = pair_plan(loads, counts, gpus)
    assert (plan[:, 0] != plan[:, 1]).all()
    assert (np.bincount(plan.ravel(), minlength=loads.size) == counts).all()


def test_fast_reports_the_pairing_bound_for_two_slot_layers():
    from moe_place.problem import PlacementProblem
    from moe_place.solvers import solve

    rng = np.random.default_rng(11)
    lifted = 0
    for _ in range(25):
        gpus = int(rng.integers(2, 5))
        experts = int(rng.integers(gpus + 1, 2 * gpus))  # some redundant slots: the count search matters
        loads = np.round(rng.pareto(1.0, experts) * 10) + 1
        optimum, _ = brute_force_layer(loads, gpus, 2)
        layer = solve(PlacementProblem(loads[None], gpus, 2 * gpus), "fast", None, 1).layers[0]
        base = layer_lower_bound(loads, gpus, 2 * gpus)
        assert min(base, layer.objective) <= layer.lower_bound <= optimum * (1 + 1e-9), (loads, gpus)
        lifted += layer.lower_bound > base * (1 + 1e-6)
    assert lifted >= 1  # bound 4 is what the solution reports, not only bounds 1-3


def test_pairing_ip_never_refutes_a_reachable_target_and_its_counts_pair_under_it():
    from moe_place.solvers.bounds import pairing_ip

    rng = np.random.default_rng(5)
    refuted = feasible = 0
    for _ in range(40):
        loads, gpus = _random_layer(rng)
        optimum, _ = brute_force_layer(loads, gpus, 2)
        if optimum <= 0:
            continue
        target = optimum * float(rng.uniform(0.85, 1.15))
        verdict, counts = pairing_ip(loads, gpus, 2 * gpus, target)
        if target >= optimum:
            assert verdict != "infeasible", (loads, gpus, target, optimum)
        if verdict == "feasible":
            feasible += 1
            assert counts.sum() == 2 * gpus and counts.min() >= 1 and counts.max() <= gpus
            pieces = np.sort(np.repeat(loads / counts, counts))
            assert (pieces + pieces[::-1]).max() <= target * (1 + 1e-6), (loads, gpus, counts, target)
        refuted += verdict == "infeasible"
    assert refuted >= 5 and feasible >= 5
