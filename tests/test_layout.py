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
     "moe_place.progress", "moe_place.interrupts", "moe_place.cores"),
    ("moe_place.traces",),
    ("moe_place.placement", "moe_place.planfile", "moe_place.split"),
    ("moe_place.analysis",),
    ("moe_place.cost",),
    ("moe_place.problem",),
    ("moe_place.solvers",),
    ("moe_place.kernels", "moe_place.online"),
    ("moe_place.engines", "moe_place.eplb"),   # the adapters run the online rule; the rule knows no engine
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
        for path in sorted(folder.glob("*/*.py")):   # subpackages (solvers/comm/)
            yield f"{package}.{path.parent.name}.{path.stem}", path
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


def test_online_imports_neither_the_engines_nor_the_cli():
    # the rule and the replay are the engines' shared core: the adapters import them, never the reverse
    # (the engines' launch lines live in moe_place.engines.launch); at any depth, inside functions too
    bad = [f"{name} imports {imported}" for name, path in _modules() if name.startswith("moe_place.online.")
           for imported in _imports(path) if imported.startswith(("moe_place.engines", "moe_place.cli"))]
    assert not bad, bad


def test_the_drop_in_is_imported_by_no_module_of_the_package():
    # moe_place.eplb is DeepSeek's entry point for code that calls it; the replay and the adapters plan with
    # moe_place.solvers.engine_call and convert with moe_place.engines.tensors, which read no environment
    bad = [f"{name} imports {imported}" for name, path in _modules() for imported in _imports(path)
           if imported == "moe_place.eplb" or imported.startswith("moe_place.eplb.")]
    assert not bad, bad


def test_the_import_checks_see_a_forbidden_import(tmp_path, monkeypatch):
    # the two checks above read the same walk of the tree: a module that breaks each rule is found
    online = tmp_path / "moe_place" / "online"
    online.mkdir(parents=True)
    (online / "bad.py").write_text("def f():\n    from moe_place.engines.config import EngineConfig\n"
                                   "    import moe_place.eplb\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "SOURCE_DIRS", {})
    for check in (test_online_imports_neither_the_engines_nor_the_cli,
                  test_the_drop_in_is_imported_by_no_module_of_the_package):
        with pytest.raises(AssertionError, match="moe_place.online.bad imports moe_place"):
            check()


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


def _module_names() -> set[str]:
    names = {name for name, _ in _modules()}
    for package in ("moe_place", "moe_place.kernels", "moe_place.solvers", "moe_place.solvers.comm", "moe_place.traces",
                    "moe_place.analysis", "moe_place.cli", "moe_place.cost", "moe_place.engines", "moe_place.online"):
        names.add(package)  # a package is its __init__
    return {name[: -len(".__init__")] if name.endswith(".__init__") else name for name in names}


def _import_targets(node: ast.AST, known: set[str]) -> list[str]:
    """The package's modules an import statement loads: `from p import m` is the submodule p.m when
    there is one, else p (the package's __init__)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in known]
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module in known:
        subs = [f"{node.module}.{alias.name}" for alias in node.names if f"{node.module}.{alias.name}" in known]
        return subs if len(subs) == len(node.names) else subs + [node.module]
    return []


def _import_graph(function_level: bool):
    import networkx as nx

    known = _module_names()
    graph = nx.DiGraph()
    for name, path in _modules():
        source = name[: -len(".__init__")] if name.endswith(".__init__") else name
        graph.add_node(source)
        tree = ast.parse(path.read_text())
        nodes = ast.walk(tree) if function_level else tree.body
        for node in nodes:
            for target in _import_targets(node, known):
                if target != source and not (source + ".").startswith(target + "."):  # a package's own parents run first
                    graph.add_edge(source, target)
    return graph


@pytest.mark.parametrize("function_level", [False, True], ids=["module level", "with imports inside functions"])
def test_no_import_circle_between_modules_even_within_a_layer(function_level):
    import networkx as nx

    cycles = list(nx.simple_cycles(_import_graph(function_level)))
    assert not cycles, f"import circles: {cycles[:5]}"


def test_the_circle_check_sees_a_circle():
    import networkx as nx

    graph = _import_graph(False)
    graph.add_edge("moe_place.errors", "moe_place.traces.model")  # the model imports errors: now a circle
    assert list(nx.simple_cycles(graph))


# Imports of the package's own modules inside functions: only in the CLI's run() (one block at its
# top, so that --help does not load the library) and where a comment says why it must be late.
LATE_IMPORTS_ALLOWED = {
    "moe_place.kernels.aot": "importing the kernels with TRITON_INTERPRET set would bind the interpreter's triton",
    "moe_place.solvers.__init__": "OR-Tools is optional (the solver extra): cpsat's module is loaded when cpsat is asked for",
    "moe_place.engines.sglang_startup": "runs in every Python process of an environment (a .pth line): the adapter "
                                        "(numpy, the rule) loads only when SGLang imports its EPLB algorithms",
}


def _function_level_own_imports(tree: ast.Module):
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = function.body[1:] if function.body and isinstance(function.body[0], ast.Expr) and \
            isinstance(getattr(function.body[0], "value", None), ast.Constant) else function.body
        leading = set()
        for statement in body:
            if not isinstance(statement, (ast.Import, ast.ImportFrom)):
                break
            leading.add(id(statement))
        for node in ast.walk(function):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("moe_place") or \
                    isinstance(node, ast.Import) and any(a.name.startswith("moe_place") for a in node.names):
                yield function.name, node, id(node) in leading


def test_own_modules_are_imported_at_the_top_except_in_cli_run_blocks():
    bad = []
    for name, path in _modules():
        for function, node, leading in _function_level_own_imports(ast.parse(path.read_text())):
            if name.startswith("moe_place.cli.") and function == "run" and leading:
                continue
            if name in LATE_IMPORTS_ALLOWED:
                continue
            bad.append(f"{name}:{node.lineno} in {function}()")
    assert not bad, f"imports of moe_place inside functions: {bad}"


def test_the_late_import_check_tells_a_leading_block_from_a_scattered_import():
    source = ("def run(args):\n    '''doc'''\n    from moe_place.errors import InputError\n    x = 1\n"
              "    from moe_place.io import write_atomic\n")
    found = [(node.lineno, leading) for _, node, leading in _function_level_own_imports(ast.parse(source))]
    assert found == [(3, True), (5, False)]


def test_every_hypothesis_test_is_derandomized():
    # conftest.py loads a derandomized profile; a test's own @settings inherits it unless it says otherwise
    hypothesis = pytest.importorskip("hypothesis")
    assert hypothesis.settings.default.derandomize and hypothesis.settings.default.database is None
    overriding = [str(path.relative_to(ROOT)) for path in sorted((ROOT / "tests").glob("test_*.py"))
                  if re.search(r"derandomize\s*=\s*False", path.read_text())]
    assert not overriding, overriding
    from hypothesis import given, settings, strategies

    @settings(max_examples=5)   # as the tests write it: the profile's derandomize still holds
    @given(strategies.integers())
    def drawn(value):
        seen.append(value)

    seen: list = []
    drawn()
    first, seen = seen, []
    drawn()
    assert seen == first


def test_the_dropin_imports_only_what_it_runs():
    """`import moe_place.eplb` (DeepSeek's drop-in) loads no module of the online rule, the CLI or the cost model."""
    code = "import sys, moe_place.eplb; print(' '.join(sorted(m for m in sys.modules if m.startswith('moe_place'))))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert "moe_place.eplb" in loaded
    assert not [m for m in loaded if m.split(".")[1:2] in (["online"], ["cli"], ["cost"])], loaded
