"""Persistence: how long hot experts stay hot from one window to the next.

The hot set of a window is its `top_n` most loaded experts (ties go to the lower expert id).
A *run* is a maximal stretch of consecutive windows in which an expert stays in the hot set.
Runs touching the first or last window are cut by the trace's ends, so short traces understate
persistence; a trace of one window has no transitions (overlap is NaN).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_place.errors import InputError

__all__ = ["Persistence", "hot_overlap", "hot_sets", "persistence", "run_lengths"]


def hot_sets(window_load: np.ndarray, top_n: int) -> np.ndarray:
    """bool `[..., windows, E]`: True where an expert is among the window's `top_n` hottest.

    window_load: `[..., windows, E]` loads per window.
    """
    loads = np.asarray(window_load)
    experts = loads.shape[-1]
    if not 1 <= top_n <= experts:
        raise InputError("top_n", f"an integer in [1, {experts}]", top_n)
    order = np.argsort(-loads, axis=-1, kind="stable")[..., :top_n]
    hot = np.zeros(loads.shape, dtype=bool)
    np.put_along_axis(hot, order, True, axis=-1)
    return hot


def run_lengths(hot: np.ndarray) -> np.ndarray:
    """int64 `[runs]`: lengths of the maximal runs of True along axis -2 of `hot [..., windows, E]`."""
    return _runs(hot)[1]


def _runs(hot: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, length) int64 `[runs]` of every maximal run of True along axis -2 of `hot [..., windows, E]`;
    rows number the flattened leading axes and experts, and runs come row by row (rows ascending)."""
    hot = np.asarray(hot, dtype=bool)
    windows = hot.shape[-2]
    flat = np.zeros((hot.size // max(1, windows), windows + 2), dtype=np.int8)
    flat[:, 1:-1] = np.moveaxis(hot, -2, -1).reshape(-1, windows)
    edges = np.diff(flat, axis=1)
    start_rows, starts = np.nonzero(edges == 1)
    _, ends = np.nonzero(edges == -1)
    # nonzero walks row by row, left to right, so the i-th start pairs with the i-th end
    return start_rows.astype(np.int64), (ends - starts).astype(np.int64)


def hot_overlap(hot: np.ndarray) -> np.ndarray:
    """float64 `[..., windows-1]`: share of window w's hot set still hot in window w+1."""
    hot = np.asarray(hot, dtype=bool)
    kept = (hot[..., 1:, :] & hot[..., :-1, :]).sum(axis=-1)
    size = hot[..., :-1, :].sum(axis=-1)
    return np.divide(kept, size, out=np.zeros(kept.shape), where=size > 0)


@dataclass(frozen=True)
class Persistence:
    """Per layer: how long the `top_n` hottest experts stay hot over `num_windows` windows.

    mean_run / median_run / max_run: `[layers]` run lengths in windows (see the module note).
    mean_overlap: `[layers]` mean over transitions of the share of the hot set kept; NaN with
        one window. Random hot sets would keep about `top_n/E`.
    """

    top_n: int
    num_windows: int
    mean_run: np.ndarray
    median_run: np.ndarray
    max_run: np.ndarray
    mean_overlap: np.ndarray

    def __post_init__(self) -> None:
        layers = self.mean_run.shape[0]
        for name in ("median_run", "max_run", "mean_overlap"):
            if getattr(self, name).shape != (layers,):
                raise InputError(f"Persistence.{name}", f"shape ({layers},)", getattr(self, name).shape)
        if self.num_windows < 1 or self.top_n < 1:
            raise InputError("Persistence", "at least one window and top_n >= 1")


def persistence(window_load: np.ndarray, top_n: int) -> Persistence:
    """Persistence of hot experts in `[windows, layers, E]` loads (see `windows.window_loads`)."""
    loads = np.asarray(window_load)
    if loads.ndim != 3:
        raise InputError("window_load", "a 3-D array [windows, layers, experts]", f"shape {loads.shape}")
    windows, layers, _ = loads.shape
    hot = hot_sets(np.moveaxis(loads, 0, 1), top_n)  # [layers, windows, E]
    rows, lengths = _runs(hot)
    layer_of = rows // loads.shape[2]  # runs come layer by layer; every layer has one (top_n >= 1)
    per_layer = np.bincount(layer_of, minlength=layers)
    first = np.concatenate([[0], np.cumsum(per_layer)[:-1]])
    mean_run = np.bincount(layer_of, weights=lengths, minlength=layers) / per_layer
    max_run = np.maximum.reduceat(lengths, first).astype(np.float64)
    ordered = lengths[np.lexsort((lengths, layer_of))]  # each layer's lengths, ascending
    median_run = (ordered[first + (per_layer - 1) // 2] + ordered[first + per_layer // 2]) / 2
    overlap = hot_overlap(hot)
    mean_overlap = overlap.mean(axis=-1) if windows > 1 else np.full(layers, np.nan)
    return Persistence(int(top_n), windows, mean_run, median_run, max_run, mean_overlap)
