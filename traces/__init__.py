"""Routing traces: load, stream and synthesize (imported as `moe_place.traces`).

- `model`: the in-memory `Trace` (token level `[tokens, layers, k]` per step, or count level
  `[steps, layers, experts]`) and its validation;
- `load.load_trace`: one entry point for every supported file; `npz`: our versioned format
  (`save_npz`); `sglang`, `vllm`, `text`: engine dumps and plain CSV/JSON counts;
- `count`, `stream`: validated count extraction, chunked with bounded memory;
- `synthetic`: seeded generators, including the DeepSeek-R1-calibrated preset;
- `bundled`: the real traces shipped in `traces/data/` (see its PROVENANCE.md).
"""

from moe_place.traces.model import Trace, TraceMeta, check_counts, check_topk_ids, count_dispatches
from moe_place.traces.load import load_trace
from moe_place.traces.npz import save_npz

__all__ = ["Trace", "TraceMeta", "check_counts", "check_topk_ids", "count_dispatches", "load_trace", "save_npz"]
