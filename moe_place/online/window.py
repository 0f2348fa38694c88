"""The engines' load window: the last steps of per-step counts, as a ring buffer.

Engines record dispatches per expert and step (vLLM keeps a ring buffer `[window, layers,
physical]`, SGLang's recorder a circular buffer of per-pass counts); the replay's controllers
keep the same thing per logical expert and hand it to the policy at each call.
"""

from __future__ import annotations

import numpy as np

from moe_place.errors import InputError


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
