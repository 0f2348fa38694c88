"""Replay a multi-step trace through a controller and the cost model.

Each step: the map in use serves the step's counts (busiest-GPU expert time of every layer,
summed over layers); the controller observes the counts and may decide a new map; serving pays
for the copies it needs as the cost model's migration says (`ReplayCost.charge`: `stall`, the
copy time of formula 7, or `async`, the delay the copies cause beside dispatch/combine,
priced on the step that decided) and the map switches once the copies are done (`async`: after
the steps they run beside, at least one per layer moved where the engine moves one layer per
step) and the in-flight batches drain (`MapSwitch`). The policy's own time at each call is paid
too: the CPU seconds of the thread that ran it (`time.thread_time`, what the call takes on an idle
core, since an engine runs it on its own; wall time on a shared machine is longer). Totals: expert-layer time + migration time + policy time. Every
controller starts from the same map: the engine's start map (`controller.initial_map`), or an
offline plan made from the first `window` steps (`initial_placement`), as a user loading a plan
at start-up would have.

Hindsight bounds: `hindsight_static` plans once for the whole trace (knowing it all);
`hindsight_per_step` plans every step for that step's own counts with free migration.
A reference that needs no foresight: `free_replan_reference` plans afresh every `every` steps
from the last `every` steps and migrates for free - what a controller predicting from recent
history could reach if copies cost nothing (not a bound: a lucky controller can beat it, but
on the bench traces no migration-paying controller came near it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from moe_place.eplb import plan_placement
from moe_place.errors import InputError, check_keys
from moe_place.online.controller import Controller, StaticController
from moe_place.online.costing import ReplayCost
from moe_place.online.switch import MapSwitch
from moe_place.placement import Placement, balancedness
from moe_place.traces.synthetic import DEEPSEEK_R1, domain_mixture_counts


@dataclass(frozen=True)
class ReplayResult:
    """Per-step and total figures of one replay.

    expert_time_s / balancedness / bytes_moved / copy_time_s / policy_time_s: float64 or int64
    `[steps]` (bytes and the migration time serving pays, on the step a rebalance was decided;
    the policy's wall time on the step it was called). bytes_moved counts copies between
    GPUs; slots_moved counts every slot whose expert changed (a copy within a GPU included);
    policy_time_s is measured (CPU seconds of the policy's calls, `time.thread_time`);
    peak_staging_bytes is the most buffer memory one switch held (both maps live until the drain).
    balancedness: mean over layers of mean/max GPU load (vLLM's metric) under the map in use.
    Every figure but `policy_time_s` (and the totals that include it) repeats exactly.
    """

    controller: str
    expert_time_s: np.ndarray
    balancedness: np.ndarray
    bytes_moved: np.ndarray
    copy_time_s: np.ndarray
    rebalance_steps: tuple[int, ...]
    slots_moved: int
    peak_staging_bytes: int
    policy_time_s: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.policy_time_s is None:
            object.__setattr__(self, "policy_time_s", np.zeros(len(self.expert_time_s)))

    @property
    def steps(self) -> int:
        return len(self.expert_time_s)

    @property
    def rebalances(self) -> int:
        return len(self.rebalance_steps)

    @property
    def total_bytes_moved(self) -> int:
        return int(self.bytes_moved.sum())

    @property
    def total_expert_time_s(self) -> float:
        return float(self.expert_time_s.sum())

    @property
    def total_migration_time_s(self) -> float:
        return float(self.copy_time_s.sum())

    @property
    def total_policy_time_s(self) -> float:
        return float(self.policy_time_s.sum())

    @property
    def total_time_s(self) -> float:
        return self.total_expert_time_s + self.total_migration_time_s + self.total_policy_time_s

    def cumulative_time_s(self) -> np.ndarray:
        return np.cumsum(self.expert_time_s + self.copy_time_s + self.policy_time_s)

    def to_json(self, per_step: bool = True) -> dict:
        out = {
            "controller": self.controller,
            "steps": self.steps,
            "rebalances": self.rebalances,
            "rebalance_steps": list(self.rebalance_steps),
            "slots_moved": self.slots_moved,
            "bytes_moved": self.total_bytes_moved,
            "peak_staging_bytes": self.peak_staging_bytes,
            "total_expert_time_s": self.total_expert_time_s,
            "total_migration_time_s": self.total_migration_time_s,
            "total_policy_time_s": self.total_policy_time_s,
            "total_time_s": self.total_time_s,
            "mean_balancedness": float(self.balancedness.mean()) if self.steps else 0.0,
        }
        if per_step:
            decided = set(self.rebalance_steps)
            out["per_step"] = [
                {"step": i, "expert_time_s": float(self.expert_time_s[i]), "balancedness": float(self.balancedness[i]),
                 "rebalance": i in decided, "bytes_moved": int(self.bytes_moved[i]),
                 "copy_time_s": float(self.copy_time_s[i])}
                for i in range(self.steps)]
        return out


def check_counts_3d(counts: np.ndarray) -> np.ndarray:
    counts = np.asarray(counts)
    if counts.ndim != 3 or 0 in counts.shape:
        raise InputError("trace counts", "a non-empty array [steps, layers, experts]", f"shape {counts.shape}")
    return counts.astype(np.float64)


def initial_placement(counts: np.ndarray, num_gpus: int, num_physical: int, num_nodes: int = 1,
                      window: int = 1000, num_groups: int | None = None, solver: str = "fast") -> Placement:
    """The start-up map: planned from the first `window` steps (an offline plan)."""
    counts = check_counts_3d(counts)
    return plan_placement(counts[:window].sum(axis=0), num_physical, num_groups, num_nodes, num_gpus, solver=solver)


def balancedness_of(placement: Placement, counts: np.ndarray) -> float:
    """Mean over layers of mean/max GPU load (1 when perfectly balanced; 1 for an empty step)."""
    return float(balancedness(placement.gpu_loads(counts)).mean())


def replay(counts: np.ndarray, controller: Controller, cost: ReplayCost, initial: Placement,
           drain_steps: int = 1, on_step: Callable[[int], None] | None = None,
           layer_per_step: bool = False) -> ReplayResult:
    """Run `controller` over `counts [steps, layers, E]` starting from the map `initial`.

    on_step: called with each step's index once it is done (e.g. a progress bar).
    layer_per_step: asynchronous copies take at least one step per layer they change (vLLM).
    """
    counts = check_counts_3d(counts)
    steps, layers, experts = counts.shape
    if (initial.num_layers, initial.num_experts) != (layers, experts):
        raise InputError("initial placement", f"{layers} layers x {experts} experts",
                         f"{initial.num_layers} x {initial.num_experts}")
    if initial.num_gpus != cost.num_gpus:
        raise InputError("initial placement", f"{cost.num_gpus} GPUs (the cluster)", initial.num_gpus)
    switch = MapSwitch(initial, drain_steps=drain_steps)
    expert_s = np.zeros(steps)
    balance = np.zeros(steps)
    moved_bytes = np.zeros(steps, dtype=np.int64)
    copy_s = np.zeros(steps)
    policy_s = np.zeros(steps)
    rebalance_steps: list[int] = []
    slots_moved = peak_staging = 0
    for step in range(steps):
        in_use = switch.map_for_step(step)
        expert_s[step] = cost.step_time_s(in_use, counts[step])
        balance[step] = balancedness_of(in_use, counts[step])
        controller.observe(step, counts[step])
        decision = None if switch.busy else controller.decide(step, switch.latest)
        policy_s[step] = getattr(controller, "last_policy_s", 0.0) if not switch.busy else 0.0
        copies = cost.copies(switch.latest, decision.placement) if decision is not None else []
        if copies:
            staging = sum(c.num_bytes for c in copies)
            charge = cost.charge(copies, in_use, counts[step])
            copy_steps = charge.steps
            if layer_per_step and cost.migration == "async":
                copy_steps = max(copy_steps, len({c.layer for c in copies}))
            switch.schedule(decision.placement, step, staging_bytes=staging, copy_steps=copy_steps)
            moved_bytes[step] = sum(c.num_bytes for c in copies if not c.local)
            copy_s[step] = charge.charged_s
            rebalance_steps.append(step)
            slots_moved += len(copies)
            peak_staging = max(peak_staging, staging)
        if on_step is not None:
            on_step(step)
    return ReplayResult(controller.name, expert_s, balance, moved_bytes, copy_s, tuple(rebalance_steps),
                        slots_moved, peak_staging, policy_s)


def hindsight_static(counts: np.ndarray, cost: ReplayCost, num_physical: int, num_nodes: int = 1,
                     num_groups: int | None = None, solver: str = "fast") -> ReplayResult:
    """Bound: one map planned from the whole trace, never moved, no migration paid."""
    counts = check_counts_3d(counts)
    plan = plan_placement(counts.sum(axis=0), num_physical, num_groups, num_nodes, cost.num_gpus, solver=solver)
    result = replay(counts, StaticController(), cost, plan)
    return ReplayResult("hindsight-static", result.expert_time_s, result.balancedness, result.bytes_moved,
                        result.copy_time_s, (), 0, 0)


def hindsight_per_step(counts: np.ndarray, cost: ReplayCost, num_physical: int, num_nodes: int = 1,
                       num_groups: int | None = None, solver: str = "fast") -> ReplayResult:
    """Bound: every step runs on a map planned for its own counts; migration is free."""
    counts = check_counts_3d(counts)
    plans = ((plan_placement(counts[step], num_physical, num_groups, num_nodes, cost.num_gpus, solver=solver),
              range(step, step + 1)) for step in range(counts.shape[0]))
    return _free_migration_run("hindsight-per-step", counts, cost, plans)


def free_replan_reference(counts: np.ndarray, cost: ReplayCost, initial: Placement, every: int = 16,
                          num_groups: int | None = None, solver: str = "fast") -> ReplayResult:
    """Reference: from `initial`, every `every` steps a fresh plan for the mean of the last `every`
    steps' counts (no look-ahead), switched with free migration (see the module note)."""
    counts = check_counts_3d(counts)
    if every < 1:
        raise InputError("every", "an integer >= 1 steps", every)
    steps = counts.shape[0]

    def plans():
        yield initial, range(0, min(every, steps))
        for start in range(every, steps, every):
            plan = plan_placement(counts[start - every:start].mean(axis=0), initial.num_physical, num_groups,
                                  initial.num_nodes, initial.num_gpus, solver=solver)
            yield plan, range(start, min(start + every, steps))

    return _free_migration_run(f"free-replan-{every}", counts, cost, plans())


def _free_migration_run(name: str, counts: np.ndarray, cost: ReplayCost,
                        plans: Iterable[tuple[Placement, range]]) -> ReplayResult:
    """Each `(plan, steps)` of `plans` serves those steps of `counts`; switches cost nothing."""
    steps = counts.shape[0]
    expert_s, balance = np.zeros(steps), np.zeros(steps)
    for plan, block in plans:
        for step in block:
            expert_s[step] = cost.step_time_s(plan, counts[step])
            balance[step] = balancedness_of(plan, counts[step])
    return ReplayResult(name, expert_s, balance, np.zeros(steps, dtype=np.int64), np.zeros(steps), (), 0, 0)


# ---------------------------------------------------------------------- synthetic traces
SYNTHETIC_KINDS = ("drift",)
SYNTHETIC_DEFAULTS = {"steps": 6000, "layers": 8, "experts": 64, "top_k": 8, "tokens": 4096, "domains": 6,
                      "drift": 0.12, "skew": 0.8, "shared": 0.0, "concentration": 2.0, "hot": 0.0, "seed": 0}
# `preset=deepseek-r1` starts from the traces helper's calibrated DeepSeek-R1 mixture (58 layers by default
# there; `layers` still applies)
SYNTHETIC_PRESETS = ("deepseek-r1",)
# Upper limits of one synthetic trace: it is generated in memory as int64 counts [steps, layers, experts]
MAX_SYNTHETIC_STEPS = 1_000_000
MAX_SYNTHETIC_CELLS = 2**28  # steps x layers x experts: 2 GiB of counts


def _check_synthetic(params: dict, where: str) -> None:
    """InputError naming the first `--synthetic` key out of range (sizes bounded: see MAX_SYNTHETIC_*)."""
    for key, low in (("steps", 1), ("layers", 1), ("experts", 2), ("top_k", 1), ("tokens", 1), ("domains", 1),
                     ("seed", 0)):
        if params[key] < low:
            raise InputError(f"{where} {key}", f"an integer >= {low}", params[key])
    for key in ("drift", "skew", "shared", "concentration", "hot"):
        if not np.isfinite(params[key]) or params[key] < 0:
            raise InputError(f"{where} {key}", "a finite number >= 0", params[key])
    if params["top_k"] > params["experts"]:
        raise InputError(f"{where} top_k", f"at most experts = {params['experts']}", params["top_k"])
    if params["steps"] > MAX_SYNTHETIC_STEPS:
        raise InputError(f"{where} steps", f"at most {MAX_SYNTHETIC_STEPS:,}", f"{params['steps']:,}")
    cells = params["steps"] * params["layers"] * params["experts"]
    if cells > MAX_SYNTHETIC_CELLS:
        raise InputError(f"{where} steps x layers x experts", f"at most {MAX_SYNTHETIC_CELLS:,} counts in memory",
                         f"{cells:,}")
    weights = params["domains"] * params["layers"] * params["experts"]  # each domain's expert weights
    if weights > MAX_SYNTHETIC_CELLS:
        raise InputError(f"{where} domains x layers x experts", f"at most {MAX_SYNTHETIC_CELLS:,} weights in memory",
                         f"{weights:,}")


def parse_synthetic(spec: str, where: str = "--synthetic") -> tuple[np.ndarray, dict]:
    """Counts `[steps, layers, E]` of the drifting domain-mixture generator from `drift:key=value,...`.

    Keys (defaults in `SYNTHETIC_DEFAULTS`): steps, layers, experts, top_k, tokens (per step),
    domains, drift (std of the mixture-logit random walk per step), skew, shared, concentration,
    hot (one hot expert per domain and layer at `hot` x the mean weight; 0: none), seed, and
    `preset=deepseek-r1` (the traces helper's calibrated DeepSeek-R1 mixture: 256 experts, top-8,
    4 domains, shared 0.9, hot experts 9-22x; other keys override it). Returns the counts and the
    resolved parameters.
    """
    kind, _, rest = str(spec).partition(":")
    if kind not in SYNTHETIC_KINDS:
        raise InputError(where, f"'{SYNTHETIC_KINDS[0]}:key=value,...'", repr(spec))
    params = dict(SYNTHETIC_DEFAULTS)
    hot_range = None
    items = [p.strip() for p in rest.split(",") if p.strip()]
    for item in items:
        if item.startswith("preset="):
            name = item.partition("=")[2]
            if name not in SYNTHETIC_PRESETS:
                raise InputError(f"{where} preset", f"one of {', '.join(SYNTHETIC_PRESETS)}", repr(name))
            params.update(experts=DEEPSEEK_R1["num_experts"], top_k=DEEPSEEK_R1["top_k"],
                          domains=DEEPSEEK_R1["num_domains"], drift=DEEPSEEK_R1["drift"],
                          concentration=DEEPSEEK_R1["concentration"], shared=DEEPSEEK_R1["shared"])
            params["preset"] = name
            params["skew"] = float(np.mean(DEEPSEEK_R1["skew"]))
            skew_range, hot_range = DEEPSEEK_R1["skew"], DEEPSEEK_R1["hot_factor"]
    for item in items:
        if item.startswith("preset="):
            continue
        key, eq, value = item.partition("=")
        if not eq:
            raise InputError(where, f"key=value pairs with keys among {', '.join(params)}", repr(item))
        check_keys({key: value}, params, f"{where}:")
        kind_name = "a number" if isinstance(params[key], float) else "an integer"
        try:
            params[key] = type(params[key])(value) if not isinstance(params[key], float) else float(value)
        except ValueError:
            raise InputError(f"{where} {key}", kind_name, repr(value)) from None
    _check_synthetic(params, where)
    skew = params["skew"]
    if "preset" in params and "skew=" not in rest:
        skew = skew_range
    if params["hot"] > 0:
        hot_range = (params["hot"], params["hot"])
    counts = domain_mixture_counts(params["steps"], params["layers"], params["experts"], params["top_k"],
                                   params["tokens"], num_domains=params["domains"], skew=skew,
                                   drift=params["drift"], concentration=params["concentration"],
                                   shared=params["shared"], hot_factor=hot_range, seed=params["seed"])
    return counts, {"kind": kind, **params}
