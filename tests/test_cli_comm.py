"""CLI: plan --objective time, evaluate's layer-time figures, their defaults and their errors."""

import json

import numpy as np
import pytest

from moe_place.cli.main import main
from moe_place.cost.models import infer_model_name
from moe_place.planfile import read_plan
from moe_place.problem import PlacementProblem
from moe_place.solvers import solve


def write_token_trace(path, rng, tokens=120, layers=2, experts=16, k=4, steps=3, model="Qwen/Qwen3-30B-A3B"):
    ids = np.concatenate([np.stack([np.stack([rng.choice(experts, k, replace=False) for _ in range(layers)])
                                    for _ in range(tokens)]) for _ in range(steps)])
    step = np.repeat(np.arange(steps), tokens)
    np.savez(path, format_version=1, num_experts=experts, top_k=k, topk_ids=ids.astype(np.int16), step=step,
             model=model)
    return ids.reshape(steps, tokens, layers, k)


@pytest.fixture
def token_trace(tmp_path):
    path = tmp_path / "tokens.npz"
    return path, write_token_trace(path, np.random.default_rng(0))


def run_json(capsys, argv):
    code = main(argv)
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def test_plan_time_records_the_objective_and_evaluate_reports_the_layer_time(token_trace, tmp_path, capsys):
    path, ids = token_trace
    out = tmp_path / "time.json"
    report = run_json(capsys, ["plan", str(path), "--gpus", "8", "--nodes", "2", "--redundant", "8", "--out", str(out),
                               "--no-progress", "--format", "json"])
    assert report["objective"] == "time"   # the default: token-level trace on two nodes
    plan = read_plan(out)
    options = plan.inputs["options"]
    assert options["objective"] == "time" and options["dispatch"] == "deepep"
    assert options["replica_choice"] == "sglang-static" and options["model"] == "Qwen3-30B-A3B"
    assert plan.report["time"]["lower_bound_s"] <= plan.report["time"]["predicted_layer_time_s"]
    assert plan.placement.num_physical == 24 and not plan.placement.allow_colocated
    ev = run_json(capsys, ["evaluate", str(out), str(path), "--format", "json"])
    for row in ev["layers"]:
        for key in ("distinct_nodes_per_token", "rdma_bytes", "nvlink_bytes", "dispatch_s", "compute_s", "combine_s",
                    "layer_time_s"):
            assert row[key] is not None
        assert row["layer_time_s"] == pytest.approx(row["dispatch_s"] + row["compute_s"] + row["combine_s"])
    assert ev["layer_time_s"] == pytest.approx(sum(r["layer_time_s"] for r in ev["layers"]))
    assert ev["rdma_bytes"] == pytest.approx(sum(r["rdma_bytes"] for r in ev["layers"]))
    assert ev["time_model"]["replica_choice"] == "sglang-static"
    # the plan's own prediction is what evaluate predicts on the same trace
    assert plan.report["time"]["predicted_layer_time_s"] == pytest.approx(ev["layer_time_s"])
    # exportable as any plan
    loc = tmp_path / "loc.json"
    assert main(["export", str(out), "--engine", "sglang", "--out", str(loc)]) == 0
    capsys.readouterr()
    mapping = np.asarray(json.loads(loc.read_text())["physical_to_logical_map"])
    assert mapping.shape == (2, 24) and all(set(row) == set(range(16)) for row in mapping.tolist())


@pytest.mark.parametrize("objective", [["time", "--time-guard", "0.05"], ["balance"]])
def test_a_plan_of_one_layer_is_the_whole_plans_row_and_evaluates_alike(tmp_path, capsys, objective):
    # each layer is planned on its own tokens, and the random replica choices are seeded by the layer's id:
    # `plan --layers 5` gives layer 5's row of the whole plan, and evaluate gives it the same figures (the
    # default time decision pools the planned layers' windows, so there a layer alone may decide otherwise)
    path = tmp_path / "six.npz"
    write_token_trace(path, np.random.default_rng(3), layers=6)
    whole, one = tmp_path / "whole.json", tmp_path / "one.json"
    common = ["--gpus", "8", "--nodes", "2", "--redundant", "8", "--objective", *objective, "--no-progress",
              "--format", "json"]
    run_json(capsys, ["plan", str(path), *common, "--out", str(whole)])
    run_json(capsys, ["plan", str(path), *common, "--layers", "5", "--out", str(one)])
    assert read_plan(one).placement.phy2log.tolist() == read_plan(whole).placement.phy2log[5:].tolist()
    dynamic = ["--replica-choice", "sglang-dynamic", "--format", "json"]     # a random replica per token and expert
    ev_whole = run_json(capsys, ["evaluate", str(whole), str(path), *dynamic])
    ev_one = run_json(capsys, ["evaluate", str(one), str(path), *dynamic])
    for key in ("rdma_bytes", "dispatch_s", "compute_s", "layer_time_s"):
        assert ev_one["layers"][0][key] == pytest.approx(ev_whole["layers"][5][key], rel=1e-12)


def test_plan_time_reports_its_decision_and_the_guard_is_an_option(token_trace, tmp_path, capsys):
    path, _ = token_trace
    base = ["plan", str(path), "--gpus", "8", "--nodes", "2", "--no-progress", "--format", "json"]
    default = run_json(capsys, [*base, "--out", str(tmp_path / "d.json")])["time"]
    assert default["decision"] == "expected" and default["min_saving"] is None
    assert set(default["pooled"]) == {"traffic", "compute"}
    assert all(set(p) == {"mean", "weight", "noise", "layers"} and p["layers"] == 2 for p in default["pooled"].values())
    layers = read_plan(tmp_path / "d.json").report["layers"]
    for row in layers:   # grouped where the expected saving is positive; two layers: their own windows' means
        own = np.mean(row["held_out_traffic_savings"]) + np.mean(row["held_out_compute_savings"])
        assert row["expected_saving"] == pytest.approx(own) and (row["choice"] == "grouped") == (own > 0)
    guarded = run_json(capsys, [*base, "--time-guard", "0.05", "--out", str(tmp_path / "g.json")])["time"]
    assert guarded["decision"] == "guard" and guarded["min_saving"] == 0.05
    assert main([*base[:-2], "--time-guard", "0.05", "--out", str(tmp_path / "t.json")]) == 0
    assert "on every held-out window" in capsys.readouterr().out
    assert main([*base[:-2], "--out", str(tmp_path / "t.json")]) == 0
    assert "expected saving over the layers" in capsys.readouterr().out


@pytest.mark.parametrize("argv, where", [
    (["--objective", "balance", "--time-guard", "0.05"], "--time-guard"),
    (["--time-guard", "5"], "--time-guard"),
])
def test_time_guard_bad_input_is_one_line_exit_2(token_trace, tmp_path, capsys, argv, where):
    path, _ = token_trace
    try:
        code = main(["plan", str(path), "--gpus", "8", "--nodes", "2", *argv, "--out", str(tmp_path / "x.json"),
                     "--no-progress"])
    except SystemExit as stop:   # argparse's own check of the value
        code = stop.code
    err = capsys.readouterr().err
    assert code == 2 and where in err and err.count("\n") == 1
    assert not (tmp_path / "x.json").exists()


def test_distinct_nodes_per_token_is_a_direct_count(token_trace, tmp_path, capsys):
    path, ids = token_trace
    out = tmp_path / "b.json"
    run_json(capsys, ["plan", str(path), "--gpus", "8", "--nodes", "4", "--objective", "balance", "--out", str(out),
                      "--no-progress", "--format", "json"])
    ev = run_json(capsys, ["evaluate", str(out), str(path), "--format", "json"])
    phy2log = np.array(read_plan(out).placement.phy2log)
    for layer, row in enumerate(ev["layers"]):
        node = np.empty(16, dtype=int)
        node[phy2log[layer]] = np.arange(16) // 2 // 2          # 2 slots per GPU, 2 GPUs per node
        direct = np.mean([len(set(node[t])) for t in ids[:, :, layer, :].reshape(-1, 4)])
        assert row["distinct_nodes_per_token"] == pytest.approx(direct)


def test_balance_objective_is_todays_plan(token_trace, tmp_path, capsys):
    path, ids = token_trace
    out = tmp_path / "b.json"
    run_json(capsys, ["plan", str(path), "--gpus", "8", "--nodes", "2", "--objective", "balance", "--out", str(out),
                      "--no-progress", "--format", "json"])
    loads = np.stack([np.bincount(ids[:, :, i, :].ravel(), minlength=16) for i in range(2)]).astype(float)
    expected = solve(PlacementProblem(loads, 8, 16, num_nodes=2), "auto").placement.phy2log
    assert np.array_equal(read_plan(out).placement.phy2log, expected)
    one_node = tmp_path / "one.json"
    report = run_json(capsys, ["plan", str(path), "--gpus", "8", "--out", str(one_node), "--no-progress",
                               "--format", "json"])
    assert report["objective"] == "balance"   # one node: today's default


def test_count_level_trace_gets_compute_and_a_note(tmp_path, capsys):
    path = tmp_path / "counts.npz"
    rng = np.random.default_rng(1)
    np.savez(path, format_version=1, num_experts=16, top_k=2, counts=2 * rng.integers(0, 25, (3, 2, 16)),
             model="allenai/OLMoE-1B-7B-0924")
    out = tmp_path / "p.json"
    report = run_json(capsys, ["plan", str(path), "--gpus", "8", "--nodes", "2", "--out", str(out), "--no-progress",
                               "--format", "json"])
    assert report["objective"] == "balance"   # counts only: no traffic to plan for
    code = main(["evaluate", str(out), str(path), "--format", "json"])
    captured = capsys.readouterr()
    assert code == 0 and "token-level" in captured.err
    ev = json.loads(captured.out)
    assert ev["layer_time_s"] is None and ev["rdma_bytes"] is None and "token-level" in ev["note"]
    assert all(row["compute_s"] > 0 and row["dispatch_s"] is None for row in ev["layers"])
    assert ev["compute_s"] == pytest.approx(sum(row["compute_s"] for row in ev["layers"]))


def test_evaluate_table_shows_the_time_columns(token_trace, tmp_path, capsys):
    path, _ = token_trace
    out = tmp_path / "p.json"
    run_json(capsys, ["plan", str(path), "--gpus", "8", "--nodes", "2", "--out", str(out), "--no-progress",
                      "--format", "json"])
    assert main(["evaluate", str(out), str(path), "--dispatch", "all-to-all", "--replica-choice", "vllm"]) == 0
    text = capsys.readouterr().out
    assert "RDMA MB" in text and "dispatch all-to-all" in text and "replica choice vllm" in text


@pytest.mark.parametrize("argv, where", [
    (["--objective", "time", "--topology", "3 nodes x 8 H100, 400 Gbit/s NIC per GPU"], "--topology"),
    (["--objective", "time", "--model", "GPT-5"], "model preset"),
    (["--objective", "time", "--weights", "tiles"], "--block-m"),
    (["--objective", "time", "--solver", "cpsat"], "--solver"),
    (["--objective", "time", "--expert-memory-budget", "100000", "--expert-bytes", "10"], "--objective time"),
])
def test_plan_time_bad_input_is_one_line_exit_2(token_trace, tmp_path, capsys, argv, where):
    path, _ = token_trace
    code = main(["plan", str(path), "--gpus", "8", "--nodes", "2", *argv, "--out", str(tmp_path / "x.json"),
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and where in err and err.startswith("moe-place plan: error:") and err.count("\n") == 1
    assert not (tmp_path / "x.json").exists()


def test_plan_time_needs_token_ids_and_a_model(tmp_path, capsys):
    counts = tmp_path / "c.npz"
    np.savez(counts, format_version=1, num_experts=16, top_k=2, counts=np.ones((1, 1, 16), dtype=int))
    code = main(["plan", str(counts), "--gpus", "8", "--nodes", "2", "--objective", "time", "--out",
                 str(tmp_path / "x.json"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "--objective time: expected a token-level trace" in err
    unknown = tmp_path / "u.npz"
    write_token_trace(unknown, np.random.default_rng(2), tokens=20, steps=1, model="someone/custom-moe")
    code = main(["plan", str(unknown), "--gpus", "8", "--nodes", "2", "--out", str(tmp_path / "x.json"),
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "--model: expected an expert shape preset" in err


def test_model_names_map_to_presets():
    assert infer_model_name("Qwen/Qwen3-30B-A3B-Instruct-2507") == "Qwen3-30B-A3B"
    assert infer_model_name("mistralai/Mixtral-8x7B-v0.1") == "Mixtral-8x7B"
    assert infer_model_name("deepseek-ai/DeepSeek-R1") == "DeepSeek-V3"
    assert infer_model_name("unknown") is None
