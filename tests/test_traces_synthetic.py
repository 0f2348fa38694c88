"""Synthetic generators: determinism, exact token-level properties, calibration of the DeepSeek-R1 preset."""

import numpy as np
import pytest

from moe_place.errors import InputError
from moe_place.traces import synthetic as S


def test_inclusion_probabilities_cap_and_sum():
    w = np.array([[0.5, 0.3, 0.1, 0.05, 0.05]])
    q = S.inclusion_probabilities(w, 3)
    assert q.max() <= 1 + 1e-12 and abs(q.sum() - 3) < 1e-9
    assert q[0, 0] == 1.0 and q[0, 1] == 1.0  # 1.5 and 0.9 -> the first is capped, then the second
    # uncapped experts keep their proportions
    assert abs(q[0, 2] / q[0, 3] - 2.0) < 1e-9


def test_token_sampler_gives_distinct_experts_with_the_right_marginals():
    rng = np.random.default_rng(0)
    w = S.lognormal_weights(2, 16, 1.2, rng)
    q = S.inclusion_probabilities(w, 4)
    ids = S.sample_token_ids(q, 20000, rng)
    assert ids.shape == (20000, 2, 4)
    ordered = np.sort(ids, axis=2)
    assert (ordered[:, :, 1:] != ordered[:, :, :-1]).all()
    freq = np.stack([np.bincount(ids[:, layer].ravel(), minlength=16) for layer in range(2)]) / 20000
    # binomial standard error of a frequency near 0.5 over 20000 tokens is 0.0035
    assert np.abs(freq - q).max() < 0.02


def test_count_sampler_matches_expectation_and_totals():
    rng = np.random.default_rng(1)
    q = S.inclusion_probabilities(S.lognormal_weights(3, 32, 1.0, rng), 4)
    counts = S.sample_counts(q, 5000, rng)
    assert counts.shape == (3, 32) and (counts.sum(axis=1) == 5000 * 4).all()
    assert np.abs(counts / 5000 - q).max() < 0.05


@pytest.mark.parametrize("make", [
    lambda seed: S.generate(S.drifting_hot_spots(3, 16, 4, 0.3, persistence=2), 3, 50, 4, seed, token_level=True),
    lambda seed: S.domain_mixture_trace(3, 50, 3, 16, 4, seed=seed),
])
def test_generators_are_deterministic_and_valid(make):
    a, b, c = make(7), make(7), make(8)
    assert a.is_token_level and a.num_tokens == a.num_steps * 50
    np.testing.assert_array_equal(a.step_counts(), b.step_counts())
    assert not np.array_equal(a.step_counts(), c.step_counts())


def test_domain_mixture_counts_shape_dtype_determinism():
    c1 = S.domain_mixture_counts(5, 4, 32, 8, 1000, seed=3)
    c2 = S.domain_mixture_counts(5, 4, 32, 8, 1000, seed=3)
    assert c1.shape == (5, 4, 32) and c1.dtype == np.int64
    np.testing.assert_array_equal(c1, c2)
    assert (c1.sum(axis=2) == 8000).all()


def test_drifting_hot_spots_move_about_every_persistence_steps():
    steps = S.drifting_hot_spots(50, 64, 1, 0.5, persistence=10)(np.random.default_rng(0))
    hottest = np.array([next(steps).argmax(axis=1) for _ in range(200)])  # [steps, layers]
    changes = (hottest[1:] != hottest[:-1]).mean()
    assert 0.07 < changes < 0.13  # a move with probability 1/10 per step (rarely onto itself)


def test_drift_zero_keeps_the_mix():
    c = S.domain_mixture_counts(20, 2, 64, 2, 200000, drift=0.0, seed=0)
    share = c / c.sum(axis=2, keepdims=True)
    assert np.abs(share[0] - share[-1]).max() < 0.01
    moving = S.domain_mixture_counts(20, 2, 64, 2, 200000, drift=1.0, seed=0)
    share = moving / moving.sum(axis=2, keepdims=True)
    assert np.abs(share[0] - share[-1]).max() > 0.02


def test_bad_parameters_are_input_errors():
    with pytest.raises(InputError, match="persistence"):
        S.drifting_hot_spots(2, 16, 2, 0.3, persistence=0.5)
    with pytest.raises(InputError, match="top_k"):
        S.inclusion_probabilities(np.ones((1, 4)), 5)
    with pytest.raises(InputError, match="shared"):
        S.domain_mixture_counts(1, 1, 8, 2, 10, shared=1.0)


@pytest.mark.parametrize("seed", [0, 1])
def test_deepseek_r1_like_calibration(seed):
    """PROVENANCE.md: DeepSeek-R1, 256 experts, top-8, EP 32, contiguous placement, no balancer."""
    trace = S.deepseek_r1_like(seed=seed)
    assert (trace.num_layers, trace.num_experts, trace.top_k) == (58, 256, 8)
    load = trace.total_counts().astype(float)  # [layers, experts]
    gpu = load.reshape(58, 32, 8).sum(axis=2)
    gpu_ratio = gpu.max(axis=1) / gpu.mean(axis=1)
    expert_ratio = load.max(axis=1) / load.mean(axis=1)
    top32 = np.sort(load, axis=1)[:, -32:].sum(axis=1) / load.sum(axis=1)
    # busiest GPU about 2.56x the mean (stated tolerance +-0.2), per layer 1.46-3.46 published:
    assert abs(gpu_ratio.mean() - 2.56) < 0.2
    assert gpu_ratio.min() > 1.3 and gpu_ratio.max() < 4.5 and np.percentile(gpu_ratio, 90) < 3.6
    # busiest expert about 12x the mean (median over layers within +-3)
    assert abs(np.median(expert_ratio) - 12) < 3
    # the top 32 of 256 experts take 25-50% of the load (every layer)
    assert top32.min() >= 0.25 and top32.max() <= 0.50


def test_coactivation_trace_keeps_a_token_in_its_cluster_as_its_cohesion_says():
    # 3 layers at cohesion 1, 0.5 and 0: a token's k experts from its topic's cluster, half, and anywhere
    trace, clusters = S.coactivation_trace(4, 600, 3, 32, 4, 4, [1.0, 0.5, 0.0], seed=3)
    again, same = S.coactivation_trace(4, 600, 3, 32, 4, 4, [1.0, 0.5, 0.0], seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(trace.topk_ids, again.topk_ids)) and np.array_equal(clusters, same)
    assert (trace.num_layers, trace.num_experts, trace.top_k, trace.num_steps) == (3, 32, 4, 4)
    assert clusters.shape == (3, 32) and all(np.bincount(c).tolist() == [8] * 4 for c in clusters)
    ids = np.concatenate(trace.topk_ids)                                   # [tokens, layers, k]
    ordered = np.sort(ids, axis=2)
    assert (ordered[:, :, 1:] != ordered[:, :, :-1]).all()                 # k distinct experts
    topic = clusters[0][ids[:, 0, 0]]                                      # layer 0 names each token's topic
    assert (clusters[0][ids[:, 0, :]] == topic[:, None]).all()             # cohesion 1: all in the cluster
    assert (clusters[2][ids[:, 2, :]] == topic[:, None]).mean() == pytest.approx(0.25, abs=0.05)   # 0: by chance
    half = (clusters[1][ids[:, 1, :]] == topic[:, None]).mean()            # 0.5 + 0.5 * (about a quarter)
    assert 0.5 < half < 0.75


def test_coactivation_trace_drift_moves_the_hot_cluster_and_the_hot_experts():
    # persistence 1: the topic mix and the experts' weights change from step to step; a long persistence keeps them
    def shares(persistence):
        trace, _ = S.coactivation_trace(6, 2000, 1, 32, 4, 4, 1.0, topic_spread=2.0, topic_persistence=persistence,
                                        expert_persistence=persistence, seed=0)
        loads = np.stack([np.bincount(s[:, 0].ravel(), minlength=32) for s in trace.topk_ids]) / (2000 * 4)
        return np.abs(np.diff(loads, axis=0)).sum(axis=1).mean()
    assert shares(1.0) > 2 * shares(1000.0)
    with pytest.raises(InputError, match="num_clusters"):
        S.coactivation_trace(1, 10, 1, 30, 2, 4, 0.5)
    with pytest.raises(InputError, match="top_k"):
        S.coactivation_trace(1, 10, 1, 32, 9, 4, 0.5)
    with pytest.raises(InputError, match="cohesion"):
        S.coactivation_trace(1, 10, 2, 32, 2, 4, [0.5, 1.5])
    with pytest.raises(InputError, match="persistence"):
        S.coactivation_trace(1, 10, 1, 32, 2, 4, 0.5, topic_persistence=0.0)
