"""One entry point that reads any supported trace file: `load_trace(path)`."""

from __future__ import annotations

from pathlib import Path

from moe_place.errors import InputError
from moe_place.traces.bundled import is_bundled, load_bundled
from moe_place.traces.model import Trace


def load_trace(path: str | Path) -> Trace:
    """Read a trace file, choosing the reader by its name and contents."""
    path = Path(path)
    if not path.exists():
        raise InputError(str(path), "an existing trace file", "no such file")
    if path.is_dir():
        raise InputError(str(path), "a trace file", "a directory")
    if is_bundled(path):
        return load_bundled(path)
    raise InputError(str(path), "a supported trace format")
