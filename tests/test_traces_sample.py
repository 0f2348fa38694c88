"""The token sample (traces/sample.py): the same tokens whether a trace is read whole or streamed."""

import numpy as np
import pytest

from moe_place.errors import InputError
from moe_place.traces import load_trace
from moe_place.traces.model import Trace, TraceMeta
from moe_place.traces.sample import SAMPLE_TOKENS, SampleCollector, TokenSample, sample_positions


def _ids(tokens, layers=2, experts=16, k=3, seed=0):
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((tokens, layers, experts)), axis=2)[:, :, :k].astype(np.int16)


def test_small_traces_keep_every_token_in_order():
    np.testing.assert_array_equal(sample_positions(5), np.arange(5))
    np.testing.assert_array_equal(sample_positions(SAMPLE_TOKENS), np.arange(SAMPLE_TOKENS))
    assert sample_positions(0).size == 0


@pytest.mark.parametrize("tokens", [SAMPLE_TOKENS + 1, 3 * SAMPLE_TOKENS, 10**6, 10**12])
def test_large_traces_draw_distinct_tokens_the_same_way_every_time(tokens):
    positions = sample_positions(tokens)
    assert positions.shape == (SAMPLE_TOKENS,) and positions.dtype == np.int64
    assert np.unique(positions).size == SAMPLE_TOKENS and 0 <= positions.min() and positions.max() < tokens
    np.testing.assert_array_equal(sample_positions(tokens), positions)
    np.testing.assert_array_equal(sample_positions(tokens, size=100), positions[:100])  # a prefix


def test_draw_is_spread_over_the_trace():
    positions = sample_positions(10**6)
    counts = np.bincount(positions * 16 // 10**6, minlength=16)  # 512 expected per sixteenth
    assert np.all(np.abs(counts - 512) < 5 * np.sqrt(512))
    halves = [np.bincount(part * 4 // 10**6, minlength=4) for part in np.split(positions, 2)]
    assert all(np.all(np.abs(h - 1024) < 5 * np.sqrt(1024)) for h in halves)


def test_sample_of_steps_holds_the_tokens_at_its_positions():
    steps = [_ids(n, seed=n) for n in (4000, 1, 3500, 2000)]
    sample = TokenSample.of_steps(steps)
    whole = np.concatenate(steps)
    assert sample.num_tokens == 9501 and not sample.complete
    np.testing.assert_array_equal(sample.ids, whole[sample_positions(9501)])
    small = TokenSample.of_steps(steps[:2])
    assert small.complete
    np.testing.assert_array_equal(small.ids, np.concatenate(steps[:2]))


@pytest.mark.parametrize("tokens", [500, 9000])
def test_collector_gets_the_same_rows_from_a_file_with_steps_out_of_order(tokens):
    ids = _ids(tokens, seed=1)
    step = np.random.default_rng(2).integers(0, 5, tokens)
    _, index = np.unique(step, return_inverse=True)
    order = np.argsort(index, kind="stable")  # trace order: step by step, file order within a step
    expected = ids[order][sample_positions(tokens)]
    collector = SampleCollector(tokens, (2, 3), ids.dtype, index)
    starts = list(range(0, tokens, 700))
    for start in np.random.default_rng(3).permutation(starts):  # chunks in any order
        collector.add(int(start), ids[start:start + 700])
    np.testing.assert_array_equal(collector.sample().ids, expected)


def test_a_count_trace_carries_a_checked_sample():
    ids = _ids(100, layers=3, k=2)
    counts = np.stack([np.bincount(ids[:, layer].ravel(), minlength=16) for layer in range(3)])[None]
    meta = TraceMeta(num_experts=16, top_k=2, layer_ids=(4, 5, 6))
    trace = Trace(meta, counts=counts, sample=TokenSample(ids, 100))
    assert trace.token_sample().complete
    picked = trace.select_layer_ids([6, 4])
    np.testing.assert_array_equal(picked.token_sample().ids, ids[:, [2, 0]])
    with pytest.raises(InputError, match="sample"):
        Trace(meta, counts=counts, sample=TokenSample(ids, 101))
    with pytest.raises(InputError, match="sample"):
        Trace(meta, counts=counts, sample=TokenSample(ids[:, :2], 100))
    with pytest.raises(InputError, match="sample"):
        Trace(meta, topk_ids=(ids,), sample=TokenSample(ids, 100))
    bad = ids.copy()
    bad[7, 1, 0] = 16
    with pytest.raises(InputError, match=r"sample: expected expert ids in \[0, 16\)"):
        Trace(meta, counts=counts, sample=TokenSample(bad, 100))


def test_streamed_and_whole_files_hold_the_same_sample(tmp_path):
    ids = _ids(9000, seed=4)
    path = tmp_path / "t.npz"
    np.savez(path, num_experts=16, topk_ids=ids, step=np.random.default_rng(5).integers(0, 3, 9000))
    whole, streamed = load_trace(path), load_trace(path, max_token_bytes=0)
    assert whole.is_token_level and not streamed.is_token_level
    np.testing.assert_array_equal(streamed.token_sample().ids, whole.token_sample().ids)
    assert streamed.token_sample().num_tokens == whole.token_sample().num_tokens == 9000
