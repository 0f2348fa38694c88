"""The training tokens of one layer, as the time planner reads them (`moe_place.solvers.comm`)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from moe_place.analysis.coactivation import coactivation
from moe_place.analysis.dispatch import token_sources

__all__ = ["LayerTokens"]


@dataclass(frozen=True)
class LayerTokens:
    """The training tokens of one layer, every step together.

    ids: int64 `[T, k]` expert ids; step: int64 `[T]` step of each token; home: int64 `[T]` home GPU.
    loads: float64 `[steps, E]` dispatches per expert and step.
    """

    ids: np.ndarray
    step: np.ndarray
    home: np.ndarray
    loads: np.ndarray

    @classmethod
    def from_steps(cls, steps: list[np.ndarray], num_experts: int, num_gpus: int, token_home: str) -> "LayerTokens":
        """From one int `[tokens, k]` array per step (homes are per step, as in `layer_cost`)."""
        ids = np.concatenate([np.asarray(s, dtype=np.int64) for s in steps])
        step = np.concatenate([np.full(s.shape[0], i, dtype=np.int64) for i, s in enumerate(steps)])
        home = np.concatenate([token_sources(s.shape[0], num_gpus, token_home) for s in steps])
        loads = np.stack([np.bincount(np.asarray(s).ravel(), minlength=num_experts) for s in steps])
        return cls(ids, step, home, loads.astype(np.float64))

    @property
    def num_steps(self) -> int:
        return self.loads.shape[0]

    @cached_property
    def pairs(self) -> np.ndarray:
        """float64 `[E, E]`: tokens picking both experts (`coactivation`; the diagonal is each expert's load)."""
        return coactivation(self.ids[:, None, :], self.loads.shape[1])[0].astype(np.float64)

    def affinity(self) -> np.ndarray:
        """float64 `[E, E]`: cosine similarity of the experts' token sets, `pairs[a, b] / sqrt(load_a * load_b)`
        (0 for an unused expert; 1 on the diagonal): how often two experts fire together whatever
        their volume, the part of the co-activation that carries over to other batches."""
        loads = self.loads.sum(axis=0)
        out = self.pairs / np.sqrt(np.maximum(loads[:, None] * loads[None, :], 1.0))
        np.fill_diagonal(out, 1.0)
        return out
