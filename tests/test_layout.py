"""The package layout the project promises: one import root, one-way imports, README == CI."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Layers, lowest first: a module may import only from its own layer or lower ones.
LAYERS = [
    ("moe_place.__init__", "moe_place.errors", "moe_place.glossary", "moe_place.io", "moe_place.plotting",
     "moe_place.progress"),
    ("moe_place.traces",),
    ("moe_place.placement", "moe_place.planfile"),
    ("moe_place.analysis",),
    ("moe_place.cost",),
    ("moe_place.problem",),
    ("moe_place.solvers",),
    ("moe_place.kernels", "moe_place.engines", "moe_place.online", "moe_place.eplb"),
    ("moe_place.cli",),
]
SOURCE_DIRS = {"moe_place": ROOT / "moe_place", "moe_place.kernels": ROOT / "kernels",
               "moe_place.solvers": ROOT / "solvers", "moe_place.traces": ROOT / "traces"}


def _layer_of(module: str) -> int | None:
    for rank, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    return None


def _modules():
    for package, folder in SOURCE_DIRS.items():
        for path in sorted(folder.glob("*.py")):
            name = f"{package}.{path.stem}"
            yield name, path
    for sub in ("analysis", "cli", "cost", "engines", "online"):
        for path in sorted((ROOT / "moe_place" / sub).glob("*.py")):
            yield f"moe_place.{sub}.{path.stem}", path


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def test_lower_layers_never_import_higher_ones():
    violations = []
    for name, path in _modules():
        own = _layer_of(name)
        assert own is not None, f"{name} is in no layer: add it to LAYERS"
        for imported in _imports(path):
            rank = _layer_of(imported)
            if rank is not None and rank > own:
                violations.append(f"{name} imports {imported}")
    assert not violations, violations


def test_modules_exist_in_every_layer_folder():
    names = {name for name, _ in _modules()}
    assert {"moe_place.traces.model", "moe_place.placement", "moe_place.solvers.base"} <= names


@pytest.mark.parametrize("name", ["kernels", "solvers", "traces"])
def test_no_top_level_module_named_like_other_pypi_packages(name, tmp_path):
    code = f"import importlib.util, sys; sys.exit(0 if importlib.util.find_spec({name!r}) is None else 1)"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path)
    assert done.returncode == 0, f"a top-level module {name!r} is importable"


@pytest.mark.parametrize("name", ["moe_place.kernels", "moe_place.solvers", "moe_place.traces"])
def test_mapped_folders_import_under_the_root(name, tmp_path):
    code = f"import {name}, sys; print({name}.__file__)"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    folder = name.split(".")[1]
    assert Path(done.stdout.strip()).parent.name == folder


def test_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    commands = re.findall(r"^```(?:bash|sh)?\n(.*?)\n```", readme, flags=re.S | re.M)
    test_lines = [c for c in commands if "pytest" in c and "\n" not in c]
    assert test_lines, "README has no one-line test command"
    assert test_lines[0] in ci, "README's test command and .ci/run disagree"
