"""Conformance rows of docs/MODEL.md: C1, C2, C4 (exact) and C5 (statistical, within +-0.01) from analysis
outputs (C1: the cost model's expert work)."""

import numpy as np
import pytest

from moe_place.analysis.active import expected_active_experts
from moe_place.analysis.balance import gpu_balance
from moe_place.analysis.ep_sweep import ep_sweep
from moe_place.cost.gemm import expert_work_arrays
from moe_place.placement import Placement

MiB, GiB = 2**20, 2**30
PARAMS_PER_EXPERT = 3 * 4096 * 1536  # Qwen3-235B-A22B expert: P_e = 18,874,368
EXPERT_BYTES = 2 * PARAMS_PER_EXPERT  # BF16: W_e = 36 MiB


def test_expert_size_of_the_spec():
    assert PARAMS_PER_EXPERT == 18_874_368 and EXPERT_BYTES == 36 * MiB


def test_c1_same_flops_but_16x_the_weight_traffic_when_uniform():
    uniform = np.full(128, 4)  # 512 dispatches over all 128 experts
    concentrated = np.zeros(128)
    concentrated[:8] = 64  # the same 512 dispatches on 8 experts
    # the cost model's expert work: weights read once per touched expert (formula 1), BF16
    _, flops, weight_bytes = expert_work_arrays(np.stack([uniform, concentrated]), 4096, 1536, 2, weights="once")
    assert [round(f / 1e9, 2) for f in flops] == [19.33, 19.33]
    assert weight_bytes.tolist() == [4.5 * GiB, 288 * MiB] and weight_bytes[1] == 8 * EXPERT_BYTES
    cpu_bytes_per_s = 220e9
    assert [round(b / cpu_bytes_per_s * 1e3, 2) for b in weight_bytes] == [21.96, 1.37]


def test_c2_expected_active_experts_and_their_weights():
    active = expected_active_experts(128, 8, 64)
    assert round(active, 2) == 125.94
    assert round(active * EXPERT_BYTES / GiB, 2) == 4.43


def c4_loads() -> np.ndarray:
    """n=1024, k=8, E=256: expert 0 gets 128 rows, the other 8064 spread evenly over 255."""
    loads = np.full((1, 256), (1024 * 8 - 128) / 255)
    loads[0, 0] = 128
    return loads


@pytest.mark.parametrize("ep_size, busiest_rows, ratio", [(8, 1108.3, 1.08), (32, 349.4, 1.36), (256, 128.0, 4.0)])
def test_c4_busiest_gpu_rows_with_one_hot_expert(ep_size, busiest_rows, ratio):
    bal = gpu_balance(Placement.contiguous(1, 256, ep_size), c4_loads())
    assert round(bal.gpu_load.max(), 1) == busiest_rows
    assert round(bal.max_over_mean[0], 2) == ratio
    assert bal.gpu_load.sum() == pytest.approx(1024 * 8)


def test_c4_receive_time_of_the_hot_gpu_at_ep256():
    bal = gpu_balance(Placement.contiguous(1, 256, 256), c4_loads())
    row_bytes, nic_bytes_per_s = 8 * 1024, 50e9
    hot_bytes = bal.gpu_load.max() * row_bytes
    assert hot_bytes == MiB
    assert round(hot_bytes / nic_bytes_per_s * 1e6) == 21
    assert round(bal.gpu_load.mean() * row_bytes / nic_bytes_per_s * 1e6, 1) == 5.2


def uniform_distinct_topk(rng: np.random.Generator, num_tokens: int, num_experts: int, top_k: int) -> np.ndarray:
    """int64 `[tokens, k]`: a uniformly random k-subset per token (Floyd's algorithm, vectorised)."""
    chosen = np.empty((num_tokens, top_k), dtype=np.int64)
    for i, j in enumerate(range(num_experts - top_k, num_experts)):
        pick = rng.integers(0, j + 1, size=num_tokens)
        taken = (chosen[:, :i] == pick[:, None]).any(axis=1)
        chosen[:, i] = np.where(taken, j, pick)
    return chosen


def test_floyd_sampler_is_distinct_and_uniform():
    ids = uniform_distinct_topk(np.random.default_rng(5), 40_000, 16, 4)
    ordered = np.sort(ids, axis=1)
    assert (ordered[:, 1:] != ordered[:, :-1]).all() and ids.min() == 0 and ids.max() == 15
    counts = np.bincount(ids.ravel(), minlength=16)
    assert np.abs(counts / (40_000 * 4 / 16) - 1).max() < 0.03


def test_c5_uniform_routing_still_leaves_the_busiest_gpu_above_the_mean():
    batches, tokens, top_k, experts = 1000, 1024, 8, 256
    ids = uniform_distinct_topk(np.random.default_rng(2024), batches * tokens, experts, top_k)
    batch = np.repeat(np.arange(batches), tokens * top_k)
    counts = np.bincount(batch * experts + ids.ravel(), minlength=batches * experts).reshape(batches, experts)
    assert (counts.sum(axis=1) == tokens * top_k).all()
    # each batch is one "layer" of loads; mean over batches of busiest/mean GPU rows
    sweep = {p.ep_size: p.balance.max_over_mean.mean() for p in ep_sweep(counts, [8, 32, 256])}
    assert sweep[8] == pytest.approx(1.04, abs=0.01)
    assert sweep[32] == pytest.approx(1.13, abs=0.01)
    assert sweep[256] == pytest.approx(1.52, abs=0.01)
