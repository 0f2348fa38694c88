"""The `trtllm` baseline solver: TensorRT-LLM's offline greedy (`do_replication`, `do_placement` in
cpp/tensorrt_llm/runtime/moeLoadBalancer/moeLoadBalancer.cpp at 65b31db, called by
examples/wide_ep/ep_load_balancer/generate_eplb_config.py at 76a646e), as `moe_place.solvers.trtllm` says.

Worked by hand from that reading; the tie rules (a max-heap of (size, expert id): the larger id wins a
tie in replication; replicas sorted by size then smaller expert id; a min-heap of (load, rank): the smaller
rank wins) are pinned on purpose, since they decide where equal loads go.
"""

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from moe_place.cli.main import main
from moe_place.placement import has_colocation
from moe_place.solvers.trtllm import trtllm_placement, trtllm_plan, trtllm_replicas
from moe_place.traces.load import load_trace

BUNDLED = Path(__file__).resolve().parents[1] / "traces" / "data" / "qwen3-30b-a3b_prefill_topk.npz"


def test_a_layer_worked_by_hand():
    # replication: 2 extra slots go to expert 0 (10 -> 5 per replica), then expert 1 (6 > 5 -> 3)
    load = np.array([10.0, 6, 3, 1])
    assert trtllm_replicas(load, 6).tolist() == [2, 2, 1, 1]
    # placement: replicas 5,5 (e0), 3,3 (e1), 3 (e2), 1 (e3) onto 2 ranks of 3 slots, least-loaded rank first:
    # rank 0 gets e0 (5), e1 (8), e2 (11, full); rank 1 gets e0 (5), e1 (8), e3 (9)
    assert trtllm_placement(load, [2, 2, 1, 1], 2).tolist() == [0, 1, 2, 0, 1, 3]
    assert trtllm_plan(load, 6, 2).tolist() == [0, 1, 2, 0, 1, 3]


def test_ties_go_where_the_cpp_heaps_send_them():
    assert trtllm_replicas([4.0, 4.0], 3).tolist() == [1, 2]          # equal sizes: the larger expert id
    assert trtllm_placement([4.0, 4.0], [1, 2], 1).tolist() == [0, 1, 1]
    assert trtllm_placement([2.0, 2.0, 2.0, 2.0], [1, 1, 1, 1], 2).tolist() == [0, 2, 1, 3]  # rank 0 first


def test_loads_are_float32_as_the_script_hands_them_over():
    # 2**25 + 1 and 2**25 are one float32 value: a tie, which the larger expert id wins
    assert trtllm_replicas([2.0**25 + 1, 2.0**25], 3).tolist() == [1, 2]


def test_idle_layer_and_no_spare_slots():
    assert trtllm_replicas(np.zeros(4), 6).tolist() == [2, 2, 1, 1]  # evenly, the first experts one more
    assert trtllm_replicas([5.0, 1, 1, 1], 4).tolist() == [1, 1, 1, 1]


@pytest.mark.parametrize("seed", range(6))
def test_replication_minimises_the_largest_replica_load(seed):
    rng = np.random.default_rng(seed)
    load = rng.integers(0, 40, 4).astype(float)
    slots = int(rng.integers(4, 9))
    got = trtllm_replicas(load, slots)
    assert got.sum() == slots and got.min() >= 1
    best = min(max(load / np.array(c)) for c in itertools.product(range(1, slots - 2), repeat=4) if sum(c) == slots)
    assert max(load / got) == pytest.approx(best)


def test_plan_with_the_trtllm_solver_is_generate_eplb_configs_map(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", str(BUNDLED), "--gpus", "32", "--redundant", "32", "--solver", "trtllm", "--out", str(out),
                 "--no-progress"]) == 0
    capsys.readouterr()
    plan = json.loads(out.read_text())
    totals = load_trace(BUNDLED).total_counts()  # what the script sums over the iterations
    want = np.stack([trtllm_plan(total, 160, 32) for total in totals])
    np.testing.assert_array_equal(np.array(plan["phy2log"]), want)
    assert any(has_colocation(row, 32) for row in want)  # the greedy co-locates replicas, and the plan may


def test_compare_runs_it_beside_the_others(capsys):
    assert main(["compare", str(BUNDLED), "--gpus", "32", "--redundant", "32", "--solvers", "trtllm,fast",
                 "--layers", "0-3", "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("trtllm ") for line in lines) and any(line.startswith("fast ") for line in lines)
