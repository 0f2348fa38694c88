"""Solvers: invariants on every registered solver, bounds against brute force, fast, evaluate, solve."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_place.errors import InputError
from moe_place.placement import Placement, has_colocation
from moe_place.problem import PlacementProblem
from moe_place.solvers import AUTO_GAP, get_solver, solve, solver_names
from moe_place.solvers.bounds import (apportion, average_bound, count_bound, layer_lower_bound, lower_bounds,
                                      windows_lower_bound)
from moe_place.solvers.deepseek import eplb_rebalance
from moe_place.solvers.evaluate import (even_gpu_loads, evaluate_placement, layer_figures, local_gpu_loads,
                                        optimal_split)
from moe_place.solvers.fast import fast_layer, lpt_pack, target_pack
from bruteforce import brute_force_layer  # tests/, beside this file

TINY = [600, 560, 120, 120, 20, 10, 10, 10]
LIMIT_S = {"cpsat": 0.5}


def _busiest(phy2log, loads, gpus):
    """Independent count: the largest sum over a GPU's slots of load / replicas (plain loops)."""
    phy2log = [int(e) for e in phy2log]
    slots = len(phy2log) // gpus
    replicas = {e: phy2log.count(e) for e in set(phy2log)}
    return max(sum(float(loads[e]) / replicas[e] for e in phy2log[g * slots:(g + 1) * slots]) for g in range(gpus))


CASES = [  # (loads [layers, E], G, P)
    (np.array([TINY]), 8, 16),
    (np.array([TINY, TINY[::-1]]), 4, 8),                    # E == P: one copy each
    (np.array([[5.0, 1, 1, 1, 1, 1]]), 1, 6),               # one GPU
    (np.zeros((1, 6)), 3, 9),                                # idle layer
    (np.random.default_rng(3).integers(0, 1000, (3, 16)), 8, 24),
]


@pytest.mark.parametrize("name", sorted(set(solver_names()) - {"cpsat"}) + ["cpsat"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_invariants_every_solver(name, case):
    loads, gpus, physical = CASES[case]
    problem = PlacementProblem(loads, gpus, physical)
    solver = get_solver(name)
    for layer in range(problem.num_layers):
        sol = solver.solve_layer(problem, layer, LIMIT_S.get(name))
        row = sol.phy2log
        assert row.shape == (physical,) and row.dtype == np.int64
        counts = np.bincount(row, minlength=problem.num_experts)
        assert counts.min() >= 1 and counts.sum() == physical          # every expert, exact slot count
        colocated = has_colocation(row, gpus)
        assert colocated == bool(sol.detail.get("colocated", False))   # only eplb may, and says so
        Placement(row[None], problem.num_experts, gpus, allow_colocated=colocated)
        assert sol.objective == pytest.approx(_busiest(row, loads[layer], gpus), rel=1e-12, abs=1e-12)
        assert sol.lower_bound <= sol.objective * (1 + 1e-9) + 1e-12
        if physical == problem.num_experts:
            assert counts.tolist() == [1] * physical                   # identity set: one copy each
        if gpus == 1:
            assert sorted(row.tolist()) == list(range(problem.num_experts))
        if not loads[layer].any():
            assert sol.objective == 0.0 and sol.status == "optimal"


def test_tiny_instance_fast_reaches_optimum_eplb_does_not():
    problem = PlacementProblem(np.array([TINY]), 8, 16)
    assert get_solver("fast").solve_layer(problem, 0, None).objective == pytest.approx(590 / 3, rel=1e-12)
    assert get_solver("eplb").solve_layer(problem, 0, None).objective == pytest.approx(232.0)
    assert brute_force_layer(np.array(TINY, float), 8, 2)[0] == pytest.approx(590 / 3)


def test_bounds_never_exceed_brute_force_and_fast_never_below():
    rng = np.random.default_rng(7)
    checked = helped = 0
    while checked < 120:
        experts, gpus, slots = int(rng.integers(1, 8)), int(rng.integers(1, 5)), int(rng.integers(1, 4))
        if gpus * slots < experts or slots > experts:
            continue
        loads = rng.integers(0, 60, experts) * (rng.random(experts) < 0.85)
        optimum, _ = brute_force_layer(loads.astype(float), gpus, slots)
        bound = layer_lower_bound(loads, gpus, gpus * slots)
        assert bound <= optimum * (1 + 1e-9) + 1e-12, (loads, gpus, slots, bound, optimum)
        plan = fast_layer(loads, gpus, gpus * slots)
        assert _busiest(plan, loads, gpus) >= optimum * (1 - 1e-12) - 1e-12
        base = max(average_bound(loads, gpus), count_bound(loads[None], gpus, gpus * slots)[0])
        helped += bound > base * (1 + 1e-9)
        checked += 1
    assert helped > 0  # the pigeonhole bound is stronger than bounds 1-2 on some cases


def test_count_bound_is_the_exact_min_max_apportionment():
    rng = np.random.default_rng(1)
    for _ in range(50):
        experts = int(rng.integers(1, 12))
        physical = experts + int(rng.integers(0, 40))
        gpus = int(rng.integers(1, 6))
        loads = rng.integers(0, 100, (2, experts)).astype(float)
        replicas = np.ones((2, experts), dtype=np.int64)  # reference: one replica at a time
        for _ in range(physical - experts):
            e = np.argmax(loads / replicas, axis=1)
            replicas[np.arange(2), e] += 1
        got = apportion(loads, physical)
        assert got.sum(axis=1).tolist() == [physical, physical]
        assert np.allclose((loads / got).max(axis=1), (loads / replicas).max(axis=1))
        if physical <= experts * gpus:
            capped = apportion(loads, physical, cap=gpus)
            assert capped.max() <= gpus and capped.sum(axis=1).tolist() == [physical, physical]
            assert np.allclose(count_bound(loads, gpus, physical), (loads / capped).max(axis=1))
    assert count_bound(np.array([[600.0, 560, 120, 120, 20, 10, 10, 10]]), 8, 16)[0] == pytest.approx(120.0)


def test_pigeonhole_bound_without_redundancy_is_the_pair_bound():
    # 4 experts on 2 GPUs x 2 slots: some GPU holds two of the three largest: >= 8 + 7
    loads = np.array([[10.0, 8.0, 7.0, 0.0]])
    assert lower_bounds(loads, 2, 4)[0] == pytest.approx(15.0, rel=1e-6)
    assert lower_bounds(loads, 2, 4)[0] <= 15.0
    assert brute_force_layer(loads[0], 2, 2)[0] == pytest.approx(15.0)  # {10, 0}, {8, 7}: the bound is tight
    assert max(average_bound(loads, 2)[0], count_bound(loads, 2, 4)[0]) == pytest.approx(12.5)


def test_window_bound_aggregates_consistently():
    rng = np.random.default_rng(5)
    loads = rng.integers(0, 100, (4, 8)).astype(float)
    per = lower_bounds(loads, 4, 8)
    assert windows_lower_bound(loads, 4, 8, "max") >= per.max()
    assert windows_lower_bound(loads, 4, 8, "quantile", 0.5) == pytest.approx(np.quantile(per, 0.5))
    for objective in ("max", "mean", "quantile"):
        bound = windows_lower_bound(loads, 4, 8, objective, 0.5)
        for seed in range(30):  # no plan (random valid plans, fast's plan) beats the bound
            plan = np.random.default_rng(seed).permutation(8) if seed else fast_layer(loads.sum(0), 4, 8)
            busiest = even_gpu_loads(plan, loads, 4).max(axis=1)
            value = {"max": busiest.max(), "mean": busiest.mean(), "quantile": np.quantile(busiest, 0.5)}[objective]
            assert bound <= value * (1 + 1e-12)


def test_fast_never_worse_than_eplb_and_deterministic():
    rng = np.random.default_rng(11)
    for _ in range(25):
        gpus = int(rng.choice([2, 4, 8]))
        experts = int(rng.choice([8, 16]))
        physical = experts + gpus * int(rng.integers(0, 3))
        loads = np.round(rng.lognormal(0, 1.2, experts) * 100)
        problem = PlacementProblem(loads[None], gpus, physical)
        fast = get_solver("fast").solve_layer(problem, 0, None)
        eplb = get_solver("eplb").solve_layer(problem, 0, None)
        if not eplb.detail["colocated"]:
            assert fast.objective <= eplb.objective * (1 + 1e-12)
        # (a co-located EPLB plan leaves slots idle, which no valid plan may: it can be lower,
        # e.g. 646 vs 654.5 on 8 experts, 2 GPUs x 5 slots)
        assert np.array_equal(fast.phy2log, get_solver("fast").solve_layer(problem, 0, None).phy2log)


def test_lpt_and_target_pack_respect_slots_and_conflicts():
    loads = np.array(TINY, float)
    table = lpt_pack(loads, np.array([5, 5, 1, 1, 1, 1, 1, 1]), 8)
    assert table.shape == (8, 2) and all(len(set(row)) == 2 for row in table.tolist())
    packed = target_pack(loads, 8, 2, 590 / 3)
    assert packed is not None and _busiest(packed.ravel(), loads, 8) <= 590 / 3 * (1 + 1e-12)
    assert all(len(set(row)) == 2 for row in packed.tolist())
    assert target_pack(loads, 8, 2, 180.0) is None  # below the average: nothing fits


def test_migration_mode_respects_cost_and_cap():
    rng = np.random.default_rng(2)
    loads = np.round(rng.lognormal(0, 1.0, (1, 16)) * 100)
    current = Placement.contiguous(1, 16, 4, num_redundant=8)
    base = _busiest(current.phy2log[0], loads[0], 4)

    def plan(**kw):
        problem = PlacementProblem(loads, 4, 24, current=current, **kw)
        return get_solver("fast").solve_layer(problem, 0, None)

    free = plan()
    assert free.objective < base
    moved = free.phy2log != current.phy2log[0]
    assert free.detail["moved_slots"] == int(moved.sum())
    assert plan(max_moved_slots=0).phy2log.tolist() == current.phy2log[0].tolist()
    capped = plan(max_moved_slots=3)
    assert int((capped.phy2log != current.phy2log[0]).sum()) <= 3
    assert capped.objective <= base
    # a move must pay for itself: with a huge cost per slot nothing moves
    assert plan(move_cost_weight=1e9).phy2log.tolist() == current.phy2log[0].tolist()
    weight = 5.0
    priced = plan(move_cost_weight=weight)
    n = int((priced.phy2log != current.phy2log[0]).sum())
    assert priced.objective + weight * n <= base + 1e-9


def test_evaluate_splits():
    loads = np.array([[8.0, 4.0, 2.0, 2.0]])
    phy2log = np.array([0, 1, 0, 2, 0, 3])  # 3 GPUs x 2 slots; expert 0 on every GPU
    even = even_gpu_loads(phy2log, loads, 3)[0]
    assert even.tolist() == pytest.approx([8 / 3 + 4, 8 / 3 + 2, 8 / 3 + 2])
    local = local_gpu_loads(phy2log, loads, 3)[0]
    # expert 0 is on every GPU: each GPU serves its own third; expert 1 only on GPU 0: all of it
    assert local.tolist() == pytest.approx([8 / 3 + 4, 8 / 3 + 2, 8 / 3 + 2])
    assert local.sum() == pytest.approx(loads.sum())
    best = optimal_split(phy2log, loads[0], 3)[0]
    assert best == pytest.approx(16 / 3)  # expert 0 can move its load off GPU 0: (8+4+2+2)/3
    # local differs from even only with co-located replicas: expert 0 twice on GPU 0, once on GPU 1
    colocated = np.array([0, 0, 0, 1])
    assert even_gpu_loads(colocated, np.array([6.0, 3.0]), 2)[0].tolist() == pytest.approx([4, 5])
    # each GPU keeps its own 3 of expert 0; expert 1 only on GPU 1: all of it there
    assert local_gpu_loads(colocated, np.array([6.0, 3.0]), 2)[0].tolist() == pytest.approx([3, 6])
    phy2log = np.array([0, 1, 0, 2])  # 2 GPUs, expert 0 on both, 1 on GPU 0, 2 on GPU 1
    loads = np.array([[4.0, 6.0, 2.0]])
    assert local_gpu_loads(phy2log, loads, 2)[0].tolist() == pytest.approx([2 + 6, 2 + 2])
    report = layer_figures(phy2log, loads, 2, "optimal")
    assert report.max_gpu_load == pytest.approx(6.0)
    assert report.balancedness == pytest.approx(1.0)
    assert report.gap == pytest.approx(0.0, abs=1e-9)
    assert layer_figures(phy2log, loads, 2, "even").max_gpu_load == pytest.approx(8.0)


def test_evaluate_placement_matches_placement_loads_and_checks_shapes():
    rng = np.random.default_rng(0)
    loads = rng.integers(0, 50, (3, 8)).astype(float)
    placement = Placement(eplb_rebalance(loads, 12, 1, 1, 4), 8, 4, allow_colocated=True)
    reports = evaluate_placement(placement, loads, layer_ids=(5, 6, 7))
    assert [r.layer for r in reports] == [5, 6, 7]
    assert [r.max_gpu_load for r in reports] == pytest.approx(placement.gpu_loads(loads).max(axis=1).tolist())
    for r in reports:
        assert 0 < r.balancedness <= 1 and r.gap >= 0 and r.lower_bound <= r.max_gpu_load
    with pytest.raises(InputError, match="loads"):
        evaluate_placement(placement, loads[:, :7])
    with pytest.raises(InputError, match="split"):
        layer_figures(placement.phy2log[0], loads[0], 4, "random")


def test_solve_parallel_equals_serial_and_auto_without_limit_is_fast():
    rng = np.random.default_rng(4)
    loads = np.round(rng.lognormal(0, 1.0, (6, 16)) * 100)
    problem = PlacementProblem(loads, 4, 24)
    serial = solve(problem, "fast")
    parallel = solve(problem, "fast", jobs=2)
    assert np.array_equal(serial.placement.phy2log, parallel.placement.phy2log)
    auto = solve(problem, "auto")
    assert np.array_equal(auto.placement.phy2log, serial.placement.phy2log)
    assert len(serial.layers) == 6 and serial.solver == "fast"
    with pytest.raises(InputError, match="solver"):
        solve(problem, "nope")
    with pytest.raises(InputError, match="jobs"):
        solve(problem, "fast", jobs=0)


@pytest.mark.skipif("cpsat" not in solver_names(), reason="cpsat not registered")
def test_auto_with_time_limit_closes_the_tiny_gap():
    problem = PlacementProblem(np.array([TINY]), 8, 16)
    solution = solve(problem, "auto", time_limit_s=20)
    layer = solution.layers[0]
    assert layer.objective == pytest.approx(590 / 3)
    assert layer.gap <= AUTO_GAP  # cpsat proved the bound that fast alone could not
    assert solution.status == "optimal"


def test_problem_rejects_more_slots_per_gpu_than_experts():
    with pytest.raises(InputError, match="num_physical"):
        PlacementProblem(np.ones((1, 4)), 2, 10)


def test_even_split_bound_is_not_used_for_other_splits():
    # [12, 6, 0] on 2 GPUs x 2 slots: replicating 12 gives 6+6 and 6+0 under the even split (12,
    # and the pairing bound proves it), but the optimal split sends 3 and 9 of it: 9 on each GPU.
    loads = np.array([12.0, 6.0, 0.0])
    assert layer_lower_bound(loads, 2, 4) == pytest.approx(12.0, rel=1e-6)
    assert brute_force_layer(loads, 2, 2)[0] == pytest.approx(12.0)
    plan = np.array([0, 1, 0, 2])
    optimal = layer_figures(plan, loads, 2, "optimal")
    assert optimal.max_gpu_load == pytest.approx(9.0)
    assert optimal.lower_bound <= 9.0 + 1e-9
    assert layer_figures(plan, loads, 2, "even").lower_bound == pytest.approx(12.0, rel=1e-6)
    assert layer_figures(plan, loads, 2, "local").lower_bound <= layer_figures(plan, loads, 2, "local").max_gpu_load


def test_tiny_time_limit_returns_the_anytime_plan_and_says_so():
    rng = np.random.default_rng(8)
    loads = np.round(rng.lognormal(0, 1.0, (5, 16)) * 100)
    problem = PlacementProblem(loads, 4, 24)
    eplb = solve(problem, "eplb")
    for name in ("fast", "auto", "cpsat"):
        anytime = solve(problem, name, time_limit_s=1e-3)
        assert anytime.placement.num_layers == 5 and not anytime.placement.allow_colocated
        assert anytime.notes and "anytime plan" in anytime.notes[0]
        assert {layer.detail["solver"] for layer in anytime.layers} <= {"quick", "eplb"}
        for quick, baseline in zip(anytime.layers, eplb.layers):
            assert quick.lower_bound <= quick.objective
            if not baseline.detail.get("colocated"):
                assert quick.objective <= baseline.objective * (1 + 1e-12)  # EPLB's plan is a candidate


def test_a_short_time_limit_still_reaches_the_requested_exact_solver():
    rng = np.random.default_rng(3)
    loads = rng.integers(1, 1000, size=(3, 8)).astype(float)
    problem = PlacementProblem(loads, num_gpus=4, num_physical=12)
    solution = solve(problem, "cpsat", time_limit_s=3.0)
    for layer in solution.layers:  # every layer went through CP-SAT unless fast had already met the bound
        assert "cpsat" in layer.detail["solvers"] or layer.status == "optimal"
    assert not solution.notes


@pytest.mark.parametrize("solver", ["cpsat", "auto"])
def test_time_limited_cpsat_is_never_worse_than_fast_and_repeats(solver):
    """The solver path as users run it: with a time limit, cpsat/auto start from fast's plan of every
    layer, so no layer is worse than the default, and two runs give the same plan."""
    rng = np.random.default_rng(11)
    loads = np.round(rng.lognormal(0, 1.2, (6, 10)) * 50)
    problem = PlacementProblem(loads, 4, 12)  # small layers: CP-SAT proves them long before their budget
    default = solve(problem, "fast")
    runs = [solve(problem, solver, time_limit_s=20.0) for _ in range(2)]
    assert np.array_equal(runs[0].placement.phy2log, runs[1].placement.phy2log)
    assert [s.objective for s in runs[0].layers] == [s.objective for s in runs[1].layers]
    for mine, base in zip(runs[0].layers, default.layers):
        assert mine.objective <= base.objective * (1 + 1e-12)
    assert not runs[0].notes


def test_cpsat_schedule_depends_on_the_limit_and_sizes_only():
    from moe_place.solvers import CPSAT_MIN_DET_S, cpsat_schedule

    problem = PlacementProblem(np.ones((6, 16)), 4, 24)
    gaps = {0: 0.01, 3: 0.05, 5: 0.02}
    schedule = cpsat_schedule(problem, gaps, 3.0)
    assert [layer for layer, _ in schedule] == [3, 5, 0]  # largest gap first
    assert schedule == cpsat_schedule(problem, gaps, 3.0)
    assert all(det >= CPSAT_MIN_DET_S for _, det in schedule)
    assert cpsat_schedule(problem, gaps, 0.01) == []      # too short for one model
    assert len(cpsat_schedule(problem, gaps, 0.5)) < 3    # fewer layers, each still worth a model


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_allow_colocated_is_never_worse_than_eplb(seed):
    """With --allow-colocated EPLB's plan is a candidate on every layer: no solver does worse."""
    rng = np.random.default_rng(seed)
    experts, gpus = int(rng.integers(4, 14)), int(rng.integers(2, 6))
    slots = int(rng.integers(max(1, -(-experts // gpus)), experts + 1))
    loads = rng.integers(0, 6, size=(2, experts)).astype(float)
    problem = PlacementProblem(loads, gpus, gpus * slots, allow_colocated=True)
    eplb = solve(problem, "eplb")
    for name in ("fast", "auto"):
        mine = solve(problem, name)
        for a, b in zip(mine.layers, eplb.layers):
            assert a.objective <= b.objective * (1 + 1e-12)


def test_issue_example_fast_loses_to_eplb_only_by_colocation():
    loads = np.array([[1, 2, 3, 1, 1, 0, 2, 1, 1, 0, 2, 3]], dtype=float)
    strict = PlacementProblem(loads, 4, 32)
    eplb = solve(strict, "eplb")
    assert eplb.layers[0].detail["colocated"]
    assert solve(strict, "fast").layers[0].objective > eplb.layers[0].objective  # forbidden co-location costs here
    parity = solve(PlacementProblem(loads, 4, 32, allow_colocated=True), "fast")
    assert parity.layers[0].objective <= eplb.layers[0].objective and parity.placement.allow_colocated
