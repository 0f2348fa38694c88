"""Physical (slot) loads -> logical (expert) loads, through a `physical_to_logical_map`.

Engines record how many tokens each physical slot received; a logical expert's load is the sum
over its replicas. Used by the SGLang and vLLM readers.
"""

from __future__ import annotations

import numpy as np

from moe_place.errors import InputError
from moe_place.traces.model import check_counts

__all__ = ["check_phy2log", "physical_to_logical_counts"]


def check_phy2log(phy2log: np.ndarray, where: str, num_layers: int | None = None,
                  num_physical: int | None = None) -> np.ndarray:
    """Validate `physical_to_logical_map` int `[layers, physical]`; return it as int64.

    Entries are logical expert ids >= 0; -1 marks an unused slot (it must receive no tokens).
    """
    arr = np.asarray(phy2log)
    if arr.ndim != 2 or arr.dtype.kind not in "iu" or arr.size == 0:
        raise InputError(where, "a non-empty integer array [layers, physical]", f"{arr.dtype} shape {arr.shape}")
    if num_layers is not None and arr.shape[0] != num_layers:
        raise InputError(where, f"{num_layers} layers (rows)", arr.shape[0])
    if num_physical is not None and arr.shape[1] != num_physical:
        raise InputError(where, f"{num_physical} physical slots (columns)", arr.shape[1])
    if arr.min() < -1:
        raise InputError(where, "logical expert ids >= 0 (or -1 for an unused slot)", int(arr.min()))
    return arr.astype(np.int64)


def physical_to_logical_counts(physical_counts: np.ndarray, phy2log: np.ndarray, where: str,
                               num_logical: int | None = None) -> np.ndarray:
    """int64 `[steps, layers, logical]`: loads of `physical_counts` `[steps, layers, physical]` per expert.

    phy2log: int `[layers, physical]`, the logical expert of each slot (-1: unused slot).
    num_logical: experts per layer; default `max(phy2log) + 1`.
    """
    counts = check_counts(physical_counts, where)
    steps, num_layers, num_physical = counts.shape
    phy2log = check_phy2log(phy2log, f"{where}: physical_to_logical_map", num_layers, num_physical)
    largest = int(phy2log.max())
    if largest < 0:
        raise InputError(f"{where}: physical_to_logical_map", "at least one used slot", "all -1")
    if num_logical is None:
        num_logical = largest + 1
    elif largest >= num_logical:
        raise InputError(f"{where}: physical_to_logical_map", f"logical ids in [0, {num_logical})", largest)
    unused = phy2log < 0
    if unused.any() and counts[:, unused].any():
        raise InputError(where, "no tokens on unused slots (physical_to_logical_map = -1)", "tokens")
    flat = np.where(unused, 0, phy2log) + (np.arange(num_layers, dtype=np.int64) * num_logical)[:, None]
    out = np.zeros((steps, num_layers * num_logical), dtype=np.int64)
    np.add.at(out, (slice(None), flat.reshape(-1)), counts.reshape(steps, -1))
    return out.reshape(steps, num_layers, num_logical)
