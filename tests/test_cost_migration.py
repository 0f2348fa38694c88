"""The migration model: what a re-plan moves, what the copies take, what serving pays (stall vs async)."""

import math

import numpy as np
import pytest

from moe_place.cost.cluster import cluster_cost
from moe_place.cost.migration import Copy, Migration, plan_copies
from moe_place.cost.topology import parse_topology_spec
from moe_place.online.controller import StaticController
from moe_place.online.replay import replay
from moe_place.placement import Placement
from moe_place.problem import PlacementProblem
from moe_place.solvers import solve

TOPO = parse_topology_spec("2 nodes x 2 H100, 400 Gbit/s NIC per GPU")
W = 36 * 2**20


def test_stall_pays_the_copy_time_async_the_contention_share():
    moves = Migration(TOPO, W, alpha_s=5e-6, model="stall")
    copies = [Copy(0, 1, W), Copy(1, 2, W), Copy(3, 3, W)]  # NVLink, NIC, local (free)
    copy_s = W / TOPO.path_bandwidth_bytes_per_s(0, 1) + W / TOPO.path_bandwidth_bytes_per_s(1, 2) + 2 * 5e-6
    stall = moves.charge(copies, expert_s=1e-3, comm_s=3e-4)
    assert stall.copy_s == pytest.approx(copy_s) and stall.charged_s == stall.copy_s and stall.steps == 0
    lazy = Migration(TOPO, W, alpha_s=5e-6, model="async").charge(copies, expert_s=1e-3, comm_s=3e-4)
    # a step carries t + d = 1.3 ms of copy work; the d = 0.3 ms beside dispatch/combine delay them
    assert lazy.copy_s == pytest.approx(copy_s)
    assert lazy.charged_s == pytest.approx(copy_s * 0.3 / 1.3)
    assert lazy.steps == math.ceil(copy_s / 1.3e-3) and lazy.steps >= 1
    assert Migration(TOPO, W, model="async").charge([Copy(2, 2, W)], 1e-3, 3e-4).steps == 0  # nothing to copy


def test_async_copies_run_beside_the_expected_dispatch_and_combine():
    cost = cluster_cost(4, 2, "H100", "DeepSeek-V3", migration="async")
    placement = Placement(np.array([[0, 1, 2, 3]]), 4, 4, 2)   # one expert per GPU
    load = np.array([[400.0, 100, 100, 100]])                    # GPU 0 computes 400 rows
    expert, comm, _ = cost.served_times_s(placement.phy2log, load)
    assert comm[0] > 0 and cost.rows_parts_s(placement.phy2log, load, 4)[1] == pytest.approx(comm)
    # GPU 0's port carries more than under an even load: the hot GPU's rows lengthen both phases
    assert cost.served_times_s(placement.phy2log, np.array([[175.0] * 4]))[1][0] < comm[0]
    copies = [Copy(0, 2, W)]
    charge = cost.charge(copies, placement, load)
    step = expert[0] + comm[0]
    assert charge.charged_s == pytest.approx(charge.copy_s * comm[0] / step)


def test_async_replay_switches_after_the_copies_and_pays_less_than_stall():
    counts = np.zeros((40, 1, 8))
    counts[:, 0, :] = [4000, 100, 100, 100, 100, 100, 100, 100]
    start = Placement(np.array([[1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4]]), 8, 4, 2)
    better = Placement(np.array([[0, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4]]), 8, 4, 2)

    class OneMove(StaticController):
        def decide(self, step, current):
            from moe_place.online.controller import Decision
            return Decision(better, (0,)) if step == 4 else None

    runs = {}
    for model in ("stall", "async"):
        cost = cluster_cost(4, 2, "H100", "DeepSeek-V3", migration=model)
        runs[model] = replay(counts, OneMove(), cost, start, drain_steps=1)
        charge = cost.charge(cost.copies(start, better), start, counts[4])
        assert runs[model].copy_time_s[4] == pytest.approx(charge.charged_s)
        switch = 4 + 1 + charge.steps + 1
        assert runs[model].expert_time_s[switch - 1] > runs[model].expert_time_s[switch]  # the new map from here
    assert 0 < runs["async"].total_migration_time_s < runs["stall"].total_migration_time_s
    assert runs["async"].total_bytes_moved == runs["stall"].total_bytes_moved > 0


def test_the_planner_moves_what_the_model_copies():
    rng = np.random.default_rng(0)
    current = Placement.contiguous(2, 16, 4, 2, num_redundant=8)
    loads = rng.zipf(1.4, size=(2, 16)).astype(float)
    problem = PlacementProblem(loads, 4, 24, num_nodes=2, current=current, max_moved_slots=3)
    solution = solve(problem, "fast")
    copies = plan_copies(current, solution.placement, TOPO, W)
    for layer, sol in enumerate(solution.layers):
        assert sol.detail["moved_slots"] == sum(c.layer == layer for c in copies) <= 3
