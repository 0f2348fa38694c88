"""The in-memory routing trace: token-level expert ids or count-level loads, plus metadata.

Two granularities, as real tools produce them:
- token level: for each step, int `[tokens, layers, k]` expert ids (the router's top-k);
- count level: int64 `[steps, layers, experts]` dispatches per expert (what engines record).
A token-level trace can always give counts; a count-level trace cannot give tokens back, except
the bounded random sample of them (`moe_place.traces.sample`) a streamed token file keeps.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from moe_place.errors import InputError
from moe_place.traces.count import DispatchCounter
from moe_place.traces.sample import TokenSample

__all__ = ["Trace", "TraceMeta", "check_counts", "check_topk_ids", "count_dispatches", "located",
           "validated_step_counts"]


MAX_EXPERTS = 1 << 16  # a sanity bound: counts are dense [layers, experts] arrays


@dataclass(frozen=True)
class TraceMeta:
    """What a trace is about.

    layer_ids: the model's layer index of each trace layer (a trace may hold a subset).
    step_names: one name per step (a recording, a domain, a window); empty means `step0..`.
    dtype: the dtype the ids or counts were stored with.
    """

    num_experts: int
    top_k: int
    layer_ids: tuple[int, ...]
    model: str = "unknown"
    source: str = ""
    dtype: str = ""
    step_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.num_experts <= MAX_EXPERTS:
            raise InputError("num_experts", f"an integer in [1, {MAX_EXPERTS}]", self.num_experts)
        if not 1 <= self.top_k <= self.num_experts:
            raise InputError("top_k", f"an integer in [1, num_experts={self.num_experts}]", self.top_k)
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise InputError("layer_ids", "distinct layer indices", list(self.layer_ids))

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)


@dataclass(frozen=True, eq=False)
class Trace:
    """A routing trace. Exactly one of `counts` and `topk_ids` is given.

    counts: int64 `[steps, layers, experts]`.
    topk_ids: tuple of per-step int arrays `[tokens, layers, k]` (tokens may differ per step);
        validated and counted in one pass on construction (`validated_step_counts`), so
        `step_counts` is free.
    sample: with `counts` reduced from token-level ids (a streamed file), the ids of a bounded
        random sample of its tokens (`moe_place.traces.sample`); a token-level trace draws the
        same sample from `topk_ids` (`token_sample`).
    """

    meta: TraceMeta
    counts: np.ndarray | None = None
    topk_ids: tuple[np.ndarray, ...] | None = None
    sample: TokenSample | None = None
    _step_counts: list = field(default_factory=list, init=False, repr=False)
    _sample: list = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if (self.counts is None) == (self.topk_ids is None):
            raise InputError("trace", "exactly one of counts or topk_ids")
        meta = self.meta
        if self.counts is not None:
            counts = check_counts(self.counts, "counts", meta.num_experts)
            if counts.shape[1] != meta.num_layers:
                raise InputError("counts", f"{meta.num_layers} layers (layer_ids)", counts.shape[1])
            object.__setattr__(self, "counts", counts)
        else:
            steps = tuple(self.topk_ids)
            if not steps:
                raise InputError("topk_ids", "at least one step")
            counts = validated_step_counts(steps, meta.num_experts, meta.top_k, meta.num_layers)
            counts.setflags(write=False)
            self._step_counts.append(counts)
            object.__setattr__(self, "topk_ids", steps)
        if meta.step_names and len(meta.step_names) != self.num_steps:
            raise InputError("step_names", f"{self.num_steps} names", len(meta.step_names))
        if self.sample is not None:
            self._check_sample(self.sample)

    def _check_sample(self, sample: TokenSample) -> None:
        if self.topk_ids is not None:
            raise InputError("sample", "a sample only with counts (a token-level trace draws its own)")
        if sample.ids.shape[1:] != (self.num_layers, self.top_k):
            raise InputError("sample", f"ids [n, {self.num_layers} layers, k = {self.top_k}]",
                             f"shape {sample.ids.shape}")
        if sample.num_tokens != self.num_tokens:
            raise InputError("sample", f"a sample of the trace's {self.num_tokens} tokens", sample.num_tokens)
        ids = sample.ids
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num_experts):
            raise InputError("sample", f"expert ids in [0, {self.num_experts})",
                             int(ids.min()) if int(ids.min()) < 0 else int(ids.max()))

    # ------------------------------------------------------------------ shape
    @property
    def is_token_level(self) -> bool:
        return self.topk_ids is not None

    @property
    def num_steps(self) -> int:
        return len(self.topk_ids) if self.topk_ids is not None else self.counts.shape[0]

    @property
    def num_layers(self) -> int:
        return self.meta.num_layers

    @property
    def num_experts(self) -> int:
        return self.meta.num_experts

    @property
    def top_k(self) -> int:
        return self.meta.top_k

    @property
    def step_names(self) -> tuple[str, ...]:
        return self.meta.step_names or tuple(f"step{i}" for i in range(self.num_steps))

    @property
    def num_tokens(self) -> int:
        """Tokens in the whole trace (count level: dispatches of the first layer / top_k)."""
        if self.topk_ids is not None:
            return int(sum(ids.shape[0] for ids in self.topk_ids))
        return int(self.counts[:, 0, :].sum() // self.top_k) if self.num_layers else 0

    # ------------------------------------------------------------------ loads
    def step_counts(self) -> np.ndarray:
        """int64 `[steps, layers, experts]`: dispatches per expert in each step."""
        if self.counts is not None:
            return self.counts
        return self._step_counts[0]  # counted when the ids were validated

    def token_sample(self) -> TokenSample | None:
        """The ids of a bounded random sample of the trace's tokens (`moe_place.traces.sample`):
        drawn from `topk_ids`, or kept while streaming; None for a trace of counts only."""
        if self.topk_ids is None:
            return self.sample
        if not self._sample:
            self._sample.append(TokenSample.of_steps(self.topk_ids))
        return self._sample[0]

    def total_counts(self) -> np.ndarray:
        """int64 `[layers, experts]`: dispatches per expert summed over every step."""
        return self.step_counts().sum(axis=0)

    def window_counts(self, num_windows: int | None = None, where: str = "--windows") -> np.ndarray:
        """int64 `[windows, layers, experts]`: consecutive steps summed into `num_windows` windows
        (None: one window, the whole trace); InputError naming `where` if there are fewer steps."""
        steps = self.step_counts()
        if num_windows is None:
            return steps.sum(axis=0)[None]
        if not 1 <= num_windows <= steps.shape[0]:
            raise InputError(where, f"1 to the {steps.shape[0]} steps of the trace", num_windows)
        return np.stack([part.sum(axis=0) for part in np.array_split(steps, num_windows)])

    def select_layer_ids(self, layer_ids: list[int], where: str = "--layers") -> "Trace":
        """A trace of the layers whose model layer id is in `layer_ids` (InputError names `where`)."""
        positions = {layer_id: pos for pos, layer_id in enumerate(self.meta.layer_ids)}
        missing = [layer for layer in layer_ids if layer not in positions]
        if missing:
            ids = self.meta.layer_ids
            known = (f"{ids[0]}-{ids[-1]}" if list(ids) == list(range(ids[0], ids[-1] + 1))
                     else ",".join(map(str, ids)))
            raise InputError(where, f"layer ids of the trace ({known})", missing[0])
        return self.select_layers([positions[layer] for layer in layer_ids])

    def step_positions(self, selection: Sequence[str | int], where: str = "--steps") -> list[int]:
        """Sorted distinct step positions of `selection`: step names, positions (`2`) and inclusive
        ranges of positions (`0-1`); InputError naming `where` for anything else."""
        names = {name: pos for pos, name in enumerate(self.step_names)}
        last = self.num_steps - 1
        positions: set[int] = set()
        for item in selection:
            text = str(item).strip()
            if text in names:
                positions.add(names[text])
                continue
            try:
                lo, hi = (int(x) for x in text.split("-", 1)) if "-" in text[1:] else (int(text), int(text))
            except ValueError:
                lo, hi = -1, -1
            if not 0 <= lo <= hi <= last:
                listed = ", ".join(self.step_names[:8]) + (", ..." if self.num_steps > 8 else "")
                raise InputError(where, f"steps of the trace: positions 0-{last} or names ({listed})", text)
            positions.update(range(lo, hi + 1))
        return sorted(positions)

    def select_steps(self, positions: list[int]) -> "Trace":
        """A trace of the steps at `positions` (say, the recorded batches a plan is made on), keeping
        their names. A streamed trace's token sample spans every step, so it is left out."""
        for p in positions:
            if not 0 <= p < self.num_steps:
                raise InputError("steps", f"step positions in [0, {self.num_steps})", p)
        if not positions:
            raise InputError("steps", "at least one step")
        meta = TraceMeta(**{**self.meta.__dict__, "step_names": tuple(self.step_names[p] for p in positions)})
        if self.counts is not None:
            return Trace(meta, counts=self.counts[positions])
        return Trace(meta, topk_ids=tuple(self.topk_ids[p] for p in positions))

    def select_layers(self, positions: list[int]) -> "Trace":
        """A trace of the layers at `positions` (indices into `meta.layer_ids`)."""
        for p in positions:
            if not 0 <= p < self.num_layers:
                raise InputError("layers", f"layer positions in [0, {self.num_layers})", p)
        meta = TraceMeta(**{**self.meta.__dict__, "layer_ids": tuple(self.meta.layer_ids[p] for p in positions)})
        if self.counts is not None:
            sample = None if self.sample is None else self.sample.select_layers(positions)
            return Trace(meta, counts=self.counts[:, positions, :], sample=sample)
        return Trace(meta, topk_ids=tuple(ids[:, positions, :] for ids in self.topk_ids))


# ---------------------------------------------------------------------- validation
MAX_COUNT = 2**53  # larger counts lose precision in float arithmetic downstream


def check_counts(counts: np.ndarray, where: str, num_experts: int | None = None) -> np.ndarray:
    """Validate count-level loads `[steps, layers, experts]`; return them as read-only int64."""
    arr = np.asarray(counts)
    if arr.ndim != 3:
        raise InputError(where, "a 3-D array [steps, layers, experts]", f"shape {arr.shape}")
    if arr.size == 0:
        raise InputError(where, "a non-empty array [steps, layers, experts]", f"shape {arr.shape}")
    if num_experts is not None and arr.shape[2] != num_experts:
        raise InputError(where, f"{num_experts} experts (num_experts) on the last axis", arr.shape[2])
    if arr.dtype.kind == "f":
        if not np.isfinite(arr).all():
            raise InputError(where, "finite counts", "NaN or inf")
        if (arr != np.round(arr)).any():
            raise InputError(where, "whole-number counts", "fractional values")
    elif arr.dtype.kind not in "iu":
        raise InputError(where, "integer counts", f"dtype {arr.dtype}")
    if (arr < 0).any():
        raise InputError(where, "counts >= 0", int(arr.min()))
    if arr.max() > MAX_COUNT:
        raise InputError(where, f"counts <= {MAX_COUNT}", arr.max())
    out = np.array(arr, dtype=np.int64)
    out.setflags(write=False)
    return out


def check_topk_ids(ids: np.ndarray, where: str, num_experts: int, top_k: int | None = None,
                   num_layers: int | None = None, workers: int | None = None) -> np.ndarray:
    """Validate token-level expert ids `[tokens, layers, k]` (integer, in range, no repeats per
    token) and return their int64 `[layers, experts]` dispatch counts.

    Validation and counting are one chunked pass (`count.DispatchCounter`, on `workers` threads,
    default `count.resolve_workers()`); an error is that of the earliest bad chunk, as when the
    file is streamed: its id out of range (the smallest if negative, else the largest) or its
    first repeat.
    """
    _check_ids_shape(ids, where, top_k, num_layers)
    if ids.size == 0:
        return np.zeros((ids.shape[1], num_experts), dtype=np.int64)
    return DispatchCounter(ids.shape[1], num_experts, ids.shape[2], where).count(ids, workers=workers)


def validated_step_counts(steps: tuple[np.ndarray, ...], num_experts: int, top_k: int,
                          num_layers: int) -> np.ndarray:
    """int64 `[steps, layers, experts]`: `check_topk_ids` of every step (`topk_ids[step i]` in errors),
    the chunks of all steps counted by one pool of threads."""
    for i, ids in enumerate(steps):
        _check_ids_shape(ids, f"topk_ids[step {i}]", top_k, num_layers)
    if num_layers == 0 or not any(ids.size for ids in steps):
        return np.zeros((len(steps), num_layers, num_experts), dtype=np.int64)
    counter = DispatchCounter(num_layers, num_experts, top_k, "topk_ids")
    return counter.count_steps(steps, where=lambda step: f"topk_ids[step {step}]")


def _check_ids_shape(ids: np.ndarray, where: str, top_k: int | None, num_layers: int | None) -> None:
    if ids.dtype.kind not in "iu":
        raise InputError(where, "integer expert ids", f"dtype {ids.dtype}")
    if ids.ndim != 3:
        raise InputError(where, "a 3-D array [tokens, layers, k]", f"shape {ids.shape}")
    if top_k is not None and ids.shape[2] != top_k:
        raise InputError(where, f"k = top_k = {top_k} ids per token", ids.shape[2])
    if num_layers is not None and ids.shape[1] != num_layers:
        raise InputError(where, f"{num_layers} layers", ids.shape[1])


def count_dispatches(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """int64 `[layers, experts]`: how often each expert appears, per layer, in `[tokens, layers, k]`."""
    num_layers = ids.shape[1]
    offsets = (np.arange(num_layers, dtype=np.int64) * num_experts)[None, :, None]
    flat = (ids.astype(np.int64) + offsets).ravel()
    return np.bincount(flat, minlength=num_layers * num_experts).reshape(num_layers, num_experts)


@contextmanager
def located(path: str | Path) -> Iterator[None]:
    """Prefix the `where` of InputErrors raised inside with the file `path` (if not there yet)."""
    try:
        yield
    except InputError as exc:
        if str(path) in exc.where:
            raise
        raise InputError(f"{path}: {exc.where}", exc.expected, exc.got) from None
