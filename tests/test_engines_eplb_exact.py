"""The drop-in with solver="eplb" equals DeepSeek EPLB's `eplb.py` exactly, in all three tensors.

Expected outputs: `tests/data/eplb_expected.npz`, made by `tests/data/make_eplb_expected.py` from
github.com/deepseek-ai/EPLB `eplb.py` at commit d52c72d5b2f2fb4c41afbf8eb21366820239913d (main,
2025-03-24; the commit, the file's sha256 and the torch version are stored beside the outputs) on
torch 2.13.0. The tests fetch nothing. The original orders equal loads by torch's default (unstable) sort, and so does
the drop-in, so the tie cases hold for the torch the file was made with.
"""

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from moe_place import eplb as dropin  # noqa: E402
from moe_place.errors import InputError, ParameterError  # noqa: E402
from moe_place.solvers.deepseek import eplb_maps  # noqa: E402

DATA = np.load(Path(__file__).parent / "data" / "eplb_expected.npz")
CASES = [str(name) for name in DATA["meta/cases"]]

# sha256 of `eplb.py` at every commit of github.com/deepseek-ai/EPLB (main and the pull-request refs), read
# from a clone on 2026-12-04 with `git show COMMIT:eplb.py | sha256sum`; main's head then was d52c72d.
EPLB_PY_SHA256 = {
    "f9bc62e84182eee311ec97c3ec3ce38f5073a646": "f64ac531dc4021f075199604fe73fb1875be2a5197827ec9480106dcf39e6dec",
    "636fdc0a3e0918b24d9379bb80cbf10e734b94ad": "f64ac531dc4021f075199604fe73fb1875be2a5197827ec9480106dcf39e6dec",
    "fc36b96136e1ce3d9a298017929f2eacf474091b": "71503cc72f073c4e8d34a9b61a92ec0abde4ec719d5cf229baa91f8178f419cb",
    "48c86cb16b6c1789553dc03a92805906073e0eec": "b712dfa7f7a7b23e2fbed46470bdd2998ba6d81aab20cc667c444172c62e46ad",
    "cf221658a7f129d4b006954b04711f2394a4d520": "b712dfa7f7a7b23e2fbed46470bdd2998ba6d81aab20cc667c444172c62e46ad",
    "9d303fafea12a096dc446076c51e1a27760e0923": "a952549162b5b26b8d12d767fe23a0c0e4b173b7d2941492ae68dfe2dd7d0caa",
    "3079d71e1f7d2075a70c93fbfecf7f7002c0e87e": "a952549162b5b26b8d12d767fe23a0c0e4b173b7d2941492ae68dfe2dd7d0caa",
    "79724bd9744f9d8d08cc9ab4c7319265fc54cc9a": "cbc03334dfd70578ab3c8c08f491e5d716b0d8294aa35602e40b4529bf593bf1",
    "16341859c672681a261e9b691abb3d6eb757da29": "cbebf43827fbae30cc0df69c45928bb3f6fe0f7c007035af3fcc41241c5d83e8",
    "e1100fefe7a54540f5009421c3d18867f62b5f47": "cbebf43827fbae30cc0df69c45928bb3f6fe0f7c007035af3fcc41241c5d83e8",
    "ff2cba52e9950e7913ce5dad856ca61ebb7558ba": "0e6c2d6a6de88fd835b2b1a8261431b26aa6cef7e0ff08038e21b5b6ce916a00",
    "d52c72d5b2f2fb4c41afbf8eb21366820239913d": "25b37ccd83aef2369c68f2b4bb596608a4f289956d97d9a3504bfd3159459e29",
    # refs/pull/13/merge: PR 13 (a rebalance_with_migration_cost function) merged into d52c72d, never on main
    "57919718be1fbe2baca80a42a7df4de7119aaa95": "1213f1264b9d0b253a5b18f7847ee197b8ab518369471186a1a22c0a719f034f",
}


# DeepSeek EPLB's README example (github.com/deepseek-ai/EPLB, README.md), written here from the README,
# not read from the expected-outputs file: 2 layers x 12 experts, 16 replicas, 4 groups, 2 nodes, 8 GPUs
README_WEIGHT = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                 [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
README_PHY2LOG = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                  [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]


def test_the_expected_outputs_say_where_they_came_from():
    commit, sha256 = str(DATA["meta/eplb_commit"]), str(DATA["meta/eplb_sha256"])
    assert commit in EPLB_PY_SHA256, f"eplb.py commit {commit} is not one of EPLB's known commits"
    assert EPLB_PY_SHA256[commit] == sha256, f"the stored sha256 is not that of eplb.py at {commit}"
    assert commit == "d52c72d5b2f2fb4c41afbf8eb21366820239913d"  # the commit the docs and this module name
    # the ties are torch's: the file holds for the torch it was made with, the one the tests run
    assert str(DATA["meta/torch"]).split("+")[0] == torch.__version__.split("+")[0]
    # the file's README case is DeepSeek's published example, its arguments and its answer
    assert DATA["readme/weight"].tolist() == README_WEIGHT and DATA["readme/args"].tolist() == [16, 4, 2, 8]
    assert DATA["readme/phy2log"].tolist() == README_PHY2LOG
    assert {"readme", "colocated"} <= set(CASES) and sum(c.startswith("random") for c in CASES) == 32
    policies = {bool(DATA[f"{c}/args"][1] % DATA[f"{c}/args"][2] == 0) for c in CASES if c.startswith("random")}
    assert policies == {True, False}  # hierarchical and global
    sizes = [DATA[f"{c}/weight"].shape for c in CASES if c.startswith("random")]
    assert {s[0] for s in sizes} == {1, 2, 3, 4} and min(s[1] for s in sizes) == 8 and max(s[1] for s in sizes) == 256
    for case in CASES:   # every case's three maps agree with each other and with its arguments
        replicas, experts = int(DATA[f"{case}/args"][0]), DATA[f"{case}/weight"].shape[1]
        phy2log, log2phy, logcnt = (DATA[f"{case}/{name}"] for name in ("phy2log", "log2phy", "logcnt"))
        assert phy2log.shape == (len(DATA[f"{case}/weight"]), replicas), case
        for layer in range(len(phy2log)):
            assert np.bincount(phy2log[layer], minlength=experts).tolist() == logcnt[layer].tolist(), case
            for expert in range(experts):
                slots = log2phy[layer, expert]
                assert sorted(slots[slots >= 0].tolist()) == np.flatnonzero(phy2log[layer] == expert).tolist(), case


@pytest.mark.parametrize("case", CASES)
def test_drop_in_equals_eplb_py(case):
    replicas, groups, nodes, gpus = (int(v) for v in DATA[f"{case}/args"])
    got = dropin.rebalance_experts(torch.from_numpy(DATA[f"{case}/weight"]), replicas, groups, nodes, gpus,
                                   solver="eplb")
    for name, tensor in zip(("phy2log", "log2phy", "logcnt"), got):
        assert tensor.dtype == torch.int64 and tensor.device.type == "cpu"
        np.testing.assert_array_equal(tensor.numpy(), DATA[f"{case}/{name}"], err_msg=f"{case}: {name}")


def test_readme_log2phy_lists_replicas_in_creation_order():
    _, log2phy, _ = dropin.rebalance_experts(torch.from_numpy(DATA["readme/weight"]), 16, 4, 2, 8, solver="eplb")
    # expert 10 of layer 0 has two replicas; the original lists them as created, not ascending
    np.testing.assert_array_equal(log2phy.numpy(), DATA["readme/log2phy"])
    assert any(row[0] > row[1] >= 0 for row in log2phy.numpy().reshape(-1, log2phy.shape[-1]) if len(row) > 1)


def test_forced_colocation_is_accepted_like_the_original():
    phy2log, log2phy, logcnt = dropin.rebalance_experts(torch.ones(1, 8), 10, 1, 1, 1, solver="eplb")
    assert phy2log.tolist() == [[2, 3, 4, 5, 6, 7, 0, 1, 0, 1]]
    assert logcnt.tolist() == [[2, 2, 1, 1, 1, 1, 1, 1]]
    # our other solvers never co-locate: one clear error saying why
    with pytest.raises(ParameterError, match="at most 8 slots per GPU.*solver='eplb'"):
        dropin.rebalance_experts(torch.ones(1, 8), 10, 1, 1, 1, solver="fast")


def test_the_stable_order_differs_from_torch_only_in_tie_order():
    # the planner's reimplementation sorts stably (ties by index): same phy2log on tie-free
    # loads, but replicas of one expert may be listed in another order in log2phy
    for case in (c for c in CASES if c.startswith("random")):
        replicas, groups, nodes, gpus = (int(v) for v in DATA[f"{case}/args"])
        phy2log, log2phy, logcnt = eplb_maps(DATA[f"{case}/weight"], replicas, groups, nodes, gpus)
        np.testing.assert_array_equal(phy2log, DATA[f"{case}/phy2log"])
        np.testing.assert_array_equal(logcnt, DATA[f"{case}/logcnt"])
        np.testing.assert_array_equal(np.sort(log2phy, axis=-1), np.sort(DATA[f"{case}/log2phy"], axis=-1))


@pytest.mark.parametrize("solver", ["eplb", "fast"])
def test_parameter_errors_are_assertion_errors_with_a_clear_line(solver):
    weight = torch.tensor([[10, 20, 30, 40]])
    # vLLM's test_parameter_validation: 7 replicas on 4 GPUs must raise AssertionError
    with pytest.raises(AssertionError, match="num_replicas: expected a multiple of num_gpus=4, got 7"):
        dropin.rebalance_experts(weight, 7, 2, 2, 4, solver=solver)
    with pytest.raises(InputError, match="num_replicas"):
        dropin.rebalance_experts(weight, 7, 2, 2, 4, solver=solver)
    # the hierarchical policy's own assertions: groups split the experts, nodes split the GPUs
    with pytest.raises(ParameterError, match="num_groups: expected a divisor of the 4 logical experts, got 3"):
        dropin.rebalance_experts(weight, 8, 3, 1, 4, solver=solver)
    with pytest.raises(ParameterError, match="num_nodes: expected a divisor of num_gpus=3, got 2"):
        dropin.rebalance_experts(weight, 6, 2, 2, 3, solver=solver)
    with pytest.raises(ParameterError, match="weight"):
        dropin.rebalance_experts(torch.ones(4), 8, 1, 1, 4, solver=solver)
    # where the original falls back to the global policy, so does the drop-in
    phy2log, _, logcnt = dropin.rebalance_experts(weight, 8, 3, 2, 4, solver=solver)
    assert phy2log.shape == (1, 8) and logcnt.sum() == 8
