"""SGLang expert-distribution-recorder dumps (`torch.save` files) -> traces.

Facts from SGLang's `python/sglang/srt/eplb/expert_distribution.py` (recorder modes set with
`--expert-distribution-recorder-mode`, files written on `/dump_expert_distribution_record`):
- `stat` / `stat_approx`: one file (rank 0) `{"rank", "logical_count": int32 [steps, layers,
  logical], "average_utilization_rate_over_window"}`. Steps are the recorder's buffer rows: rows of a
  circular buffer that were never written are all zero (dropped here).
- `per_pass`: one file per rank `{"records": [{"forward_pass_id", "rank", "gatherer_key",
  "global_physical_count": [layers, physical]}, ...], "last_physical_to_logical_map": [layers, physical]}`.
  Counts are per physical slot; the map turns them into logical experts (replicas summed).
- `per_token`: the records also carry `topk_ids_of_layer` int32 `[layers, tokens, 8]` (plus
  input_ids, positions, ...): the *physical* slot ids each token chose, -1 where nothing was
  recorded (dense layers, padded tokens, columns beyond the model's top-k: the recorder always
  keeps 8 columns). Mapped to logical ids and transposed to `[tokens, layers, k]`.
`layers` counts every decoder layer; dense layers are all-zero (count modes) or all -1 (per_token)
rows. They are dropped by default (`layer_ids` keep the model layer index of the MoE layers);
`keep_dense_layers=True` keeps them as zero rows (per_token then gives a count-level trace, since
a dense layer has no expert ids). Forward passes become the steps, in forward_pass_id order;
several files (ranks) are merged by summing each pass's counts / concatenating its tokens, as
SGLang's own `stat` mode sums over ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from moe_place.errors import InputError
from moe_place.traces.model import Trace, TraceMeta, check_counts, located
from moe_place.traces.npz import infer_top_k
from moe_place.traces.physical import check_phy2log, physical_to_logical_counts
from moe_place.traces.torchfile import load_torch_file
from moe_place.traces.vllm import is_vllm_dict, vllm_window_trace

__all__ = ["dump_mode", "read_sglang_dumps", "read_torch_dump"]


def read_torch_dump(path: Path, top_k: int | None = None, keep_dense_layers: bool = False) -> Trace:
    """Read one `.pt` file: an SGLang dump (any mode) or a vLLM-style window dict."""
    path = Path(path)
    obj = load_torch_file(path)
    if is_vllm_dict(obj):
        return vllm_window_trace(obj, path, top_k)
    return read_sglang_dumps([path], top_k=top_k, keep_dense_layers=keep_dense_layers, loaded=[obj])


def dump_mode(obj: Any, where: str) -> str:
    """'stat', 'per_pass' or 'per_token' from the dump's keys."""
    if not isinstance(obj, Mapping):
        raise InputError(where, "an SGLang expert-distribution dump (a dict)", type(obj).__name__)
    if "logical_count" in obj:
        return "stat"
    if "records" in obj:
        records = obj["records"]
        if not isinstance(records, (list, tuple)) or not all(isinstance(r, Mapping) for r in records):
            raise InputError(f"{where}: records", "a list of dicts", type(records).__name__)
        if records and all("topk_ids_of_layer" in r for r in records):
            return "per_token"
        return "per_pass"
    raise InputError(where, "an SGLang dump with 'logical_count' (stat) or 'records' (per_pass/per_token)",
                     f"keys {sorted(map(str, obj))[:8]}")


def read_sglang_dumps(paths: Sequence[str | Path], top_k: int | None = None, keep_dense_layers: bool = False,
                      loaded: Sequence[Any] | None = None) -> Trace:
    """Read and merge SGLang dumps of one recording (one file per rank for per_pass/per_token)."""
    paths = [Path(p) for p in paths]
    if not paths:
        raise InputError("sglang dumps", "at least one file")
    objs = list(loaded) if loaded is not None else [load_torch_file(p) for p in paths]
    modes = {dump_mode(obj, str(p)) for obj, p in zip(objs, paths)}
    if len(modes) != 1:
        raise InputError(str(paths[0]), "dumps of one recorder mode", sorted(modes))
    mode = modes.pop()
    where = str(paths[0]) if len(paths) == 1 else f"{paths[0]} (+{len(paths) - 1} files)"
    with located(where):
        if mode == "stat":
            return _stat_trace(objs, where, top_k, keep_dense_layers)
        return _records_trace(objs, where, mode, top_k, keep_dense_layers)


# ---------------------------------------------------------------------- stat
def _stat_trace(objs: list, where: str, top_k: int | None, keep_dense_layers: bool) -> Trace:
    counts = None
    for obj in objs:
        part = check_counts(np.asarray(obj["logical_count"]), "logical_count")
        if counts is not None and part.shape != counts.shape:
            raise InputError("logical_count", f"shape {counts.shape} in every file", f"shape {part.shape}")
        counts = part if counts is None else counts + part
    written = counts.reshape(counts.shape[0], -1).any(axis=1)  # ring-buffer rows never filled are 0
    if not written.any():
        raise InputError("logical_count", "a non-empty trace (at least one dispatch)", "all counts are 0")
    return _count_trace(counts[written], where, top_k, keep_dense_layers, "sglang-stat",
                        tuple(f"step{i}" for i in np.flatnonzero(written)))


def _count_trace(counts: np.ndarray, where: str, top_k: int | None, keep_dense_layers: bool, kind: str,
                 step_names: tuple[str, ...]) -> Trace:
    moe = counts.any(axis=(0, 2))
    layers = np.arange(counts.shape[1]) if keep_dense_layers else np.flatnonzero(moe)
    counts = counts[:, layers, :]
    k = top_k if top_k is not None else infer_top_k(counts)
    if not 1 <= k <= counts.shape[2]:
        raise InputError("top_k", f"an integer in [1, {counts.shape[2]}]", k)
    meta = TraceMeta(num_experts=counts.shape[2], top_k=k, layer_ids=tuple(int(x) for x in layers),
                     source=f"{kind}:{Path(where.split(' (+')[0]).name}", dtype="int32", step_names=step_names)
    return Trace(meta, counts=counts)


# ---------------------------------------------------------------------- per_pass / per_token
def _records_trace(objs: list, where: str, mode: str, top_k: int | None, keep_dense_layers: bool) -> Trace:
    phy2log = None
    by_pass: dict[int, list[Mapping]] = {}
    for obj in objs:
        if "last_physical_to_logical_map" not in obj:
            raise InputError("last_physical_to_logical_map", "the map saved with the records", "missing")
        current = check_phy2log(np.asarray(obj["last_physical_to_logical_map"]), "last_physical_to_logical_map")
        if phy2log is not None and not np.array_equal(current, phy2log):
            raise InputError("last_physical_to_logical_map", "the same map in every rank's file", "different maps")
        phy2log = current
        for i, record in enumerate(obj["records"]):
            pass_id = record.get("forward_pass_id")
            if not isinstance(pass_id, (int, np.integer)) or isinstance(pass_id, bool):
                raise InputError(f"records[{i}].forward_pass_id", "an integer", type(pass_id).__name__)
            by_pass.setdefault(int(pass_id), []).append(record)
    if not by_pass:
        raise InputError("records", "at least one forward pass", "no records")
    passes = sorted(by_pass)
    names = tuple(f"pass{p}" for p in passes)
    num_logical = int(phy2log.max()) + 1
    if mode == "per_token":
        token_steps = [_pass_tokens(by_pass[p], phy2log, p) for p in passes]
        return _token_trace(token_steps, where, num_logical, top_k, keep_dense_layers, names)
    physical = np.stack([_pass_physical(by_pass[p], phy2log, p) for p in passes])
    counts = physical_to_logical_counts(physical, phy2log, "global_physical_count", num_logical)
    return _count_trace(counts, where, top_k, keep_dense_layers, "sglang-per_pass", names)


def _pass_physical(records: list[Mapping], phy2log: np.ndarray, pass_id: int) -> np.ndarray:
    total = np.zeros(phy2log.shape, dtype=np.int64)
    for record in records:
        where = f"records[forward_pass_id={pass_id}].global_physical_count"
        if "global_physical_count" not in record:
            raise InputError(where, "an int array [layers, physical]", "missing")
        arr = np.asarray(record["global_physical_count"])
        if arr.shape != phy2log.shape:
            raise InputError(where, f"shape {phy2log.shape} (as last_physical_to_logical_map)", f"shape {arr.shape}")
        total += check_counts(arr[None], where)[0]
    return total


def _pass_tokens(records: list[Mapping], phy2log: np.ndarray, pass_id: int) -> np.ndarray:
    """int64 `[tokens, layers, 8]` logical ids of one pass (ranks concatenated), -1 where none."""
    parts = []
    num_layers, num_physical = phy2log.shape
    for record in records:
        where = f"records[forward_pass_id={pass_id}].topk_ids_of_layer"
        ids = np.asarray(record["topk_ids_of_layer"])
        if ids.ndim != 3 or ids.dtype.kind not in "iu" or ids.shape[0] != num_layers:
            raise InputError(where, f"an int array [layers={num_layers}, tokens, k]", f"{ids.dtype} shape {ids.shape}")
        ids = ids.astype(np.int64)
        if ids.size and (ids.min() < -1 or ids.max() >= num_physical):
            bad = int(ids.min()) if ids.min() < -1 else int(ids.max())
            raise InputError(where, f"physical slot ids in [0, {num_physical}) or -1", bad)
        layer = np.arange(num_layers)[:, None, None]
        logical = np.where(ids >= 0, phy2log[layer, np.maximum(ids, 0)], -1)
        if (logical[ids >= 0] < 0).any():
            raise InputError(where, "tokens only on used slots", "a token on a slot mapped to -1")
        parts.append(logical.transpose(1, 0, 2))
    return np.concatenate(parts, axis=0)


def _token_trace(steps: list[np.ndarray], where: str, num_logical: int, top_k: int | None,
                 keep_dense_layers: bool, names: tuple[str, ...]) -> Trace:
    valid = [ids >= 0 for ids in steps]
    moe = np.zeros(steps[0].shape[1], dtype=bool)
    columns = np.zeros(steps[0].shape[2], dtype=bool)
    for v in valid:
        moe |= v.any(axis=(0, 2))
        columns |= v.any(axis=(0, 1))
    if not moe.any():
        raise InputError("topk_ids_of_layer", "a non-empty trace (at least one recorded token)", "all -1")
    if keep_dense_layers and not moe.all():
        counts = np.stack([_count_valid(ids, num_logical) for ids in steps])
        return _count_trace(counts, where, top_k, True, "sglang-per_token", names)
    k = int(columns.sum())
    if not columns[:k].all():
        raise InputError("topk_ids_of_layer", "the recorded ids in the first k columns", "a gap of -1 columns")
    if top_k is not None and top_k != k:
        raise InputError("top_k", f"{k} (ids recorded per token)", top_k)
    layer_ids = np.flatnonzero(moe)
    out = []
    for ids, v in zip(steps, valid):
        ids, v = ids[:, layer_ids, :k], v[:, layer_ids, :k]
        recorded = v.any(axis=(1, 2))  # padded tokens have no id in any layer
        if not v[recorded].all():
            token = int(np.flatnonzero(recorded & ~v.all(axis=(1, 2)))[0])
            raise InputError("topk_ids_of_layer", f"{k} ids in every MoE layer of a recorded token",
                             f"-1 entries at token {token}")
        out.append(ids[recorded])
    kept = [(name, ids) for name, ids in zip(names, out) if ids.shape[0]]  # passes of padding only
    meta = TraceMeta(num_experts=num_logical, top_k=k, layer_ids=tuple(int(x) for x in layer_ids),
                     source=f"sglang-per_token:{Path(where.split(' (+')[0]).name}", dtype="int32",
                     step_names=tuple(name for name, _ in kept))
    out = [ids for _, ids in kept]
    return Trace(meta, topk_ids=tuple(ids.astype(np.int32) for ids in out))


def _count_valid(ids: np.ndarray, num_logical: int) -> np.ndarray:
    """int64 `[layers, experts]` counts of the ids >= 0 of `[tokens, layers, k]`."""
    num_layers = ids.shape[1]
    flat = ids + (np.arange(num_layers) * num_logical)[None, :, None]
    return np.bincount(flat[ids >= 0], minlength=num_layers * num_logical).reshape(num_layers, num_logical)
