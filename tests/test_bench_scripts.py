"""Every benchmark script starts (`--help`), never overwrites an existing record unless `--force`,
and a failing benchmark says why on stderr. The scripts are run as a user runs them (subprocesses
from the repository root), so a broken import shows here and not only when someone benchmarks."""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# modules of bench/ that scripts and tests import, not scripts themselves, with the reason
MODULES = {"records.py": "the record plumbing every script imports: output options, exit codes, provenance"}
PY_SCRIPTS = sorted(p.name for p in (ROOT / "bench").glob("*.py") if p.name not in MODULES)
SH_SCRIPTS = sorted(p.name for p in (ROOT / "bench").glob("*.sh"))
# scripts without the shared record options, with the reason
OWN_OUTPUT_OPTIONS = {"check_sglang_kt_stats.py": "a check: it writes no file",
                      "check_sglang_plugin.py": "a check against a real SGLang: it writes no file",
                      "write_sample_sglang_dump.py": "writes a sample SGLang dump (.pt) to try, no record"}


def _run(*argv, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_the_bench_folder_has_the_scripts_the_readme_names():
    assert {"bench_comm.py", "bench_plan_quality.py", "bench_replay.py", "bench_scale.py",
            "bench_trace_throughput.py", "bench_windows.py", "gemm_configs.py", "microbench.py"} <= set(PY_SCRIPTS)
    assert SH_SCRIPTS == ["engine_overlay.sh", "gpu_check.sh"]
    assert {"bench_engines.py", "bench_eplb_ties.py"} <= set(PY_SCRIPTS) and set(MODULES) <= {
        p.name for p in (ROOT / "bench").glob("*.py")}


@pytest.mark.parametrize("script", PY_SCRIPTS)
def test_every_python_bench_script_starts(script):
    done = _run(sys.executable, ROOT / "bench" / script, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage:") and done.stderr == ""


@pytest.mark.parametrize("script", SH_SCRIPTS)
def test_every_shell_bench_script_starts(script):
    done = _run("bash", ROOT / "bench" / script, "--help")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert "--dry-run" in done.stdout
    # an argument the script does not take stops it at once: exit 2, and stderr says so (usage or the argument)
    wrong = _run("bash", ROOT / "bench" / script, "--dry-run", "--no-such-option", "x", "y")
    assert wrong.returncode == 2 and wrong.stdout == ""
    assert "--no-such-option" in wrong.stderr or wrong.stderr.startswith("usage:")


def test_the_overlay_dry_run_says_what_it_would_do_and_changes_nothing(tmp_path):
    overlay = tmp_path / "overlay"
    done = _run("bash", ROOT / "bench" / "engine_overlay.sh", "--dry-run", sys.executable, overlay)
    assert done.returncode == 0, done.stderr
    link, install = done.stdout.splitlines()
    assert link == f"would link {ROOT}/moe_place/* and {ROOT}/{{solvers,kernels,traces}} into {overlay}/moe_place"
    assert install.startswith(f"would install into {overlay}: ")
    named = install.split(": ", 1)[1].split()
    # what it names is what this Python lacks: the test environment has networkx and pytest, so neither is named
    assert "networkx" not in named and "pytest" not in named
    assert not overlay.exists()   # a dry run changes nothing


@pytest.mark.parametrize("script", [s for s in PY_SCRIPTS if s not in OWN_OUTPUT_OPTIONS])
@pytest.mark.parametrize("flag", ["--out", "--output-json"])
def test_an_existing_record_is_kept_unless_forced(tmp_path, script, flag):
    record = tmp_path / "record.json"
    record.write_text('{"committed": true}\n')
    done = _run(sys.executable, ROOT / "bench" / script, flag, record)
    assert done.returncode == 2, done.stderr
    last = done.stderr.splitlines()[-1]  # after argparse's usage lines where a script uses parser.error
    assert str(record) in last and "--force" in last and "Traceback" not in done.stderr, done.stderr
    assert record.read_text() == '{"committed": true}\n'
    assert done.stdout == ""  # refused before any work


def test_an_existing_plot_is_kept_unless_forced(tmp_path):
    plot = tmp_path / "replay.png"
    plot.write_bytes(b"committed")
    done = _run(sys.executable, ROOT / "bench" / "bench_replay.py", "--plot", plot)
    assert done.returncode == 2 and "--plot" in done.stderr and "--force" in done.stderr
    assert plot.read_bytes() == b"committed"


def test_force_overwrites_and_a_missed_target_says_which(tmp_path):
    """A short replay (300 steps: only the shortest cadences call the policy) misses a target: the script
    exits 1, says which on stderr, and still writes the record."""
    record = tmp_path / "replay.json"
    record.write_text("{}")
    done = _run(sys.executable, ROOT / "bench" / "bench_replay.py", "--steps", "300", "--scenarios", "1x8-qwen3-30b",
                "--seeds", "0", "--protocols", "sglang", "--out", record, "--force")
    assert done.returncode == 1
    assert "NOT MET" in done.stdout
    # and on stderr, where it shows when stdout goes to a file: one line naming each missed target
    missed = done.stderr.splitlines()[-1]
    assert missed.startswith("bench_replay: ") and " missed: sglang, tuning set: " in missed, done.stderr
    assert '"traces"' in record.read_text()
    # its progress: a line on stderr as each trace ends (the tuned one and the stationary one)
    progress = [line for line in done.stderr.splitlines() if " traces done (" in line]
    assert [line.split(" traces done")[0] for line in progress] == ["bench_replay: 1/2", "bench_replay: 2/2"]


def _bench_module(name: str):
    """A bench/ script as a module (bench/ is not a package; the scripts find their neighbours themselves)."""
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script, inner", [("bench_replay", "_run_job"), ("bench_engines", "workload_section")])
def test_ctrl_c_says_one_line_writes_nothing_and_exits_130(tmp_path, capsys, monkeypatch, script, inner):
    module = _bench_module(script)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(module, inner, interrupted)
    record = tmp_path / "record.json"
    argv = ["--steps", "300", "--scenarios", "1x8-qwen3-30b", "--seeds", "0", "--protocols", "sglang"] \
        if script == "bench_replay" else ["--engine", "standin-sglang", "--sizes", "1x8-e64", "--drift", "none"]
    assert module.main(argv + ["--out", str(record)]) == 130
    err = capsys.readouterr().err.splitlines()
    assert err == [f"{script}: interrupted; nothing written"]
    assert not record.exists()


def _module_level(tree: ast.Module):
    """The nodes a module runs when it is imported: all but those inside its functions."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))


def test_the_scripts_take_their_record_plumbing_from_records_not_the_cli(tmp_path):
    """No bench script imports the CLI when it loads (bench_trace_throughput imports `moe_place.cli.main` inside
    the function it times: that is the user's command measured), and none writes JSON past `records.write_record`,
    which adds the record's provenance."""
    cli, direct = [], []
    for script in sorted((ROOT / "bench").glob("*.py")):
        tree = ast.parse(script.read_text())
        for node in _module_level(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            cli += [f"{script.name}:{node.lineno}" for name in names if name.startswith("moe_place.cli")]
        direct += [f"{script.name}:{node.lineno}" for node in ast.walk(tree) if isinstance(node, ast.Call)
                   and "write_json_atomic" in (getattr(node.func, "id", None), getattr(node.func, "attr", None))
                   and script.name != "records.py"]
    assert not cli and not direct, (cli, direct)
    records = _bench_module("records")
    records.write_record(tmp_path / "record.json", {"rows": [1]})
    written = json.loads((tmp_path / "record.json").read_text())
    assert written["rows"] == [1] and {"commit", "date", "machine", "model_defaults"} <= set(written["provenance"])
    records.write_record(tmp_path / "kept.json", {"provenance": {"commit": "abc"}})   # a record's own is kept
    assert json.loads((tmp_path / "kept.json").read_text()) == {"provenance": {"commit": "abc"}}


def test_moe_place_bench_keeps_an_existing_record(tmp_path):
    record = tmp_path / "run.json"
    record.write_text("{}")
    done = _run(sys.executable, "-m", "moe_place.cli.main", "bench", "--dry-run", "--out", record)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1 and "--force" in done.stderr
    assert record.read_text() == "{}"


def test_the_multinode_page_shows_the_committed_record():
    """docs/multinode.md's results tables are `bench_comm.py --table` of the committed record, verbatim."""
    done = _run(sys.executable, ROOT / "bench" / "bench_comm.py", "--table", ROOT / "bench/results/comm.json")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() and done.stdout.strip() in (ROOT / "docs" / "multinode.md").read_text()
    missing = _run(sys.executable, ROOT / "bench" / "bench_comm.py", "--table", ROOT / "no-such-record.json")
    assert missing.returncode == 2 and "--table" in missing.stderr.splitlines()[-1]
