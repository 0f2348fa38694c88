"""Co-activation and the top pair's lift (analysis/coactivation.py) against brute-force per-token loops."""

import itertools
import math

import numpy as np
import pytest

from moe_place.analysis import coactivation as module
from moe_place.analysis.coactivation import coactivation, top_pairs
from moe_place.traces.sample import TokenSample


def random_topk(rng, tokens, layers, experts, k, skew=0.0):
    """int16 `[tokens, layers, k]`, distinct ids per token-layer; `skew` > 0 favours low ids."""
    weights = np.arange(experts, 0, -1, dtype=float) ** (4 * skew)
    keys = rng.gumbel(size=(tokens, layers, experts)) + np.log(weights)
    return np.argsort(-keys, axis=2)[:, :, :k].astype(np.int16)


def brute_pairs(ids, experts):
    """C[l][a][b] by looping over every token and every pair of its ids (diagonal: loads)."""
    tokens, layers, k = ids.shape
    out = np.zeros((layers, experts, experts), dtype=np.int64)
    for t in range(tokens):
        for layer in range(layers):
            row = [int(x) for x in ids[t, layer]]
            for a in row:
                for b in row:
                    out[layer, a, b] += 1
    return out


def brute_best(ids, layer, experts):
    """(a, b, tokens) of the most frequent pair a < b of one layer (the smallest on ties), by loops."""
    counts = {}
    for row in ids[:, layer]:
        for a, b in itertools.combinations(sorted(int(x) for x in row), 2):
            counts[(a, b)] = counts.get((a, b), 0) + 1
    if not counts:
        return None
    best = max(counts.values())
    a, b = min(pair for pair, count in counts.items() if count == best)
    return a, b, best


def tokens_with_both(ids, layer, a, b):
    return sum(1 for row in ids[:, layer] if a in row and b in row)


@pytest.mark.parametrize("tokens, layers, experts, k, skew", [
    (37, 1, 5, 2, 0.0), (255, 3, 16, 4, 0.5), (120, 2, 200, 8, 1.0), (50, 2, 9, 9, 0.0), (40, 2, 6, 1, 0.0)])
def test_coactivation_equals_per_token_loops(tokens, layers, experts, k, skew):
    ids = random_topk(np.random.default_rng(tokens), tokens, layers, experts, k, skew)
    np.testing.assert_array_equal(coactivation(ids, experts), brute_pairs(ids, experts))


def test_coactivation_in_small_chunks_equals_per_token_loops(monkeypatch):
    ids = random_topk(np.random.default_rng(5), 301, 2, 12, 3, 0.7)
    monkeypatch.setattr(module, "CHUNK_PAIRS", 3 * 5)  # 5 tokens per chunk
    np.testing.assert_array_equal(coactivation(ids, 12), brute_pairs(ids, 12))


@pytest.mark.parametrize("tokens, layers, experts, k, skew", [
    (400, 3, 16, 4, 0.6), (333, 2, 200, 8, 1.0), (90, 1, 7, 3, 0.0), (64, 2, 5, 5, 0.0)])
def test_top_pairs_on_every_token_equal_per_token_loops(tokens, layers, experts, k, skew):
    ids = random_topk(np.random.default_rng(k), tokens, layers, experts, k, skew)
    loads = np.stack([np.bincount(ids[:, layer].ravel(), minlength=experts) for layer in range(layers)])
    pairs = top_pairs(TokenSample(ids, tokens), loads)
    assert pairs.exact and pairs.chosen_on == pairs.estimated_on == tokens
    for layer in range(layers):
        a, b, both = brute_best(ids, layer, experts)
        assert both == tokens_with_both(ids, layer, a, b)
        assert pairs.experts[layer].tolist() == [a, b] and pairs.tokens[layer] == both
        assert pairs.lift[layer] == tokens * both / (int(loads[layer, a]) * int(loads[layer, b]))
        assert pairs.lift_stderr[layer] == 0


def test_top_pairs_of_a_sample_choose_on_one_quarter_and_count_on_the_rest():
    rng = np.random.default_rng(11)
    ids = random_topk(rng, 600, 2, 10, 3, 0.8)  # a sample of 600 tokens of a 50,000-token trace
    loads = np.array([[5000 + 300 * e for e in range(10)], [7000 - 200 * e for e in range(10)]])
    total = 50_000
    pairs = top_pairs(TokenSample(ids, total), loads)
    assert not pairs.exact and (pairs.chosen_on, pairs.estimated_on) == (150, 450)
    for layer in range(2):
        a, b, _ = brute_best(ids[:150], layer, 10)
        hits = tokens_with_both(ids[150:], layer, a, b)
        share = hits / 450
        stderr = math.sqrt(share * (1 - share) / 450 * (total - 150 - 450) / (total - 150 - 1))
        scale = total * total / (loads[layer, a] * loads[layer, b])
        assert pairs.experts[layer].tolist() == [a, b]
        assert pairs.tokens[layer] == pytest.approx(share * total, rel=1e-12)
        assert pairs.lift[layer] == pytest.approx(share * scale, rel=1e-12)
        assert pairs.lift_stderr[layer] == pytest.approx(stderr * scale, rel=1e-12)


def test_sampled_lift_is_not_inflated_by_choosing_the_largest_count():
    # Uniform routing, k distinct of E: every pair's lift is (k-1)E / (k(E-1)) = 0.774. Counting the
    # chosen pair on the part that chose it gives the largest of 496 noisy counts (~1.4x that);
    # the other tokens give an honest estimate.
    rng = np.random.default_rng(3)
    experts, k, total = 32, 4, 200_000
    ids = np.argsort(rng.random((8192, 4, experts)), axis=2)[:, :, :k].astype(np.int16)
    loads = np.full((4, experts), total * k // experts)
    expected = (k - 1) * experts / (k * (experts - 1))
    pairs = top_pairs(TokenSample(ids, total), loads)
    assert np.all(np.abs(pairs.lift - expected) < 3 * pairs.lift_stderr)
    assert np.all(pairs.lift_stderr < 0.2 * expected)  # about 1/sqrt(50 tokens picking a pair)
    first_quarter = [brute_best(ids[:2048], layer, experts)[2] for layer in range(4)]
    biased = np.array(first_quarter) / 2048 * total * total / (total * k / experts) ** 2
    assert np.all(biased > 1.25 * expected)


def test_sampled_lift_finds_a_planted_pair_within_its_error():
    rng = np.random.default_rng(4)
    experts, k, tokens = 24, 3, 60_000
    ids = np.argsort(rng.random((tokens, 1, experts)), axis=2)[:, :, :k].astype(np.int16)
    planted = rng.random(tokens) < 0.2  # 20% of tokens pick experts 5 and 6 together
    ids[planted, 0, :2] = [5, 6]
    ids[planted, 0, 2] = rng.integers(7, experts, int(planted.sum()))
    loads = np.bincount(ids[:, 0].ravel(), minlength=experts)[None]
    exact_both = tokens_with_both(ids, 0, 5, 6)
    exact_lift = tokens * exact_both / (int(loads[0, 5]) * int(loads[0, 6]))
    positions = np.random.default_rng(9).choice(tokens, 8192, replace=False)
    pairs = top_pairs(TokenSample(ids[positions], tokens), loads)
    assert pairs.experts[0].tolist() == [5, 6]
    assert abs(pairs.lift[0] - exact_lift) < 3 * pairs.lift_stderr[0] and pairs.lift_stderr[0] < 0.05 * exact_lift
    assert abs(pairs.tokens[0] - exact_both) < 0.05 * exact_both


def test_top_pairs_do_not_depend_on_dense_counting(monkeypatch):
    ids = random_topk(np.random.default_rng(6), 3000, 5, 40, 6, 0.9)
    loads = np.stack([np.bincount(ids[:, layer].ravel(), minlength=40) for layer in range(5)])
    for total in (3000, 90_000):  # every token, then a sample
        runs = [top_pairs(TokenSample(ids, total), loads)]
        monkeypatch.setattr(module, "MAX_DENSE_EXPERTS", 8)  # pairs counted with np.unique instead
        runs.append(top_pairs(TokenSample(ids, total), loads))
        monkeypatch.undo()
        for run in runs[1:]:
            for field in ("experts", "tokens", "lift", "lift_stderr"):
                np.testing.assert_array_equal(getattr(run, field), getattr(runs[0], field))


def test_no_pair_with_one_expert_per_token():
    ids = random_topk(np.random.default_rng(7), 50, 2, 6, 1)
    loads = np.stack([np.bincount(ids[:, layer].ravel(), minlength=6) for layer in range(2)])
    pairs = top_pairs(TokenSample(ids, 50), loads)
    assert (pairs.experts == -1).all() and np.isnan(pairs.lift).all()
