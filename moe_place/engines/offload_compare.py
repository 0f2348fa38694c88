"""Held-out comparison of GPU-resident expert sets: the offload planner against the engines' rules.

Plan on some steps of a trace, judge on another (leave one step out: each step is judged once),
at the same GPU memory (`capacity` experts), with the tiered layer time of
`moe_place.cost.offload.tiered_times`:
- decode at each batch size `n`: `batches` batches of `n` distinct tokens drawn from the judged
  step's tokens (the same draws for every set), each layer at `max(CPU side, GPU side)` of its
  own rows; a count-level trace has no tokens, so there the expected (fluid) times of the judged
  step's shares are used instead;
- prefill: the judged step's whole batch (its recorded rows), or `prefill_tokens` as decode.
Sets: the plan (`moe_place.solvers.offload`), sglang-kt's four rules (`moe_place.engines.sglang_kt`;
`frequency` reads the planning steps' counts, as a stats file recorded on them would give it),
llama.cpp's `--n-cpu-moe N` and whole layers chosen from the trace (`-ot`,
`moe_place.engines.llama_cpp`), and a hindsight plan made on the judged step itself (a reference
no deployment has: it knows the future).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_place.cost.models import ExpertShape
from moe_place.cost.offload import OffloadRates, expected_costs, expected_tiered_s, tiered_times
from moe_place.engines import llama_cpp, sglang_kt
from moe_place.errors import InputError
from moe_place.plotting import new_figure, png_bytes
from moe_place.progress import ProgressBar
from moe_place.solvers.offload import OffloadProblem, plan_offload, whole_layer_plan
from moe_place.traces.model import Trace

PLAN = "moe-place"
HINDSIGHT = "hindsight (plan on the judged step)"
N_CPU_MOE = "llama.cpp --n-cpu-moe"
LAYERS_FROM_TRACE = "llama.cpp -ot (layers from the trace)"
PREFILL = "prefill"
BATCH_CHUNK = 64       # decode batches drawn and priced at once
MAX_BATCHES = 65536    # --batches: the time grows with it (memory does not: chunks)


@dataclass(frozen=True)
class Scenarios:
    """Batch sizes to price: decode batch sizes with weight 1 each, and a prefill scenario.

    prefill_tokens: None: the recorded steps' own batches (planning: their mean size); 0: no prefill."""

    batch_sizes: tuple[int, ...] = (8, 32)
    prefill_tokens: int | None = None
    prefill_weight: float = 1.0

    def __post_init__(self) -> None:
        if any(int(n) < 1 for n in self.batch_sizes) or len(set(self.batch_sizes)) != len(self.batch_sizes):
            raise InputError("--batch-sizes", "distinct batch sizes >= 1", list(self.batch_sizes))
        if self.prefill_tokens is not None and self.prefill_tokens < 0:
            raise InputError("--prefill-tokens", "tokens >= 0", self.prefill_tokens)
        if not self.prefill_weight >= 0:
            raise InputError("--prefill-weight", "a number >= 0", self.prefill_weight)
        if not self.batch_sizes and (self.prefill_tokens == 0 or self.prefill_weight == 0):
            raise InputError("--batch-sizes", "some batch size, or a prefill scenario", "none")

    @property
    def has_prefill(self) -> bool:
        return self.prefill_tokens != 0 and self.prefill_weight > 0

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f"decode{n}" for n in self.batch_sizes) + ((PREFILL,) if self.has_prefill else ())

    def planned(self, mean_step_tokens: int) -> list[tuple[str, int, float]]:
        """`(name, tokens, weight)` for `OffloadProblem.from_counts`."""
        out = [(f"decode{n}", int(n), 1.0) for n in self.batch_sizes]
        if self.has_prefill:
            tokens = mean_step_tokens if self.prefill_tokens is None else self.prefill_tokens
            out.append((PREFILL, max(1, int(tokens)), float(self.prefill_weight)))
        return out

    @property
    def weights(self) -> np.ndarray:
        return np.array([w for _, _, w in self.planned(1)], dtype=np.float64)


def step_tokens(trace: Trace) -> np.ndarray:
    """int64 `[steps]`: tokens of each step (count level: a layer's dispatches / top-k)."""
    if trace.is_token_level:
        return np.array([ids.shape[0] for ids in trace.topk_ids], dtype=np.int64)
    return trace.step_counts()[:, 0, :].sum(axis=1) // trace.top_k


def planning_problem(trace: Trace, steps, scenarios: Scenarios, model: ExpertShape, rates: OffloadRates,
                     capacity: int) -> tuple[OffloadProblem, np.ndarray]:
    """The offload problem of the given steps, and their counts `[L, E]`."""
    steps = list(steps)
    counts = trace.step_counts()[steps].sum(axis=0)
    tokens = step_tokens(trace)[steps]
    problem = OffloadProblem.from_counts(counts, int(tokens.sum()), scenarios.planned(int(round(tokens.mean()))),
                                         model, rates, capacity, tuple(trace.meta.layer_ids))
    return problem, counts


def candidate_sets(problem: OffloadProblem, counts: np.ndarray, layer_ids: tuple[int, ...],
                   time_limit_s: float) -> dict[str, np.ndarray]:
    """Resident masks `[L, E]` of every compared set at the problem's capacity (hindsight excluded)."""
    k = min(problem.capacity, problem.num_layers * problem.num_experts)
    sets = {PLAN: plan_offload(problem, time_limit_s).resident}
    for strategy in sglang_kt.STRATEGIES:
        sets[f"sglang-kt {strategy}"] = sglang_kt.strategy_mask(strategy, counts, k)
    gpu_layers = k // problem.num_experts
    sets[N_CPU_MOE] = llama_cpp.n_cpu_moe_mask(layer_ids, problem.num_experts,
                                               llama_cpp.n_cpu_moe_for(layer_ids, gpu_layers))
    sets[LAYERS_FROM_TRACE] = whole_layer_plan(problem, gpu_layers)
    return sets


def sample_rows(ids: np.ndarray, batch_tokens: int, batches: int, num_experts: int,
                rng: np.random.Generator) -> np.ndarray:
    """float64 `[batches, L, E]`: rows per expert of `batches` batches of `batch_tokens` distinct tokens
    drawn from `ids` int `[tokens, L, k]`."""
    tokens, layers, _ = ids.shape
    if batch_tokens > tokens:
        raise InputError("batch size", f"at most the judged step's {tokens} tokens", batch_tokens)
    picks = np.stack([rng.choice(tokens, batch_tokens, replace=False) for _ in range(batches)])
    chosen = np.asarray(ids[picks], dtype=np.int64)                            # [B, n, L, k]
    cell = (np.arange(batches)[:, None, None, None] * layers + np.arange(layers)[None, None, :, None]) * num_experts
    return np.bincount((cell + chosen).reshape(-1), minlength=batches * layers * num_experts).reshape(
        batches, layers, num_experts).astype(np.float64)


def judge(trace: Trace, step: int, sets: dict[str, np.ndarray], scenarios: Scenarios, model: ExpertShape,
          rates: OffloadRates, batches: int, seed: int) -> dict[str, np.ndarray]:
    """Per set, float64 `[scenarios]`: mean step time (sum over layers) of each scenario on `step`."""
    out = {name: [] for name in sets}
    tokens = int(step_tokens(trace)[step])
    step_counts = trace.step_counts()[step].astype(np.float64)
    for i, (name, size, _) in enumerate(scenarios.planned(tokens)):
        recorded = name == PREFILL and scenarios.prefill_tokens is None
        if recorded:
            rows, batch = step_counts[None], np.array([tokens])
        elif trace.is_token_level:  # in chunks of batches, so that memory stays bounded
            rng = np.random.default_rng([seed, step, i])
            sums = dict.fromkeys(sets, 0.0)
            for start in range(0, batches, BATCH_CHUNK):
                rows = sample_rows(trace.topk_ids[step], size, min(BATCH_CHUNK, batches - start), trace.num_experts,
                                   rng)
                for key, mask in sets.items():
                    sums[key] += float(tiered_times(rows, mask[None], size, model, rates).layer_s.sum())
            for key in sets:
                out[key].append(sums[key] / batches)
            continue
        else:
            costs = expected_costs(step_counts / tokens, size, model, rates)
            for key, mask in sets.items():
                out[key].append(float(expected_tiered_s(costs, mask).layer_s.sum()))
            continue
        for key, mask in sets.items():
            times = tiered_times(rows, mask[None], batch[:, None], model, rates).layer_s  # [B, L]
            out[key].append(float(times.sum(axis=1).mean()))
    return {key: np.array(values) for key, values in out.items()}


@dataclass(frozen=True)
class FoldResult:
    """One held-out fold: planned on `plan_steps`, judged on `judged_step`; times per set `[scenarios]`."""

    plan_steps: tuple[int, ...]
    judged_step: int
    times_s: dict
    weights: np.ndarray

    def total_s(self, name: str) -> float:
        return float(self.weights @ self.times_s[name])


@dataclass(frozen=True)
class Comparison:
    scenario_names: tuple[str, ...]
    capacity: int
    folds: tuple[FoldResult, ...]
    batches: int
    fluid: bool

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.folds[0].times_s)

    def mean_total_s(self, name: str) -> float:
        return float(np.mean([fold.total_s(name) for fold in self.folds]))

    def mean_times_s(self, name: str) -> np.ndarray:
        return np.mean([fold.times_s[name] for fold in self.folds], axis=0)


def compare_held_out(trace: Trace, scenarios: Scenarios, model: ExpertShape, rates: OffloadRates, capacity: int,
                     batches: int = 512, seed: int = 0, time_limit_s: float = 10.0,
                     progress: bool | None = None) -> Comparison:
    """Leave one step out over the trace's steps (needs at least 2)."""
    if trace.num_steps < 2:
        raise InputError("held-out evaluation", "a trace of at least 2 steps (plan on some, judge on another)",
                         f"{trace.num_steps} step")
    if not 1 <= batches <= MAX_BATCHES:
        raise InputError("--batches", f"an integer in [1, {MAX_BATCHES:,}]", batches)
    layer_ids = tuple(trace.meta.layer_ids)
    folds = []
    bar = ProgressBar(trace.num_steps, "offload held-out", "folds", enabled=progress)
    for judged in range(trace.num_steps):
        plan_steps = tuple(s for s in range(trace.num_steps) if s != judged)
        problem, counts = planning_problem(trace, plan_steps, scenarios, model, rates, capacity)
        sets = candidate_sets(problem, counts, layer_ids, time_limit_s)
        hindsight, _ = planning_problem(trace, (judged,), scenarios, model, rates, capacity)
        sets[HINDSIGHT] = plan_offload(hindsight, time_limit_s).resident
        folds.append(FoldResult(plan_steps, judged, judge(trace, judged, sets, scenarios, model, rates, batches, seed),
                                scenarios.weights))
        bar.advance()
    bar.close()
    return Comparison(scenarios.names, capacity, tuple(folds), batches, not trace.is_token_level)


def render_comparison_png(comparison: Comparison, dpi: int = 110) -> bytes:
    """Held-out weighted step time per set: a bar per set (the folds' mean) and a dot per fold."""
    names = comparison.names
    fig = new_figure((8.5, 0.42 * len(names) + 1.6), layout="constrained")
    ax = fig.subplots()
    rows = np.arange(len(names))[::-1]
    ax.barh(rows, [comparison.mean_total_s(n) * 1e3 for n in names], color="#9ab", label="mean of the folds")
    for fold in comparison.folds:
        ax.plot([fold.total_s(n) * 1e3 for n in names], rows, "o", ms=4, label=f"judged step {fold.judged_step}")
    ax.set_yticks(rows, names)
    ax.set_xlabel("predicted weighted step time (ms): " + " + ".join(comparison.scenario_names))
    ax.set_title(f"held out, {comparison.capacity} experts on the GPU")
    ax.legend(loc="lower right", fontsize=8)
    return png_bytes(fig, dpi)
