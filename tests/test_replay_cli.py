"""`moe-place replay`: the JSON contract, totals that add up, determinism, and input errors."""

import json

import numpy as np
import pytest

from moe_place.cli.main import main
from moe_place.online.replay import parse_synthetic
from moe_place.traces.bundled import bundled_path

SPEC = "drift:steps=300,layers=2,experts=16,tokens=1024,seed=3"
COMMON = ["--synthetic", SPEC, "--gpus", "4", "--window", "100", "--format", "json", "--no-progress"]


def _run(capsys, *extra):
    assert main(["replay", *COMMON, *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("controller", ["static", "engine-default", "ours"])
def test_json_contract_and_totals(capsys, controller, engine):
    doc = _run(capsys, "--controller", controller, "--step-interval", "120", "--engine", engine)
    for key in ("controller", "steps", "rebalances", "bytes_moved", "total_expert_time_s", "total_migration_time_s",
                "total_policy_time_s", "total_time_s", "per_step", "engine", "step_interval", "window", "start",
                "migration", "copy_schedule"):
        assert key in doc, key
    name = f"{engine}-default" if controller == "engine-default" else controller
    assert doc["controller"] == name and doc["steps"] == 300 == len(doc["per_step"])
    assert (doc["migration"], doc["copy_schedule"]) == ({"vllm": "async", "sglang": "stall"}[engine], "parallel")
    steps = doc["per_step"]
    assert sum(s["expert_time_s"] for s in steps) == pytest.approx(doc["total_expert_time_s"])
    assert sum(s["comm_time_s"] for s in steps) == pytest.approx(doc["total_comm_time_s"]) and doc["total_comm_time_s"] > 0
    assert sum(s["copy_time_s"] for s in steps) == pytest.approx(doc["total_migration_time_s"])
    assert sum(s["bytes_moved"] for s in steps) == doc["bytes_moved"]
    assert doc["total_time_s"] == pytest.approx(doc["total_expert_time_s"] + doc["total_comm_time_s"]
                                                + doc["total_migration_time_s"] + doc["total_policy_time_s"])
    assert sum(s["rebalance"] for s in steps) == doc["rebalances"] == len(doc["rebalance_steps"])
    assert all(s["rebalance"] for s in steps if s["bytes_moved"] or s["copy_time_s"])
    assert all(0 < s["balancedness"] <= 1 for s in steps)
    if controller == "static":
        assert doc["rebalances"] == 0 and doc["bytes_moved"] == 0 and doc["total_policy_time_s"] == 0
    if controller == "engine-default":
        # vLLM: a quarter interval, then every 120 steps; SGLang: after 121 passes, then every 120 (both from slot p = p % E)
        assert doc["rebalance_steps"] == {"vllm": [29, 149, 269], "sglang": [120, 240]}[engine]
        assert doc["total_policy_cpu_s"] > 0
        # vLLM runs its policy in the async worker thread, beside serving; SGLang's scheduler waits for it
        assert (doc["total_policy_time_s"] > 0) == (engine == "sglang")


def test_the_earlier_controller_name_still_works(capsys):
    assert _run(capsys, "--controller", "periodic-eplb", "--step-interval", "120")["controller"] == "vllm-default"


def test_same_input_same_output(capsys):
    first, second = (_run(capsys, "--controller", "ours", "--step-interval", "60") for _ in range(2))
    for doc in (first, second):   # the policy's own time is measured (CPU time): everything else repeats
        doc.pop("total_policy_time_s"), doc.pop("total_policy_cpu_s"), doc.pop("total_time_s")
    assert first == second


def test_synthetic_spec_is_the_traces_generator():
    counts, params = parse_synthetic("drift:steps=50,layers=3,experts=8,top_k=2,tokens=64,seed=1")
    assert counts.shape == (50, 3, 8) and params["seed"] == 1
    np.testing.assert_array_equal(counts.sum(axis=2), 64 * 2)  # every token dispatched top_k times per layer
    again, _ = parse_synthetic("drift:steps=50,layers=3,experts=8,top_k=2,tokens=64,seed=1")
    np.testing.assert_array_equal(counts, again)


def test_replays_a_bundled_trace_file(capsys):
    path = bundled_path("olmoe-1b-7b_expert_counts_L0_L7_L15.npz")
    assert main(["replay", str(path), "--gpus", "8", "--controller", "ours", "--format", "json", "--no-per-step",
                 "--engine", "sglang", "--step-interval", "2", "--window", "2"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["steps"] == 6 and doc["model"] == "OLMoE-1B-7B" and "per_step" not in doc


@pytest.mark.parametrize("argv, message", [
    (["replay"], "exactly one"),
    (["replay", "--synthetic", "drift:steps=x"], "steps"),
    (["replay", "--synthetic", "walk:steps=10"], "--synthetic"),
    (["replay", "--synthetic", "drift:steps=20,experts=8", "--gpus", "3", "--redundant", "0", "--step-interval", "4"],
     "--redundant"),
    (["replay", "--synthetic", "drift:steps=20,experts=8"], "--step-interval"),
    (["replay", "--synthetic", "drift:steps=20,experts=8", "--step-interval", "4", "--groups", "3"], "--groups"),
    (["replay", "no/such/trace.npz"], "no such file"),
    (["replay", "--synthetic", "drift:steps=20,experts=8", "--gpus", "4", "--nodes", "3", "--step-interval", "4"],
     "--nodes"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err
