"""The rebalance rule: what to move when an engine asks, and when moving is worth it.

An engine asks its policy for a map once per interval and runs the answer until it asks again:
vLLM every `step_interval` steps (3000) with the load of the last `window_size` steps (1000)
summed, SGLang every `--eplb-rebalance-num-iterations` passes (1000) with as many per-pass
counts. `RebalanceRule.decide` answers one such call; docs/MODEL.md ("The rebalance rule")
states the rule and what it assumes. Per layer:

1. Predict. The load of the coming steps, `lam` (per step), is estimated from every window the
   engine has handed over (`moe_place.online.estimate.LoadEstimate`): exponentially weighted means
   of the steps seen so far, with the half-life that has predicted each next window best (scored
   at every call, the flat window, the engines' own estimate, among the candidates): long on a
   stationary load, a few steps on a fast drift, reset at a sudden change. `estimate="window"`
   keeps the window's mean, as the engines' default policies do.
2. Plan. DeepSeek EPLB's greedy plan for `lam` (what the engines' default policies compute;
   hierarchical, every expert group and its replicas inside one node, when the groups are a
   multiple of the nodes), with its GPUs and slots matched to the map in use
   (`placement.align_slots`), so that every expert that can stay where it is stays and only what
   must move is copied. Why not our tighter plans (`solve(..., "quick")`, `fast`): they fit the
   window better but did not carry over better to the steps after it on the replay's drifting
   traces (docs/MODEL.md, "The rebalance rule"), and they cost more time per call.
3. Is the gain real? A plan fitted to a window looks better on that window than any map made
   before it even when nothing changed: it fits the window's sampling noise. Where the layer's load
   is the same as at the last call up to noise (the windows' total-variation distance within three
   noise widths, or 2%), the rule measures that noise floor: plans made for resampled windows
   (`NOISE_REPLICATES` draws that differ from the window as much as two independent windows of the
   same load would: a multinomial draw of its total, or a bootstrap of its steps when the engine
   hands per-step counts, the deviation scaled by sqrt(2)), and the plan of the last call's window
   (an independent sample of the same load, noisier than a multinomial draw where the engine's
   batches are), each judged on the real window, fall behind the fresh plan by what noise alone
   gives. Such a layer moves only when the map in use
   falls behind the fresh plan by more than `noise_margin` times the worst of them plus `min_gain`
   (shares of the mean GPU load); a layer whose load changed needs only `min_gain`.
4. Does it pay back? Its saving `dt` per step (the cost model's busiest-GPU time, formula 11,
   on `lam`) accrues until the load pattern changes. The rule believes the saving lasts
   `H = max(interval, age, interval / (1 - retention))` more steps: at least until the next call,
   since the map cannot change before it; as long again as the layer's load has already lasted
   (`age`: how long it has stayed the same up to noise, measured from call to call); and, on a
   load that drifts (never the same twice, yet its hot experts stay hot a while), the life of a
   saving that keeps `retention` of itself from one interval to the next (a geometric series),
   where `retention` is measured, not assumed: the gain the last calls' plans realised on the
   window that came after them over the gain they showed on their own window, pooled over the
   layers that had a gap and the last `RETENTION_CALLS` calls (0 before any, clipped to [0, 1)).
   H is capped at `MAX_HORIZON_INTERVALS` intervals. The move is taken when it pays back
   within that horizon, `dt * (H - copy steps) > charge` (formula 7, with the engine's migration
   model: `stall` pays the copy time, `async` the delay the copies cause beside dispatch/combine),
   and taken whole: no cap on moved slots, unless the engine states one (`max_moved_slots`, or
   `max_bytes` for its move buffer, layers best net gain first).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cache
from typing import Callable

import numpy as np

from moe_place.cost.cluster import ReplayCost, cluster_cost
from moe_place.cost.payback import n_min
from moe_place.errors import InputError
from moe_place.online.estimate import Draw, EstimateState, LoadEstimate, step_sums
from moe_place.online.splitting import SplitChoice, SplitState
from moe_place.placement import Placement, align_slots, even_split_gpu_loads
from moe_place.solvers.deepseek import eplb_rebalance, plans_hierarchically

__all__ = ["Decision", "LayerVerdict", "RebalanceRule", "RuleAnswer", "RuleState", "warm_up"]

SAME_PATTERN_NOISE = 3.0     # two windows show one pattern when they differ by at most this many noise widths
SAME_PATTERN_FLOOR = 0.02    # ... or by at most this total-variation distance, whatever the noise
MAX_HORIZON_INTERVALS = 100  # the believed life of a pattern is capped at this many intervals
NOISE_CHECK_BELOW = 0.05     # a layer further behind than this share of the mean GPU load is not noise
NOISE_REPLICATES = 2         # resampled windows per call (besides the last call's); the floor is the worst
RETENTION_CALLS = 4          # the retention of a saving is pooled over this many past calls
ESTIMATES = ("adaptive", "window")   # step 1: the load estimate


@dataclass(frozen=True)
class Decision:
    """A new map and why.

    placement: the full new map (valid; layers not in `layers` are unchanged).
    layers: the layers whose row changes.
    predicted_saving_s: expected expert time saved per step (prediction, new vs current map).
    expected_steps: how many steps the saving is expected to last (the horizon).
    copy_time_s: what serving is predicted to pay for the copies.
    """

    placement: Placement
    layers: tuple[int, ...]
    predicted_saving_s: float = 0.0
    expected_steps: float = 0.0
    copy_time_s: float = 0.0


@dataclass(frozen=True)
class LayerVerdict:
    """Why one layer moved or not at one call (`RuleAnswer.verdicts`).

    deficit: how far the map in use is behind the fresh plan (share of the mean GPU load).
    noise_floor: what a plan fitted to a resampled window is behind it (same unit; 0 if not measured).
    saving_s / charge_s: predicted expert time saved per step and what serving pays for the copies.
    horizon_steps: the steps the saving is believed to last. moved_slots: slots the move changes (0 where
        the layer is balanced or noise explains its gap: such a move is not matched to the map or priced).
    moved: whether the layer moves. reason: one word, "moves", "balanced", "noise", "no-time",
        "no-payback", "cap".
    """

    layer: int
    deficit: float
    noise_floor: float
    saving_s: float
    charge_s: float
    horizon_steps: float
    moved_slots: int
    moved: bool
    reason: str


@dataclass(frozen=True)
class RuleState:
    """What the rule carries from one call to the next; `RebalanceRule.decide` reads one and returns the
    next, and never writes into the one it read (an engine may plan twice from one state, vLLM's context
    interface does until a plan is committed).

    calls: calls answered so far (the resampling's seed takes it).
    age: float64 `[L]`, steps each layer's load pattern has lasted (step 4).
    share / total: the last window's load shares `[L, E]` and counts `[L, 1]` (the next call's
        same-pattern test), None before the first call.
    planned / rows / gap: the last call's fresh plan `[L, P]`, the map then in use `[L, P]` and how far
        behind the plan it was `[L]` (the next call measures the retention on them), None before.
    kept: `(realised, shown)` gain of each of the last `RETENTION_CALLS` calls that had a gap (step 4).
    floors: float64 `[L, RETENTION_CALLS]`, the noise floors measured last per layer (nan: none yet).
    estimate: the load estimate's state (`moe_place.online.estimate.EstimateState`).
    split: the per-batch split's per-layer choice (`moe_place.online.splitting.SplitState`; None: split off or
        no call yet).
    """

    calls: int
    age: np.ndarray
    share: np.ndarray | None
    total: np.ndarray | None
    planned: np.ndarray | None
    rows: np.ndarray | None
    gap: np.ndarray | None
    kept: tuple[tuple[float, float], ...]
    floors: np.ndarray
    estimate: EstimateState
    split: SplitState | None = None


@dataclass(frozen=True)
class RuleAnswer:
    """One call's answer: the new map (`decision`; None keeps the map in use), the state the next call
    reads, each layer's verdict, the retention step 4 used, and with the per-batch split the layers it takes
    (bool `[L]`; None: split off), its choice's CPU seconds (part of the call's) and their committed price
    (`SplitState.price_s`)."""

    decision: Decision | None
    state: RuleState
    verdicts: tuple[LayerVerdict, ...]
    retention: float
    split_layers: np.ndarray | None = None
    split_cpu_s: float = 0.0
    split_price_s: float = 0.0


@dataclass(frozen=True)
class _Window:
    """One call's window: `loads` as float (per-step float32 `[n, L, E]` or summed float64 `[L, E]`), its
    counts summed `[L, E]` (float64) and the steps they cover."""

    loads: np.ndarray
    total: np.ndarray
    steps: int


@dataclass(frozen=True)
class RebalanceRule:
    """The rule of the module note: settings and the cluster it prices on; the state between calls is a
    `RuleState` (`create_state`), handed in and returned by `decide`.

    cost: the cluster and model (expert time, copies, migration model).
    num_groups: expert groups (hierarchical planning when a multiple of the cluster's nodes).
    min_gain: a layer moves only when its busiest GPU drops by more than this share of the mean.
    noise_margin: ... and by more than this many times the measured noise floor.
    max_moved_slots / max_bytes: caps an engine states (None: none).
    seed: the resampling's seed (same inputs and seed, same decisions).
    estimate: "adaptive" (step 1) or "window" (the window's mean per step).
    split: the per-batch split's per-layer choice (`moe_place.online.splitting.SplitChoice`), made at each
        call on the map the engine will run next (None: split off).
    """

    cost: ReplayCost
    num_layers: int
    num_experts: int
    num_groups: int | None = None
    min_gain: float = 0.005
    noise_margin: float = 2.0
    max_moved_slots: int | None = None
    max_bytes: int | None = None
    seed: int = 0
    estimate: str = "adaptive"
    split: SplitChoice | None = None

    def __post_init__(self) -> None:
        for name in ("min_gain", "noise_margin"):
            value = getattr(self, name)
            if not np.isfinite(value) or value < 0:
                raise InputError(name, "a finite number >= 0", value)
        if self.max_moved_slots is not None and self.max_moved_slots < 0:
            raise InputError("max_moved_slots", "an integer >= 0 (or none)", self.max_moved_slots)
        if self.max_bytes is not None and self.max_bytes < 0:
            raise InputError("max_bytes", "an integer >= 0 (or none)", self.max_bytes)
        if self.estimate not in ESTIMATES:
            raise InputError("estimate", f"one of {', '.join(ESTIMATES)}", self.estimate)
        if self._hierarchical and self.num_experts % self.num_groups:
            raise InputError("num_groups", f"a divisor of the {self.num_experts} experts", self.num_groups)

    @property
    def load_estimate(self) -> LoadEstimate:
        return LoadEstimate(self.num_layers, self.num_experts, adaptive=self.estimate == "adaptive")

    def create_state(self) -> RuleState:
        """The state before the first call: every layer's load new, nothing measured."""
        layers = self.num_layers
        return RuleState(0, np.zeros(layers), None, None, None, None, None, (),
                         np.full((layers, RETENTION_CALLS), np.nan), self.load_estimate.create_state())

    # ------------------------------------------------------------------ one engine call
    def decide(self, state: RuleState, window: np.ndarray, current: Placement, interval_steps: int,
               window_steps: int | None = None, step: int | None = None) -> RuleAnswer:
        """The answer to one engine call, from `state` (the last call's `RuleAnswer.state`, or `create_state()`).

        window: the engine's load window, float `[samples, layers, E]` per-step counts (SGLang's
            per-pass counts, vLLM's per-step window) or `[layers, E]` counts summed over
            `window_steps` steps (vLLM 0.33's policy argument).
        current: the map in use. interval_steps: steps until the engine asks again (the least life of a
            move's saving). step: the engine's step count at the call (the split choice's clock; None: each
            call decides every layer afresh).
        """
        seen = self._read_window(window, current, window_steps)
        if interval_steps < 1:
            raise InputError("interval_steps", "an integer >= 1", interval_steps)
        age, changed, share, total = self._pattern(state, seen, interval_steps)
        # step 1; layers whose load changed beyond noise start their estimate again from this window
        lam, estimate, draw = self.load_estimate.update(state.estimate, seen.loads, seen.steps, interval_steps,
                                                        reset=changed, total=seen.total)   # per step
        gpus = current.num_gpus
        mean = np.maximum(lam.sum(axis=1) / gpus, 1e-12)
        cur_busy = even_split_gpu_loads(current.phy2log, lam, gpus).max(axis=1)
        retention, kept = self._retention(state, lam, mean, gpus)
        planned, new_busy = self._plan_where_it_could_gain(lam, current, cur_busy, mean)   # step 2
        deficit = (cur_busy - new_busy) / mean
        open_layers = np.flatnonzero(deficit > self.min_gain)
        floor, floors = self._noise_floor(state, changed, open_layers, deficit, draw, lam, new_busy, mean, gpus,
                                          current.num_physical)   # step 3
        horizon = self._horizon(age, retention, interval_steps)
        explained = deficit <= self.noise_margin * floor + self.min_gain   # noise explains the gap (step 3)
        priced = open_layers[~explained[open_layers]]
        fresh, moved, copy_s = self._match_and_copy(current, planned, priced)   # step 4's copies
        cur_s, new_s = self._layer_times(current, fresh, planned, lam, open_layers, priced)
        step_parts = self._step_times(current, lam)
        verdicts = [self._judge(layer, int(moved[layer]), float(copy_s[layer]), step_parts, float(deficit[layer]),
                                float(floor[layer]), bool(explained[layer]), float(cur_s[layer] - new_s[layer]),
                                float(horizon[layer]))
                    for layer in range(self.num_layers)]
        chosen = self._within_bytes([v for v in verdicts if v.moved], verdicts)
        decision = self._decision(chosen, current, fresh, priced)
        split, split_s = state.split, 0.0
        if self.split is not None:   # on the map the engine runs next
            started = time.thread_time()
            split = self.split.decide(state.split, window, seen.steps, current if decision is None else
                                      decision.placement, step, interval_steps, seen.total)
            split_s = time.thread_time() - started
        new_state = RuleState(state.calls + 1, age, share, total, planned, current.phy2log, deficit, kept, floors,
                              estimate, split)
        return RuleAnswer(decision, new_state, tuple(verdicts), retention, None if split is None else split.on,
                          split_s, 0.0 if split is None else split.price_s)

    # ------------------------------------------------------------------ the steps
    def _read_window(self, window: np.ndarray, current: Placement, window_steps: int | None) -> _Window:
        """The window checked and converted once (for the checks, the sums and the estimate)."""
        loads = np.asarray(window)
        shape = (current.num_layers, current.num_experts)
        if loads.shape[-2:] != shape or loads.ndim not in (2, 3) or 0 in loads.shape:
            raise InputError("load window", f"[samples, {shape[0]}, {shape[1]}] or [{shape[0]}, {shape[1]}]",
                             list(loads.shape))
        if (current.num_layers, current.num_experts) != (self.num_layers, self.num_experts):
            raise InputError("current map", f"{self.num_layers} layers x {self.num_experts} experts",
                             f"{current.num_layers} x {current.num_experts}")
        # per-step counts to float32 (exact for counts up to 2**24 a step, half float64's memory on a window
        # of a thousand steps)
        counts = loads.dtype.kind in "iub"
        if counts and loads.min() < 0:
            raise InputError("load window", "finite counts >= 0", "a negative count")
        loads = loads.astype(np.float64 if loads.ndim == 2 else np.float32, copy=False)
        if not counts and not (loads.min() >= 0 and np.isfinite(loads.max())):   # NaN fails the first, inf the second
            raise InputError("load window", "finite counts >= 0", "NaN, inf or a negative count")
        if loads.ndim == 3:   # per-step counts as the engine hands them
            steps = len(loads) if window_steps is None else int(window_steps)
            total = step_sums(loads)
        else:
            steps = 1 if window_steps is None else int(window_steps)
            total = loads
        if steps < 1:
            raise InputError("window_steps", "an integer >= 1", window_steps)
        return _Window(loads, total, steps)

    def _pattern(self, state: RuleState, seen: _Window,
                 interval_steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(each layer's pattern age, whether its load changed, the window's shares and counts per layer):
        the age grows by the interval while two calls' windows agree up to noise (total variation within
        `SAME_PATTERN_NOISE` widths, or `SAME_PATTERN_FLOOR`), else restarts at the window's length (the new
        pattern is as old as what shows it)."""
        sums = np.maximum(seen.total.sum(axis=1, keepdims=True), 1e-12)
        share = seen.total / sums
        if state.share is None:
            same = np.zeros(self.num_layers, dtype=bool)
        else:
            tv = 0.5 * np.abs(share - state.share).sum(axis=1)
            width = 0.5 * np.sqrt(2 / np.pi) * np.sqrt(share * (1 / sums + 1 / state.total)).sum(axis=1)
            same = tv <= np.maximum(SAME_PATTERN_NOISE * width, SAME_PATTERN_FLOOR)
        return np.where(same, state.age + interval_steps, float(seen.steps)), ~same, share, sums

    @property
    def _hierarchical(self) -> bool:
        return plans_hierarchically(self.num_groups, self.cost.topology.num_servers)

    def _plan(self, lam: np.ndarray, num_physical: int) -> np.ndarray:
        """int64 `[layers, P]`: DeepSeek EPLB's plan of every layer of `lam` (step 2), hierarchical when
        expert groups span nodes."""
        nodes = self.cost.topology.num_servers
        if self._hierarchical:
            return eplb_rebalance(lam, num_physical, self.num_groups, nodes, self.cost.num_gpus)
        return eplb_rebalance(lam, num_physical, 1, 1, self.cost.num_gpus)

    def _plan_where_it_could_gain(self, lam: np.ndarray, current: Placement, cur_busy: np.ndarray,
                                  mean: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Step 2 for the layers whose map could gain more than `min_gain` (no plan beats the mean): (the
        plans `[L, P]`, their busiest GPU's load `[L]`); the other layers keep their rows, as good as a plan."""
        need = np.flatnonzero((cur_busy - mean) / mean > self.min_gain)
        planned, new_busy = np.array(current.phy2log), cur_busy.copy()
        if need.size:
            planned[need] = self._plan(lam[need], current.num_physical)
            new_busy[need] = even_split_gpu_loads(planned[need], lam[need], current.num_gpus).max(axis=1)
        return planned, new_busy

    def _noise_floor(self, state: RuleState, changed: np.ndarray, open_layers: np.ndarray, deficit: np.ndarray,
                     draw: Draw, lam: np.ndarray, new_busy: np.ndarray, mean: np.ndarray, gpus: int,
                     num_physical: int) -> tuple[np.ndarray, np.ndarray]:
        """Step 3: (each layer's noise floor `[L]`, the floors kept for the next calls `[L, RETENTION_CALLS]`).

        Noise can only explain a gap where the load has not changed beyond noise since the last call (a
        changed load is a real gap), and not a gap this large; its floor: the plans of resampled estimates
        and of the last call's, judged on this estimate. A floor is one measurement of the noise: the worst
        of the pattern's last few stands for it."""
        floor = np.zeros(self.num_layers)
        near = open_layers[(deficit[open_layers] < NOISE_CHECK_BELOW) & ~changed[open_layers]]
        if near.size:
            rng = np.random.default_rng([self.seed, state.calls])
            replicas = self._plan(np.concatenate([draw.resample(near, rng) for _ in range(NOISE_REPLICATES)]),
                                  num_physical)
            plans = np.concatenate([replicas, state.planned[near]])
            busy = even_split_gpu_loads(plans, np.tile(lam[near], (NOISE_REPLICATES + 1, 1)), gpus).max(axis=1)
            behind = (busy.reshape(NOISE_REPLICATES + 1, -1) - new_busy[near]) / mean[near]
            floor[near] = np.maximum(behind.max(axis=0), 0.0)
        floors = state.floors.copy()
        floors[changed] = np.nan
        measured = np.zeros(self.num_layers, dtype=bool)
        measured[near] = True
        floors[measured] = np.column_stack([floors[measured, 1:], floor[measured]])
        checked = measured & ~np.isnan(floors).all(axis=1)   # only where noise could explain the gap
        floor[checked] = np.maximum(floor[checked], np.nanmax(floors[checked], axis=1))
        return floor, floors

    def _horizon(self, age: np.ndarray, retention: float, interval_steps: int) -> np.ndarray:
        """Step 4: the steps each layer's saving is believed to last `[L]`."""
        kept_for = interval_steps / (1.0 - retention)                               # geometric life of a saving
        return np.minimum(np.maximum(np.maximum(interval_steps, age), kept_for), MAX_HORIZON_INTERVALS * interval_steps)

    def _match_and_copy(self, current: Placement, planned: np.ndarray,
                        priced: np.ndarray) -> tuple[Placement, np.ndarray, np.ndarray]:
        """Step 4's copies: the layers noise cannot explain (`priced`) take their plan matched to the map in
        use (`align_slots`); (that map, slots each layer changes `[L]`, their copy seconds `[L]`). The other
        layers are held whatever they would copy."""
        moved, copy_s = np.zeros(self.num_layers, dtype=np.int64), np.zeros(self.num_layers)
        if not priced.size:
            return current, moved, copy_s
        gpus, servers = current.num_gpus, self.cost.topology.num_servers
        rows = np.array(current.phy2log)
        rows[priced] = align_slots(planned[priced], current.phy2log[priced], gpus, servers if self._hierarchical else 1)
        fresh = Placement(rows, current.num_experts, gpus, servers,
                          allow_colocated=True)   # EPLB's plans may co-locate replicas, as the engines' own do
        plan = self.cost.moves.copy_plan(current, fresh, priced)
        return fresh, np.bincount(plan.layer, minlength=self.num_layers), \
            self.cost.moves.copy_times_by_layer(plan, self.num_layers)

    def _layer_times(self, current: Placement, fresh: Placement, planned: np.ndarray, lam: np.ndarray,
                     open_layers: np.ndarray, priced: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The busiest GPU's seconds `[L]` of every layer on the map in use and on its plan, priced only where
        a layer could move (the others are balanced: 0 both); GPU loads do not depend on how its GPUs are
        numbered, so a plan not matched to the map is priced as planned."""
        if not open_layers.size:
            zeros = np.zeros(self.num_layers)
            return zeros, zeros
        new_rows = np.where(np.isin(open_layers, priced)[:, None], fresh.phy2log[open_layers], planned[open_layers])
        times = self.cost.rows_times_s(np.concatenate([current.phy2log, new_rows]),
                                       np.concatenate([lam, lam[open_layers]]), current.num_gpus)
        cur_s, new_s = times[:self.num_layers], times[:self.num_layers].copy()
        new_s[open_layers] = times[self.num_layers:]
        return cur_s, new_s

    def _step_times(self, current: Placement, lam: np.ndarray) -> Callable[[], tuple[float, float]]:
        """`step()`: a step's expert and dispatch/combine seconds on the map in use, every layer (what asynchronous
        copies run beside), worked out when the first layer is priced; a stalling engine's charge uses neither."""

        @cache
        def step() -> tuple[float, float]:
            if self.cost.moves.model != "async":
                return 0.0, 0.0
            expert, comm = self.cost.rows_parts_s(current.phy2log, lam, current.num_gpus)
            return float(expert.sum()), float(comm.sum())

        return step

    def _judge(self, layer: int, moved: int, copy_s: float, step: Callable[[], tuple[float, float]], deficit: float,
               floor: float, noise: bool, saving_s: float, horizon: float) -> LayerVerdict:
        """Steps 3-4 for one layer: its move changes `moved` slots whose copies take `copy_s`; `step()` gives a
        step's expert and dispatch/combine seconds on the map in use (what asynchronous copies run beside);
        `noise`: its gap is within `noise_margin` times its floor plus `min_gain` (step 3)."""

        def verdict(ok: bool, reason: str, charge: float = 0.0) -> LayerVerdict:
            return LayerVerdict(layer, deficit, floor, saving_s, charge, horizon, moved, ok, reason)

        if deficit <= self.min_gain:
            return verdict(False, "balanced")
        if noise:
            return verdict(False, "noise")
        if moved == 0:
            return verdict(False, "balanced")
        if saving_s <= 0:
            return verdict(False, "no-time")
        if self.max_moved_slots is not None and moved > self.max_moved_slots:
            return verdict(False, "cap")
        charge = self.cost.moves.charge_for(copy_s, *step())
        after = n_min(charge.charged_s, saving_s)   # batches until the move has paid for itself (formula 7)
        if after is None or after > horizon - charge.steps:
            return verdict(False, "no-payback", charge.charged_s)
        return verdict(True, "moves", charge.charged_s)

    def _within_bytes(self, chosen: list[LayerVerdict], verdicts: list[LayerVerdict]) -> list[LayerVerdict]:
        """`chosen` within `max_bytes`, best net gain first; layers left out are marked "cap" (in `verdicts`)."""
        if self.max_bytes is None:
            return chosen
        kept, spent = [], 0
        for v in sorted(chosen, key=lambda v: -(v.saving_s * v.horizon_steps - v.charge_s)):
            size = v.moved_slots * self.cost.expert_bytes
            if spent + size <= self.max_bytes:
                kept.append(v)
                spent += size
            else:
                verdicts[v.layer] = LayerVerdict(**{**v.__dict__, "moved": False, "reason": "cap"})
        return kept

    def _decision(self, chosen: list[LayerVerdict], current: Placement, fresh: Placement,
                  priced: np.ndarray) -> Decision | None:
        """The chosen layers' rows of `fresh` in the map in use (None: nothing moves)."""
        if not chosen:
            return None
        layers = sorted(v.layer for v in chosen)
        if layers == priced.tolist():
            new = fresh                          # every layer that could move does
        else:
            rows = np.array(current.phy2log)
            rows[layers] = fresh.phy2log[layers]
            new = Placement(rows, current.num_experts, current.num_gpus, self.cost.topology.num_servers,
                            allow_colocated=True)
        return Decision(new, tuple(layers), sum(v.saving_s for v in chosen),
                        float(min(v.horizon_steps for v in chosen)), sum(v.charge_s for v in chosen))

    def _retention(self, state: RuleState, lam: np.ndarray, mean: np.ndarray,
                   gpus: int) -> tuple[float, tuple[tuple[float, float], ...]]:
        """Step 4's retention, and the calls it pools: of the gap the last call's plan showed over the map
        then in use (on its own window, layers with a gap over `min_gain`), the share it still shows on this
        window; pooled over the layers and the last `RETENTION_CALLS` calls, clipped to
        [0, 1 - 1/MAX_HORIZON_INTERVALS]; 0 until a call has had a gap."""
        kept = state.kept
        if state.rows is not None:   # set with `planned` and `gap` by every call
            had = np.flatnonzero(state.gap > self.min_gain)
            if had.size:
                busy = even_split_gpu_loads(np.concatenate([state.rows[had], state.planned[had]]),
                                            np.tile(lam[had], (2, 1)), gpus).max(axis=1)
                then, plan = busy[:had.size], busy[had.size:]
                kept = (kept + ((float(((then - plan) / mean[had]).sum()), float(state.gap[had].sum())),))[
                    -RETENTION_CALLS:]
        shown = sum(s for _, s in kept)
        if shown <= 0:
            return 0.0, kept
        return float(np.clip(sum(r for r, _ in kept) / shown, 0.0, 1.0 - 1.0 / MAX_HORIZON_INTERVALS)), kept


def warm_up() -> None:
    """Run the rule once on a tiny problem (2 layers x 8 experts on 2 GPUs), so that what is paid
    once per process (lazy imports, numpy's first calls of each routine, the cost model's caches)
    is paid when an engine installs the policy, not in its first rebalance, which the engine
    times as serving. The engines' own policies pay theirs at import."""
    rule = RebalanceRule(cluster_cost(2, 1, migration="async"), 2, 8)
    state = rule.create_state()
    rng = np.random.default_rng(0)
    current = Placement(np.tile(np.arange(10) % 8, (2, 1)), 8, 2)   # the engines' start map, slot p -> p % E
    for _ in range(3):   # a first call, then calls with a "same" load: every step of the rule runs
        window = rng.multinomial(4096, np.linspace(1.0, 3.0, 8) / 16.0, size=(16, 2)).astype(np.float64)
        answer = rule.decide(state, window, current, interval_steps=100)
        state = answer.state
        current = current if answer.decision is None else answer.decision.placement
