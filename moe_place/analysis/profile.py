"""Per-layer expert-load profile: how skewed a layer's logical experts are.

All functions take `expert_load`, float or int `[layers, E]` (dispatches per logical expert,
summed over a step, window or trace) and return one value per layer. A layer with no load at
all (a dense layer recorded as zeros) counts as balanced: max/mean 1, CV 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_place.errors import InputError

__all__ = ["LoadProfile", "check_expert_load", "coefficient_of_variation", "load_profile", "max_over_mean",
           "top_share"]


def check_expert_load(expert_load: np.ndarray, where: str = "expert_load") -> np.ndarray:
    """Validate `[layers, E]` non-negative finite loads; return them as float64."""
    loads = np.asarray(expert_load)
    if loads.ndim != 2 or loads.shape[1] == 0:
        raise InputError(where, "a 2-D array [layers, experts] with at least one expert", f"shape {loads.shape}")
    if loads.dtype.kind not in "iuf":
        raise InputError(where, "numeric loads", f"dtype {loads.dtype}")
    loads = loads.astype(np.float64)
    if not np.isfinite(loads).all():
        raise InputError(where, "finite loads", "NaN or inf")
    if (loads < 0).any():
        raise InputError(where, "loads >= 0", float(loads.min()))
    return loads


def max_over_mean(loads: np.ndarray) -> np.ndarray:
    """float64 `[...]`: max over mean along the last axis (1 = balanced; 1 where all are zero)."""
    loads = np.asarray(loads, dtype=np.float64)
    mean = loads.mean(axis=-1)
    peak = loads.max(axis=-1)
    return np.divide(peak, mean, out=np.ones_like(mean), where=mean > 0)


def coefficient_of_variation(loads: np.ndarray) -> np.ndarray:
    """float64 `[...]`: population std over mean along the last axis (0 where all are zero)."""
    loads = np.asarray(loads, dtype=np.float64)
    mean = loads.mean(axis=-1)
    return np.divide(loads.std(axis=-1), mean, out=np.zeros_like(mean), where=mean > 0)


def top_share(loads: np.ndarray, top_n: int) -> np.ndarray:
    """float64 `[...]`: share of the total load carried by the `top_n` most loaded entries (0 if empty)."""
    loads = np.asarray(loads, dtype=np.float64)
    if not 1 <= top_n <= loads.shape[-1]:
        raise InputError("top_n", f"an integer in [1, {loads.shape[-1]}]", top_n)
    top = -np.partition(-loads, top_n - 1, axis=-1)[..., :top_n]
    total = loads.sum(axis=-1)
    return np.divide(top.sum(axis=-1), total, out=np.zeros_like(total), where=total > 0)


@dataclass(frozen=True)
class LoadProfile:
    """Skew of each layer's expert loads.

    expert_load: float64 `[layers, E]`, the loads profiled.
    max_over_mean: `[layers]` hottest expert over the mean expert (1 = balanced).
    cv: `[layers]` coefficient of variation (std/mean) of the expert loads.
    zero_load_experts: int64 `[layers]` experts that received no dispatch.
    top_n: how many of the hottest experts `top_share` counts.
    top_share: `[layers]` share of the layer's dispatches that went to its `top_n` hottest experts
        (uniform routing gives about `top_n/E`).
    """

    expert_load: np.ndarray
    max_over_mean: np.ndarray
    cv: np.ndarray
    zero_load_experts: np.ndarray
    top_n: int
    top_share: np.ndarray

    def __post_init__(self) -> None:
        layers, experts = self.expert_load.shape
        for name in ("max_over_mean", "cv", "zero_load_experts", "top_share"):
            if getattr(self, name).shape != (layers,):
                raise InputError(f"LoadProfile.{name}", f"shape ({layers},)", getattr(self, name).shape)
        if not 1 <= self.top_n <= experts:
            raise InputError("top_n", f"an integer in [1, {experts}]", self.top_n)

    @property
    def num_layers(self) -> int:
        return self.expert_load.shape[0]


def load_profile(expert_load: np.ndarray, top_n: int) -> LoadProfile:
    """Profile `[layers, E]` expert loads; `top_n` hottest experts for the top share."""
    loads = check_expert_load(expert_load)
    return LoadProfile(
        expert_load=loads,
        max_over_mean=max_over_mean(loads),
        cv=coefficient_of_variation(loads),
        zero_load_experts=(loads == 0).sum(axis=-1).astype(np.int64),
        top_n=int(top_n),
        top_share=top_share(loads, int(top_n)),
    )
