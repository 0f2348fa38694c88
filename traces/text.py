"""Plain-text count traces: CSV and JSON (count level only).

CSV: one row per (step, layer, expert) with a header naming the four columns (any order):

    # num_experts: 8          <- optional "# key: value" lines before the header:
    # top_k: 2                   num_experts, top_k, model
    step,layer,expert,count
    0,0,0,600
    0,0,1,560

- `step`: an integer or a name; steps keep the order in which they first appear.
- `layer`: the model layer index (int >= 0); the trace's layers are the distinct values, sorted.
- `expert`: int in [0, num_experts); `count`: int >= 0. Missing rows count 0; a repeated
  (step, layer, expert) row is an error. Without `num_experts`, it is the largest expert + 1.

JSON: an object
    {"format_version": 1, "num_experts": 8, "top_k": 2, "counts": [[[600, 560, ...]]],
     "layer_ids": [0], "step_names": ["a"], "model": "...", "source": "..."}
with `counts` nested lists `[steps][layers][experts]`; `num_experts` defaults to the last axis.
In both formats `top_k` comes from the file or from `--top-k` (`load_trace(..., top_k=K)`): it is
never guessed from counts, and every (step, layer) total must be a multiple of it.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np

from moe_place.errors import InputError, check_keys
from moe_place.io import write_atomic, write_json_atomic
from moe_place.traces.model import MAX_EXPERTS, Trace
from moe_place.traces.npz import NpzHeader, check_num_experts, counts_trace

__all__ = ["read_csv", "read_json", "save_csv", "save_json"]

CSV_COLUMNS = ("step", "layer", "expert", "count")
MAX_CSV_CELLS = 1 << 28  # steps x layers x experts of the dense counts a CSV fills: 2 GiB of int64
JSON_KEYS = ("format_version", "num_experts", "top_k", "counts", "layer_ids", "step_names", "model", "source")


# ---------------------------------------------------------------------- CSV
def read_csv(path: str | Path, top_k: int | None = None) -> Trace:
    """Read a CSV count trace (see the module doc)."""
    path = Path(path)
    lines = _text(path).splitlines()
    meta, body_start = _csv_meta(lines, path)
    rows = list(csv.reader(lines[body_start:]))
    if not rows:
        raise InputError(str(path), f"a header line {','.join(CSV_COLUMNS)}", "no header")
    header = [c.strip() for c in rows[0]]
    if sorted(header) != sorted(CSV_COLUMNS):
        raise InputError(f"{path}: header", f"the columns {','.join(CSV_COLUMNS)}", ",".join(header))
    column = {name: header.index(name) for name in CSV_COLUMNS}
    steps: dict[str, int] = {}
    table = []
    for line, row in enumerate(rows[1:], start=body_start + 2):
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) != len(header):
            raise InputError(f"{path}: line {line}", f"{len(header)} fields", len(row))
        step = row[column["step"]].strip()
        layer = _csv_int(row[column["layer"]], path, line, "layer")
        expert = _csv_int(row[column["expert"]], path, line, "expert")
        count = _csv_int(row[column["count"]], path, line, "count")
        if expert >= MAX_EXPERTS:  # before any array sized by the largest id
            raise InputError(f"{path}: line {line}: expert", f"an expert id in [0, {MAX_EXPERTS})", expert)
        steps.setdefault(step, len(steps))
        table.append((steps[step], layer, expert, count))
    if not table:
        raise InputError(str(path), "a non-empty trace (at least one data row)", "no rows")
    data = np.array(table, dtype=np.int64)
    largest = int(data[:, 2].max())
    if "num_experts" in meta:
        check_num_experts(meta["num_experts"], path)
    num_experts = meta.get("num_experts", largest + 1)
    if largest >= num_experts:
        raise InputError(f"{path}: expert", f"expert ids in [0, num_experts = {num_experts})", largest)
    layer_ids, layer_pos = np.unique(data[:, 1], return_inverse=True)
    dense = len(steps) * len(layer_ids) * num_experts
    if dense > MAX_CSV_CELLS:
        raise InputError(str(path), f"at most {MAX_CSV_CELLS:,} steps x layers x experts (the dense counts)",
                         f"{len(steps):,} x {len(layer_ids):,} x {num_experts:,}")
    counts = np.zeros((len(steps), len(layer_ids), num_experts), dtype=np.int64)
    cells = (data[:, 0] * len(layer_ids) + layer_pos.reshape(-1)) * num_experts + data[:, 2]
    if len(np.unique(cells)) != len(cells):
        raise InputError(str(path), "one row per (step, layer, expert)", "a repeated row")
    counts.reshape(-1)[cells] = data[:, 3]
    header_meta = NpzHeader(keys=frozenset(), num_experts=num_experts, top_k=meta.get("top_k"),
                            layer_ids=tuple(int(x) for x in layer_ids), model=str(meta.get("model", "unknown")),
                            source=f"csv:{path.name}", step_names=tuple(steps))
    return _count_trace_with_top_k(counts, header_meta, path, top_k)


def save_csv(trace: Trace, path: str | Path) -> None:
    """Write the trace's counts as CSV (rows with count 0 are left out), atomically."""
    out = io.StringIO()
    out.write(f"# num_experts: {trace.num_experts}\n# top_k: {trace.top_k}\n# model: {trace.meta.model}\n")
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    counts = trace.step_counts()
    for s, layer, expert in zip(*np.nonzero(counts)):
        writer.writerow((trace.step_names[s], trace.meta.layer_ids[layer], int(expert), int(counts[s, layer, expert])))
    write_atomic(path, out.getvalue())


def _csv_meta(lines: list[str], path: Path) -> tuple[dict, int]:
    meta: dict = {}
    i = 0
    while i < len(lines) and (lines[i].startswith("#") or not lines[i].strip()):
        text = lines[i].lstrip("#").strip()
        i += 1
        if not text:
            continue
        key, _, value = text.partition(":")
        key, value = key.strip(), value.strip()
        if key in ("num_experts", "top_k"):
            try:
                meta[key] = int(value)
            except ValueError:
                raise InputError(f"{path}: {key}", "an integer", value) from None
            if meta[key] < 1:
                raise InputError(f"{path}: {key}", "an integer >= 1", meta[key])
        elif key == "model":
            meta[key] = value
    return meta, i


def _csv_int(text: str, path: Path, line: int, name: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise InputError(f"{path}: line {line}: {name}", "an integer", repr(text.strip())) from None
    if not 0 <= value < 2**63:
        raise InputError(f"{path}: line {line}: {name}", "an integer in [0, 2**63)", value)
    return value


def _count_trace_with_top_k(counts: np.ndarray, header: NpzHeader, path: Path, top_k: int | None) -> Trace:
    """`counts_trace` with top_k from the file, else from `--top-k`: counts alone cannot prove it (any
    total fits top-1), and it sets the token count and the default hot-set size, so it is not guessed.
    The rest of the file is checked first, so its own errors come before a missing top_k."""
    trace = counts_trace(counts, header, path, top_k if top_k is not None else 1)
    if header.top_k is None and top_k is None and trace.counts.any():  # (an empty file is reported as such)
        raise InputError(f"{path}: top_k", "the router's top-k: the file does not record it, pass --top-k K",
                         "nothing")
    return trace


# ---------------------------------------------------------------------- JSON
def read_json(path: str | Path, top_k: int | None = None) -> Trace:
    """Read a JSON count trace (see the module doc); `top_k` when the file does not record it."""
    path = Path(path)
    try:
        obj = json.loads(_text(path))
    except json.JSONDecodeError as exc:
        raise InputError(str(path), "valid JSON", f"{exc.msg} at line {exc.lineno}") from None
    if not isinstance(obj, dict) or "counts" not in obj:
        raise InputError(str(path), "a JSON object with a 'counts' array [steps][layers][experts]",
                         type(obj).__name__ if not isinstance(obj, dict) else f"keys {sorted(obj)[:8]}")
    check_keys(obj, JSON_KEYS, f"{path}:")
    if obj.get("format_version", 1) != 1:
        raise InputError(f"{path}: format_version", "1", obj.get("format_version"))
    try:
        counts = np.array(obj["counts"])
    except (ValueError, TypeError, OverflowError):
        raise InputError(f"{path}: counts", "a rectangular array [steps][layers][experts]", "ragged lists") from None
    if counts.dtype.kind not in "iuf":
        raise InputError(f"{path}: counts", "numbers in a rectangular array [steps][layers][experts]",
                         f"{counts.dtype} shape {counts.shape}")
    header = NpzHeader(keys=frozenset(obj), num_experts=_json_int(obj, "num_experts", path),
                       top_k=_json_int(obj, "top_k", path), layer_ids=_json_ints(obj, "layer_ids", path),
                       model=str(obj.get("model", "unknown")), source=str(obj.get("source", "")) or f"json:{path.name}",
                       step_names=tuple(str(s) for s in obj.get("step_names", []) or ()))
    return _count_trace_with_top_k(counts, header, path, top_k)


def save_json(trace: Trace, path: str | Path) -> None:
    """Write the trace's counts as JSON, atomically."""
    write_json_atomic(path, {
        "format_version": 1, "num_experts": trace.num_experts, "top_k": trace.top_k,
        "layer_ids": list(trace.meta.layer_ids), "step_names": list(trace.step_names),
        "model": trace.meta.model, "source": trace.meta.source, "counts": trace.step_counts().tolist()})


def _json_int(obj: dict, key: str, path: Path) -> int | None:
    if key not in obj:
        return None
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{path}: {key}", "an integer >= 1", value)
    return value


def _json_ints(obj: dict, key: str, path: Path) -> tuple[int, ...] | None:
    if key not in obj:
        return None
    value = obj[key]
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise InputError(f"{path}: {key}", "a list of integers >= 0", value)
    return tuple(value)


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InputError(str(path), "a UTF-8 text file", "binary data") from None
