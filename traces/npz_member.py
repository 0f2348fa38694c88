"""The `topk_ids` member of an `.npz` trace read straight from the zip archive, and how a failed read is said.

An `.npz` is a zip archive of `.npy` members. A token-level trace's `topk_ids` can be larger than memory, so
`IdsReader` reads that one member whole or chunk by chunk (from any thread when it is stored uncompressed),
checking it against the CRC-32 the archive records (`MemberCrc`); `token_bytes` says how large it is. What a
damaged file can raise on the way (`READ_ERRORS`) becomes one InputError line (`error_reason`), here and in the
other loaders. The format itself (which members, what they mean) is `moe_place.traces.npz`.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import threading
import tokenize
import zipfile
import zlib
from pathlib import Path
from typing import Iterator

import numpy as np

from moe_place.errors import InputError

__all__ = ["IdsReader", "MemberCrc", "error_reason", "token_bytes"]

# What a damaged file can raise inside numpy/zipfile; each becomes one InputError.
READ_ERRORS = (ValueError, OSError, EOFError, KeyError, IndexError, TypeError, zipfile.BadZipFile,
               zlib.error, NotImplementedError, OverflowError, MemoryError, UnicodeDecodeError)


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
