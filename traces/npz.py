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
decompressing chunk by chunk). The `topk_ids` member is read, whole or by chunks, for both readers by
`moe_place.traces.npz_member.IdsReader`.
"""

from __future__ import annotations

import io
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from moe_place.errors import InputError
from moe_place.io import write_atomic
from moe_place.traces.content import not_a_zip
from moe_place.traces.model import MAX_EXPERTS, Trace, TraceMeta, check_counts, located
from moe_place.traces.npz_member import READ_ERRORS, IdsReader, MemberCrc, error_reason

__all__ = ["NpzHeader", "check_meta_against_ids", "check_num_experts", "check_totals_divisible", "counts_trace",
           "crc_checked", "header_meta", "infer_top_k", "open_npz", "read_header", "read_member", "read_npz",
           "save_npz", "split_by_step", "step_index", "token_trace"]

FORMAT_VERSION = 1


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
