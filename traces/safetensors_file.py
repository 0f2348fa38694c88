"""The safetensors file format, read and written with numpy alone (no `safetensors` package needed).

A safetensors file is an 8-byte little-endian header size `N`, then `N` bytes of UTF-8 JSON, then
the tensors' bytes. The JSON maps each tensor name to `{"dtype": "I64", "shape": [...],
"data_offsets": [begin, end]}` (offsets into the bytes after the header) and may hold a
`"__metadata__"` map of strings. Tensors are C-ordered little-endian; their byte ranges cover the
data without a gap or an overlap. This is the format's published description (the `safetensors`
project's README); the tests check this module against that project's own library, which writes
the files TensorRT-LLM's expert statistics are made of (`moe_place.traces.trtllm`).

Why not the `safetensors` package: moe-place reads the statistics beside TensorRT-LLM or on a
laptop without it, and the format is small enough that a reader is fifty lines of numpy. Every
problem is an `InputError` naming the file (and tensor).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe_place.errors import InputError
from moe_place.io import write_atomic

__all__ = ["TensorInfo", "read_header", "read_safetensors", "read_tensor", "safetensors_bytes", "write_safetensors"]

# the format's dtype names and the numpy dtype of each (little-endian); BF16 and FP8 have no numpy twin
DTYPES = {"BOOL": "|b1", "U8": "|u1", "I8": "|i1", "I16": "<i2", "U16": "<u2", "I32": "<i4", "U32": "<u4",
          "I64": "<i8", "U64": "<u8", "F16": "<f2", "F32": "<f4", "F64": "<f8"}
NAMES = {np.dtype(code): name for name, code in DTYPES.items()}
MAX_HEADER_BYTES = 100 << 20  # the reference library refuses a larger header as well


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor of a file is: `dtype` (numpy), `shape`, and `begin`/`end` byte offsets
    from the start of the file."""

    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(path: str | Path) -> dict[str, TensorInfo]:
    """The tensors of a safetensors file by name, in the file's order of offsets, checked against the
    file's size; InputError naming the file (and tensor) for anything that is not the format."""
    path = Path(path)
    expected = "a safetensors file (8-byte header size, JSON header, tensor bytes)"
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            header_size = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            if header_size is None or not 2 <= header_size <= min(MAX_HEADER_BYTES, size - 8):
                raise InputError(str(path), expected, f"{size} bytes, header size {header_size}")
            text = fh.read(header_size)
    except OSError as exc:
        raise InputError(str(path), f"a readable {expected}", exc.strerror or type(exc).__name__) from None
    try:
        header = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(str(path), expected, f"a header that is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise InputError(str(path), expected, f"a JSON {type(header).__name__} as header")
    start = 8 + header_size
    tensors = {name: _tensor_info(path, name, entry, start) for name, entry in header.items()
               if name != "__metadata__"}
    _check_offsets(path, tensors, start, size)
    return dict(sorted(tensors.items(), key=lambda item: item[1].begin))


def _tensor_info(path: Path, name: str, entry, start: int) -> TensorInfo:
    where = f"{path}: {name}"
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise InputError(where, "a tensor entry {dtype, shape, data_offsets}", entry)
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPES:
        raise InputError(where, f"a dtype numpy reads ({', '.join(DTYPES)})", dtype)
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise InputError(where, "a shape of non-negative integers", shape)
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise InputError(where, "data_offsets [begin, end]", offsets)
    numpy_dtype = np.dtype(DTYPES[dtype])
    nbytes = int(np.prod(shape, dtype=np.int64)) * numpy_dtype.itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise InputError(where, f"{nbytes} bytes ({dtype} shape {shape})", f"data_offsets {offsets}")
    return TensorInfo(numpy_dtype, tuple(shape), start + offsets[0], start + offsets[1])


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_offsets(path: Path, tensors: dict[str, TensorInfo], start: int, size: int) -> None:
    """The byte ranges, in order, tile the data from the header's end to the file's end."""
    at = start
    for name, info in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if info.begin != at:
            raise InputError(f"{path}: {name}", f"data from byte {at - start} (no gap, no overlap)",
                             f"data_offsets [{info.begin - start}, {info.end - start}]")
        at = info.end
    if at != size:
        raise InputError(str(path), f"{at} bytes (as the header says)", f"{size} bytes (cut short or padded)")


def read_tensor(path: str | Path, info: TensorInfo) -> np.ndarray:
    """One tensor of the file (`read_header` gives its `info`), native byte order, its own memory."""
    with open(path, "rb") as fh:
        fh.seek(info.begin)
        data = fh.read(info.end - info.begin)
    if len(data) != info.end - info.begin:
        raise InputError(str(path), f"{info.end} bytes", "a file cut short while reading")
    array = np.frombuffer(data, dtype=info.dtype).reshape(info.shape)
    return array.astype(info.dtype.newbyteorder("="), copy=True)


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file by name."""
    return {name: read_tensor(path, info) for name, info in read_header(path).items()}


def safetensors_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """The bytes of a safetensors file holding `arrays` (names in sorted order, the header padded with
    spaces to a multiple of 8 bytes, as the reference library pads it)."""
    header, chunks, at = {}, [], 0
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder not in "|" else array.dtype
        if np.dtype(dtype) not in NAMES:
            raise InputError(f"tensor {name}", f"a dtype of {', '.join(DTYPES)}", str(array.dtype))
        data = array.astype(dtype, copy=False).tobytes()
        header[name] = {"dtype": NAMES[np.dtype(dtype)], "shape": list(array.shape),
                        "data_offsets": [at, at + len(data)]}
        chunks.append(data)
        at += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)


def write_safetensors(path: str | Path, arrays: dict[str, np.ndarray]) -> None:
    """Write `arrays` as a safetensors file, atomically."""
    write_atomic(path, safetensors_bytes(arrays))
