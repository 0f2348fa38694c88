"""`moe-place export PLAN --engine sglang|vllm|eplb --out FILE`: each engine's file format, and the launch
line of each (the whole command that serves the file; TensorRT-LLM's: tests/test_trtllm_export.py)."""

import json
import shlex

import numpy as np
import pytest

from moe_place.cli.main import main
from moe_place.errors import InputError
from moe_place.engines.sglang import MAP_KEY
from moe_place.engines.vllm_policy import static_placement
from moe_place.placement import Placement
from moe_place.planfile import PlanFile, parse_plan, read_plan, write_plan

PHY2LOG = np.array([[0, 1, 2, 3, 0, 2], [3, 2, 1, 0, 1, 3], [0, 3, 1, 2, 0, 3]])


@pytest.fixture
def plan_path(tmp_path):
    path = tmp_path / "plan.json"
    write_plan(path, PlanFile(Placement(PHY2LOG, 4, 2), layer_ids=(3, 4, 5)))
    return path


def read_init_expert_location(path):
    """The `physical_to_logical_map` of a `.json`/`.pt` file, as SGLang reads it (int64 `[layers, P]`)."""
    if str(path).endswith(".pt"):
        import torch

        return torch.load(path, weights_only=True, map_location="cpu")[MAP_KEY].numpy()
    with open(path) as file:
        return np.asarray(json.load(file)[MAP_KEY], dtype=np.int64)


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


def test_vllm_file_is_the_plan_file_without_its_report(tmp_path, plan_path):
    out = tmp_path / "vllm.json"
    assert _export(plan_path, "--engine", "vllm", "--out", str(out), "--format", "json") == 0
    doc = json.loads(out.read_text())
    plan = json.loads(plan_path.read_text())
    assert "report" not in doc and {k: v for k, v in plan.items() if k != "report"} == doc
    assert read_plan(out).layer_ids == (3, 4, 5)
    np.testing.assert_array_equal(static_placement(out, 3, 4, 6, 2).phy2log, PHY2LOG)
    # the plan file itself works as a static placement too
    np.testing.assert_array_equal(static_placement(plan_path, 3, 4, 6, 2).phy2log, PHY2LOG)


def test_budget_plans_are_first_class_in_the_plan_file(tmp_path, capsys):
    from moe_place.planfile import BudgetLayers

    rows = (np.array([[0, 1, 2, 3, 0, 1]]), np.array([[0, 1, 2, 3]]))  # 3 and 2 slots per GPU
    budget = BudgetLayers(tuple(Placement(r, 4, 2) for r in rows), expert_bytes=10, gpu_budget_bytes=50)
    path = tmp_path / "budget.json"
    even = Placement(np.array([[0, 1, 2, 3], [0, 1, 2, 3]]), 4, 2)
    write_plan(path, PlanFile(even, (0, 1), {}, {}, budget))
    back = read_plan(path)
    assert back.budget.slots_per_gpu == (3, 2) and back.budget.used_bytes == 50
    np.testing.assert_array_equal(back.budget.layers[0].phy2log, rows[0])
    doc = json.loads(path.read_text())
    doc["budget"]["phy2log"][1] = [0, 1, 2, 2]  # expert 3 lost: read as an invalid placement
    with pytest.raises(InputError, match=r"budget.phy2log\[1\]"):
        parse_plan(doc, "b.json")
    doc["budget"]["phy2log"][1] = [0, 1, 2, 3]
    doc["budget"]["gpu_budget_bytes"] = 40  # 5 copies of 10 bytes do not fit
    with pytest.raises(InputError, match="budget"):
        parse_plan(doc, "b.json")
    # engines run one slot count on every layer: the evenly slotted placement is exported, with a warning
    assert _export(path, "--engine", "sglang", "--out", str(tmp_path / "loc.json")) == 0
    assert "per-layer slot counts (2-3 per GPU)" in capsys.readouterr().err


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


# ---------------------------------------------------------------------- the launch lines
def _launch(plan_path, tmp_path, capsys, engine, name, *argv) -> list[str]:
    out = tmp_path / name
    assert _export(plan_path, "--engine", engine, "--out", str(out), "--format", "json", *argv) == 0
    return shlex.split(json.loads(capsys.readouterr().out)["launch"])


def _value(words, flag):
    return words[words.index(flag) + 1]


def test_vllm_launch_line_turns_the_plugin_and_eplb_on(tmp_path, plan_path, capsys):
    # the plugin installs only with MOE_PLACE_VLLM_POLICY set (docs/vllm.md), vLLM calls a policy only with
    # --enable-eplb (and that only with expert parallelism), and the policy reads the file MOE_PLACE_STATIC_PLAN names
    words = _launch(plan_path, tmp_path, capsys, "vllm", "placement.json")
    env = dict(w.split("=", 1) for w in words[:words.index("vllm")])
    assert env == {"MOE_PLACE_VLLM_POLICY": "default", "MOE_PLACE_STATIC_PLAN": str(tmp_path / "placement.json")}
    assert words[words.index("vllm"):words.index("vllm") + 3] == ["vllm", "serve", "MODEL"]
    assert "--enable-eplb" in words and "--enable-expert-parallel" in words
    assert _value(words, "--tensor-parallel-size") == "2"  # EP size = TP x DP = the plan's 2 GPUs
    assert json.loads(_value(words, "--eplb-config")) == {"num_redundant_experts": 2}  # 6 slots - 4 experts
    np.testing.assert_array_equal(static_placement(env["MOE_PLACE_STATIC_PLAN"], 3, 4, 6, 2).phy2log, PHY2LOG)


def test_sglang_launch_line_is_the_docs_command(tmp_path, plan_path, capsys):
    words = _launch(plan_path, tmp_path, capsys, "sglang", "loc.json", "--dense-layers", "0-2")
    assert words[:3] == ["python", "-m", "sglang.launch_server"] and _value(words, "--model-path") == "MODEL"
    assert _value(words, "--tp") == "2" and _value(words, "--ep-size") == "2"
    assert _value(words, "--ep-num-redundant-experts") == "2"
    assert read_init_expert_location(_value(words, "--init-expert-location")).shape == (6, 6)


def test_eplb_launch_line_names_the_loader(tmp_path, plan_path, capsys):
    out = tmp_path / "eplb.npz"  # no server: the line says how code that calls DeepSeek EPLB loads the file
    assert _export(plan_path, "--engine", "eplb", "--out", str(out), "--format", "json") == 0
    assert f"numpy.load({str(out)!r})" in json.loads(capsys.readouterr().out)["launch"]
