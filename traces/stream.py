"""Streaming count extraction for large token-level traces, with bounded memory.

A per-token dump of 1M tokens x 61 layers x top-8 int16 is about 1 GB; this reads its `topk_ids`
member of an `.npz` (our format, `moe_place.traces.npz`) chunk by chunk, validates each chunk
(ids in range, no expert twice in one token's top-k) and accumulates the counts per step:
- an uncompressed (stored) member is read straight from the file: the zip local header and the
  `.npy` header give the data offset, then `readinto` fills one reused chunk buffer at a time;
- a compressed (deflated) member is decompressed chunk by chunk through `zipfile`;
- a plain `.npy` file is memory-mapped (`stream_npy_counts`).
Memory: one chunk of ids and its keys (`chunk_tokens * layers * k` elements each, about 256K by
default), the counts
`[steps, layers, experts]`, and the `step` array if present (8 bytes per token, 1/(layers*k)
of the ids at int64: that member is read whole).
"""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path
from typing import Iterator

import numpy as np

from moe_place.errors import InputError
from moe_place.traces.count import DispatchCounter, chunk_tokens_for
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


def stream_npz_counts(path: str | Path, chunk_tokens: int | None = None) -> Trace:
    """A count-level Trace `[steps, layers, experts]` from a token-level npz, read in chunks.

    chunk_tokens: tokens per chunk (default: about 256K ids, `count.chunk_tokens_for`).
    """
    path = Path(path)
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
        for start, chunk in reader.chunks(chunk_tokens):
            if index is None:
                counter.add(chunk, counts[0], start)
            else:
                _add_by_step(counter, chunk, index[start:start + chunk.shape[0]], counts, start)
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


def _add_by_step(counter: DispatchCounter, chunk: np.ndarray, index: np.ndarray, counts: np.ndarray,
                 start: int) -> None:
    """Add a chunk whose tokens belong to the steps `index` [tokens] (any order)."""
    first, last = int(index[0]), int(index[-1])
    if first == last and (index == first).all():
        counter.add(chunk, counts[first], start)
        return
    order = np.argsort(index, kind="stable")
    ordered = index[order]
    bounds = np.flatnonzero(ordered[1:] != ordered[:-1]) + 1
    for part in np.split(order, bounds):
        # token offsets in errors are exact only for the part's first token when steps interleave
        counter.add(chunk[part], counts[int(index[part[0]])], start + int(part[0]))


class IdsReader:
    """Reads the `topk_ids` member of an npz chunk by chunk (a context manager)."""

    def __init__(self, path: Path):
        self.path = path
        self.where = f"{path}: topk_ids"
        self._zip = None
        self._file = None

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
                self._file.seek(info.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1])
            else:
                self._file = self._zip.open(info)
            self.shape, self.dtype = self._read_npy_header()
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
            try:
                got = self._file.readinto(memoryview(view.reshape(-1).view(np.uint8)))
            except (OSError, EOFError, zipfile.BadZipFile, ValueError) as exc:
                raise InputError(self.where, "a readable array", error_reason(exc)) from None
            if got != view.nbytes:
                raise InputError(self.where, f"{tokens} tokens of data", f"a truncated file (ends in token {start})")
            yield start, view
        self._file.seek(start_pos)  # ready for another pass


