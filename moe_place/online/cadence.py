"""How often to rebalance: the cadence sweep behind `moe-place cadence`, best against best.

A rebalance cadence is a setting of the engine (vLLM `--eplb-config` `step_interval` and
`window_size`; SGLang `--eplb-rebalance-num-iterations`, whose recorder buffer is as long), and
it changes what any policy gets: a shorter interval plans on fresher load and moves more often.
So a policy is judged against the engine's default policy at the default's own best cadence, not
at one cadence both share. `sweep` replays a trace (`moe_place.online.replay.replay`) under the
engine's protocol (`EngineCadence.of`) for each interval, the window as long as the interval (the
engine's own window at its default interval), with the engine's default policy and with
moe-place's rule, and beside them a reference no policy reaches: plans made on the *next*
interval's load, switched for free (`hindsight_next_reference`). `CadenceSweep` says each
policy's best interval and total and the ratios; the lines that set a cadence in the engine are
where the engines live (`moe_place.engines.launch.engine_settings`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from moe_place.cost.cluster import ReplayCost
from moe_place.errors import InputError
from moe_place.online.controller import EngineCadence, make_controller
from moe_place.online.policy import RebalanceRule
from moe_place.online.policy_cpu import PolicyCpuPrice
from moe_place.online.replay import ReplayResult, check_counts_3d, hindsight_next_reference, replay
from moe_place.online.splitting import SplitChoice
from moe_place.placement import Placement

__all__ = ["CadenceRun", "CadenceSweep", "cadences", "sweep"]

DEFAULT_INTERVALS = (10, 20, 50, 100, 200, 500, 1000)   # besides the engine's own default
POLICIES = ("default", "moe-place")


@dataclass(frozen=True)
class CadenceRun:
    """One policy at one cadence: the replay's totals (seconds of the cost model; bytes between GPUs)."""

    policy: str
    step_interval: int
    window: int
    total_s: float
    expert_s: float
    migration_s: float
    policy_s: float
    policy_cpu_s: float
    bytes_moved: int
    calls: int
    slots_after_first: int   # slots changed by the calls after the first (a stationary load: none)
    split_layer_steps: int = 0   # layer-steps the per-batch split took
    split_cpu_s: float = 0.0     # CPU seconds of the split's per-layer choice (inside policy_cpu_s)
    comm_s: float = 0.0          # dispatch + combine (inside total_s)
    split_price_s: float = 0.0   # ... their committed price (inside a priced policy_s)

    @classmethod
    def of(cls, policy: str, cadence: EngineCadence, result: ReplayResult) -> "CadenceRun":
        calls = np.flatnonzero(result.called_at)
        later = result.slots_moved_at[calls[0] + 1:].sum() if calls.size else 0
        return cls(policy, cadence.step_interval, cadence.window_size, result.total_time_s, result.total_expert_time_s,
                   result.total_migration_time_s, result.total_policy_time_s, result.total_policy_cpu_s,
                   result.total_bytes_moved, int(calls.size), int(later), int(result.split_layers.sum()),
                   float(result.split_cpu_s.sum()), result.total_comm_time_s, float(result.split_price_s.sum()))


@dataclass(frozen=True)
class CadenceSweep:
    """Every run of a sweep, and what it says (module note).

    engine / use_async: the protocol. runs: `CadenceRun`s, both policies at every interval.
    hindsight: `{interval: total seconds}` of the reference at each interval.
    default_interval: the engine's own default interval (its row uses the engine's default window), 0 when
        the trace is too short for it.
    """

    engine: str
    use_async: bool
    runs: tuple[CadenceRun, ...]
    hindsight: dict = field(default_factory=dict)
    default_interval: int = 0

    def intervals(self) -> list[int]:
        return sorted({r.step_interval for r in self.runs})

    def run(self, policy: str, interval: int) -> CadenceRun:
        return next(r for r in self.runs if r.policy == policy and r.step_interval == interval)

    def best(self, policy: str) -> CadenceRun:
        """The policy's run with the least total time (the shorter interval on a tie)."""
        return min((r for r in self.runs if r.policy == policy), key=lambda r: (r.total_s, r.step_interval))

    @property
    def best_ratio(self) -> float:
        """moe-place at its best cadence over the default at its best: moe-place's own gain."""
        return self.best("moe-place").total_s / self.best("default").total_s

    def ratio_at(self, interval: int) -> float:
        return self.run("moe-place", interval).total_s / self.run("default", interval).total_s

    @property
    def worst_same_cadence_ratio(self) -> float:
        return max(self.ratio_at(i) for i in self.intervals())

    @property
    def hindsight_best(self) -> tuple[int, float]:
        """(interval, total seconds) of the best hindsight reference."""
        interval = min(self.hindsight, key=lambda i: (self.hindsight[i], i))
        return interval, self.hindsight[interval]

    @property
    def hindsight_ratio(self) -> float:
        """The best hindsight reference over the default at its best: what no policy can beat by much."""
        return self.hindsight_best[1] / self.best("default").total_s

    def to_json(self) -> dict:
        best_default, best_ours = self.best("default"), self.best("moe-place")
        return {"engine": self.engine, "use_async": self.use_async, "default_interval": self.default_interval,
                "runs": [r.__dict__ for r in self.runs],
                "hindsight": {str(k): v for k, v in sorted(self.hindsight.items())},
                "best": {"default": best_default.__dict__, "moe-place": best_ours.__dict__},
                "best_ratio": self.best_ratio, "worst_same_cadence_ratio": self.worst_same_cadence_ratio,
                "ratio_at": {str(i): self.ratio_at(i) for i in self.intervals()},
                "hindsight_best": list(self.hindsight_best) if self.hindsight else None,
                "hindsight_ratio": self.hindsight_ratio if self.hindsight else None}


def cadences(engine: str, intervals: tuple[int, ...] = DEFAULT_INTERVALS, use_async: bool = True,
             steps: int | None = None) -> list[EngineCadence]:
    """The engine's protocol at each interval (window = interval) and at its own default, shortest first;
    intervals whose first call would not fall within `steps` are left out."""
    default = EngineCadence.of(engine, use_async=use_async)
    out = {i: EngineCadence.of(engine, i, i, use_async=use_async) for i in intervals if i < default.step_interval}
    out[default.step_interval] = default
    return [c for _, c in sorted(out.items()) if steps is None or c.first_call <= steps]


def sweep(counts: np.ndarray, cost_of: Callable[[EngineCadence], ReplayCost], start: Placement, engine: str,
          intervals: tuple[int, ...] = DEFAULT_INTERVALS, use_async: bool = True, num_groups: int | None = None,
          rule_of: Callable[[ReplayCost], RebalanceRule] | None = None, hindsight: bool = True,
          default_plan: Callable | None = None, on_run: Callable[[str], None] | None = None,
          on_step: Callable[[int], None] | None = None, split: bool = False,
          price: PolicyCpuPrice | None = None) -> CadenceSweep:
    """Both policies and the hindsight reference at each cadence (module note).

    counts: `[steps, layers, E]`. cost_of: the cost model for a cadence (its migration model).
    start: the engine's start map. rule_of: moe-place's rule for a cost (default: `RebalanceRule`'s
    defaults). default_plan: the default policy itself (`EngineDefaultController.plan`; None: the numpy
    port, which costs less CPU time than the engines' own code). on_run: called with a label before each
    replay; on_step: with each replayed step. split: moe-place's rule runs with the per-batch split where it
    pays (`SplitChoice` on the cadence's cost, whose `replica_choice` is what the default runs with).
    price: where the engine waits for the policy, each call is paid at this price (the engine's own default code
    and the rule as the committed records measured them, `moe_place.online.policy_cpu`), so that the sweep's
    verdict repeats; None: at the CPU time each call measured.
    """
    counts = check_counts_3d(counts)
    steps, layers, experts = counts.shape
    plan = cadences(engine, intervals, use_async, steps)
    if not plan:
        raise InputError("trace", f"a trace long enough for one policy call ({engine} calls first after "
                                  f"{EngineCadence.of(engine, min(intervals)).first_call} steps)", f"{steps} steps")
    rule_of = rule_of or (lambda cost: RebalanceRule(cost, layers, experts, num_groups=num_groups))
    runs, references = [], {}
    for cadence in plan:
        cost = cost_of(cadence)
        for policy in POLICIES:
            if on_run is not None:
                on_run(f"{policy} every {cadence.step_interval}")
            kind = "engine-default" if policy == "default" else "ours"
            rule = rule_of(cost)
            if split and policy != "default":
                rule = replace(rule, split=SplitChoice(cost))
            controller = make_controller(kind, cadence, layers, experts, rule=rule, num_groups=num_groups,
                                         default_plan=default_plan)
            paid = None if price is None else price.call_s(policy, layers, experts, start.num_physical,
                                                           cadence.window_size)
            result = replay(counts, controller, cost, start, on_step=on_step, layer_per_step=cadence.layer_per_step,
                            policy_in_worker=cadence.policy_in_worker, policy_price_s=paid)
            runs.append(CadenceRun.of(policy, cadence, result))
        if hindsight:
            if on_run is not None:
                on_run(f"hindsight every {cadence.step_interval}")
            reference = hindsight_next_reference(counts, cost, start, cadence.step_interval, cadence.first_call,
                                                 num_groups)
            references[cadence.step_interval] = reference.total_time_s
    default = EngineCadence.of(engine, use_async=use_async).step_interval
    return CadenceSweep(engine, use_async, tuple(runs), references, default if plan[-1].step_interval == default else 0)
