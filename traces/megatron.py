"""Megatron-Core's router trace (`router_trace_rank{N}.jsonl`, one file per rank) -> a trace.

What Megatron writes, from NVIDIA/Megatron-LM at d98e8a64ddf34856e74b24714e3bedb2f5a39553
(`megatron/core/transformer/moe/router_trace.py`, last changed in c1560d9481dae7c5243623457f5a1788d411cc6b):
- turned on by `--moe-routing-trace-path DIR` in training and inference (`init_moe_router_tracer`,
  called from `megatron/training/training.py`); each rank writes `DIR/router_trace_rank{rank}.jsonl`;
- one JSON object per line, one per (step, block, layer) of the rank: `step`, `stage`
  ("pre_dispatch"), `block` ("decoder" or "mtp"), `layer`, `rank`, `num_tokens`, `topk`,
  `top_indices` (`[num_tokens][topk]`, the rank's own tokens, int32 expert ids); MTP records also
  carry `mtp_idx`; optional sidecar offsets (`hs_offset`, `logit_offset`, ...) are not read;
- `layer` is parsed from the router's module name (`decoder.layers.<n>`: the index inside the model
  chunk the rank holds) or, failing that, the module's `layer_number`; `step` is the training
  iteration (training mode) or a counter advanced when a layer fires twice (inference mode).

How it is read here (`read_router_trace`):
- a folder: every `router_trace_rank*.jsonl` in it, in rank order; a file: that file alone;
- steps are the distinct `step` values in increasing order, named `step<N>`; layers the distinct
  `layer` values of the `decoder` records in increasing order (`layer_ids` as written); MTP records
  are left out (their `layer` numbers repeat the decoder's);
- counts: every record's ids counted into its (step, layer), summed over ranks and records;
- token level when each (step, rank) has exactly one record for every layer, all with the same
  `num_tokens` (the same tokens pass every layer): a step's tokens are its ranks' tokens in rank
  order. Otherwise (several micro-batches of a step on one rank, pipeline stages holding different
  layers) the trace is count level, and so is a folder larger than `max_token_bytes` (no token
  sample is kept: pair lift is then not measured);
- the number of experts is not written: it is the largest id + 1.
What the steps cannot say: with tensor parallelism and no sequence parallelism every rank of a
tensor-parallel group routes the same tokens, so each is counted once per rank (give one rank's
file); under pipeline parallelism `layer` is stage-local, so two stages' layer 0 are one layer here.
Every problem is one `InputError` naming the file, the line and the field: a missing or non-integer
`step`/`layer`/`rank`/`num_tokens`/`topk`, `top_indices` not `[num_tokens, topk]`, NaN or negative
ids, a top-k differing between records, an expert twice in one token's top-k.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

import numpy as np

from moe_place.errors import InputError
from moe_place.traces.jsonl import add_counts, first_repeat, id_array, parse_object, read_lines, stack_counts
from moe_place.traces.model import Trace, TraceMeta

__all__ = ["is_router_trace", "rank_files", "read_router_trace"]

RANK_FILE = re.compile(r"router_trace_rank(\d+)\.jsonl")
INT_FIELDS = ("step", "layer", "rank", "num_tokens", "topk")


def rank_files(folder: Path) -> list[Path]:
    """The `router_trace_rank{N}.jsonl` files of a folder, in rank order (empty if none)."""
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := RANK_FILE.fullmatch(p.name)) and p.is_file()]
    return [p for _, p in sorted(found)]


def is_router_trace(head: bytes) -> bool:
    """Whether the first bytes of a text file look like a router_trace record (its fields come first)."""
    return head.lstrip().startswith(b"{") and all(f'"{key}"'.encode() in head for key in ("step", "layer", "topk"))


def read_router_trace(paths: str | Path | Sequence[str | Path], *, max_token_bytes: int | None = None,
                      progress: bool = False) -> Trace:
    """Read a folder of rank files, one file, or several files (see the module doc).

    max_token_bytes: files larger than this in total are read into a count-level trace (None: never).
    progress: a bar on stderr (when it is a terminal) over the bytes read.
    """
    if isinstance(paths, (str, Path)):
        path = Path(paths)
        files = rank_files(path) if path.is_dir() else [path]
        if not files:
            raise InputError(str(path), "a folder with router_trace_rank<N>.jsonl files", "none")
    else:
        files = [Path(p) for p in paths]
        if not files:
            raise InputError("router trace", "at least one file")
    keep = max_token_bytes is None or sum(f.stat().st_size for f in files) <= max_token_bytes
    counts: dict[int, dict[int, np.ndarray]] = {}  # step -> layer -> counts [1, width]
    tokens: dict[tuple[int, int], dict[int, list[np.ndarray]]] = {}  # (step, rank) -> layer -> ids [n, k]
    top_k, first_where = None, ""
    label = f"read {files[0].name}" + (f" (+{len(files) - 1} files)" if len(files) > 1 else "")
    for path, number, _, line in read_lines(files, label, progress):
        where = f"{path}: line {number}"
        record = parse_object(line, where)
        if record.get("block", "decoder") != "decoder":
            continue
        step, layer, rank, num_tokens, k = (_int_field(record, key, where) for key in INT_FIELDS)
        if k < 1:
            raise InputError(f"{where}: topk", "an integer >= 1", k)
        if top_k is None:
            top_k, first_where = k, where
        elif k != top_k:
            raise InputError(f"{where}: topk", f"{top_k}, the top-k of every record (as {first_where})", k)
        if "top_indices" not in record:
            raise InputError(f"{where}: top_indices", "the expert ids [num_tokens, topk]", "missing")
        ids = id_array(record["top_indices"], f"{where}: top_indices", 2, "[num_tokens, topk]")
        if ids.shape != (num_tokens, k) and not (num_tokens == 0 and ids.size == 0):
            raise InputError(f"{where}: top_indices", f"[num_tokens = {num_tokens}, topk = {k}]", f"shape {list(ids.shape)}")
        ids = ids.reshape(num_tokens, 1, k)
        repeat = first_repeat(ids)
        if repeat is not None:
            raise InputError(f"{where}: top_indices", f"topk = {k} distinct experts per token",
                             f"an expert twice at token {repeat[0]}")
        by_layer = counts.setdefault(step, {})
        by_layer[layer] = add_counts(by_layer.get(layer), ids)
        if keep:
            tokens.setdefault((step, rank), {}).setdefault(layer, []).append(ids[:, 0, :].astype(np.int32))
    if top_k is None:
        raise InputError(str(files[0]), "at least one decoder record", "none")
    return _trace(files, counts, tokens if keep else None, top_k)


def _int_field(record: dict, key: str, where: str) -> int:
    value = record.get(key)
    if value is None:
        raise InputError(f"{where}: {key}", "an integer", "missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InputError(f"{where}: {key}", "an integer >= 0", repr(value))
    return value


def _trace(files: list[Path], counts: dict, tokens: dict | None, top_k: int) -> Trace:
    steps = sorted(counts)
    layers = sorted({layer for by_layer in counts.values() for layer in by_layer})
    width = max(c.shape[1] for by_layer in counts.values() for c in by_layer.values())
    empty = np.zeros((1, 0), dtype=np.int64)
    dense = np.stack([stack_counts([counts[s].get(layer, empty) for layer in layers], width)[:, 0, :] for s in steps])
    used = np.flatnonzero(dense.any(axis=(0, 1)))
    if not used.size:
        raise InputError(str(files[0]), "a non-empty trace (at least one token)", "0 tokens")
    num_experts = int(used[-1]) + 1
    meta = TraceMeta(num_experts=num_experts, top_k=top_k, layer_ids=tuple(layers), source=f"megatron:{files[0].name}",
                     dtype="int32", step_names=tuple(f"step{s}" for s in steps))
    if tokens is not None and _aligned(tokens, layers):
        ids = []
        for s in steps:
            ranks = sorted(rank for step, rank in tokens if step == s)
            ids.append(np.concatenate([np.stack([tokens[(s, r)][layer][0] for layer in layers], axis=1) for r in ranks]))
        return Trace(meta, topk_ids=tuple(ids))
    return Trace(meta, counts=dense[:, :, :num_experts])


def _aligned(tokens: dict, layers: list[int]) -> bool:
    """Whether every (step, rank) has one record per layer, all of the same tokens."""
    for by_layer in tokens.values():
        if sorted(by_layer) != layers or any(len(parts) != 1 for parts in by_layer.values()):
            return False
        if len({parts[0].shape[0] for parts in by_layer.values()}) != 1:
            return False
    return True
