"""bench/ modules for the tests that drive them: the in-engine kit (the package `bench/inengine`, imported with
bench/ on `sys.path`, after everything else, as the bench scripts import it) and the scripts (bench/ itself is not a
package: each loaded once by its path and registered under its own name)."""

import importlib
import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load(name: str):
    """bench/`name`.py as a module, loaded on the first call; `inengine.*` from the package."""
    if name.split(".")[0] == "inengine":
        if str(BENCH) not in sys.path:
            sys.path.append(str(BENCH))
        return importlib.import_module(name)
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
