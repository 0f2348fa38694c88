"""Active experts: how many distinct experts a batch touches, against formula 2 of docs/MODEL.md.

Under uniform routing a batch of `M` tokens, each picking `K` distinct experts of `E`, touches
`E[U] = E * (1 - (1 - K/E)^M)` experts on average. Each touched expert's weights are read at
least once, so for small batches E[U] (not M*K) sets the weight traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_place.errors import InputError

__all__ = ["ActiveExperts", "active_experts", "expected_active_experts"]


def expected_active_experts(num_experts: int, top_k: int, num_tokens: np.ndarray | float) -> np.ndarray | float:
    """E[U] = E * (1 - (1 - K/E)^M): distinct experts a batch of `num_tokens` touches (uniform routing)."""
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise InputError("top_k", f"an integer in [1, num_experts={num_experts}]", top_k)
    tokens = np.asarray(num_tokens, dtype=np.float64)
    if (tokens < 0).any():
        raise InputError("num_tokens", "a number >= 0", float(tokens.min()))
    expected = num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)
    return float(expected) if expected.ndim == 0 else expected


@dataclass(frozen=True)
class ActiveExperts:
    """Distinct experts touched per batch (step), observed and expected under uniform routing.

    observed: int64 `[batches, layers]` experts with at least one dispatch.
    num_tokens: float64 `[batches, layers]` tokens of the batch (dispatches / top_k).
    expected: float64 `[batches, layers]` E[U] for that many tokens.
    """

    num_experts: int
    top_k: int
    observed: np.ndarray
    num_tokens: np.ndarray
    expected: np.ndarray

    def __post_init__(self) -> None:
        if self.observed.ndim != 2 or self.num_tokens.shape != self.observed.shape or \
                self.expected.shape != self.observed.shape:
            raise InputError("ActiveExperts", "observed, num_tokens and expected of one shape [batches, layers]")
        if (self.observed > self.num_experts).any():
            raise InputError("ActiveExperts.observed", f"at most num_experts={self.num_experts}")


def active_experts(step_counts: np.ndarray, top_k: int) -> ActiveExperts:
    """Active experts of each `[batches, layers, E]` batch (e.g. `trace.step_counts()`)."""
    counts = np.asarray(step_counts)
    if counts.ndim != 3:
        raise InputError("step_counts", "a 3-D array [batches, layers, experts]", f"shape {counts.shape}")
    num_experts = counts.shape[2]
    tokens = counts.sum(axis=2) / top_k
    return ActiveExperts(num_experts, top_k, (counts > 0).sum(axis=2).astype(np.int64), tokens,
                         np.asarray(expected_active_experts(num_experts, top_k, tokens)))
