"""The analyzer's whole answer for one trace, and its JSON form (the `moe-place analyze` contract).

`analyze_trace` runs every per-layer and per-EP-size analysis once; `analysis_to_json` turns the
result into plain JSON types (NaN becomes null). The CLI only formats what is here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from moe_place.analysis.active import ActiveExperts, active_experts
from moe_place.analysis.coactivation import TopPairs, top_pairs
from moe_place.analysis.ep_sweep import EpPoint, default_ep_sizes, ep_sweep
from moe_place.analysis.out_of_sample import OutOfSample, out_of_sample
from moe_place.analysis.persistence import Persistence, persistence
from moe_place.analysis.profile import LoadProfile, load_profile
from moe_place.analysis.windows import window_loads
from moe_place.errors import InputError
from moe_place.traces.count import resolve_workers, run_chunks
from moe_place.traces.model import Trace

__all__ = ["TraceAnalysis", "analysis_to_json", "analyze_trace", "default_top_n", "default_window_steps"]

#: Version of the JSON written by `analysis_to_json`; bump when a key changes meaning.
JSON_VERSION = 1

#: Unless asked otherwise, steps are summed into windows so that there are at most this many
#: (persistence and out-of-sample loss then cost the same on a 3-step and a 3000-step trace).
MAX_DEFAULT_WINDOWS = 16


@dataclass(frozen=True)
class TraceAnalysis:
    """Everything `moe-place analyze` reports for one trace.

    profile: skew of the loads summed over every step.
    persistence: hot experts over windows of `window_steps` steps.
    active: distinct experts per step against E[U].
    ep: the EP sweep of the summed loads (contiguous placement).
    out_of_sample: per EP size, the replicate-hottest plan made on one window judged on the
        next (`None` for every size when the trace has fewer than two windows).
    pairs: per layer, the pair of experts most often picked by the same token and its lift
        (traces with a token sample: token-level, or streamed from a token-level file).
    """

    trace: Trace
    window_steps: int
    profile: LoadProfile
    persistence: Persistence
    active: ActiveExperts
    ep: tuple[EpPoint, ...]
    out_of_sample: tuple[OutOfSample | None, ...]
    pairs: TopPairs | None = None

    def __post_init__(self) -> None:
        if len(self.out_of_sample) != len(self.ep):
            raise InputError("TraceAnalysis.out_of_sample", f"one entry per EP size ({len(self.ep)})")
        if self.profile.num_layers != self.trace.num_layers:
            raise InputError("TraceAnalysis.profile", f"{self.trace.num_layers} layers", self.profile.num_layers)


def default_top_n(trace: Trace) -> int:
    """The hot set size used unless asked otherwise: `top_k` experts (uniform share `k/E`)."""
    return trace.top_k


def default_window_steps(num_steps: int) -> int:
    """Steps per window: 1, or as many as keep the trace to `MAX_DEFAULT_WINDOWS` windows."""
    return max(1, math.ceil(num_steps / MAX_DEFAULT_WINDOWS))


def analyze_trace(trace: Trace, ep_sizes: Sequence[int] | None = None, top_n: int | None = None,
                  window_steps: int | None = None) -> TraceAnalysis:
    """Analyze `trace`. ep_sizes: default `default_ep_sizes(E)`; top_n: default `top_k`;
    window_steps: default `default_window_steps(steps)`."""
    window_steps = default_window_steps(trace.num_steps) if window_steps is None else int(window_steps)
    counts = trace.step_counts()
    total = trace.total_counts()
    sizes = tuple(ep_sizes) if ep_sizes is not None else default_ep_sizes(trace.num_experts)
    top_n = default_top_n(trace) if top_n is None else int(top_n)
    windows = window_loads(counts, window_steps)
    points = ep_sweep(total, sizes)
    shifts = _out_of_sample_by_size(windows, [p.ep_size for p in points])
    sample = trace.token_sample()
    pairs = None if sample is None else top_pairs(sample, total)
    return TraceAnalysis(trace=trace, window_steps=window_steps, profile=load_profile(total, top_n),
                         persistence=persistence(windows, top_n), active=active_experts(counts, trace.top_k),
                         ep=points, out_of_sample=shifts, pairs=pairs)


def _out_of_sample_by_size(windows: np.ndarray, ep_sizes: Sequence[int]) -> tuple[OutOfSample | None, ...]:
    """`out_of_sample(windows, G)` for each EP size G of `ep_sizes` (None with one window or G = 1).

    windows: `[windows, layers, E]` loads. The sizes are planned on `resolve_workers()` threads (the
    counting's, `moe_place.traces.count`), the largest first: a plan takes one pass over
    `[windows * layers, E]` per GPU, and numpy releases the GIL inside each pass. The results do
    not depend on the threads.
    """
    shifts: list[OutOfSample | None] = [None] * len(ep_sizes)
    if windows.shape[0] < 2:
        return tuple(shifts)

    def plan(pos: int) -> None:
        shifts[pos] = out_of_sample(windows, ep_sizes[pos])  # each call its own slot

    todo = sorted((pos for pos, size in enumerate(ep_sizes) if size > 1), key=lambda pos: -ep_sizes[pos])
    run_chunks(todo, resolve_workers(), plan)
    return tuple(shifts)


# ---------------------------------------------------------------------- JSON
def _top_pair(pairs: TopPairs, pos: int) -> dict | None:
    """Layer `pos`'s most frequent pair of experts, its tokens (rounded when estimated) and lift."""
    a, b = (int(e) for e in pairs.experts[pos])
    if a < 0:
        return None
    return {"experts": [a, b], "tokens": int(round(float(pairs.tokens[pos]))), "lift": _num(pairs.lift[pos]),
            "lift_stderr": _num(pairs.lift_stderr[pos])}


def _pair_sample(pairs: TopPairs | None) -> dict | None:
    if pairs is None or pairs.exact:
        return None
    return {"chosen_on_tokens": pairs.chosen_on, "estimated_on_tokens": pairs.estimated_on}


def _num(x: float) -> float | None:
    """`x` rounded to 6 digits as `_nums` rounds (one rule for every float of the JSON), NaN -> None."""
    x = float(x)
    return None if math.isnan(x) else float(np.round(x, 6))


def _nums(values: np.ndarray) -> list:
    """`_num` of every value of a 1-D array, rounded in one numpy call."""
    rounded = np.round(np.asarray(values, dtype=np.float64).ravel(), 6)
    out = rounded.tolist()
    for i in np.flatnonzero(np.isnan(rounded)).tolist():
        out[i] = None
    return out


def _rows(values: np.ndarray) -> list:
    """`_nums` of each row of a 2-D array, rounded in one numpy call."""
    flat = _nums(values)
    width = values.shape[1]
    return [flat[i:i + width] for i in range(0, len(flat), width)] if width else [[] for _ in range(values.shape[0])]


def analysis_to_json(analysis: TraceAnalysis) -> dict:
    """The JSON contract of `moe-place analyze --format json` (floats rounded to 6 digits, NaN -> null).

    Top level: `format_version`, `model`, `source`, `num_layers`, `num_experts`, `top_k`,
    `tokens` (whole trace), `steps`, `step_names`, `window_steps`, `windows`, `top_n`,
    `pair_sample` (null when `top_pair` counts every token, else {`chosen_on_tokens`,
    `estimated_on_tokens`}: the random sample it was chosen on and estimated on,
    `moe_place.analysis.coactivation`), `layers`, `ep`.

    `layers[i]` (one per analyzed layer, in trace order):
      `layer` the model's layer id; `expert_load` ints, dispatches per expert summed over every
      step; `max_over_mean`, `cv`, `zero_load_experts`, `top_n_share` of those loads;
      `hot_experts` the `top_n` hottest ids, hottest first; `persistence` {`mean_run_windows`,
      `median_run_windows`, `max_run_windows`, `mean_hot_overlap`}; `active_experts` per step
      and `expected_active_experts` per step (E[U] for that step's tokens); `top_pair` (traces
      with tokens: token-level, or streamed from a token-level file; else null) {`experts` [a, b],
      `tokens` picking both (estimated for the whole trace when sampled), `lift` = tokens * C[a,b] /
      (load a * load b), 1 if independent, `lift_stderr` its standard error (0 when exact)}.

    `ep[j]` (one per EP size, ascending; contiguous placement of the summed loads):
      `ep_size`, `placement` ("contiguous"), `experts_per_gpu`; per layer lists
      `gpu_max_over_mean` (busiest/mean GPU rows), `balancedness` (mean/max),
      `sglang_balancedness`, `gpu_rows` (`[layers][ep_size]`); `mean_gpu_max_over_mean`,
      `worst_gpu_max_over_mean`, `worst_layer` (layer id), `vllm_balancedness` (model-wide);
      `out_of_sample` null with one window (or EP 1), else {`planner`, `redundant_per_gpu`,
      `transitions`, and per layer, averaged over transitions w -> w+1 and judged on w+1:
      `contiguous`, `planned_on_previous`, `planned_on_same`, `loss` (previous/same - 1)}.
    """
    trace, prof, pers, act = analysis.trace, analysis.profile, analysis.persistence, analysis.active
    # every per-layer float rounded in one numpy call per field (a call per value was ~10 ms a report)
    max_over_mean, cv, top_share = _nums(prof.max_over_mean), _nums(prof.cv), _nums(prof.top_share)
    mean_run, median_run, max_run = _nums(pers.mean_run), _nums(pers.median_run), _nums(pers.max_run)
    mean_overlap, expected = _nums(pers.mean_overlap), _rows(act.expected.T)
    hot = np.argsort(-prof.expert_load, axis=1, kind="stable")[:, : prof.top_n].tolist()
    loads = prof.expert_load.astype(np.int64).tolist()
    observed = act.observed.T.astype(np.int64).tolist()
    layers = []
    for pos, layer_id in enumerate(trace.meta.layer_ids):
        layers.append({
            "layer": int(layer_id),
            "expert_load": loads[pos],
            "max_over_mean": max_over_mean[pos],
            "cv": cv[pos],
            "zero_load_experts": int(prof.zero_load_experts[pos]),
            "top_n_share": top_share[pos],
            "hot_experts": hot[pos],
            "persistence": {
                "mean_run_windows": mean_run[pos],
                "median_run_windows": median_run[pos],
                "max_run_windows": max_run[pos],
                "mean_hot_overlap": mean_overlap[pos],
            },
            "active_experts": observed[pos],
            "expected_active_experts": expected[pos],
            "top_pair": None if analysis.pairs is None else _top_pair(analysis.pairs, pos),
        })
    ep = []
    for point, shift in zip(analysis.ep, analysis.out_of_sample):
        bal = point.balance
        worst = int(np.argmax(bal.max_over_mean))
        entry = {
            "ep_size": point.ep_size,
            "placement": "contiguous",
            "experts_per_gpu": point.placement.slots_per_gpu,
            "gpu_max_over_mean": _nums(bal.max_over_mean),
            "mean_gpu_max_over_mean": _num(bal.max_over_mean.mean()),
            "worst_gpu_max_over_mean": _num(bal.max_over_mean[worst]),
            "worst_layer": int(trace.meta.layer_ids[worst]),
            "balancedness": _nums(bal.balancedness),
            "sglang_balancedness": _nums(bal.sglang_balancedness),
            "vllm_balancedness": _num(bal.vllm_balancedness),
            "gpu_rows": _rows(bal.gpu_load),
            "out_of_sample": None,
        }
        if shift is not None:
            entry["out_of_sample"] = {
                "planner": shift.planner,
                "redundant_per_gpu": 1,
                "transitions": int(shift.contiguous.shape[0]),
                "contiguous": _nums(shift.contiguous.mean(axis=0)),
                "planned_on_previous": _nums(shift.out_of_sample.mean(axis=0)),
                "planned_on_same": _nums(shift.in_sample.mean(axis=0)),
                "loss": _nums(shift.loss.mean(axis=0)),
            }
        ep.append(entry)
    return {
        "format_version": JSON_VERSION,
        "model": trace.meta.model,
        "source": trace.meta.source,
        "num_layers": trace.num_layers,
        "num_experts": trace.num_experts,
        "top_k": trace.top_k,
        "tokens": trace.num_tokens,
        "steps": trace.num_steps,
        "step_names": list(trace.step_names),
        "window_steps": analysis.window_steps,
        "windows": pers.num_windows,
        "top_n": prof.top_n,
        "pair_sample": _pair_sample(analysis.pairs),
        "layers": layers,
        "ep": ep,
    }
