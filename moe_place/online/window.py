"""The engines' load window (a ring buffer of per-step counts) and the persistence of hot spots.

Engines record dispatches per expert and step (vLLM keeps a ring buffer `[window, layers,
physical]`, SGLang's recorder a circular buffer of per-pass counts); the replay's controllers
keep the same thing per logical expert and hand it to the policy at each call.

A *hot spot* is an expert whose per-step load over recent steps exceeds `hot_factor` times the
layer's mean. `HotSpotTracker` measures how long hot spots last (in steps, at the resolution of
the checks) and predicts how much longer the current ones will last: the mean residual life of
the runs seen so far, `E[L - a | L > a]` for a spot of age `a` (the offload replay's payback rule,
`moe_place.online.offload`, uses it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moe_place.errors import InputError

__all__ = ["HotSpotTracker", "SlidingWindow"]


class SlidingWindow:
    """The last `capacity` steps of per-step counts `[layers, E]` (a ring buffer)."""

    def __init__(self, capacity: int, num_layers: int, num_experts: int):
        if capacity < 1:
            raise InputError("window", "an integer >= 1 steps", capacity)
        self.capacity = capacity
        self._buffer = np.zeros((capacity, num_layers, num_experts), dtype=np.float64)
        self._count = 0

    @property
    def num_steps(self) -> int:
        """Steps held (at most `capacity`)."""
        return min(self._count, self.capacity)

    def push(self, counts: np.ndarray) -> None:
        counts = np.asarray(counts, dtype=np.float64)
        if counts.shape != self._buffer.shape[1:]:
            raise InputError("step counts", f"shape {self._buffer.shape[1:]}", counts.shape)
        self._buffer[self._count % self.capacity] = counts
        self._count += 1

    def last(self, steps: int) -> np.ndarray:
        """float64 `[n, layers, E]`: the last `min(steps, held)` steps, oldest first."""
        n = min(steps, self.num_steps)
        idx = (self._count - n + np.arange(n)) % self.capacity
        return self._buffer[idx]

    def total(self, steps: int | None = None) -> np.ndarray:
        """float64 `[layers, E]`: counts summed over the last `steps` steps (default: all held)."""
        return self.last(self.capacity if steps is None else steps).sum(axis=0)


@dataclass
class HotSpotTracker:
    """Measured persistence of hot spots (see the module note).

    hot_factor: an expert is hot when its per-step load exceeds `hot_factor` x the layer mean.
    prior_steps: expected remaining life before `min_runs` runs have been seen.
    interval_steps: steps between updates (the age a spot gets at its first sighting).
    """

    hot_factor: float = 2.0
    interval_steps: int = 1
    prior_steps: float = 64.0
    min_runs: int = 8
    max_runs: int = 4096
    _age: np.ndarray | None = field(default=None, init=False, repr=False)
    _runs: list = field(default_factory=list, init=False, repr=False)
    _last_step: int | None = field(default=None, init=False, repr=False)

    def update(self, step: int, per_step_load: np.ndarray) -> np.ndarray:
        """Record which experts are hot at `step` given recent per-step loads `[layers, E]`; returns the hot mask."""
        load = np.asarray(per_step_load, dtype=np.float64)
        mean = load.mean(axis=-1, keepdims=True)
        hot = load > self.hot_factor * np.maximum(mean, 1e-12)
        elapsed = self.interval_steps if self._last_step is None else step - self._last_step
        if self._age is None:
            self._age = np.zeros(load.shape, dtype=np.float64)
        ended = (self._age > 0) & ~hot
        self._runs.extend(self._age[ended].tolist())
        del self._runs[: max(0, len(self._runs) - self.max_runs)]
        self._age = np.where(hot, self._age + max(elapsed, 1), 0.0)  # hot since the previous update
        self._last_step = step
        return hot

    @property
    def runs(self) -> np.ndarray:
        """float64 `[runs]`: lengths in steps of the hot spots that have ended."""
        return np.asarray(self._runs, dtype=np.float64)

    def expected_remaining_steps(self, age: float) -> float:
        """Mean residual life `E[L - a | L > a]` of a hot spot of age `a` steps (the prior with few runs)."""
        runs = self.runs
        longer = runs[runs > age]
        if len(runs) < self.min_runs or len(longer) == 0:
            return self.prior_steps if len(runs) < self.min_runs else float(max(1.0, runs.mean() / 2))
        return float((longer - age).mean())

    def expected_duration_steps(self, weights: np.ndarray | None = None) -> float:
        """Expected remaining life of the current hot spots, weighted by `weights [layers, E]` (default equal)."""
        if self._age is None or not (self._age > 0).any():
            return self.expected_remaining_steps(0.0)
        ages = self._age[self._age > 0]
        w = np.ones_like(ages) if weights is None else np.asarray(weights, dtype=np.float64)[self._age > 0]
        remaining = np.array([self.expected_remaining_steps(a) for a in ages])
        if w.sum() <= 0:
            return float(remaining.mean())
        return float((remaining * w).sum() / w.sum())
