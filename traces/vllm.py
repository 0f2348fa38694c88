"""vLLM-style expert load window -> a count-level trace.

vLLM's EPLB state keeps `expert_load_window` int `[window_size, layers, physical]` (a ring
buffer of per-pass physical slot loads) and `physical_to_logical_map` int `[layers, physical]`.
vLLM does not write them to a file itself; this reads them as saved by a user, either
`np.savez(path, expert_load_window=..., physical_to_logical_map=...)` or
`torch.save({"expert_load_window": ..., "physical_to_logical_map": ...}, path)`.

Optional keys: `expert_load_window_step` (int, vLLM's ring position = the oldest row: rows are
rotated into chronological order), `num_logical_experts`, `top_k`, `layer_ids`, `model`.
All-zero rows (ring slots never written) are dropped. Steps are named `pass<i>`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

from moe_place.errors import InputError
from moe_place.traces.model import Trace, TraceMeta
from moe_place.traces.npz import infer_top_k, open_npz, read_member
from moe_place.traces.physical import physical_to_logical_counts

__all__ = ["is_vllm_dict", "is_vllm_npz", "read_vllm_window", "vllm_window_trace"]

WINDOW_KEY = "expert_load_window"
MAP_KEY = "physical_to_logical_map"
OPTIONAL_KEYS = ("expert_load_window_step", "num_logical_experts", "top_k", "layer_ids", "model")


def is_vllm_npz(path: Path) -> bool:
    with open_npz(path) as npz:
        return WINDOW_KEY in npz.files


def is_vllm_dict(obj: Any) -> bool:
    return isinstance(obj, Mapping) and WINDOW_KEY in obj


def read_vllm_window(path: Path, top_k: int | None = None) -> Trace:
    """Read an `.npz` load window (see the module doc)."""
    with open_npz(path) as npz:
        fields = {k: read_member(npz, path, k) for k in (WINDOW_KEY, MAP_KEY, *OPTIONAL_KEYS) if k in npz.files}
    return vllm_window_trace(fields, path, top_k)


def vllm_window_trace(fields: Mapping[str, Any], path: Path, top_k: int | None = None) -> Trace:
    """A count-level Trace from the window dict (numpy arrays or scalars)."""
    if MAP_KEY not in fields:
        raise InputError(str(path), f"key '{MAP_KEY}' next to '{WINDOW_KEY}'", f"keys {sorted(fields)}")
    window = np.asarray(fields[WINDOW_KEY])
    if window.ndim != 3:
        raise InputError(f"{path}: {WINDOW_KEY}", "a 3-D array [window, layers, physical]", f"shape {window.shape}")
    if "expert_load_window_step" in fields:
        oldest = _int(fields["expert_load_window_step"], f"{path}: expert_load_window_step")
        window = np.roll(window, -(oldest % max(window.shape[0], 1)), axis=0)
    num_logical = None
    if "num_logical_experts" in fields:
        num_logical = _int(fields["num_logical_experts"], f"{path}: num_logical_experts")
        if num_logical < 1:
            raise InputError(f"{path}: num_logical_experts", "an integer >= 1", num_logical)
    counts = physical_to_logical_counts(window, fields[MAP_KEY], f"{path}: {WINDOW_KEY}", num_logical)
    written = counts.reshape(counts.shape[0], -1).any(axis=1)
    step_names = tuple(f"pass{i}" for i in np.flatnonzero(written))
    counts = counts[written]
    if counts.shape[0] == 0:
        raise InputError(f"{path}: {WINDOW_KEY}", "a non-empty trace (at least one dispatch)", "all counts are 0")
    if "top_k" in fields:
        top_k = _int(fields["top_k"], f"{path}: top_k")
    top_k = top_k if top_k is not None else infer_top_k(counts)
    layer_ids = tuple(range(counts.shape[1]))
    if "layer_ids" in fields:
        layer_ids = tuple(int(x) for x in np.asarray(fields["layer_ids"]).reshape(-1))
        if len(layer_ids) != counts.shape[1]:
            raise InputError(f"{path}: layer_ids", f"{counts.shape[1]} entries", len(layer_ids))
    model = str(np.asarray(fields["model"]).reshape(())) if "model" in fields else "unknown"
    if not 1 <= top_k <= counts.shape[2]:
        raise InputError(f"{path}: top_k", f"an integer in [1, {counts.shape[2]}]", top_k)
    meta = TraceMeta(num_experts=counts.shape[2], top_k=top_k, layer_ids=layer_ids, model=model,
                     source=f"vllm-window:{path.name}", dtype=str(window.dtype), step_names=step_names)
    return Trace(meta, counts=counts)


def _int(value: Any, where: str) -> int:
    arr = np.asarray(value)
    if arr.size != 1 or arr.dtype.kind not in "iu":
        raise InputError(where, "one integer", f"{arr.dtype} shape {arr.shape}")
    return int(arr.reshape(()))
