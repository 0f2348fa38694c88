"""Replay figures: per-step balancedness and cumulative time of each controller, one row per run."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from moe_place.online.replay import ReplayResult
from moe_place.plotting import new_figure, png_bytes

__all__ = ["render_cadence_png", "render_replay_png"]

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


def render_cadence_png(records: Sequence[dict], dpi: int = 110) -> bytes:
    """PNG bytes: for each protocol of cadence-sweep records (`bench/bench_replay.py`), total time over the
    rebalance interval (each trace's default at its best = 1) for the default, moe-place and the hindsight
    reference, one line per trace, the best cadences marked; last panel, best-against-best ratios per trace."""
    protocols = sorted({p for r in records for p in r["protocols"]})
    fig = new_figure((5.2 * (len(protocols) + 1), 4.4))
    axes = fig.subplots(1, len(protocols) + 1, squeeze=False)[0]
    styles = {"default": dict(color="tab:grey", ls="--"), "moe-place": dict(color="tab:blue", ls="-"),
              "hindsight": dict(color="tab:green", ls=":")}
    for ax, protocol in zip(axes, protocols):
        for r in records:
            s = r["protocols"].get(protocol)
            if s is None or r["kind"] == "stationary":
                continue
            base = s["best"]["default"]["total_s"]
            intervals = sorted({x["step_interval"] for x in s["runs"]})
            for policy in ("default", "moe-place"):
                totals = [next(x["total_s"] for x in s["runs"] if x["policy"] == policy and x["step_interval"] == i)
                          for i in intervals]
                ax.plot(intervals, np.array(totals) / base, lw=0.8, alpha=0.7, **styles[policy])
                best = s["best"][policy]
                ax.plot(best["step_interval"], best["total_s"] / base, "o", ms=3, color=styles[policy]["color"])
            ax.plot(intervals, [s["hindsight"][str(i)] / base for i in intervals], lw=0.8, alpha=0.7,
                    **styles["hindsight"])
        for policy, style in styles.items():
            ax.plot([], [], label=policy if policy != "hindsight" else "hindsight (next interval, free moves)", **style)
        ax.set(xscale="log", title=f"{protocol}: total time vs interval", xlabel="rebalance interval (steps)",
               ylabel="total / default at its best cadence")
        ax.axhline(1.0, color="black", lw=0.5)
        ax.legend(fontsize=7)
    ax = axes[-1]
    for i, protocol in enumerate(protocols):
        cells = [r["protocols"][protocol] for r in records if protocol in r["protocols"] and r["kind"] != "stationary"]
        x = np.full(len(cells), i) + np.linspace(-0.2, 0.2, max(len(cells), 1))[:len(cells)]
        ax.plot(x, [c["best_ratio"] for c in cells], "o", color="tab:blue", ms=4,
                label="moe-place best / default best" if i == 0 else None)
        ax.plot(x, [c["hindsight_ratio"] for c in cells], "^", color="tab:green", ms=4,
                label="hindsight best / default best" if i == 0 else None)
    ax.axhline(1.0, color="black", lw=0.5)
    ax.set(xticks=range(len(protocols)), xticklabels=protocols, title="best against best, per trace",
           ylabel="total time ratio")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return png_bytes(fig, dpi)
