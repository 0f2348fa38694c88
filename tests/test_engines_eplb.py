"""`moe_place.eplb.rebalance_experts`: a drop-in for DeepSeek EPLB's entry point."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
import pytest

torch = pytest.importorskip("torch")

from moe_place import eplb as dropin  # noqa: E402
from moe_place.solvers import engine_call  # noqa: E402
from moe_place.errors import InputError  # noqa: E402
from moe_place.placement import Placement  # noqa: E402
from moe_place.solvers import deepseek as reference  # noqa: E402

# DeepSeek EPLB's README example: 2 layers x 12 experts, 16 replicas, 4 groups, 2 nodes, 8 GPUs
README_WEIGHT = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                 [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
README_PHY2LOG = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                  [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(engine_call.SOLVER_ENV, raising=False)
    monkeypatch.delenv(engine_call.TIME_LIMIT_ENV, raising=False)


def _max_gpu_load(phy2log, weight, gpus):
    placement = Placement(np.asarray(phy2log), len(weight[0]), gpus, allow_colocated=True)
    return placement.gpu_loads(np.asarray(weight, dtype=float)).max(axis=1)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float16, torch.float32])
def test_shapes_dtypes_and_padding_match_eplb(dtype):
    weight = torch.tensor(README_WEIGHT).to(dtype)
    phy2log, log2phy, logcnt = dropin.rebalance_experts(weight, 16, 4, 2, 8)
    for t in (phy2log, log2phy, logcnt):
        assert t.dtype == torch.int64 and t.device.type == "cpu"
    assert phy2log.shape == (2, 16) and logcnt.shape == (2, 12)
    assert log2phy.shape == (2, 12, int(logcnt.max()))
    # the same maps as our Placement derives, -1 after each expert's replicas
    placement = Placement(phy2log.numpy(), 12, 8)
    np.testing.assert_array_equal(log2phy.numpy(), placement.log2phy)
    np.testing.assert_array_equal(logcnt.numpy(), placement.logcnt)
    for layer in range(2):
        for e in range(12):
            row = log2phy[layer, e].tolist()
            n = int(logcnt[layer, e])
            assert all(s >= 0 for s in row[:n]) and all(s == -1 for s in row[n:])
            assert all(int(phy2log[layer, s]) == e for s in row[:n])


def test_eplb_solver_reproduces_the_readme_example_exactly(monkeypatch):
    monkeypatch.setenv(engine_call.SOLVER_ENV, "eplb")
    phy2log, _, _ = dropin.rebalance_experts(torch.tensor(README_WEIGHT), 16, 4, 2, 8)
    assert phy2log.tolist() == README_PHY2LOG


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_default_plan_is_no_worse_than_eplb_and_keeps_groups_in_nodes(seed):
    rng = np.random.default_rng(seed)
    weight = rng.zipf(1.4, size=(4, 32)).clip(max=5000)
    theirs = _max_gpu_load(reference.eplb_maps(weight, 48, 4, 2, 16)[0], weight, 16)
    phy2log, _, _ = dropin.rebalance_experts(torch.from_numpy(weight), 48, 4, 2, 16)
    assert (_max_gpu_load(phy2log.numpy(), weight, 16) <= theirs + 1e-9).all()
    # hierarchical (4 groups on 2 nodes): every group and its replicas inside one node, as EPLB keeps them
    for row in phy2log.numpy():
        for group in range(4):
            assert len(set((np.flatnonzero(np.isin(row, range(8 * group, 8 * group + 8))) // 24).tolist())) == 1
    apart, _, _ = dropin.rebalance_experts(torch.from_numpy(weight), 48, 4, 2, 16, allow_colocated=False)
    Placement(apart.numpy(), 32, 16)  # raises if two replicas of an expert share a GPU


def test_solver_and_time_limit_come_from_keywords_or_environment(monkeypatch):
    weight = torch.tensor(README_WEIGHT)
    by_keyword = dropin.rebalance_experts(weight, 16, 4, 2, 8, solver="eplb")[0]
    assert by_keyword.tolist() == README_PHY2LOG
    assert engine_call.solver_settings() == ("quick", None)
    monkeypatch.setenv(engine_call.SOLVER_ENV, "cpsat")
    monkeypatch.setenv(engine_call.TIME_LIMIT_ENV, "2.5")
    assert engine_call.solver_settings() == ("cpsat", 2.5)
    assert engine_call.solver_settings("fast", 1.0) == ("fast", 1.0)  # keywords win
    monkeypatch.setenv(engine_call.TIME_LIMIT_ENV, "soon")
    with pytest.raises(InputError, match=engine_call.TIME_LIMIT_ENV):
        dropin.rebalance_experts(weight, 16, 4, 2, 8)
    monkeypatch.delenv(engine_call.TIME_LIMIT_ENV)
    monkeypatch.setenv(engine_call.SOLVER_ENV, "magic")
    with pytest.raises(InputError, match="solver"):
        dropin.rebalance_experts(weight, 16, 4, 2, 8)


def test_engine_style_arguments_fall_back_like_eplb():
    weight = torch.tensor(README_WEIGHT)
    # num_groups 0 (vLLM, no expert groups) or not a multiple of the nodes: global policy, still valid
    for groups, nodes in ((0, 2), (3, 2), (4, 3)):
        phy2log, _, logcnt = dropin.rebalance_experts(weight, 16, groups, nodes, 8)
        assert phy2log.shape == (2, 16) and (logcnt >= 1).all()
    with pytest.raises(InputError, match="num_replicas"):
        dropin.rebalance_experts(weight, 18, 4, 2, 8)
    with pytest.raises(InputError, match="weight"):
        dropin.rebalance_experts(torch.ones(12), 16, 4, 2, 8)


@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_any_load_gives_a_valid_map(data):
    gpus = data.draw(st.sampled_from([1, 2, 4]))
    experts = gpus * data.draw(st.integers(1, 4))
    # a GPU holds at most one replica of an expert: at most E slots per GPU
    replicas = experts + gpus * data.draw(st.integers(0, min(2, experts - experts // gpus)))
    layers = data.draw(st.integers(1, 3))
    kind = data.draw(st.sampled_from(["zeros", "spike", "random"]))
    rng = np.random.default_rng(data.draw(st.integers(0, 1000)))
    weight = np.zeros((layers, experts))
    if kind == "spike":
        weight[:, rng.integers(experts)] = 10.0 ** rng.integers(0, 12)
    elif kind == "random":
        weight = rng.integers(0, 10**6, size=(layers, experts)).astype(float)
    phy2log, log2phy, logcnt = dropin.rebalance_experts(torch.from_numpy(weight), replicas, 1, 1, gpus)
    rows = phy2log.numpy()
    assert rows.shape == (layers, replicas)
    for layer in range(layers):
        assert set(rows[layer]) == set(range(experts))
        np.testing.assert_array_equal(np.bincount(rows[layer], minlength=experts), logcnt[layer].numpy())
    assert log2phy.shape[-1] == int(logcnt.max())
