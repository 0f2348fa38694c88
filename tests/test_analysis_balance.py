"""GPU balance of placements and the EP sweep: hand examples, engine definitions, bad EP sizes."""

import numpy as np
import pytest

from moe_place.analysis.balance import balance_of_gpu_loads, gpu_balance, sglang_balancedness, vllm_balancedness
from moe_place.analysis.ep_sweep import check_ep_sizes, default_ep_sizes, ep_sweep
from moe_place.errors import InputError
from moe_place.placement import Placement, balancedness


def test_contiguous_rows_per_gpu_and_skew():
    loads = np.array([[10, 0, 3, 3, 2, 2, 0, 0]])  # GPUs of 2 experts: 10, 6, 4, 0 rows, mean 5
    bal = gpu_balance(Placement.contiguous(1, 8, 4), loads)
    np.testing.assert_allclose(bal.gpu_load, [[10, 6, 4, 0]])
    np.testing.assert_allclose(bal.max_over_mean, [2.0])
    np.testing.assert_allclose(bal.balancedness, [0.5])
    np.testing.assert_allclose(bal.sglang_balancedness, [(5 + 1e-5) / (10 + 1e-5)])


def test_replicas_split_the_load_evenly():
    # expert 0 (12 rows) on GPUs 0 and 1 (6 each), expert 1 (4 rows) on GPUs 0 and 2 (2 each)
    phy2log = np.array([[0, 1, 0, 2, 3, 1]])  # GPU0 {0,1} GPU1 {0,2} GPU2 {3,1}
    placement = Placement(phy2log, 4, 3)
    bal = gpu_balance(placement, np.array([[12, 4, 2, 2]]))
    np.testing.assert_allclose(bal.gpu_load, [[6 + 2, 6 + 2, 2 + 2]])
    assert bal.gpu_load.sum() == pytest.approx(20)


def test_vllm_balancedness_weighs_layers_by_their_busiest_gpu():
    gpu_load = np.array([[1.0, 1.0], [0.0, 4.0]])  # per-layer mean/max: 1.0 and 0.5
    np.testing.assert_allclose(balancedness(gpu_load), [1.0, 0.5])
    # vLLM: (1 + 2) / (1 + 4), not the mean of the per-layer ratios (0.75)
    assert vllm_balancedness(gpu_load) == pytest.approx(3 / 5)
    assert vllm_balancedness(np.zeros((2, 3))) == 0.0
    # SGLang: the epsilon makes an idle layer count as balanced
    np.testing.assert_allclose(sglang_balancedness(np.zeros((1, 4))), [1.0])
    assert balance_of_gpu_loads(gpu_load).vllm_balancedness == pytest.approx(0.6)


def test_ep_sweep_matches_reshaped_sums():
    rng = np.random.default_rng(3)
    loads = rng.integers(0, 100, size=(5, 64))
    points = ep_sweep(loads, [16, 4, 64])
    assert [p.ep_size for p in points] == [4, 16, 64]
    for point in points:
        ref = loads.reshape(5, point.ep_size, -1).sum(-1)
        np.testing.assert_allclose(point.balance.gpu_load, ref)
        np.testing.assert_allclose(point.balance.max_over_mean, ref.max(1) / ref.mean(1))
        assert point.placement.slots_per_gpu == 64 // point.ep_size


def test_one_gpu_is_always_balanced():
    point, = ep_sweep(np.array([[5, 0, 0, 1]]), [1])
    np.testing.assert_allclose(point.balance.max_over_mean, [1.0])


def test_ep_sizes_must_divide_the_expert_count():
    assert check_ep_sizes([32, 8, 8], 128) == (8, 32)
    with pytest.raises(InputError, match="divide the 128 experts, got 48"):
        check_ep_sizes([8, 48], 128)
    with pytest.raises(InputError):
        check_ep_sizes([], 128)
    with pytest.raises(InputError):
        ep_sweep(np.ones((1, 10)), [4])


def test_default_ep_sizes():
    assert default_ep_sizes(128) == (8, 16, 32, 64, 128)
    assert default_ep_sizes(256) == (8, 16, 32, 64, 128, 256)
    assert default_ep_sizes(64) == (8, 16, 32, 64)
    assert default_ep_sizes(8) == (8,)
    assert default_ep_sizes(6) == (6,)
    assert default_ep_sizes(160) == (8, 16, 32)
