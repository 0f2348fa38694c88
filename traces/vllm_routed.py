"""vLLM's routed experts (`--enable-return-routed-experts`), saved one response per line -> a trace.

What vLLM returns, from its sources and docs (read with the search tools):
- `vllm/outputs.py` (the version docs.vllm.ai/en/latest/api/vllm/outputs/ showed on 2026-05-07):
  `RequestOutput.prompt_routed_experts` (np.ndarray `[prompt_len, layers, top_k]`, shared by the
  request's completions) and `CompletionOutput.routed_experts` (`[gen_len, layers, top_k]`), the
  expert ids each MoE layer's router chose for every token; the engine splits one per-request array
  into the two (`split_routed_experts` in `vllm/model_executor/layers/fused_moe/routed_experts_capturer.py`).
- The OpenAI-compatible server (docs.vllm.ai/en/v0.21.0/training/routed_experts_replay/) puts them in
  the response as nested lists of int16 ids: `prompt_routed_experts` at the response level and
  `routed_experts` in each of `choices`.
- vLLM main at 002032ee2b18e1f7bd924ec47b62504ba3866063 (`vllm/entrypoints/openai/completion/protocol.py`,
  `CompletionResponseChoice`; `chat_completion/protocol.py`, `ChatCompletionResponseChoice`) returns
  instead, per choice, `routed_experts` as a base64 string of `.npy` bytes (uint8/uint16/int32) of
  shape `[prompt_len + gen_len - 1, layers, top_k]` (the last sampled token was never forwarded), with
  no `prompt_routed_experts`; the request field `routed_experts_prompt_start` drops leading prompt rows.
- An early capturer (`routed_experts_capturer.py` at 42fa4c096d406754b7e5c6d93835fe390487c8af) sized
  the layer axis by `num_hidden_layers`, so dense layers come back as rows of zeros.

The file read here (JSON Lines, one request per line, requests in arrival order):
- (a) each line one completion response as the server returned it (`/v1/completions` or
  `/v1/chat/completions`, not streamed): `prompt_routed_experts` (nested lists, or absent/null) and
  `choices[i].routed_experts` (nested lists or base64 `.npy`, or null);
- (b) offline `LLM.generate` outputs written one `RequestOutput` per line with the same field names:
  `{"prompt_routed_experts": out.prompt_routed_experts.tolist(), "outputs": [{"routed_experts":
  o.routed_experts.tolist()} for o in out.outputs]}` (docs/traces.md shows the loop). Pickles and
  `torch.save` files of `RequestOutput` are not read: loading one runs code from the file.
A request's tokens are its prompt rows, then each completion's rows in choice order. A layer whose
ids are 0 for every token of every request is a dense layer (a real top-k never names expert 0
twice) and is dropped; `layer_ids` keep the position of each kept layer on vLLM's layer axis.
The number of experts is not in the file: it is the largest id + 1.

Steps: consecutive requests in arrival order are grouped into one step until it holds at least
`STEP_TOKENS` tokens (a request is never split; the last step may hold fewer), named `r<first>-<last>`
(request numbers from 0). A step is NOT one of the engine's batches: vLLM batches tokens of many
requests (chunked prefill, decode steps interleaved) and the response does not say which. What a
step can say: the load of a stretch of traffic of about one batch's size, in arrival order (so
windows and drift over the recording are meaningful). What it cannot say: the per-batch imbalance
the engine saw; and since one step holds whole requests, the tokens of one prompt (which route
alike) are more concentrated in a step than in a real batch, so per-step active experts read low.

Memory: a line at a time. A file up to `max_token_bytes` (load_trace's default, 256 MiB; JSON text
takes at least 2 bytes per id, so the ids kept take no more than the file) becomes a token-level
trace; a larger one is counted step by step into a count-level trace, and the ids of the bounded
token sample (`moe_place.traces.sample`, the same tokens as if read whole) are read back afterwards
from the lines that hold them (with long requests most lines hold one, so a large file is parsed
about twice).

Speed: the id lists, nearly all of a line's bytes, are read by `jsonl.parse_with_id_lists` (bracket
skeleton checked, numbers read with numpy; see `moe_place.traces.jsonl`), and any line it cannot
prove it read as `json` would goes through `json` (`parse_request`), so the trace and every error
are those of the `json` reading. Measured on a 300 MiB file of 135 server responses (1800 tokens x
48 layers x top-8 each, one dense layer; written as the tests write them), this project's loaded
2-core machine, before/after in one session, two runs each: read whole 17-19 -> 73-79 MiB/s;
counted with the sample read back 10 -> 51-54 MiB/s. The sample is still read back in a second
pass: which tokens it holds depends on the file's token count (`sample_positions`), known only at
the end, and keeping the same tokens as a file read whole (the tests compare them row for row)
rules out a one-pass reservoir; at the new speed the second pass adds about half the first's time.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moe_place.errors import InputError
from moe_place.progress import ProgressBar
from moe_place.traces.jsonl import (IdLists, add_counts, first_repeat, id_array, parse_object, parse_with_id_lists,
                                    read_line_at, read_lines, stack_counts)
from moe_place.traces.model import Trace, TraceMeta
from moe_place.traces.sample import TokenSample, sample_positions

__all__ = ["is_vllm_routed", "parse_request", "read_routed_experts", "request_ids"]

STEP_TOKENS = 8192  # tokens per step: about one engine batch (vLLM's max_num_batched_tokens is of this order)
LIST_KEYS = ("choices", "outputs")  # the server's response, a RequestOutput written as JSON
HEAD_MARKERS = (b'"prompt_routed_experts"', b'"routed_experts"', b'"choices"')
ID_FIELDS = (b"prompt_routed_experts", b"routed_experts")  # the fields `parse_with_id_lists` reads fast


def is_vllm_routed(head: bytes) -> bool:
    """Whether the first bytes of a text file look like a vLLM response (or RequestOutput) per line."""
    return head.lstrip().startswith(b"{") and any(marker in head for marker in HEAD_MARKERS)


def read_routed_experts(path: str | Path, *, step_tokens: int = STEP_TOKENS, max_token_bytes: int | None = None,
                        progress: bool = False) -> Trace:
    """Read a JSON Lines file of vLLM responses with routed experts (see the module doc).

    step_tokens: tokens per step (whole requests; 1 gives one step per request).
    max_token_bytes: files larger than this are counted into a count-level trace (None: never).
    progress: a bar on stderr (when it is a terminal) over the bytes read, and one over the lines
        whose sampled tokens are read back (a file over `max_token_bytes`).
    """
    path = Path(path)
    if step_tokens < 1:
        raise InputError("step_tokens", "an integer >= 1", step_tokens)
    keep = max_token_bytes is None or path.stat().st_size <= max_token_bytes
    reader = _Reader(path, step_tokens, keep, progress)
    for _, number, offset, line in read_lines([path], f"read {path.name}", progress):
        reader.add(number, offset, line)
    return reader.trace()


def parse_request(line: bytes, where: str) -> tuple[dict, np.ndarray | None]:
    """One line -> (its response object, `request_ids` of it): the id lists read by numpy when
    `parse_with_id_lists` proves it read them right, else (and to word any error) by `json`."""
    fast = parse_with_id_lists(line, ID_FIELDS)
    if fast is not None:
        obj, lists = fast
        try:
            ids = request_ids(obj, where, lists)
        except InputError:
            pass  # json's reading below raises it, worded as always
        else:
            if lists.all_taken:
                return obj, ids
    obj = parse_object(line, where)
    return obj, request_ids(obj, where)


def request_ids(obj: dict, where: str, lists: IdLists | None = None) -> np.ndarray | None:
    """int `[tokens, layers, k]`: one response's prompt rows then each completion's rows (None: no row);
    int64, or uint16 when every part was read by `parse_with_id_lists` (`lists`: the arrays standing
    behind the placeholders in `obj`)."""
    parts = []
    if obj.get("prompt_routed_experts") is not None:
        parts.append(id_array(obj["prompt_routed_experts"], f"{where}: prompt_routed_experts", 3,
                              "[prompt_len, layers, top_k]", lists))
    key = next((k for k in LIST_KEYS if k in obj), None)
    if key is None and not parts:
        raise InputError(where, "a vLLM response with prompt_routed_experts or choices[].routed_experts",
                         f"keys {sorted(obj)[:8]}")
    completions = obj.get(key) if key is not None else None
    if key is not None and completions is not None and not isinstance(completions, list):
        raise InputError(f"{where}: {key}", "a list", type(completions).__name__)
    for i, completion in enumerate(completions or []):
        if not isinstance(completion, dict):
            raise InputError(f"{where}: {key}[{i}]", "an object", type(completion).__name__)
        if completion.get("routed_experts") is not None:
            parts.append(id_array(completion["routed_experts"], f"{where}: {key}[{i}].routed_experts", 3,
                                  "[gen_len, layers, top_k]", lists))
    parts = [part for part in parts if part.shape[0]]
    if not parts:
        return None
    first = parts[0].shape[1:]
    for part in parts[1:]:
        if part.shape[1:] != first:
            raise InputError(where, f"[tokens, layers, top_k] arrays of one shape {list(first)} after the token axis",
                             f"{list(part.shape[1:])}")
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


class _Reader:
    """The state of one pass over the file: per-step counts (and ids when kept), per-request offsets."""

    def __init__(self, path: Path, step_tokens: int, keep: bool, progress: bool = False):
        self.path, self.step_tokens, self.keep, self.progress = path, step_tokens, keep, progress
        self.shape: tuple[int, int] | None = None  # (layers, k), and the line that set it
        self.shape_line = 0
        self.model = "unknown"
        self.steps: list[np.ndarray] = []  # counts [layers, width] of each closed step
        self.step_ids: list[list[np.ndarray]] = []
        self.names: list[str] = []
        self.current: np.ndarray | None = None
        self.current_ids: list[np.ndarray] = []
        self.current_tokens = 0
        self.first_request = 0
        self.offsets: list[int] = []  # of each request's line
        self.tokens: list[int] = []  # of each request
        self.zero_line: np.ndarray | None = None  # first line where a layer was all 0, per layer (0: none)
        self.routed_line: np.ndarray | None = None  # first line where a layer was routed, per layer

    def add(self, number: int, offset: int, line: bytes) -> None:
        where = f"{self.path}: line {number}"
        obj, ids = parse_request(line, where)
        if ids is None:
            raise InputError(where, "routed experts (prompt_routed_experts or choices[].routed_experts; start vLLM "
                             "with --enable-return-routed-experts)", "none in this response")
        if self.shape is None:
            self.shape, self.shape_line = ids.shape[1:], number
            self.zero_line = np.zeros(ids.shape[1], dtype=np.int64)
            self.routed_line = np.zeros(ids.shape[1], dtype=np.int64)
            if isinstance(obj.get("model"), str):
                self.model = obj["model"]
        elif ids.shape[1:] != self.shape:
            layers, k = self.shape
            field = "top_k" if ids.shape[2] != k else "layers"
            raise InputError(f"{where}: {field}", f"[tokens, {layers} layers, top_k = {k}] as in line {self.shape_line}",
                             f"[{ids.shape[0]}, {ids.shape[1]} layers, top_k = {ids.shape[2]}]")
        self._check(ids, number, where)
        self.offsets.append(offset)
        self.tokens.append(ids.shape[0])
        self.current = add_counts(self.current, ids)
        if self.keep:
            self.current_ids.append(ids.astype(np.int16 if int(ids.max()) < 1 << 15 else np.int32))
        self.current_tokens += ids.shape[0]
        if self.current_tokens >= self.step_tokens:
            self._close_step()

    def _check(self, ids: np.ndarray, number: int, where: str) -> None:
        """Dense layers (all 0) must be dense in every request; other layers need k distinct experts."""
        zero = (ids == 0).all(axis=(0, 2)) if ids.shape[2] > 1 else np.zeros(ids.shape[1], dtype=bool)
        for layer in np.flatnonzero(zero & (self.routed_line > 0))[:1]:
            raise InputError(f"{where}: layer {layer}", f"routed ids (as in line {self.routed_line[layer]})",
                             "every id 0 (a dense layer here only)")
        for layer in np.flatnonzero(~zero & (self.zero_line > 0))[:1]:
            raise InputError(f"{where}: layer {layer}", f"every id 0, a dense layer (as in line {self.zero_line[layer]})",
                             "routed ids")
        self.zero_line[zero & (self.zero_line == 0)] = number
        self.routed_line[~zero & (self.routed_line == 0)] = number
        repeat = first_repeat(ids[:, ~zero, :])
        if repeat is not None:
            token, position = repeat
            layer = int(np.flatnonzero(~zero)[position])
            raise InputError(where, f"top_k = {ids.shape[2]} distinct experts per token",
                             f"an expert twice at token {token} of the request, layer {layer}")

    def _close_step(self) -> None:
        if self.current is None:
            return
        last = len(self.tokens) - 1
        self.names.append(f"r{self.first_request}" if last == self.first_request else f"r{self.first_request}-{last}")
        self.steps.append(self.current)
        self.step_ids.append(self.current_ids)
        self.current, self.current_ids, self.current_tokens, self.first_request = None, [], 0, last + 1

    def trace(self) -> Trace:
        self._close_step()
        if self.shape is None:
            raise InputError(str(self.path), "at least one response with routed experts", "no lines")
        moe = self.routed_line > 0
        if not moe.any():
            raise InputError(str(self.path), "at least one MoE layer (ids other than 0)", "every id is 0")
        layers = np.flatnonzero(moe)
        width = max(c.shape[1] for c in self.steps)
        counts = stack_counts(self.steps, width)[:, layers, :]
        num_experts = int(np.flatnonzero(counts.any(axis=(0, 1)))[-1]) + 1
        meta = TraceMeta(num_experts=num_experts, top_k=self.shape[1], layer_ids=tuple(int(x) for x in layers),
                         model=self.model, source=f"vllm-routed:{self.path.name}", dtype="int16",
                         step_names=tuple(self.names))
        if self.keep:
            return Trace(meta, topk_ids=tuple(np.concatenate(ids)[:, layers, :] for ids in self.step_ids))
        return Trace(meta, counts=counts[:, :, :num_experts], sample=self._sample(layers))

    def _sample(self, layers: np.ndarray) -> TokenSample:
        """The sampled tokens' ids, read back from the lines of the requests that hold them."""
        tokens = np.asarray(self.tokens, dtype=np.int64)
        starts = np.cumsum(tokens) - tokens
        positions = sample_positions(int(tokens.sum()))
        request = np.searchsorted(starts, positions, side="right") - 1
        ids = np.empty((positions.size, layers.size, self.shape[1]), dtype=np.int32)
        lines = np.unique(request)
        bar = ProgressBar(len(lines), f"sample {self.path.name}", "lines", enabled=None if self.progress else False)
        try:
            for r in lines:
                rows = np.flatnonzero(request == r)
                where = f"{self.path}: request {r}"
                _, read = parse_request(read_line_at(self.path, self.offsets[r]), where)
                ids[rows] = read[positions[rows] - starts[r]][:, layers, :]
                bar.advance()
        finally:
            bar.close()
        return TokenSample(ids, int(tokens.sum()))
