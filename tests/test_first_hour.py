"""The first hour of a new user (issue 35): what README's commands lead to on a fresh clone.

Each test is one rough edge a user hit, run as the user ran it where that is cheap (subprocesses,
the CLI's `main`), with the one-line message it must now give.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SITE = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]  # numpy & co., without .pth files


def _python(code: str, cwd: Path, *path: Path | str) -> subprocess.CompletedProcess:
    """`python -S -c code` in `cwd`: no site module, so no editable-install finder (its .pth file is not
    read); `sys.path` is `cwd`'s folder first (as for any `python -c` in a checkout), then `path`, then
    this interpreter's site-packages for the dependencies."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, path), *SITE])}
    return subprocess.run([sys.executable, "-S", "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


# ---------------------------------------------------------------------- the checkout shadows the install
WHERE = ("import sys, moe_place.solvers, moe_place.kernels, moe_place.traces.bundled as b; "
         "from moe_place.eplb import rebalance_experts; "
         "print(moe_place.solvers.__file__); print(moe_place.kernels.__file__); print(b.data_dir()); "
         "print(sum(type(f).__name__ == '_CheckoutFolders' for f in sys.meta_path))")


def test_the_drop_in_imports_in_the_checkout_without_the_installed_mapping():
    """After `pip install '.[solver]'` (not editable), Python started in the checkout imports the
    checkout's `moe_place/`, where pip's mapping of solvers/, kernels/, traces/ does not apply."""
    done = _python(WHERE, ROOT)
    assert done.returncode == 0, done.stderr
    solvers, kernels, data, finders = done.stdout.split("\n")[:4]
    assert Path(solvers) == ROOT / "solvers" / "__init__.py" and Path(kernels) == ROOT / "kernels" / "__init__.py"
    assert Path(data) == ROOT / "traces" / "data" and finders == "1"


def test_an_installed_layout_gets_no_finder(tmp_path):
    """Installed (or linked by bench/engine_overlay.sh), the three folders are inside the package."""
    site = tmp_path / "site"
    (site / "moe_place").mkdir(parents=True)
    shutil.copy(ROOT / "moe_place" / "__init__.py", site / "moe_place" / "__init__.py")
    for name in ("kernels", "solvers", "traces"):
        (site / "moe_place" / name).mkdir()
        (site / "moe_place" / name / "__init__.py").write_text(f"WHERE = 'installed {name}'\n")
    (tmp_path / "pyproject.toml").write_text("")  # even beside a pyproject.toml: the folders are there
    code = ("import sys, moe_place.solvers as s; print(s.WHERE); "
            "print(sum(type(f).__name__ == '_CheckoutFolders' for f in sys.meta_path))")
    done = _python(code, tmp_path, site)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["installed", "solvers", "0"]


@pytest.mark.slow
def test_a_real_install_and_the_checkout_beside_it(tmp_path):
    """pip builds and installs (not editable) a copy of the checkout; Python started in the checkout
    uses the checkout (mapped folders included), started elsewhere the installed copy."""
    source = tmp_path / "src"  # a copy: pip builds a local folder in place (build/, *.egg-info)
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("moe_place", "solvers", "kernels", "traces"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "installed"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--no-index", "--target", str(target), str(source)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    in_checkout = _python(WHERE, ROOT, target)
    assert in_checkout.returncode == 0, in_checkout.stderr
    assert in_checkout.stdout.split("\n")[0] == str(ROOT / "solvers" / "__init__.py")
    elsewhere = _python(WHERE, tmp_path, target)
    assert elsewhere.returncode == 0, elsewhere.stderr
    lines = elsewhere.stdout.split("\n")
    assert lines[0] == str(target / "moe_place" / "solvers" / "__init__.py") and lines[3] == "0"
    assert Path(lines[2]) == target / "moe_place" / "traces" / "data"


# ---------------------------------------------------------------------- helpers for the CLI cases
def _cli(capsys, *argv) -> tuple[int, str, str]:
    from moe_place.cli.main import main

    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _one_line_error(code: int, err: str, *fragments: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


@pytest.fixture
def steps_trace(tmp_path):
    """3 steps (recorded batches, say), 2 layers of 16 experts, top-2, as counts."""
    import numpy as np

    counts = 2 * np.random.default_rng(3).zipf(1.5, (3, 2, 16)).clip(max=400)
    path = tmp_path / "three.npz"
    np.savez(path, format_version=1, num_experts=16, top_k=2, counts=counts,
             step_names=np.array(["monday", "tuesday", "wednesday"]))
    return path, counts


# ---------------------------------------------------------------------- one size syntax for memory options
def test_every_memory_option_takes_sizes_with_units_and_decimals(steps_trace, tmp_path, capsys):
    """`plan --expert-memory-budget 1.4GiB` was refused ("expected a positive integer") where offload took 12GiB."""
    path, _ = steps_trace
    by_unit, by_bytes = tmp_path / "unit.json", tmp_path / "bytes.json"
    code, _, err = _cli(capsys, "plan", path, "--gpus", "4", "--expert-memory-budget", "1.4GiB",
                        "--expert-bytes", "100MiB", "--out", by_unit, "--no-progress")
    assert code == 0, err
    code, _, err = _cli(capsys, "plan", path, "--gpus", "4", "--expert-memory-budget", str(int(1.4 * 2**30)),
                        "--expert-bytes", str(100 * 2**20), "--out", by_bytes, "--no-progress")
    assert code == 0, err
    import json

    unit, plain = json.loads(by_unit.read_text()), json.loads(by_bytes.read_text())
    assert unit["phy2log"] == plain["phy2log"] and unit["budget"] == plain["budget"]
    assert unit["budget"]["gpu_budget_bytes"] == 1503238553 and unit["budget"]["expert_bytes"] == 104857600
    for option, value in (("--expert-memory-budget", "0"), ("--expert-memory-budget", "lots"),
                          ("--expert-bytes", "0.1"), ("--max-replica-bytes", "-1GiB")):
        code, _, err = _cli(capsys, "plan", path, "--gpus", "4", "--redundant", "auto" if "replica" in option else "0",
                            f"{option}={value}", "--out", tmp_path / "x.json")
        _one_line_error(code, err, option)


# ---------------------------------------------------------------------- trace files that are not what they say
def _zeros(path, size):
    with open(path, "wb") as fh:
        fh.truncate(size)  # sparse: no disk space taken
    return path


def _gzip_of(source, path):
    import gzip

    path.write_bytes(gzip.compress(Path(source).read_bytes()))
    return path


def _cut(source, path):
    path.write_bytes(Path(source).read_bytes()[:1000])
    return path


def _pickle(path):
    import pickle

    path.write_bytes(pickle.dumps({"logical_count": [[1, 2]]}, protocol=4))
    return path


QWEN = ROOT / "traces" / "data" / "qwen3-30b-a3b_prefill_topk.npz"
# file -> (make(path), what the one error line must say the file is)
NOT_WHAT_THEY_SAY = {
    "gzip.npz": (lambda p: _gzip_of(QWEN, p), "got gzip-compressed data, not a zip archive"),
    "sparse.npz": (lambda p: _zeros(p, 2 << 30), "got 2.0 GiB starting with zero bytes"),
    "cut.npz": (lambda p: _cut(QWEN, p), "a zip archive without its end record (1000 bytes): cut short"),
    "padded.npz": (lambda p: p.write_bytes(QWEN.read_bytes() + bytes(70_000)),  # its end record 70 KB before the end
                   "cut short, as by an interrupted download or copy, or padded with bytes after its end"),
    "text.pt": (lambda p: p.write_text("hello world\n"), "expected a torch.save file (a zip archive, or "
                "torch's legacy format), got text starting 'hello world'"),
    "pickle.pt": (_pickle, "got a plain Python pickle (protocol 4), not a torch.save file"),
    "gzip.pt": (lambda p: _gzip_of(QWEN, p), "expected a torch.save file (a zip archive, or torch's legacy format), "
                "got gzip-compressed data"),
    "binary.csv": (lambda p: _gzip_of(QWEN, p), "expected a csv text file, got gzip-compressed data"),
}


@pytest.mark.parametrize("name", sorted(NOT_WHAT_THEY_SAY))
def test_a_trace_file_that_is_not_what_its_name_says_is_named_for_what_it_is(tmp_path, capsys, name):
    make, fragment = NOT_WHAT_THEY_SAY[name]
    path = tmp_path / name
    make(path)
    code, _, err = _cli(capsys, "analyze", path)
    _one_line_error(code, err, str(path), fragment)


def test_a_torch_file_of_python_objects_names_the_object(tmp_path, capsys):
    """torch's own message is a page of advice, cut mid-word before ("with `weights_onl")."""
    torch = pytest.importorskip("torch")
    path = tmp_path / "objects.pt"
    torch.save({"logical_count": torch.zeros(2, 3), "when": __import__("datetime").date(2026, 1, 1)}, path)
    code, _, err = _cli(capsys, "analyze", path)
    line = _one_line_error(code, err, str(path), "expected a torch.save file of tensors, dicts, lists and numbers",
                           "got a file that also holds the Python object datetime.date")
    assert "weights_onl" not in line.replace("weights_only=True", "")


def test_a_long_exception_text_is_cut_at_a_word():
    from moe_place.traces.npz_member import REASON_CHARS, error_reason

    reason = error_reason(RuntimeError("word " * 100 + "\n(2) more advice"))
    assert len(reason) <= REASON_CHARS + 3 and reason.endswith("word...") and "advice" not in reason


def test_a_renamed_copy_of_a_bundled_trace_loads_as_the_bundled_trace(tmp_path):
    import numpy as np

    from moe_place.traces import load_trace

    copy = tmp_path / "my-trace.npz"
    shutil.copy(QWEN, copy)
    original, renamed = load_trace(QWEN), load_trace(copy)
    assert renamed.meta == original.meta and renamed.meta.model == "Qwen/Qwen3-30B-A3B-Instruct-2507"
    np.testing.assert_array_equal(renamed.step_counts(), original.step_counts())
    changed = tmp_path / "qwen3-30b-a3b_prefill_topk.npz"  # the bundled name, other bytes: not the recording
    np.savez(changed, ep_states=np.zeros((4, 48, 8), dtype=np.int16))
    with pytest.raises(Exception, match="exactly one of the arrays 'counts' or 'topk_ids'"):
        load_trace(changed)


def test_every_bundled_file_is_recognised_by_its_bytes():
    from moe_place.io import file_sha256
    from moe_place.traces.bundled import BUNDLED, bundled_info, bundled_path

    for name, info in BUNDLED.items():
        path = bundled_path(name)
        assert (path.stat().st_size, file_sha256(path)) == (info.size, info.sha256)
        assert bundled_info(path) is info


# ---------------------------------------------------------------------- --no-progress, threads, plan-file keys
LONG_WORK = ("analyze", "plan", "compare", "evaluate", "replay")  # offload: its own owner (issue 35 note)


@pytest.mark.parametrize("command", LONG_WORK)
def test_every_long_running_subcommand_takes_no_progress(command):
    from moe_place.cli.main import build_parser

    argv = {"analyze": ["T"], "plan": ["T", "--gpus", "4", "--out", "p.json"], "compare": ["T", "--gpus", "4"],
            "evaluate": ["P", "T"], "replay": ["T"]}[command]
    args = build_parser(command).parse_args([command, *argv, "--no-progress"])
    assert args.no_progress is True


class _Terminal(__import__("io").StringIO):
    def isatty(self) -> bool:
        return True


def test_analyze_draws_its_bar_while_streaming_unless_told_not_to(tmp_path, monkeypatch, capsys):
    import numpy as np

    from moe_place.traces import load as load_module

    ids = np.argsort(np.random.default_rng(0).random((5000, 2, 16)), axis=2)[:, :, :2].astype(np.int16)
    path = tmp_path / "tokens.npz"
    np.savez(path, num_experts=16, top_k=2, topk_ids=ids)
    monkeypatch.setattr(load_module, "DEFAULT_MAX_TOKEN_BYTES", 0)  # streamed: the long part of a large trace
    for extra, drawn in (((), True), (("--no-progress",), False)):
        terminal = _Terminal()
        monkeypatch.setattr(sys, "stderr", terminal)
        code, _, _ = _cli(capsys, "analyze", path, "--ep", "4", *extra)
        assert code == 0
        assert ("read tokens.npz [" in terminal.getvalue()) is drawn
        assert ("5000/5000 tokens" in terminal.getvalue()) is drawn


def test_thread_count_above_the_cores_is_refused_as_jobs_is(steps_trace, tmp_path, monkeypatch, capsys):
    """`MOE_PLACE_THREADS=10000` was taken as it came, where `--jobs 99` is refused."""
    from moe_place.cores import usable_cores

    path, _ = steps_trace
    too_many = str(usable_cores() + 1)
    code, _, jobs_err = _cli(capsys, "plan", path, "--gpus", "4", "--jobs", too_many, "--out", tmp_path / "p.json")
    expected = f"expected an integer in [1, {usable_cores()}] (the cores this process may use)"
    _one_line_error(code, jobs_err, "--jobs", expected)
    for value in (too_many, "10000"):
        monkeypatch.setenv("MOE_PLACE_THREADS", value)
        code, _, err = _cli(capsys, "analyze", path)
        _one_line_error(code, err, "MOE_PLACE_THREADS", expected, f"got '{value}'")
    monkeypatch.setenv("MOE_PLACE_THREADS", str(usable_cores()))
    assert _cli(capsys, "analyze", path)[0] == 0


@pytest.fixture
def plan_file(steps_trace, tmp_path, capsys):
    path, _ = steps_trace
    out = tmp_path / "plan.json"
    assert _cli(capsys, "plan", path, "--gpus", "4", "--redundant", "4", "--out", out, "--no-progress")[0] == 0
    return out


def _with_key(plan_file: Path, section: str | None, key: str) -> Path:
    import json

    document = json.loads(plan_file.read_text())
    (document if section is None else document[section])[key] = 1
    bad = plan_file.with_name(f"bad-{key}.json")
    bad.write_text(json.dumps(document))
    return bad


# every reader of a plan file, given (plan, trace, folder): a command line, or a call of the library
CLI_READERS = {
    "evaluate": lambda plan, trace, tmp: ["evaluate", plan, trace],
    "export": lambda plan, trace, tmp: ["export", plan, "--engine", "sglang", "--out", tmp / "loc.json"],
    "plan --current": lambda plan, trace, tmp: ["plan", trace, "--gpus", "4", "--redundant", "4", "--current", plan,
                                               "--out", tmp / "new.json"],
    "predict (a scenario's workload)": lambda plan, trace, tmp: ["predict", _scenario(tmp, trace, plan)],
}


def _scenario(folder: Path, trace: Path, plan: Path) -> Path:
    path = folder / "s.toml"
    path.write_text(f'[model]\npreset = "Qwen3-30B-A3B"\n[topology]\nspec = "1 node x 4 H100"\n[workload]\n'
                    f'trace = "{trace}"\nplan = "{plan}"\n')
    return path


def _vllm_static_plan(plan):
    from moe_place.engines.vllm_policy import static_placement

    return static_placement(plan, 2, 16, 20, 4)


def _read_plan(plan):
    from moe_place.planfile import read_plan

    return read_plan(plan)


LIBRARY_READERS = {"read_plan": _read_plan, "vLLM static plan": _vllm_static_plan}


@pytest.mark.parametrize("reader", sorted(CLI_READERS) + sorted(LIBRARY_READERS))
def test_a_plan_file_with_an_unknown_key_is_refused_by_every_reader(plan_file, steps_trace, tmp_path, capsys, reader):
    from moe_place.errors import InputError

    trace, _ = steps_trace
    bad = _with_key(plan_file, None, "budjet")  # a misspelt budget section would be dropped silently
    fragments = (f"{bad}: budjet: expected one of the keys", "(did you mean budget?)", "got an unknown key")
    if reader in CLI_READERS:
        code, _, err = _cli(capsys, *CLI_READERS[reader](bad, trace, tmp_path))
        _one_line_error(code, err, *fragments)
        return
    with pytest.raises(InputError) as caught:
        LIBRARY_READERS[reader](bad)
    assert all(fragment in str(caught.value) for fragment in fragments), str(caught.value)


def test_the_plan_readers_name_an_unknown_key_inside_the_budget_section(plan_file, tmp_path):
    import json

    from moe_place.errors import InputError
    from moe_place.planfile import read_plan

    document = json.loads(plan_file.read_text())
    document["budget"] = {"expert_bytes": 1, "gpu_budget_bytes": 10, "slots_per_gpu": [5, 5],
                          "phy2log": document["phy2log"], "slot_per_gpu": [5, 5]}
    bad = tmp_path / "budget.json"
    bad.write_text(json.dumps(document))
    with pytest.raises(InputError, match=r"budget\.slot_per_gpu: expected one of the keys .*did you mean slots_per_gpu"):
        read_plan(bad)


# ---------------------------------------------------------------------- replay, and the fold split
def test_replay_of_a_few_recorded_batches_says_why_and_what_runs(capsys):
    """README's `replay TRACE ... --step-interval 100 --window 100` on the bundled 3-step trace exited 2
    blaming --step-interval; the line now says the trace is too short and gives a command that runs."""
    cluster = ["--gpus", "32", "--nodes", "4", "--redundant", "32", "--step-interval", "100", "--window", "100"]
    code, _, err = _cli(capsys, "replay", QWEN, *cluster)
    line = _one_line_error(code, err, f"{QWEN}: expected a trace of at least 25 steps", "got 3 steps",
                           "each recorded batch is one step")
    suggested = line.split("run: ", 1)[1]
    assert suggested == ("moe-place replay --synthetic drift:steps=6000,seed=0 --gpus 32 --nodes 4 --redundant 32 "
                         "--step-interval 100 --window 100")
    code, out, err = _cli(capsys, *suggested.split()[1:], "--no-progress", "--format", "json", "--no-per-step")
    import json

    result = json.loads(out)
    assert code == 0 and result["steps"] == 6000 and result["rebalances"] > 0, err


def test_a_plan_is_judged_out_of_sample_on_the_steps_it_never_saw(steps_trace, tmp_path, capsys):
    """`evaluate PLAN OTHER_TRACE` needs a second trace; `--steps` splits one file by recorded batch."""
    import json

    import numpy as np

    path, counts = steps_trace
    plan = tmp_path / "plan01.json"
    code, _, err = _cli(capsys, "plan", path, "--gpus", "4", "--redundant", "4", "--steps", "0-1", "--out", plan,
                        "--no-progress")
    assert code == 0, err
    assert json.loads(plan.read_text())["inputs"]["options"]["steps"] == [0, 1]
    alone = tmp_path / "wednesday.npz"  # the held-out step as a file of its own: the oracle
    np.savez(alone, format_version=1, num_experts=16, top_k=2, counts=counts[2:3])
    judged = {}
    for name, argv in (("by position", [path, "--steps", "2"]), ("by name", [path, "--steps", "wednesday"]),
                       ("its own file", [alone]), ("in sample", [path, "--steps", "monday,tuesday"])):
        code, out, err = _cli(capsys, "evaluate", plan, *argv, "--format", "json")
        assert code == 0, err
        judged[name] = (json.loads(out), err)
    held_out = [row["max_gpu_load"] for row in judged["its own file"][0]["layers"]]
    for name in ("by position", "by name"):
        report, err = judged[name]
        assert [row["max_gpu_load"] for row in report["layers"]] == held_out
        assert report["sample"] == "out of sample: the plan was made on steps 0,1 of this trace, judged on step 2"
        assert f"evaluate: note: {report['sample']}" in err
    assert judged["its own file"][0]["sample"].startswith("out of sample: the plan was made on another trace file")
    assert judged["in sample"][0]["sample"].startswith("in sample: the plan was made on steps 0,1")
    code, _, err = _cli(capsys, "evaluate", plan, path, "--steps", "3")
    _one_line_error(code, err, "--steps: expected steps of the trace: positions 0-2 or names (monday, tuesday, "
                               "wednesday)", "got 3")


# ---------------------------------------------------------------------- benchmarks say a miss on stderr
def test_the_drop_in_bench_names_a_missed_target_on_stderr():
    """bench_dropin printed NOT MET on stdout only (a redirected table hid it)."""
    code = ("import sys; sys.path.insert(0, 'bench'); import bench_dropin as b; "
            "b.SHAPES = b.SHAPES[:1]; b.STALL_TARGET_S = 0.0; sys.exit(b.main(['--repeats', '1']))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    assert "NOT MET" in done.stdout.splitlines()[-1]
    assert done.stderr.startswith("bench_dropin: 1 target missed: worst drop-in call ")
    assert "> 0.0 s (DeepSeek-V3 EP32 r1, DeepSeek-V3 EP32 random)" in done.stderr


def test_no_bench_script_exits_1_without_naming_the_miss():
    """Every benchmark with targets ends through `missed_targets` (one stderr line, exit 1): none
    returns a bare 1 of its own."""
    import ast

    bare, mains = [], 0
    for script in sorted((ROOT / "bench").glob("*.py")):
        tree = ast.parse(script.read_text())
        main = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main"]
        mains += len(main)
        for node in (n for function in main for n in ast.walk(function)):
            values = [node.value] if isinstance(node, ast.Return) and node.value is not None else []
            values += [v for v in values if isinstance(v, ast.IfExp) for v in (v.body, v.orelse)]
            if any(isinstance(v, ast.Constant) and v.value == 1 for v in values):
                bare.append(f"{script.name}:{node.lineno}")
    assert not bare and mains >= 10, (bare, mains)


def test_missed_targets_is_one_line_and_the_exit_code(capsys):
    from bench_modules import load

    missed_targets = load("records").missed_targets  # bench/records.py
    assert missed_targets("bench_x", []) == 0 and capsys.readouterr().err == ""
    assert missed_targets("bench_x", ["a"]) == 1 and capsys.readouterr().err == "bench_x: 1 target missed: a\n"
    assert missed_targets("bench_x", ["a <= 1 (got 2)", "b"]) == 1
    assert capsys.readouterr().err == "bench_x: 2 targets missed: a <= 1 (got 2); b\n"


# ---------------------------------------------------------------------- the drop-in without torch
def test_the_drop_in_takes_numpy_loads_without_torch():
    """Called with numpy arrays where torch is absent, the drop-in ended in `ModuleNotFoundError: torch`."""
    code = ("import sys, json; sys.modules['torch'] = None\n"  # `import torch` raises ImportError
            "import numpy as np\n"
            "from moe_place.eplb import rebalance_experts\n"
            "w = np.array([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],"
            " [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])\n"
            "out = {}\n"
            "for solver in ('quick', 'eplb'):\n"
            "    maps = rebalance_experts(w, 16, 4, 2, 8, solver=solver)\n"
            "    assert all(type(m) is np.ndarray and m.dtype == np.int64 for m in maps)\n"
            "    out[solver] = [m.tolist() for m in maps]\n"
            "print(json.dumps(out))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    import json

    got = json.loads(done.stdout)
    # DeepSeek EPLB's README example, exactly (no ties there: the stable sort agrees with torch's)
    assert got["eplb"][0] == [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                              [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
    torch = pytest.importorskip("torch")
    from moe_place.eplb import rebalance_experts

    weight = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                           [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
    for solver in ("quick", "eplb"):
        with_torch = rebalance_experts(weight, 16, 4, 2, 8, solver=solver)
        assert all(isinstance(m, torch.Tensor) for m in with_torch)  # tensors in, tensors out, as engines call it
        assert [m.tolist() for m in with_torch] == got[solver]


# ---------------------------------------------------------------------- compare --plot
def test_compare_plot_has_a_title_and_lines_that_do_not_hide_each_other(steps_trace, tmp_path, capsys):
    from moe_place.cli.compare import plot_figure

    path, _ = steps_trace
    png = tmp_path / "cmp.png"
    code, _, err = _cli(capsys, "compare", path, "--gpus", "4", "--redundant", "4", "--solvers", "eplb,fast,auto",
                        "--plot", png, "--no-progress")
    assert code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", err
    rows = {name: {"layers": [{"max_gpu_load": load} for load in loads]}
            for name, loads in (("eplb", (12, 11)), ("fast", (10, 10)), ("cpsat", (10, 10)))}
    fig = plot_figure("compare three.npz: 2 layers", [0, 1], rows, [10, 10])
    ax = fig.axes[0]
    assert ax.get_title() == "compare three.npz: 2 layers"
    styles = [(line.get_marker(), str(line.get_linestyle())) for line in ax.get_lines()[:3]]
    assert len(set(styles)) == 3  # cpsat drawn over fast stays visible: another marker and dash
    labels = [text.get_text() for text in ax.get_legend().get_texts()]
    assert labels == ["eplb", "fast", "cpsat (the same as fast on every layer)"]
