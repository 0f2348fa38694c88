"""The time-objective planner (moe_place.solvers.comm): valid plans, the held-out guard, the bound,
the search's incremental state, and a trace where grouping must pay."""

import itertools

import numpy as np
import pytest

from moe_place.cost.comm import CommModel, SlotTable, default_topology, layer_cost
from moe_place.cost.models import ExpertShape
from moe_place.errors import InputError
from moe_place.placement import Placement
from moe_place.problem import PlacementProblem
from moe_place.solvers import solve
from moe_place.solvers.comm import (STRENGTHS, LayerTokens, NodeSearch, balanced_nodes, community_nodes, cv_windows,
                                    layer_lower_bound_s, plan_layer, plan_time, replica_nodes)

SHAPE = ExpertShape("test", 512, 256, 16, 4, 2)


def clustered_steps(rng, experts=16, layers=2, k=4, tokens=160, steps=3, groups=2):
    """Steps of tokens that each pick `k` experts inside one of `groups` fixed expert groups (scrambled
    ids), so a node per group serves a token entirely: grouping pays on every step."""
    perm = rng.permutation(experts)
    size = experts // groups
    out = []
    for _ in range(steps):
        ids = np.empty((tokens, layers, k), dtype=np.int64)
        for t in range(tokens):
            g = rng.integers(groups)
            for layer in range(layers):
                ids[t, layer] = perm[g * size + rng.choice(size, k, replace=False)]
        out.append(ids)
    return out


def problem_for(steps, gpus, nodes, redundant=0):
    experts = 16
    loads = np.stack([sum(np.bincount(s[:, i, :].ravel(), minlength=experts) for s in steps)
                      for i in range(steps[0].shape[1])]).astype(float)
    return PlacementProblem(loads, gpus, experts + redundant, num_nodes=nodes)


def layer_time(model, steps, row, layer, gpus, nodes):
    return layer_cost(model, [s[:, layer, :] for s in steps], SlotTable(row, gpus, nodes, 16), layer).layer_time_s


@pytest.mark.parametrize("redundant, rule", [(0, "sglang-static"), (8, "sglang-static"), (8, "vllm"),
                                             (8, "node-aware")])
def test_time_plan_is_valid_deterministic_and_guarded(redundant, rule):
    rng = np.random.default_rng(1)
    steps = clustered_steps(rng)
    problem = problem_for(steps, 8, 2, redundant)
    model = CommModel(default_topology(8, 2), SHAPE, replica_choice=rule)
    first = plan_time(problem, steps, model)
    second = plan_time(problem, steps, model)
    assert np.array_equal(first.placement.phy2log, second.placement.phy2log)
    placement = first.placement
    assert placement.phy2log.shape == (2, 16 + redundant) and not placement.allow_colocated
    Placement(placement.phy2log, 16, 8, 2)  # engine-compatible: every expert, equal slots, no co-location
    assert set(first.cv) == {str(s) for s in STRENGTHS} | {"balance"}
    for i, layer in enumerate(first.layers):
        assert layer.lower_bound_s <= layer.predicted_s * (1 + 1e-9)
        assert layer.predicted_s == pytest.approx(layer_time(model, steps, placement.phy2log[i], i, 8, 2))
        if layer.choice == "grouped":
            assert layer.held_out_s <= layer.balance_held_out_s
        else:
            assert np.array_equal(placement.phy2log[i], first.balance.phy2log[i])


def test_grouping_pays_on_a_clustered_trace_in_and_out_of_sample():
    rng = np.random.default_rng(2)
    steps = clustered_steps(rng, steps=4)
    train, test = steps[:3], steps[3:]
    problem = problem_for(train, 8, 2)
    model = CommModel(default_topology(8, 2), SHAPE)
    result = plan_time(problem, train, model)
    balance = solve(problem, "fast").placement
    assert all(layer.choice == "grouped" for layer in result.layers)
    for i in range(2):
        table = SlotTable(result.placement.phy2log[i], 8, 2, 16)
        grouped = layer_cost(model, [s[:, i, :] for s in test], table, i)
        base = layer_cost(model, [s[:, i, :] for s in test], SlotTable(balance.phy2log[i], 8, 2, 16), i)
        assert grouped.distinct_nodes_per_token == pytest.approx(1.0)   # each token stays on one node
        assert grouped.rdma_bytes < 0.7 * base.rdma_bytes
        assert grouped.layer_time_s < base.layer_time_s


def test_a_layer_that_grouping_does_not_help_keeps_the_balance_plan():
    rng = np.random.default_rng(3)
    # uniform random routing: co-activation carries no signal; whatever the windows say, the guard holds
    steps = [rng.permuted(np.tile(np.arange(16), (200, 1)), axis=1)[:, None, :4] for _ in range(3)]
    problem = problem_for(steps, 8, 2)
    result = plan_time(problem, steps, CommModel(default_topology(8, 2), SHAPE))
    for i, layer in enumerate(result.layers):
        if layer.choice == "balance":
            assert np.array_equal(result.placement.phy2log[i], result.balance.phy2log[i])
        else:
            assert layer.held_out_s <= layer.balance_held_out_s


def test_node_search_keeps_its_incremental_state_exact():
    rng = np.random.default_rng(4)
    steps = clustered_steps(rng, layers=1)
    tokens = LayerTokens.from_steps([s[:, 0, :] for s in steps], 16, 8, "blocks")
    model = CommModel(default_topology(8, 2), SHAPE)
    start = balanced_nodes(tokens.loads.sum(axis=0), 2)
    assert np.bincount(start).tolist() == [8, 8]
    search = NodeSearch(tokens, start, 8, 2, 2, model)
    for _ in range(6):
        e, f = rng.choice(16, 2, replace=False)
        if search.node_of[e] == search.node_of[f]:
            continue
        predicted = search.swap_value(int(e), int(f))
        search.apply_swap(int(e), int(f))
        fresh = NodeSearch(tokens, search.node_of, 8, 2, 2, model)
        assert np.array_equal(search.count, fresh.count) and np.array_equal(search.visits, fresh.visits)
        assert np.allclose(search.node_load, fresh.node_load)
        assert predicted == pytest.approx(fresh.value())
    snapshots = NodeSearch(tokens, start, 8, 2, 2, model).search(64, (0, 2, 64))
    assert set(snapshots) == {0, 2, 64} and np.array_equal(snapshots[0], start)


def test_replica_nodes_respect_the_spare_slots_and_keep_each_expert_home():
    rng = np.random.default_rng(5)
    steps = clustered_steps(rng, layers=1)
    tokens = LayerTokens.from_steps([s[:, 0, :] for s in steps], 16, 8, "blocks")
    for rule in ("sglang-static", "vllm"):
        model = CommModel(default_topology(8, 2), SHAPE, replica_choice=rule)
        search = NodeSearch(tokens, np.arange(16) % 2, 8, 2, 3, model)          # P = 24: 4 spare slots per node
        for exact in (True, False):
            plan = replica_nodes(search, 24, exact=exact)
            assert plan.present[np.arange(16), search.node_of].all()
            assert (plan.present.sum(axis=0) <= 12).all()
            assert plan.served.sum() == pytest.approx(tokens.loads.sum())
            if rule == "vllm":
                assert plan.present.sum() == 16   # replicas stay on their expert's node


def test_lower_bound_is_below_every_plan_of_a_tiny_layer():
    rng = np.random.default_rng(6)
    steps = [np.stack([rng.choice(4, 2, replace=False) for _ in range(24)]) for _ in range(2)]
    topo = default_topology(4, 2)
    shape = ExpertShape("tiny", 256, 64, 4, 2, 1)
    model = CommModel(topo, shape)
    bound = layer_lower_bound_s(steps, model, 4, 4, 2, 4)
    best = min(layer_cost(model, steps, SlotTable(np.array(p), 4, 2, 4)).layer_time_s
               for p in itertools.permutations(range(4)))
    assert 0 < bound <= best * (1 + 1e-12)


def test_cv_windows_split_steps_or_halves():
    steps = [np.zeros((10, 1, 2), dtype=int) + i for i in range(5)]
    windows = cv_windows(steps)
    assert [[int(s[0, 0, 0]) for s in w] for w in windows] == [[0, 1], [2], [3, 4]]
    halves = cv_windows(steps[:1])
    assert [w[0].shape[0] for w in halves] == [5, 5]


def test_community_start_puts_each_cluster_on_one_node():
    rng = np.random.default_rng(8)
    steps = clustered_steps(rng, layers=1)
    tokens = LayerTokens.from_steps([s[:, 0, :] for s in steps], 16, 8, "blocks")
    node_of = community_nodes(tokens, 2)
    assert np.bincount(node_of).tolist() == [8, 8]
    together = [len({int(node_of[e]) for e in row}) for row in tokens.ids]
    assert np.mean(together) == pytest.approx(1.0)   # every token's experts on one node
    problem = problem_for(steps, 8, 2)
    model = CommModel(default_topology(8, 2), SHAPE)
    row = plan_layer(tokens, problem, model, (0,), False, "communities")[0][0]   # strength 0: the start itself
    placed = np.empty(16, dtype=int)
    placed[row] = np.arange(16) // 8
    assert len({tuple(np.flatnonzero(placed == n)) for n in range(2)} ^
               {tuple(np.flatnonzero(node_of == n)) for n in range(2)}) == 0
    result = plan_time(problem, steps, model, strength=0, start="communities")   # every layer at the start
    assert np.array_equal(result.placement.phy2log[0], row)
    result = plan_time(problem, steps, model, start="communities")
    Placement(result.placement.phy2log, 16, 8, 2)
    with pytest.raises(InputError, match="start"):
        plan_time(problem, steps, model, start="random")
