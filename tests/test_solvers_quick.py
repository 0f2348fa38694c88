"""The anytime plan (`moe_place.solvers.quick`): valid on every layer, deterministic, and what a
tiny time limit returns."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_place.placement import Placement, even_split_gpu_loads, has_colocation
from moe_place.problem import PlacementProblem
from moe_place.solvers import solve
from moe_place.solvers.bounds import lower_bounds
from moe_place.solvers.deepseek import eplb_rebalance
from moe_place.solvers.quick import quick_plan


def _busiest(phy2log: np.ndarray, loads: np.ndarray, gpus: int) -> np.ndarray:
    """Independent count: per layer, the largest sum over a GPU's slots of load / replicas."""
    out = []
    for row, w in zip(phy2log, loads):
        replicas = np.array([np.count_nonzero(row == e) for e in range(w.size)])
        out.append(max(sum(w[e] / replicas[e] for e in slot) for slot in row.reshape(gpus, -1)))
    return np.array(out)


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(["uniform", "lognormal", "ties"]))
def test_quick_plan_is_a_valid_plan_above_the_bound(seed, kind):
    rng = np.random.default_rng(seed)
    experts, gpus = int(rng.integers(2, 30)), int(rng.integers(1, 10))
    slots = int(rng.integers(max(1, -(-experts // gpus)), experts + 1))
    layers = int(rng.integers(1, 4))
    loads = {"uniform": rng.random((layers, experts)),
             "lognormal": np.round(rng.lognormal(0, 1.5, (layers, experts)) * 10),
             "ties": rng.integers(0, 3, (layers, experts)).astype(float)}[kind]
    plan = quick_plan(loads, gpus, gpus * slots)
    Placement(plan, experts, gpus)  # every expert at least once, equal slots, no co-location
    assert np.array_equal(plan, quick_plan(loads, gpus, gpus * slots))  # deterministic
    busiest = _busiest(plan, loads, gpus)
    assert np.allclose(busiest, even_split_gpu_loads(plan, loads, gpus).max(axis=1))
    assert (busiest >= lower_bounds(loads, gpus, gpus * slots) * (1 - 1e-9)).all()


def test_quick_plan_beats_eplb_on_a_deepseek_shaped_model():
    """The drop-in's anytime plan at EP32 and EP144 (58 x 256 + 32): never above EPLB's plan where
    EPLB co-locates nothing, on a seeded random load."""
    loads = np.random.default_rng(0).random((58, 256))
    for gpus in (32, 144):
        ours = even_split_gpu_loads(quick_plan(loads, gpus, 288), loads, gpus).max(axis=1)
        eplb = eplb_rebalance(loads, 288, 1, 1, gpus)
        theirs = even_split_gpu_loads(eplb, loads, gpus).max(axis=1)
        clean = np.array([not has_colocation(row, gpus) for row in eplb])
        assert (ours[clean] <= theirs[clean] * (1 + 1e-12)).all()
        assert ours.mean() < theirs.mean()


def test_migration_mode_anytime_plan_is_the_current_placement():
    loads = np.random.default_rng(1).random((2, 12))
    current = Placement.contiguous(2, 12, 4)
    problem = PlacementProblem(loads, 4, 12, current=current, max_moved_slots=2)
    solution = solve(problem, "fast", time_limit_s=1e-3)
    assert np.array_equal(solution.placement.phy2log, current.phy2log)
    assert solution.notes and all(layer.detail["moved_slots"] == 0 for layer in solution.layers)
