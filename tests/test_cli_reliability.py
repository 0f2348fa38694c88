"""Every path a user can type ends in one clear line: bad outputs, unreadable inputs, silently
accepted options, unbounded work; and a property test driving every subcommand with generated
bad paths, options and file contents."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from moe_place.cli.main import COMMANDS, build_parser, main
from moe_place.cost.scenario import MAX_PAYBACK_BATCHES
from moe_place.online.replay import MAX_SYNTHETIC_STEPS, parse_synthetic
from moe_place.traces.load import load_trace

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ROOT / "bench" / "scenarios"


def run(*argv) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `moe-place *argv`, in process; an exception escaping main()
    (what a user would see as a traceback) fails the test."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exc:  # argparse usage errors
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def one_line_error(code, err, *fragments):
    lines = err.splitlines()
    assert code == 2, err
    assert len(lines) == 1, err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture
def files(tmp_path):
    """A tiny trace, a plan of it, a scenario, a result JSON, and bad things: a folder, a symlink loop."""
    trace = tmp_path / "t.npz"
    np.savez(trace, format_version=1, num_experts=8, top_k=2,
             counts=np.array([[[600, 560, 120, 120, 20, 10, 10, 10], [200, 200, 200, 200, 200, 200, 200, 200]]]))
    plan = tmp_path / "p.json"
    assert run("plan", trace, "--gpus", "4", "--redundant", "4", "--out", plan)[0] == 0
    trace35 = tmp_path / "t35.npz"  # layers 3 and 5 of a model
    np.savez(trace35, format_version=1, num_experts=8, top_k=2, layer_ids=np.array([3, 5]),
             counts=np.array([[[600, 560, 120, 120, 20, 10, 10, 10], [200, 200, 200, 200, 200, 200, 200, 200]]]))
    plan35 = tmp_path / "p35.json"
    assert run("plan", trace35, "--gpus", "4", "--redundant", "4", "--out", plan35)[0] == 0
    folder = tmp_path / "folder"
    folder.mkdir()
    loop = tmp_path / "loop"
    os.symlink(tmp_path / "loop2", loop)
    os.symlink(loop, tmp_path / "loop2")
    return {"trace": trace, "plan": plan, "plan35": plan35, "folder": folder, "loop": loop, "tmp": tmp_path}


# ---------------------------------------------------------------------- output paths
OUTPUTS = [
    ("plan", ["TRACE", "--gpus", "4", "--out"]),
    ("analyze", ["TRACE", "--plot"]),
    ("analyze", ["TRACE", "--output"]),
    ("compare", ["TRACE", "--gpus", "4", "--plot"]),
    ("compare", ["TRACE", "--gpus", "4", "--output-json"]),
    ("predict", [str(SCENARIOS / "c6_hot.toml"), "--output"]),
    ("payback", [str(SCENARIOS / "c9_payback.toml"), "--plot"]),
    ("replay", ["TRACE", "--out"]),
    ("replay", ["TRACE", "--plot"]),
    ("export", ["PLAN", "--engine", "vllm", "--out"]),
    ("bench", ["--dry-run", "--output-json"]),
    ("synth", ["drift:steps=4", "--out"]),
]


@pytest.mark.parametrize("command, argv", OUTPUTS, ids=[f"{c}{a[-1]}" for c, a in OUTPUTS])
@pytest.mark.parametrize("where", ["folder", "missing", "unwritable"])
def test_a_bad_output_path_is_one_line_before_any_work(files, command, argv, where):
    target = {"folder": files["folder"], "missing": files["tmp"] / "nope" / "x.out",
              "unwritable": Path("/proc/moe-place-test.out")}[where]
    args = [files["trace"] if a == "TRACE" else files["plan"] if a == "PLAN" else a for a in argv]
    code, out, err = run(command, *args, target)
    one_line_error(code, err, argv[-1], str(target))
    assert out == "" and not (files["tmp"] / "nope").exists()


def test_report_out_must_be_a_folder(files):
    code, _, err = run("report", files["plan"], "--out", files["plan"])
    one_line_error(code, err, "--out", "a file")


# ---------------------------------------------------------------------- unreadable inputs
INPUTS = [("evaluate", ["INPUT", "TRACE"], "plan file"), ("export", ["INPUT", "--engine", "vllm", "--out", "OUT"], ""),
          ("plan", ["TRACE", "--gpus", "4", "--redundant", "4", "--current", "INPUT", "--out", "OUT"], "plan file"),
          ("predict", ["INPUT"], ".toml or .json"), ("payback", ["INPUT"], ".toml or .json"),
          ("report", ["INPUT", "--out", "REPORT"], "result JSON"), ("analyze", ["INPUT"], "")]


@pytest.mark.parametrize("command, argv, expected", INPUTS, ids=[c for c, _, _ in INPUTS])
@pytest.mark.parametrize("kind, reason", [("folder", "a directory"), ("loop", "a symlink loop"),
                                          ("missing", "no such file")])
def test_an_unreadable_input_names_why(files, command, argv, expected, kind, reason):
    target = files["tmp"] / "absent.json" if kind == "missing" else files[kind]
    args = [target if a == "INPUT" else files["trace"] if a == "TRACE" else files["tmp"] / "o.json" if a == "OUT"
            else files["tmp"] / "rep" if a == "REPORT" else a for a in argv]
    code, _, err = run(command, *args)
    one_line_error(code, err, str(target))
    assert reason in err or (reason == "a directory" and "directory" in err)
    if reason != "no such file":
        assert "no such file" not in err


@pytest.mark.parametrize("command, argv", [("evaluate", ["INPUT", "TRACE"]), ("predict", ["INPUT"]),
                                           ("report", ["INPUT", "--out", "REPORT"])])
def test_permission_denied_is_one_line(files, monkeypatch, command, argv):
    """Running as root reads everything, so the denial is simulated where the file is opened."""
    target = files["tmp"] / "secret.json"
    target.write_text("{}")
    real_open = open

    def deny(path, *args, **kwargs):
        if str(path) == str(target):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", deny)
    args = [target if a == "INPUT" else files["trace"] if a == "TRACE" else files["tmp"] / "rep" if a == "REPORT"
            else a for a in argv]
    code, _, err = run(command, *args)
    one_line_error(code, err, str(target), "permission denied")


def test_report_rejects_sections_of_the_wrong_type(files):
    bad = files["tmp"] / "r.json"
    for body, fragment in (({"env": [], "calibration": {}, "sections": {}}, "env: expected a JSON object"),
                           ({"env": {}, "calibration": {}, "sections": {"gemm": 3}}, "sections.gemm"),
                           ({"env": {}, "calibration": {}, "sections": {"padding": {"rows": 3}}}, "malformed")):
        bad.write_text(json.dumps({"kind": "moe-place-microbench", **body}))
        code, _, err = run("report", bad, "--out", files["tmp"] / "rep")
        one_line_error(code, err, str(bad), fragment)


# ---------------------------------------------------------------------- silently accepted before
def test_options_that_were_silently_accepted(files):
    trace, plan, tmp = files["trace"], files["plan"], files["tmp"]
    cases = [
        (("plan", trace, "--gpus", "4", "--redundant", "4", "--current", plan, "--move-cost", "nan", "--out",
          tmp / "q.json"), ("--move-cost", "finite")),
        (("plan", trace, "--gpus", "4", "--expert-bytes", "100", "--out", tmp / "q.json"), ("--expert-bytes", "budget")),
        (("evaluate", plan, trace, "--quantile", "0.5"), ("--quantile", "--window-objective quantile")),
        (("replay", trace, "--start", "offline", "--window", "5"), ("--window", "at most the 1 steps")),
        (("replay", trace), ("--step-interval", "first call")),
        (("payback", SCENARIOS / "c9_payback.toml", "--saving-ms", "1"), ("--saving-ms", "SCENARIO")),
        (("export", files["plan35"], "--engine", "sglang", "--out", tmp / "s.json", "--dense-layers", "3"),
         ("--dense-layers", "layer 3")),  # model layers 3 and 5 have experts: 3 cannot be dense
        (("bench", "--block-m", "x"), ("--block-m", "positive integer")),
        (("bench", "--reps", "0"), ("--reps",)),
        (("plan", trace, "--gpus", "4", "--solver", "magic", "--out", tmp / "q.json"), ("--solver", "auto")),
    ]
    for argv, fragments in cases:
        code, _, err = run(*argv)
        one_line_error(code, err, *fragments)
    assert not (tmp / "q.json").exists() and not (tmp / "s.json").exists()


def test_a_scenario_with_only_a_model_says_what_is_missing(tmp_path):
    path = tmp_path / "only.toml"
    path.write_text('[model]\npreset = "Qwen3-235B-A22B"\n')
    code, out, err = run("predict", path)
    one_line_error(code, err, str(path), "[workload]", "[payback]", "only [model]")
    assert out == ""


def test_count_files_need_top_k_and_multiples_of_it(tmp_path):
    csv = tmp_path / "c.csv"
    csv.write_text("# num_experts: 8\nstep,layer,expert,count\n0,0,0,3\n0,0,1,2\n0,0,5,1\n")
    code, _, err = run("analyze", csv)
    one_line_error(code, err, str(csv), "top_k", "--top-k")
    code, _, err = run("analyze", csv, "--top-k", "4")
    one_line_error(code, err, "step 0, layer 0", "multiple of top_k = 4", "got 6")
    assert run("analyze", csv, "--top-k", "3")[0] == 0


def test_plan_files_are_strict_json(files):
    text = files["plan"].read_text()
    assert "NaN" not in text and "Infinity" not in text
    document = json.loads(text)
    document["report"]["layers"][0]["gap"] = float("nan")
    bad = files["tmp"] / "nan.json"
    bad.write_text(json.dumps(document))  # Python writes NaN as a bare token
    code, _, err = run("evaluate", bad, files["trace"])
    one_line_error(code, err, str(bad), "strict JSON", "NaN")


# ---------------------------------------------------------------------- unbounded work
def test_unbounded_work_has_a_documented_limit(tmp_path):
    code, _, err = run("replay", "--synthetic", "drift:steps=100000000000")
    one_line_error(code, err, "--synthetic steps", f"at most {MAX_SYNTHETIC_STEPS:,}")
    code, _, err = run("replay", "--synthetic", "drift:steps=900000,layers=58,experts=256")
    one_line_error(code, err, "steps x layers x experts")
    scenario = tmp_path / "p.toml"
    scenario.write_text((SCENARIOS / "c9_payback.toml").read_text().replace("max_batches = 64", "max_batches = 100000000"))
    code, _, err = run("payback", scenario)
    one_line_error(code, err, "max_batches", f"[1, {MAX_PAYBACK_BATCHES:,}]")
    assert "100,000" in build_parser()._subparsers._group_actions[0].choices["payback"].format_help()


# ---------------------------------------------------------------------- help
def test_every_option_says_what_it_does_and_its_default():
    import argparse

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(COMMANDS)
    missing = []
    for name, command in sub.choices.items():
        for action in command._actions:
            if isinstance(action, (argparse._HelpAction, argparse._StoreTrueAction)):
                continue
            text = (action.help or "").lower()
            if not text or (action.option_strings and not action.required
                            and "default" not in text and "required" not in text):
                missing.append(f"{name} {action.option_strings or action.dest}")
    assert not missing, missing


def test_help_lists_the_registry_solvers_and_the_catalog_parts():
    from moe_place.cli.options import SOLVER_CHOICES
    from moe_place.cost.hardware import BUILTIN_PARTS
    from moe_place.cost.models import PRESETS
    from moe_place.solvers import solver_names

    assert set(SOLVER_CHOICES) == {"auto", *solver_names()}
    help_text = {name: command.format_help() for name, command in
                 build_parser()._subparsers._group_actions[0].choices.items()}
    assert all(name in " ".join(help_text["plan"].split()) for name in SOLVER_CHOICES)
    replay = " ".join(help_text["replay"].split())
    assert all(part in replay for part in BUILTIN_PARTS["gpu"]) and all(p in replay for p in PRESETS)


def test_a_registry_and_its_option_list_are_checked_at_import():
    import moe_place.cli.shared  # noqa: F401  (checks every option list against its registry at import)
    from moe_place.errors import check_registry

    check_registry("--solver", ("fast", "auto"), ("auto", "fast"))   # the order does not matter
    with pytest.raises(ImportError, match="--solver.*'cpsat'"):
        check_registry("--solver", ("fast", "cpsat"), ("fast",))     # a registered solver the options lack


def test_synth_writes_a_trace_every_command_reads(tmp_path):
    path = tmp_path / "s.npz"
    code, _, err = run("synth", "drift:steps=6,layers=2,experts=16,seed=3", "--out", path)
    assert code == 0 and str(path) in err
    code, out, _ = run("analyze", path, "--format", "json")
    assert code == 0 and json.loads(out)["steps"] == 6 and json.loads(out)["model"] == "synthetic"
    # the file holds the generator's counts, step by step: `replay FILE` sees what `replay --synthetic SPEC` sees
    np.testing.assert_array_equal(load_trace(path).step_counts(),
                                  parse_synthetic("drift:steps=6,layers=2,experts=16,seed=3")[0])


# ---------------------------------------------------------------------- property test
def _fixture_files(tmp: Path) -> dict[str, Path]:
    """Inputs good and bad, made once per example (names are what the strategies pick from)."""
    made = {}
    made["trace"] = tmp / "t.npz"
    np.savez(made["trace"], format_version=1, num_experts=8, top_k=2,
             counts=np.array([[[600, 560, 120, 120, 20, 10, 10, 10]], [[200, 200, 200, 200, 200, 200, 200, 200]]]))
    made["plan"] = tmp / "p.json"
    if not made["plan"].exists():
        main(["plan", str(made["trace"]), "--gpus", "4", "--redundant", "4", "--out", str(made["plan"])])
    made["scenario"] = SCENARIOS / "c6_hot.toml"
    made["payback"] = SCENARIOS / "c9_payback.toml"
    made["folder"] = tmp / "dir"
    made["folder"].mkdir(exist_ok=True)
    made["empty"] = tmp / "empty.json"
    made["empty"].write_text("")
    made["garbage"] = tmp / "garbage.npz"
    made["garbage"].write_bytes(b"PK\x03\x04 not a zip at all")
    made["json_list"] = tmp / "list.json"
    made["json_list"].write_text("[1, 2, 3]")
    made["json_nan"] = tmp / "nan.json"
    made["json_nan"].write_text('{"counts": [[[NaN, 1]]], "top_k": 1}')
    made["json_typo"] = tmp / "typo.json"  # an unknown key, close to a known one
    made["json_typo"].write_text('{"counts": [[[3, 1]]], "top_K": 2}')
    made["csv"] = tmp / "c.csv"
    made["csv"].write_text("step,layer,expert,count\n0,0,0,3\n0,0,1,1\n")
    made["csv_huge_id"] = tmp / "huge.csv"  # an expert id that once sized a 7 TiB array
    made["csv_huge_id"].write_text("step,layer,expert,count\n0,0,999999999999,2\n0,0,1,2\n")
    made["damaged"] = tmp / "damaged.npz"  # a stored topk_ids member whose bytes no longer match its CRC
    if not made["damaged"].exists():
        ids = np.tile(np.array([[[0, 1]], [[2, 3]]], dtype=np.int16), (50, 1, 1))
        buffer = io.BytesIO()
        np.savez(buffer, format_version=1, num_experts=8, top_k=2, topk_ids=ids)
        data = bytearray(buffer.getvalue())
        at = bytes(data).find(ids.tobytes())
        data[at:at + 2] = np.int16(5).tobytes()  # token 0's first id 0 -> 5: in range, still distinct
        made["damaged"].write_bytes(bytes(data))
    made["scenario_typo"] = tmp / "typo.toml"  # [pipeline] micro_batchez: ran with the default once
    made["scenario_typo"].write_text((SCENARIOS / "c7_pipeline.toml").read_text().replace(
        "micro_batches", "micro_batchez"))
    made["missing"] = tmp / "missing.json"
    return made


INPUT_NAMES = ["trace", "plan", "scenario", "payback", "folder", "empty", "garbage", "json_list", "json_nan",
               "json_typo", "csv", "csv_huge_id", "damaged", "scenario_typo", "missing"]
# output files: bad paths, and fresh files whose suffix may or may not name what is written
OUTPUT_NAMES = ["fresh.json", "fresh.png", "fresh.npz", "fresh.csv", "fresh.txt", "fresh.pt", "folder", "missing_dir",
                "proc"]
VALUES = ["0", "-1", "1", "2", "4", "5", "x", "nan", "inf", "1e9", "0.5", "", "0-3", "0-99999999999", "8,16",
          "1000", "99999999999"]
OPTIONS = {
    "analyze": ["--ep", "--layers", "--top-n", "--window", "--top-k", "--format"],
    "plan": ["--gpus", "--nodes", "--redundant", "--time-limit", "--layers", "--solver", "--seed", "--groups",
             "--expert-memory-budget", "--expert-bytes", "--max-moved-slots", "--move-cost", "--split", "--jobs"],
    "evaluate": ["--split", "--windows", "--window-objective", "--quantile", "--top-k", "--model", "--seed"],
    "compare": ["--gpus", "--redundant", "--solvers", "--time-limit", "--jobs"],
    "predict": ["--format"],
    "payback": ["--saving-ms", "--alpha-us", "--batches", "--max-batches", "--topology", "--case", "--model",
                "--format"],
    "export": ["--engine", "--num-model-layers", "--dense-layers", "--format"],
    "replay": ["--gpus", "--redundant", "--window", "--controller", "--layers", "--max-moved-slots", "--hardware",
               "--synthetic", "--min-gain", "--step-interval"],
    "synth": [],
    "report": [],
}
POSITIONALS = {"analyze": 1, "plan": 1, "evaluate": 2, "compare": 1, "predict": 1, "payback": 1, "export": 1,
               "replay": 1, "synth": 0, "report": 1}
RIGHT_INPUTS = {"analyze": ["trace"], "plan": ["trace"], "evaluate": ["plan", "trace"], "compare": ["trace"],
                "predict": ["scenario"], "payback": ["payback"], "export": ["plan"], "replay": ["trace"], "synth": [],
                "report": ["folder"]}
# the output flags: --out everywhere, and the older names still accepted
OUTPUT_OPTIONS = {"analyze": ["--out", "--output", "--plot"], "plan": ["--out"], "compare": ["--out", "--output-json",
                  "--plot"], "predict": ["--out", "--output"], "payback": ["--out", "--output", "--plot"],
                  "export": ["--out"], "replay": ["--out", "--plot"], "synth": ["--out"], "report": ["--out"]}
MAGIC = {".json": b"{", ".png": b"\x89PNG", ".npz": b"PK"}  # what a file of each suffix starts with


@st.composite
def command_lines(draw):
    command = draw(st.sampled_from(sorted(OPTIONS)))
    right = RIGHT_INPUTS[command]  # half the time the input the command wants, so deeper paths run too
    positionals = [("input", draw(st.sampled_from([right[i]] * len(INPUT_NAMES) + INPUT_NAMES)))
                   for i in range(POSITIONALS[command])]
    if command == "synth":
        positionals = [("literal", draw(st.sampled_from(["drift:steps=3", "drift:steps=x", "drift:top_k=99",
                                                          "nope:1", "drift:steps=3,layers=0", "drift:stepz=3",
                                                          "drift:steps=3,domains=99999999999"])))]
    options = draw(st.lists(st.tuples(st.sampled_from(OPTIONS[command]), st.sampled_from(VALUES)), max_size=2)
                   ) if OPTIONS[command] else []
    if command not in OUTPUT_OPTIONS:
        return command, positionals, options, (None, None)
    required = command in ("plan", "export", "synth")
    flag = "--out" if required else draw(st.sampled_from(OUTPUT_OPTIONS[command]))
    right = "fresh.png" if flag == "--plot" else "fresh.npz" if command == "synth" else "fresh.json"
    output = draw(st.sampled_from([right] * len(OUTPUT_NAMES) + OUTPUT_NAMES + ([] if required else [None])))
    return command, positionals, options, (flag, output)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(command_lines())
def test_no_command_line_ends_in_a_traceback(tmp_path, line):
    command, positionals, options, (flag, output) = line
    made = _fixture_files(tmp_path)
    (tmp_path / "out").mkdir(exist_ok=True)
    outputs = {"folder": made["folder"], "missing_dir": tmp_path / "no" / "such" / "dir" / "x.out",
               "proc": Path("/proc/moe-place-x.out"),
               **{name: tmp_path / "out" / name for name in OUTPUT_NAMES if name.startswith("fresh")}}
    argv = [command]
    argv += [str(made[name]) if kind == "input" else name for kind, name in positionals]
    for option, value in options:
        argv += [option, value]
    if output is not None:
        argv += [flag, str(outputs[output])]
    if command in ("plan", "compare") and "--gpus" not in argv:
        argv += ["--gpus", "4"]
    if command == "replay":
        argv += ["--no-progress"]
    for name in OUTPUT_NAMES:  # a file left by an earlier example would hide a new one
        if name.startswith("fresh"):
            outputs[name].unlink(missing_ok=True)
    before = set(tmp_path.rglob("*"))
    code, _, err = run(*argv)
    event(f"{command} exit {code}")
    assert code in (0, 1, 2), (argv, code, err)
    assert "Traceback" not in err, (argv, err)
    if code == 2:
        assert len(err.strip().splitlines()) <= 1, (argv, err)
        written = set(tmp_path.rglob("*")) - before
        assert not written, (argv, written)  # nothing half-written when the command failed
    assert not [p for p in tmp_path.rglob(".*.tmp")], argv  # atomic writes leave no temporary file
    if code == 0 and output is not None and output.startswith("fresh") and command != "report":
        path = outputs[output]
        assert path.exists(), argv
        magic = MAGIC.get(path.suffix)  # the suffix says what was written
        if magic is not None:
            assert path.read_bytes().startswith(magic), (argv, path.read_bytes()[:8])
        if path.suffix == ".json":
            json.loads(path.read_text())
