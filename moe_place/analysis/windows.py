"""Windows: runs of consecutive steps whose loads are summed, as engines do before re-planning."""

from __future__ import annotations

import numpy as np

from moe_place.errors import InputError

__all__ = ["consecutive_runs", "window_loads"]


def window_loads(step_counts: np.ndarray, window_steps: int = 1) -> np.ndarray:
    """int64 `[windows, layers, E]`: `[steps, layers, E]` counts summed over `window_steps` steps.

    Trailing steps that do not fill a whole window are dropped (a partial window would look
    lighter than the others).
    """
    counts = np.asarray(step_counts)
    if counts.ndim != 3:
        raise InputError("step_counts", "a 3-D array [steps, layers, experts]", f"shape {counts.shape}")
    if window_steps < 1:
        raise InputError("window_steps", "an integer >= 1", window_steps)
    windows = counts.shape[0] // window_steps
    if windows < 1:
        raise InputError("window_steps", f"at most the {counts.shape[0]} steps of the trace", window_steps)
    used = counts[: windows * window_steps]
    return used.reshape(windows, window_steps, *counts.shape[1:]).sum(axis=1, dtype=np.int64)


def consecutive_runs(num_steps: int, most: int) -> list[range]:
    """`min(num_steps, most)` runs of consecutive step indices covering `0..num_steps-1`, as even as whole
    steps allow: the held-out folds of redundancy sizing and the time planner's cross-validation windows."""
    count = min(num_steps, most)
    bounds = np.linspace(0, num_steps, count + 1).round().astype(int)
    return [range(int(bounds[i]), int(bounds[i + 1])) for i in range(count)]
