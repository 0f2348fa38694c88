"""Replay figures: per-step balancedness and cumulative time of each controller, one row per run."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from moe_place.online.replay import ReplayResult
from moe_place.plotting import new_figure, png_bytes

SMOOTH_STEPS = 50


def render_replay_png(runs: Sequence[tuple[str, dict[str, ReplayResult]]], dpi: int = 110) -> bytes:
    """PNG bytes: for each `(title, {controller: result})` a row with balancedness (a `SMOOTH_STEPS`-step
    mean; the rebalances of the engines' default policies marked) and cumulative expert + migration time."""
    fig = new_figure((13, 3.2 * len(runs)))
    axes = fig.subplots(len(runs), 2, squeeze=False)
    for row, (title, results) in enumerate(runs):
        for name, r in results.items():
            # a quarter of a short trace at most: a 3-step replay still draws 3 points, not 1
            window = max(1, min(SMOOTH_STEPS, r.steps // 4))
            smooth = np.convolve(r.balancedness, np.ones(window) / window, mode="valid")
            marker = "." if r.steps <= 100 else None  # few points: show each one
            axes[row, 0].plot(np.arange(window - 1, r.steps), smooth, label=name, lw=1, marker=marker)
            axes[row, 1].plot(r.cumulative_time_s(), label=name, lw=1, marker=marker)
            for step in r.rebalance_steps if name.endswith("-default") else ():
                axes[row, 0].axvline(step, color="grey", lw=0.5, ls=":")
        axes[row, 0].set(title=f"{title}: balancedness ({window}-step mean)", xlabel="step",
                         ylabel="mean / max GPU load")
        axes[row, 1].set(title=f"{title}: cumulative time", xlabel="step", ylabel="seconds")
        axes[row, 0].legend(fontsize=7)
        axes[row, 1].legend(fontsize=7)
    fig.tight_layout()
    return png_bytes(fig, dpi)
