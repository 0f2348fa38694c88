"""The replicate-the-hottest baseline plan and the loss of a plan judged on the next window."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_place.analysis.balance import gpu_balance
from moe_place.analysis.out_of_sample import out_of_sample
from moe_place.analysis.replicate_hottest import replicate_hottest
from moe_place.errors import InputError
from moe_place.placement import Placement


def test_replicate_hottest_on_a_hand_example():
    # expert 0 takes 40 rows, the 7 others 1 each; 4 GPUs of 2 experts + 1 extra slot each.
    # GPUs 1, 2, 3 (least loaded in turn) take a replica of expert 0 (40 -> 20 -> 13.3 -> 10 per
    # replica); GPU 0 holds experts 0 and 1, so it takes the hottest other one, expert 2.
    placement = replicate_hottest(np.array([[40, 1, 1, 1, 1, 1, 1, 1]]), num_gpus=4, redundant_per_gpu=1)
    np.testing.assert_array_equal(placement.phy2log, [[0, 1, 2, 2, 3, 0, 4, 5, 0, 6, 7, 0]])
    np.testing.assert_allclose(placement.gpu_loads(np.array([[40, 1, 1, 1, 1, 1, 1, 1]])), [[11.5, 11.5, 12, 12]])


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([(16, 2), (16, 4), (16, 8), (12, 3), (8, 8)]), st.integers(0, 3))
def test_replicate_hottest_invariants(seed, experts_gpus, redundant):
    experts, gpus = experts_gpus
    redundant = min(redundant, experts - experts // gpus)
    rng = np.random.default_rng(seed)
    loads = rng.zipf(1.5, size=(3, experts)).clip(max=10_000)
    block = experts // gpus
    # idle experts, at least `redundant` outside every GPU's block: a forced fill can then harm nothing
    loads[:, rng.choice(experts, min(experts, redundant + block), replace=False)] = 0
    placement = replicate_hottest(loads, gpus, redundant)  # Placement validates: no GPU holds one expert twice
    # every GPU keeps its contiguous block; rows are conserved; the plan never loses to contiguous
    np.testing.assert_array_equal(placement.phy2log.reshape(3, gpus, -1)[:, :, :block],
                                  np.broadcast_to(np.arange(experts).reshape(gpus, block), (3, gpus, block)))
    np.testing.assert_allclose(placement.gpu_loads(loads).sum(1), loads.sum(1))
    base = gpu_balance(Placement.contiguous(3, experts, gpus), loads).max_over_mean
    assert (gpu_balance(placement, loads).max_over_mean <= base + 1e-9).all()


def test_a_dominant_expert_is_replicated_and_the_skew_drops():
    loads = np.array([[1000, 10, 20, 10, 30, 10, 10, 10, 15, 10, 5, 10, 10, 10, 10, 10]])
    placement = replicate_hottest(loads, num_gpus=8, redundant_per_gpu=1)
    assert placement.logcnt[0, 0] >= 4
    assert gpu_balance(placement, loads).max_over_mean[0] < 0.5 * gpu_balance(
        Placement.contiguous(1, 16, 8), loads).max_over_mean[0]


def test_replicate_hottest_rejects_bad_sizes():
    with pytest.raises(InputError):
        replicate_hottest(np.ones((1, 8)), 3)
    with pytest.raises(InputError):
        replicate_hottest(np.ones((1, 8)), 4, redundant_per_gpu=7)


def test_a_plan_on_steady_loads_loses_nothing():
    rng = np.random.default_rng(0)
    loads = np.repeat(rng.integers(1, 200, size=(1, 2, 32)), 4, axis=0)
    shift = out_of_sample(loads, ep_size=8)
    assert shift.contiguous.shape == (3, 2)
    np.testing.assert_allclose(shift.out_of_sample, shift.in_sample)
    np.testing.assert_allclose(shift.loss, 0.0, atol=1e-12)
    ref = loads[0].reshape(2, 8, 4).sum(-1)
    np.testing.assert_allclose(shift.contiguous[0], ref.max(1) / ref.mean(1))


def test_a_moving_hot_spot_makes_the_old_plan_lose():
    windows, experts = 4, 32
    loads = np.random.default_rng(2).integers(5, 15, size=(windows, 1, experts)).astype(float)
    for w in range(windows):
        loads[w, 0, 8 * w + 3] = 400  # the hot expert moves to another GPU every window
    shift = out_of_sample(loads, ep_size=4)
    assert (shift.in_sample < shift.contiguous - 0.5).all()  # with hindsight the plan helps a lot
    assert (shift.loss > 0.5).all()  # the previous window's plan replicated the wrong expert
    assert (shift.out_of_sample > shift.contiguous - 0.2).all()  # ... and is little better than no plan


def test_out_of_sample_accepts_another_planner_and_needs_two_windows():
    loads = np.random.default_rng(1).integers(0, 50, size=(3, 2, 16))
    seen = []

    def contiguous(loads):
        seen.append(loads.shape)
        return Placement.contiguous(loads.shape[0], loads.shape[1], 4)

    shift = out_of_sample(loads, 4, planner=contiguous, planner_name="contiguous")
    np.testing.assert_allclose(shift.out_of_sample, shift.contiguous)
    np.testing.assert_allclose(shift.in_sample, shift.contiguous)
    assert seen == [(3 * 2, 16)]  # called once, windows x layers stacked
    with pytest.raises(InputError):
        out_of_sample(loads[:1], 4)


def test_gpu_loads_agree_with_per_slot_loads():
    # Placement.gpu_loads (even_split_gpu_loads, replicas counted per row) vs slot loads from logcnt
    loads = np.random.default_rng(4).zipf(1.3, size=(6, 32)).clip(max=5000).astype(float)
    placement = replicate_hottest(loads, 8, redundant_per_gpu=2)
    by_slot = placement.slot_loads(loads).reshape(6, 8, -1).sum(axis=-1)
    np.testing.assert_allclose(placement.gpu_loads(loads), by_slot)


def _plain_greedy(load, num_gpus, redundant_per_gpu):
    """The greedy of replicate_hottest written plainly: every pass recomputes every share, mask and
    GPU load over the whole `[layers, E]` (the formulation the fast one must match exactly)."""
    layers, experts = load.shape
    block = experts // num_gpus
    rows = np.arange(layers)
    home = np.arange(experts) // block
    replicas = np.ones((layers, experts))
    gpu_load = load.reshape(layers, num_gpus, block).sum(axis=2)
    free = np.full((layers, num_gpus), redundant_per_gpu)
    extra = np.full((layers, num_gpus, redundant_per_gpu), -1, dtype=np.int64)
    for _ in range(num_gpus * redundant_per_gpu):
        share, new_share = load / replicas, load / (replicas + 1)
        gpu = np.where(free > 0, gpu_load, np.inf).argmin(axis=1)
        may = home[None, :] != gpu[:, None]
        for layer in range(layers):
            held = extra[layer, gpu[layer]]
            may[layer, held[held >= 0]] = False
        fits = may & (gpu_load[rows, gpu][:, None] + new_share <= gpu_load.max(axis=1)[:, None])
        expert = np.where(fits.any(axis=1), np.where(fits, share, -np.inf).argmax(axis=1),
                          np.where(may, new_share, np.inf).argmin(axis=1))
        holders = (np.arange(num_gpus)[None, :] == home[expert][:, None]) | (extra == expert[:, None, None]).any(axis=2)
        gained = new_share[rows, expert]
        gpu_load -= holders * (share[rows, expert] - gained)[:, None]
        gpu_load[rows, gpu] += gained
        replicas[rows, expert] += 1
        extra[rows, gpu, redundant_per_gpu - free[rows, gpu]] = expert
        free[rows, gpu] -= 1
    return extra


@pytest.mark.parametrize("kind", ["few values", "counts", "floats", "heavy tail"])
def test_greedy_equals_its_plain_formulation(kind):
    rng = np.random.default_rng(len(kind))
    for _ in range(40):
        experts = int(rng.choice([4, 6, 8, 12, 16, 32, 64]))
        gpus = int(rng.choice([g for g in range(2, experts + 1) if experts % g == 0]))
        redundant = int(rng.integers(0, min(experts - experts // gpus, 3) + 1))
        shape = (int(rng.integers(1, 30)), experts)
        load = {"few values": lambda: rng.integers(0, 4, shape),  # ties and idle experts everywhere
                "counts": lambda: rng.integers(0, 1000, shape),
                "floats": lambda: rng.random(shape) * 10 ** rng.uniform(0, 6),
                "heavy tail": lambda: np.floor(rng.pareto(1.2, shape) * 100)}[kind]().astype(np.float64)
        placement = replicate_hottest(load, gpus, redundant)
        block = experts // gpus
        extra = placement.phy2log.reshape(shape[0], gpus, -1)[:, :, block:]
        np.testing.assert_array_equal(extra, _plain_greedy(load, gpus, redundant))
