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
  last (`L` steps; the prediction averages the last `L / 2` steps). Every `check_every` steps, and
  at every full-GPU pass, each layer pairs its most valuable hot CPU expert (hot: the tracker's,
  `hot_factor` x the layer's mean share; right after a full-GPU pass, any CPU expert) with its
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
from moe_place.cost.offload import OffloadRates, cpu_compute_s, expert_copy_s, full_gpu_layer_s, tiered_times
from moe_place.cost.payback import n_min
from moe_place.errors import InputError
from moe_place.online.window import HotSpotTracker, SlidingWindow
from moe_place.solvers.offload import OffloadProblem, plan_offload
from moe_place.traces.synthetic import ProfileSteps, inclusion_probabilities, sample_counts

__all__ = ["PaybackSettings", "ReplayOutcome", "ServingRun", "SwapLedger", "replay_offload", "serving_run",
           "warm_up_plan"]

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
    """check_every: steps between checks. window: steps kept; the prediction averages the last
    `L / 2` of them (`L` the tracker's expected hot-spot life), at least `horizon_min`. hot_factor /
    prior_steps: the hot-spot tracker's. hysteresis: a copy must pay back within `L / hysteresis` steps.
    audit_steps: how long after a swap its real saving is compared with the predicted one (`SwapLedger`)."""

    check_every: int = 16
    window: int = 256
    horizon_min: int = 8
    hot_factor: float = 2.0
    prior_steps: float = 256.0
    hysteresis: float = 2.0
    audit_steps: int = 64

    def __post_init__(self) -> None:
        if self.check_every < 1 or not 1 <= self.horizon_min <= self.window or not self.hysteresis >= 1:
            raise InputError("payback settings", "check_every >= 1, 1 <= horizon_min <= window, hysteresis >= 1",
                             (self.check_every, self.horizon_min, self.window, self.hysteresis))


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
    ledger = SwapLedger(settings.audit_steps)
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
        if not full:
            ledger.observe(run.counts[step], model, rates)
        if not (full or (step + 1) % settings.check_every == 0):
            continue
        # the coming shares: counts per step over the last half hot-spot life (at least `horizon_min`
        # steps, at most the window), over their tokens, so a prefill batch weighs by its tokens
        life = tracker.expected_duration_steps()
        horizon = int(np.clip(life / 2, settings.horizon_min, settings.window))
        mean_counts = window.last(horizon).mean(axis=0)
        tokens = mean_counts.sum(axis=1, keepdims=True) / run.top_k
        predicted = np.clip(mean_counts / np.maximum(tokens, 1e-12), 0.0, 1.0)
        hot = tracker.update(step, predicted)
        life = tracker.expected_duration_steps(predicted)
        copy_one = inside_gpu_s if full else expert_copy_s(model, rates)
        # a copy over the link only for experts hot over the horizon and still hot over the last check
        # interval (an expert whose hot spot just ended is still hot on average over the horizon);
        # right after a full-GPU pass every expert is on the GPU: any may come in at almost no cost
        recent = window.last(settings.check_every).mean(axis=0)
        recent_share = recent / np.maximum(recent.sum(axis=1, keepdims=True) / run.top_k, 1e-12)
        still_hot = recent_share > settings.hot_factor * recent_share.mean(axis=1, keepdims=True)
        candidates = np.ones_like(hot) if full else hot & still_hot
        # the ledger audits (and discounts) the copies over the link, the ones whose cost matters
        swaps, saving = _payback_swaps(predicted, resident, candidates, scenarios, model, rates, copy_one,
                                       life / settings.hysteresis, 1.0 if full else ledger.realised_share)
        if not full:
            ledger.add(saving)
        moved = int(swaps[1].sum())
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
                   rates: OffloadRates, copy_s: float, within_steps: float,
                   realised_share: float) -> tuple[np.ndarray, list[tuple[int, int, int, float]]]:
    """(bool `[2, L, E]`: experts leaving the GPU, experts coming in; the pairs `(layer, in, out,
    predicted saving per step)`), the pairs whose copy pays back. Only `hot` experts (bool `[L, E]`)
    come in: their advantage is the one that lasts the tracker's expected life; a colder expert ahead
    by chance would be copied for nothing. The predicted saving counts at `realised_share` of itself:
    what the earlier swaps earned of what was predicted for them (`SwapLedger`)."""
    problem = OffloadProblem.from_shares(share, scenarios, model, rates)
    value = np.tensordot(problem.weights, problem.cpu_s, axes=1)             # [L, E] expected CPU s per step
    layers, experts = resident.shape
    out = np.zeros((2, layers, experts), dtype=bool)
    pairs = []
    for l in np.flatnonzero((hot & ~resident).any(axis=1)):
        ins = np.flatnonzero(hot[l] & ~resident[l])
        outs = np.flatnonzero(resident[l])
        ins = ins[np.argsort(-value[l, ins], kind="stable")]
        outs = outs[np.argsort(value[l, outs], kind="stable")]
        for e_in, e_out in zip(ins, outs):
            saving = float(value[l, e_in] - value[l, e_out])
            needed = n_min(copy_s, saving * realised_share)
            if needed is None or needed > within_steps:
                break
            out[0, l, e_out] = out[1, l, e_in] = True
            pairs.append((int(l), int(e_in), int(e_out), saving))
    return out, pairs


class SwapLedger:
    """What swaps earned against what was predicted for them: for `audit_steps` steps after each swap,
    the CPU time the incoming expert would have taken minus what the outgoing one now takes, on the
    step's real rows (`cpu_compute_s`; the CPU side binds), summed over pairs and steps, over the
    predicted saving per step times the same steps. 1 until it has seen `min_pair_steps`."""

    def __init__(self, audit_steps: int, min_pair_steps: int = 256):
        self.audit_steps, self.min_pair_steps = audit_steps, min_pair_steps
        self._pairs: list[list] = []      # [layer, in, out, predicted per step, steps seen]
        self._realised = self._predicted = 0.0
        self._seen = 0

    def add(self, pairs: list[tuple[int, int, int, float]]) -> None:
        self._pairs.extend([l, e_in, e_out, saving, 0] for l, e_in, e_out, saving in pairs)

    def observe(self, counts: np.ndarray, model: ExpertShape, rates: OffloadRates) -> None:
        if not self._pairs:
            return
        layer, e_in, e_out = (np.array([p[i] for p in self._pairs]) for i in range(3))
        rows_in, rows_out = counts[layer, e_in].astype(np.float64), counts[layer, e_out].astype(np.float64)
        realised = (np.where(rows_in > 0, cpu_compute_s(rows_in, model, rates), 0.0)
                    - np.where(rows_out > 0, cpu_compute_s(rows_out, model, rates), 0.0))
        self._realised += float(np.sum(realised))
        self._predicted += float(sum(p[3] for p in self._pairs))
        self._seen += len(self._pairs)
        for p in self._pairs:
            p[4] += 1
        self._pairs = [p for p in self._pairs if p[4] < self.audit_steps]

    @property
    def realised_share(self) -> float:
        if self._seen < self.min_pair_steps or self._predicted <= 0:
            return 1.0
        return float(np.clip(self._realised / self._predicted, 0.0, 1.0))


def warm_up_plan(run: ServingRun, warm_up_steps: int, scenarios, model: ExpertShape, rates: OffloadRates,
                 capacity: int) -> np.ndarray:
    """The offline plan (`moe_place.solvers.offload.plan_offload`) on the first `warm_up_steps` steps."""
    if not 1 <= warm_up_steps <= run.num_steps:
        raise InputError("warm-up steps", f"in [1, {run.num_steps}]", warm_up_steps)
    share = run.counts[:warm_up_steps].sum(axis=0) / float(run.tokens[:warm_up_steps].sum())
    problem = OffloadProblem.from_shares(np.clip(share, 0.0, 1.0), scenarios, model, rates)
    return plan_offload(problem, capacity).resident
