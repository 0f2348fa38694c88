"""Threaded count extraction (traces/count.py run_chunks, traces/stream.py): same counts and same
errors as the sequential path, the earliest bad chunk's error, MOE_PLACE_THREADS."""

import io
import threading
import time
import zipfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_place import cores
from moe_place.errors import InputError
from moe_place.traces import load_trace
from moe_place.traces import stream as stream_module
from moe_place.traces.count import THREADS_ENV, DispatchCounter, resolve_workers, run_chunks
from moe_place.traces.stream import stream_npz_counts


def _ids(tokens, layers, experts, k, seed=0):
    """int16 `[tokens, layers, k]` with k distinct experts per token-layer."""
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((tokens, layers, experts)), axis=2)[:, :, :k].astype(np.int16)


def _error(fn, *args, **kwargs) -> str:
    with pytest.raises(InputError) as err:
        fn(*args, **kwargs)
    return str(err.value)


@pytest.fixture(autouse=True)
def _no_thread_env(monkeypatch):
    monkeypatch.delenv(THREADS_ENV, raising=False)


# ------------------------------------------------------------------ same counts
@pytest.mark.parametrize("layers", [1, 3])
@pytest.mark.parametrize("step_kind", ["none", "sorted", "interleaved", "per-token"])
@pytest.mark.parametrize("chunk_tokens", [97, 1000])
def test_threaded_stream_equals_sequential(tmp_path, layers, step_kind, chunk_tokens):
    tokens = 3001  # no chunk size here divides it
    ids = _ids(tokens, layers, 24, 5, seed=layers)
    rng = np.random.default_rng(1)
    fields = {"num_experts": 24, "topk_ids": ids}
    if step_kind == "sorted":
        fields["step"] = np.repeat([0, 3, 7], [1200, 1001, 800])
    elif step_kind == "interleaved":  # every chunk spans several steps, in no order
        fields["step"] = rng.integers(0, 6, tokens)
    elif step_kind == "per-token":  # many small steps: chunks hold dozens of steps each
        fields["step"] = np.arange(tokens) // 3
    path = tmp_path / "t.npz"
    np.savez(path, **fields)
    sequential = stream_npz_counts(path, chunk_tokens=chunk_tokens, workers=1)
    for workers in (2, 3):
        threaded = stream_npz_counts(path, chunk_tokens=chunk_tokens, workers=workers)
        np.testing.assert_array_equal(threaded.counts, sequential.counts)
        assert threaded.meta == sequential.meta
    loaded = load_trace(path)  # the in-memory reader, independent of the chunked counter
    np.testing.assert_array_equal(sequential.counts, loaded.step_counts())


@pytest.mark.parametrize("layers", [1, 4])
def test_threaded_in_memory_count_equals_sequential(layers):
    ids = _ids(2503, layers, 40, 6, seed=2)
    counter = DispatchCounter(layers, 40, 6, "x")
    expected = counter.count(ids, chunk_tokens=64, workers=1)
    np.testing.assert_array_equal(counter.count(ids, chunk_tokens=64, workers=2), expected)
    np.testing.assert_array_equal(counter.count(ids, chunk_tokens=333, workers=4), expected)
    reference = np.stack([np.bincount(ids[:, layer].ravel(), minlength=40) for layer in range(layers)])
    np.testing.assert_array_equal(expected, reference)


def test_every_chunk_runs_once_on_several_threads():
    seen = {}
    barrier = threading.Barrier(2, timeout=10)

    def process(start):
        seen[start] = threading.get_ident()
        if start < 2:
            barrier.wait()  # the first two chunks can only finish if they run at the same time

    run_chunks(range(12), 2, process)
    assert sorted(seen) == list(range(12)) and len(set(seen.values())) == 2
    assert seen[0] == threading.get_ident() or seen[1] == threading.get_ident()  # the caller works too


# ------------------------------------------------------------------ same errors
def _plant(ids, token, kind):
    if kind == "repeat":
        ids[token, 1, 3] = ids[token, 1, 0]
    else:
        ids[token, 0, 2] = 99 if kind == "high" else -1


@pytest.mark.parametrize("kind", ["repeat", "high", "negative"])
def test_error_in_a_late_chunk_has_the_sequential_message(tmp_path, kind):
    ids = _ids(4000, 2, 16, 4, seed=3)
    _plant(ids, 3333, kind)
    path = tmp_path / "bad.npz"
    np.savez(path, num_experts=16, topk_ids=ids, step=np.arange(4000) // 700)
    sequential = _error(stream_npz_counts, path, chunk_tokens=128, workers=1)
    assert _error(stream_npz_counts, path, chunk_tokens=128, workers=2) == sequential
    expected = "token 3333, layer 1" if kind == "repeat" else ("got 99" if kind == "high" else "got -1")
    assert expected in sequential
    counter = DispatchCounter(2, 16, 4, "ids")
    in_memory = _error(counter.count, ids, chunk_tokens=128, workers=1)
    assert _error(counter.count, ids, chunk_tokens=128, workers=2) == in_memory and expected in in_memory


@pytest.mark.parametrize("first, second", [("repeat", "high"), ("high", "repeat"), ("negative", "high")])
def test_two_bad_chunks_report_the_earlier(tmp_path, first, second):
    ids = _ids(6000, 2, 16, 4, seed=4)
    _plant(ids, 1500, first)
    _plant(ids, 5000, second)
    path = tmp_path / "bad.npz"
    np.savez(path, num_experts=16, topk_ids=ids)
    only_first = ids.copy()
    only_first[5000] = _ids(1, 2, 16, 4, seed=5)[0]
    counter = DispatchCounter(2, 16, 4, "ids")
    expected = _error(counter.count, only_first, chunk_tokens=100, workers=1)
    for _ in range(3):  # the later chunk may finish first: the answer must not depend on timing
        assert _error(counter.count, ids, chunk_tokens=100, workers=2) == expected
    expected_file = _error(stream_npz_counts, path, chunk_tokens=100, workers=1)
    assert _error(stream_npz_counts, path, chunk_tokens=100, workers=2) == expected_file
    assert ("token 1500" if first == "repeat" else ("99" if first == "high" else "-1")) in expected_file


def test_earliest_failure_wins_whatever_the_timing():
    started = []

    def process(i):
        started.append(i)
        if i == 3:
            time.sleep(0.2)  # the earlier failure comes last in time
            raise InputError("chunk 3", "good data", "bad")
        if i == 5:
            raise InputError("chunk 5", "good data", "bad")

    with pytest.raises(InputError, match="chunk 3"):
        run_chunks(range(1000), 2, process)
    # one thread sits in chunk 3 while the other runs 4 and 5; after 5 fails nothing more is handed out
    assert sorted(started) == list(range(6))


def test_a_failure_stops_handing_out_chunks():
    started = []
    failed = threading.Event()

    def process(i):
        started.append(i)
        if i == 0:
            failed.wait(10)  # chunk 0 is still running when chunk 1 fails
            return
        failed.set()
        raise InputError(f"chunk {i}", "good data", "bad")

    with pytest.raises(InputError, match="chunk 1"):
        run_chunks(range(1000), 2, process)
    assert sorted(started) == [0, 1]  # the thread done with chunk 0 takes no chunk after the failed one


def test_an_interrupt_wins_over_input_errors():
    def process(i):
        if i == 0:
            time.sleep(0.1)
            raise InputError("chunk 0", "good data", "bad")
        if i == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_chunks(range(100), 2, process)


def _npy_bytes(array):
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _short_member_npz(path, ids, keep_fraction):
    """An npz whose `topk_ids.npy` member is cut short (its header still says all tokens), followed
    by another member, so a reader that ignores the member's end would read the next member's bytes."""
    full = _npy_bytes(ids)
    data_start = len(full) - ids.nbytes
    cut = data_start + int(ids.nbytes * keep_fraction)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("num_experts.npy", _npy_bytes(np.array(16)))
        zf.writestr("topk_ids.npy", full[:cut])
        zf.writestr("padding.npy", _npy_bytes(np.zeros(ids.size, dtype=np.int16)))


def test_truncated_member_gives_the_same_error(tmp_path):
    ids = _ids(4000, 2, 16, 4, seed=6)
    path = tmp_path / "short.npz"
    _short_member_npz(path, ids, 0.6)
    sequential = _error(stream_npz_counts, path, chunk_tokens=256, workers=1)
    assert _error(stream_npz_counts, path, chunk_tokens=256, workers=2) == sequential
    # 60% of 4000 tokens = 2400: the chunk starting at token 2304 is the first one cut short
    assert "truncated file (ends in token 2304)" in sequential and str(path) in sequential


def test_truncated_archive_gives_the_same_error(tmp_path):
    path = tmp_path / "t.npz"
    np.savez(path, num_experts=16, topk_ids=_ids(4000, 2, 16, 4))
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * 0.6)])
    sequential = _error(stream_npz_counts, path, chunk_tokens=256, workers=1)
    assert _error(stream_npz_counts, path, chunk_tokens=256, workers=2) == sequential
    assert str(path) in sequential


# ------------------------------------------------------------------ MOE_PLACE_THREADS
def test_thread_env_picks_the_path(tmp_path, monkeypatch):
    ids = _ids(2000, 2, 16, 4, seed=7)
    path = tmp_path / "t.npz"
    np.savez(path, num_experts=16, topk_ids=ids)
    calls = []
    real = stream_module.run_chunks
    monkeypatch.setattr(stream_module, "run_chunks", lambda *a: calls.append(a[1]) or real(*a))
    monkeypatch.setenv(THREADS_ENV, "1")
    assert resolve_workers() == 1
    sequential = stream_npz_counts(path, chunk_tokens=100).counts
    assert calls == []
    monkeypatch.setattr(cores, "usable_cores", lambda: 4)  # 3 threads are allowed on 4 cores, whatever this has
    monkeypatch.setenv(THREADS_ENV, " 3 ")
    np.testing.assert_array_equal(stream_npz_counts(path, chunk_tokens=100).counts, sequential)
    assert calls == [3]
    monkeypatch.delenv(THREADS_ENV)
    assert 1 <= resolve_workers() <= 2


@pytest.mark.parametrize("value", ["0", "-2", "abc", "1.5", "5", "10000"])
def test_bad_thread_env_is_an_input_error(tmp_path, monkeypatch, value):
    """Above the usable cores is refused as `--jobs` is (4 here, whatever this machine has)."""
    monkeypatch.setattr(cores, "usable_cores", lambda: 4)
    path = tmp_path / "t.npz"
    np.savez(path, num_experts=16, topk_ids=_ids(50, 2, 16, 4))
    monkeypatch.setenv(THREADS_ENV, value)
    for call in (lambda: stream_npz_counts(path), lambda: load_trace(path, max_token_bytes=10),
                 lambda: DispatchCounter(2, 16, 4, "x").count(_ids(50, 2, 16, 4))):
        message = _error(call)
        assert message.startswith(f"{THREADS_ENV}: expected an integer in [1, 4] (the cores this process may use)")
        assert message.endswith(f"got {value!r}")


def test_bad_thread_env_from_the_cli_names_the_variable(monkeypatch, capsys):
    from moe_place.cli.main import main
    from moe_place.traces.bundled import bundled_path

    monkeypatch.setenv(THREADS_ENV, "abc")
    assert main(["analyze", str(bundled_path("qwen3-30b-a3b_prefill_topk.npz"))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"error: {THREADS_ENV}: expected an integer in [1, " in err[0]


@pytest.mark.parametrize("workers", [0, -1, True, 2.0])
def test_bad_workers_argument_is_an_input_error(workers):
    with pytest.raises(InputError, match="workers"):
        resolve_workers(workers)


# ------------------------------------------------------------------ one-pass range check
@pytest.mark.parametrize("dtype, experts, bad, got", [
    (np.int16, 16, -1, "-1"), (np.int16, 16, 16, "16"), (np.int8, 100, -128, "-128"), (np.uint8, 100, 200, "200"),
    (np.int64, 16, -(1 << 40), str(-(1 << 40))),
    (np.int16, 40000, -1, "-1"),  # -1 as uint16 is 65535 >= 40000 but a wider num_experts would hide it
    (np.int16, 65536, -2, "-2"),  # here the unsigned view cannot prove the range: min and max are checked
])
def test_range_check_reports_the_offending_id(dtype, experts, bad, got):
    span = min(experts, 90)  # ids < 90 fit every dtype here
    ids = ((np.arange(200 * 2).reshape(200, 2, 1) + np.arange(3)) % span).astype(dtype)  # 3 distinct per row
    counter = DispatchCounter(2, experts, 3, "ids")
    counter.count(ids, chunk_tokens=64, workers=1)  # in range: no error
    ids[150, 1, 2] = bad
    for workers in (1, 2):
        assert _error(counter.count, ids, chunk_tokens=64, workers=workers) == \
            f"ids: expected expert ids in [0, {experts}), got {got}"


# ------------------------------------------------------------------ one-call repeat check
def _brute_first_repeat(ids):
    for t in range(ids.shape[0]):
        for layer in range(ids.shape[1]):
            if len(set(ids[t, layer].tolist())) < ids.shape[2]:
                return t, layer
    return None


@settings(max_examples=150, deadline=None)
@given(tokens=st.integers(1, 40), layers=st.integers(1, 4), k=st.integers(1, 6), chunk=st.integers(1, 17),
       seed=st.integers(0, 10**6), plants=st.integers(0, 2))
def test_counting_finds_exactly_the_brute_force_repeats(tokens, layers, k, chunk, seed, plants):
    experts = 8
    ids = _ids(tokens, layers, experts, k, seed)
    rng = np.random.default_rng(seed)
    for _ in range(plants if k > 1 else 0):  # anywhere, the last token of a chunk or of the trace included
        t, layer = rng.integers(tokens), rng.integers(layers)
        i, j = rng.choice(k, 2, replace=False)
        ids[t, layer, i] = ids[t, layer, j]
    expected = _brute_first_repeat(ids)  # neighbouring tokens and layers share experts freely
    counter = DispatchCounter(layers, experts, k, "ids")
    for workers in (1, 2):
        if expected is None:
            reference = np.stack([np.bincount(ids[:, m].ravel(), minlength=experts) for m in range(layers)])
            np.testing.assert_array_equal(counter.count(ids, chunk_tokens=chunk, workers=workers), reference)
        else:
            message = _error(counter.count, ids, chunk_tokens=chunk, workers=workers)
            assert message.endswith(f"a repeated expert at token {expected[0]}, layer {expected[1]}")


def test_keys_past_the_chunk_never_count_as_repeats():
    # the key buffer is np.empty: whatever lies past the chunk's keys must not match its last row
    counter = DispatchCounter(1, 8, 3, "ids")
    ids = np.array([[[0, 1, 2]]], dtype=np.int16)  # one token: the last row has keys 0, 1, 2
    keys = counter._make_keys(ids)
    counter._keys[keys.size:] = keys[-1]  # poison the slots past the keys, then rebuild them
    keys = counter._make_keys(ids)
    assert not counter._has_repeat(keys)
    np.testing.assert_array_equal(counter.count(ids, workers=1), [[1, 1, 1, 0, 0, 0, 0, 0]])
