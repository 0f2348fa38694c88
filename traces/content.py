"""What a file really holds, told from its bytes: for the one-line errors about trace files.

A trace file's name says `.npz` or `.pt`; its bytes may say otherwise (a gzip renamed `.npz`, a
file allocated but never written, a download cut short, a plain pickle named `.pt`). The readers
call these before they hand a file to numpy or torch, so the error says what the file is instead
of what a parser tripped over (`BadZipFile: File is not a zip file`, `KeyError: 101`).
"""

from __future__ import annotations

import zipfile
from pathlib import Path

__all__ = ["describe", "is_text", "is_torch_legacy", "is_zip", "not_a_zip", "read_head", "zip_problem"]

HEAD_BYTES = 16  # enough for every signature below

# (leading bytes, what they are): file signatures of the formats a trace file is mistaken for
SIGNATURES = (
    (b"\x1f\x8b", "gzip-compressed data"),
    (b"BZh", "bzip2-compressed data"),
    (b"\xfd7zXZ\x00", "xz-compressed data"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed data"),
    (b"7z\xbc\xaf\x27\x1c", "a 7-Zip archive"),
    (b"\x93NUMPY", "a single numpy .npy array"),
    (b"\x89HDF\r\n\x1a\n", "an HDF5 file"),
    (b"\x89PNG\r\n\x1a\n", "a PNG image"),
    (b"PAR1", "a Parquet file"),
)
# torch.save's legacy (non-zip) format: pickle protocol 2, then torch's magic number as a long
TORCH_LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"


def read_head(path: Path) -> bytes:
    """The first `HEAD_BYTES` bytes of `path` (OSError propagates: the caller words it)."""
    with open(path, "rb") as fh:
        return fh.read(HEAD_BYTES)


def is_zip(head: bytes) -> bool:
    """Starts like a zip archive (npz files and torch.save's default format are zips)."""
    return head.startswith((b"PK\x03\x04", b"PK\x05\x06"))


def is_torch_legacy(head: bytes) -> bool:
    return head.startswith(TORCH_LEGACY_MAGIC)


def describe(head: bytes, size: int) -> str:
    """What a file of `size` bytes starting with `head` holds, in a few words for an error's `got`.

    >>> describe(b"\\x1f\\x8b\\x08\\x00", 1000)
    'gzip-compressed data'
    >>> describe(bytes(16), 2 << 30)
    '2.0 GiB starting with zero bytes (allocated but never written, or a sparse copy?)'
    """
    for signature, what in SIGNATURES:
        if head.startswith(signature):
            return what
    if is_torch_legacy(head):
        return "a torch.save file in torch's legacy format"
    if is_zip(head):
        return "a zip archive"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return f"a plain Python pickle (protocol {head[1]}), not a torch.save file"
    if head and not head.strip(b"\x00"):
        return f"{_size(size)} starting with zero bytes (allocated but never written, or a sparse copy?)"
    text = _text(head)
    if text is not None:
        first = text.strip().splitlines()[0] if text.strip() else ""
        return f"text starting {first[:12]!r}" if first else "blank text"
    return f"binary data of no format moe-place knows (first bytes {head[:4].hex(' ')})"


def is_text(head: bytes) -> bool:
    """Starts like a text file (CSV, JSON): UTF-8 of printable characters."""
    return _text(head) is not None


def _text(head: bytes) -> str | None:
    """`head` as text if it is UTF-8 (a byte-order mark allowed, a character cut at the end too) of
    printable characters and white space; else None."""
    head = head.removeprefix(b"\xef\xbb\xbf")
    for cut in range(4):
        try:
            text = head[:len(head) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
        return text if all(c.isprintable() or c.isspace() for c in text) else None
    return None


def not_a_zip(path: Path) -> str | None:
    """What the file is when it is not a readable zip archive (an npz must be one), else None."""
    try:
        head, size = read_head(path), path.stat().st_size
    except OSError:
        return None  # the caller's own error says what the OS said
    return zip_problem(path) if is_zip(head) else f"{describe(head, size)}, not a zip archive"


def zip_problem(path: Path) -> str | None:
    """Why a file that starts like a zip archive cannot be opened as one, or None if it can.

    A zip's directory is at its end: a file cut short (an interrupted download or copy) or with
    bytes after its end (padded to a larger size) has no end record there.
    """
    try:
        with zipfile.ZipFile(path):
            return None
    except zipfile.BadZipFile as exc:
        size = _size(path.stat().st_size)
        if "not a zip file" in str(exc):
            return (f"a zip archive without its end record ({size}): cut short, as by an interrupted download or "
                    f"copy, or padded with bytes after its end")
        return f"a damaged zip archive ({size}: {str(exc).strip() or 'BadZipFile'})"
    except (OSError, EOFError, ValueError) as exc:
        return f"an unreadable zip archive ({type(exc).__name__}: {exc})"


def _size(size: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} bytes"
