"""`moe-place export PLAN --engine sglang|vllm|eplb --out FILE`: each engine's file format."""

import json

import numpy as np
import pytest

from moe_place.cli.main import main
from moe_place.engines.sglang import read_init_expert_location
from moe_place.engines.vllm import EXPORT_FORMAT, read_static_map
from moe_place.placement import Placement
from moe_place.planfile import PlanFile, write_plan

PHY2LOG = np.array([[0, 1, 2, 3, 0, 2], [3, 2, 1, 0, 1, 3], [0, 3, 1, 2, 0, 3]])


@pytest.fixture
def plan_path(tmp_path):
    path = tmp_path / "plan.json"
    write_plan(path, PlanFile(Placement(PHY2LOG, 4, 2), layer_ids=(3, 4, 5)))
    return path


def _export(plan_path, *argv):
    return main(["export", str(plan_path), *argv])


@pytest.mark.parametrize("suffix", [".json", ".pt"])
def test_sglang_file_covers_every_model_layer(tmp_path, plan_path, capsys, suffix):
    out = tmp_path / f"loc{suffix}"
    assert _export(plan_path, "--engine", "sglang", "--out", str(out), "--dense-layers", "0-2") == 0
    m = read_init_expert_location(out)
    assert m.shape == (6, 6)
    np.testing.assert_array_equal(m[3:], PHY2LOG)
    np.testing.assert_array_equal(m[:3], np.tile(np.arange(6) % 4, (3, 1)))
    summary = capsys.readouterr()
    assert "--ep-num-redundant-experts 2" in summary.out and "warning" not in summary.err


def test_sglang_warns_about_moe_layers_missing_from_the_plan(tmp_path, plan_path, capsys):
    assert _export(plan_path, "--engine", "sglang", "--out", str(tmp_path / "loc.json")) == 0
    assert "3 model layers are not in the plan" in capsys.readouterr().err  # layers 0-2 not declared dense


def test_vllm_file_is_read_back_by_the_policy(tmp_path, plan_path):
    out = tmp_path / "vllm.json"
    assert _export(plan_path, "--engine", "vllm", "--out", str(out), "--format", "json") == 0
    doc = json.loads(out.read_text())
    assert doc["format"] == EXPORT_FORMAT and doc["layer_ids"] == [3, 4, 5]
    np.testing.assert_array_equal(read_static_map(out), PHY2LOG)
    log2phy = np.array(doc["log2phy"])
    assert log2phy.shape == (3, 4, 3)  # padded to num_redundant + 1 columns, as vLLM allocates it
    np.testing.assert_array_equal(np.array(doc["logcnt"]), Placement(PHY2LOG, 4, 2).logcnt)
    assert ((log2phy >= 0).sum(axis=2) == np.array(doc["logcnt"])).all()
    # a plan file works as a static placement too
    np.testing.assert_array_equal(read_static_map(plan_path), PHY2LOG)


@pytest.mark.parametrize("suffix", [".npz", ".pt"])
def test_eplb_tensors(tmp_path, plan_path, suffix):
    out = tmp_path / f"eplb{suffix}"
    assert _export(plan_path, "--engine", "eplb", "--out", str(out)) == 0
    placement = Placement(PHY2LOG, 4, 2)
    if suffix == ".npz":
        data = dict(np.load(out))
    else:
        import torch

        data = {k: v.numpy() for k, v in torch.load(out, weights_only=True).items()}
    assert set(data) == {"phy2log", "log2phy", "logcnt"}
    assert all(v.dtype == np.int64 for v in data.values())
    np.testing.assert_array_equal(data["phy2log"], PHY2LOG)
    np.testing.assert_array_equal(data["log2phy"], placement.log2phy)
    np.testing.assert_array_equal(data["logcnt"], placement.logcnt)


@pytest.mark.parametrize("argv, message", [
    (["--engine", "vllm", "--out", "x.pt"], ".json"),
    (["--engine", "eplb", "--out", "x.json"], ".pt or .npz"),
    (["--engine", "vllm", "--out", "x.json", "--dense-layers", "0"], "--engine sglang"),
])
def test_bad_requests_exit_2_with_one_line(tmp_path, plan_path, capsys, argv, message):
    argv = [a if not a.startswith("x.") else str(tmp_path / a) for a in argv]
    assert _export(plan_path, *argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err
    assert not list(tmp_path.glob("x.*"))


def test_missing_plan_exits_2(tmp_path, capsys):
    assert main(["export", str(tmp_path / "none.json"), "--engine", "eplb", "--out", str(tmp_path / "a.npz")]) == 2
