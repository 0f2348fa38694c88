"""Online controllers: the payback rule, migration-aware moves, and valid maps under any load sequence."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_place.cost.payback import n_min
from moe_place.online.controller import PaybackController, PeriodicEplbController, make_controller
from moe_place.online.costing import cluster_cost
from moe_place.online.replay import initial_placement, replay
from moe_place.online.window import HotSpotTracker, Predictor
from moe_place.placement import Placement

LAYERS, EXPERTS, GPUS = 2, 8, 4
PHYSICAL = EXPERTS + GPUS


def _cost(**kw):
    return cluster_cost(GPUS, kw.pop("nodes", 1), "H100", "Qwen3-30B-A3B", **kw)


def _independent_check(placement: Placement, shape=(LAYERS, PHYSICAL)):
    """Invariants of a map an engine can run, checked without Placement's own validation."""
    rows = np.asarray(placement.phy2log)
    assert rows.shape == shape
    for row in rows:
        assert set(row.tolist()) == set(range(EXPERTS))  # every expert has a slot
        per_gpu = row.reshape(GPUS, -1)
        assert all(len(set(g.tolist())) == len(g) for g in per_gpu)  # no expert twice on a GPU


class Recording:
    """Wraps a controller and keeps every map it emits."""

    def __init__(self, inner):
        self.inner, self.name, self.emitted = inner, inner.name, []

    def observe(self, step, counts):
        self.inner.observe(step, counts)

    def decide(self, step, current):
        decision = self.inner.decide(step, current)
        if decision is not None:
            self.emitted.append((step, current, decision))
        return decision


def _hot_counts(steps, hot_expert_of_step, hot=4000, cold=100, seed=0):
    rng = np.random.default_rng(seed)
    counts = rng.poisson(cold, size=(steps, LAYERS, EXPERTS)).astype(np.int64)
    for step in range(steps):
        counts[step, :, hot_expert_of_step(step)] += hot
    return counts


def test_a_persistent_hot_spot_is_replicated_and_pays_back():
    # expert 0 is hot for the first 40 steps, then expert 5 for 400 steps
    counts = _hot_counts(440, lambda s: 0 if s < 40 else 5)
    cost = _cost()
    start = initial_placement(counts, GPUS, PHYSICAL, window=40)
    ours = Recording(PaybackController(cost, LAYERS, EXPERTS, check_every=8, predictor=Predictor(horizon=8),
                                       tracker=HotSpotTracker(prior_steps=100)))
    result = replay(counts, ours, cost, start)
    static = replay(counts, make_controller("static", cost, LAYERS, EXPERTS), cost, start)
    assert result.rebalances >= 1
    step, before, decision = ours.emitted[0]
    assert step >= 40
    assert decision.placement.logcnt[:, 5].min() > before.logcnt[:, 5].min()  # the new hot expert got replicas
    # migration-aware: at most max_moved_slots (2) slots change per layer, everything else stays put
    assert (decision.placement.moved_slots(before).sum(axis=1) <= 2).all()
    assert result.total_time_s < static.total_time_s
    assert result.total_migration_time_s > 0


def test_a_hot_spot_too_short_to_pay_back_is_left_alone():
    # decode-sized batches (memory-bound, small savings), hot expert changes every 4 steps, 2 nodes
    counts = _hot_counts(200, lambda s: (s // 4) % EXPERTS, hot=40, cold=2)
    cost = _cost(nodes=2)
    start = initial_placement(counts, GPUS, PHYSICAL, num_nodes=2, window=200)

    def controller(prior_steps):
        tracker = HotSpotTracker(prior_steps=prior_steps, min_runs=10**6)  # believed life of a hot spot
        return Recording(PaybackController(cost, LAYERS, EXPERTS, check_every=4, predictor=Predictor(horizon=4),
                                           tracker=tracker, hysteresis=2.0))

    short = controller(4)
    assert replay(counts, short, cost, start).rebalances == 0
    # the same moves are taken when hot spots are believed to last long enough to repay them
    long = controller(10**5)
    assert replay(counts, long, cost, start).rebalances > 0
    for _, _, decision in long.emitted:  # each taken move pays back (N_min) within life / hysteresis
        assert decision.copy_time_s > 0 and decision.predicted_saving_s > 0
        assert 2.0 * n_min(decision.copy_time_s, decision.predicted_saving_s) <= decision.expected_steps


def test_byte_cap_limits_each_rebalance():
    counts = _hot_counts(240, lambda s: 0 if s < 40 else 5)
    cost = _cost()
    start = initial_placement(counts, GPUS, PHYSICAL, window=40)
    one_expert = cost.expert_bytes
    ours = Recording(PaybackController(cost, LAYERS, EXPERTS, check_every=8, predictor=Predictor(horizon=8),
                                       max_bytes=2 * one_expert))
    result = replay(counts, ours, cost, start)
    for _, before, decision in ours.emitted:
        assert decision.placement.moved_slots(before).sum() * one_expert <= 2 * one_expert
    assert result.peak_staging_bytes <= 2 * one_expert


def test_periodic_eplb_follows_vllm_cadence():
    counts = _hot_counts(700, lambda s: s // 100 % EXPERTS)
    cost = _cost()
    start = initial_placement(counts, GPUS, PHYSICAL, window=100)
    periodic = PeriodicEplbController(LAYERS, EXPERTS, window_size=100, step_interval=200)
    result = replay(counts, periodic, cost, start)
    # first after a quarter interval (50 steps: after batch 49), then every 200 steps
    assert result.rebalance_steps == (49, 249, 449, 649)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_controllers_never_emit_an_invalid_map_under_adversarial_loads(data):
    steps = data.draw(st.integers(6, 20))
    kind = data.draw(st.sampled_from(["spikes", "zeros", "random"]))
    seed = data.draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    if kind == "spikes":  # one expert takes everything, a different one each step
        counts = np.zeros((steps, LAYERS, EXPERTS), dtype=np.int64)
        for s in range(steps):
            counts[s, :, rng.integers(EXPERTS)] = rng.integers(1, 10**6)
    elif kind == "zeros":  # idle steps and idle layers mixed with bursts
        counts = rng.integers(0, 1000, size=(steps, LAYERS, EXPERTS)) * (rng.random((steps, LAYERS, 1)) < 0.3)
    else:
        counts = rng.integers(0, 10**5, size=(steps, LAYERS, EXPERTS)) ** rng.integers(1, 3)
    cost = _cost(nodes=data.draw(st.sampled_from([1, 2])))
    start = initial_placement(counts, GPUS, PHYSICAL, num_nodes=cost.topology.num_servers, window=3)
    ours = Recording(PaybackController(cost, LAYERS, EXPERTS, check_every=2, predictor=Predictor(horizon=2),
                                       hysteresis=0.0, min_relative_saving=0.0,
                                       tracker=HotSpotTracker(prior_steps=10**6)))
    result = replay(counts, ours, cost, start, drain_steps=data.draw(st.integers(0, 3)))
    assert np.isfinite(result.expert_time_s).all() and (result.balancedness <= 1 + 1e-12).all()
    for _, before, decision in ours.emitted:
        _independent_check(decision.placement)
        _independent_check(before)
        assert (decision.placement.moved_slots(before).sum(axis=1) <= 2).all()


def test_unknown_controller_is_an_input_error():
    with pytest.raises(Exception, match="--controller"):
        make_controller("oracle", _cost(), LAYERS, EXPERTS)


def test_move_budget_is_chosen_per_layer_by_net_gain():
    counts = _hot_counts(200, lambda s: 0 if s < 40 else 5)
    cost = _cost(nodes=2)
    start = initial_placement(counts, GPUS, PHYSICAL, num_nodes=2, window=40)
    ours = Recording(PaybackController(cost, LAYERS, EXPERTS, check_every=8, predictor=Predictor(horizon=8),
                                       tracker=HotSpotTracker(prior_steps=200), max_moved_slots=4,
                                       move_budgets=(4, 1, 2, 2), hysteresis=2.0))
    assert ours.inner.move_budgets == (1, 2, 4)
    result = replay(counts, ours, cost, start)
    assert result.rebalances >= 1
    for _, before, decision in ours.emitted:
        moved = decision.placement.moved_slots(before).sum(axis=1)
        assert (moved <= 4).all() and moved.sum() > 0
        # whatever budget each layer took, the whole decision pays back within the expected life (hysteresis 2)
        assert 2.0 * n_min(decision.copy_time_s, decision.predicted_saving_s) <= decision.expected_steps
    # a single budget of one slot moves at most one slot per layer
    one = Recording(PaybackController(cost, LAYERS, EXPERTS, check_every=8, predictor=Predictor(horizon=8),
                                      tracker=HotSpotTracker(prior_steps=200), max_moved_slots=4, move_budgets=(1,)))
    replay(counts, one, cost, start)
    assert one.emitted and all((d.placement.moved_slots(b).sum(axis=1) <= 1).all() for _, b, d in one.emitted)


def test_move_budgets_beyond_the_cap_are_an_input_error():
    with pytest.raises(Exception, match="move_budgets"):
        PaybackController(_cost(), LAYERS, EXPERTS, max_moved_slots=2, move_budgets=(1, 4))
