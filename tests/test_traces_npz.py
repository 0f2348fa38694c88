"""Our versioned npz format: round trips, plain-numpy files, metadata cross-checks."""

import numpy as np
import pytest

from moe_place.errors import InputError
from moe_place.traces import Trace, TraceMeta, load_trace
from moe_place.traces.bundled import bundled_path
from moe_place.traces.npz import infer_top_k, read_npz, save_npz


def _token_trace(seed=0, steps=(5, 3, 7), layers=4, experts=16, k=4):
    rng = np.random.default_rng(seed)
    ids = tuple(np.argsort(rng.random((n, layers, experts)), axis=2)[:, :, :k].astype(np.int16) for n in steps)
    meta = TraceMeta(num_experts=experts, top_k=k, layer_ids=tuple(range(3, 3 + layers)), model="m",
                     source="s", step_names=tuple(f"s{i}" for i in range(len(steps))))
    return Trace(meta, topk_ids=ids)


@pytest.mark.parametrize("compress", [False, True])
def test_token_round_trip(tmp_path, compress):
    trace = _token_trace()
    save_npz(trace, tmp_path / "t.npz", compress=compress)
    back = read_npz(tmp_path / "t.npz")
    assert back.meta.layer_ids == (3, 4, 5, 6) and back.meta.step_names == ("s0", "s1", "s2")
    assert (back.meta.model, back.meta.source, back.top_k, back.num_experts) == ("m", "s", 4, 16)
    assert len(back.topk_ids) == 3
    for a, b in zip(trace.topk_ids, back.topk_ids):
        np.testing.assert_array_equal(a, b)


def test_count_round_trip(tmp_path):
    counts = np.arange(2 * 3 * 5).reshape(2, 3, 5) * 2
    meta = TraceMeta(num_experts=5, top_k=2, layer_ids=(0, 2, 9), step_names=("a", "b"))
    save_npz(Trace(meta, counts=counts), tmp_path / "c.npz")
    back = load_trace(tmp_path / "c.npz")
    np.testing.assert_array_equal(back.counts, counts)
    assert back.meta.layer_ids == (0, 2, 9) and back.top_k == 2 and back.step_names == ("a", "b")


def test_bundled_qwen_round_trips_through_our_format(tmp_path):
    qwen = load_trace(bundled_path("qwen3-30b-a3b_prefill_topk.npz"))
    save_npz(qwen, tmp_path / "q.npz")
    back = load_trace(tmp_path / "q.npz")
    np.testing.assert_array_equal(back.step_counts(), qwen.step_counts())
    assert back.num_tokens == qwen.num_tokens == 1960 + 2050 + 2080


def test_plain_numpy_file_loads(tmp_path):
    path = tmp_path / "t.npz"
    np.savez(path, format_version=1, num_experts=8, top_k=1, counts=np.array([[[600, 560, 120, 120, 20, 10, 10, 10]]]))
    trace = load_trace(path)
    assert trace.num_experts == 8 and trace.top_k == 1 and trace.meta.layer_ids == (0,)
    assert trace.total_counts().tolist() == [[600, 560, 120, 120, 20, 10, 10, 10]]
    assert trace.num_tokens == 1450


def test_unsorted_step_groups_tokens(tmp_path):
    ids = np.array([[[0, 1]], [[2, 3]], [[1, 2]], [[3, 0]]])
    path = tmp_path / "s.npz"
    np.savez(path, topk_ids=ids, step=np.array([7, 2, 7, 2]), num_experts=4)
    trace = load_trace(path)
    # steps in increasing value (2 then 7), tokens in file order within a step
    np.testing.assert_array_equal(trace.topk_ids[0], ids[[1, 3]])
    np.testing.assert_array_equal(trace.topk_ids[1], ids[[0, 2]])


def test_missing_metadata_is_inferred(tmp_path):
    path = tmp_path / "m.npz"
    np.savez(path, topk_ids=np.array([[[0, 5]], [[5, 2]]], dtype=np.int32))
    trace = load_trace(path)
    assert trace.num_experts == 6 and trace.top_k == 2 and trace.num_tokens == 2


def test_infer_top_k_from_count_totals():
    counts = np.zeros((2, 1, 8), dtype=np.int64)
    counts[0, 0, :3] = [8, 7, 6]   # 21 = 3 * 7
    counts[1, 0, :2] = [5, 4]      # 9 = 3 * 3
    assert infer_top_k(counts) == 3
    counts[1, 0, 0] = 6            # gcd(21, 10) = 1
    assert infer_top_k(counts) == 1


@pytest.mark.parametrize(("fields", "field"), [
    ({"num_experts": 4, "topk_ids": np.array([[[0, 4]]])}, "expert ids in [0, 4)"),
    ({"top_k": 3, "topk_ids": np.array([[[0, 1]]])}, "top_k"),
    ({"num_experts": 7, "counts": np.ones((1, 1, 8), dtype=int)}, "num_experts"),
    ({"format_version": 2, "counts": np.ones((1, 1, 8), dtype=int)}, "format_version"),
    ({"layer_ids": np.array([0, 1]), "counts": np.ones((1, 1, 8), dtype=int)}, "layer_ids"),
    ({"step_names": np.array(["a", "b"]), "counts": np.ones((1, 1, 8), dtype=int)}, "step_names"),
    ({"counts": np.ones((1, 1, 8)), "topk_ids": np.array([[[0]]])}, "exactly one of"),
    ({"step": np.array([0, 1]), "topk_ids": np.array([[[0, 1]]])}, "step"),
    ({"num_experts": np.array([1.5]), "counts": np.ones((1, 1, 8), dtype=int)}, "num_experts"),
])
def test_metadata_disagreeing_with_arrays_is_named(tmp_path, fields, field):
    path = tmp_path / "bad.npz"
    np.savez(path, **fields)
    with pytest.raises(InputError) as err:
        load_trace(path)
    assert field in str(err.value) and str(path) in str(err.value)


def test_top_k_option_for_count_files_that_do_not_record_it(tmp_path):
    from moe_place.traces import load_trace

    path = tmp_path / "t.npz"
    np.savez(path, format_version=1, num_experts=8, counts=np.array([[[600, 560, 120, 120, 20, 10, 10, 10]]]))
    assert load_trace(path, top_k=2).top_k == 2
    assert load_trace(path, top_k=2).num_tokens == 725
    np.savez(path, format_version=1, num_experts=8, top_k=1, counts=np.array([[[600, 560, 120, 120, 20, 10, 10, 10]]]))
    assert load_trace(path, top_k=2).top_k == 1  # the file's own value wins
