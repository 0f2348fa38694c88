"""The redundancy sizing curve: held-out busiest/mean and the KV-cache tokens the replicas take, against R."""

from __future__ import annotations

from moe_place.plotting import new_figure, png_bytes
from moe_place.solvers.sizing import Sizing

__all__ = ["render_sizing_png"]


def render_sizing_png(sizing: Sizing, dpi: int = 110) -> bytes:
    """PNG bytes: held-out busiest/mean per candidate R (the folds' range shaded, the lower convex
    hull dashed, the recommendation marked) and, on the right axis, the KV tokens lost per GPU
    (the replica GiB per GPU when the KV bytes per token are unknown)."""
    rows = sizing.rows
    r = [row.redundant for row in rows]
    fig = new_figure((8.0, 4.6), layout="constrained")
    ax = fig.subplots()
    ax.fill_between(r, [min(row.fold_held_out) for row in rows], [max(row.fold_held_out) for row in rows],
                    color="tab:blue", alpha=0.15, label="held-out folds (min-max)")
    ax.plot(r, [row.held_out for row in rows], marker=".", color="tab:blue", label="held-out busiest/mean (mean)")
    hull = [row for row in rows if row.on_hull]
    ax.plot([row.redundant for row in hull], [row.held_out for row in hull], linestyle="--", color="tab:blue",
            linewidth=0.9, label="lower convex hull")
    chosen = next(row for row in rows if row.redundant == sizing.recommended)
    ax.axvline(chosen.redundant, color="tab:green", linewidth=1.0)
    ax.plot([chosen.redundant], [chosen.held_out], marker="*", markersize=13, color="tab:green",
            label=f"recommended R = {chosen.redundant}")
    ax.set_xlabel("redundant experts per layer R")
    ax.set_ylabel("held-out busiest/mean GPU")
    ax.grid(alpha=0.3)
    cost = ax.twinx()
    if sizing.memory.kv_bytes_per_token is not None:
        cost.plot(r, [row.kv_tokens_per_gpu / 1e3 for row in rows], color="tab:red", marker=".", linewidth=1.0,
                  label="KV tokens lost per GPU")
        cost.set_ylabel("KV tokens lost per GPU (thousands)", color="tab:red")
    else:
        cost.plot(r, [row.replica_gib_per_gpu for row in rows], color="tab:red", marker=".", linewidth=1.0,
                  label="replica GiB per GPU")
        cost.set_ylabel("replica memory per GPU (GiB)", color="tab:red")
    cost.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()
    more = cost.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3,
              fontsize=8, frameon=False)
    ax.set_title(f"Redundancy sizing: E = {sizing.num_experts} on {sizing.num_gpus} GPUs "
                 f"({sizing.memory.source}; price {sizing.min_gain_per_gib:.1%} per GiB per GPU)", fontsize=10)
    return png_bytes(fig, dpi)
