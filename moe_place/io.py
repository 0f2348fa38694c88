"""Small I/O helpers: atomic writes of text, JSON and binary files; why an input or output path is unusable."""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from moe_place.errors import InputError
from moe_place.interrupts import raise_if_interrupted, signals_held

__all__ = ["file_sha256", "input_problem", "output_file", "output_problem", "read_input_text", "write_atomic",
           "write_json_atomic"]


def write_atomic(path: str | Path, data: bytes | str) -> None:
    """Write `data` to `path` so readers see the old file or the whole new one, never a part; the
    temporary file is removed whatever stops the write (an error, Ctrl-C, SIGTERM)."""
    raise_if_interrupted()  # an interrupt some library swallowed: write nothing
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = data.encode() if isinstance(data, str) else data
    with signals_held():  # an interrupt between creating the file and knowing its name would leave it behind
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the mode a plain open() would
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """Strict JSON (NaN and infinities are refused: other readers cannot parse them), written atomically."""
    try:
        text = json.dumps(obj, indent=1, sort_keys=False, allow_nan=False)
    except ValueError:
        raise InputError(str(path), "finite numbers only (strict JSON)", "NaN or infinity in the data") from None
    write_atomic(path, text + "\n")


def input_problem(path: str | Path) -> str | None:
    """Why `path` cannot be read as a file ('no such file', 'a directory', 'a symlink loop',
    'a broken symlink', 'permission denied', ...), or None when it can be opened."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a broken symlink" if os.path.islink(path) else "no such file"
    except OSError as exc:
        return _reason(exc)
    if stat.S_ISDIR(mode):
        return "a directory"
    try:
        with open(path, "rb"):
            return None
    except OSError as exc:
        return _reason(exc)


def read_input_text(path: str | Path, expected: str) -> str:
    """The UTF-8 text of an input file; InputError naming the file and why it cannot be read."""
    problem = input_problem(path)
    if problem is not None:
        raise InputError(str(path), expected, problem)
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InputError(str(path), expected, "not UTF-8 text") from None
    except OSError as exc:
        raise InputError(str(path), expected, _reason(exc)) from None


def output_problem(path: str | Path) -> str | None:
    """Why a file cannot be written at `path` (a directory there, a missing or unwritable folder),
    or None. Probes the folder by creating and removing a temporary file in it."""
    path = Path(path)
    if not str(path):
        return "an empty path"
    if path.is_dir():
        return "a directory"
    folder = path.parent
    if not folder.exists():
        return f"a missing folder {folder}"
    if not folder.is_dir():
        return f"{folder} is not a folder"
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=folder)
    except OSError as exc:
        why = "files cannot be created there" if exc.errno == errno.ENOENT else _reason(exc)
        return f"an unwritable folder {folder} ({why})"
    os.close(fd)
    os.unlink(probe)
    if path.exists() and not os.access(path, os.W_OK):
        return "a read-only file"
    return None



def output_file(text: str) -> str:
    """An argparse type: a path a file can be written to (`output_problem`), checked when the options are parsed,
    before the work (the CLI's output options and the benchmarks' records alike)."""
    problem = output_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"expected a writable file path, got {text!r} ({problem})")
    return text

def _reason(exc: OSError) -> str:
    """One short phrase for an OSError (never 'no such file' unless there is none)."""
    known = {errno.ELOOP: "a symlink loop", errno.EACCES: "permission denied", errno.EPERM: "permission denied",
             errno.EISDIR: "a directory", errno.ENOENT: "no such file", errno.ENOTDIR: "a path through a file",
             errno.EROFS: "a read-only file system"}
    return known.get(exc.errno, exc.strerror or type(exc).__name__)


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes (the trace digest a plan records; how bundled traces are recognised);
    of a folder (TensorRT-LLM's statistics), the sha256 of its files' names and digests in name order."""
    if Path(path).is_dir():
        files = sorted(p for p in Path(path).iterdir() if p.is_file())
        listing = "".join(f"{p.name}\0{file_sha256(p)}\n" for p in files)
        return hashlib.sha256(listing.encode()).hexdigest()
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
