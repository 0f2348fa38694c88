"""Online controllers: when to re-plan, and what to move.

Every controller sees the per-step counts `[layers, E]` as the engine records them (`observe`)
and, after each step, may return a `Decision` (a new map) for the map the engine will run
(`decide`). The replay (or an engine hook) pays for the copies and switches maps through
`MapSwitch`, so a controller never has to worry about in-flight batches.

- `StaticController`: never moves (the map planned once, offline).
- `PeriodicEplbController`: vLLM's cadence (window 1000 steps, a rebalance every `step_interval`
  = 3000 steps, the first after a quarter interval) with a full DeepSeek EPLB re-plan that
  ignores the map in use, so it pays for every slot it changes.
- `PaybackController` ("ours"): every `check_every` steps it predicts the coming load and asks the
  solver for migration-aware plans (unchanged experts keep their slots) under each move budget of
  `move_budgets` (slot changes per layer; by default only `max_moved_slots`). Per
  layer it keeps the budget whose net gain over the expected remaining life `L` of the current hot
  spots (measured persistence) is largest, `dt * L - T_copy`, among those that pay back (formula 7: `N_min = floor(T_copy/dt) + 1` batches) within `L / hysteresis` (> 1 keeps it from
  flapping); with several budgets the move count of a rebalance follows the payback rule.
  Layers go best gain/cost first, within `max_bytes` per rebalance. Copies come from the cheapest
  replica (same GPU, same node, then across nodes), so moves that stay inside a node pay back
  sooner and win the per-layer choice when they give a similar saving.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from moe_place.cost.payback import n_min
from moe_place.eplb import plan_placement
from moe_place.errors import InputError
from moe_place.online.costing import ReplayCost
from moe_place.online.window import HotSpotTracker, Predictor, SlidingWindow
from moe_place.placement import Placement
from moe_place.solvers.deepseek import eplb_rebalance

CONTROLLERS = ("static", "periodic-eplb", "ours")


@dataclass(frozen=True)
class Decision:
    """A new map and why.

    placement: the full new map (valid; layers not in `layers` are unchanged).
    layers: the layers whose row changes.
    predicted_saving_s: expected expert time saved per step (prediction, new vs current map).
    expected_steps: how many steps the saving is expected to last.
    copy_time_s: predicted time of the copies.
    """

    placement: Placement
    layers: tuple[int, ...]
    predicted_saving_s: float = 0.0
    expected_steps: float = 0.0
    copy_time_s: float = 0.0


class Controller(Protocol):
    name: str

    def observe(self, step: int, counts: np.ndarray) -> None:
        """Record the counts `[layers, E]` of batch `step`."""

    def decide(self, step: int, current: Placement) -> Decision | None:
        """After batch `step`: a new map to switch to from `current`, or None."""


@dataclass
class StaticController:
    name: str = "static"

    def observe(self, step: int, counts: np.ndarray) -> None:
        return None

    def decide(self, step: int, current: Placement) -> Decision | None:
        return None


@dataclass
class PeriodicEplbController:
    """vLLM's default EPLB cadence with DeepSeek's EPLB (`moe_place.solvers.deepseek`)."""

    num_layers: int
    num_experts: int
    window_size: int = 1000
    step_interval: int = 3000
    num_groups: int = 1
    name: str = "periodic-eplb"
    _window: SlidingWindow = field(init=False, repr=False)
    _progress: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.step_interval < 1:
            raise InputError("step_interval", "an integer >= 1", self.step_interval)
        self._window = SlidingWindow(self.window_size, self.num_layers, self.num_experts)
        self._progress = self.step_interval - self.step_interval // 4  # first rebalance after a quarter

    def observe(self, step: int, counts: np.ndarray) -> None:
        self._window.push(counts)
        self._progress += 1

    def decide(self, step: int, current: Placement) -> Decision | None:
        if self._progress < self.step_interval:
            return None
        self._progress = 0
        phy2log = eplb_rebalance(self._window.total(), current.num_physical, self.num_groups,
                                 current.num_nodes, current.num_gpus)
        new = Placement(np.asarray(phy2log), current.num_experts, current.num_gpus, current.num_nodes,
                        allow_colocated=True)
        return Decision(new, tuple(range(current.num_layers)))


@dataclass
class PaybackController:
    """Re-plan only what pays back (see the module note).

    check_every: steps between checks. predictor / tracker: load prediction and hot-spot persistence.
    hysteresis: a layer's copies must pay back within `expected life / hysteresis` steps.
    min_relative_saving: ignore layers whose predicted saving is below this share of their time.
    max_moved_slots: slot changes per layer and rebalance at most (the solver's migration cap).
    move_budgets: the caps tried at each check (None: `max_moved_slots` only); each layer takes the
        one with the largest predicted net gain that pays back. On the bench traces (1, 2) did worse
        than (2,) (EP32 seed 0: 0.854 vs 0.839 of the better baseline): the greedy's first move alone
        often wins on predicted net gain but leaves the layer to drift further.
    max_bytes: bytes copied per rebalance at most (None: no cap); layers are taken best first.
    move_cost_share: the solver charges each moved slot this share of the mean GPU load.
    cooldown_steps: steps after a rebalance before the next one may be decided.
    num_groups / solver: passed to the planner (`moe_place.eplb.plan_placement`).
    """

    cost: ReplayCost
    num_layers: int
    num_experts: int
    check_every: int = 16
    predictor: Predictor = field(default_factory=Predictor)
    tracker: HotSpotTracker = field(default_factory=HotSpotTracker)
    hysteresis: float = 1.0
    min_relative_saving: float = 0.005
    max_moved_slots: int = 2
    move_budgets: tuple[int, ...] | None = None
    max_bytes: int | None = None
    move_cost_share: float = 0.0
    cooldown_steps: int = 0
    num_groups: int | None = None
    solver: str = "fast"
    name: str = "ours"
    _window: SlidingWindow = field(init=False, repr=False)
    _last_switch: int = field(default=-(10 ** 9), init=False, repr=False)

    def __post_init__(self) -> None:
        if self.check_every < 1:
            raise InputError("check_every", "an integer >= 1", self.check_every)
        if self.move_cost_share < 0:
            raise InputError("move_cost_share", "a number >= 0", self.move_cost_share)
        if self.hysteresis < 0:
            raise InputError("hysteresis", "a number >= 0", self.hysteresis)
        if self.max_moved_slots < 0:
            raise InputError("max_moved_slots", "an integer >= 0", self.max_moved_slots)
        if self.move_budgets is None:
            self.move_budgets = (self.max_moved_slots,)
        self.move_budgets = tuple(sorted({int(b) for b in self.move_budgets}))
        if not self.move_budgets or min(self.move_budgets) < 0 or max(self.move_budgets) > self.max_moved_slots:
            raise InputError("move_budgets", f"integers in [0, max_moved_slots={self.max_moved_slots}]",
                             self.move_budgets)
        need = self.predictor.horizon * (self.predictor.num_scenarios if self.predictor.kind == "scenarios" else 1)
        self._window = SlidingWindow(max(need, self.predictor.horizon), self.num_layers, self.num_experts)
        self.tracker.interval_steps = self.check_every

    def observe(self, step: int, counts: np.ndarray) -> None:
        self._window.push(counts)
        self.predictor.observe(counts)

    def decide(self, step: int, current: Placement) -> Decision | None:
        if (step + 1) % self.check_every or self._window.num_steps < self.predictor.horizon:
            return None
        recent = self._window.last(self.predictor.horizon).mean(axis=0)
        self.tracker.update(step, recent)
        if step - self._last_switch < self.cooldown_steps:
            return None
        predicted = self.predictor.predict(self._window)          # [K, layers, E] per step
        expected_load = predicted.mean(axis=0)
        current_s = self.cost.layer_times_s(current, expected_load)
        # a moved slot must lower the busiest GPU by more than this share of the mean GPU load
        move_cost = self.move_cost_share * float(expected_load.sum(axis=-1).mean()) / current.num_gpus
        candidates = [plan_placement(predicted, current.num_physical, self.num_groups, current.num_nodes,
                                     current.num_gpus, solver=self.solver, current=current, max_moved_slots=budget,
                                     move_cost_weight=move_cost)
                      for budget in self.move_budgets if budget > 0]
        if not candidates:
            return None
        savings = [current_s - self.cost.layer_times_s(c, expected_load) for c in candidates]
        excess = np.clip(recent - self.tracker.hot_factor * recent.mean(axis=-1, keepdims=True), 0, None)
        duration = self.tracker.expected_duration_steps(excess)
        chosen = self._choose_layers(current, candidates, savings, current_s, duration, expected_load)
        if not chosen:
            return None
        rows = np.array(current.phy2log)
        for layer, which in chosen.items():
            rows[layer] = candidates[which].phy2log[layer]
        new = Placement(rows, current.num_experts, current.num_gpus, current.num_nodes,
                        allow_colocated=current.allow_colocated)
        layers = sorted(chosen)
        copies = self.cost.copies(current, new, np.array(layers))
        self._last_switch = step
        saving = sum(float(savings[which][layer]) for layer, which in chosen.items())
        charged = self.cost.charge(copies, current, expected_load).charged_s
        return Decision(new, tuple(layers), saving, duration, charged)

    def _choose_layers(self, current: Placement, candidates: list[Placement], savings: list[np.ndarray],
                       current_s: np.ndarray, duration: float, expected_load: np.ndarray) -> dict[int, int]:
        """`{layer: candidate index}`: per layer the candidate (move budget) with the largest net gain
        `saving x (duration - copy steps) - charged copy time` among those that pay back what serving
        pays for their copies (N_min, on the cost model's migration: stall or async) within
        `(duration - copy steps) / hysteresis` steps, the saving starting once asynchronous copies
        are done; layers taken best gain/cost first, within the byte cap."""
        scored = []
        for layer in range(current.num_layers):
            best = None
            for which, (candidate, saving_s) in enumerate(zip(candidates, savings)):
                saving = float(saving_s[layer])
                if saving <= self.min_relative_saving * current_s[layer]:
                    continue
                copies = self.cost.copies(current, candidate, np.array([layer]))
                if not copies:
                    continue
                charge = self.cost.charge(copies, current, expected_load)
                copy_s, life = charge.charged_s, duration - charge.steps
                pays_back_after = n_min(copy_s, saving)  # batches (formula 7)
                if pays_back_after is None or self.hysteresis * pays_back_after > life:
                    continue
                net = saving * life - copy_s
                if best is None or net > best[0]:
                    best = (net, saving * life / max(copy_s, 1e-12), which, len(copies) * self.cost.expert_bytes)
            if best is not None:
                scored.append((best[1], layer, best[2], best[3]))
        chosen, spent = {}, 0
        for _, layer, which, num_bytes in sorted(scored, reverse=True):
            if self.max_bytes is not None and spent + num_bytes > self.max_bytes:
                continue
            chosen[layer] = which
            spent += num_bytes
        return chosen


def make_controller(kind: str, cost: ReplayCost, num_layers: int, num_experts: int, **options) -> Controller:
    """A controller by name (`static`, `periodic-eplb`, `ours`) with its options."""
    if kind == "static":
        return StaticController()
    if kind == "periodic-eplb":
        return PeriodicEplbController(num_layers, num_experts, **options)
    if kind == "ours":
        return PaybackController(cost, num_layers, num_experts, **options)
    raise InputError("--controller", f"one of {', '.join(CONTROLLERS)}", kind)


@dataclass
class EngineRebalancer:
    """The payback controller behind an engine's rebalance call, with its state kept between calls.

    An engine (vLLM's EPLB policy, SGLang's rebalance) calls `rebalance` every `step_interval`
    steps with the load window it recorded and the map it runs; the answer is the map to run
    next: `PaybackController.decide`'s map when its move pays back, else `current` unchanged.
    `controller.check_every` is the engine's `step_interval` (one check per call).

    controller: the decision (`replay --controller ours` makes the same one on the same history).
    step_interval: engine steps between two calls (vLLM's default 3000; SGLang's
        `--eplb-rebalance-num-iterations`, default 1000).
    """

    controller: PaybackController
    step_interval: int = 3000
    _step: int = field(default=-1, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.step_interval < 1:
            raise InputError("step_interval", "an integer >= 1 steps", self.step_interval)
        self.controller.check_every = 1
        self.controller.tracker.interval_steps = self.step_interval

    def rebalance(self, window: np.ndarray, current: Placement, window_steps: int | None = None) -> Decision | None:
        """The decision for `current` after the engine recorded `window`.

        window: float `[samples, layers, E]` per-step loads, oldest first (vLLM's load window,
            SGLang's per-pass logical counts), or `[layers, E]` loads summed over `window_steps`
            steps (vLLM's older policy interface), taken as that many steps of their mean.
        Returns None when nothing pays back (the engine keeps `current`).
        """
        loads = np.asarray(window, dtype=np.float64)
        if loads.ndim == 2:
            steps = 1 if window_steps is None else int(window_steps)
            if steps < 1:
                raise InputError("window_steps", "an integer >= 1 steps", window_steps)
            # the predictor and tracker look at the last `horizon` steps: that many of the mean
            loads = np.broadcast_to(loads / steps, (min(steps, self.controller.predictor.horizon),) + loads.shape)
        if loads.ndim != 3 or loads.shape[1:] != (current.num_layers, current.num_experts):
            raise InputError("load window", f"[samples, {current.num_layers}, {current.num_experts}]",
                             list(loads.shape))
        self._step += self.step_interval
        first = self._step - len(loads) + 1
        for i, counts in enumerate(loads):
            self.controller.observe(first + i, counts)
        return self.controller.decide(self._step, current)
