"""SGLang expert-distribution-recorder dumps and vLLM-style load windows, reconstructed faithfully.

The dumps are built as SGLang's recorder writes them (python/sglang/srt/eplb/expert_distribution.py):
torch.save of plain dicts with int32 tensors; physical slot ids; -1 where nothing was recorded;
every decoder layer listed, dense layers as zero (or -1) rows.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from moe_place.errors import InputError  # noqa: E402
from moe_place.traces import load_trace  # noqa: E402
from moe_place.traces.sglang import read_sglang_dumps  # noqa: E402

LAYERS, DENSE, LOGICAL, PHYSICAL, K = 5, (0, 1), 6, 8, 2


def _phy2log():
    """Slots 0..5 hold experts 0..5, slots 6 and 7 replicas of experts 0 and 3 (every layer)."""
    return torch.tensor([[0, 1, 2, 3, 4, 5, 0, 3]] * LAYERS, dtype=torch.int64)


def _logical_ids(rng, tokens):
    """int [tokens, layers, K] logical ids, distinct per token, and -1 rows for the dense layers."""
    ids = np.argsort(rng.random((tokens, LAYERS, LOGICAL)), axis=2)[:, :, :K]
    ids[:, list(DENSE), :] = -1
    return ids


def _to_physical(logical, rng):
    """Route experts 0 and 3 to either of their two slots, as EPLB dispatch would."""
    physical = logical.copy()
    swap0 = (logical == 0) & (rng.random(logical.shape) < 0.5)
    swap3 = (logical == 3) & (rng.random(logical.shape) < 0.5)
    physical[swap0], physical[swap3] = 6, 7
    return physical


def _recorder_topk(physical, width=8):
    """SGLang keeps 8 columns per token ([layers, tokens, 8]), -1 beyond the model's top-k."""
    out = -np.ones((LAYERS, physical.shape[0], width), dtype=np.int32)
    out[:, :, : physical.shape[2]] = physical.transpose(1, 0, 2)
    return torch.from_numpy(out)


def _physical_count(physical):
    counts = np.zeros((LAYERS, PHYSICAL), dtype=np.int32)
    for layer in range(LAYERS):
        ids = physical[:, layer].ravel()
        counts[layer] = np.bincount(ids[ids >= 0], minlength=PHYSICAL)
    return torch.from_numpy(counts)


def _logical_count(logical):
    counts = np.zeros((LAYERS, LOGICAL), dtype=np.int64)
    for layer in range(LAYERS):
        ids = logical[:, layer].ravel()
        counts[layer] = np.bincount(ids[ids >= 0], minlength=LOGICAL)
    return counts


@pytest.fixture
def passes():
    rng = np.random.default_rng(0)
    out = []
    for tokens in (7, 4, 9):
        logical = _logical_ids(rng, tokens)
        out.append((logical, _to_physical(logical, rng)))
    return out


def test_stat_mode(tmp_path):
    logical_count = torch.zeros((4, LAYERS, LOGICAL), dtype=torch.int32)  # circular buffer, 1 row unused
    logical_count[0, 2:, :] = torch.tensor([5, 1, 0, 2, 2, 2], dtype=torch.int32)
    logical_count[2, 2:, :] = torch.tensor([1, 1, 1, 1, 1, 1], dtype=torch.int32)
    logical_count[3, 2:, :] = torch.tensor([0, 0, 6, 0, 0, 0], dtype=torch.int32)
    path = tmp_path / "expert_distribution_recorder_1722.5.pt"
    torch.save({"rank": 0, "logical_count": logical_count, "average_utilization_rate_over_window": None}, path)
    trace = load_trace(path, top_k=2)
    assert trace.meta.layer_ids == (2, 3, 4) and trace.num_steps == 3 and trace.step_names == ("step0", "step2", "step3")
    assert trace.counts[0, 0].tolist() == [5, 1, 0, 2, 2, 2] and trace.num_tokens == 6 + 3 + 3
    kept = load_trace(path, top_k=2, keep_dense_layers=True)
    assert kept.meta.layer_ids == (0, 1, 2, 3, 4) and not kept.counts[:, :2].any()
    assert load_trace(path).top_k == 6  # inferred: gcd of the totals 12, 6, 6


def test_per_pass_mode_maps_physical_to_logical_and_merges_ranks(tmp_path, passes):
    files = []
    for rank in (0, 1):
        records = [{"forward_pass_id": 10 + i, "rank": rank, "gatherer_key": "primary",
                    "global_physical_count": _physical_count(physical)} for i, (_, physical) in enumerate(passes)]
        path = tmp_path / f"expert_distribution_recorder_1722.5_{rank}.pt"
        torch.save({"records": records, "last_physical_to_logical_map": _phy2log()}, path)
        files.append(path)
    one = load_trace(files[0])
    assert one.meta.layer_ids == (2, 3, 4) and one.step_names == ("pass10", "pass11", "pass12")
    assert one.top_k == K  # inferred: gcd of the per-pass totals 14, 8, 18
    for step, (logical, _) in enumerate(passes):
        np.testing.assert_array_equal(one.counts[step], _logical_count(logical)[2:])
    both = read_sglang_dumps(files, top_k=K)
    np.testing.assert_array_equal(both.counts, 2 * one.counts)


def test_per_token_mode_gives_logical_token_ids(tmp_path, passes):
    records = []
    for i, (_, physical) in enumerate(passes):
        padded = np.concatenate([physical, -np.ones((2, LAYERS, K), dtype=physical.dtype)])  # 2 padded tokens
        records.append({"forward_pass_id": i, "rank": 0, "gatherer_key": "primary",
                        "input_ids": list(range(padded.shape[0])), "positions": list(range(padded.shape[0])),
                        "extend_seq_lens": [padded.shape[0]], "forward_mode": 1, "misc_objects": [],
                        "topk_ids_of_layer": _recorder_topk(padded), "global_physical_count": _physical_count(padded)})
    path = tmp_path / "expert_distribution_recorder_1722.5_0.pt"
    torch.save({"records": records, "last_physical_to_logical_map": _phy2log()}, path)
    trace = load_trace(path)
    assert trace.is_token_level and trace.top_k == K and trace.num_experts == LOGICAL
    assert trace.meta.layer_ids == (2, 3, 4)
    for ids, (logical, _) in zip(trace.topk_ids, passes):
        np.testing.assert_array_equal(ids, logical[:, 2:, :])
    dense = load_trace(path, keep_dense_layers=True)
    assert not dense.is_token_level and dense.meta.layer_ids == tuple(range(LAYERS))
    np.testing.assert_array_equal(dense.counts[:, 2:], trace.step_counts())
    with pytest.raises(InputError, match="top_k"):
        load_trace(path, top_k=3)


def test_per_token_partial_row_is_an_error(tmp_path, passes):
    physical = passes[0][1].copy()
    physical[3, 4, 1] = -1  # one id missing in a MoE layer of a recorded token
    records = [{"forward_pass_id": 0, "rank": 0, "gatherer_key": "primary", "topk_ids_of_layer": _recorder_topk(physical)}]
    path = tmp_path / "dump.pt"
    torch.save({"records": records, "last_physical_to_logical_map": _phy2log()}, path)
    with pytest.raises(InputError, match="token 3") as err:
        load_trace(path)
    assert str(path) in str(err.value)


def test_per_pass_wrong_map_shape_is_named(tmp_path, passes):
    records = [{"forward_pass_id": 0, "rank": 0, "gatherer_key": "primary",
                "global_physical_count": _physical_count(passes[0][1])}]
    path = tmp_path / "dump.pt"
    torch.save({"records": records, "last_physical_to_logical_map": _phy2log()[:, :7]}, path)
    with pytest.raises(InputError, match="global_physical_count"):
        load_trace(path)


@pytest.mark.parametrize("suffix", [".npz", ".pt"])
def test_vllm_window(tmp_path, passes, suffix):
    window = np.zeros((5, LAYERS, PHYSICAL), dtype=np.int64)  # ring buffer: 3 rows written, 2 not yet
    for i, (_, physical) in enumerate(passes):
        window[(i + 3) % 5] = _physical_count(physical).numpy()  # the oldest pass sits at row 3
    path = tmp_path / f"window{suffix}"
    fields = {"expert_load_window": window, "physical_to_logical_map": _phy2log().numpy(),
              "expert_load_window_step": 3, "top_k": K}
    if suffix == ".npz":
        np.savez(path, **fields)
    else:
        torch.save({k: torch.as_tensor(v) for k, v in fields.items()}, path)
    trace = load_trace(path)
    assert trace.num_steps == 3 and trace.top_k == K and trace.num_experts == LOGICAL
    for step, (logical, _) in enumerate(passes):
        np.testing.assert_array_equal(trace.counts[step], _logical_count(logical))


def test_vllm_window_tokens_on_unused_slot_is_an_error(tmp_path):
    window = np.ones((1, 1, 4), dtype=np.int64)
    path = tmp_path / "w.npz"
    np.savez(path, expert_load_window=window, physical_to_logical_map=np.array([[0, 1, 2, -1]]))
    with pytest.raises(InputError, match="unused slots"):
        load_trace(path)


def test_not_a_dump_is_named(tmp_path):
    path = tmp_path / "x.pt"
    torch.save({"weights": torch.zeros(3)}, path)
    with pytest.raises(InputError, match="logical_count"):
        load_trace(path)


def _tensor_or_junk():
    from hypothesis import strategies as st

    ints = st.lists(st.integers(-2, 9), min_size=0, max_size=12)
    return st.one_of(
        st.integers(-2, 5), st.none(), st.text(max_size=3),
        ints.map(lambda v: torch.tensor(v, dtype=torch.int32)),
        st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 3), st.integers(-1, 8)).map(
            lambda s: torch.full(s[:3], s[3], dtype=torch.int32)),
        st.tuples(st.integers(0, 3), st.integers(0, 8)).map(lambda s: torch.randint(-1, 9, s)),
    )


def test_random_dumps_load_or_raise_input_error(tmp_path):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    record = st.dictionaries(st.sampled_from(["forward_pass_id", "rank", "global_physical_count", "topk_ids_of_layer"]),
                             _tensor_or_junk(), max_size=4)
    dump = st.one_of(
        st.dictionaries(st.sampled_from(["rank", "logical_count"]), _tensor_or_junk(), max_size=2),
        st.fixed_dictionaries({"records": st.lists(record, max_size=3),
                               "last_physical_to_logical_map": _tensor_or_junk()}),
        st.dictionaries(st.sampled_from(["expert_load_window", "physical_to_logical_map", "top_k"]),
                        _tensor_or_junk(), max_size=3),
        _tensor_or_junk())

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(obj=dump)
    def check(obj):
        path = tmp_path / "h.pt"
        torch.save(obj, path)
        try:
            trace = load_trace(path)
        except InputError as exc:
            assert "\n" not in str(exc) and str(path) in str(exc)
            return
        assert trace.total_counts().sum() > 0

    check()
