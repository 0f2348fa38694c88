"""The brute-force oracle: hand-computed optima, and agreement with a naive enumeration."""

from itertools import combinations, product

import numpy as np
import pytest

from moe_place.errors import InfeasibleError, InputError
from moe_place.placement import Placement
from bruteforce import brute_force_layer  # tests/, beside this file


def _plan_load(loads, phy2log, num_gpus):
    placement = Placement(np.asarray(phy2log)[None], len(loads), num_gpus)
    return float(placement.gpu_loads(np.asarray(loads, dtype=np.float64)[None]).max())


def _naive_optimum(loads, num_gpus, slots_per_gpu):
    """Every GPU picks a set of S distinct experts; keep the covers of all experts. No pruning."""
    experts = len(loads)
    best = np.inf
    for gpu_sets in product(list(combinations(range(experts), slots_per_gpu)), repeat=num_gpus):
        count = np.bincount([e for s in gpu_sets for e in s], minlength=experts)
        if count.min() < 1:
            continue
        best = min(best, max(sum(loads[e] / count[e] for e in s) for s in gpu_sets))
    return best


@pytest.mark.parametrize(("loads", "gpus", "slots", "optimum"), [
    # The public instance from the issue: 560 split over 3 GPUs, each beside a 10 -> 560/3 + 10 = 590/3.
    ([600, 560, 120, 120, 20, 10, 10, 10], 8, 2, 590 / 3),
    # No redundancy on 4 GPUs: the best pairing puts each hot expert beside a 10 -> 600 + 10.
    ([600, 560, 120, 120, 20, 10, 10, 10], 4, 2, 610.0),
    # One spare slot: replicate the 5 -> {2.5, 3}, {2.5, 1} -> 5.5 (replicating the 3 gives 6.5).
    ([5, 3, 1], 2, 2, 5.5),
    # One GPU holds everything once.
    ([4, 1, 2], 1, 3, 7.0),
    # One expert on every slot of 3 GPUs: 9 / 3.
    ([9], 3, 1, 3.0),
])
def test_hand_computed_optima(loads, gpus, slots, optimum):
    value, phy2log = brute_force_layer(np.array(loads, dtype=float), gpus, slots)
    assert value == pytest.approx(optimum, rel=1e-12)
    assert _plan_load(loads, phy2log, gpus) == pytest.approx(value, rel=1e-12)


def test_agrees_with_naive_enumeration_on_random_tiny_cases():
    rng = np.random.default_rng(7)
    checked = 0
    while checked < 40:
        experts = int(rng.integers(1, 6))
        gpus = int(rng.integers(1, 4))
        slots = int(rng.integers(1, experts + 1))
        if not experts <= gpus * slots <= experts * gpus:
            continue
        loads = rng.integers(0, 50, experts).astype(float)
        value, phy2log = brute_force_layer(loads, gpus, slots)
        assert value == pytest.approx(_naive_optimum(loads, gpus, slots), rel=1e-12), (loads, gpus, slots)
        assert _plan_load(loads, phy2log, gpus) == pytest.approx(value, rel=1e-12)
        checked += 1


def test_plan_is_a_valid_placement():
    loads = np.array([30.0, 1, 7, 7, 0, 12, 3, 9])
    value, phy2log = brute_force_layer(loads, 4, 3)
    placement = Placement(phy2log[None], 8, 4)  # validates: every expert present, no duplicate per GPU
    assert placement.num_physical == 12
    assert value >= loads.sum() / 4 - 1e-9


def test_rejects_impossible_and_oversized_cases():
    with pytest.raises(InfeasibleError, match="cannot hold"):
        brute_force_layer(np.ones(5), 2, 2)
    with pytest.raises(InfeasibleError, match="duplicate"):
        brute_force_layer(np.ones(2), 3, 3)  # 9 slots but 2 experts x 3 GPUs = 6 distinct places
    with pytest.raises(InputError, match="experts"):
        brute_force_layer(np.ones(11), 4, 3)
    with pytest.raises(InputError, match="loads"):
        brute_force_layer(np.array([1.0, -1.0]), 2, 1)
