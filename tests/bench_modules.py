"""bench/ modules for the tests that drive them (bench/ is not a package): each loaded once by its path and
registered under its own name, as the harness imports its stand-ins."""

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load(name: str):
    """bench/`name`.py as a module, loaded on the first call."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
