"""Replay a multi-step trace through a controller and the cost model.

Each step: the map in use serves the step's counts (busiest-GPU expert time of every layer,
summed over layers); the controller observes the counts and may decide a new map; serving pays
for the copies it needs as the cost model's migration says (`ReplayCost.charge`: `stall`, the
copy time of formula 7, or `async`, the delay the copies cause beside dispatch/combine, priced
on the step that decided) and the map switches once the copies are done and the in-flight
batches drain (`MapSwitch`). Under vLLM's asynchronous worker (`layer_per_step`) every call
walks the layers one per step, each layer's copies priced on their own and each layer switching
as it is committed, and the next call waits for the walk (`MapSwitch.schedule_layers`).
The policy's own time at each call is measured, the CPU seconds of the thread that ran it
(`time.thread_time`, what the call takes on an idle core), and paid where the engine waits
for it (SGLang's scheduler, vLLM's sync mode), not where it runs in a worker thread beside
serving (`policy_in_worker`, vLLM's `use_async`). Totals: expert-layer time + migration time +
policy time paid. Every controller starts from the same map: the engine's start map
(`controller.initial_map`), or an offline plan made from the first `window` steps
(`initial_placement`), as a user loading a plan at start-up would have.

A reference no controller reaches: `hindsight_next_reference` plans every `every` steps for the
next `every` steps (a rule at that cadence that knew the coming load, moving for free).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from moe_place.cost.cluster import ReplayCost
from moe_place.errors import InputError, check_keys
from moe_place.online.controller import Controller
from moe_place.online.switch import MapSwitch
from moe_place.placement import Placement
from moe_place.solvers.deepseek import eplb_rebalance
from moe_place.solvers.engine_call import plan_placement
from moe_place.traces.load import load_trace
from moe_place.traces.synthetic import DEEPSEEK_R1, domain_mixture_counts

__all__ = ["ReplayResult", "check_counts_3d", "hindsight_next_reference", "initial_placement", "load_replay_counts",
           "parse_synthetic", "replay", "served_steps"]


def _summed(name: str, kind: type = float) -> property:
    """A property: the per-step array `name` summed over the steps, as a Python `kind`."""
    return property(lambda self: kind(getattr(self, name).sum()))


@dataclass(frozen=True)
class ReplayResult:
    """Per-step and total figures of one replay.

    expert_time_s / balancedness / bytes_moved / copy_time_s / policy_time_s / policy_cpu_s:
    float64 or int64 `[steps]` (bytes and the migration time serving pays, on the step a
    rebalance was decided; the policy's time on the step it was called). bytes_moved counts
    copies between GPUs; slots_moved counts every slot whose expert changed (a copy within a GPU
    included), slots_moved_at the same per step; called_at: bool, the steps after which the
    policy was called; policy_cpu_s is measured (CPU seconds of the policy's calls, `time.thread_time`),
    policy_time_s is what serving pays for it: the same where the step waits for the policy,
    0 where it runs in a worker thread beside serving (vLLM's `use_async`);
    peak_staging_bytes is the most buffer memory one switch held (both maps live until the drain).
    split_layers: int64 `[steps]`, the layers whose batch the per-batch split took (0 without it);
    split_cpu_s: float64 `[steps]`, the CPU seconds of the split's choice in the policy's call (part of
    policy_cpu_s); split_price_s the same priced (`SplitState.price_s`, part of a priced policy_time_s).
    comm_time_s: float64 `[steps]`, the layers' dispatch + combine summed (`moe_place.cost.expected_traffic`:
    the rows each step is expected to move, formula 3).
    balancedness: mean over layers of mean/max GPU load (vLLM's metric) under the map in use.
    Every figure but the policy's times (and the totals that include them) repeats exactly.
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
    policy_cpu_s: np.ndarray | None = None
    slots_moved_at: np.ndarray | None = None
    called_at: np.ndarray | None = None
    split_layers: np.ndarray | None = None
    split_cpu_s: np.ndarray | None = None
    comm_time_s: np.ndarray | None = None
    split_price_s: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.comm_time_s is None:
            object.__setattr__(self, "comm_time_s", np.zeros(len(self.expert_time_s)))
        if self.split_layers is None:
            object.__setattr__(self, "split_layers", np.zeros(len(self.expert_time_s), dtype=np.int64))
        for name in ("split_cpu_s", "split_price_s"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, np.zeros(len(self.expert_time_s)))
        if self.slots_moved_at is None:
            object.__setattr__(self, "slots_moved_at", np.zeros(len(self.expert_time_s), dtype=np.int64))
        if self.called_at is None:
            object.__setattr__(self, "called_at", np.zeros(len(self.expert_time_s), dtype=bool))
        if self.policy_time_s is None:
            object.__setattr__(self, "policy_time_s", np.zeros(len(self.expert_time_s)))
        if self.policy_cpu_s is None:
            object.__setattr__(self, "policy_cpu_s", np.array(self.policy_time_s))

    @property
    def steps(self) -> int:
        return len(self.expert_time_s)

    @property
    def rebalances(self) -> int:
        return len(self.rebalance_steps)

    total_bytes_moved = _summed("bytes_moved", int)
    total_expert_time_s = _summed("expert_time_s")
    total_comm_time_s = _summed("comm_time_s")
    total_migration_time_s = _summed("copy_time_s")
    total_policy_time_s = _summed("policy_time_s")
    total_policy_cpu_s = _summed("policy_cpu_s")

    @property
    def total_time_s(self) -> float:
        return (self.total_expert_time_s + self.total_comm_time_s + self.total_migration_time_s
                + self.total_policy_time_s)

    def cumulative_time_s(self) -> np.ndarray:
        return np.cumsum(self.expert_time_s + self.comm_time_s + self.copy_time_s + self.policy_time_s)

    def to_json(self, per_step: bool = True) -> dict:
        out = {
            "controller": self.controller,
            "steps": self.steps,
            "rebalances": self.rebalances,
            "calls": int(self.called_at.sum()),
            "rebalance_steps": list(self.rebalance_steps),
            "slots_moved": self.slots_moved,
            "bytes_moved": self.total_bytes_moved,
            "peak_staging_bytes": self.peak_staging_bytes,
            "total_expert_time_s": self.total_expert_time_s,
            "total_comm_time_s": self.total_comm_time_s,
            "total_migration_time_s": self.total_migration_time_s,
            "total_policy_time_s": self.total_policy_time_s,
            "total_policy_cpu_s": self.total_policy_cpu_s,
            "total_time_s": self.total_time_s,
            "mean_balancedness": float(self.balancedness.mean()) if self.steps else 0.0,
            "split_layer_steps": int(self.split_layers.sum()),
            "split_cpu_s": float(self.split_cpu_s.sum()),
            "split_price_s": float(self.split_price_s.sum()),
        }
        if per_step:
            decided = set(self.rebalance_steps)
            out["per_step"] = [
                {"step": i, "expert_time_s": float(self.expert_time_s[i]), "comm_time_s": float(self.comm_time_s[i]),
                 "balancedness": float(self.balancedness[i]),
                 "rebalance": i in decided, "bytes_moved": int(self.bytes_moved[i]),
                 "copy_time_s": float(self.copy_time_s[i])}
                for i in range(self.steps)]
        return out


def check_counts_3d(counts: np.ndarray) -> np.ndarray:
    counts = np.asarray(counts)
    if counts.ndim != 3 or 0 in counts.shape:
        raise InputError("trace counts", "a non-empty array [steps, layers, experts]", f"shape {counts.shape}")
    return counts.astype(np.float64)


def load_replay_counts(trace: str | None, synthetic: str | None, layers: list[int] | None = None,
                       load_options: dict | None = None) -> tuple[np.ndarray, str, str]:
    """(counts `[steps, layers, E]`, where they come from, the trace's model name or "") of a trace file or a
    `parse_synthetic` spec (exactly one), restricted to the trace layer positions `layers` if given."""
    if (trace is None) == (synthetic is None):
        raise InputError("replay input", "a TRACE file or --synthetic SPEC (exactly one)")
    if synthetic is not None:
        counts, _ = parse_synthetic(synthetic)
        source, model_hint = synthetic, ""
    else:
        loaded = load_trace(trace, **(load_options or {}))
        counts, source, model_hint = np.asarray(loaded.step_counts()), str(trace), loaded.meta.model
    if layers is not None:
        bad = [p for p in layers if p >= counts.shape[1]]
        if bad:
            raise InputError("--layers", f"positions in [0, {counts.shape[1]})", bad[0])
        counts = counts[:, layers]
    return counts, source, model_hint


def initial_placement(counts: np.ndarray, num_gpus: int, num_physical: int, num_nodes: int = 1,
                      window: int = 1000, num_groups: int | None = None, solver: str = "fast") -> Placement:
    """The start-up map: planned from the first `window` steps (an offline plan)."""
    counts = check_counts_3d(counts)
    return plan_placement(counts[:window].sum(axis=0), num_physical, num_groups, num_nodes, num_gpus, solver=solver)


def replay(counts: np.ndarray, controller: Controller, cost: ReplayCost, initial: Placement,
           drain_steps: int = 1, on_step: Callable[[int], None] | None = None,
           layer_per_step: bool = False, policy_in_worker: bool = False,
           policy_price_s: float | None = None) -> ReplayResult:
    """Run `controller` over `counts [steps, layers, E]` starting from the map `initial`.

    on_step: called with each step's index once it is done (e.g. a progress bar).
    layer_per_step: vLLM's asynchronous worker (`EngineCadence.layer_per_step`): every policy call
        walks all layers, one per step at least (a layer's copies may take more), each layer
        switching as it is committed, and no call is made before the walk ends.
    policy_in_worker: the policy runs beside serving (`EngineCadence.policy_in_worker`): its CPU
        time is measured (`policy_cpu_s`) but serving does not pay it.
    policy_price_s: where serving waits for the policy, the seconds it pays per call
        (`moe_place.online.policy_cpu`, the same on every run), plus the split choice's own committed price
        (`last_split_price_s`); None: the CPU time each call measured.
    A controller with a per-batch split (`split_layers`, bool `[layers]`, set at each call) has those layers'
    batches split (`ReplayCost.served_times_s`) from the next step on, each paying the split's overhead.
    """
    counts = check_counts_3d(counts)
    steps, layers, experts = counts.shape
    if (initial.num_layers, initial.num_experts) != (layers, experts):
        raise InputError("initial placement", f"{layers} layers x {experts} experts",
                         f"{initial.num_layers} x {initial.num_experts}")
    if initial.num_gpus != cost.num_gpus:
        raise InputError("initial placement", f"{cost.num_gpus} GPUs (the cluster)", initial.num_gpus)
    switch = MapSwitch(initial, drain_steps=drain_steps)
    served: list[Placement] = []                                  # the map of each step (shared objects)
    split = np.zeros((steps, layers), dtype=bool)
    split_now = np.zeros(layers, dtype=bool)
    moved_bytes = np.zeros(steps, dtype=np.int64)
    copy_s = np.zeros(steps)
    policy_s = np.zeros(steps)
    policy_cpu = np.zeros(steps)
    split_cpu, split_price = np.zeros(steps), np.zeros(steps)
    slots_at = np.zeros(steps, dtype=np.int64)
    called_at = np.zeros(steps, dtype=bool)
    rebalance_steps: list[int] = []
    slots_moved = peak_staging = 0
    for step in range(steps):
        in_use = switch.map_for_step(step)
        served.append(in_use)
        split[step] = split_now
        controller.observe(step, counts[step], in_use)
        decision, called = None, False
        if not switch.busy_at(step):
            decision = controller.decide(step, switch.latest)
            called = called_at[step] = bool(getattr(controller, "called", decision is not None))
            policy_cpu[step] = getattr(controller, "last_policy_s", 0.0)
            split_price[step] = getattr(controller, "last_split_price_s", 0.0)
            paid = policy_cpu[step] if policy_price_s is None else policy_price_s * called + split_price[step]
            policy_s[step] = 0.0 if policy_in_worker else paid
            split_cpu[step] = getattr(controller, "last_split_s", 0.0)
            chosen = getattr(controller, "split_layers", None)
            if called and chosen is not None:
                split_now = np.asarray(chosen, dtype=bool).copy()
        copies = cost.copies(switch.latest, decision.placement) if decision is not None else []
        if layer_per_step and called:
            new = switch.latest if decision is None else decision.placement
            charged, layer_steps = _walk_charge(cost, copies, in_use, counts[step], layers)
            switch.schedule_layers(new, step, layer_steps, staging_bytes=sum(c.num_bytes for c in copies))
            copy_s[step] = charged
        elif copies:
            charge = cost.charge(copies, in_use, counts[step])
            switch.schedule(decision.placement, step, staging_bytes=sum(c.num_bytes for c in copies),
                            copy_steps=charge.steps)
            copy_s[step] = charge.charged_s
        if copies:
            staging = sum(c.num_bytes for c in copies)
            moved_bytes[step] = sum(c.num_bytes for c in copies if not c.local)
            rebalance_steps.append(step)
            slots_moved += len(copies)
            slots_at[step] = len(copies)
            peak_staging = max(peak_staging, staging)
        if on_step is not None:
            on_step(step)
    expert_s, comm_s, balance = served_steps(cost, served, counts, split)
    return ReplayResult(controller.name, expert_s, balance, moved_bytes, copy_s, tuple(rebalance_steps),
                        slots_moved, peak_staging, policy_s, policy_cpu, slots_at, called_at,
                        split.sum(axis=1).astype(np.int64), split_cpu, comm_s, split_price)


def served_steps(cost: ReplayCost, served: list[Placement], counts: np.ndarray, split: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(expert-layer time `[steps]`, dispatch + combine `[steps]`, balancedness `[steps]`) of each step on its map
    `served[step]`, the layers `split [steps, layers]` per-batch split: one batched `ReplayCost.served_times_s`
    per layer, map row and split (maps change rarely, so a row serves many steps)."""
    steps, layers, _ = counts.shape
    times, comm, balance = np.zeros((steps, layers)), np.zeros((steps, layers)), np.zeros((steps, layers))
    for layer in range(layers):
        groups: dict[tuple[bytes, bool], list[int]] = {}
        rows: dict[bytes, np.ndarray] = {}
        for step, placement in enumerate(served):
            row = placement.phy2log[layer]
            key = row.tobytes()
            rows.setdefault(key, row)
            groups.setdefault((key, bool(split[step, layer])), []).append(step)
        for (key, on), members in groups.items():
            at = np.asarray(members)
            times[at, layer], comm[at, layer], balance[at, layer] = cost.served_times_s(
                np.broadcast_to(rows[key], (at.size, rows[key].size)), counts[at, layer], on)
    return times.sum(axis=1), comm.sum(axis=1), balance.mean(axis=1)


def _walk_charge(cost: ReplayCost, copies: list, in_use: Placement, step_counts: np.ndarray,
                 layers: int) -> tuple[float, np.ndarray]:
    """What serving pays for a layer walk's copies and the steps each layer takes (at least one).

    The walk moves one layer at a time, so each layer's copies are priced on their own
    (`ReplayCost.charge` of that layer's copies: under `async`, the delay beside dispatch/combine)."""
    layer_steps = np.ones(layers, dtype=np.int64)
    charged = 0.0
    by_layer: dict[int, list] = {}
    for c in copies:
        by_layer.setdefault(c.layer, []).append(c)
    for layer, group in by_layer.items():
        charge = cost.charge(group, in_use, step_counts)
        charged += charge.charged_s
        layer_steps[layer] = max(1, charge.steps)
    return charged, layer_steps


def hindsight_next_reference(counts: np.ndarray, cost: ReplayCost, initial: Placement, every: int,
                             first: int | None = None, num_groups: int | None = None) -> ReplayResult:
    """Reference (not reachable): from `initial`, after the first `first` steps (default `every`) and then
    every `every` steps, DeepSeek EPLB's plan for the mean of the *next* `every` steps, switched with free
    migration: a rule at that cadence that knew the coming load exactly and paid nothing to move."""
    counts = check_counts_3d(counts)
    if every < 1:
        raise InputError("every", "an integer >= 1 steps", every)
    steps, first = counts.shape[0], every if first is None else max(1, first)

    def plans():
        yield initial, range(0, min(first, steps))
        for start in range(first, steps, every):
            block = range(start, min(start + every, steps))
            rows = eplb_rebalance(counts[block.start:block.stop].mean(axis=0), initial.num_physical,
                                  num_groups or 1, initial.num_nodes, initial.num_gpus)
            yield Placement(rows, initial.num_experts, initial.num_gpus, initial.num_nodes,
                            allow_colocated=True), block

    return _free_migration_run(f"hindsight-next-{every}", counts, cost, plans())


def _free_migration_run(name: str, counts: np.ndarray, cost: ReplayCost,
                        plans: Iterable[tuple[Placement, range]]) -> ReplayResult:
    """Each `(plan, steps)` of `plans` serves those steps of `counts`; switches cost nothing (steps no plan
    serves cost nothing either)."""
    steps = counts.shape[0]
    covered, served = [], []
    for plan, block in plans:
        covered += list(block)
        served += [plan] * len(block)
    expert_s, comm_s, balance = np.zeros(steps), np.zeros(steps), np.zeros(steps)
    if covered:
        at = np.asarray(covered)
        expert_s[at], comm_s[at], balance[at] = served_steps(cost, served, counts[at],
                                                             np.zeros((at.size, counts.shape[1]), dtype=bool))
    return ReplayResult(name, expert_s, balance, np.zeros(steps, dtype=np.int64), np.zeros(steps), (), 0, 0,
                        comm_time_s=comm_s)


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
