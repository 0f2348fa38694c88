"""Streaming count extraction for large token-level traces, with bounded memory.

A per-token dump of 1M tokens x 61 layers x top-8 int16 is about 1 GB; this reads its `topk_ids`
member of an `.npz` (our format, `moe_place.traces.npz`, whose `IdsReader` reads the member)
chunk by chunk, validates each chunk (ids in range, no expert twice in one token's top-k) and
accumulates the counts per step:
- an uncompressed (stored) member is read straight from the file: the zip local header and the
  `.npy` header give the data offset; sequentially `readinto` fills one reused chunk buffer at a
  time; in parallel (`workers` > 1, see `moe_place.traces.count`) each thread reads its chunks
  into its own buffer with positional reads (`os.preadv` at the chunk's offset, no shared file
  position) and counts them into its own `[layers, experts]` sums, added to the shared counts
  when it moves to another step and at the end;
- a compressed (deflated) member is decompressed chunk by chunk through `zipfile` (sequential).
The ids of a bounded random sample of the tokens (`moe_place.traces.sample`, at most
`SAMPLE_TOKENS`) are kept as their chunks go by, so statistics over whole tokens (co-activation)
are computed on a streamed file too, on the same tokens as if it had been read whole.
Memory: one chunk of ids and its keys (`chunk_tokens * layers * k` elements each, about 256K by
default), the counts
`[steps, layers, experts]`, the token sample (`SAMPLE_TOKENS * layers * k` ids), and the `step`
array if present (8 bytes per token, 1/(layers*k) of the ids at int64: that member is read
whole). In parallel: the chunk's buffers and one `[layers, experts]` sums array per thread
(nothing is queued between threads).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

import numpy as np

from moe_place.errors import InputError
from moe_place.progress import ProgressBar
from moe_place.traces.count import (DispatchCounter, PerThread, StepSums, chunk_tokens_for, resolve_workers,
                                    run_chunks)
from moe_place.traces.model import Trace
from moe_place.traces.npz import (check_meta_against_ids, check_num_experts, crc_checked, header_meta, open_npz,
                                  read_header, read_member, step_index)
from moe_place.traces.npz_member import IdsReader
from moe_place.traces.sample import SampleCollector

__all__ = ["stream_npz_counts"]

def stream_npz_counts(path: str | Path, chunk_tokens: int | None = None, workers: int | None = None,
                      progress: bool = False) -> Trace:
    """A count-level Trace `[steps, layers, experts]` from a token-level npz, read in chunks.

    chunk_tokens: tokens per chunk (default: about 256K ids, `count.chunk_tokens_for`).
    workers: threads for an uncompressed member (default `count.resolve_workers()`: $MOE_PLACE_THREADS
    or min(2, cores)); the counts and the error raised (that of the earliest bad chunk) do not depend on it.
    progress: a bar on stderr (when it is a terminal) over the tokens counted.
    """
    path = Path(path)
    workers = resolve_workers(workers)
    with open_npz(path) as npz:
        header = read_header(npz, path)
        if "topk_ids" not in header.keys:
            raise InputError(str(path), "a token-level trace (key 'topk_ids')", f"keys {sorted(header.keys)}")
        step = read_member(npz, path, "step") if "step" in header.keys else None
    with IdsReader(path) as reader, crc_checked(reader.check_crc_meanwhile()):
        reader.require_c_order()
        tokens, num_layers, k = reader.shape
        chunk_tokens = chunk_tokens_for(num_layers, k, chunk_tokens)
        if tokens == 0 or num_layers == 0 or k == 0:
            raise InputError(f"{path}: topk_ids", "at least one token, layer and expert per token",
                             f"shape {reader.shape}")
        num_experts = header.num_experts
        if num_experts is None:  # a first pass finds the largest id
            num_experts = max(int(chunk.max()) for _, chunk in reader.chunks(chunk_tokens)) + 1
        check_num_experts(num_experts, path)
        check_meta_against_ids(header, path, k, num_experts)
        if step is None:
            index, num_steps = None, 1
        else:
            index, num_steps = step_index(step, tokens, path)
        counts = np.zeros((num_steps, num_layers, num_experts), dtype=np.int64)
        counter = DispatchCounter(num_layers, num_experts, k, f"{path}: topk_ids")
        # validated ids fit the narrowest unsigned type below num_experts: 1 byte each up to 256 experts
        sample = SampleCollector(tokens, (num_layers, k), np.min_scalar_type(num_experts - 1), index)
        bar = ProgressBar(tokens, f"read {path.name}", "tokens", enabled=None if progress else False)
        try:
            if workers > 1 and reader.positional and tokens > chunk_tokens:
                _count_in_parallel(reader, counter, index, counts, chunk_tokens, workers, sample, bar)
            else:
                for start, chunk in reader.chunks(chunk_tokens):
                    if index is None:
                        counter.add(chunk, counts[0], start)
                    else:
                        _add_by_step(counter, chunk, index[start:start + chunk.shape[0]], start, counts.__getitem__)
                    sample.add(start, chunk)  # validated by now
                    bar.advance(chunk.shape[0])
        finally:  # also on a bad chunk: its error line starts on a line of its own
            bar.close()
        dtype = str(reader.dtype)
    meta = header_meta(header, path, num_experts, k, num_layers, dtype, num_steps)
    return Trace(meta, counts=counts, sample=sample.sample())


def _add_by_step(counter: DispatchCounter, chunk: np.ndarray, index: np.ndarray, start: int,
                 target: Callable[[int], np.ndarray]) -> None:
    """Add a chunk whose tokens belong to the steps `index` [tokens] (any order) to `target(step)`,
    an int64 `[layers, experts]` array, one step after the other in increasing step order."""
    first, last = int(index[0]), int(index[-1])
    if first == last and (index == first).all():
        counter.add(chunk, target(first), start)
        return
    order = np.argsort(index, kind="stable")
    ordered = index[order]
    bounds = np.flatnonzero(ordered[1:] != ordered[:-1]) + 1
    for part in np.split(order, bounds):
        # token offsets in errors are exact only for the part's first token when steps interleave
        counter.add(chunk[part], target(int(index[part[0]])), start + int(part[0]))


def _count_in_parallel(reader: IdsReader, counter: DispatchCounter, index: np.ndarray | None,
                       counts: np.ndarray, chunk_tokens: int, workers: int, sample: SampleCollector,
                       bar: ProgressBar) -> None:
    """`counts[step] +=` every chunk's counts, and its sampled tokens into `sample`; chunks read,
    validated and counted on `workers` threads (`count.run_chunks`: the error raised is the
    earliest bad chunk's, as sequentially); `bar` advanced by each chunk's tokens."""
    tokens, num_layers, k = reader.shape
    counter.reserve(chunk_tokens)
    lock, drawing = threading.Lock(), threading.Lock()
    # per thread: a counter (its own scratch), a chunk buffer, and its sums of the current step
    scratch = PerThread(lambda: (counter.clone(), np.empty((chunk_tokens, num_layers, k), dtype=reader.dtype),
                                 StepSums(counts, lock)))

    def process(start: int) -> None:
        own, buffer, sums = scratch.get()
        ids = buffer[:min(chunk_tokens, tokens - start)]
        reader.read_at(start, ids)
        if index is None:
            own.add(ids, sums.of_step(0), start)
        else:
            _add_by_step(own, ids, index[start:start + ids.shape[0]], start, sums.of_step)
        sample.add(start, ids)
        with drawing:  # one thread at a time redraws the bar
            bar.advance(ids.shape[0])

    run_chunks(range(0, tokens, chunk_tokens), workers, process)
    for _, _, sums in scratch.made:
        sums.flush()
