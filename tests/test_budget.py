"""Budget mode: the exact multiple-choice knapsack and the per-layer slot allocation."""

from itertools import product

import numpy as np
import pytest

from moe_place.errors import InfeasibleError, InputError
from moe_place.placement import Placement
from moe_place.solvers.budget import allocate_budget, allocate_slots


def _brute_force_allocation(cost, budget):
    best = np.inf
    for choice in product(*(range(len(c)) for c in cost)):
        if sum(choice) <= budget:
            best = min(best, sum(c[k] for c, k in zip(cost, choice)))
    return best


def test_dp_matches_brute_force_on_random_tables():
    rng = np.random.default_rng(4)
    for _ in range(60):
        layers = int(rng.integers(1, 5))
        cost = [rng.uniform(0, 10, int(rng.integers(1, 5))) for _ in range(layers)]
        if rng.random() < 0.5:  # the usual shape: more slots, less load
            cost = [np.sort(c)[::-1] for c in cost]
        budget = int(rng.integers(0, 10))
        choice, total = allocate_slots(cost, budget)
        assert len(choice) == layers and sum(choice) <= budget
        assert all(0 <= k < len(c) for k, c in zip(choice, cost))
        assert total == pytest.approx(sum(c[k] for c, k in zip(cost, choice)))
        assert total == pytest.approx(_brute_force_allocation(cost, budget))


def test_dp_uses_no_units_it_does_not_need():
    choice, total = allocate_slots([np.array([5.0, 5.0, 5.0]), np.array([3.0, 1.0, 1.0])], 4)
    assert choice == [0, 1] and total == 6.0


def test_skewed_layer_gets_the_spare_memory():
    flat = np.full(8, 100.0)
    skewed = np.array([700.0, 30, 30, 30, 30, 30, 30, 30])
    loads = np.stack([flat, skewed, flat])
    # 4 GPUs: 2 slots per layer needed (6 copies); budget 8 copies per GPU -> 2 spare slots per GPU.
    plan = allocate_budget(loads, num_gpus=4, expert_bytes=1000, gpu_budget_bytes=8000 + 999)
    assert plan.slots_per_gpu[1] > plan.slots_per_gpu[0] and plan.slots_per_gpu[1] > plan.slots_per_gpu[2]
    assert plan.used_bytes <= 8999 and sum(plan.slots_per_gpu) <= 8
    assert plan.even_slots_per_gpu == 2
    assert plan.total_max_load < plan.even_total_max_load and plan.gain > 0
    for layer, row in enumerate(plan.phy2log):
        placement = Placement(row[None], 8, 4)  # valid plan with G * S[l] slots
        assert placement.gpu_loads(loads[layer][None]).max() == pytest.approx(plan.max_load[layer])
    as_dict = plan.to_dict()
    assert as_dict["num_physical"] == [4 * s for s in plan.slots_per_gpu]
    # against the uniform R: 2 slots per GPU on each of 3 layers (R = 4 * 2 - 8 = 0), 6,000 bytes per GPU
    assert (plan.even_redundant, plan.even_used_bytes) == (0, 6000)
    assert plan.freed_bytes == 6000 - 1000 * sum(plan.slots_per_gpu) == as_dict["freed_bytes"] < 0  # it uses more


def test_flat_layers_free_memory_against_the_uniform_r():
    loads = np.full((2, 8), 100.0)  # one copy of each expert already meets the average: spare slots buy nothing
    plan = allocate_budget(loads, num_gpus=4, expert_bytes=1000, gpu_budget_bytes=6000)
    assert plan.slots_per_gpu == (2, 2) and plan.even_slots_per_gpu == 3 and plan.even_redundant == 4
    assert plan.freed_bytes == 6000 - 4000


def test_allocation_is_never_worse_than_the_even_spread():
    rng = np.random.default_rng(2)
    loads = rng.gamma(0.6, 100.0, (4, 12))
    for copies in (12, 14, 17, 24):  # per GPU; 4 layers x ceil(12 experts / 4 GPUs) = 12 at least
        plan = allocate_budget(loads, num_gpus=4, expert_bytes=10, gpu_budget_bytes=copies * 10)
        assert plan.total_max_load <= plan.even_total_max_load * (1 + 1e-12)
        assert plan.gain >= 0
        assert sum(plan.slots_per_gpu) <= copies and min(plan.slots_per_gpu) >= 3


def test_budget_below_one_copy_per_expert_is_infeasible():
    loads = np.ones((2, 8))
    with pytest.raises(InfeasibleError, match="at least 4 per GPU") as info:
        allocate_budget(loads, num_gpus=4, expert_bytes=100, gpu_budget_bytes=399)
    assert "give at least 400 bytes" in str(info.value)


def test_bad_arguments_are_input_errors():
    with pytest.raises(InputError, match="loads"):
        allocate_budget(np.ones(8), 4, 100, 1000)
    with pytest.raises(InputError, match="expert_bytes"):
        allocate_budget(np.ones((1, 8)), 4, 0, 1000)
    with pytest.raises(InputError, match="max_slots_per_gpu"):
        allocate_budget(np.ones((1, 8)), 4, 100, 1000, max_slots_per_gpu=1)


def test_pricing_stops_once_a_layer_reaches_its_average_load():
    calls = []

    def counting_planner(loads, gpus, slots):
        calls.append(slots)
        from moe_place.solvers.fast import fast_layer
        return fast_layer(loads, gpus, gpus * slots)

    loads = np.stack([np.full(8, 10.0), np.array([700.0, 30, 30, 30, 30, 30, 30, 30])])
    plan = allocate_budget(loads, 4, 1, 12, planner=counting_planner)
    # Layer 0 (flat) is at its average with the least count (2 slots per GPU): priced once.
    # Layer 1 (skewed) is priced from 2 slots upwards.
    assert calls[:2] == [2, 2] and len(calls) > 2 and all(slots > 2 for slots in calls[2:])
    assert plan.slots_per_gpu[0] == 2 and plan.even_max_load[0] == pytest.approx(20.0)
    assert plan.slots_per_gpu[1] > 2
