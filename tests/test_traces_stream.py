"""Validated count extraction (traces/count.py) and chunked streaming of npz traces (traces/stream.py)."""

import tracemalloc

import numpy as np
import pytest

from moe_place.errors import InputError
from moe_place.traces import load_trace
from moe_place.traces.count import DispatchCounter
from moe_place.traces.sample import SAMPLE_TOKENS
from moe_place.traces.stream import stream_npz_counts


def _ids(tokens, layers, experts, k, seed=0, dtype=np.int16):
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((tokens, layers, experts)), axis=2)[:, :, :k].astype(dtype)


def _reference(ids, experts):
    return np.stack([np.bincount(ids[:, layer].ravel(), minlength=experts) for layer in range(ids.shape[1])])


def test_counter_matches_bincount_across_chunks():
    ids = _ids(1001, 3, 32, 4, seed=3)
    counter = DispatchCounter(3, 32, 4, "x")
    np.testing.assert_array_equal(counter.count(ids, chunk_tokens=97), _reference(ids, 32))
    one = ids[:, :1]
    np.testing.assert_array_equal(DispatchCounter(1, 32, 4, "x").count(one, chunk_tokens=10), _reference(one, 32))


def test_counter_reports_the_global_token_of_a_repeat():
    ids = _ids(500, 2, 16, 3, seed=4)
    ids[321, 1, 2] = ids[321, 1, 0]
    with pytest.raises(InputError, match="token 321, layer 1"):
        DispatchCounter(2, 16, 3, "f: topk_ids").count(ids, chunk_tokens=64)


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("step_kind", ["none", "sorted", "shuffled"])
def test_stream_equals_in_memory(tmp_path, compress, step_kind):
    ids = _ids(3000, 4, 64, 6, seed=5)
    fields = {"num_experts": 64, "topk_ids": ids}
    step = np.repeat([0, 4, 9], [1000, 1500, 500])
    if step_kind == "shuffled":
        step = np.random.default_rng(0).permutation(step)
    if step_kind != "none":
        fields["step"] = step
    path = tmp_path / "t.npz"
    (np.savez_compressed if compress else np.savez)(path, **fields)
    streamed = stream_npz_counts(path, chunk_tokens=256)
    loaded = load_trace(path)
    np.testing.assert_array_equal(streamed.counts, loaded.step_counts())
    assert streamed.meta.layer_ids == loaded.meta.layer_ids and streamed.top_k == 6
    if step_kind == "none":
        np.testing.assert_array_equal(streamed.counts[0], _reference(ids, 64))


@pytest.mark.parametrize("compress", [False, True])
def test_stream_infers_num_experts_in_a_first_pass(tmp_path, compress):
    ids = _ids(700, 2, 20, 3, seed=6)
    (np.savez_compressed if compress else np.savez)(tmp_path / "t.npz", topk_ids=ids)
    trace = stream_npz_counts(tmp_path / "t.npz", chunk_tokens=100)
    assert trace.num_experts == int(ids.max()) + 1
    np.testing.assert_array_equal(trace.counts[0], _reference(ids, trace.num_experts))


def test_stream_errors_in_late_chunks(tmp_path):
    ids = _ids(2000, 2, 16, 4, seed=7)
    ids[1777, 0, 3] = 16
    np.savez(tmp_path / "r.npz", num_experts=16, topk_ids=ids)
    with pytest.raises(InputError, match=r"expert ids in \[0, 16\)"):
        stream_npz_counts(tmp_path / "r.npz", chunk_tokens=128)
    ids[1777, 0, 3] = ids[1777, 0, 1]
    np.savez(tmp_path / "p.npz", num_experts=16, topk_ids=ids)
    with pytest.raises(InputError, match="token 1777, layer 0"):
        stream_npz_counts(tmp_path / "p.npz", chunk_tokens=128)


def test_truncated_member_is_an_input_error(tmp_path):
    path = tmp_path / "t.npz"
    np.savez(path, num_experts=16, topk_ids=_ids(4000, 2, 16, 4))
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * 0.6)])
    with pytest.raises(InputError) as err:
        stream_npz_counts(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("workers", [1, 2])
def test_streaming_memory_is_bounded_by_the_chunk(tmp_path, workers):
    rng = np.random.default_rng(8)  # distinct ids per token: a random start plus 0..7 (mod 64)
    ids = ((rng.integers(0, 64, (200_000, 8, 1)) + np.arange(8)) % 64).astype(np.int16)  # 25.6 MB
    path = tmp_path / "big.npz"
    np.savez(path, num_experts=64, top_k=8, topk_ids=ids)
    expected = _reference(ids, 64)
    nbytes = ids.nbytes
    del ids
    tracemalloc.start()
    try:
        trace = stream_npz_counts(path, chunk_tokens=1024, workers=workers)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(trace.counts[0], expected)
    # per thread, in units of the chunk's int16 bytes: the chunk buffer (1), its keys (1), the key
    # offsets (1, shared), the k-1 = 7 compare flags per id (3.5) and np.bincount's internal int64
    # copy of the keys (4); plus a [layers, experts] sums array. Once per trace, whatever its length:
    # the token sample's int16 ids and three int64 arrays of its positions.
    chunk_bytes = 1024 * 8 * 8 * 2
    sample_bytes = SAMPLE_TOKENS * (8 * 8 * 2 + 3 * 8)
    assert trace.sample.ids.shape == (SAMPLE_TOKENS, 8, 8)
    assert peak < workers * 12 * chunk_bytes + sample_bytes and peak - sample_bytes < workers * nbytes / 10


def test_load_trace_streams_large_token_files(tmp_path):
    ids = _ids(3000, 3, 32, 4, seed=9)
    path = tmp_path / "t.npz"
    np.savez(path, num_experts=32, topk_ids=ids, step=np.arange(3000) // 1000)
    small = load_trace(path, max_token_bytes=1000)
    full = load_trace(path)
    assert not small.is_token_level and full.is_token_level
    np.testing.assert_array_equal(small.counts, full.step_counts())

