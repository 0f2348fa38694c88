"""JSON Lines trace files read one line at a time: the parts vLLM's and Megatron's readers share.

- `read_lines`: every line of one or more files with its file, line number and byte offset, and a
  progress bar over the bytes read (memory: one line at a time);
- `parse_object`: one line -> a JSON object, or an `InputError` naming the file and line;
- `id_array`: a field's nested lists `[rows][...]` (or vLLM's base64 `.npy` string) -> an integer
  array, with the shape, type and range checked (NaN, fractions, ragged rows, negative ids are errors);
- `first_repeat`: the first (row, layer) whose top-k names one expert twice;
- `add_counts`: dispatches per expert of `[tokens, layers, k]` ids added to `[layers, width]` counts
  whose width grows with the largest id seen (the number of experts is not written in these files).

Parsing is Python's standard `json` module, then `np.asarray` of the lists. Measured on this
project's 2-core machine: `json.loads` of a 1.2 MiB line of ids runs at about 16 MiB/s and is 80% of
the time; a whole file reads at about 10 MiB/s (a 5 GB file: about 8 minutes, with a progress bar).
Reading the number spans as text (`np.fromstring` of the brackets stripped) runs at about 60 MiB/s
but must then check the nesting is regular itself; that is not done here. No faster JSON parser is
added: it would be a new dependency for a file read once per trace.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from moe_place.errors import InputError
from moe_place.progress import ProgressBar
from moe_place.traces.model import MAX_EXPERTS

KIB = 1024  # the progress bar counts KiB read


def read_lines(paths: Sequence[Path], label: str, progress: bool = False) -> Iterator[tuple[Path, int, int, bytes]]:
    """(file, line number from 1, byte offset, line) of every non-blank line of `paths` in order."""
    total = sum(path.stat().st_size for path in paths)
    bar = ProgressBar(-(-total // KIB), label, "KiB", enabled=None if progress else False)
    done = 0
    try:
        for path in paths:
            with open(path, "rb") as fh:
                offset = 0
                for number, line in enumerate(fh, start=1):
                    if line.strip():
                        yield path, number, offset, line
                    offset += len(line)
                    if (done + offset) // KIB > bar.done:
                        bar.advance((done + offset) // KIB - bar.done)
            done += path.stat().st_size
    finally:  # also on a bad line: its error starts on a line of its own
        bar.close()


def read_line_at(path: Path, offset: int) -> bytes:
    """The line of `path` that starts at byte `offset` (a second look at a line read before)."""
    with open(path, "rb") as fh:
        fh.seek(offset)
        return fh.readline()


def parse_object(line: bytes, where: str) -> dict:
    """One line of JSON Lines -> its object; InputError naming `where` if it is not a JSON object."""
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise InputError(where, "one JSON object per line", f"invalid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise InputError(where, "one JSON object per line", type(obj).__name__)
    return obj


def id_array(value: object, where: str, ndim: int, shape: str) -> np.ndarray:
    """int64 array of `ndim` dimensions (`shape` words it in errors) from nested JSON lists, or from a
    base64 string of `.npy` bytes (how recent vLLM returns `routed_experts`). Expert ids must be
    whole numbers in [0, MAX_EXPERTS); an empty list is an array with no rows."""
    if isinstance(value, str):
        arr = _npy_from_base64(value, where)
    elif isinstance(value, list):
        if not value:
            return np.zeros((0,) * ndim, dtype=np.int64)
        try:
            arr = np.asarray(value)
        except ValueError:  # numpy >= 1.24 refuses ragged nesting
            raise InputError(where, f"a regular nested list {shape}", "rows of different lengths") from None
    else:
        raise InputError(where, f"a nested list {shape} of expert ids", type(value).__name__)
    if arr.dtype.kind == "f":
        bad = "NaN" if np.isnan(arr).any() else ("inf" if np.isinf(arr).any() else "a fractional number")
        if bad == "a fractional number" and (arr == np.round(arr)).all():
            bad = "a number written as a float"
        raise InputError(where, "integer expert ids", bad)
    if arr.dtype.kind not in "iu":
        raise InputError(where, f"a nested list {shape} of integer expert ids",
                         "rows of different lengths" if arr.dtype == object else f"values of type {arr.dtype}")
    if arr.ndim != ndim:
        raise InputError(where, f"a {ndim}-D list {shape}", f"{arr.ndim} dimensions, shape {list(arr.shape)}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= MAX_EXPERTS:
            raise InputError(where, f"expert ids in [0, {MAX_EXPERTS})", lo if lo < 0 else hi)
    return arr


def _npy_from_base64(text: str, where: str) -> np.ndarray:
    try:
        data = base64.b64decode(text, validate=True)
        if not data.startswith(b"\x93NUMPY"):
            raise ValueError("no .npy header")
        return np.load(io.BytesIO(data), allow_pickle=False)
    except (binascii.Error, ValueError, EOFError, OSError) as exc:
        raise InputError(where, "a base64 string of .npy bytes (or a nested list of ids)", str(exc)) from None


def first_repeat(ids: np.ndarray) -> tuple[int, int] | None:
    """(row, layer) of the first token-layer of int `[tokens, layers, k]` ids naming an expert twice."""
    if ids.shape[2] < 2 or ids.size == 0:
        return None
    ordered = np.sort(ids, axis=2)
    repeated = (ordered[:, :, 1:] == ordered[:, :, :-1]).any(axis=2)
    if not repeated.any():
        return None
    token, layer = np.argwhere(repeated)[0]
    return int(token), int(layer)


def add_counts(counts: np.ndarray | None, ids: np.ndarray) -> np.ndarray:
    """int64 `[layers, width]`: `counts` (None: none yet) plus the dispatches of `ids` `[tokens, layers, k]`
    (ids in range), the width widened to the largest id + 1 when needed."""
    num_layers = ids.shape[1]
    width = 0 if counts is None else counts.shape[1]
    if ids.size:
        width = max(width, int(ids.max()) + 1)
    keys = ids.astype(np.int64) * num_layers + np.arange(num_layers)[None, :, None]
    added = np.bincount(keys.ravel(), minlength=width * num_layers).reshape(width, num_layers).T
    if counts is None:
        return np.ascontiguousarray(added)
    if counts.shape[1] < width:
        counts = np.pad(counts, ((0, 0), (0, width - counts.shape[1])))
    counts += added
    return counts


def stack_counts(steps: Sequence[np.ndarray], num_experts: int) -> np.ndarray:
    """int64 `[steps, layers, num_experts]` from per-step `[layers, width <= num_experts]` counts."""
    return np.stack([np.pad(c, ((0, 0), (0, num_experts - c.shape[1]))) for c in steps])
