"""Online GPU-resident experts for offloaded serving: swap experts over PCIe only when it pays back.

A serving run is a sequence of steps (decode batches, with a prefill batch now and then) whose
routing drifts. Every layer keeps `k[l]` experts resident on the GPU (the offline plan's counts,
made on a warm-up window) and runs the rest on the CPU; a step costs the tiered layer time
(`moe_place.cost.offload.tiered_times`), and a batch of `threshold` tokens or more runs sglang-kt's
full-GPU pass of every layer instead (`full_gpu_layer_s`). Policies, all from the same start:

- `static`: the warm-up plan, never changed (sglang-kt `frequency` with a recorded stats file);
- `sglang-kt dynamic` (`--kt-enable-dynamic-expert-update`): after each full-GPU pass a layer's
  resident set becomes that batch's `k[l]` most frequent experts (ties: the lower id), copied
  inside the GPU from the full layer (`2*W_e/B_H` each);
- `payback` (ours): per-step counts go into a sliding window (`moe_place.online.window`), a
  predictor gives the coming counts per step, and their ratio to the tokens the coming shares
  (weighted by tokens: a prefill batch counts for its many tokens) and a hot-spot tracker how long the current hot spots will
  last (`L` steps). Every `check_every` steps, and at every full-GPU pass, each layer pairs its
  most valuable hot CPU expert (hot: the tracker's, `hot_factor` x the layer's mean share) with its
  least valuable resident one (value: the expected CPU time it
  costs per step under the predicted shares, `moe_place.solvers.offload`'s planning costs), the
  next pair, and so on; a pair is swapped when its copy pays back (formula 7, `N_min =
  floor(T_copy/dt) + 1` steps) within `L / hysteresis` steps, where `T_copy = alpha + W_e/B_L` over
  the link (or `2*W_e/B_H` inside the GPU right after a full-GPU pass) and `dt` the predicted
  saving per step. Copies stall serving (charged to the step that decided them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_place.cost.models import ExpertShape
from moe_place.cost.offload import OffloadRates, expert_copy_s, full_gpu_layer_s, tiered_times
from moe_place.cost.payback import n_min
from moe_place.errors import InputError
from moe_place.online.window import HotSpotTracker, Predictor, SlidingWindow
from moe_place.solvers.offload import OffloadProblem, plan_offload
from moe_place.traces.synthetic import ProfileSteps, inclusion_probabilities, sample_counts

POLICIES = ("static", "sglang-kt dynamic", "payback")


@dataclass(frozen=True)
class ServingRun:
    """Steps of a serving run: counts int64 `[steps, L, E]` and tokens int64 `[steps]`."""

    counts: np.ndarray
    tokens: np.ndarray

    def __post_init__(self) -> None:
        if self.counts.ndim != 3 or self.tokens.shape != (self.counts.shape[0],) or (self.tokens < 1).any():
            raise InputError("serving run", "counts [steps, layers, experts] and tokens >= 1 per step",
                             (self.counts.shape, self.tokens.shape))

    @property
    def num_steps(self) -> int:
        return self.counts.shape[0]

    @property
    def top_k(self) -> int:
        """Experts per token: a step's dispatches per layer over its tokens."""
        return int(round(float(self.counts[0, 0].sum()) / float(self.tokens[0])))


def serving_run(profile: ProfileSteps, num_steps: int, top_k: int, decode_tokens: int, prefill_tokens: int,
                prefill_every: int, seed: int) -> ServingRun:
    """Counts of a drifting profile (`moe_place.traces.synthetic`): decode steps of `decode_tokens`
    tokens, every `prefill_every`-th step a prefill of `prefill_tokens` (0: none)."""
    if num_steps < 1 or decode_tokens < 1 or prefill_tokens < 0 or prefill_every < 1:
        raise InputError("serving run", "steps, decode tokens, prefill interval >= 1 and prefill tokens >= 0",
                         (num_steps, decode_tokens, prefill_tokens, prefill_every))
    rng = np.random.default_rng(seed)
    weights = profile(rng)
    tokens = np.where((np.arange(num_steps) % prefill_every == 0) & (prefill_tokens > 0), prefill_tokens,
                      decode_tokens).astype(np.int64)
    counts = np.stack([sample_counts(inclusion_probabilities(next(weights), top_k), int(n), rng) for n in tokens])
    return ServingRun(counts, tokens)


@dataclass(frozen=True)
class ReplayOutcome:
    """What a policy cost over the run: step_s / copy_s float `[steps]`, experts copied over the link
    and inside the GPU, full-GPU passes."""

    policy: str
    step_s: np.ndarray
    copy_s: np.ndarray
    link_copies: int
    gpu_copies: int
    full_gpu_passes: int

    @property
    def total_s(self) -> float:
        return float(self.step_s.sum() + self.copy_s.sum())

    def to_json(self) -> dict:
        return {"policy": self.policy, "total_s": self.total_s, "serving_s": float(self.step_s.sum()),
                "copies_s": float(self.copy_s.sum()), "link_copies": self.link_copies, "gpu_copies": self.gpu_copies,
                "full_gpu_passes": self.full_gpu_passes}


@dataclass(frozen=True)
class PaybackSettings:
    """check_every: steps between checks. window / predictor / tracker: load prediction and how long hot
    spots last. hysteresis: a copy must pay back within `L / hysteresis` steps."""

    check_every: int = 16
    window: int = 256
    predictor: str = "last"
    horizon: int = 64
    alpha: float = 0.05
    hot_factor: float = 2.0
    prior_steps: float = 256.0
    hysteresis: float = 2.0

    def __post_init__(self) -> None:
        if self.check_every < 1 or self.window < 1 or not self.hysteresis >= 1:
            raise InputError("payback settings", "check_every, window >= 1 and hysteresis >= 1",
                             (self.check_every, self.window, self.hysteresis))


def _step_time(run: ServingRun, step: int, resident: np.ndarray, threshold: int | None, model: ExpertShape,
               rates: OffloadRates) -> tuple[float, bool]:
    rows = run.counts[step].astype(np.float64)
    if threshold is not None and run.tokens[step] >= threshold:
        return float(full_gpu_layer_s(rows, resident, model, rates).sum()), True
    return float(tiered_times(rows, resident, run.tokens[step], model, rates).layer_s.sum()), False


def replay_offload(run: ServingRun, policy: str, initial: np.ndarray, model: ExpertShape, rates: OffloadRates,
                   scenarios: list[tuple[str, int, float]], threshold: int | None = None,
                   settings: PaybackSettings | None = None) -> ReplayOutcome:
    """Replay `run` under `policy` from the resident mask `initial` bool `[L, E]` (its per-layer counts
    stay). scenarios: the `(name, tokens, weight)` mix the payback policy prices a step with."""
    if policy not in POLICIES:
        raise InputError("policy", f"one of {', '.join(POLICIES)}", repr(policy))
    settings = settings or PaybackSettings()
    resident = np.array(initial, dtype=bool)
    layers, experts = resident.shape
    if run.counts.shape[1:] != resident.shape:
        raise InputError("initial resident set", f"bool {list(run.counts.shape[1:])}", list(resident.shape))
    per_layer = resident.sum(axis=1)
    step_s, copy_s = np.zeros(run.num_steps), np.zeros(run.num_steps)
    link_copies = gpu_copies = passes = 0
    window = SlidingWindow(settings.window, layers, experts)
    predictor = Predictor(settings.predictor, settings.horizon, settings.alpha)
    tracker = HotSpotTracker(settings.hot_factor, settings.check_every, settings.prior_steps)
    inside_gpu_s = 2 * model.expert_bytes / rates.hbm_bytes_per_s
    for step in range(run.num_steps):
        step_s[step], full = _step_time(run, step, resident, threshold, model, rates)
        passes += full
        if policy == "static":
            continue
        if policy == "sglang-kt dynamic":
            if full:  # the batch's most frequent experts, the same count per layer
                order = np.argsort(-run.counts[step], axis=1, kind="stable")
                new = np.zeros_like(resident)
                np.put_along_axis(new, order, np.arange(experts)[None] < per_layer[:, None], axis=1)
                moved = int((new & ~resident).sum())
                gpu_copies += moved
                copy_s[step] = moved * inside_gpu_s
                resident = new
            continue
        window.push(run.counts[step])
        predictor.observe(run.counts[step])
        if not (full or (step + 1) % settings.check_every == 0):
            continue
        mean_counts = predictor.predict(window)[0]              # per step, so a prefill weighs by its tokens
        tokens = mean_counts.sum(axis=1, keepdims=True) / run.top_k
        predicted = np.clip(mean_counts / np.maximum(tokens, 1e-12), 0.0, 1.0)
        hot = tracker.update(step, predicted)
        life = tracker.expected_duration_steps(predicted)
        copy_one = inside_gpu_s if full else expert_copy_s(model, rates)
        swaps = _payback_swaps(predicted, resident, hot, scenarios, model, rates, copy_one,
                               life / settings.hysteresis)
        moved = int(swaps.sum())
        if moved:
            resident = (resident & ~swaps[0]) | swaps[1]
            copy_s[step] = moved * copy_one
            if full:
                gpu_copies += moved
            else:
                link_copies += moved
    assert (resident.sum(axis=1) == per_layer).all()
    return ReplayOutcome(policy, step_s, copy_s, link_copies, gpu_copies, passes)


def _payback_swaps(share: np.ndarray, resident: np.ndarray, hot: np.ndarray, scenarios, model: ExpertShape,
                   rates: OffloadRates, copy_s: float, within_steps: float) -> np.ndarray:
    """bool `[2, L, E]`: (experts leaving the GPU, experts coming in), the pairs whose copy pays back.
    Only hot experts (`hot` bool `[L, E]`, the tracker's) come in: their advantage is the one that
    lasts the tracker's expected life; a colder expert ahead by chance would be copied for nothing."""
    problem = OffloadProblem.from_shares(share, scenarios, model, rates, capacity=1)
    value = np.tensordot(problem.weights, problem.cpu_s, axes=1)             # [L, E] expected CPU s per step
    layers, experts = resident.shape
    out = np.zeros((2, layers, experts), dtype=bool)
    for l in np.flatnonzero((hot & ~resident).any(axis=1)):
        ins = np.flatnonzero(hot[l] & ~resident[l])
        outs = np.flatnonzero(resident[l])
        ins = ins[np.argsort(-value[l, ins], kind="stable")]
        outs = outs[np.argsort(value[l, outs], kind="stable")]
        for e_in, e_out in zip(ins, outs):
            needed = n_min(copy_s, float(value[l, e_in] - value[l, e_out]))
            if needed is None or needed > within_steps:
                break
            out[0, l, e_out] = out[1, l, e_in] = True
    return out


def warm_up_plan(run: ServingRun, warm_up_steps: int, scenarios, model: ExpertShape, rates: OffloadRates,
                 capacity: int) -> np.ndarray:
    """The offline plan (`moe_place.solvers.offload.plan_offload`) on the first `warm_up_steps` steps."""
    if not 1 <= warm_up_steps <= run.num_steps:
        raise InputError("warm-up steps", f"in [1, {run.num_steps}]", warm_up_steps)
    share = run.counts[:warm_up_steps].sum(axis=0) / float(run.tokens[:warm_up_steps].sum())
    problem = OffloadProblem.from_shares(np.clip(share, 0.0, 1.0), scenarios, model, rates, capacity)
    return plan_offload(problem).resident
