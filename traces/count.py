"""Count extraction with validation: token-level expert ids -> dispatches per expert.

The hot path of reading token-level traces. Per chunk of ids `[tokens, layers, k]`:
1. range check: one `max` pass (signed ids viewed as unsigned, so negatives become huge and fail
   the same `< num_experts` test); min and max are computed only to word the error;
2. keys = id + layer * num_experts, in the narrowest integer dtype that holds them;
3. repeat check on the keys: the flat key stream holds each token-layer's k ids side by side, so
   "the same expert twice in one token's top-k" is `key[t] == key[t + s]` for some shift
   s in 1..k-1 with t and t+s in the same row. Pairs that straddle two rows compare keys of two
   different layers (adjacent rows are adjacent layers), which can never be equal, so no mask is
   needed: k-1 contiguous vector compares, no sort. (One-layer traces get an alternating offset
   per row so that neighbouring rows still differ.) The k-1 shifts are ONE `np.equal` over a
   `[k-1, n]` strided view of the keys (k-1 sentinels -1 after them) and one `any`: two long
   numpy calls instead of 2(k-1) short ones, so threads rarely wait for each other's GIL (a
   waiting thread cannot wake up within a call of a few microseconds); the exact row is looked
   up shift by shift only when a repeat exists.
4. one `np.bincount` over the keys gives every layer's counts at once.
Buffers are allocated once per chunk size and reused, so memory is bounded by the chunk.

Parallelism: numpy releases the GIL inside ufuncs and `np.bincount`'s counting loop, so chunks are
validated and counted on `workers` threads (`run_chunks`; default `min(2, usable cores)`, the
environment variable MOE_PLACE_THREADS overrides, 1 = sequential, at most the usable cores), the calling thread being one of
them. Each thread has its own scratch (`DispatchCounter.clone`) and its own counts of the step it
is in (`StepSums`), added to the shared counts when it moves to another step and at the end
(integer sums: exact in any order); the error raised is that of the earliest bad chunk, so the
counts and the errors are the same as sequentially.
"""

from __future__ import annotations

import os
import threading
from functools import lru_cache
from typing import Callable, Generic, Sequence, TypeVar

import numpy as np

from moe_place.cores import parse_workers, usable_cores, workers_expected
from moe_place.errors import InputError

__all__ = ["DispatchCounter", "PerThread", "StepSums", "chunk_tokens_for", "key_dtype", "resolve_workers",
           "run_chunks"]

CHUNK_ELEMENTS = 1 << 18  # ids per chunk: 512 KB of int16 (+ k-1 compare flags per id, np.bincount's int64 copy: 2 MB)
THREADS_ENV = "MOE_PLACE_THREADS"

T = TypeVar("T")


def resolve_workers(workers: int | None = None) -> int:
    """Threads for count extraction: `workers` if given, else $MOE_PLACE_THREADS (1 up to the usable
    cores, as `--jobs`: `moe_place.cores`), else min(2, cores)."""
    if workers is None:
        value = os.environ.get(THREADS_ENV, "").strip()
        if not value:
            return min(2, usable_cores())
        workers = parse_workers(value)
        if workers is None:
            raise InputError(THREADS_ENV, f"{workers_expected()}: threads for counting a trace", repr(value))
        return workers
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise InputError("workers", "an integer >= 1", workers)
    return workers


def run_chunks(starts: Sequence[int], workers: int, process: Callable[[int], None]) -> None:
    """Call `process(start)` once for every start, on `workers` threads (this thread is one of them).

    Starts are handed out one at a time in increasing order from a shared cursor, so each thread
    holds one chunk at a time (memory: one chunk's scratch per thread, nothing queued). When a call
    raises, nothing after it is handed out, the calls already running finish, and the exception of
    the SMALLEST failing start is raised - the one a sequential loop would raise, whatever the
    timing: every smaller start was handed out before it and has finished. `process` must write
    only per-thread state (`PerThread`) or take a lock.

    Hand-written rather than `ThreadPoolExecutor.map` (which also keeps order and the earliest
    error): with the executor the calling thread only waits, and wakes for every finished chunk,
    competing with the workers for the GIL - measured slower on 2 cores (100 MB in memory:
    114 ms vs 97 ms; a 276 MB file streamed: 377 ms vs 313 ms).
    """
    lock = threading.Lock()
    cursor = {"next": 0, "stop": len(starts)}  # hand out starts[next] while next < stop
    errors: dict[int, BaseException] = {}

    def work() -> None:
        while True:
            with lock:
                i = cursor["next"]
                if i >= cursor["stop"]:
                    return
                cursor["next"] = i + 1
            try:
                process(starts[i])
            except BaseException as exc:
                with lock:
                    errors[i] = exc
                    # an interrupt stops everything at once; an input error only what comes after it
                    cursor["stop"] = min(cursor["stop"], i if isinstance(exc, Exception) else -1)
                return

    helpers = [threading.Thread(target=work, name=f"moe-place-count-{n}", daemon=True) for n in range(workers - 1)]
    try:
        for helper in helpers:
            helper.start()
        work()
        for helper in helpers:
            helper.join()
    except BaseException:  # interrupted outside `process`: the helpers stop after their chunk
        with lock:
            cursor["stop"] = -1
        raise
    if errors:
        interrupts = [i for i, exc in errors.items() if not isinstance(exc, Exception)]
        raise errors[min(interrupts or errors)]


class PerThread(Generic[T]):
    """One object per calling thread, made by `make()` on the thread's first `get()`; `made` lists them
    all (to fold per-thread results once the threads are done)."""

    def __init__(self, make: Callable[[], T]):
        self._make = make
        self._local = threading.local()
        self.made: list[T] = []

    def get(self) -> T:
        value = getattr(self._local, "value", None)
        if value is None:
            value = self._local.value = self._make()
            self.made.append(value)
        return value


class StepSums:
    """One thread's counts `[layers, experts]` of step `step` not yet added to the shared
    `counts` `[steps, layers, experts]`: added under `lock` when the thread moves to another step
    (`of_step`) and by `flush` at the end, so threads rarely wait for each other."""

    def __init__(self, counts: np.ndarray, lock: threading.Lock):
        self.sums = np.zeros(counts.shape[1:], dtype=np.int64)
        self.step = 0
        self._counts = counts
        self._lock = lock

    def of_step(self, step: int) -> np.ndarray:
        """The array to add step `step`'s counts to (another step's sums are flushed first)."""
        if step != self.step:
            self.flush()
            self.step = step
        return self.sums

    def flush(self) -> None:
        with self._lock:
            self._counts[self.step] += self.sums
        self.sums.fill(0)


def chunk_tokens_for(num_layers: int, top_k: int, chunk_tokens: int | None = None) -> int:
    """Tokens per chunk: `chunk_tokens` if given, else about CHUNK_ELEMENTS ids."""
    if chunk_tokens is not None:
        if chunk_tokens < 1:
            raise InputError("chunk_tokens", "an integer >= 1", chunk_tokens)
        return chunk_tokens
    return max(1, CHUNK_ELEMENTS // max(1, num_layers * top_k))


def key_dtype(num_keys: int) -> np.dtype:
    """The narrowest signed dtype holding keys 0..num_keys-1."""
    for dtype in (np.int16, np.int32):
        if num_keys <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.int64)


class DispatchCounter:
    """Validates chunks of `[tokens, layers, k]` ids and adds their dispatches to `[layers, experts]` rows.

    where: names the file/field in errors. Reuse one counter for all chunks of a trace.
    """

    def __init__(self, num_layers: int, num_experts: int, top_k: int, where: str):
        if num_layers < 1 or num_experts < 1 or top_k < 1:
            raise InputError(where, "at least one layer, expert and id per token",
                             f"layers={num_layers}, experts={num_experts}, k={top_k}")
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.top_k = top_k
        self.where = where
        # A one-layer trace counts as two virtual layers (even/odd tokens), folded afterwards.
        self._virtual_layers = 2 if num_layers == 1 else num_layers
        self._num_keys = self._virtual_layers * num_experts
        self._dtype = key_dtype(self._num_keys)
        self._keys = np.empty(0, dtype=self._dtype)  # chunk keys, then k - 1 sentinels
        self._equal = np.empty(0, dtype=bool)  # [k - 1, chunk ids] compare flags
        self._offsets = np.empty(0, dtype=self._dtype)
        self._shift_views: tuple[int, np.ndarray, np.ndarray, np.ndarray] | None = None

    def clone(self) -> "DispatchCounter":
        """A counter for the same trace with its own scratch buffers (one per thread); the read-only
        key offsets are shared."""
        other = DispatchCounter(self.num_layers, self.num_experts, self.top_k, self.where)
        other._offsets = self._offsets
        return other

    def reserve(self, chunk_tokens: int) -> None:
        """Build the key offsets for chunks of up to `chunk_tokens` tokens now (before cloning)."""
        if self._offsets.size < chunk_tokens * self.num_layers * self.top_k:
            self._offsets = self._offset_tile(chunk_tokens)

    # ------------------------------------------------------------------ public
    def add(self, ids: np.ndarray, out: np.ndarray, token_offset: int = 0) -> None:
        """Validate `ids` int `[tokens, layers, k]` and add its counts to `out` int64 `[layers, experts]`.

        token_offset: index of the chunk's first token in the whole trace (for error messages).
        """
        n, num_layers, k = self._check_shape(ids)
        if n == 0:
            return
        self._check_range(ids)
        keys = self._make_keys(ids)
        self._check_repeats(keys, n, token_offset)
        hist = np.bincount(keys, minlength=self._num_keys)
        if self.num_layers == 1:
            out[0] += hist[: self.num_experts] + hist[self.num_experts:]
        else:
            out += hist.reshape(self.num_layers, self.num_experts)

    def count(self, ids: np.ndarray, chunk_tokens: int | None = None, workers: int | None = None) -> np.ndarray:
        """int64 `[layers, experts]` counts of a whole in-memory array, validated chunk by chunk.

        workers: threads (default `resolve_workers()`); the counts and the error raised (that of the
        earliest bad chunk) do not depend on it.
        """
        return self.count_steps([ids], chunk_tokens, workers)[0]

    def count_steps(self, steps: Sequence[np.ndarray], chunk_tokens: int | None = None, workers: int | None = None,
                    where: Callable[[int], str] | None = None) -> np.ndarray:
        """int64 `[len(steps), layers, experts]` counts of in-memory arrays `[tokens, layers, k]`, one per
        step, validated chunk by chunk; the chunks of every step share one pool of threads, so many
        small steps are counted in parallel too.

        workers: threads (default `resolve_workers()`); the counts and the error raised (that of the
        earliest bad chunk, steps in order) do not depend on it.
        where: names step s in errors (default: this counter's `where` for every step).
        """
        workers = resolve_workers(workers)
        out = np.zeros((len(steps), self.num_layers, self.num_experts), dtype=np.int64)
        chunk_tokens = chunk_tokens_for(self.num_layers, self.top_k, chunk_tokens)
        tasks = [(step, start) for step, ids in enumerate(steps) for start in range(0, ids.shape[0], chunk_tokens)]

        def named(step: int, add: Callable[[], None]) -> None:
            try:
                add()
            except InputError as exc:
                if where is None:
                    raise
                raise InputError(where(step), exc.expected, exc.got) from None

        if workers == 1 or len(tasks) < 2:
            for step, start in tasks:
                named(step, lambda: self.add(steps[step][start:start + chunk_tokens], out[step], start))
            return out
        for step, ids in enumerate(steps):
            named(step, lambda: self._check_shape(ids))
        self.reserve(chunk_tokens)
        lock = threading.Lock()
        scratch = PerThread(lambda: (self.clone(), StepSums(out, lock)))

        def process(task: int) -> None:
            step, start = tasks[task]
            counter, sums = scratch.get()
            named(step, lambda: counter.add(steps[step][start:start + chunk_tokens], sums.of_step(step), start))

        run_chunks(range(len(tasks)), workers, process)
        for _, sums in scratch.made:
            sums.flush()
        return out

    # ------------------------------------------------------------------ steps
    def _check_shape(self, ids: np.ndarray) -> tuple[int, int, int]:
        if ids.ndim != 3 or ids.dtype.kind not in "iu":
            raise InputError(self.where, "an integer array [tokens, layers, k]", f"{ids.dtype} shape {ids.shape}")
        n, num_layers, k = ids.shape
        if num_layers != self.num_layers or k != self.top_k:
            raise InputError(self.where, f"[tokens, {self.num_layers} layers, k = {self.top_k}]",
                             f"shape {ids.shape}")
        return n, num_layers, k

    def _check_range(self, ids: np.ndarray) -> None:
        as_unsigned = _unsigned_view(ids.dtype, self.num_experts)
        if as_unsigned is not None and int(ids.view(as_unsigned).max()) < self.num_experts:
            return  # one pass: every id in [0, num_experts)
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.num_experts:
            raise InputError(self.where, f"expert ids in [0, {self.num_experts})", lo if lo < 0 else hi)

    def _make_keys(self, ids: np.ndarray) -> np.ndarray:
        size = ids.size
        k = self.top_k
        if self._keys.size < size + k - 1:
            self._keys = np.empty(size + k - 1, dtype=self._dtype)
            self._equal = np.empty(max(1, k - 1) * size, dtype=bool)
            self._shift_views = None
        self.reserve(ids.shape[0])
        keys = self._keys[:size]
        # a contiguous add (SIMD) is several times faster than broadcasting [n, layers, 1] over k
        np.add(ids.reshape(-1), self._offsets[:size], out=keys, casting="unsafe")
        self._keys[size:size + k - 1] = -1  # sentinels: never equal to a key
        return keys

    def _offset_tile(self, n: int) -> np.ndarray:
        """`[n * layers * k]` key offsets laid out like the flat ids: layer * experts (one layer:
        alternately 0 and experts per token, so that neighbouring rows never share a key)."""
        if self.num_layers == 1:
            rows = (np.arange(n) % 2) * self.num_experts
        else:
            rows = np.tile(np.arange(self.num_layers) * self.num_experts, n)
        return np.repeat(rows.astype(self._dtype), self.top_k)

    def _has_repeat(self, keys: np.ndarray) -> bool:
        """Whether `key[t] == key[t + s]` for any t and shift s in 1..k-1 (keys from `_make_keys`)."""
        k, size = self.top_k, keys.size
        if k < 2:
            return False
        if self._shift_views is None or self._shift_views[0] != size:
            base, item = self._keys, self._keys.itemsize
            # left[s - 1, t] = key[t], right[s - 1, t] = key[t + s] (past the keys: the sentinels)
            left = np.ndarray((k - 1, size), dtype=base.dtype, buffer=base, strides=(0, item))
            right = np.ndarray((k - 1, size), dtype=base.dtype, buffer=base, offset=item, strides=(item, item))
            self._shift_views = (size, left, right, self._equal[: (k - 1) * size].reshape(k - 1, size))
        _, left, right, equal = self._shift_views
        np.equal(left, right, out=equal)
        return bool(equal.any())

    def _check_repeats(self, keys: np.ndarray, n: int, token_offset: int) -> None:
        if not self._has_repeat(keys):
            return
        row = self._first_repeated_row(keys)
        if row is not None:
            token, layer = divmod(row, self.num_layers)
            raise InputError(self.where, "k distinct experts per token",
                             f"a repeated expert at token {token_offset + token}, layer {layer}")

    def _first_repeated_row(self, keys: np.ndarray) -> int | None:
        k = self.top_k
        size = keys.size
        first = None
        for shift in range(1, k):
            equal = self._equal[: size - shift]
            np.equal(keys[:-shift], keys[shift:], out=equal)
            if equal.any():
                row = int(np.flatnonzero(equal)[0]) // k
                first = row if first is None else min(first, row)
        return first


@lru_cache(maxsize=None)
def _unsigned_view(dtype: np.dtype, num_experts: int) -> np.dtype | None:
    """The unsigned dtype of `dtype`'s width if `max(ids.view(it)) < num_experts` alone proves every
    id in [0, num_experts): a negative id viewed as unsigned is >= 2**(bits-1), so it fails the test
    whenever num_experts <= 2**(bits-1). None if not (then min and max are both checked)."""
    info = np.iinfo(dtype)
    if info.min < 0 and num_experts > info.max + 1:
        return None
    return np.dtype(f"u{dtype.itemsize}")

