"""A bounded random sample of a token-level trace's tokens, kept when the trace is reduced to counts.

Counting costs one operation per routing decision; statistics over whole tokens (which experts one
token picks together, `moe_place.analysis.coactivation`) cost k(k-1)/2 per token-layer, 3.5x that
at top-8. They are computed on at most `SAMPLE_TOKENS` tokens drawn at random without replacement
(every token when the trace has no more), so their cost does not grow with the trace.

The draw depends only on the number of tokens (a fixed seed), and positions are in trace order:
step by step in increasing step, file order within a step (the order of `Trace.topk_ids`). So a
trace read whole and the same file streamed (`moe_place.traces.stream`, which keeps the sampled
tokens' ids while counting) hold the same sample, row for row, whatever the chunking or threads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from moe_place.errors import InputError

__all__ = ["SampleCollector", "TokenSample", "sample_positions"]

#: Tokens kept: 8192 tokens x 48 layers x top-8 is 6 MB of int16 ids, about 15 ms of pair counting
#: on one core; `analysis.coactivation` chooses each layer's pair on a quarter of them and counts
#: it on the other three quarters (its standard error is reported with it).
SAMPLE_TOKENS = 8192
SAMPLE_SEED = 20_250_613  # fixed: the same tokens for the same trace, read whole or streamed


def sample_positions(num_tokens: int, size: int | None = None) -> np.ndarray:
    """int64 `[min(num_tokens, size)]`: trace positions of the sampled tokens, in draw order.

    Every token, in order, when `num_tokens <= size` (default `SAMPLE_TOKENS`); otherwise a uniform
    random sample without replacement (each draw is a uniform integer; repeats are skipped, so
    the first `m` positions are themselves a uniform sample of `m` tokens, for any `m`).
    """
    size = SAMPLE_TOKENS if size is None else int(size)
    if num_tokens < 0 or size < 1:
        raise InputError("sample", "num_tokens >= 0 and size >= 1", f"num_tokens={num_tokens}, size={size}")
    if num_tokens <= size:
        return np.arange(num_tokens, dtype=np.int64)
    rng = np.random.default_rng(SAMPLE_SEED)
    picked = np.empty(0, dtype=np.int64)
    while picked.size < size:
        drawn = np.concatenate([picked, rng.integers(0, num_tokens, size=2 * size, dtype=np.int64)])
        _, first = np.unique(drawn, return_index=True)  # first draw of each distinct position
        picked = drawn[np.sort(first)]
    return picked[:size]


@dataclass(frozen=True, eq=False)
class TokenSample:
    """The sampled tokens of a trace.

    ids: int `[n, layers, k]` expert ids of the sampled tokens, row i = `sample_positions(num_tokens)[i]`
        (draw order), n = min(num_tokens, SAMPLE_TOKENS).
    num_tokens: tokens in the whole trace.
    """

    ids: np.ndarray
    num_tokens: int

    def __post_init__(self) -> None:
        if self.ids.ndim != 3 or self.ids.dtype.kind not in "iu":
            raise InputError("TokenSample.ids", "an integer array [n, layers, k]",
                             f"{self.ids.dtype} shape {self.ids.shape}")
        if not 0 <= self.ids.shape[0] <= self.num_tokens:
            raise InputError("TokenSample.ids", f"at most num_tokens={self.num_tokens} rows", self.ids.shape[0])

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])

    @property
    def complete(self) -> bool:
        """Every token of the trace is in the sample (statistics on it are exact)."""
        return self.size == self.num_tokens

    def select_layers(self, positions: Sequence[int]) -> "TokenSample":
        """The same tokens, with only the layers at `positions` (indices into the trace's layers)."""
        return TokenSample(self.ids[:, list(positions), :], self.num_tokens)

    @classmethod
    def of_steps(cls, steps: Sequence[np.ndarray]) -> "TokenSample":
        """The sample of a token-level trace held in memory: `steps` are its per-step int
        `[tokens, layers, k]` arrays, in trace order."""
        num_tokens = sum(ids.shape[0] for ids in steps)
        if num_tokens <= SAMPLE_TOKENS:  # every token: the steps themselves
            return cls(np.concatenate(steps, axis=0) if len(steps) > 1 else steps[0], num_tokens)
        if len(steps) == 1:  # what the collector gives for one chunk, in one call (half its time)
            return cls(np.take(steps[0], sample_positions(num_tokens), axis=0), num_tokens)
        # the steps in trace order are the chunks of a file read in order: the streaming collector
        collector = SampleCollector(num_tokens, steps[0].shape[1:], np.result_type(*steps))
        start = 0
        for ids in steps:
            collector.add(start, ids)
            start += ids.shape[0]
        return collector.sample()


class SampleCollector:
    """Keeps the sampled tokens' ids from chunks of a token-level file read in any order.

    num_tokens, row_shape `(layers, k)`: those of the file's `topk_ids`; dtype: the sample's
        (any integer dtype holding the ids, which `add` copies after they were validated).
    step_index: int `[num_tokens]` step index of each file token (None: one step); trace positions
        are step-major, so with steps out of file order a position maps to the file token
        `argsort(step_index, stable)[position]`.
    `add` may be called from several threads at once: chunks are disjoint, so are the rows they write.
    Memory: the sample's ids, and three int64 arrays of its size.
    """

    def __init__(self, num_tokens: int, row_shape: tuple[int, int], dtype: np.dtype,
                 step_index: np.ndarray | None = None):
        self.num_tokens = num_tokens
        positions = sample_positions(num_tokens)
        if step_index is not None and (step_index[1:] < step_index[:-1]).any():
            positions = np.argsort(step_index, kind="stable")[positions]
        order = np.argsort(positions, kind="stable")
        self._tokens = positions[order]  # file tokens of the sample, increasing
        self._rows = order  # and the sample row each one fills
        self.ids = np.empty((positions.size, *row_shape), dtype=dtype)

    def add(self, start: int, chunk: np.ndarray) -> None:
        """Copy the sampled tokens among file tokens start..start+len(chunk)-1 (`chunk` `[n, layers, k]`)."""
        lo, hi = np.searchsorted(self._tokens, (start, start + chunk.shape[0]))
        if lo < hi:
            self.ids[self._rows[lo:hi]] = chunk[self._tokens[lo:hi] - start]

    def sample(self) -> TokenSample:
        return TokenSample(self.ids, self.num_tokens)
