"""JSON Lines trace files read one line at a time: the parts vLLM's and Megatron's readers share.

- `read_lines`: every line of one or more files with its file, line number and byte offset, and a
  progress bar over the bytes read (memory: one line at a time);
- `parse_object`: one line -> a JSON object, or an `InputError` naming the file and line;
- `id_array`: a field's nested lists `[rows][...]` (or vLLM's base64 `.npy` string) -> an integer
  array, with the shape, type and range checked (NaN, fractions, ragged rows, negative ids are errors);
- `first_repeat`: the first (row, layer) whose top-k names one expert twice;
- `add_counts`: dispatches per expert of `[tokens, layers, k]` ids added to `[layers, width]` counts
  whose width grows with the largest id seen (the number of experts is not written in these files);
- `parse_with_id_lists`: one line -> its object, with a placeholder string where the named fields'
  nested id lists were, and those lists read by numpy (`IdLists`, which `id_array` takes them back
  from); None when this fast path cannot prove it read the line as `json` would (the caller then
  uses `parse_object`).

Speed. Python's standard `json` builds one Python int per id and then `np.asarray` walks the lists:
`json.loads` of a 1.2 MiB line of ids runs at about 16 MiB/s and is 80% of the time. The ids are
nearly all the bytes of a line, and they are a regular nesting of brackets, commas and digits, so
`parse_with_id_lists` finds each named field's value with `bytes.find`, cuts it out of the line
(`json` parses the few hundred bytes left, with a placeholder string in its place) and reads it with
byte-string operations that run in C at hundreds of MiB/s:
1. only `[`, `]`, `,` and digits (`, ` as `json.dumps` writes it is accepted): anything else (a
   minus sign, a fraction, a space inside a number) is left to `json`, which names the error;
2. the skeleton (the digits deleted) must be exactly that of a regular `[T][L][K]` nesting, built
   from its first row and first block; no digit touches a `]` before it or a `[` after it, so
   digits sit only in the T*L*K slots, and T*L*K numbers mean one per slot (no empty slot `[,`,
   `,,`, `,]`); the digits are as many as the values need (no leading zero, which JSON forbids);
3. the numbers are read with a few numpy passes over the bytes (`_numbers`: one per digit place,
   uint16, so ids of 5 digits or more are left to `json`).
A field the line holds elsewhere than where the reader looks (a placeholder left unused) sends the
whole line to `json`. Measured on a 300 MiB file of 135 server responses (1800 tokens x 48 layers x
top-8 each, written as the tests write them) on this project's loaded 2-core machine: with `json`
17-19 MiB/s read whole, 10 MiB/s counted with its sample read back; with this path 73-79 and
51-54 MiB/s (`parse_with_id_lists` alone: about 100 MiB/s; the rest is the per-request checks and
counting). No JSON parser package is added: numpy does the work.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from moe_place.errors import InputError
from moe_place.progress import ProgressBar
from moe_place.traces.model import MAX_EXPERTS

__all__ = ["IdLists", "add_counts", "first_repeat", "id_array", "parse_object", "parse_with_id_lists", "read_line_at",
           "read_lines", "stack_counts"]

KIB = 1024  # the progress bar counts KiB read
DIGITS = b"0123456789"
# A placeholder string starts with NUL, which a JSON string can only write as \u0000: a line with no
# `\u0000` holds no string that looks like one (a line with one is left to `json`).
NUMBER_PIECE = 1 << 17  # bytes of list text read at once by `_numbers`: its scratch (9 bytes per byte) fits a core's L2
PLACEHOLDER = "\x00moe-place ids "  # + the index of the array it stands for
NUL_ESCAPE = b"\\u0000"


def read_lines(paths: Sequence[Path], label: str, progress: bool = False) -> Iterator[tuple[Path, int, int, bytes]]:
    """(file, line number from 1, byte offset, line) of every non-blank line of `paths` in order."""
    total = sum(path.stat().st_size for path in paths)
    bar = ProgressBar(-(-total // KIB), label, "KiB", enabled=None if progress else False)
    done = 0
    try:
        for path in paths:
            with open(path, "rb") as fh:
                offset = 0
                for number, line in enumerate(fh, start=1):
                    if line and not line.isspace():  # not blank (strip() would copy a long line)
                        yield path, number, offset, line
                    offset += len(line)
                    if (done + offset) // KIB > bar.done:
                        bar.advance((done + offset) // KIB - bar.done)
            done += path.stat().st_size
    finally:  # also on a bad line: its error starts on a line of its own
        bar.close()


def read_line_at(path: Path, offset: int) -> bytes:
    """The line of `path` that starts at byte `offset` (a second look at a line read before)."""
    with open(path, "rb") as fh:
        fh.seek(offset)
        return fh.readline()


def parse_object(line: bytes, where: str) -> dict:
    """One line of JSON Lines -> its object; InputError naming `where` if it is not a JSON object."""
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise InputError(where, "one JSON object per line", f"invalid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise InputError(where, "one JSON object per line", type(obj).__name__)
    return obj


class IdLists:
    """The id arrays `parse_with_id_lists` cut out of one line, each taken back by its placeholder."""

    def __init__(self, arrays: list[np.ndarray]):
        self.arrays = arrays
        self.taken = [False] * len(arrays)

    def take(self, value: object) -> np.ndarray | None:
        """The array whose placeholder `value` is (None: `value` is no placeholder)."""
        if not (isinstance(value, str) and value.startswith(PLACEHOLDER)):
            return None
        index = int(value[len(PLACEHOLDER):])
        self.taken[index] = True
        return self.arrays[index]

    @property
    def all_taken(self) -> bool:
        """Every array was read where the caller looks: the line was read as `json` would read it."""
        return all(self.taken)


def parse_with_id_lists(line: bytes, keys: Sequence[bytes]) -> tuple[dict, IdLists] | None:
    """One line -> (its object with a placeholder string in place of each nested id list that is the
    value of a field named in `keys`, those lists as arrays); None if that fast path cannot prove it
    read the line right (see the module doc), or if the line holds no such list.
    Every array is regular, of 3 dimensions `[T, L, K]` (or the empty list `[]`), uint16 ids in
    [0, 10000) (int64 for `[]`): the values `json` and `id_array` give, in a narrower dtype."""
    if NUL_ESCAPE in line:
        return None
    spans = sorted(span for key in keys for span in _list_spans(line, b'"' + key + b'"'))
    pieces, arrays, done = [], [], 0
    for start, end in spans:
        ids = _id_list(line[start:end]) if start >= done else None
        if ids is None:
            return None
        pieces += [line[done:start], b'"%b%d"' % (NUL_ESCAPE + PLACEHOLDER[1:].encode(), len(arrays))]
        arrays.append(ids)
        done = end
    if not arrays:
        return None
    pieces.append(line[done:])
    try:
        obj = json.loads(b"".join(pieces))
    except (ValueError, UnicodeDecodeError):
        return None
    return (obj, IdLists(arrays)) if isinstance(obj, dict) else None


def _list_spans(line: bytes, key: bytes) -> Iterator[tuple[int, int]]:
    """(start, end) of the text of each `[...]` value after `key` (a quoted field name) and its colon:
    from the `[` to the last `]` before the next `"` or `}` (a list of numbers holds neither)."""
    at = line.find(key)
    while at >= 0:
        start = _skip_space(line, at + len(key))
        if line[start:start + 1] == b":":
            start = _skip_space(line, start + 1)
            if line[start:start + 1] == b"[":
                stops = [i for i in (line.find(b'"', start), line.find(b"}", start)) if i >= 0]
                end = line.rfind(b"]", start, min(stops, default=len(line))) + 1
                yield start, end
        at = line.find(key, at + len(key))


def _skip_space(line: bytes, at: int) -> int:
    while line[at:at + 1] in (b" ", b"\t"):
        at += 1
    return at


def _id_list(text: bytes) -> np.ndarray | None:
    """uint16 `[T, L, K]` from the text of a nested JSON list of ids, None if not provably one (1-3 of
    the module doc)."""
    skeleton = text.translate(None, DIGITS)
    other = skeleton.translate(None, b"[],")
    if other:
        if other.strip(b" ") or len(other) != text.count(b", "):
            return None  # another byte: a sign, a fraction, a space elsewhere than after a comma, a string
        text, skeleton = text.replace(b", ", b","), skeleton.replace(b", ", b",")
    if skeleton == b"[]":
        return np.zeros((0, 0, 0), dtype=np.int64)
    if not skeleton.startswith(b"[[[") or skeleton[3:4] == b"[":
        return None
    row = skeleton[2:skeleton.find(b"]") + 1]  # [,,,] of the first token's first layer
    block = skeleton[1:skeleton.find(b"]]") + 2]  # [[,,,],[,,,]] of the first token
    k, layers = row.count(b",") + 1, block.count(b"[") - 1
    tokens = (len(skeleton) - 1) // (len(block) + 1)
    if block != b"[" + b",".join([row] * layers) + b"]" or skeleton != b"[" + b",".join([block] * tokens) + b"]":
        return None
    chars = np.frombuffer(text, dtype=np.uint8)
    digit = chars < ord("[")  # a digit or `,`
    digit &= chars != ord(",")
    # digits only between `[` or `,` and `,` or `]`: then the skeleton's T*L*K slots are the only
    # places they can be, and T*L*K numbers are one per slot (no empty slot)
    if (digit[1:] & (chars[:-1] == ord("]"))).any() or (digit[:-1] & (chars[1:] == ord("["))).any():
        return None
    ids = _numbers(chars, digit)
    if ids is None or ids.size != tokens * layers * k:
        return None  # an empty slot, a number of 5 digits or more
    digits = ids.size + sum(int(np.count_nonzero(ids >= 10 ** p)) for p in range(1, 4))
    if digits != len(text) - len(skeleton):
        return None  # a leading zero
    return ids.reshape(tokens, layers, k)


def _numbers(chars: np.ndarray, digit: np.ndarray) -> np.ndarray | None:
    """uint16 `[numbers]`: the decimal numbers in uint8 `chars` (`digit` marks their digits), in order;
    None if one has more than 4 digits (ids of 10000 and up, which no model has, are left to `json`).
    Read in pieces of about `NUMBER_PIECE` bytes cut after a separator (a piece's scratch stays in the
    core's cache: measured 1.8x faster than the whole text at once)."""
    pieces, start = [], 0
    while start < chars.size:
        end = min(chars.size, start + NUMBER_PIECE)
        while end < chars.size and digit[end - 1]:
            end += 1
        piece = _piece_numbers(chars[start:end], digit[start:end])
        if piece is None:
            return None
        pieces.append(piece)
        start = end
    return np.concatenate(pieces) if len(pieces) != 1 else pieces[0]


def _piece_numbers(chars: np.ndarray, digit: np.ndarray) -> np.ndarray | None:
    """`_numbers` of a piece that starts at a number's first digit or a separator. The number ending
    at byte i is the sum over places p of digit i-p times 10**p while bytes i-p..i are all digits:
    one vector pass per place (in uint16: 4 digits fit), no Python loop per number."""
    places = np.subtract(chars, ord("0"), dtype=np.uint16)
    places *= digit  # separators count 0
    value = places.copy()
    run = digit.copy()  # run[i]: bytes i-p..i are all digits
    for p in range(1, 5):
        run[p:] &= digit[:-p]
        run[:p] = False
        if not run.any():
            break
        if p == 4:
            return None
        term = places[:-p] * np.uint16(10 ** p)
        term *= run[p:]
        value[p:] += term
    last = digit.copy()  # the last digit of each number
    last[:-1] &= ~digit[1:]
    return np.compress(last, value)  # much faster than value[last]


def id_array(value: object, where: str, ndim: int, shape: str, lists: IdLists | None = None) -> np.ndarray:
    """int64 array of `ndim` dimensions (`shape` words it in errors) from nested JSON lists, or from a
    base64 string of `.npy` bytes (how recent vLLM returns `routed_experts`); or the uint16 array
    `lists` holds for a placeholder (`parse_with_id_lists`, 3 dimensions, the same values). Expert
    ids must be whole numbers in [0, MAX_EXPERTS); an empty list is an array with no rows."""
    parsed = None if lists is None else lists.take(value)
    if parsed is not None:
        return parsed
    if isinstance(value, str):
        arr = _npy_from_base64(value, where)
    elif isinstance(value, list):
        if not value:
            return np.zeros((0,) * ndim, dtype=np.int64)
        try:
            arr = np.asarray(value)
        except ValueError:  # numpy >= 1.24 refuses ragged nesting
            raise InputError(where, f"a regular nested list {shape}", "rows of different lengths") from None
    else:
        raise InputError(where, f"a nested list {shape} of expert ids", type(value).__name__)
    if arr.dtype.kind == "f":
        bad = "NaN" if np.isnan(arr).any() else ("inf" if np.isinf(arr).any() else "a fractional number")
        if bad == "a fractional number" and (arr == np.round(arr)).all():
            bad = "a number written as a float"
        raise InputError(where, "integer expert ids", bad)
    if arr.dtype.kind not in "iu":
        raise InputError(where, f"a nested list {shape} of integer expert ids",
                         "rows of different lengths" if arr.dtype == object else f"values of type {arr.dtype}")
    if arr.ndim != ndim:
        raise InputError(where, f"a {ndim}-D list {shape}", f"{arr.ndim} dimensions, shape {list(arr.shape)}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= MAX_EXPERTS:
            raise InputError(where, f"expert ids in [0, {MAX_EXPERTS})", lo if lo < 0 else hi)
    return arr


def _npy_from_base64(text: str, where: str) -> np.ndarray:
    try:
        data = base64.b64decode(text, validate=True)
        if not data.startswith(b"\x93NUMPY"):
            raise ValueError("no .npy header")
        return np.load(io.BytesIO(data), allow_pickle=False)
    except (binascii.Error, ValueError, EOFError, OSError) as exc:
        raise InputError(where, "a base64 string of .npy bytes (or a nested list of ids)", str(exc)) from None


def first_repeat(ids: np.ndarray) -> tuple[int, int] | None:
    """(row, layer) of the first token-layer of int `[tokens, layers, k]` ids naming an expert twice."""
    if ids.shape[2] < 2 or ids.size == 0:
        return None
    # whether there is one: k-1 contiguous compares of the flat ids at shifts 1..k-1, every other
    # token-layer's ids moved above MAX_EXPERTS so that ids of neighbouring ones never compare equal
    # (much faster than sorting every token-layer's k ids, which is done only to find where)
    keys = ids.astype(np.int32).reshape(-1, ids.shape[2])
    keys[1::2] += MAX_EXPERTS
    keys = keys.reshape(-1)
    if not any((keys[:-shift] == keys[shift:]).any() for shift in range(1, ids.shape[2])):
        return None
    ordered = np.sort(ids, axis=2)
    repeated = (ordered[:, :, 1:] == ordered[:, :, :-1]).any(axis=2)
    if not repeated.any():
        return None
    token, layer = np.argwhere(repeated)[0]
    return int(token), int(layer)


def add_counts(counts: np.ndarray | None, ids: np.ndarray) -> np.ndarray:
    """int64 `[layers, width]`: `counts` (None: none yet) plus the dispatches of `ids` `[tokens, layers, k]`
    (ids in range), the width widened to the largest id + 1 when needed."""
    num_layers = ids.shape[1]
    width = 0 if counts is None else counts.shape[1]
    if ids.size:
        width = max(width, int(ids.max()) + 1)
    keys = np.multiply(ids, num_layers, dtype=np.intp)
    keys += np.arange(num_layers)[None, :, None]
    added = np.bincount(keys.ravel(), minlength=width * num_layers).reshape(width, num_layers).T
    if counts is None:
        return np.ascontiguousarray(added)
    if counts.shape[1] < width:
        counts = np.pad(counts, ((0, 0), (0, width - counts.shape[1])))
    counts += added
    return counts


def stack_counts(steps: Sequence[np.ndarray], num_experts: int) -> np.ndarray:
    """int64 `[steps, layers, num_experts]` from per-step `[layers, width <= num_experts]` counts."""
    return np.stack([np.pad(c, ((0, 0), (0, num_experts - c.shape[1]))) for c in steps])
