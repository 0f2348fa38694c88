"""Step 5 of the time planner: which layers to group, judged on held-out windows."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_place.analysis.windows import consecutive_runs
from moe_place.errors import InputError

__all__ = ["HeldOut", "Pooled", "comm_gains", "compute_savings", "cv_windows", "expected_savings", "guard",
           "layer_gains", "shrunk_means", "traffic_savings"]

DECISIONS = ("expected", "guard")     # step 5: the expected saving over the layers (default), or the per-layer guard
JUDGES = ("comm", "layer")            # the guard judges dispatch + combine (the default) or the whole layer time
MIN_SAVING = 0.05                     # the guard's default bar: the saving, every window, as a share of the layer time
MAX_WINDOWS = 3                       # cross-validation windows (folds) at most


@dataclass(frozen=True)
class HeldOut:
    """One layer's plan on one held-out window (step 5): dispatch + combine and compute, seconds."""

    comm_s: float
    compute_s: float

    @classmethod
    def of(cls, cost) -> "HeldOut":
        """From a `LayerCost`."""
        return cls(cost.dispatch_s + cost.combine_s, cost.compute_s)

    @property
    def layer_time_s(self) -> float:
        return self.comm_s + self.compute_s


def traffic_savings(grouped: tuple[HeldOut, ...], balance: tuple[HeldOut, ...]) -> tuple[float, ...]:
    """Per window, the dispatch + combine time the grouped plan saves, as a share of the balance-only plan's
    layer time (what step 5 judges: the saving has to outweigh the chance in the compute, which is
    measured in layer time)."""
    return tuple((b.comm_s - g.comm_s) / b.layer_time_s if b.layer_time_s > 0 else 0.0
                 for g, b in zip(grouped, balance))


def comm_gains(grouped: tuple[HeldOut, ...], balance: tuple[HeldOut, ...]) -> tuple[float, ...]:
    """Per window, the share of the balance-only plan's dispatch + combine time the grouped plan saves
    (0 where the balance-only plan has none)."""
    return tuple(1.0 - g.comm_s / b.comm_s if b.comm_s > 0 else 0.0 for g, b in zip(grouped, balance))


def layer_gains(grouped: tuple[HeldOut, ...], balance: tuple[HeldOut, ...]) -> tuple[float, ...]:
    """Per window, the share of the balance-only plan's layer time the grouped plan saves."""
    return tuple(1.0 - g.layer_time_s / b.layer_time_s if b.layer_time_s > 0 else 0.0
                 for g, b in zip(grouped, balance))


def guard(grouped: tuple[HeldOut, ...], balance: tuple[HeldOut, ...], judge: str = "comm",
          min_saving: float = MIN_SAVING) -> bool:
    """The per-layer guard (step 5, `decision="guard"`): group one layer only if its grouped plan saves more
    than `min_saving` of the balance-only plan's layer time on every held-out window: by its dispatch + combine (`judge="comm"`, the
    default, `traffic_savings`; compute is hedged by steps 2 and 4, the package docstring) or by the whole layer
    time (`judge="layer"`, `layer_gains`: what judging compute on the windows too does). No window: no
    grouping."""
    if judge not in JUDGES:
        raise InputError("judge", f"one of {', '.join(JUDGES)}", judge)
    gains = layer_gains(grouped, balance) if judge == "layer" else traffic_savings(grouped, balance)
    return bool(gains) and min(gains) > min_saving


def compute_savings(grouped: tuple[HeldOut, ...], balance: tuple[HeldOut, ...]) -> tuple[float, ...]:
    """Per window, the compute time the grouped plan saves (negative: loses), as a share of the balance-only
    plan's layer time (step 5: the compute risk)."""
    return tuple((b.compute_s - g.compute_s) / b.layer_time_s if b.layer_time_s > 0 else 0.0
                 for g, b in zip(grouped, balance))


@dataclass(frozen=True)
class Pooled:
    """One part of the expected saving, estimated over the layers (step 5, `shrunk_means`).

    mean: the mean over the layers of their window means (a share of the layer time). weight: the
    James-Stein factor in [0, 1], how much of a layer's own deviation from that mean is kept (0: every
    layer gets the mean; 1: each its own). noise: the variance of a layer's window mean (pooled over the
    layers). layers: how many layers were pooled.
    """

    mean: float
    weight: float
    noise: float
    layers: int

    def to_dict(self) -> dict:
        return {"mean": self.mean, "weight": self.weight, "noise": self.noise, "layers": self.layers}


def shrunk_means(values: np.ndarray) -> tuple[np.ndarray, Pooled]:
    """(float64 `[L]` estimates, Pooled): each layer's mean of `values` (float `[L, W]`: L layers, W >= 2
    windows each) shrunk toward the mean over the layers by the positive-part James-Stein factor
    `max(0, 1 - (L - 3) * noise / sum_l (mean_l - mean)^2)`, `noise` = the within-layer variance of
    the windows (ddof 1, averaged over the layers) over W. Fewer than four layers: the own means."""
    values = np.asarray(values, dtype=np.float64)
    layers, windows = values.shape
    own = values.mean(axis=1)
    noise = float(values.var(axis=1, ddof=1).mean() / windows) if windows > 1 else 0.0
    mean = float(own.mean()) if layers else 0.0
    if layers < 4:
        return own, Pooled(mean, 1.0, noise, layers)
    spread = float(((own - mean) ** 2).sum())
    weight = max(0.0, 1.0 - (layers - 3) * noise / spread) if spread > 0 else 0.0
    return mean + weight * (own - mean), Pooled(mean, weight, noise, layers)


def expected_savings(evidence: list[tuple[tuple[HeldOut, ...], tuple[HeldOut, ...]]]
                     ) -> tuple[np.ndarray, dict[str, Pooled]]:
    """(float64 `[L]`, {"traffic": Pooled, "compute": Pooled}): step 5's expected saving of grouping each
    layer, a share of its balance-only layer time: the windows' dispatch + combine saving
    (`traffic_savings`) and compute saving (`compute_savings`), each estimated over the layers by
    `shrunk_means`, added. evidence: per layer, its grouped and balance-only windows (the same count,
    at least two, for every layer)."""
    if not evidence:
        return np.zeros(0), {}
    traffic = np.array([traffic_savings(g, b) for g, b in evidence])
    compute = np.array([compute_savings(g, b) for g, b in evidence])
    traffic_est, traffic_pool = shrunk_means(traffic)
    compute_est, compute_pool = shrunk_means(compute)
    return traffic_est + compute_est, {"traffic": traffic_pool, "compute": compute_pool}


def cv_windows(steps: list[np.ndarray]) -> list[list[np.ndarray]]:
    """Windows of the training steps for cross-validation: `min(steps, MAX_WINDOWS)` runs of
    consecutive steps; a single step is split into its two halves. Each item is a list of
    int `[tokens, layers, k]` arrays."""
    if len(steps) == 1:
        half = steps[0].shape[0] // 2
        if half == 0:
            return []
        return [[steps[0][:half]], [steps[0][half:]]]
    return [list(steps[run.start:run.stop]) for run in consecutive_runs(len(steps), MAX_WINDOWS)]
