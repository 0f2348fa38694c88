"""Our versioned `.npz` trace format: write and read.

Keys (format_version 1). Anything that writes them with plain numpy (`np.savez`) is readable.

| key              | dtype / shape                  | required | meaning                                       |
| ---------------- | ------------------------------ | -------- | --------------------------------------------- |
| `format_version` | int scalar, 1                  | no (1)   | the format version                            |
| `num_experts`    | int scalar                     | no*      | routed (logical) experts per layer            |
| `top_k`          | int scalar                     | no*      | experts each token is sent to                 |
| `counts`         | int `[steps, layers, experts]` | one of   | dispatches per expert in each step            |
| `topk_ids`       | int `[tokens, layers, k]`      | these    | the router's expert ids of each token         |
| `step`           | int `[tokens]`                 | no       | with `topk_ids`: the step each token belongs to |
| `layer_ids`      | int `[layers]`                 | no       | model layer index of each trace layer (0..)   |
| `model`, `source`| str scalar                     | no       | free text                                     |
| `step_names`     | str `[steps]`                  | no       | one name per step                             |

(*) When absent, `num_experts` is `counts.shape[2]` or `max(topk_ids) + 1`, and `top_k` is `k`
of `topk_ids`; count files without `top_k` get it from `infer_top_k` (see there). When present
they must agree with the arrays: `num_experts` > every id and == `counts.shape[2]`, `top_k` == k.

`step`: the steps are the distinct values of `step` in increasing order; a step's tokens need not
be contiguous (the reader groups them, keeping their order within a step). Without `step` all
tokens form one step. The writer stores tokens grouped by step with `step` = 0, 1, 2, ...

Files are written uncompressed by default so large token-level traces can be streamed
(`moe_place.traces.stream`); `compress=True` uses deflate (still readable, streamed by
decompressing chunk by chunk). `IdsReader` (at the end) reads the `topk_ids` member, whole or by
chunks, for both readers.
"""

from __future__ import annotations

import io
import mmap
import os
import re
import struct
import threading
import tokenize
import zipfile
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from moe_place.errors import InputError
from moe_place.io import write_atomic
from moe_place.traces.content import not_a_zip
from moe_place.traces.model import MAX_EXPERTS, Trace, TraceMeta, check_counts, located

FORMAT_VERSION = 1
# What a damaged file can raise inside numpy/zipfile; each becomes one InputError.
READ_ERRORS = (ValueError, OSError, EOFError, KeyError, IndexError, TypeError, zipfile.BadZipFile,
               zlib.error, NotImplementedError, OverflowError, MemoryError, UnicodeDecodeError)


# ---------------------------------------------------------------------- write
def save_npz(trace: Trace, path: str | Path, compress: bool = False) -> None:
    """Write `trace` to `path` in format_version 1, atomically.

    Token-level traces store all steps' tokens concatenated in `topk_ids` with `step` = the
    step index of each token; count-level traces store `counts`.
    """
    meta = trace.meta
    arrays: dict[str, np.ndarray] = {
        "format_version": np.int64(FORMAT_VERSION),
        "num_experts": np.int64(meta.num_experts),
        "top_k": np.int64(meta.top_k),
        "layer_ids": np.asarray(meta.layer_ids, dtype=np.int64),
        "model": np.str_(meta.model),
        "source": np.str_(meta.source),
        "step_names": np.asarray(trace.step_names, dtype=np.str_),
    }
    if trace.is_token_level:
        arrays["topk_ids"] = np.concatenate(trace.topk_ids, axis=0)
        arrays["step"] = np.repeat(np.arange(trace.num_steps, dtype=np.int64),
                                   [ids.shape[0] for ids in trace.topk_ids])
    else:
        arrays["counts"] = trace.counts
    buffer = io.BytesIO()
    (np.savez_compressed if compress else np.savez)(buffer, **arrays)
    write_atomic(path, buffer.getvalue())


# ---------------------------------------------------------------------- read
@contextmanager
def open_npz(path: Path) -> Iterator[np.lib.npyio.NpzFile]:
    """`np.load` an npz without pickles; any damage becomes one InputError naming the file.

    The file is opened here and always closed here: `np.load(path)` leaves its own file open when
    the archive turns out to be damaged."""
    try:
        handle = open(path, "rb")
    except OSError as exc:
        raise InputError(str(path), "a readable .npz file", error_reason(exc)) from None
    with handle:
        try:
            npz = np.load(handle, allow_pickle=False)
        except READ_ERRORS as exc:  # say what the file is rather than what numpy tripped over
            raise InputError(str(path), "a readable .npz file", not_a_zip(path) or error_reason(exc)) from None
        if not isinstance(npz, np.lib.npyio.NpzFile):
            raise InputError(str(path), "an .npz archive", "a single .npy array")
        try:
            yield npz
        finally:
            npz.close()


def read_member(npz, path: Path, key: str) -> np.ndarray:
    """One array of an open npz; a damaged member becomes an InputError naming it."""
    try:
        return npz[key]
    except InputError:
        raise
    except READ_ERRORS as exc:
        raise InputError(f"{path}: {key}", "a readable array", error_reason(exc)) from None


@dataclass(frozen=True)
class NpzHeader:
    """The metadata of an npz trace, read without its big arrays (used by streaming too)."""

    keys: frozenset[str]
    num_experts: int | None
    top_k: int | None
    layer_ids: tuple[int, ...] | None
    model: str
    source: str
    step_names: tuple[str, ...]


def read_header(npz, path: Path) -> NpzHeader:
    """Parse and check the small metadata keys of an npz trace."""
    keys = frozenset(npz.files)
    if ("counts" in keys) == ("topk_ids" in keys):
        raise InputError(str(path), "exactly one of the arrays 'counts' or 'topk_ids'",
                         f"keys {sorted(keys)}")
    if "format_version" in keys:
        version = _int_scalar(npz, path, "format_version")
        if version != FORMAT_VERSION:
            raise InputError(f"{path}: format_version", f"{FORMAT_VERSION}", version)
    layer_ids = None
    if "layer_ids" in keys:
        arr = read_member(npz, path, "layer_ids")
        if arr.ndim != 1 or arr.dtype.kind not in "iu" or (arr.size and arr.min() < 0):
            raise InputError(f"{path}: layer_ids", "a 1-D array of layer indices >= 0",
                             f"{arr.dtype} shape {arr.shape}")
        layer_ids = tuple(int(x) for x in arr)
    step_names: tuple[str, ...] = ()
    if "step_names" in keys:
        arr = read_member(npz, path, "step_names")
        if arr.ndim != 1 or arr.dtype.kind != "U":
            raise InputError(f"{path}: step_names", "a 1-D array of strings", f"{arr.dtype} shape {arr.shape}")
        step_names = tuple(str(x) for x in arr)
    return NpzHeader(
        keys=keys,
        num_experts=_int_scalar(npz, path, "num_experts", minimum=1) if "num_experts" in keys else None,
        top_k=_int_scalar(npz, path, "top_k", minimum=1) if "top_k" in keys else None,
        layer_ids=layer_ids,
        model=_str_scalar(npz, path, "model") if "model" in keys else "unknown",
        source=_str_scalar(npz, path, "source") if "source" in keys else "",
        step_names=step_names,
    )


def read_npz(path: str | Path, top_k: int | None = None) -> Trace:
    """Read an npz trace fully into memory (see `moe_place.traces.stream` for large files).

    top_k: used when a count file does not record it (instead of guessing with `infer_top_k`).
    `topk_ids` is read by `IdsReader.read_all`: a stored (uncompressed) member is mapped from the
    file, so the Trace's id arrays are read-only (copy them to change them); building the Trace
    validates and counts the ids in one pass, while `MemberCrc` checks the member's CRC-32.
    """
    path = Path(path)
    with open_npz(path) as npz:
        header = read_header(npz, path)
        if "counts" in header.keys:
            counts = read_member(npz, path, "counts")
            return counts_trace(counts, header, path, top_k)
        step = read_member(npz, path, "step") if "step" in header.keys else None
    with IdsReader(path) as reader:
        ids = reader.read_all()
        crc = reader.check_crc_meanwhile()
    with crc_checked(crc):
        return token_trace(ids, step, header, path)


@contextmanager
def crc_checked(crc: "MemberCrc | None") -> Iterator[None]:
    """Run the block (validating and counting the ids), then `crc.check()`; a damaged member is the
    error reported even when the block failed on a bad id (the damage explains it)."""
    try:
        yield
    except InputError:
        if crc is not None:
            crc.check()
        raise
    if crc is not None:
        crc.check()


def counts_trace(counts: np.ndarray, header: NpzHeader, path: Path, top_k: int | None = None) -> Trace:
    """A count-level Trace from a `counts` array and the header, cross-checked."""
    counts = check_counts(counts, f"{path}: counts")
    num_experts = counts.shape[2]
    if header.num_experts is not None and header.num_experts != num_experts:
        raise InputError(f"{path}: num_experts", f"{num_experts} (counts has {num_experts} experts)",
                         header.num_experts)
    if header.top_k is not None:
        top_k = header.top_k
    elif top_k is None:
        top_k = infer_top_k(counts)
    if top_k > num_experts:
        raise InputError(f"{path}: top_k", f"at most num_experts = {num_experts}", top_k)
    check_totals_divisible(counts, top_k, f"{path}: counts")
    meta = header_meta(header, path, num_experts, top_k, counts.shape[1], str(counts.dtype), counts.shape[0])
    return Trace(meta, counts=counts)


def token_trace(ids: np.ndarray, step: np.ndarray | None, header: NpzHeader, path: Path) -> Trace:
    """A token-level Trace from `topk_ids` [tokens, layers, k] and optional `step` [tokens]."""
    where = f"{path}: topk_ids"
    if ids.ndim != 3 or ids.dtype.kind not in "iu":
        raise InputError(where, "an integer array [tokens, layers, k]", f"{ids.dtype} shape {ids.shape}")
    if ids.shape[0] == 0 or ids.shape[1] == 0 or ids.shape[2] == 0:
        raise InputError(where, "at least one token, layer and expert per token", f"shape {ids.shape}")
    num_experts = header.num_experts if header.num_experts is not None else int(ids.max()) + 1
    check_num_experts(num_experts, path)
    check_meta_against_ids(header, path, ids.shape[2], num_experts)
    groups = split_by_step(ids, step, path)
    meta = header_meta(header, path, num_experts, ids.shape[2], ids.shape[1], str(ids.dtype), len(groups))
    with located(path):
        return Trace(meta, topk_ids=groups)


def check_num_experts(num_experts: int, path: Path) -> None:
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise InputError(f"{path}: num_experts", f"an integer in [1, {MAX_EXPERTS}] (largest id + 1 if absent)",
                         num_experts)


def check_meta_against_ids(header: NpzHeader, path: Path, k: int, num_experts: int) -> None:
    if header.top_k is not None and header.top_k != k:
        raise InputError(f"{path}: top_k", f"{k} (topk_ids has k = {k} ids per token)", header.top_k)
    if k > num_experts:
        raise InputError(f"{path}: num_experts", f"at least k = {k}", num_experts)


def step_index(step: np.ndarray, num_tokens: int, path: Path) -> tuple[np.ndarray, int]:
    """Map `step` values [tokens] to step indices 0..S-1 (increasing value order); return (index, S)."""
    if step.ndim != 1 or step.dtype.kind not in "iu":
        raise InputError(f"{path}: step", "a 1-D integer array [tokens]", f"{step.dtype} shape {step.shape}")
    if step.shape[0] != num_tokens:
        raise InputError(f"{path}: step", f"{num_tokens} entries (one per token of topk_ids)", step.shape[0])
    values, index = np.unique(step, return_inverse=True)
    return index.reshape(-1), len(values)


def split_by_step(ids: np.ndarray, step: np.ndarray | None, path: Path) -> tuple[np.ndarray, ...]:
    """Per-step token arrays, in increasing step value, tokens in file order within a step."""
    if step is None:
        return (ids,)
    index, num_steps = step_index(step, ids.shape[0], path)
    if num_steps == 1:
        return (ids,)
    if np.all(index[1:] >= index[:-1]):
        bounds = np.searchsorted(index, np.arange(1, num_steps))
        return tuple(np.split(ids, bounds, axis=0))
    order = np.argsort(index, kind="stable")
    bounds = np.searchsorted(index[order], np.arange(1, num_steps))
    return tuple(ids[part] for part in np.split(order, bounds))


def check_totals_divisible(counts: np.ndarray, top_k: int, where: str) -> None:
    """Every token adds top_k dispatches to a layer, so each (step, layer) total of `counts`
    `[steps, layers, E]` is a multiple of top_k; InputError naming the first total that is not."""
    totals = counts.sum(axis=2)
    bad = np.argwhere(totals % top_k)
    if bad.size:
        step, layer = (int(x) for x in bad[0])
        raise InputError(f"{where}[step {step}, layer {layer}]", f"a total that is a multiple of top_k = {top_k}",
                         int(totals[step, layer]))


def infer_top_k(counts: np.ndarray) -> int:
    """Guess top_k for count files that do not record it.

    Every token adds top_k dispatches to each layer it passes, so each (step, layer) total is a
    multiple of top_k; we take the greatest common divisor of the non-zero totals when it is at
    most the number of experts, else 1 (unknown: tokens are then reported as dispatches).
    Pass top_k explicitly when you know it.
    """
    totals = counts.sum(axis=2).ravel()
    totals = totals[totals > 0]
    if totals.size == 0:
        return 1
    g = int(np.gcd.reduce(totals.astype(np.int64)))
    return g if 1 <= g <= counts.shape[2] else 1


# ---------------------------------------------------------------------- helpers
def header_meta(header: NpzHeader, path: Path, num_experts: int, top_k: int, num_layers: int, dtype: str,
                num_steps: int) -> TraceMeta:
    """The TraceMeta of a file, its header cross-checked against the array sizes."""
    layer_ids = header.layer_ids if header.layer_ids is not None else tuple(range(num_layers))
    if len(layer_ids) != num_layers:
        raise InputError(f"{path}: layer_ids", f"{num_layers} entries (one per trace layer)", len(layer_ids))
    if len(set(layer_ids)) != len(layer_ids):
        raise InputError(f"{path}: layer_ids", "distinct layer indices", list(layer_ids))
    if header.step_names and len(header.step_names) != num_steps:
        raise InputError(f"{path}: step_names", f"{num_steps} names (one per step)", len(header.step_names))
    if not 1 <= top_k <= num_experts:
        raise InputError(f"{path}: top_k", f"an integer in [1, num_experts = {num_experts}]", top_k)
    return TraceMeta(num_experts=num_experts, top_k=top_k, layer_ids=tuple(layer_ids), model=header.model,
                     source=header.source or f"npz:{path.name}", dtype=dtype, step_names=header.step_names)


def _int_scalar(npz, path: Path, key: str, minimum: int | None = None) -> int:
    arr = read_member(npz, path, key)
    if arr.ndim != 0 and arr.size != 1:
        raise InputError(f"{path}: {key}", "one integer", f"an array of shape {arr.shape}")
    if arr.dtype.kind in "iu":
        value = int(arr.reshape(()))
    elif arr.dtype.kind == "f" and np.isfinite(arr).all() and float(arr.reshape(())).is_integer():
        value = int(float(arr.reshape(())))  # a whole float (1.0, or 1e300: the caller's bounds reject it)
    else:
        raise InputError(f"{path}: {key}", "an integer", f"{arr.dtype} {arr.reshape(-1)[:1].tolist()}")
    if minimum is not None and value < minimum:
        raise InputError(f"{path}: {key}", f"an integer >= {minimum}", value)
    return value


def _str_scalar(npz, path: Path, key: str) -> str:
    arr = read_member(npz, path, key)
    if arr.dtype.kind not in "US" or arr.size != 1:
        raise InputError(f"{path}: {key}", "one string", f"{arr.dtype} shape {arr.shape}")
    value = arr.reshape(())[()]
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


REASON_CHARS = 200  # an exception's text in an error line is cut to about this, at a word


def error_reason(exc: BaseException) -> str:
    """One short line describing an exception from numpy/zipfile/torch (for an InputError's `got`):
    its type and the first line of its text, cut at a word (with "...") when longer than
    `REASON_CHARS`, terminal escape codes removed."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()
    text = text.splitlines()[0].strip() if text else ""
    name = type(exc).__name__
    if not text:
        return name
    line = f"{name}: {text}"
    if len(line) <= REASON_CHARS:
        return line
    return line[:REASON_CHARS].rsplit(" ", 1)[0].rstrip(",;:") + "..."


# ---------------------------------------------------------------------- the topk_ids member
IDS_MEMBER = "topk_ids.npy"
READ_PIECE = 16 << 20  # bytes per read of a compressed member read whole
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # zip local file header, 30 bytes


def token_bytes(path: str | Path) -> int:
    """Uncompressed size in bytes of the `topk_ids` member of an npz (0 if it has none)."""
    try:
        with zipfile.ZipFile(path) as zf:
            return zf.getinfo(IDS_MEMBER).file_size
    except KeyError:
        return 0




class IdsReader:
    """Reads the `topk_ids` member of an npz chunk by chunk (a context manager).

    `positional`: the member is stored uncompressed, so `read_at` can read any chunk from any thread.
    Reads stop at the member's end, so a member shorter than its `.npy` header says is a truncated file.
    """

    def __init__(self, path: Path):
        self.path = path
        self.where = f"{path}: topk_ids"
        self.positional = False
        self.fortran_order = False
        self._zip = None
        self._file = None
        self._data_offset = 0  # stored member: file offsets of the first id byte and of the member's end
        self._data_end = 0
        self._member_start = 0  # ... and of its first byte (the .npy magic), and the CRC-32 the archive records
        self._crc = 0

    def __enter__(self) -> "IdsReader":
        try:
            self._zip = zipfile.ZipFile(self.path)
            info = self._zip.getinfo(IDS_MEMBER)
            if info.compress_type == zipfile.ZIP_STORED:
                self._file = open(self.path, "rb")
                self._file.seek(info.header_offset)
                head = self._file.read(_LOCAL_HEADER.size)
                if len(head) < _LOCAL_HEADER.size or not head.startswith(b"PK\x03\x04"):
                    raise InputError(self.where, "a zip local file header", "damaged archive")
                fields = _LOCAL_HEADER.unpack(head)
                member_start = info.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1]
                self._data_end = member_start + info.compress_size
                self._member_start, self._crc = member_start, info.CRC
                self._file.seek(member_start)
            else:
                self._file = self._zip.open(info)
            self.shape, self.dtype, self.fortran_order = self._read_npy_header()
            if info.compress_type == zipfile.ZIP_STORED:
                self._data_offset = self._file.tell()
                self.positional = True
        except (*READ_ERRORS, RuntimeError) as exc:  # zipfile's word for a damaged or encrypted member
            self.__exit__(None, None, None)
            if isinstance(exc, InputError):
                raise
            raise InputError(self.where, "a readable zip member", error_reason(exc)) from None
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            self._file.close()
        if self._zip is not None:
            self._zip.close()

    def _read_npy_header(self) -> tuple[tuple[int, int, int], np.dtype, bool]:
        fmt = np.lib.format
        try:
            version = fmt.read_magic(self._file)
            reader = {(1, 0): fmt.read_array_header_1_0, (2, 0): fmt.read_array_header_2_0}.get(version)
            if reader is None:
                raise ValueError(f"npy format version {version}")
            shape, fortran_order, dtype = reader(self._file)
        except (*READ_ERRORS, SyntaxError, tokenize.TokenError) as exc:  # numpy parses the header as Python
            raise InputError(self.where, "a readable .npy header", error_reason(exc)) from None
        if dtype.kind not in "iu" or len(shape) != 3:
            raise InputError(self.where, "an integer array [tokens, layers, k]", f"{dtype} shape {shape}")
        return shape, dtype, bool(fortran_order)

    def check_crc_meanwhile(self) -> "MemberCrc | None":
        """Start checking the stored member's CRC-32 against the archive's (`MemberCrc`), or None for a
        compressed member, which zipfile checks as it reads it to the end."""
        if not self.positional:
            return None
        return MemberCrc(self.path, self._member_start, self._data_end, self._crc, self.where)

    def require_c_order(self) -> None:
        """Chunks of tokens are contiguous only in a C-ordered array: InputError otherwise."""
        if self.fortran_order:
            raise InputError(self.where, "a C-ordered array (np.ascontiguousarray before saving)", "Fortran order")

    def read_all(self) -> np.ndarray:
        """The whole member: int `[tokens, layers, k]`, in the order it was stored (C or Fortran).

        A stored member whose ids are aligned in the file is mapped read-only (`mmap`), not copied:
        the array is the page cache's bytes, so reading costs no copy and no anonymous memory
        (100 MB: about 1 ms instead of 18 ms). Otherwise a stored member is read with positional
        reads straight from the file, with no zipfile layer (its CRC: `check_crc_meanwhile`; a
        file cut short is an error here). A compressed one is read through zipfile in pieces of
        READ_PIECE bytes (zipfile checks its CRC at the end).
        """
        mapped = self.map_all()
        if mapped is not None:
            return mapped
        stored = np.empty(self.shape[::-1] if self.fortran_order else self.shape, dtype=self.dtype)
        target = memoryview(stored.reshape(-1).view(np.uint8))
        got = 0
        try:
            if self.positional:
                got = self._pread(target, self._data_offset)
            else:
                while got < len(target):
                    n = self._file.readinto(target[got:got + READ_PIECE])
                    if not n:
                        break
                    got += n
        except (OSError, EOFError, zipfile.BadZipFile, ValueError) as exc:
            raise InputError(self.where, "a readable array", error_reason(exc)) from None
        if got != stored.nbytes:
            row_bytes = max(1, stored.nbytes // max(1, self.shape[0]))
            raise InputError(self.where, f"{self.shape[0]} tokens of data",
                             f"a truncated file (ends in token {got // row_bytes})")
        return stored.T if self.fortran_order else stored

    def map_all(self) -> np.ndarray | None:
        """The stored member as a read-only array over a map of the file, or None when it cannot
        be mapped as is (compressed, misaligned for its dtype, empty, or shorter than its header
        says: the reading path then words the error). The streaming reader does not map: dropping
        each counted chunk's pages (to keep resident memory bounded) cost more than the copy saved
        (276 MB: 338 ms mapped and released, 315 ms with positional reads)."""
        shape = self.shape[::-1] if self.fortran_order else self.shape
        nbytes = int(np.prod(shape, dtype=np.int64)) * self.dtype.itemsize
        offset = self._data_offset
        if not self.positional or nbytes == 0 or offset % self.dtype.itemsize or offset + nbytes > self._data_end:
            return None
        fd = self._file.fileno()
        try:
            if os.fstat(fd).st_size < offset + nbytes:
                return None
            start = offset - offset % mmap.ALLOCATIONGRANULARITY
            mapping = mmap.mmap(fd, offset + nbytes - start, offset=start, access=mmap.ACCESS_READ)
        except (OSError, ValueError):  # not a mappable file (a pipe, a special file): read it
            return None
        stored = np.frombuffer(mapping, dtype=self.dtype, count=nbytes // self.dtype.itemsize,
                               offset=offset - start).reshape(shape)
        return stored.T if self.fortran_order else stored

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
        try:
            got = self._pread(memoryview(ids.reshape(-1).view(np.uint8)), offset)
        except OSError as exc:
            raise InputError(self.where, "a readable array", error_reason(exc)) from None
        self._check_complete(got, ids, start)

    def _pread(self, target: memoryview, offset: int) -> int:
        """Fill `target` from file offset `offset` by positional reads, not past the member's end;
        return the bytes read."""
        wanted = max(0, min(len(target), self._data_end - offset))
        fd = self._file.fileno()
        got = 0
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
        return got

    def _check_complete(self, got: int | None, ids: np.ndarray, start: int) -> None:
        if got != ids.nbytes:
            raise InputError(self.where, f"{self.shape[0]} tokens of data", f"a truncated file (ends in token {start})")


class MemberCrc:
    """The CRC-32 of a stored zip member, computed on a thread of its own while the caller validates
    and counts the ids (zlib releases the GIL; the ids are read straight from the file, past
    zipfile, which would check it). `check()` waits for it and raises one InputError when it
    differs from the CRC the archive records: bytes changed on disk or in transit, so ids that
    pass the range checks may still be wrong.

    Cost: one more pass over the member (mapped, not copied) at zlib's crc32 speed (about 1-1.7 GB/s
    on one core here), beside the counting threads.
    """

    PIECE = 8 << 20  # bytes per read

    def __init__(self, path: Path, start: int, end: int, expected: int, where: str):
        self.where, self.expected = where, expected
        self._range = (start, end)
        self._path = path
        self._result: list = []
        self._thread = threading.Thread(target=self._run, name="moe-place-crc", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        start, end = self._range
        try:
            with open(self._path, "rb") as handle:
                crc = self._mapped_crc(handle, start, end)
                if crc is None:
                    crc = self._read_crc(handle, start, end)
            self._result.append(crc)
        except OSError as exc:
            self._result.append(exc)

    @staticmethod
    def _mapped_crc(handle, start: int, end: int) -> int | None:
        """The CRC over a read-only mapping of the member (no copy: about half the time of reading
        it into a buffer), or None when the file cannot be mapped or is shorter than the member."""
        base = start - start % mmap.ALLOCATIONGRANULARITY
        try:
            if os.fstat(handle.fileno()).st_size < end:
                return None
            with mmap.mmap(handle.fileno(), end - base, offset=base, access=mmap.ACCESS_READ) as mapping:
                with memoryview(mapping) as view:
                    return zlib.crc32(view[start - base:])
        except (OSError, ValueError):
            return None

    def _read_crc(self, handle, start: int, end: int) -> int:
        handle.seek(start)
        buffer = memoryview(bytearray(min(self.PIECE, max(end - start, 1))))
        left, crc = end - start, 0
        while left > 0:
            got = handle.readinto(buffer[:min(left, len(buffer))])
            if not got:
                break  # a file cut short: the ids' own reads say so
            crc = zlib.crc32(buffer[:got], crc)
            left -= got
        return crc

    def check(self) -> None:
        self._thread.join()
        got = self._result[0]
        if isinstance(got, OSError):
            raise InputError(self.where, "a readable zip member", error_reason(got))
        if got != self.expected:
            raise InputError(self.where, f"bytes whose CRC-32 is the archive's {self.expected:08x} (a damaged "
                             "file: its ids cannot be trusted)", f"{got:08x}")
