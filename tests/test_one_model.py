"""One layer-time model with one set of defaults, in every command (docs/MODEL.md, "One model, one set of
defaults"): the same default in every `--help`, a plan's own predicted time equal to `evaluate`'s on the same
steps, every plan judged under the command line's model (never silently the plan's), a replay's figures the
same on every run, and advice that never recommends a loss."""

import json

import numpy as np
import pytest

from moe_place.cli.main import main
from moe_place.cli.options import TIME_MODEL_DEFAULTS
from moe_place.cost.comm import CommModel
from moe_place.cost.cluster import ReplayCost
from moe_place.cost.gemm import DEFAULT_WEIGHTS
from moe_place.traces.bundled import bundled_path

TRACE = str(bundled_path("qwen3-30b-a3b_prefill_topk.npz"))
SMALL = ["--gpus", "8", "--nodes", "2", "--redundant", "8", "--layers", "0-2"]


def test_every_command_and_class_has_the_same_expert_time_default():
    assert TIME_MODEL_DEFAULTS["weights"] == DEFAULT_WEIGHTS == "calibrated"
    assert CommModel.__dataclass_fields__["weights"].default == DEFAULT_WEIGHTS
    assert ReplayCost.__dataclass_fields__["weights"].default == DEFAULT_WEIGHTS


@pytest.mark.parametrize("command", ["plan", "evaluate"])
def test_the_help_names_the_one_default(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "none (default: calibrated, the same in every command)" in text


def _json(capsys, argv):
    assert main(argv + ["--format", "json", "--no-progress"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_plans_own_time_is_evaluates_on_the_same_steps_and_plans_are_judged_alike(tmp_path, capsys):
    timed, balanced = tmp_path / "time.json", tmp_path / "balance.json"
    made = _json(capsys, ["plan", TRACE, *SMALL, "--objective", "time", "--steps", "1-2", "--out", str(timed)])
    _json(capsys, ["plan", TRACE, *SMALL, "--objective", "balance", "--steps", "1-2", "--out", str(balanced)])
    same = _json(capsys, ["evaluate", str(timed), TRACE, "--steps", "1-2"])
    assert same["layer_time_s"] == pytest.approx(made["time"]["predicted_layer_time_s"], rel=1e-12)
    assert same["time_model"]["weights"] == "calibrated"
    # a plan made under another expert time is judged, as every plan, under the one the command line names
    once = tmp_path / "once.json"
    _json(capsys, ["plan", TRACE, *SMALL, "--objective", "time", "--steps", "1-2", "--weights", "once",
                   "--out", str(once)])
    judged = {p.name: _json(capsys, ["evaluate", str(p), TRACE, "--steps", "0"]) for p in (once, timed, balanced)}
    assert {r["time_model"]["weights"] for r in judged.values()} == {"calibrated"}
    assert judged["once.json"]["model_unlike_plan"] == {"weights": {"plan": "once", "judged": "calibrated"}}
    assert "model_unlike_plan" not in judged["time.json"]
    assert main(["evaluate", str(once), TRACE, "--steps", "0", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "the plan was made under --weights once; judged, as every plan, under --weights calibrated" in err
    under_once = _json(capsys, ["evaluate", str(once), TRACE, "--steps", "0", "--weights", "once"])
    assert under_once["time_model"]["weights"] == "once"
    assert under_once["layer_time_s"] != judged["once.json"]["layer_time_s"]


CADENCE = ["cadence", "--synthetic", "drift:steps=1200,layers=2,experts=16,tokens=1024,seed=3", "--engine", "sglang",
           "--intervals", "100", "--no-hindsight", "--no-progress"]


def test_the_cadence_verdict_repeats_run_to_run(capsys):
    first, second = _json(capsys, CADENCE), _json(capsys, CADENCE)
    for doc in (first, second):
        assert doc["policy_time"] == "priced"
    assert [r["total_s"] for r in first["runs"]] == [r["total_s"] for r in second["runs"]]
    assert first["best_ratio"] == second["best_ratio"] and first["settings"] == second["settings"]


def test_cadence_never_advises_a_loss(capsys):
    doc = _json(capsys, CADENCE)
    wins = doc["best"]["moe-place"]["total_s"] < doc["best"]["default"]["total_s"]
    assert doc["advice"] == ("moe-place" if wins else "default")
    text = " ".join(doc["settings"])
    assert ("MOE_PLACE_SGLANG=1" in text) == wins
    # a rule that moves a layer only for a 99% gain never moves: it cannot win, and the advice says so
    assert main(CADENCE + ["--min-gain", "0.99"]) == 0
    out = capsys.readouterr().out
    assert "advice               keep the engine's default policy" in out
    assert "MOE_PLACE" not in out.split("advice")[1]
    assert "--eplb-rebalance-num-iterations" in out.split("advice")[1]


def test_cadence_settings_carry_the_split(capsys):
    doc = _json(capsys, CADENCE + ["--split", "per-batch", "--gpus", "4", "--redundant", "4"])
    if doc["advice"] == "moe-place":
        text = " ".join(doc["settings"])
        assert "MOE_PLACE_SPLIT=per-batch" in text and "--ep-dispatch-algorithm lp" in text


def test_cadence_refuses_a_trace_too_short_for_the_defaults_own_cadence(capsys):
    assert main(["cadence", TRACE, "--engine", "sglang"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a trace of at least 1001 steps" in err[0] and "3 steps" in err[0]


def test_the_replay_prices_each_call_the_same(capsys):
    argv = ["replay", "--synthetic", "drift:steps=600,layers=2,experts=16,tokens=1024,seed=3", "--engine", "sglang",
            "--step-interval", "100"]
    first, second = _json(capsys, argv + ["--no-per-step"]), _json(capsys, argv + ["--no-per-step"])
    assert first["total_policy_time_s"] == second["total_policy_time_s"] > 0
    assert first["calls"] > 0
    assert first["total_policy_time_s"] == pytest.approx(first["policy_price_s"] * first["calls"], rel=1e-12)
    measured = _json(capsys, argv + ["--no-per-step", "--policy-time", "measured"])
    assert measured["policy_price_s"] is None
    assert measured["total_policy_time_s"] == pytest.approx(measured["total_policy_cpu_s"])


def test_compare_prices_each_plan_as_plan_and_evaluate_do(tmp_path, capsys):
    compared = _json(capsys, ["compare", TRACE, *SMALL, "--solvers", "fast", "--steps", "1-2"])
    plan = tmp_path / "fast.json"
    _json(capsys, ["plan", TRACE, *SMALL, "--objective", "balance", "--solver", "fast", "--steps", "1-2",
                   "--out", str(plan)])
    judged = _json(capsys, ["evaluate", str(plan), TRACE, "--steps", "1-2"])
    assert compared["time_model"] == judged["time_model"]
    assert compared["summary"]["fast"]["layer_time_s"] == pytest.approx(judged["layer_time_s"], rel=1e-12)


def test_replay_and_cadence_say_which_default_they_ran(capsys):
    from moe_place.online import engine_default

    doc = _json(capsys, CADENCE)
    here = engine_default.available("sglang")
    if here:
        assert doc["default_policy"].startswith("sglang ") and doc["default_policy"].endswith("'s own code")
    else:
        assert doc["default_policy"] == ("moe-place's numpy copy of DeepSeek's EPLB (the engine's maps; sglang is "
                                         "not importable here)")
    numpy = _json(capsys, CADENCE + ["--default-policy", "numpy"])
    assert numpy["default_policy"] == "moe-place's numpy copy of DeepSeek's EPLB (the engine's maps)"
    if not here:   # CI: the engine is not installed; asking for its code is one line, exit 2
        assert main(CADENCE + ["--default-policy", "engine"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--default-policy engine" in err[0] and "no sglang here" in err[0]
