"""One PNG summary of an analysis: expert-load heatmap (layers x experts) and the EP sweep.

Rendered with matplotlib's Agg canvas directly (no pyplot state); returns PNG bytes so the
caller writes them atomically with `moe_place.io.write_atomic`.
"""

from __future__ import annotations

import numpy as np

from moe_place.analysis.report import TraceAnalysis
from moe_place.plotting import new_figure, png_bytes

__all__ = ["render_png"]


def render_png(analysis: TraceAnalysis, dpi: int = 110) -> bytes:
    """PNG bytes of the heatmap (left) and the busiest/mean GPU vs EP size curve (right)."""
    fig = new_figure((14, 6.2), layout="constrained")
    heat_ax, sweep_ax = fig.subplots(1, 2, width_ratios=[1.55, 1])
    _heatmap(fig, heat_ax, analysis)
    _sweep(sweep_ax, analysis)
    trace = analysis.trace
    fig.suptitle(f"{trace.meta.model}: {trace.num_layers} layers, {trace.num_experts} experts, top-{trace.top_k}, "
                 f"{trace.num_tokens:,} tokens in {trace.num_steps} steps", fontsize=13, fontweight="bold")
    return png_bytes(fig, dpi)


def _heatmap(fig, ax, analysis: TraceAnalysis) -> None:
    prof = analysis.profile
    mean = prof.expert_load.mean(axis=1, keepdims=True)
    relative = np.divide(prof.expert_load, mean, out=np.zeros_like(prof.expert_load), where=mean > 0)
    top = max(2.0, float(np.percentile(relative, 99.5)))
    layers, experts = relative.shape
    image = ax.imshow(relative, aspect="auto", cmap="magma", vmin=0.0, vmax=top, interpolation="nearest",
                      origin="lower", extent=(-0.5, experts - 0.5, -0.5, layers - 0.5))
    ax.set_title("Expert load per layer (summed over all steps)")
    ax.set_xlabel("logical expert id")
    ax.set_ylabel("MoE layer")
    layer_ids = analysis.trace.meta.layer_ids
    step = next(s for s in (1, 2, 4, 5, 8, 10, 16, 20, 25, 50, 100) if layers / s <= 13 or s == 100)
    ticks = np.arange(0, layers, step)
    ax.set_yticks(ticks, [str(layer_ids[t]) for t in ticks])
    bar = fig.colorbar(image, ax=ax, extend="max" if relative.max() > top else "neither", pad=0.01)
    bar.set_label("load / layer mean (1 = average expert)")


def _sweep(ax, analysis: TraceAnalysis) -> None:
    sizes = np.array([p.ep_size for p in analysis.ep])
    skew = np.stack([p.balance.max_over_mean for p in analysis.ep])  # [sizes, layers]
    ax.plot(sizes, skew.max(axis=1), "o-", color="tab:red", label="all steps summed: worst layer (contiguous)")
    ax.plot(sizes, skew.mean(axis=1), "o-", color="tab:blue", label="all steps summed: mean over layers (contiguous)")
    label_box = dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none", alpha=0.8)
    for x, worst, mean in zip(sizes, skew.max(axis=1), skew.mean(axis=1)):
        ax.annotate(f"{worst:.2f}", (x, worst), textcoords="offset points", xytext=(0, 7), ha="center",
                    fontsize=8, color="tab:red", bbox=label_box, zorder=5)
        ax.annotate(f"{mean:.2f}", (x, mean), textcoords="offset points", xytext=(0, -15), ha="center",
                    fontsize=8, color="tab:blue", bbox=label_box, zorder=5)
    shifts = [(p.ep_size, s) for p, s in zip(analysis.ep, analysis.out_of_sample) if s is not None]
    if shifts:
        xs = [x for x, _ in shifts]
        ax.plot(xs, [s.contiguous.mean() for _, s in shifts], "^--", color="tab:blue", alpha=0.55,
                label="per window: contiguous (mean)")
        ax.plot(xs, [s.out_of_sample.mean() for _, s in shifts], "s--", color="tab:green",
                label="per window: +1 replica/GPU of the hottest,\n  planned on the previous window (mean)")
        ax.plot(xs, [s.in_sample.mean() for _, s in shifts], "s:", color="tab:green", alpha=0.6,
                label="per window: same plan made on the window itself")
    ax.axhline(1.0, color="grey", linestyle=":", linewidth=1, label="perfect balance")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.minorticks_off()
    ax.set_ylim(bottom=0.75, top=float(skew.max()) * 1.12 + 0.05)
    ax.set_title("Busiest / mean GPU rows vs EP size")
    ax.set_xlabel("EP size (GPUs)")
    ax.set_ylabel("busiest GPU rows / mean GPU rows")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize=8.5)
