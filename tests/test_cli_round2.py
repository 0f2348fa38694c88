"""Reliability, round 2 (issue 22): inputs that were silently wrong, wrong diagnoses, options that
ignored the plan, and output a person reads. Each test names what used to happen."""

from __future__ import annotations

import argparse
import json
import re
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from moe_place.cli.main import COMMANDS, build_parser
from moe_place.cli.options import MAX_LAYERS
from moe_place.cores import usable_cores
from moe_place.placement import Placement
from moe_place.traces.load import load_trace
from moe_place.traces.npz import save_npz
from moe_place.traces.synthetic import domain_mixture_trace
from test_cli_reliability import one_line_error, run  # the in-process CLI run and the one-line check

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ROOT / "bench" / "scenarios"
H200 = ROOT / "bench" / "results" / "NVIDIA_H200_20261130T210929Z"


@pytest.fixture
def counts_trace(tmp_path):
    path = tmp_path / "t.npz"
    np.savez(path, format_version=1, num_experts=8, top_k=2,
             counts=np.array([[[600, 560, 120, 120, 20, 10, 10, 10], [200, 200, 200, 200, 200, 200, 200, 200]]] * 4))
    return path


@pytest.fixture
def token_trace(tmp_path):
    """4 steps of 256 tokens, 2 layers of 16 experts, top-2; its model name names no preset."""
    trace = domain_mixture_trace(4, 256, 2, 16, 2, seed=1, model="in-house-moe")
    path = tmp_path / "tokens.npz"
    save_npz(trace, path)
    return path


# ---------------------------------------------------------------------- unknown keys
def _scenario(tmp_path, text: str) -> Path:
    path = tmp_path / "s.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("section, line, closest", [
    ("pipeline", "micro_batchez = 4", "micro_batches"),  # ran with the default 2
    ("workload", "tokenz = 999", "tokens"),  # skipped the tokens check
    ("hardware", "eficiency = 0.5", "efficiency"),
    ("topology", "nodez = 2", "nodes"),
])
def test_a_misspelled_scenario_key_names_the_closest_known_one(tmp_path, section, line, closest):
    text = (SCENARIOS / "c7_pipeline.toml").read_text()
    text = text.replace(f"[{section}]\n", f"[{section}]\n{line}\n") if f"[{section}]" in text else \
        text + f"\n[{section}]\n{line}\n"
    path = _scenario(tmp_path, text)
    code, out, err = run("predict", path)
    one_line_error(code, err, str(path), line.split()[0], f"did you mean {closest}")
    assert out == ""


def test_unknown_keys_in_payback_cases_topology_specs_and_top_level(tmp_path):
    base = (SCENARIOS / "c9_payback.toml").read_text()
    for edit, fragments in [(lambda t: t.replace("[[payback.cases]]\n", "[[payback.cases]]\ncopy_too = [1]\n", 1),
                             ("payback.cases[0].copy_too", "did you mean copy_to")),
                            (lambda t: "pipline = 3\n" + t, ("pipline", "did you mean pipeline"))]:
        path = _scenario(tmp_path, edit(base))
        one_line_error(*run("predict", path)[::2], *fragments)
    path = _scenario(tmp_path, '[model]\npreset = "Qwen3-235B-A22B"\n[topology]\nspec = "1 node x 8 H100"\n'
                               'nodes = 2\n[nic]\nnic = "ConnectX-7"\n')
    one_line_error(*run("predict", path)[::2], "topology.nodes", "spec")  # a spec and a key it overrides


def test_a_parts_file_and_an_engine_config_name_the_closest_key(tmp_path, monkeypatch):
    from moe_place.cost.hardware import load_catalog
    from moe_place.engines.config import load_engine_config
    from moe_place.errors import InputError

    parts = tmp_path / "parts.toml"
    parts.write_text("[gpu.MyGPU]\nbf16_tflops = 100\nhbm_gb_per_s = 1000\nmemory_gb = 80\npcie_gb_per_s = 64\n"
                     "nvlink_gbps = 400\n")
    with pytest.raises(InputError, match="nvlink_gbps.*did you mean nvlink_gb_per_s"):
        load_catalog(parts)
    config = tmp_path / "moe-place.toml"
    config.write_text("max_moved_slot = 4\n")
    with pytest.raises(InputError, match="max_moved_slot.*did you mean max_moved_slots"):
        load_engine_config({"MOE_PLACE_CONFIG": str(config)})


def test_json_traces_and_synthetic_specs_name_the_closest_key(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"counts": [[[3, 1]]], "top_K": 2}))  # top_k was ignored
    one_line_error(*run("analyze", path)[::2], "top_K", "did you mean top_k")
    one_line_error(*run("replay", "--synthetic", "drift:stepz=10")[::2], "stepz", "did you mean steps")


def test_every_bundled_scenario_still_loads():
    from moe_place.cost.scenario import load_scenario, predict
    from moe_place.errors import InfeasibleError

    def numbers(value):
        if isinstance(value, dict):
            for item in value.values():
                yield from numbers(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                yield from numbers(item)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield float(value)

    paths = sorted(SCENARIOS.glob("*.toml"))
    assert len(paths) >= 15
    for path in paths:
        scenario = load_scenario(path)
        if path.name == "c9_no_room.toml":   # the case whose replica does not fit: the model says which GPU
            with pytest.raises(InfeasibleError, match="gpu1 needs 36 MiB"):
                predict(scenario)
            continue
        figures = list(numbers(predict(scenario)))   # every scenario predicts, and every figure is a number
        assert len(figures) >= 5 and all(np.isfinite(figures)), path.name
        assert max(figures) > 0, path.name


# ---------------------------------------------------------------------- npz CRCs
def _damaged_copy(tmp_path, compress: bool) -> Path:
    """A token trace whose topk_ids bytes were changed after writing, ids still in range and distinct."""
    ids = np.argsort(np.random.default_rng(0).random((400, 3, 16)), axis=2)[:, :, :2].astype(np.int16)
    good = tmp_path / ("good_z.npz" if compress else "good.npz")
    (np.savez_compressed if compress else np.savez)(good, format_version=1, num_experts=16, top_k=2, topk_ids=ids)
    data = bytearray(good.read_bytes())
    if compress:  # flip a bit of the stored CRC: zipfile's own check must catch it
        with zipfile.ZipFile(good) as archive:
            info = archive.getinfo("topk_ids.npy")
        crc = info.CRC.to_bytes(4, "little")
        at = data.rfind(crc)  # the central directory's copy, the one zipfile checks against
        data[at] ^= 1
    else:
        at = bytes(data).find(ids.tobytes())
        first = ids[10, 0]
        new = next(e for e in range(16) if e not in first)
        data[at + 10 * 3 * 2 * 2:at + 10 * 3 * 2 * 2 + 2] = np.int16(new).tobytes()
    bad = tmp_path / ("bad_z.npz" if compress else "bad.npz")
    bad.write_bytes(bytes(data))
    return bad


@pytest.mark.parametrize("compress", [False, True])
def test_a_damaged_npz_member_is_one_error_line(tmp_path, compress):
    """Stored members were read past zipfile (no CRC check): analyze counted the damaged ids."""
    bad = _damaged_copy(tmp_path, compress)
    code, out, err = run("analyze", bad)
    one_line_error(code, err, str(bad), "topk_ids", "CRC" if not compress else "")
    assert out == ""


def test_a_damaged_member_is_caught_when_streamed_too(tmp_path):
    from moe_place.errors import InputError
    from moe_place.traces.stream import stream_npz_counts

    bad = _damaged_copy(tmp_path, compress=False)
    for workers in (1, 2):
        with pytest.raises(InputError, match="CRC-32"):
            stream_npz_counts(bad, chunk_tokens=64, workers=workers)
    good = tmp_path / "good.npz"
    assert stream_npz_counts(good, chunk_tokens=64).counts.sum() == 400 * 3 * 2


# ---------------------------------------------------------------------- suffixes
@pytest.mark.parametrize("argv, fragment", [
    (["plan", "TRACE", "--gpus", "4", "--out", "x.npz"], ".json"),  # wrote JSON into x.npz
    (["synth", "drift:steps=3", "--out", "s.txt"], ".npz or .csv or .json"),
    (["analyze", "TRACE", "--plot", "x.txt"], ".png"),  # wrote a PNG into x.txt
    (["compare", "TRACE", "--gpus", "4", "--plot", "x.jpg"], ".png"),
    (["replay", "TRACE", "--out", "r.npz"], ".json"),
    (["predict", str(SCENARIOS / "c6_hot.toml"), "--out", "x.png"], "table"),
    (["analyze", "TRACE", "--format", "table", "--out", "x.json"], "--format table"),
])
def test_a_suffix_that_contradicts_the_format_is_refused(tmp_path, counts_trace, argv, fragment):
    argv = [str(counts_trace) if a == "TRACE" else str(tmp_path / a) if "." in a and "/" not in a and a[0] != "d"
            else a for a in argv]
    code, out, err = run(*argv)
    one_line_error(code, err, fragment)
    assert out == "" and sorted(p.name for p in tmp_path.iterdir()) == ["t.npz"]


@pytest.mark.parametrize("suffix", [".npz", ".csv", ".json"])
def test_synth_writes_the_format_its_suffix_names(tmp_path, suffix):
    """`synth --out s.csv` wrote an npz."""
    path = tmp_path / f"s{suffix}"
    assert run("synth", "drift:steps=5,layers=2,experts=16,seed=4", "--out", path)[0] == 0
    reference = tmp_path / "ref.npz"
    assert run("synth", "drift:steps=5,layers=2,experts=16,seed=4", "--out", reference)[0] == 0
    if suffix == ".csv":
        assert path.read_text().startswith("# num_experts: 16")
    elif suffix == ".json":
        assert json.loads(path.read_text())["num_experts"] == 16
    assert np.array_equal(load_trace(path).step_counts(), load_trace(reference).step_counts())


def test_a_json_name_gets_json_with_a_note(tmp_path, counts_trace):
    """`analyze --out a.json` wrote the table."""
    out = tmp_path / "a.json"
    code, stdout, err = run("analyze", counts_trace, "--out", out)
    assert code == 0 and stdout == ""
    assert json.loads(out.read_text())["num_experts"] == 8
    assert f"wrote json (as its suffix says) {out}" in err


# ---------------------------------------------------------------------- ranges, huge ids
def test_jobs_are_bounded_by_the_cores(tmp_path, counts_trace):
    """`--jobs 1000` ran 18x slower; 99999999999 ended in an OverflowError traceback."""
    cores = usable_cores()
    for value in (str(cores + 1), "1000", "99999999999"):
        for command in (["plan", counts_trace, "--gpus", "4", "--out", tmp_path / "p.json"],
                        ["compare", counts_trace, "--gpus", "4"]):
            one_line_error(*run(*command, "--jobs", value)[::2], "--jobs", f"[1, {cores}]")
    assert run("plan", counts_trace, "--gpus", "4", "--jobs", str(cores), "--out", tmp_path / "p.json")[0] == 0


def test_shares_are_fractions_below_one(counts_trace):
    """`replay --min-saving 5` (500%) was accepted; its successor `--min-gain` is a share too."""
    for value in ("5", "1", "-0.1"):
        one_line_error(*run("replay", counts_trace, "--min-gain", value, "--no-progress")[::2], "--min-gain",
                       "[0, 1)")
    assert run("replay", counts_trace, "--min-gain", "0", "--step-interval", "4", "--no-progress")[0] == 0


@pytest.mark.parametrize("argv, fragment", [
    (["analyze", "TRACE", "--layers", "0-99999999999"], f"[0, {MAX_LAYERS})"),  # MemoryError traceback
    (["export", "PLAN", "--engine", "sglang", "--out", "OUT", "--dense-layers", "0-99999999999"], "--dense-layers"),
    (["export", "PLAN", "--engine", "sglang", "--out", "OUT", "--num-model-layers", "99999999999"],
     "--num-model-layers"),  # 8.73 TiB allocation
    (["replay", "--synthetic", "drift:steps=10,domains=99999999999"], "domains"),  # ran forever
])
def test_huge_values_fail_on_their_range_before_any_allocation(tmp_path, counts_trace, argv, fragment):
    plan = tmp_path / "p.json"
    assert run("plan", counts_trace, "--gpus", "4", "--redundant", "4", "--out", plan)[0] == 0
    argv = [str(counts_trace) if a == "TRACE" else str(plan) if a == "PLAN" else str(tmp_path / "o.json")
            if a == "OUT" else a for a in argv]
    one_line_error(*run(*argv)[::2], fragment)


def test_a_huge_expert_id_in_a_csv_is_an_id_range_error(tmp_path):
    """It ended in "MemoryError: Unable to allocate 7.28 TiB"."""
    path = tmp_path / "c.csv"
    path.write_text("step,layer,expert,count\n0,0,999999999999,3\n0,0,1,1\n")
    one_line_error(*run("analyze", path, "--top-k", "1")[::2], "line 2: expert", "expert id in [0, 65536)",
                   "999999999999")
    sparse = tmp_path / "s.csv"  # small ids, but a dense expansion of 3000 x 3000 x 65001 counts
    sparse.write_text("step,layer,expert,count\n" + "".join(f"{i},{i},65000,1\n" for i in range(3000)))
    one_line_error(*run("analyze", sparse, "--top-k", "1")[::2], "steps x layers x experts")


# ---------------------------------------------------------------------- .pt without torch
@pytest.mark.parametrize("engine, other", [("sglang", ".json"), ("eplb", ".npz")])
def test_a_pt_file_without_torch_says_what_to_do(tmp_path, counts_trace, monkeypatch, engine, other):
    """After README's first command (no torch) this was a 15-line ModuleNotFoundError traceback."""
    plan = tmp_path / "p.json"
    assert run("plan", counts_trace, "--gpus", "4", "--redundant", "4", "--out", plan)[0] == 0
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` fails, find_spec says none
    out = tmp_path / "x.pt"
    code, stdout, err = run("export", plan, "--engine", engine, "--out", out)
    one_line_error(code, err, "torch", "pip install torch", other)
    assert not out.exists() and stdout == ""


# ---------------------------------------------------------------------- export --dense-layers
def test_dense_layers_with_a_plan_of_moe_layers_only(tmp_path, counts_trace):
    """Plans whose layer ids are 0..n-1 (synth, vLLM traces) were refused with --dense-layers."""
    trace = tmp_path / "two.npz"
    np.savez(trace, format_version=1, num_experts=8, top_k=2,
             counts=np.array([[[600, 560, 120, 120, 20, 10, 10, 10], [10, 10, 20, 120, 120, 560, 600, 10]]]))
    plan, loc = tmp_path / "p.json", tmp_path / "loc.json"
    assert run("plan", trace, "--gpus", "4", "--redundant", "4", "--out", plan)[0] == 0
    code, _, err = run("export", plan, "--engine", "sglang", "--out", loc, "--dense-layers", "0-2")
    assert code == 0 and "plan row i goes to the i-th model layer that is not dense" in err
    rows = np.asarray(json.loads(loc.read_text())["physical_to_logical_map"])
    phy2log = np.asarray(json.loads(plan.read_text())["phy2log"])
    assert rows.shape == (5, 12)
    assert (rows[:3] == np.arange(12) % 8).all()  # dense layers: the trivial row
    assert np.array_equal(rows[3:], phy2log)


# ---------------------------------------------------------------------- options a plan records
def test_evaluate_uses_the_plans_model_and_judges_it_under_the_one_time_model(tmp_path, token_trace):
    """A plan made with --objective time --model X on a trace without a model name: evaluate said
    "give --model" and printed no layer time. The expert shape is the plan's; the time model is the command
    line's, else the one set of defaults, never silently the plan's (a note names what the plan was made under)."""
    plan = tmp_path / "p.json"
    code, _, err = run("plan", token_trace, "--gpus", "8", "--nodes", "2", "--objective", "time", "--model",
                       "Qwen3-30B-A3B", "--replica-choice", "vllm", "--time-limit", "20", "--no-progress",
                       "--out", plan)
    assert code == 0, err
    code, out, err = run("evaluate", plan, token_trace, "--format", "json")
    assert code == 0, err
    report = json.loads(out)
    assert report["layer_time_s"] > 0 and report["time_model"]["model"] == "Qwen3-30B-A3B"
    assert report["time_model"]["replica_choice"] == "sglang-static"            # the one default
    assert report["options_from_plan"]["model"] == "Qwen3-30B-A3B"
    assert report["model_unlike_plan"]["replica_choice"] == {"plan": "vllm", "judged": "sglang-static"}
    assert "--model Qwen3-30B-A3B" in err and "the plan was made under --replica-choice vllm" in err
    code, out, err = run("evaluate", plan, token_trace, "--format", "json", "--replica-choice", "vllm")
    assert json.loads(out)["time_model"]["replica_choice"] == "vllm"            # the command line names it
    assert "made under" not in err


def test_predict_takes_the_traffic_model_of_a_time_plan(tmp_path, token_trace):
    plan = tmp_path / "p.json"
    assert run("plan", token_trace, "--gpus", "8", "--nodes", "2", "--objective", "time", "--model",
               "Qwen3-30B-A3B", "--dispatch", "all-to-all", "--time-limit", "20", "--no-progress", "--out",
               plan)[0] == 0
    scenario = tmp_path / "s.toml"
    scenario.write_text(f'[model]\npreset = "Qwen3-30B-A3B"\n[topology]\nspec = "2 nodes x 4 H100, 400 Gbit/s NIC '
                        f'per GPU"\n[workload]\ntrace = "{token_trace.name}"\nplan = "{plan.name}"\nweights = "none"\n')
    code, out, err = run("predict", scenario, "--format", "json")
    assert code == 0, err
    assert json.loads(out)["workload_from_plan"]["traffic"] == "all-to-all"
    assert "traffic = 'all-to-all'" in err


# ---------------------------------------------------------------------- output a person reads
def test_plan_says_what_cpsat_changed(tmp_path, counts_trace):
    """`plan --time-limit 60` spent 33 s in CP-SAT, changed nothing and did not say so."""
    code, _, err = run("plan", counts_trace, "--gpus", "4", "--redundant", "4", "--solver", "cpsat", "--time-limit",
                       "10", "--out", tmp_path / "p.json")
    assert code == 0
    assert "plan: note: CP-SAT, " in err and "layer(s) with a gap" in err
    # the note's figures are the plans': CP-SAT starts from fast's plan, on the layers where it has a gap
    assert run("plan", counts_trace, "--gpus", "4", "--redundant", "4", "--solver", "fast", "--out",
               tmp_path / "fast.json")[0] == 0
    before = [layer["gap"] for layer in json.loads((tmp_path / "fast.json").read_text())["report"]["layers"]]
    after = [layer["gap"] for layer in json.loads((tmp_path / "p.json").read_text())["report"]["layers"]]
    open_layers = [i for i, gap in enumerate(before) if gap > 0]
    note = next(line for line in err.splitlines() if "CP-SAT, " in line)
    assert f"for the {len(open_layers)} layer(s) with a gap" in note and open_layers
    mean = lambda gaps: sum(gaps[i] for i in open_layers) / len(open_layers)  # noqa: E731
    assert f"mean gap {mean(before):.2%} -> {mean(after):.2%}" in note


def test_budget_mode_describes_the_budget_plan(tmp_path, counts_trace):
    """The header described the even plan ('P = ... 2 slots each') and nothing showed the budget plan."""
    code, out, _ = run("plan", counts_trace, "--gpus", "4", "--expert-memory-budget", "10", "--expert-bytes", "1",
                       "--out", tmp_path / "p.json")
    assert code == 0
    assert "budget mode (10 bytes of experts per GPU)" in out and "even plan below" in out
    assert "budget plan (the plan's budget section)" in out and "slots/GPU" in out
    # the budget table describes the plans the file's budget section holds, and they keep the budget
    budget = json.loads((tmp_path / "p.json").read_text())["budget"]
    table = [row.split() for row in out.split("budget plan (the plan's budget section)")[1].splitlines()[2:4]]
    loads = np.load(counts_trace)["counts"].sum(axis=0).astype(float)            # [layers, E]
    for layer, (row, phy2log) in enumerate(zip(table, budget["phy2log"])):
        slots = len(phy2log) // 4
        gpu = Placement(np.array([phy2log]), 8, 4).gpu_loads(loads[layer:layer + 1])[0]
        assert (int(row[1]), float(row[2])) == (slots, round(gpu.max(), 2)) == (budget["slots_per_gpu"][layer],
                                                                                round(gpu.max(), 2))
    assert sum(budget["slots_per_gpu"]) * budget["expert_bytes"] <= 10   # bytes of experts per GPU, all layers


def test_replay_plots_a_short_trace_and_says_so(tmp_path, counts_trace):
    """On a 3-step trace the left panel was empty (one smoothed point) and no 'wrote plot' line."""
    from matplotlib import image

    plot, out = tmp_path / "r.png", tmp_path / "r.json"
    code, _, err = run("replay", counts_trace, "--controller", "static", "--plot", plot, "--out", out,
                       "--no-progress")
    assert code == 0 and f"wrote plot {plot}" in err and f"wrote json {out}" in err
    pixels = image.imread(plot)[..., :3]
    left = pixels[:, :pixels.shape[1] // 2]
    blue = np.abs(left - np.array([0x1f, 0x77, 0xb4]) / 255).max(axis=2) < 0.25  # the first line's colour
    assert blue.sum() > 400  # a line across the panel (about 1,200 pixels), not only the legend's sample (44)


def test_analyze_explains_its_balancedness_columns(counts_trace):
    out = run("analyze", counts_trace)[1]
    assert "vLLM bal: the balancedness vLLM logs" in out and "SGLang bal: SGLang's" in out
    # and the columns hold what the legend says, worked out here from the trace: EP8 puts one expert on a GPU
    gpu = np.load(counts_trace)["counts"].sum(axis=0).astype(float)       # [layers, E] = [layers, GPUs]
    mean, busiest = gpu.mean(axis=1), gpu.max(axis=1)
    row = next(line.split() for line in out.splitlines() if line.split()[:2] == ["8", "1"])
    assert row[2:4] == [f"{(busiest / mean).mean():.2f}", f"{(busiest / mean).max():.2f}"]
    assert row[5:7] == [f"{mean.sum() / busiest.sum():.3f}", f"{(mean / busiest).mean():.3f}"]   # 0.477, 0.651


def _help(command: str) -> str:
    return " ".join(build_parser(command)._subparsers._group_actions[0].choices[command].format_help().split())


def test_one_output_flag_on_every_subcommand_that_writes_a_file():
    """The flag was --out, --output or --output-json depending on the subcommand."""
    aliases = {"analyze": "--output", "predict": "--output", "payback": "--output", "compare": "--output-json",
               "bench": "--output-json", "offload": "--output"}
    for command in set(COMMANDS) - {"evaluate"}:  # evaluate writes no file (stdout only)
        parser = build_parser(command)._subparsers._group_actions[0].choices[command]
        flags = {s for a in parser._actions for s in a.option_strings}
        assert "--out" in flags, command
        assert not flags & {"--output", "--output-json"} - {aliases.get(command)}, command
        if command in aliases:
            action = next(a for a in parser._actions if "--out" in a.option_strings)
            assert aliases[command] in action.option_strings and action.dest == "out"


def test_old_output_flags_still_work(tmp_path, counts_trace):
    out = tmp_path / "a.txt"
    assert run("analyze", counts_trace, "--output", out)[0] == 0 and out.read_text().startswith("unknown")
    out = tmp_path / "c.json"
    assert run("compare", counts_trace, "--gpus", "4", "--output-json", out)[0] == 0
    assert "summary" in json.loads(out.read_text())


def test_help_texts_agree_with_the_choices():
    replay = _help("replay")
    assert "(default H100-SXM)" in replay and "H100-SXM" in replay
    assert "moe-place bench --out" in _help("report") and "microbench.py" not in _help("report")
    # every "(default V)" a help text states is the default the parser really uses (None: resolved later)
    checked, wrong = 0, []
    for command, parser in build_parser()._subparsers._group_actions[0].choices.items():
        for action in parser._actions:
            for said in re.findall(r"\(default ([^)\s,;:]+)\)", action.help or ""):
                if action.default is None:
                    continue
                same = float(said) == float(action.default) if isinstance(action.default, (int, float)) \
                    else said == str(action.default)
                checked += 1
                if not same:
                    wrong.append(f"{command} {action.option_strings[0]}: help {said}, default {action.default}")
    assert checked >= 20 and not wrong, wrong


def test_the_committed_h200_report_is_what_report_renders(tmp_path):
    """Regenerated from the committed JSON it differed from the committed .md on one line."""
    code, _, err = run("report", H200.with_suffix(".json"), "--out", tmp_path)
    assert code == 0, err
    assert (tmp_path / "report.md").read_text() == H200.with_suffix(".md").read_text()


def test_every_option_help_still_names_its_default():
    missing = []
    for command in COMMANDS:
        parser = build_parser(command)._subparsers._group_actions[0].choices[command]
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._StoreTrueAction)) or not action.option_strings:
                continue
            text = (action.help or "").lower()
            if not action.required and "default" not in text and "required" not in text:
                missing.append(f"{command} {action.option_strings}")
    assert not missing, missing


def test_the_docs_state_the_facts_this_round_corrected():
    """README cited SPEC.md (not in the repository), an exit code 1 for a 'threshold' option no
    subcommand has, and bench commands that overwrite the committed replay record. The errors section
    is now docs/errors.md; tests/test_docs.py checks every page for SPEC.md and for `--force` on every
    command that writes into bench/results/."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    assert not any("SPEC.md" in page.read_text() for page in pages) and not (ROOT / "SPEC.md").exists()
    errors = (ROOT / "docs" / "errors.md").read_text()
    assert "threshold" not in errors
    assert all(fact in errors for fact in ("exits with 2", "130 or 143", "--out", "never exit with 1"))
    for page in pages:  # every command that writes the committed replay record says --force
        for line in page.read_text().splitlines():
            if "bench_replay.py" in line and "--out bench/results/replay.json" in line:
                assert "--force" in line, f"{page}: {line}"