"""Property tests (hypothesis): solver invariants and the split policies on random small layers."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_place.placement import Placement, has_colocation
from moe_place.problem import PlacementProblem
from moe_place.solvers import get_solver
from moe_place.solvers.bounds import layer_lower_bound
from moe_place.solvers.evaluate import even_gpu_loads, local_gpu_loads, optimal_split


@st.composite
def layers(draw):
    gpus = draw(st.integers(1, 6))
    slots = draw(st.integers(1, 4))
    experts = draw(st.integers(slots, min(12, gpus * slots)))  # P >= E and at most one copy per GPU
    loads = draw(st.lists(st.integers(0, 1000), min_size=experts, max_size=experts))
    return np.array(loads, dtype=np.float64), gpus, gpus * slots


@settings(max_examples=60, deadline=None)
@given(layers())
def test_fast_plan_is_valid_and_above_the_bound(case):
    loads, gpus, physical = case
    problem = PlacementProblem(loads[None], gpus, physical)
    solution = get_solver("fast").solve_layer(problem, 0, None)
    placement = Placement(solution.phy2log[None], loads.size, gpus)  # raises on any broken invariant
    assert placement.logcnt.min() >= 1
    busiest = even_gpu_loads(solution.phy2log, loads, gpus).max()
    assert solution.objective == busiest
    assert layer_lower_bound(loads, gpus, physical) <= busiest * (1 + 1e-9) + 1e-9
    eplb = get_solver("eplb").solve_layer(problem, 0, None)
    if not has_colocation(eplb.phy2log, gpus):
        assert busiest <= eplb.objective * (1 + 1e-12)


@settings(max_examples=40, deadline=None)
@given(layers(), st.integers(0, 2**31 - 1))
def test_split_policies_conserve_load_and_optimal_is_best(case, seed):
    loads, gpus, physical = case
    rng = np.random.default_rng(seed)
    experts = loads.size
    slots = physical // gpus
    # a random valid plan: each expert once, the rest random experts not yet on that GPU
    table = [[] for _ in range(gpus)]
    order = rng.permutation(experts)
    for i, e in enumerate(order):
        table[i % gpus if len(table[i % gpus]) < slots else next(g for g in range(gpus) if len(table[g]) < slots)].append(int(e))
    for row in table:
        while len(row) < slots:
            row.append(int(rng.choice([e for e in range(experts) if e not in row])))
    phy2log = np.array([e for row in table for e in row])
    even = even_gpu_loads(phy2log, loads, gpus)[0]
    local = local_gpu_loads(phy2log, loads, gpus)[0]
    replicas = {e: int((phy2log == e).sum()) for e in range(experts)}
    by_hand = [sum(loads[e] / replicas[e] for e in row) for row in table]  # independent of even_gpu_loads
    assert np.allclose(even, by_hand, rtol=1e-12, atol=1e-9)
    assert abs(even.sum() - loads.sum()) <= 1e-9 * max(1, loads.sum())
    assert abs(local.sum() - loads.sum()) <= 1e-9 * max(1, loads.sum())
    # with tokens spread evenly over their source GPUs and no co-located replicas, local == even
    assert np.allclose(local, even, rtol=1e-12, atol=1e-9)
    best = optimal_split(phy2log, loads, gpus)[0]
    scale = max(1.0, loads.sum())
    assert best <= even.max() + 1e-7 * scale and best <= local.max() + 1e-7 * scale
    assert best >= loads.sum() / gpus - 1e-7 * scale
