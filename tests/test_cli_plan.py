"""CLI: plan, evaluate, compare; the plan file round trip and its errors."""

import json

import numpy as np
import pytest

from moe_place.cli.main import main
from moe_place.errors import InputError
from moe_place.glossary import STATUS_MEANINGS, explain
from moe_place.solvers.base import STATUSES
from moe_place.solvers.evaluate import evaluate_placement
from moe_place.placement import Placement
from moe_place.io import file_sha256
from moe_place.planfile import PlanFile, parse_plan, read_plan, write_plan

TINY = [600, 560, 120, 120, 20, 10, 10, 10]


@pytest.fixture
def tiny_trace(tmp_path):
    path = tmp_path / "t.npz"
    np.savez(path, format_version=1, num_experts=8, top_k=1, counts=np.array([[TINY]]))
    return path


@pytest.fixture
def two_layer_trace(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "two.npz"
    counts = 2 * rng.integers(0, 100, (4, 2, 16))  # 4 steps, 2 layers, 16 experts; top-2: even totals
    np.savez(path, format_version=1, num_experts=16, top_k=2, counts=counts)
    return path, counts


def test_plan_writes_a_valid_plan_with_the_contract_keys(tiny_trace, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["plan", str(tiny_trace), "--gpus", "8", "--redundant", "8", "--out", str(out),
                 "--format", "json", "--no-progress"]) == 0
    report = json.loads(capsys.readouterr().out)
    plan = json.loads(out.read_text())
    for key in ("format_version", "num_layers", "num_logical_experts", "num_gpus", "num_nodes", "phy2log",
                "log2phy", "logcnt", "report", "inputs"):
        assert key in plan
    layer = plan["report"]["layers"][0]
    assert layer["max_gpu_load"] == pytest.approx(590 / 3)  # fast alone reaches the optimum here
    assert layer == report["layers"][0]
    assert plan["inputs"]["trace_sha256"] == file_sha256(tiny_trace)
    assert plan["inputs"]["options"]["num_physical"] == 16
    loaded = read_plan(out)
    assert loaded.placement.num_physical == 16 and loaded.layer_ids == (0,)
    assert np.array_equal(loaded.placement.phy2log, np.array(plan["phy2log"]))


def test_plan_is_deterministic_and_table_output(tiny_trace, tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for out in (a, b):
        assert main(["plan", str(tiny_trace), "--gpus", "4", "--redundant", "8", "--solver", "fast",
                     "--out", str(out), "--no-progress"]) == 0
    assert json.loads(a.read_text())["phy2log"] == json.loads(b.read_text())["phy2log"]
    text = capsys.readouterr().out
    assert "max_gpu_load" in text and "mean gap" in text


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "8", "--redundant", "7"], "--redundant: expected R with E + R divisible by --gpus 8"),
    (["--gpus", "3"], "--redundant"),
    (["--gpus", "8", "--expert-memory-budget", "100"], "--expert-bytes"),
    (["--gpus", "8", "--expert-memory-budget", "10", "--expert-bytes", "20"], "one copy of each"),
    (["--gpus", "8", "--solver", "magic"], "solver: expected one of"),
    (["--gpus", "8", "--nodes", "3"], "--nodes"),
    (["--gpus", "8", "--max-moved-slots", "2"], "--current"),
])
def test_plan_bad_input_is_one_line_exit_2(tiny_trace, tmp_path, capsys, argv, message):
    code = main(["plan", str(tiny_trace), *argv, "--out", str(tmp_path / "x.json"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and err.startswith("moe-place plan: error:") and "Traceback" not in err
    assert not (tmp_path / "x.json").exists()


def test_memory_budget_sets_slots(tiny_trace, tmp_path, capsys):
    out = tmp_path / "m.json"
    assert main(["plan", str(tiny_trace), "--gpus", "8", "--expert-memory-budget", "10", "--expert-bytes", "3",
                 "--out", str(out), "--no-progress"]) == 0
    assert json.loads(out.read_text())["num_physical_experts"] == 24  # 10 // 3 = 3 slots per GPU


def test_memory_budget_reports_per_layer_slots_within_budget(tmp_path, capsys):
    # layer 0 is very skewed (replicas pay), layer 1 is uniform (they do not)
    path = tmp_path / "skew.npz"
    counts = np.array([[[3000, 3000, 3000, 100, 100, 100, 100, 100], [500] * 8]])
    np.savez(path, format_version=1, num_experts=8, top_k=1, counts=counts)
    out = tmp_path / "b.json"
    budget = 6 * 100  # 6 copies per GPU for 2 layers: 3 each if spread evenly
    assert main(["plan", str(path), "--gpus", "4", "--expert-memory-budget", str(budget), "--expert-bytes", "100",
                 "--out", str(out), "--no-progress"]) == 0
    doc = json.loads(out.read_text())
    plan, figures = doc["budget"], doc["report"]["budget"]
    assert sum(plan["slots_per_gpu"]) * 100 <= budget
    assert plan["slots_per_gpu"][0] > plan["slots_per_gpu"][1]  # memory goes to the skewed layer
    assert figures["total_max_load"] < figures["even_total_max_load"]
    assert [len(row) for row in plan["phy2log"]] == [4 * s for s in plan["slots_per_gpu"]]
    for row in plan["phy2log"]:
        assert set(row) == set(range(8))
    assert read_plan(out).budget.slots_per_gpu == tuple(plan["slots_per_gpu"])  # read back, validated
    err = capsys.readouterr().err
    assert "budget mode" in err
    # 4 + 2 slots per GPU (the skewed layer takes the spare) against the uniform R = 4: 3 slots on both layers
    assert plan["slots_per_gpu"] == [4, 2] and figures["freed_bytes"] == 0
    assert ("budget mode: memory: the budget plan's experts take 600 bytes per GPU, the uniform R = 4 (3 slots per "
            "GPU on every layer) 600 bytes: it uses the same memory per GPU (budget 600 bytes)") in err.splitlines()


def test_memory_budget_says_what_it_frees_against_the_uniform_r(tmp_path, capsys):
    path = tmp_path / "flat.npz"  # flat layers: one copy of each expert is as good as more, so the plan frees memory
    np.savez(path, format_version=1, num_experts=8, top_k=1, counts=np.array([[[500] * 8, [500] * 8]]))
    assert main(["plan", str(path), "--gpus", "4", "--expert-memory-budget", "3GiB", "--expert-bytes", "512MiB",
                 "--out", str(tmp_path / "b.json"), "--no-progress", "--format", "json"]) == 0
    done = capsys.readouterr()
    budget = json.loads(done.out)["budget"]
    assert budget["slots_per_gpu"] == [2, 2] and budget["even_slots_per_gpu"] == 3 and budget["even_redundant"] == 4
    assert budget["freed_bytes"] == 2 * 2**29
    assert ("budget mode: memory: the budget plan's experts take 2.00 GiB per GPU, the uniform R = 4 (3 slots per GPU "
            "on every layer) 3.00 GiB: it frees 1.00 GiB per GPU (budget 3.00 GiB)") in done.err.splitlines()


def test_evaluate_out_of_sample_and_windows(two_layer_trace, tmp_path, capsys):
    path, counts = two_layer_trace
    out = tmp_path / "p.json"
    assert main(["plan", str(path), "--gpus", "4", "--redundant", "4", "--solver", "fast", "--out", str(out),
                 "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["evaluate", str(out), str(path), "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    plan = read_plan(out)
    expected = plan.placement.gpu_loads(counts.sum(axis=0)).max(axis=1)
    assert [row["max_gpu_load"] for row in report["layers"]] == pytest.approx(expected.tolist())
    # another trace with the same layers: out of sample
    other = tmp_path / "other.npz"
    shifted = np.roll(counts, 3, axis=2)
    np.savez(other, format_version=1, num_experts=16, top_k=2, counts=shifted)
    assert main(["evaluate", str(out), str(other), "--format", "json", "--split", "local"]) == 0
    local = json.loads(capsys.readouterr().out)
    assert all(0 < row["balancedness"] <= 1 for row in local["layers"])
    assert main(["evaluate", str(out), str(path), "--windows", "4", "--window-objective", "max",
                 "--format", "json"]) == 0
    windows = json.loads(capsys.readouterr().out)
    per_window = np.stack([plan.placement.gpu_loads(c).max(axis=1) for c in counts])  # [4, layers]
    assert [row["max_gpu_load"] for row in windows["layers"]] == pytest.approx(per_window.max(axis=0).tolist())


def test_evaluate_rejects_mismatched_trace(two_layer_trace, tiny_trace, tmp_path, capsys):
    path, _ = two_layer_trace
    out = tmp_path / "p.json"
    main(["plan", str(path), "--gpus", "4", "--solver", "eplb", "--out", str(out), "--no-progress"])
    assert main(["evaluate", str(out), str(tiny_trace)]) == 2
    assert "num_experts" in capsys.readouterr().err


def test_evaluate_rejects_a_trace_without_the_plans_layers(two_layer_trace, tmp_path, capsys):
    path, counts = two_layer_trace
    out, other = tmp_path / "p.json", tmp_path / "one_layer.npz"
    main(["plan", str(path), "--gpus", "4", "--out", str(out), "--no-progress"])
    np.savez(other, format_version=1, num_experts=16, top_k=2, layer_ids=np.array([0]), counts=counts[:, :1])
    capsys.readouterr()
    assert main(["evaluate", str(out), str(other)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "plan's layer ids" in err[0] and "got 1" in err[0]


def test_migration_plan_caps_moves(two_layer_trace, tmp_path, capsys):
    path, counts = two_layer_trace
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    assert main(["plan", str(path), "--gpus", "4", "--redundant", "4", "--solver", "eplb", "--out", str(first),
                 "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["plan", str(path), "--gpus", "4", "--redundant", "4", "--current", str(first),
                 "--max-moved-slots", "2", "--out", str(second), "--no-progress", "--format", "json"]) == 0
    old, new = read_plan(first).placement, read_plan(second).placement
    assert (new.phy2log != old.phy2log).sum(axis=1).max() <= 2
    report = json.loads(capsys.readouterr().out)  # the JSON alone on stdout; the line below on stderr
    moved = int((new.phy2log != old.phy2log).sum())
    assert report["moved_slots"] == moved
    gaps = report["current_plan"]["gap"]  # the plan in use, judged on the same loads against the same bounds
    layers = evaluate_placement(old, counts.sum(axis=0))
    assert gaps == pytest.approx([(r.max_gpu_load - row["lower_bound"]) / r.max_gpu_load
                                  for r, row in zip(layers, report["layers"])], abs=1e-6)
    assert main(["plan", str(path), "--gpus", "4", "--redundant", "4", "--current", str(first),
                 "--max-moved-slots", "2", "--out", str(second), "--no-progress"]) == 0
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if line.startswith("plan: re-planned from "))
    new_gaps = [row["gap"] for row in report["layers"]]
    assert line == (f"plan: re-planned from {first}: {moved} of 40 slots moved, at most 2 per layer; gap (the busiest "
                    f"GPU above the lower bound) mean {np.mean(gaps):.2%} -> {np.mean(new_gaps):.2%}, worst "
                    f"{max(gaps):.2%} -> {max(new_gaps):.2%} (plan in use -> new plan)")


def test_the_table_explains_its_status_words(two_layer_trace, tmp_path, capsys):
    path, _ = two_layer_trace
    assert main(["plan", str(path), "--gpus", "4", "--redundant", "4", "--solver", "fast",
                 "--out", str(tmp_path / "p.json"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "heuristic" in out.split("status: ")[0]  # the table shows the word, then the legend defines it
    assert out.splitlines()[-1] == "status: heuristic = not proved; the gap bounds the loss; gap = (busiest - bound) / busiest"
    assert explain(["heuristic", "optimal"]).startswith("optimal = proved best")
    assert tuple(word for word, _ in STATUS_MEANINGS) == STATUSES  # every status a solver gives has a meaning


def test_compare_table_json_and_plot(two_layer_trace, tmp_path, capsys):
    path, _ = two_layer_trace
    plot, js = tmp_path / "c.png", tmp_path / "c.json"
    assert main(["compare", str(path), "--gpus", "4", "--redundant", "4", "--solvers", "eplb,fast",
                 "--plot", str(plot), "--output-json", str(js)]) == 0
    text = capsys.readouterr().out
    assert "eplb" in text and "fast" in text
    document = json.loads(js.read_text())
    summary = document["summary"]
    assert summary["fast"]["mean_max_over_bound"] <= summary["eplb"]["mean_max_over_bound"] + 1e-12
    assert summary["fast"]["mean_max_over_bound"] >= 1.0 - 1e-12
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["compare", str(path), "--gpus", "4", "--solvers", "eplb,nope"]) == 2


def test_plan_file_round_trip_and_errors(tmp_path):
    placement = Placement(np.array([[0, 1, 2, 3, 0, 1]]), 4, 3)
    plan = PlanFile(placement, (7,), {"solver": "x", "layers": []}, {"seed": 0})
    path = tmp_path / "p.json"
    write_plan(path, plan)
    back = read_plan(path)
    assert back.layer_ids == (7,) and np.array_equal(back.placement.phy2log, placement.phy2log)
    assert (back.placement.num_gpus, back.placement.num_nodes, back.placement.num_experts) == (3, 1, 4)
    document = json.loads(path.read_text())
    bad = {**document, "format_version": 99}
    with pytest.raises(InputError, match="format_version"):
        parse_plan(bad)
    with pytest.raises(InputError, match="logcnt"):
        parse_plan({**document, "logcnt": [[1, 1, 1, 1]]})
    with pytest.raises(InputError, match="log2phy"):
        parse_plan({**document, "log2phy": [[[4, -1], [1, 5], [2, -1], [3, -1]]]})
    with pytest.raises(InputError, match="phy2log"):
        parse_plan({**document, "phy2log": [[0, 1, 2, 3, 0]]})
    with pytest.raises(InputError, match="at most one replica"):
        parse_plan({**document, "phy2log": [[0, 0, 1, 2, 3, 1]]})
    with pytest.raises(InputError, match="missing"):
        parse_plan({k: v for k, v in document.items() if k != "inputs"})
    assert parse_plan({k: v for k, v in document.items() if k != "report"}).report is None  # an engine export
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(InputError, match="JSON"):
        read_plan(tmp_path / "junk.json")
    with pytest.raises(InputError, match="no such file"):
        read_plan(tmp_path / "none.json")
    with pytest.raises(InputError, match="layer_ids"):
        PlanFile(placement, (1, 2))
