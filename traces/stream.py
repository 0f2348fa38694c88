"""Streaming count extraction for large token-level traces, with bounded memory.

A per-token dump of 1M tokens x 61 layers x top-8 int16 is about 1 GB; this reads its `topk_ids`
member of an `.npz` (our format, `moe_place.traces.npz`) chunk by chunk, validates each chunk
(ids in range, no expert twice in one token's top-k) and accumulates the counts per step:
- an uncompressed (stored) member is read straight from the file: the zip local header and the
  `.npy` header give the data offset; sequentially `readinto` fills one reused chunk buffer at a
  time; in parallel (`workers` > 1, see `moe_place.traces.count`) each thread reads its chunks
  into its own buffer with positional reads (`os.preadv` at the chunk's offset, no shared file
  position) and counts them into its own `[layers, experts]` sums, added to the shared counts
  when it moves to another step and at the end;
- a compressed (deflated) member is decompressed chunk by chunk through `zipfile` (sequential);
- a plain `.npy` file is memory-mapped (`stream_npy_counts`).
Memory: one chunk of ids and its keys (`chunk_tokens * layers * k` elements each, about 256K by
default), the counts
`[steps, layers, experts]`, and the `step` array if present (8 bytes per token, 1/(layers*k)
of the ids at int64: that member is read whole). In parallel: the chunk's buffers and one
`[layers, experts]` sums array per thread (nothing is queued between threads).
"""

from __future__ import annotations

import os
import struct
import threading
import zipfile
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from moe_place.errors import InputError
from moe_place.traces.count import DispatchCounter, PerThread, chunk_tokens_for, resolve_workers, run_chunks
from moe_place.traces.model import Trace
from moe_place.traces.npz import (check_meta_against_ids, check_num_experts, error_reason, header_meta, open_npz,
                                  read_header, read_member, step_index)

IDS_MEMBER = "topk_ids.npy"
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # zip local file header, 30 bytes


def token_bytes(path: str | Path) -> int:
    """Uncompressed size in bytes of the `topk_ids` member of an npz (0 if it has none)."""
    try:
        with zipfile.ZipFile(path) as zf:
            return zf.getinfo(IDS_MEMBER).file_size
    except KeyError:
        return 0


def stream_npz_counts(path: str | Path, chunk_tokens: int | None = None, workers: int | None = None) -> Trace:
    """A count-level Trace `[steps, layers, experts]` from a token-level npz, read in chunks.

    chunk_tokens: tokens per chunk (default: about 256K ids, `count.chunk_tokens_for`).
    workers: threads for an uncompressed member (default `count.resolve_workers()`: $MOE_PLACE_THREADS
    or min(2, cores)); the counts and the error raised (that of the earliest bad chunk) do not depend on it.
    """
    path = Path(path)
    workers = resolve_workers(workers)
    with open_npz(path) as npz:
        header = read_header(npz, path)
        if "topk_ids" not in header.keys:
            raise InputError(str(path), "a token-level trace (key 'topk_ids')", f"keys {sorted(header.keys)}")
        step = read_member(npz, path, "step") if "step" in header.keys else None
    with IdsReader(path) as reader:
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
        if workers > 1 and reader.positional and tokens > chunk_tokens:
            _count_in_parallel(reader, counter, index, counts, chunk_tokens, workers)
        else:
            for start, chunk in reader.chunks(chunk_tokens):
                if index is None:
                    counter.add(chunk, counts[0], start)
                else:
                    _add_by_step(counter, chunk, index[start:start + chunk.shape[0]], start, counts.__getitem__)
        dtype = str(reader.dtype)
    meta = header_meta(header, path, num_experts, k, num_layers, dtype, num_steps)
    return Trace(meta, counts=counts)


def stream_npy_counts(path: str | Path, num_experts: int | None = None,
                      chunk_tokens: int | None = None) -> np.ndarray:
    """int64 `[layers, experts]` counts of a plain `.npy` of ids `[tokens, layers, k]`, memory-mapped."""
    path = Path(path)
    try:
        ids = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise InputError(str(path), "a readable .npy file", error_reason(exc)) from None
    if ids.ndim != 3 or ids.dtype.kind not in "iu" or 0 in ids.shape:
        raise InputError(str(path), "a non-empty integer array [tokens, layers, k]", f"{ids.dtype} shape {ids.shape}")
    chunk_tokens = chunk_tokens_for(ids.shape[1], ids.shape[2], chunk_tokens)
    if num_experts is None:
        num_experts = max(int(ids[s:s + chunk_tokens].max()) for s in range(0, ids.shape[0], chunk_tokens)) + 1
    counter = DispatchCounter(ids.shape[1], num_experts, ids.shape[2], str(path))
    return counter.count(ids, chunk_tokens)


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


class _ChunkScratch:
    """One thread's buffers: a counter (keys, flags), the chunk's ids, and `sums` `[layers, experts]`:
    counts of step `step` not yet added to the shared `counts` (added under `lock` when the thread
    moves to another step, and at the end)."""

    def __init__(self, counter: DispatchCounter, chunk_shape: tuple[int, int, int], dtype: np.dtype,
                 counts: np.ndarray, lock: threading.Lock):
        self.counter = counter.clone()
        self.ids = np.empty(chunk_shape, dtype=dtype)
        self.sums = np.zeros(counts.shape[1:], dtype=np.int64)
        self.step = 0
        self._counts = counts
        self._lock = lock

    def step_sums(self, step: int) -> np.ndarray:
        """The array to add step `step`'s counts to (another step's sums are flushed first)."""
        if step != self.step:
            self.flush()
            self.step = step
        return self.sums

    def flush(self) -> None:
        with self._lock:
            self._counts[self.step] += self.sums
        self.sums.fill(0)


def _count_in_parallel(reader: "IdsReader", counter: DispatchCounter, index: np.ndarray | None,
                       counts: np.ndarray, chunk_tokens: int, workers: int) -> None:
    """`counts[step] +=` every chunk's counts; chunks read, validated and counted on `workers` threads
    (`count.run_chunks`: the error raised is the earliest bad chunk's, as sequentially)."""
    tokens, num_layers, k = reader.shape
    counter.reserve(chunk_tokens)
    lock = threading.Lock()
    scratch = PerThread(lambda: _ChunkScratch(counter, (chunk_tokens, num_layers, k), reader.dtype, counts, lock))

    def process(start: int) -> None:
        own = scratch.get()
        ids = own.ids[:min(chunk_tokens, tokens - start)]
        reader.read_at(start, ids)
        if index is None:
            own.counter.add(ids, own.sums, start)
        else:
            _add_by_step(own.counter, ids, index[start:start + ids.shape[0]], start, own.step_sums)

    run_chunks(range(0, tokens, chunk_tokens), workers, process)
    for own in scratch.made:
        own.flush()


class IdsReader:
    """Reads the `topk_ids` member of an npz chunk by chunk (a context manager).

    `positional`: the member is stored uncompressed, so `read_at` can read any chunk from any thread.
    Reads stop at the member's end, so a member shorter than its `.npy` header says is a truncated file.
    """

    def __init__(self, path: Path):
        self.path = path
        self.where = f"{path}: topk_ids"
        self.positional = False
        self._zip = None
        self._file = None
        self._data_offset = 0  # stored member: file offsets of the first id byte and of the member's end
        self._data_end = 0

    def __enter__(self) -> "IdsReader":
        try:
            self._zip = zipfile.ZipFile(self.path)
            info = self._zip.getinfo(IDS_MEMBER)
            if info.compress_type == zipfile.ZIP_STORED:
                self._file = open(self.path, "rb")
                self._file.seek(info.header_offset)
                fields = _LOCAL_HEADER.unpack(self._file.read(_LOCAL_HEADER.size))
                if fields[0] != b"PK\x03\x04":
                    raise InputError(self.where, "a zip local file header", "damaged archive")
                member_start = info.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1]
                self._data_end = member_start + info.compress_size
                self._file.seek(member_start)
            else:
                self._file = self._zip.open(info)
            self.shape, self.dtype = self._read_npy_header()
            if info.compress_type == zipfile.ZIP_STORED:
                self._data_offset = self._file.tell()
                self.positional = True
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            self._file.close()
        if self._zip is not None:
            self._zip.close()

    def _read_npy_header(self) -> tuple[tuple[int, int, int], np.dtype]:
        fmt = np.lib.format
        try:
            version = fmt.read_magic(self._file)
            reader = {(1, 0): fmt.read_array_header_1_0, (2, 0): fmt.read_array_header_2_0}.get(version)
            if reader is None:
                raise ValueError(f"npy format version {version}")
            shape, fortran_order, dtype = reader(self._file)
        except (ValueError, EOFError, OSError, zipfile.BadZipFile) as exc:
            raise InputError(self.where, "a readable .npy header", error_reason(exc)) from None
        if dtype.kind not in "iu" or len(shape) != 3:
            raise InputError(self.where, "an integer array [tokens, layers, k]", f"{dtype} shape {shape}")
        if fortran_order:
            raise InputError(self.where, "a C-ordered array (np.ascontiguousarray before saving)", "Fortran order")
        return shape, dtype

    def chunks(self, chunk_tokens: int) -> Iterator[tuple[int, np.ndarray]]:
        """Yield (first token, ids `[n, layers, k]`) for consecutive chunks; the buffer is reused."""
        tokens, num_layers, k = self.shape
        start_pos = self._file.tell()
        buffer = np.empty((min(chunk_tokens, tokens), num_layers, k), dtype=self.dtype)
        for start in range(0, tokens, chunk_tokens):
            n = min(chunk_tokens, tokens - start)
            view = buffer[:n]
            target = memoryview(view.reshape(-1).view(np.uint8))
            if self.positional:  # not past the member's end
                target = target[:max(0, min(view.nbytes, self._data_end - self._file.tell()))]
            try:
                got = self._file.readinto(target)
            except (OSError, EOFError, zipfile.BadZipFile, ValueError) as exc:
                raise InputError(self.where, "a readable array", error_reason(exc)) from None
            self._check_complete(got, view, start)
            yield start, view
        self._file.seek(start_pos)  # ready for another pass

    def read_at(self, start: int, ids: np.ndarray) -> None:
        """Fill `ids` `[n, layers, k]` with tokens start..start+n-1 by positional reads (thread-safe;
        the file position is not used). Only for a `positional` (stored) member."""
        assert self.positional, "read_at needs an uncompressed member"
        offset = self._data_offset + start * (ids.nbytes // max(1, ids.shape[0]))
        target = memoryview(ids.reshape(-1).view(np.uint8))
        wanted = max(0, min(ids.nbytes, self._data_end - offset))
        fd = self._file.fileno()
        got = 0
        try:
            while got < wanted:
                if hasattr(os, "preadv"):
                    n = os.preadv(fd, [target[got:wanted]], offset + got)
                else:
                    data = os.pread(fd, wanted - got, offset + got)
                    n = len(data)
                    target[got:got + n] = data
                if n == 0:
                    break
                got += n
        except OSError as exc:
            raise InputError(self.where, "a readable array", error_reason(exc)) from None
        self._check_complete(got, ids, start)

    def _check_complete(self, got: int | None, ids: np.ndarray, start: int) -> None:
        if got != ids.nbytes:
            raise InputError(self.where, f"{self.shape[0]} tokens of data", f"a truncated file (ends in token {start})")
