"""Read the small TOML/JSON files of the cost model (hardware parts, topologies, scenarios).

TOML needs Python >= 3.11 (`tomllib`) or the `tomli` package on 3.10; JSON always works.
Every failure is an `InputError` naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path

from moe_place.errors import InputError
from moe_place.io import read_input_text

__all__ = ["get_int", "get_number", "read_table_file"]


def _toml_loads():
    try:
        import tomllib  # Python >= 3.11
    except ModuleNotFoundError:  # pragma: no cover - exercised on Python 3.10 only
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            return None
    return tomllib


def read_table_file(path: str | Path) -> dict:
    """The top-level table of a `.toml` or `.json` file."""
    path = Path(path)
    text = read_input_text(path, "a readable .toml or .json file")
    suffix = path.suffix.lower()
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(str(path), "valid JSON", f"{exc.msg} at line {exc.lineno}") from None
    elif suffix == ".toml":
        tomllib = _toml_loads()
        if tomllib is None:  # pragma: no cover - Python 3.10 without tomli
            raise InputError(str(path), "a .json file (TOML needs Python >= 3.11 or the tomli package)", "TOML")
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise InputError(str(path), "valid TOML", str(exc)) from None
    else:
        raise InputError(str(path), "a file ending in .toml or .json", suffix or "no suffix")
    if not isinstance(data, dict):
        raise InputError(str(path), "a table (JSON object) at the top level", type(data).__name__)
    return data


def get_number(table: dict, key: str, where: str, *, default: float | None = None, positive: bool = True,
               allow_zero: bool = False) -> float:
    """A finite number from `table[key]`; `positive` rejects negatives (and zero unless `allow_zero`)."""
    if key not in table:
        if default is None:
            raise InputError(f"{where}.{key}", "a number", "nothing")
        return default
    value = table[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value in (float("inf"), float("-inf")):
        raise InputError(f"{where}.{key}", "a finite number", repr(value))
    if positive and (value < 0 or (value == 0 and not allow_zero)):
        raise InputError(f"{where}.{key}", "a number >= 0" if allow_zero else "a number > 0", value)
    return float(value)


def get_int(table: dict, key: str, where: str, default: int, minimum: int = 0) -> int:
    """An integer >= `minimum` from `table[key]` (default when absent)."""
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError(f"{where}.{key}", f"an integer >= {minimum}", repr(value))
    return value
