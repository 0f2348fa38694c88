"""The replay's vectorised cost model agrees with the cost helper's per-GPU formulas."""

import numpy as np
import pytest

from moe_place.cost.cluster import cluster_cost
from moe_place.cost.gemm import expert_time_s
from moe_place.cost.migration import Copy, copy_time_s
from moe_place.placement import Placement


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gpu_times_match_expert_time_s_per_gpu(seed):
    cost = cluster_cost(num_gpus=4, hardware="H100", model="Qwen3-30B-A3B")
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 700, size=(4, 5))
    rows[rng.random(rows.shape) < 0.3] = 0  # empty slots cost nothing
    got = cost.gpu_times_s(rows)
    m, gpu = cost.model, cost.gpu
    for g in range(4):
        want = expert_time_s(rows[g], m.hidden, m.intermediate, m.dtype_bytes, gpu.flops_per_s,
                             gpu.memory_bytes_per_s, weights="calibrated", block_m=cost.block_m, block_n=cost.block_n,
                             profile=gpu.gemm_profile())
        assert got[g] == pytest.approx(want, rel=1e-12)


def test_layer_time_is_the_busiest_gpu_and_replicas_split_rows_evenly():
    cost = cluster_cost(num_gpus=2, model="Qwen3-30B-A3B")
    # 4 experts, 2 GPUs, 2 slots each; expert 0 hot
    single = Placement(np.array([[0, 1, 2, 3]]), 4, 2)
    load = np.array([[1024.0, 64, 64, 64]])
    t_single = cost.layer_times_s(single, load)[0]
    assert t_single == pytest.approx(cost.gpu_times_s(np.array([[1024, 64], [64, 64]])).max())
    # with 3 slots per GPU and expert 0 replicated on both GPUs, each replica takes 512 rows
    replicated = Placement(np.array([[0, 1, 2, 0, 3, 1]]), 4, 2)
    t_rep = cost.layer_times_s(replicated, load)[0]
    assert t_rep == pytest.approx(cost.gpu_times_s(np.array([[512, 32, 64], [512, 64, 32]])).max())
    assert t_rep < t_single


def test_copies_take_the_cheapest_source_and_match_payback_copy_time():
    cost = cluster_cost(num_gpus=4, num_nodes=2, model="Qwen3-30B-A3B")  # GPUs 0,1 on node 0; 2,3 on node 1
    old = Placement(np.array([[0, 1, 2, 3, 4, 5, 0, 1]]), 6, 4, 2)
    # slot 1 (GPU 0) gets expert 2 from GPU 1 (same node, NVLink); slots 2 and 3 swap experts inside
    # GPU 1; slot 4 (GPU 2, node 1) gets expert 2, only on GPU 1 (node 0): across nodes; slot 6 gets 4 from GPU 2
    new = Placement(np.array([[0, 2, 3, 2, 2, 5, 4, 1]]), 6, 4, 2)
    copies = {c.slot: c for c in cost.copies(old, new)}
    assert set(copies) == {1, 2, 3, 4, 6}
    moves = cost.moves
    seconds = {slot: copy_time_s(cost.topology, [c], cost.alpha_s, "serial") for slot, c in copies.items()}  # alone
    assert (copies[1].src_gpu, moves.path(copies[1])) == (1, "nvlink")
    assert (copies[6].src_gpu, moves.path(copies[6])) == (2, "nvlink")
    for slot in (2, 3):
        assert copies[slot].src_gpu == copies[slot].dst_gpu == 1 and copies[slot].local and seconds[slot] == 0
    assert copies[4].src_gpu == 1 and "nic" in moves.path(copies[4])
    assert seconds[4] > seconds[1] > 0
    assert all(isinstance(c, Copy) and c.layer == 0 and c.expert == new.phy2log[0, c.slot] for c in copies.values())
    total = moves.copy_time_s(list(copies.values()))
    assert total == pytest.approx(copy_time_s(cost.topology, list(copies.values()), cost.alpha_s, "serial"))
    assert total == pytest.approx(seconds[1] + seconds[4] + seconds[6])
