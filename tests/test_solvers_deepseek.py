"""DeepSeek EPLB reimplementation: the README example exactly, then its documented behaviour."""

import numpy as np
import pytest

from moe_place.errors import InputError
from moe_place.placement import Placement, has_colocation
from moe_place.problem import PlacementProblem
from moe_place.solvers import get_solver
from moe_place.solvers.deepseek import balanced_packing, eplb_maps, eplb_rebalance, replicate_experts

README_WEIGHT = np.array([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                          [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
README_PHY2LOG = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                  [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]


def test_readme_example_hierarchical_exact():
    phy2log, log2phy, logcnt = eplb_maps(README_WEIGHT, 16, 4, 2, 8)
    assert phy2log.tolist() == README_PHY2LOG
    assert logcnt.tolist() == [np.bincount(row, minlength=12).tolist() for row in README_PHY2LOG]
    for layer in range(2):  # log2phy lists exactly the slots of each expert
        for expert in range(12):
            slots = sorted(p for p in log2phy[layer, expert] if p >= 0)
            assert slots == [p for p in range(16) if README_PHY2LOG[layer][p] == expert]
    assert eplb_rebalance(README_WEIGHT, 16, 4, 2, 8).tolist() == README_PHY2LOG


def test_global_policy_when_groups_do_not_divide_nodes():
    # 3 groups on 2 nodes: EPLB falls back to one group on one node (the global policy)
    weight = README_WEIGHT[:, :12]
    assert np.array_equal(eplb_rebalance(weight, 16, 3, 2, 8), eplb_rebalance(weight, 16, 1, 1, 8))
    assert not np.array_equal(eplb_rebalance(weight, 16, 4, 2, 8), eplb_rebalance(weight, 16, 1, 1, 8))


def test_replicate_gives_each_extra_replica_to_largest_load_per_replica():
    phy2log, rank, logcnt = replicate_experts(np.array([[10.0, 6.0, 1.0]], dtype=np.float32), 6)
    # extra replicas: 10/1 -> expert 0 (now 5), 6/1 -> expert 1 (now 3), 5 -> expert 0 again
    assert phy2log.tolist() == [[0, 1, 2, 0, 1, 0]]
    assert logcnt.tolist() == [[3, 2, 1]]
    assert rank.tolist() == [[0, 0, 0, 1, 1, 2]]


def test_balanced_packing_exact_counts_and_greedy_choice():
    weight = np.array([[9, 8, 7, 6, 1, 1]], dtype=np.float32)
    pack, rank = balanced_packing(weight, 2)
    assert np.bincount(pack[0]).tolist() == [3, 3]
    # heaviest first to the lightest pack with room: 9->A, 8->B, 7->B, 6->A, then the 1s fill up
    assert pack[0].tolist() == [0, 1, 1, 0, 0, 1]
    assert rank[0].tolist() == [0, 0, 1, 1, 2, 2]


def test_balanced_packing_heap_and_numpy_paths_agree():
    """Few rows are packed by a heap, many by numpy at once: the same packs and ranks, ties and zeros included."""
    from moe_place.solvers.deepseek import _pack_rows_at_once, _pack_rows_by_heap
    rng = np.random.default_rng(3)
    for rows, items, packs in ((1, 6, 2), (5, 72, 8), (11, 40, 4), (3, 96, 32)):
        taken = -np.sort(-rng.integers(0, 6, size=(rows, items)).astype(np.float32), axis=1)   # many ties
        taken[0] = 0.0                                                                         # an idle row
        per_pack = items // packs
        heap, numpy_ = _pack_rows_by_heap(taken, packs, per_pack), _pack_rows_at_once(taken, packs, per_pack)
        assert np.array_equal(heap[0], numpy_[0]) and np.array_equal(heap[1], numpy_[1]), (rows, items, packs)
        assert (np.apply_along_axis(np.bincount, 1, heap[0], minlength=packs) == per_pack).all()


def test_tiny_instance_reaches_232_with_colocation():
    loads = np.array([[600, 560, 120, 120, 20, 10, 10, 10]])
    phy2log = eplb_rebalance(loads, 16, 1, 1, 8)
    assert has_colocation(phy2log, 8)  # EPLB issue #22: two replicas of one expert on one GPU
    placement = Placement(phy2log, 8, 8, allow_colocated=True)
    assert placement.gpu_loads(loads).max() == pytest.approx(232.0)
    solution = get_solver("eplb").solve_layer(PlacementProblem(loads, 8, 16), 0, None)
    assert solution.objective == pytest.approx(232.0)
    assert solution.detail["colocated"] is True
    assert solution.lower_bound <= 590 / 3


def test_bad_arguments_raise_input_errors():
    with pytest.raises(InputError, match="num_replicas"):
        eplb_maps(README_WEIGHT, 15, 4, 2, 8)
    with pytest.raises(InputError, match="num_groups"):
        eplb_maps(README_WEIGHT, 16, 5, 1, 8)
    with pytest.raises(InputError, match="weight"):
        eplb_maps(-README_WEIGHT, 16, 4, 2, 8)
