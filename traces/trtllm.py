"""TensorRT-LLM expert statistics (the folder of `EXPERT_STATISTIC_PATH`) -> a trace, and that layout written.

What TensorRT-LLM writes, from its sources (NVIDIA/TensorRT-LLM, read with the search tools; each file
at the commit given):
- `tensorrt_llm/_torch/expert_statistic.py` (c85e872): with `EXPERT_STATISTIC_ITER_RANGE=start-stop`
  set, every rank counts, for each iteration in the range and each MoE layer, `torch.bincount` of the
  expert ids its MoE layer routed (`token_selected_experts [tokens, top_k]`, the rank's own tokens)
  under the key `"{iteration}_{layer}"`, and when the stop iteration comes writes them to
  `rank{r}.safetensors` in `EXPERT_STATISTIC_PATH`; rank 0 writes `meta_info.json` with
  `num_experts` and `num_experts_per_token`. Later versions of that file also keep the raw ids of each
  key as `rank{r}_raw.safetensors` (int32 `[tokens, top_k]`), and a co-occurrence variant writes them
  as `token_selected_experts_rank{r}.safetensors` beside `cooccurrence_rank{r}.safetensors`.
- `tensorrt_llm/_torch/modules/fused_moe/fused_moe_wide_ep.py` (99bca89): the layer's `layer_idx`
  names the key, and the ids counted are slot ids when a load balancer is on (`num_experts` is then
  `num_slots`): record without `moe_config.load_balancer` to get logical experts.
- `tensorrt_llm/_torch/models/modeling_deepseekv3.py` (a43cf9e): `layer_idx` is the decoder-layer
  index; DeepSeek-V3's MoE layers are 3-60 (layers below `first_k_dense_replace` = 3 are dense and
  record nothing) and an MTP layer is `num_hidden_layers + i` (61).
- `examples/wide_ep/ep_load_balancer/utils.py` (b35ac1b; the raw reader 7ce477f): the tools sum each
  key over the `rank*.safetensors` files (the `_raw` ones excluded), require the iterations to be
  contiguous and every (iteration, layer) pair present, and take the EP size as the number of files.

How it is read here (`read_statistics`):
- steps are the iterations in order, named `iter<N>`, each the sum over ranks (as TensorRT-LLM's
  tools sum them); `--steps` takes positions (0 = the first iteration) or names (`iter100`);
- layer ids are TensorRT-LLM's layer indices as recorded (DeepSeek-V3: 3-60), so a plan made on the
  folder exports under the keys TensorRT-LLM looks up (`moe_place.engines.trtllm`);
- when every rank has raw ids (`rank{r}_raw.safetensors`, or the co-occurrence variant's
  `token_selected_experts_rank{r}.safetensors`), the trace is token level: each iteration's tokens are
  the ranks' tokens in rank order, so co-activation (pair lift) is measured. The raw ids must count
  to the rank's bincount of the same key, and every layer of an iteration must hold the same tokens
  of a rank (a chunked MoE keeps only its last chunk in the raw file; an MTP layer sees other
  tokens): otherwise the error says so, and moving the raw files away reads the counts alone;
- `meta_info.json`'s `num_experts_per_token` is the top-k; other keys of it (`ep_size`,
  `experts_per_rank`) are allowed and not used; `rank{r}_numtokens.json` and the co-occurrence
  matrices are not read.
Every problem is one `InputError` naming the file and key: no `meta_info.json`, a rank file missing
(`rank0`, `rank2`: no `rank1`), a key that is not `"{iteration}_{layer}"`, a rank without a key the
others have, iterations with a gap, a count array whose shape disagrees with `num_experts`.

`write_statistics` writes a trace in the same layout (`meta_info.json`, `rank{r}.safetensors` of int64
bincounts, `rank{r}_raw.safetensors` of int32 ids), each step an iteration and its tokens split into
contiguous blocks over the ranks (as attention data parallelism gives each rank its own requests):
for trying the path without a TensorRT-LLM server, and for TensorRT-LLM's own scripts on our traces.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from moe_place.errors import InputError
from moe_place.io import read_input_text, write_atomic
from moe_place.traces.model import Trace, TraceMeta, count_dispatches
from moe_place.traces.safetensors_file import read_header, read_safetensors, read_tensor, write_safetensors

__all__ = ["read_statistics", "write_statistics"]

META_FILE = "meta_info.json"
# the files of one rank r: name = prefix + r + suffix
COUNT_FILE = ("rank", ".safetensors")
RAW_FILES = (("rank", "_raw.safetensors"),                     # expert_statistic.py, later versions
             ("token_selected_experts_rank", ".safetensors"))  # its co-occurrence variant
KEY = re.compile(r"^(\d+)_(\d+)$")
MOVE_RAW = "move the raw files away to read the counts alone"


def read_statistics(folder: str | Path, top_k: int | None = None) -> Trace:
    """The trace of a TensorRT-LLM expert-statistics folder (module docstring)."""
    folder = Path(folder)
    num_experts, k = _read_meta(folder, top_k)
    count_files = _rank_files(folder, COUNT_FILE, required=True)
    keys, counts = {}, []
    for rank, path in enumerate(count_files):
        arrays = read_safetensors(path)
        keys[rank] = {name: _parse_key(path, name) for name in arrays}
        counts.append({name: _check_count(path, name, arr, num_experts) for name, arr in arrays.items()})
    iterations, layers = _check_grid(folder, count_files, keys)
    grid = np.zeros((len(iterations), len(layers), num_experts), dtype=np.int64)
    for by_key in counts:
        for name, arr in by_key.items():
            iteration, layer = KEY.match(name).groups()
            grid[iterations.index(int(iteration)), layers.index(int(layer))] += arr
    names = tuple(f"iter{i}" for i in iterations)
    meta = TraceMeta(num_experts=num_experts, top_k=k, layer_ids=tuple(layers), source=f"trtllm-stats:{folder.name}",
                     dtype="int64", step_names=names)
    raw_files = _raw_files(folder, len(count_files))
    if raw_files is None:
        return Trace(meta, counts=grid)
    steps = _raw_steps(raw_files, counts, iterations, layers, num_experts, k)
    return Trace(TraceMeta(**{**meta.__dict__, "dtype": "int32"}), topk_ids=steps)


def _read_meta(folder: Path, top_k: int | None) -> tuple[int, int]:
    path = folder / META_FILE
    if not folder.is_dir():
        raise InputError(str(folder), "a TensorRT-LLM expert-statistics folder", "not a folder")
    if not path.is_file() and not any(p.name.startswith("rank") for p in folder.iterdir()):
        raise InputError(str(folder), "a trace file, or a folder of TensorRT-LLM expert statistics (meta_info.json, "
                         "rank{r}.safetensors)", "a directory without them")
    if not path.is_file():
        raise InputError(str(path), "TensorRT-LLM's meta_info.json (num_experts, num_experts_per_token) beside "
                         "the rank{r}.safetensors files", "no such file")
    try:
        meta = json.loads(read_input_text(path, "a JSON file"))
    except json.JSONDecodeError as exc:
        raise InputError(str(path), "JSON", f"{exc.msg} at line {exc.lineno}") from None
    if not isinstance(meta, dict):
        raise InputError(str(path), "a JSON object", type(meta).__name__)
    values = {}
    for key in ("num_experts", "num_experts_per_token"):
        value = meta.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InputError(f"{path}: {key}", "an integer >= 1", "missing" if value is None else value)
        values[key] = value
    num_experts, k = values["num_experts"], values["num_experts_per_token"]
    if k > num_experts:
        raise InputError(f"{path}: num_experts_per_token", f"at most num_experts={num_experts}", k)
    if top_k is not None and top_k != k:
        raise InputError("--top-k", f"{k} (num_experts_per_token in {path}) or nothing", top_k)
    return num_experts, k


def _rank_files(folder: Path, kind: tuple[str, str], required: bool) -> list[Path]:
    """The files of one kind (`prefix`, `suffix`) of ranks 0..R-1, in rank order; InputError naming the
    first one missing."""
    prefix, suffix = kind
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+){re.escape(suffix)}$")
    found = {int(match.group(1)): path for path in folder.iterdir()
             if (match := pattern.match(path.name)) and path.is_file()}
    if not found:
        if required:
            raise InputError(str(folder / f"{prefix}0{suffix}"), f"one {prefix}{{r}}{suffix} per rank (TensorRT-LLM's "
                             "expert statistics)", "no such file")
        return []
    for rank in range(max(found) + 1):
        if rank not in found:
            raise InputError(str(folder / f"{prefix}{rank}{suffix}"), f"one file per rank 0-{max(found)}",
                             "no such file")
    return [found[rank] for rank in range(len(found))]


def _raw_files(folder: Path, num_ranks: int) -> list[Path] | None:
    """The raw-id files of every rank (either kind), or None when the folder has none."""
    for prefix, suffix in RAW_FILES:
        files = _rank_files(folder, (prefix, suffix), required=False)
        if files:
            if len(files) < num_ranks:
                raise InputError(str(folder / f"{prefix}{len(files)}{suffix}"),
                                 f"raw ids of every one of the {num_ranks} ranks, or of none", "no such file")
            if len(files) > num_ranks:
                raise InputError(str(folder / f"rank{num_ranks}.safetensors"),
                                 f"a bincount file of every one of the {len(files)} ranks with raw ids", "no such file")
            return files
    return None


def _parse_key(path: Path, name: str) -> tuple[int, int]:
    match = KEY.match(name)
    if match is None:
        raise InputError(f"{path}: {name}", "keys '{iteration}_{layer}'", name)
    return int(match.group(1)), int(match.group(2))


def _check_count(path: Path, name: str, arr: np.ndarray, num_experts: int) -> np.ndarray:
    if arr.ndim != 1 or arr.dtype.kind not in "iu" or arr.shape[0] != num_experts:
        raise InputError(f"{path}: {name}", f"a 1-D int array of num_experts={num_experts} counts (meta_info.json)",
                         f"{arr.dtype} shape {arr.shape}")
    if arr.size and arr.min() < 0:
        raise InputError(f"{path}: {name}", "counts >= 0", int(arr.min()))
    return arr.astype(np.int64)


def _check_grid(folder: Path, files: list[Path], keys: dict[int, dict[str, tuple[int, int]]]
                ) -> tuple[list[int], list[int]]:
    """(iterations, layers), sorted; InputError for a rank without a key another rank has, a gap in the
    iterations, or an (iteration, layer) pair no rank holds."""
    every = {name: pair for by_rank in keys.values() for name, pair in by_rank.items()}
    if not every:
        raise InputError(str(files[0]), "at least one key '{iteration}_{layer}'", "an empty file")
    for rank, path in enumerate(files):
        missing = sorted(set(every) - set(keys[rank]), key=lambda name: every[name])
        if missing:
            raise InputError(f"{path}: {missing[0]}", "every key the other ranks' files hold (one bincount per "
                             "iteration and MoE layer)", "missing")
    iterations = sorted({i for i, _ in every.values()})
    layers = sorted({layer for _, layer in every.values()})
    gaps = sorted(set(range(iterations[0], iterations[-1] + 1)) - set(iterations))
    if gaps:
        raise InputError(f"{folder / 'rank*.safetensors'}: {gaps[0]}_{layers[0]}",
                         f"contiguous iterations {iterations[0]}-{iterations[-1]}",
                         f"no iteration {gaps[0]} in any rank file")
    have = set(every.values())
    for i in iterations:
        for layer in layers:
            if (i, layer) not in have:
                raise InputError(f"{files[0]}: {i}_{layer}", f"a bincount of every MoE layer ({len(layers)}) in "
                                 f"every iteration", "missing")
    return iterations, layers


def _raw_steps(files: list[Path], counts: list[dict[str, np.ndarray]], iterations: list[int], layers: list[int],
               num_experts: int, k: int) -> tuple[np.ndarray, ...]:
    """int32 `[tokens, layers, k]` per iteration: the ranks' raw ids, checked against their bincounts."""
    headers = [read_header(path) for path in files]
    steps = []
    for i in iterations:
        parts = []
        for rank, path in enumerate(files):
            ids = [_raw_ids(path, headers[rank], f"{i}_{layer}", counts[rank], num_experts, k) for layer in layers]
            tokens = {part.shape[0] for part in ids}
            if len(tokens) > 1:
                raise InputError(f"{path}: {i}_{layers[0]}", f"the same tokens in every layer of an iteration "
                                 f"({MOVE_RAW})", f"{min(tokens)} to {max(tokens)} tokens by layer")
            parts.append(np.stack(ids, axis=1) if ids else np.zeros((0, 0, k), dtype=np.int32))
        steps.append(np.concatenate(parts, axis=0))
    return tuple(steps)


def _raw_ids(path: Path, header: dict, key: str, counts: dict[str, np.ndarray], num_experts: int, k: int) -> np.ndarray:
    where = f"{path}: {key}"
    if key not in header:
        raise InputError(where, f"the raw ids of every key of the bincount file ({MOVE_RAW})", "missing")
    ids = read_tensor(path, header[key])
    if ids.ndim != 2 or ids.dtype.kind not in "iu" or ids.shape[1] != k:
        raise InputError(where, f"an int array [tokens, num_experts_per_token={k}]", f"{ids.dtype} shape {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= num_experts):
        raise InputError(where, f"expert ids in [0, {num_experts})", int(ids.min()) if ids.min() < 0 else int(ids.max()))
    if not np.array_equal(np.bincount(ids.ravel(), minlength=num_experts), counts[key]):
        raise InputError(where, f"ids that count to the rank's bincount of {key} ({MOVE_RAW})",
                         f"{ids.size} ids against {int(counts[key].sum())} counted")
    return ids.astype(np.int32)


def write_statistics(trace: Trace, folder: str | Path, *, ranks: int = 1, first_iteration: int = 0,
                     raw: bool = True) -> list[Path]:
    """Write `trace` as TensorRT-LLM's statistics folder (module docstring); returns the files written.

    ranks: how many ranks the tokens of each step are split over (contiguous blocks); a count-level
        trace has no tokens to split: ranks 1, no raw files.
    first_iteration: the iteration number of the first step (TensorRT-LLM counts from the server's start).
    raw: also write `rank{r}_raw.safetensors` (token-level traces only).
    The folder must hold no statistics already (a stale rank file would be summed with the new ones).
    """
    folder = Path(folder)
    if ranks < 1:
        raise InputError("ranks", "an integer >= 1", ranks)
    if first_iteration < 0:
        raise InputError("first_iteration", "an integer >= 0", first_iteration)
    if not trace.is_token_level and (ranks > 1 or raw):
        raise InputError("trace", "a token-level trace for ranks > 1 or raw ids (a count-level trace cannot be split "
                         "by token)", "a count-level trace")
    if folder.exists():
        stale = sorted(p.name for p in folder.iterdir() if p.name == META_FILE or p.name.startswith("rank"))
        if stale:
            raise InputError(str(folder / stale[0]), "a folder without TensorRT-LLM statistics (they would be summed "
                             "with the new ones)", "already there")
    written = [folder / META_FILE]
    write_atomic(written[0], json.dumps({"num_experts": trace.num_experts, "num_experts_per_token": trace.top_k}))
    step_counts = trace.step_counts()
    for rank in range(ranks):
        bincounts, raw_ids = {}, {}
        for step in range(trace.num_steps):
            iteration = first_iteration + step
            if trace.is_token_level:
                ids = np.array_split(trace.topk_ids[step], ranks, axis=0)[rank]
                layer_counts = count_dispatches(ids, trace.num_experts)
            else:
                ids, layer_counts = None, step_counts[step]
            for pos, layer in enumerate(trace.meta.layer_ids):
                key = f"{iteration}_{layer}"
                bincounts[key] = layer_counts[pos].astype(np.int64)
                if raw:
                    raw_ids[key] = np.ascontiguousarray(ids[:, pos, :], dtype=np.int32)
        written.append(folder / f"rank{rank}.safetensors")
        write_safetensors(written[-1], bincounts)
        if raw:
            written.append(folder / f"rank{rank}_raw.safetensors")
            write_safetensors(written[-1], raw_ids)
    return written
