"""Held-out comparison of GPU-resident expert sets: the offload planner against the engines' rules.

Plan on some steps of a trace, judge on another (leave one step out: each step is judged once),
at the same GPU memory (`capacity` experts). Every step becomes a set of batches, priced batch by
batch with the tiered layer time (`moe_place.solvers.offload.OffloadProblem`, the max of the two
sides per batch and layer):
- decode at each batch size `n`: `batches` batches of `n` distinct tokens drawn from the step's
  recorded tokens (a count-level trace has none: tokens drawn from the step's shares, `k`
  distinct experts each, `moe_place.traces.synthetic.sample_token_ids`), the same draws for
  every set and whether the step plans or judges (seeded by `seed`, the step and the scenario);
- prefill: the step's whole recorded batch, or `prefill_tokens` drawn as decode.
Sets: the plan (`moe_place.solvers.offload.plan_held_out` on the planning steps' batches),
sglang-kt's four rules (`moe_place.solvers.offload_rules`; `frequency` reads the planning steps'
counts, as a stats file recorded on them would give it), llama.cpp's `--n-cpu-moe N` and whole
layers chosen from the trace (`-ot`, `moe_place.solvers.offload_rules`), and a plan made on the judged
step's own batches (`plan_offload`: a reference no deployment has, it knows the future).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_place.cost.models import ExpertShape
from moe_place.cost.offload import OffloadRates
from moe_place.errors import InputError
from moe_place.plotting import new_figure, png_bytes
from moe_place.progress import ProgressBar
from moe_place.solvers.offload import (HeldOutCurves, OffloadPlan, OffloadProblem, count_order, cpu_time_order,
                                       held_out_curves, plan_held_out, plan_offload, whole_layer_plan)
from moe_place.solvers.offload_rules import STRATEGIES, n_cpu_moe_for, n_cpu_moe_mask, strategy_mask
from moe_place.traces.model import Trace
from moe_place.traces.synthetic import inclusion_probabilities, sample_token_ids

__all__ = ["Comparison", "FoldResult", "PlanningData", "Scenarios", "candidate_sets", "compare_held_out",
           "drawn_from", "fold_result", "hindsight_set", "render_comparison_png", "sample_rows", "step_batches",
           "step_problems", "step_tokens"]

PLAN = "moe-place"
HINDSIGHT = "hindsight (plan on the judged step)"
N_CPU_MOE = "llama.cpp --n-cpu-moe"
LAYERS_FROM_TRACE = "llama.cpp -ot (layers from the trace)"
PREFILL = "prefill"
BATCH_CHUNK = 64       # decode batches drawn at once
MAX_BATCHES = 65536    # --batches: the time grows with it


@dataclass(frozen=True)
class Scenarios:
    """Batch sizes to price: decode batch sizes with weight 1 each, and a prefill scenario.

    prefill_tokens: None: the recorded steps' own batches; 0: no prefill."""

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

    def planned(self, step_tokens: int) -> list[tuple[str, int, float]]:
        """`(name, tokens per batch, weight)` of a step of `step_tokens` tokens."""
        out = [(f"decode{n}", int(n), 1.0) for n in self.batch_sizes]
        if self.has_prefill:
            tokens = step_tokens if self.prefill_tokens is None else self.prefill_tokens
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


def sample_rows(ids: np.ndarray, batch_tokens: int, batches: int, num_experts: int,
                rng: np.random.Generator) -> np.ndarray:
    """int32 `[batches, L, E]`: rows per expert of `batches` batches of `batch_tokens` distinct tokens
    drawn from `ids` int `[tokens, L, k]`."""
    tokens, layers, _ = ids.shape
    if batch_tokens > tokens:
        raise InputError("batch size", f"at most the step's {tokens} tokens", batch_tokens)
    picks = np.stack([rng.choice(tokens, batch_tokens, replace=False) for _ in range(batches)])
    return _rows_of(np.asarray(ids[picks], dtype=np.int64), num_experts)


def _rows_of(chosen: np.ndarray, num_experts: int) -> np.ndarray:
    """int32 `[B, L, E]` from the experts picked, int `[B, n, L, k]`."""
    batches, _, layers, _ = chosen.shape
    cell = (np.arange(batches)[:, None, None, None] * layers + np.arange(layers)[None, None, :, None]) * num_experts
    return np.bincount((cell + chosen).reshape(-1), minlength=batches * layers * num_experts).reshape(
        batches, layers, num_experts).astype(np.int32)


def step_batches(trace: Trace, step: int, scenarios: Scenarios, batches: int,
                 seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows int32 `[B, L, E]`, tokens `[B]`, scenario of each batch `[B]`) of one step (module note)."""
    tokens = int(step_tokens(trace)[step])
    counts = trace.step_counts()[step]
    rows, sizes, which = [], [], []
    for i, (name, size, _) in enumerate(scenarios.planned(tokens)):
        if name == PREFILL and scenarios.prefill_tokens is None:
            drawn = counts[None].astype(np.int32)
        else:
            rng = np.random.default_rng([seed, step, i])
            if not trace.is_token_level:
                probs = inclusion_probabilities(counts.astype(np.float64) + 1e-12, trace.top_k)
            chunks = []
            for start in range(0, batches, BATCH_CHUNK):
                n = min(BATCH_CHUNK, batches - start)
                if trace.is_token_level:
                    chunks.append(sample_rows(trace.topk_ids[step], size, n, trace.num_experts, rng))
                else:
                    ids = sample_token_ids(probs, n * size, rng).reshape(n, size, trace.num_layers, trace.top_k)
                    chunks.append(_rows_of(ids.astype(np.int64), trace.num_experts))
            drawn = np.concatenate(chunks)
        rows.append(drawn)
        sizes.append(np.full(len(drawn), size))
        which.append(np.full(len(drawn), i))
    return np.concatenate(rows), np.concatenate(sizes), np.concatenate(which)


def step_problems(trace: Trace, scenarios: Scenarios, model: ExpertShape, rates: OffloadRates, batches: int,
                  seed: int, progress: bool | None = None) -> list[OffloadProblem]:
    """One problem per step of the trace: its batches, priced (the planning and the judged data alike)."""
    if not 1 <= batches <= MAX_BATCHES:
        raise InputError("--batches", f"an integer in [1, {MAX_BATCHES:,}]", batches)
    weights = [(name, weight) for name, _, weight in scenarios.planned(1)]
    out = []
    bar = ProgressBar(trace.num_steps, "offload batches", "steps", enabled=progress)
    for step in range(trace.num_steps):
        rows, tokens, which = step_batches(trace, step, scenarios, batches, seed)
        out.append(OffloadProblem.from_rows(rows, tokens, which, weights, model, rates, tuple(trace.meta.layer_ids)))
        bar.advance()
    bar.close()
    return out


@dataclass(frozen=True)
class PlanningData:
    """What a plan is made from: the steps' problems and counts `[L, E]`, and step 3's curves."""

    steps: tuple[int, ...]
    parts: tuple[OffloadProblem, ...]
    counts: np.ndarray
    curves: HeldOutCurves

    @classmethod
    def of(cls, trace: Trace, problems: list[OffloadProblem], steps) -> "PlanningData":
        steps = tuple(int(s) for s in steps)
        per_step = [trace.step_counts()[s] for s in steps]
        parts = tuple(problems[s] for s in steps)
        return cls(steps, parts, np.sum(per_step, axis=0), held_out_curves(parts, per_step))

    def rule_sets(self, capacity: int) -> dict[str, np.ndarray]:
        """sglang-kt's rules at `capacity` experts on these counts."""
        return {f"sglang-kt {s}": strategy_mask(s, self.counts, capacity) for s in STRATEGIES}

    def plan(self, capacity: int) -> OffloadPlan:
        """The planner's set (`plan_held_out`) under `capacity` experts, the rules its candidates."""
        rules = self.rule_sets(capacity)
        return plan_held_out(self.parts, self.curves, rules["sglang-kt frequency"], rules, capacity)


def candidate_sets(data: PlanningData, capacity: int, layer_ids: tuple[int, ...]) -> dict[str, np.ndarray]:
    """Resident masks `[L, E]` of every compared set at `capacity` experts (hindsight excluded)."""
    experts = data.parts[0].num_experts
    k = min(capacity, data.parts[0].num_layers * experts)
    rules = data.rule_sets(k)
    sets = {PLAN: data.plan(capacity).resident, **rules}
    gpu_layers = k // experts
    sets[N_CPU_MOE] = n_cpu_moe_mask(layer_ids, experts, n_cpu_moe_for(layer_ids, gpu_layers))
    sets[LAYERS_FROM_TRACE] = whole_layer_plan(data.parts, gpu_layers)
    return sets


def hindsight_set(trace: Trace, problems: list[OffloadProblem], step: int, capacity: int) -> np.ndarray:
    """The least time on the judged step's own batches (`plan_offload`, over its count order and
    its CPU-time order): what knowing the future would give."""
    problem = problems[step]
    return plan_offload(problem, capacity, [count_order(trace.step_counts()[step]), cpu_time_order(problem)]).resident


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
    drawn_from: str

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.folds[0].times_s)

    def mean_total_s(self, name: str) -> float:
        return float(np.mean([fold.total_s(name) for fold in self.folds]))

    def mean_times_s(self, name: str) -> np.ndarray:
        return np.mean([fold.times_s[name] for fold in self.folds], axis=0)


def drawn_from(trace: Trace) -> str:
    return "the judged step's tokens" if trace.is_token_level else "the judged step's shares (no tokens recorded)"


def fold_result(trace: Trace, problems: list[OffloadProblem], judged: int, capacity: int, scenarios: Scenarios,
                data: PlanningData | None = None) -> FoldResult:
    """Plan on every step but `judged` (or `data`, made on them), judge every set on `judged`."""
    layer_ids = tuple(trace.meta.layer_ids)
    if data is None:
        data = PlanningData.of(trace, problems, [s for s in range(trace.num_steps) if s != judged])
    sets = candidate_sets(data, capacity, layer_ids)
    sets[HINDSIGHT] = hindsight_set(trace, problems, judged, capacity)
    times = {key: problems[judged].scenario_times_s(mask) for key, mask in sets.items()}
    return FoldResult(data.steps, judged, times, scenarios.weights)


def compare_held_out(trace: Trace, scenarios: Scenarios, model: ExpertShape, rates: OffloadRates, capacity: int,
                     batches: int = 512, seed: int = 0, progress: bool | None = None,
                     problems: list[OffloadProblem] | None = None) -> Comparison:
    """Leave one step out over the trace's steps (needs at least 2). problems: `step_problems` of
    the same arguments, when the caller has them already."""
    if trace.num_steps < 2:
        raise InputError("held-out evaluation", "a trace of at least 2 steps (plan on some, judge on another)",
                         f"{trace.num_steps} step")
    if problems is None:
        problems = step_problems(trace, scenarios, model, rates, batches, seed, progress)
    folds = []
    bar = ProgressBar(trace.num_steps, "offload held-out", "folds", enabled=progress)
    for judged in range(trace.num_steps):
        folds.append(fold_result(trace, problems, judged, capacity, scenarios))
        bar.advance()
    bar.close()
    return Comparison(scenarios.names, capacity, tuple(folds), batches, drawn_from(trace))


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
