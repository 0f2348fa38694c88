"""The payback curve: net gain of a replica move against the number of batches it lasts (formula 7)."""

from __future__ import annotations

import numpy as np

from moe_place.plotting import new_figure, png_bytes

__all__ = ["render_payback_png"]


def render_payback_png(payback: dict, dpi: int = 110) -> bytes:
    """PNG bytes: one net-gain line per copy path (`payback_report` output), N_min marked."""
    saving = payback["saving_per_batch_s"]
    n = np.arange(payback["max_batches"] + 1)
    fig = new_figure((7.0, 4.2))
    ax = fig.subplots()
    for case in payback["cases"]:
        gain_ms = (n * saving - case["copy_time_s"]) * 1e3
        label = f"{case['name']}: copy {case['copy_time_s'] * 1e3:.3f} ms, N_min = {case['n_min']}"
        (line,) = ax.plot(n, gain_ms, label=label)
        if case["n_min"] is not None and case["n_min"] <= n[-1]:
            k = case["n_min"]
            ax.plot([k], [(k * saving - case["copy_time_s"]) * 1e3], "o", color=line.get_color())
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_xlabel("batches the hot spot lasts")
    ax.set_ylabel("net gain (ms)")
    ax.set_title(f"Replica payback: saving {saving * 1e3:.3f} ms per batch")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    return png_bytes(fig, dpi)
