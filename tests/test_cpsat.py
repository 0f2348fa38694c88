"""CP-SAT on one layer: exact against brute force, proves the public instance, deterministic,
never worse than its hint, honest objective and bound, windows and migration modes."""

from itertools import combinations, product

import numpy as np
import pytest

from moe_place.placement import Placement, keep_unchanged_slots
from moe_place.problem import PlacementProblem
from moe_place.solvers.base import get_solver
from moe_place.solvers.bounds import windows_lower_bound
from moe_place.solvers.cpsat import LayerInstance, cpsat_layer
from moe_place.solvers.fast import fast_layer
from bruteforce import brute_force_layer  # tests/, beside this file

PUBLIC = np.array([600, 560, 120, 120, 20, 10, 10, 10], dtype=float)


def _instance(loads, gpus, slots, objective="max", quantile=0.9, current=None, **options):
    """The CP-SAT input of one layer with `loads` `[E]` or `[windows, E]`, through PlacementProblem."""
    loads = np.atleast_2d(np.asarray(loads, dtype=float))[:, None, :]
    if current is not None:
        current = Placement(np.asarray(current)[None], loads.shape[2], gpus)
    problem = PlacementProblem(loads, gpus, gpus * slots, window_objective=objective, quantile=quantile,
                               current=current, **options)
    return LayerInstance.of(problem, 0)


def _solve(loads, gpus, slots, hint=None, limit=10.0, **kwargs):
    instance = _instance(loads, gpus, slots, **kwargs)
    flat = instance.loads.sum(axis=0)
    if hint is None:
        hint = fast_layer(flat, gpus, gpus * slots)
    bound = windows_lower_bound(instance.loads, gpus, gpus * slots, instance.objective, instance.quantile)
    return instance, cpsat_layer(instance, hint, bound, limit)


def _true_load(phy2log, loads, gpus):
    """Busiest GPU per window `[windows]`, through Placement (independent of the solver's evaluation)."""
    loads = np.atleast_2d(loads)
    placement = Placement(np.tile(phy2log, (loads.shape[0], 1)), loads.shape[1], gpus)
    return placement.gpu_loads(loads).max(axis=1)


def _naive_windows_optimum(loads, gpus, slots, combine):
    """Every GPU picks S distinct experts; keep covers of all experts; combine window maxima. No pruning."""
    experts = loads.shape[1]
    best = np.inf
    for gpu_sets in product(list(combinations(range(experts), slots)), repeat=gpus):
        count = np.bincount([e for s in gpu_sets for e in s], minlength=experts)
        if count.min() < 1:
            continue
        share = loads / count
        per_window = np.array([max(share[t, list(s)].sum() for s in gpu_sets) for t in range(loads.shape[0])])
        best = min(best, combine(per_window))
    return best


def _tiny_cases(seed, count, integer=True):
    rng = np.random.default_rng(seed)
    while count:
        experts, gpus = int(rng.integers(2, 9)), int(rng.integers(1, 5))
        slots = int(rng.integers(1, experts + 1))
        if experts <= gpus * slots <= experts * gpus:
            loads = rng.integers(0, 100, experts).astype(float) if integer else rng.uniform(0, 10, experts)
            yield loads, gpus, slots
            count -= 1


@pytest.mark.parametrize("integer", [True, False], ids=["integer-loads", "fractional-loads"])
def test_exact_on_random_tiny_cases(integer):
    searched = 0
    for loads, gpus, slots in _tiny_cases(11 if integer else 12, 20, integer):
        optimum, _ = brute_force_layer(loads, gpus, slots)
        # The contiguous plan as hint (never the fast heuristic's): CP-SAT has to find the optimum.
        poor = Placement.contiguous(1, loads.size, gpus, num_redundant=gpus * slots - loads.size).phy2log[0]
        _, sol = _solve(loads, gpus, slots, hint=poor)
        searched += sol.detail["cp_status"] == "OPTIMAL"
        assert sol.status == "optimal", (loads, gpus, slots, sol.detail)
        assert sol.objective == pytest.approx(optimum, rel=1e-9), (loads, gpus, slots)
        assert sol.lower_bound <= optimum * (1 + 1e-12)
        assert sol.objective == pytest.approx(_true_load(sol.phy2log, loads, gpus).max(), rel=1e-12)
    assert searched >= 6  # the others: the contiguous plan already met the bound (e.g. one GPU)


def test_public_instance_proved_from_a_poor_hint():
    # Start from the contiguous plan (busiest 600 + 120): CP-SAT itself must reach and prove 590/3.
    poor = Placement.contiguous(1, 8, 8, num_redundant=8).phy2log[0]
    instance, sol = _solve(PUBLIC, 8, 2, hint=poor)
    assert instance.cost(poor) > 300
    assert sol.status == "optimal" and sol.detail["cp_status"] == "OPTIMAL"
    assert sol.detail["source"] == "cpsat"
    assert sol.objective == pytest.approx(590 / 3, rel=1e-12)
    assert sol.lower_bound == pytest.approx(590 / 3, rel=1e-9)
    assert sol.detail["exact_scale"]  # integer loads: the model's shares are exact


def test_deterministic_when_the_limit_stops_the_search():
    # From a poor hint CP-SAT's own search decides the plan; it is stopped by the limit, unproved.
    rng = np.random.default_rng(3)
    loads = rng.gamma(0.7, 100.0, 24).round()
    poor = Placement.contiguous(1, 24, 8, num_redundant=8).phy2log[0]
    runs = [_solve(loads, 8, 4, hint=poor, limit=0.3)[1] for _ in range(2)]
    assert runs[0].detail["cp_status"] == "FEASIBLE" and runs[0].detail["source"] == "cpsat"
    assert np.array_equal(runs[0].phy2log, runs[1].phy2log)
    assert runs[0].objective == runs[1].objective and runs[0].lower_bound == runs[1].lower_bound
    assert runs[0].detail["deterministic_time"] == runs[1].detail["deterministic_time"]


def test_never_worse_than_the_hint_and_bound_below_objective():
    rng = np.random.default_rng(5)
    loads = rng.gamma(0.5, 50.0, 32).round()
    for limit in (0.0, 0.2):
        instance, sol = _solve(loads, 16, 4, limit=limit)
        hint_cost = sol.detail["hint_objective"]
        assert sol.objective <= hint_cost * (1 + 1e-12)
        assert sol.lower_bound <= sol.objective
        assert sol.lower_bound >= loads.sum() / 16 * (1 - 1e-12)  # at least the average bound
        assert sol.objective == pytest.approx(_true_load(sol.phy2log, loads, 16).max(), rel=1e-12)
        Placement(sol.phy2log[None], 32, 16)  # valid: every expert present, no duplicate per GPU


@pytest.mark.parametrize("objective,combine", [("max", np.max), ("mean", np.mean)])
def test_windows_objectives_match_naive_enumeration(objective, combine):
    rng = np.random.default_rng(21)
    for _ in range(3):
        loads = rng.integers(0, 60, (3, 5)).astype(float)  # 3 windows, 5 experts on 3 GPUs x 2 slots
        optimum = _naive_windows_optimum(loads, 3, 2, combine)
        _, sol = _solve(loads, 3, 2, objective=objective)
        assert sol.status == "optimal"
        assert sol.objective == pytest.approx(optimum, rel=1e-9)
        assert sol.lower_bound <= optimum * (1 + 1e-12)
        assert sol.objective == pytest.approx(combine(_true_load(sol.phy2log, loads, 3)), rel=1e-12)


def test_quantile_objective_is_reported_as_quantile_with_a_valid_bound():
    rng = np.random.default_rng(8)
    loads = rng.integers(0, 60, (5, 6)).astype(float)
    _, sol = _solve(loads, 3, 3, objective="quantile", quantile=0.5)
    assert sol.objective == pytest.approx(np.quantile(_true_load(sol.phy2log, loads, 3), 0.5), rel=1e-12)
    assert sol.lower_bound <= _naive_windows_optimum(loads, 3, 3, lambda v: np.quantile(v, 0.5)) * (1 + 1e-12)


def test_migration_cap_keeps_unmoved_experts_in_their_slots():
    rng = np.random.default_rng(9)
    loads = rng.gamma(0.6, 80.0, 8).round()
    current = Placement.contiguous(1, 8, 4, num_redundant=4).phy2log[0]
    free_optimum, _ = brute_force_layer(loads, 4, 3)
    for cap in (0, 2, 4):
        instance, sol = _solve(loads, 4, 3, hint=current, current=current, max_moved_slots=cap)
        moved = sol.phy2log != current
        assert moved.sum() <= cap and sol.detail["moved_slots"] == moved.sum()
        # An expert a GPU keeps sits in the slot it had: a moved slot's old expert left that GPU.
        table, old = sol.phy2log.reshape(4, 3), current.reshape(4, 3)
        for g in range(4):
            for i in np.flatnonzero(moved.reshape(4, 3)[g]):
                assert old[g, i] not in table[g]
        assert sol.objective >= free_optimum * (1 - 1e-12) and sol.objective <= instance.cost(current)
        assert sol.status == "optimal"  # tiny: the capped problem is solved exactly
    # Unlimited moves reach the free optimum.
    _, sol = _solve(loads, 4, 3, hint=current, current=current)
    assert sol.objective == pytest.approx(free_optimum, rel=1e-9)


def test_move_cost_trades_load_for_moves():
    loads = np.array([90.0, 10, 10, 10, 10, 10, 10, 10])
    current = Placement.contiguous(1, 8, 4, num_redundant=4).phy2log[0]
    _, free = _solve(loads, 4, 3, current=current, move_cost_weight=0.0)
    _, dear = _solve(loads, 4, 3, current=current, move_cost_weight=1000.0)
    assert free.detail["moved_slots"] > 0 and free.objective < dear.objective
    assert dear.detail["moved_slots"] == 0 and np.array_equal(dear.phy2log, current)


def test_keep_unchanged_slots_only_reorders_within_gpus():
    current = np.array([0, 1, 2, 3, 4, 5])
    plan = np.array([2, 5, 1, 3, 0, 4])
    aligned = keep_unchanged_slots(plan, current, 3)
    assert np.array_equal(np.sort(aligned.reshape(2, 3), axis=1), np.sort(plan.reshape(2, 3), axis=1))
    # GPU 0 keeps 1 and 2 in their slots, 5 takes the free one; GPU 1 keeps 3 and 4, 0 fills in
    assert np.array_equal(aligned, [5, 1, 2, 3, 4, 0])


def test_registered_solver_plans_a_problem_layer():
    loads = np.stack([PUBLIC, PUBLIC[::-1]])[None]  # 1 window, 2 layers
    problem = PlacementProblem(loads, num_gpus=8, num_physical=16)
    solver = get_solver("cpsat")
    for layer in range(2):
        sol = solver.solve_layer(problem, layer, 5.0)
        assert sol.status == "optimal"
        assert sol.objective == pytest.approx(590 / 3, rel=1e-12)
        problem.placement(sol.phy2log[None])  # validates shape and contents


def test_registered_solver_respects_the_problem_move_cap():
    rng = np.random.default_rng(13)
    loads = rng.gamma(0.6, 80.0, (2, 1, 8)).round()  # 2 windows, 1 layer
    current = Placement.contiguous(1, 8, 4, num_redundant=4)
    problem = PlacementProblem(loads, num_gpus=4, num_physical=12, current=current, max_moved_slots=3)
    sol = get_solver("cpsat").solve_layer(problem, 0, 5.0)
    assert (sol.phy2log != current.phy2log[0]).sum() <= problem.max_moved_slots
    assert sol.detail["moved_slots"] == (sol.phy2log != current.phy2log[0]).sum()
    assert sol.objective == pytest.approx(_true_load(sol.phy2log, loads[:, 0], 4).max(), rel=1e-12)
    assert sol.lower_bound <= sol.objective


def test_hint_meeting_the_bound_is_returned_without_search():
    loads = np.full(8, 10.0)  # 8 equal experts on 4 GPUs x 2 slots: every plan is at the average bound
    _, sol = _solve(loads, 4, 2)
    assert sol.status == "optimal" and sol.detail["cp_status"] == "NOT_RUN"
    assert sol.objective == sol.lower_bound == 20.0


def test_wall_clock_stop_is_reported():
    rng = np.random.default_rng(3)
    loads = rng.gamma(0.7, 100.0, 24).round()
    instance = _instance(loads, 8, 4)
    poor = Placement.contiguous(1, 24, 8, num_redundant=8).phy2log[0]
    sol = cpsat_layer(instance, poor, windows_lower_bound(loads[None], 8, 32), time_limit_s=1000.0, wall_limit_s=0.5)
    assert sol.detail["wall_limit_hit"] and sol.detail["deterministic_time"] < 1000.0
    assert sol.objective <= instance.cost(poor) and sol.status == "feasible"
