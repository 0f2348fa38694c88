"""Token-level analyses: active experts per batch vs E[U], co-activation, dispatch matrix a[i][j]."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_place.analysis.active import active_experts, expected_active_experts
from moe_place.analysis.coactivation import coactivation
from moe_place.analysis.dispatch import dispatch_matrix, expert_to_gpu_share, token_sources
from moe_place.errors import InputError
from moe_place.placement import Placement
from moe_place.traces.model import count_dispatches


def uniform_topk(rng, tokens, layers, experts, k):
    """[tokens, layers, k] distinct uniform expert ids (a permutation prefix per token and layer)."""
    return np.argsort(rng.random((tokens, layers, experts)), axis=-1)[..., :k]


def test_expected_active_experts_limits():
    assert expected_active_experts(128, 8, 1) == pytest.approx(8)  # one token touches exactly k
    assert expected_active_experts(128, 8, 0) == 0
    assert expected_active_experts(128, 8, 10_000) == pytest.approx(128)
    np.testing.assert_allclose(expected_active_experts(16, 16, np.array([1, 5])), [16, 16])
    with pytest.raises(InputError):
        expected_active_experts(8, 9, 1)


def test_observed_active_experts_match_formula_2_under_uniform_routing():
    rng = np.random.default_rng(7)
    ids = uniform_topk(rng, 64 * 200, 1, 128, 8)
    act = active_experts(np.stack([count_dispatches(batch, 128) for batch in ids.reshape(200, 64, 1, 8)]), top_k=8)
    assert act.observed.shape == (200, 1)
    np.testing.assert_allclose(act.num_tokens, 64)
    # E[U] = 125.94 for M = 64; the mean of 200 batches is within a few standard errors
    assert act.observed.mean() == pytest.approx(125.94, abs=0.25)
    np.testing.assert_allclose(act.expected, expected_active_experts(128, 8, 64))


def test_active_experts_count_the_experts_with_rows():
    counts = np.array([[[1, 2, 1, 0]], [[1, 0, 1, 2]], [[0, 0, 4, 0]]])  # 3 batches, 1 layer, k=2
    assert active_experts(counts, 2).observed[:, 0].tolist() == [3, 3, 1]


def test_coactivation_counts_pairs_within_tokens():
    ids = np.array([[[0, 1, 2]], [[1, 2, 3]], [[0, 2, 3]]])  # 3 tokens, 1 layer, k=3
    co = coactivation(ids, 4)[0]
    assert co[1, 2] == co[2, 1] == 2 and co[0, 3] == 1 and co[0, 1] == 1
    np.testing.assert_array_equal(np.diag(co), count_dispatches(ids, 4)[0])
    # each token adds k*(k-1) ordered pairs off the diagonal
    assert co.sum() - np.trace(co) == 3 * 3 * 2


def test_coactivation_in_chunks_equals_one_pass(monkeypatch):
    import moe_place.analysis.coactivation as module

    ids = uniform_topk(np.random.default_rng(3), 1001, 2, 16, 4)
    whole = coactivation(ids, 16)
    monkeypatch.setattr(module, "CHUNK_PAIRS", 16 * 7)  # 7 tokens per chunk
    np.testing.assert_array_equal(coactivation(ids, 16), whole)


def test_coactivation_of_uniform_routing_is_flat():
    rng = np.random.default_rng(1)
    ids = uniform_topk(rng, 20_000, 2, 16, 4)
    co = coactivation(ids, 16)
    off = co[:, ~np.eye(16, dtype=bool)]
    expected = 20_000 * 4 * 3 / (16 * 15)  # tokens picking a given pair: n k (k-1) / (E (E-1))
    assert abs(off.mean() - expected) < 1e-9  # exact: every token adds k(k-1) pairs
    assert off.std() / expected < 0.06


def test_token_sources():
    np.testing.assert_array_equal(token_sources(7, 3, "round-robin"), [0, 1, 2, 0, 1, 2, 0])
    np.testing.assert_array_equal(token_sources(7, 3, "blocks"), [0, 0, 0, 1, 1, 2, 2])
    with pytest.raises(InputError):
        token_sources(4, 2, "random")


def test_dispatch_matrix_by_hand():
    # 4 experts on 2 GPUs (0,1 | 2,3); tokens 0,1 live on GPU 0, tokens 2,3 on GPU 1
    ids = np.array([[0, 2], [1, 3], [2, 3], [0, 1]])
    a = dispatch_matrix(ids, token_sources(4, 2, "blocks"), Placement.contiguous(1, 4, 2))
    np.testing.assert_allclose(a, [[2, 2], [2, 2]])
    a = dispatch_matrix(ids[:, :1], np.array([0, 0, 1, 1]), Placement.contiguous(1, 4, 2))
    np.testing.assert_allclose(a, [[2, 0], [1, 1]])


def test_dispatch_matrix_splits_over_replicas():
    placement = Placement(np.array([[0, 1, 0, 2]]), 3, 2)  # expert 0 on both GPUs
    a = dispatch_matrix(np.array([[0], [0], [2]]), np.array([0, 1, 1]), placement)
    np.testing.assert_allclose(a, [[0.5, 0.5], [0.5, 1.5]])
    np.testing.assert_allclose(expert_to_gpu_share(placement, 0).sum(axis=1), 1.0)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 1000), st.sampled_from([(8, 2, 2), (12, 3, 3), (16, 4, 8)]),
       st.sampled_from(["blocks", "round-robin"]))
def test_dispatch_matrix_columns_are_the_gpu_rows(seed, sizes, layout):
    experts, gpus, redundant = sizes
    rng = np.random.default_rng(seed)
    ids = uniform_topk(rng, 97, 2, experts, 2)
    placement = Placement.contiguous(2, experts, gpus, num_redundant=redundant)
    sources = token_sources(97, gpus, layout)
    for layer in range(2):
        a = dispatch_matrix(ids[:, layer], sources, placement, layer)
        np.testing.assert_allclose(a.sum(axis=0), placement.gpu_loads(count_dispatches(ids, experts))[layer])
        np.testing.assert_allclose(a.sum(axis=1), np.bincount(sources, minlength=gpus) * 2)


def test_dispatch_matrix_rejects_bad_input():
    placement = Placement.contiguous(1, 4, 2)
    with pytest.raises(InputError):
        dispatch_matrix(np.array([[0, 4]]), np.array([0]), placement)
    with pytest.raises(InputError):
        dispatch_matrix(np.array([[0, 1]]), np.array([0, 1]), placement)
    with pytest.raises(InputError):
        dispatch_matrix(np.array([[0, 1]]), np.array([0]), placement, layer=1)
