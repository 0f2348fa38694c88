"""One entry point that reads any supported trace file: `load_trace(path)`.

Formats, chosen by content first and file name second:
- our `.npz` (`moe_place.traces.npz`): keys `counts` or `topk_ids` (+ metadata);
- the bundled real traces (`moe_place.traces.bundled`), recognised by their bytes under any name;
- a vLLM-style load window (`moe_place.traces.vllm`): `.npz` or `.pt` with `expert_load_window`
  and `physical_to_logical_map`;
- SGLang expert-distribution-recorder dumps (`moe_place.traces.sglang`): `.pt` files;
- plain counts as `.csv` or `.json` (`moe_place.traces.text`);
- vLLM's routed experts (`moe_place.traces.vllm_routed`): JSON Lines, one response (or offline
  `RequestOutput`) per line with `prompt_routed_experts` / `choices[].routed_experts`;
- Megatron-Core's router trace (`moe_place.traces.megatron`): a `router_trace_rank{N}.jsonl` file, or
  the folder holding them;
- a folder: TensorRT-LLM's expert statistics (`moe_place.traces.trtllm`: `meta_info.json` and
  `rank{r}.safetensors`, with the raw ids where recorded).
JSON Lines files are told apart by the field names on their first line (`JSONL_HEAD_BYTES`).
Every problem with the file is one `InputError` naming the file (and field); nothing else escapes.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

from moe_place.errors import InputError
from moe_place.io import input_problem
from moe_place.traces import megatron, npz, sglang, stream, text, trtllm, vllm, vllm_routed
from moe_place.traces.bundled import bundled_info, load_bundled
from moe_place.traces.content import describe, is_text, is_torch_legacy, is_zip, not_a_zip, read_head, zip_problem
from moe_place.traces.count import resolve_workers
from moe_place.traces.model import Trace, located
from moe_place.traces.npz_member import READ_ERRORS, error_reason, token_bytes

__all__ = ["check_not_empty", "detect_folder", "detect_format", "load_trace"]

# Token-level npz traces whose `topk_ids` would take more than this are reduced to counts
# while streaming (bounded memory) instead of being loaded whole: a 1M tokens x 61 layers x
# top-8 int16 dump (976 MB) is streamed. Both give the same analysis (`moe-place analyze`).
DEFAULT_MAX_TOKEN_BYTES = 256 << 20
SUPPORTED = (".npz (moe-place, vLLM window), .pt (SGLang dump, vLLM window), .csv, .json, .jsonl (vLLM routed experts, "
             "Megatron router_trace), or a folder of TensorRT-LLM expert statistics or Megatron router_trace files")
JSONL_HEAD_BYTES = 4096  # a router_trace record's and a vLLM response's telling field names come before this


def load_trace(path: str | Path, *, top_k: int | None = None, keep_dense_layers: bool = False,
               max_token_bytes: int | None = None, progress: bool = False) -> Trace:
    """Read a trace file, choosing the reader by its contents and name.

    top_k: the router's top-k for formats that do not record it (count-only dumps); ignored
        when the file records it (a file that records a different value is not overridden).
    keep_dense_layers: SGLang dumps list every decoder layer; dense layers are all-zero rows and
        are dropped unless this is True (TensorRT-LLM's statistics hold MoE layers only).
    max_token_bytes: token-level npz traces larger than this are streamed into a count-level
        trace (memory bounded by the chunk size, plus a token sample) instead of being loaded
        whole; default `DEFAULT_MAX_TOKEN_BYTES`, read at each call.
    progress: a progress bar on stderr (when it is a terminal) while a large file is streamed.
    """
    resolve_workers()  # a bad $MOE_PLACE_THREADS is named as itself, not as a fault of the file
    if max_token_bytes is None:
        max_token_bytes = DEFAULT_MAX_TOKEN_BYTES
    path = Path(path)
    kind = detect_folder(path) if path.is_dir() else detect_format(path)
    try:
        with located(path):
            trace = _read(path, kind, top_k, keep_dense_layers, max_token_bytes, progress)
    except InputError:
        raise
    except READ_ERRORS as exc:
        raise InputError(str(path), f"a readable {kind} file", error_reason(exc)) from None
    check_not_empty(trace, path)
    return trace


def detect_folder(path: Path) -> str:
    """'megatron' for a folder of `router_trace_rank{N}.jsonl` files, else 'trtllm' (whose reader says
    what a TensorRT-LLM statistics folder lacks)."""
    try:
        return "megatron" if megatron.rank_files(path) else "trtllm"
    except OSError as exc:
        raise InputError(str(path), "a readable folder", error_reason(exc)) from None


def detect_format(path: Path) -> str:
    """'bundled', 'npz', 'torch', 'csv', 'json', 'vllm-routed' or 'megatron'; InputError if the path is
    not a readable file, or if its bytes are not what a trace of its kind holds (the error says what they are)."""
    problem = input_problem(path)
    if problem is not None:
        raise InputError(str(path), "an existing trace file" if problem == "no such file" else "a trace file", problem)
    try:
        head = read_head(path)
        size = path.stat().st_size
    except OSError as exc:
        raise InputError(str(path), "a readable file", error_reason(exc)) from None
    if not head:
        raise InputError(str(path), "a trace file", "an empty file")
    suffix = path.suffix.lower()
    if is_zip(head):
        problem = zip_problem(path)
        if problem is not None:
            raise InputError(str(path), f"a complete zip archive ({_zip_kind(suffix)})", problem)
        if bundled_info(path) is not None:
            return "bundled"
        return "torch" if _is_torch_zip(path) else "npz"
    if suffix in (".pt", ".pth"):
        if is_torch_legacy(head):
            return "torch"  # torch.save's legacy (non-zip) format
        raise InputError(str(path), "a torch.save file (a zip archive, or torch's legacy format)",
                         describe(head, size))
    if suffix == ".jsonl" or head.lstrip().startswith(b"{"):
        kind = _jsonl_kind(path)
        if kind is not None:
            return kind
        if suffix == ".jsonl":
            raise InputError(str(path), "JSON Lines of vLLM responses with routed experts or of Megatron router_trace "
                             "records", describe(head, size) if not is_text(head) else "neither's field names on line 1")
    if suffix in (".csv", ".json") or head.lstrip().startswith((b"{", b"[")):
        if not is_text(head):
            raise InputError(str(path), f"a {suffix[1:] if suffix in ('.csv', '.json') else 'JSON'} text file",
                             describe(head, size))
        return suffix[1:] if suffix in (".csv", ".json") else "json"
    if suffix == ".npz":
        raise InputError(str(path), "an .npz file (a zip archive of .npy arrays)", not_a_zip(path))
    raise InputError(str(path), f"a supported trace format ({SUPPORTED})",
                     f"{describe(head, size)} in a '{suffix or 'no'}' file")


def _jsonl_kind(path: Path) -> str | None:
    """'megatron' or 'vllm-routed' from the field names at the start of a text file, else None."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(JSONL_HEAD_BYTES)
    except OSError as exc:
        raise InputError(str(path), "a readable file", error_reason(exc)) from None
    if megatron.is_router_trace(head):
        return "megatron"
    if vllm_routed.is_vllm_routed(head):
        return "vllm-routed"
    return None


def _zip_kind(suffix: str) -> str:
    return {".pt": "a torch.save file", ".pth": "a torch.save file"}.get(suffix, "an .npz file")


def check_not_empty(trace: Trace, path: Path) -> None:
    """An all-zero trace (no token, no dispatch) is an input error."""
    if trace.is_token_level:
        if trace.num_tokens == 0:
            raise InputError(str(path), "a non-empty trace (at least one token)", "0 tokens")
    elif not trace.counts.any():
        raise InputError(str(path), "a non-empty trace (at least one dispatch)", "all counts are 0")


def _read(path: Path, kind: str, top_k: int | None, keep_dense_layers: bool, max_token_bytes: int,
          progress: bool) -> Trace:
    if kind == "bundled":
        return load_bundled(path, bundled_info(path))
    if kind == "trtllm":
        return trtllm.read_statistics(path, top_k=top_k)
    if kind == "megatron":
        return megatron.read_router_trace(path, max_token_bytes=max_token_bytes, progress=progress)
    if kind == "vllm-routed":
        return vllm_routed.read_routed_experts(path, max_token_bytes=max_token_bytes, progress=progress)
    if kind == "npz":
        if vllm.is_vllm_npz(path):
            return vllm.read_vllm_window(path, top_k=top_k)
        if token_bytes(path) > max_token_bytes:
            return stream.stream_npz_counts(path, progress=progress)
        return npz.read_npz(path, top_k=top_k)
    if kind == "torch":
        return sglang.read_torch_dump(path, top_k=top_k, keep_dense_layers=keep_dense_layers)
    if kind == "csv":
        return text.read_csv(path, top_k=top_k)
    return text.read_json(path, top_k=top_k)


def _is_torch_zip(path: Path) -> bool:
    """torch.save writes a zip whose members live under `<name>/data.pkl`; an npz holds `*.npy`."""
    try:
        with zipfile.ZipFile(path) as zf:
            return any(name.endswith("data.pkl") for name in zf.namelist())
    except READ_ERRORS:  # a damaged archive: the npz reader reports it
        return False

