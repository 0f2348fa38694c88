"""Online controllers for the replay: the engines' own protocol, their default policies, and ours.

Every controller sees the per-step counts `[layers, E]` as the engine records them (`observe`)
and, after each step, may return a `Decision` (a new map) for the map the engine will run
(`decide`). The replay pays for the copies and switches maps through `MapSwitch`.

What the engines record is rows per physical slot, under the map each step ran on; at the call they
turn the window into logical counts with the map in use *then* (vLLM 0.33 `EplbState.rearrange`:
`scatter_add_` over `physical_to_logical_map`; SGLang 0.5.23 `_convert_global_physical_count_to_
logical_count` at the recorder's dump). Steps recorded under an older map are read with the new one:
after vLLM's asynchronous walk commits layer by layer, the next short window is partly mislabelled,
and both policies plan on it. The controllers keep the window as the engines do (`records_physical`):
each step's rows per slot (the replicas' even split, the first `count % replicas` replicas one more,
`moe_place.split.even_shares`) and the conversion at the call.

An engine asks its policy on a fixed cadence (`EngineCadence`): vLLM 0.33 first after
`step_interval // 4` steps, then every `step_interval` (3000) steps, with the load of the last
`window_size` (1000) steps recorded before the call (`vllm/distributed/eplb/eplb_state.py`:
`add_model` sets the progress to 3/4 of the interval; `_should_record_current_step`); SGLang
0.5.23 first after `--eplb-rebalance-num-iterations` + 1 passes (its generator yields that many
times, and the next pass's end rebalances), then every as many passes, with the recorder's circular
buffer of as many passes (`sglang/srt/eplb/eplb_manager.py` `_entrypoint`). Both start from the same map:
slot `p` holds expert `p % E` (vLLM's linear `build_initial_global_physical_to_logical_map`,
SGLang's `trivial`; `initial_map`).

- `StaticController`: never moves (the map planned once, offline).
- `EngineDefaultController`: the engine's own default policy at its cadence: DeepSeek EPLB's
  greedy re-plan of the window, with vLLM 0.33's post-processing that keeps an expert in its
  slot when it stays on its GPU (`preserve_intragpu_slots`, our `keep_unchanged_slots`), or
  without it for SGLang's `deepseek` algorithm.
- `RuleController` ("ours"): `moe_place.online.policy.RebalanceRule` at the engine's cadence,
  exactly as the vLLM policy and the SGLang hook run it.
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from moe_place.errors import InputError
from moe_place.online.engine_default import ENGINES
from moe_place.online.policy import Decision, RebalanceRule, RuleState
from moe_place.online.window import SlidingWindow
from moe_place.placement import Placement, keep_unchanged_slots
from moe_place.split import even_shares
from moe_place.solvers.deepseek import eplb_rebalance

CONTROLLERS = ("static", "engine-default", "ours")

__all__ = ["CONTROLLERS", "Controller", "Decision", "ENGINES", "EngineCadence", "EngineDefaultController",
           "RuleController", "StaticController", "cpu_timer", "initial_map", "logical_counts", "make_controller",
           "numpy_default_plan"]


@contextmanager
def cpu_timer():
    """Times the block in CPU seconds of the calling thread (`time.thread_time`) with Python's garbage collector
    held off, as `timeit` does: a collection lands in whichever call happens to allocate past its threshold, so
    it is left out of the replay's calls and (`bench/inengine/harness.py`) the engines' alike. Yields a list that
    holds the seconds once the block ends."""
    held = gc.isenabled()
    gc.disable()
    seconds: list[float] = []
    started = time.thread_time()
    try:
        yield seconds
    finally:
        seconds.append(time.thread_time() - started)
        if held:
            gc.enable()


class Controller(Protocol):
    name: str

    def observe(self, step: int, counts: np.ndarray, in_use: Placement | None = None) -> None:
        """Record the counts `[layers, E]` of batch `step`, which the map `in_use` served."""

    def decide(self, step: int, current: Placement) -> Decision | None:
        """After batch `step`: a new map to switch to from `current`, or None."""


@dataclass(frozen=True)
class EngineCadence:
    """When an engine calls its policy and on what.

    step_interval: steps between calls. window_size: steps of load the call sees (the last ones).
    first_call: steps before the first call (vLLM: `step_interval // 4`; SGLang: `step_interval`).
    migration: the engine's default migration model ("async": vLLM's `use_async`; "stall": SGLang
        with `--eplb-rebalance-layers-per-chunk` unset, all layers updated at once).
    layer_per_step: vLLM's asynchronous worker: a call's map is committed one layer per forward
        pass, every layer in order whether it changed or not (`MapSwitch.schedule_layers`), and a
        call that falls due during that walk waits until it ends (`EplbState.step` keeps its counter
        past the interval while a rebalance is pending, vLLM 0.33 `eplb_state.py`).
    policy_in_worker: the policy runs in that worker thread, beside serving (vLLM `use_async`): its
        CPU time delays the new map, it does not stall a step. False: the step waits for it (vLLM's
        sync mode, SGLang's scheduler).
    per_step_window: the policy gets per-step counts `[steps, layers, E]` (SGLang's per-pass
        `logical_count`), not their sum over the window (vLLM 0.33's `weight`).
    copy_schedule: how a rebalance's copies run: "parallel" for both engines, which issue a layer's
        transfers as one batch (`torch.distributed.batch_isend_irecv`: vLLM's `eplb_communicator.py`,
        SGLang's `expert_location_updater.py`), so the links, not the sum of the copies, set the time.
    records_physical: the window holds rows per slot under each step's map, read at the call with the map
        in use then (module note), as both engines record it; False: the true logical counts.
    """

    engine: str = "vllm"
    step_interval: int = 3000
    window_size: int = 1000
    first_call: int = 750
    migration: str = "async"
    layer_per_step: bool = True
    per_step_window: bool = False
    copy_schedule: str = "parallel"
    policy_in_worker: bool = True
    records_physical: bool = True

    def __post_init__(self) -> None:
        for name in ("step_interval", "window_size", "first_call"):
            if getattr(self, name) < 1:
                raise InputError(name, "an integer >= 1 steps", getattr(self, name))

    @classmethod
    def of(cls, engine: str, step_interval: int | None = None, window_size: int | None = None,
           use_async: bool = True) -> "EngineCadence":
        """The engine's default cadence (`ENGINES`), with `step_interval` / `window_size` overridden if given.

        use_async: vLLM's `use_async` (its default): moves and the policy in the worker thread; False:
        vLLM's sync mode (the step waits for the policy and the copies). SGLang is always synchronous."""
        if engine == "vllm":
            interval = 3000 if step_interval is None else step_interval
            return cls("vllm", interval, 1000 if window_size is None else window_size, max(1, interval // 4),
                       "async" if use_async else "stall", use_async, False, policy_in_worker=use_async)
        if engine == "sglang":
            interval = 1000 if step_interval is None else step_interval
            # SGLang's recorder buffer defaults to the rebalance interval
            return cls("sglang", interval, interval if window_size is None else window_size, interval + 1, "stall",
                       False, True, policy_in_worker=False)
        raise InputError("--engine", f"one of {', '.join(ENGINES)}", engine)

    def calls_at(self, step: int) -> bool:
        """True when the engine calls its policy after batch `step` (0-based), no call having waited
        for a layer walk (`layer_per_step`); a controller follows the engine's counter instead."""
        done = step + 1
        return done >= self.first_call and (done - self.first_call) % self.step_interval == 0

    def window_steps(self, step: int) -> int:
        """Steps of load the call after batch `step` sees (fewer than the window at the first call)."""
        return min(self.window_size, step + 1)


def initial_map(num_layers: int, num_experts: int, num_physical: int, num_gpus: int, num_nodes: int = 1) -> Placement:
    """The engines' start map: slot `p` holds expert `p % E` (vLLM linear, SGLang trivial)."""
    rows = np.tile(np.arange(num_physical, dtype=np.int64) % num_experts, (num_layers, 1))
    return Placement(rows, num_experts, num_gpus, num_nodes, allow_colocated=True)


@dataclass
class StaticController:
    name: str = "static"
    last_policy_s: float = 0.0
    called: bool = False

    def observe(self, step: int, counts: np.ndarray, in_use: Placement | None = None) -> None:
        return None

    def decide(self, step: int, current: Placement) -> Decision | None:
        return None


@dataclass
class _OnCadence:
    """The window and call timing shared by the engine-driven controllers."""

    cadence: EngineCadence
    num_layers: int
    num_experts: int
    called: bool = field(default=False, init=False)   # whether the last `decide` called the policy
    _window: SlidingWindow | None = field(init=False, repr=False)
    _due: int = field(init=False, repr=False)          # the first step after which the next call falls due

    def __post_init__(self) -> None:
        self._window = None
        self._due = self.cadence.first_call - 1

    def observe(self, step: int, counts: np.ndarray, in_use: Placement | None = None) -> None:
        """Record batch `step`'s counts `[layers, E]`, served by the map `in_use` (needed when the engine
        records rows per slot, `EngineCadence.records_physical`)."""
        physical = self.cadence.records_physical
        if physical and in_use is None:
            raise InputError("in_use", "the map the step ran on (the engine records rows per slot)", "nothing")
        if self._window is None:
            width = in_use.num_physical if physical else self.num_experts
            self._window = SlidingWindow(self.cadence.window_size, self.num_layers, width)
        self._window.push(even_shares(in_use.phy2log, np.asarray(counts, dtype=np.int64)) if physical else counts)

    def _calls(self, step: int) -> bool:
        """The engine's counter: a call after batch `step` when it is due; the next one falls due an
        interval later. The replay asks only while no switch is under way, so a call that fell due
        during a layer walk comes right after it, as in vLLM."""
        self.called = step >= self._due
        if self.called:
            self._due = step + self.cadence.step_interval
        return self.called

    def _due_window(self, step: int, current: Placement) -> tuple[np.ndarray, int] | None:
        """(the window the engine hands its policy after batch `step`, the steps it covers) when the call
        is due (`_calls`), else None: `[steps, layers, E]` per-step counts or `[layers, E]` their sum, as
        the engine hands them, read with the map `current` where the engine records rows per slot."""
        if not self._calls(step):
            return None
        steps = self.cadence.window_steps(step)
        held = self._window.last(steps) if self.cadence.per_step_window else self._window.total(steps)
        if not self.cadence.records_physical:
            return held, steps
        return logical_counts(held, current.phy2log, current.num_experts), steps


@dataclass
class EngineDefaultController(_OnCadence):
    """The engine's default policy at its cadence (module note).

    plan: `(window, current) -> phy2log` the policy itself, given the engine's window (`[layers, E]`
        summed, or `[steps, layers, E]` per step where the engine hands those) and the map in use;
        default `numpy_default_plan`, moe-place's numpy EPLB, which returns the engines' maps at a
        fraction of their own code's CPU time (`moe_place.online.engine_default` runs the engines' own).
    """

    num_groups: int | None = None
    name: str = "engine-default"
    last_policy_s: float = 0.0
    plan: Callable[[np.ndarray, Placement], np.ndarray] | None = None

    def decide(self, step: int, current: Placement) -> Decision | None:
        self.last_policy_s = 0.0
        due = self._due_window(step, current)
        if due is None:
            return None
        window, _ = due
        plan = self.plan or (lambda w, c: numpy_default_plan(w, c, self.cadence.engine, self.num_groups))
        with cpu_timer() as seconds:
            rows = plan(window, current)
            new = Placement(np.asarray(rows), current.num_experts, current.num_gpus, current.num_nodes,
                            allow_colocated=True)
        self.last_policy_s = seconds[0]
        changed = tuple(int(i) for i in np.flatnonzero((new.phy2log != current.phy2log).any(axis=1)))
        return Decision(new, changed) if changed else None


@dataclass
class RuleController(_OnCadence):
    """`RebalanceRule` at the engine's cadence: the decision the engine adapters make. The rule's state
    between calls is held here (`state`), as an engine holds its policy's.

    last_verdicts: the last call's, one per layer (`RuleAnswer.verdicts`); last_policy_s: its CPU seconds
    (`time.thread_time`), the rule's and the split choice's (both run in the policy's call), 0 after a step
    without a call; last_split_s: the split choice's part, last_split_price_s its committed price
    (`RuleAnswer.split_price_s`). split_layers: the layers the per-batch split takes (`RuleAnswer.split_layers`;
    None where the rule has no `split`). split_all: the split takes every layer from the first step, whatever
    the rule answers (a free split's reference, bench/bench_split.py).
    """

    rule: RebalanceRule | None = None
    name: str = "ours"
    last_policy_s: float = 0.0
    last_split_s: float = 0.0
    last_split_price_s: float = 0.0
    last_verdicts: tuple = ()
    split_all: bool = False
    split_layers: np.ndarray | None = field(default=None, init=False)
    state: RuleState | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rule is None:
            raise InputError("rule", "a RebalanceRule")
        self.state = self.rule.create_state()
        if self.split_all:
            self.split_layers = np.ones(self.num_layers, dtype=bool)

    def decide(self, step: int, current: Placement) -> Decision | None:
        self.last_policy_s = self.last_split_s = self.last_split_price_s = 0.0
        due = self._due_window(step, current)
        if due is None:
            return None
        window, steps = due
        with cpu_timer() as seconds:
            answer = self.rule.decide(self.state, window, current, self.cadence.step_interval, steps, step)
        self.last_policy_s, self.last_split_s, self.last_split_price_s = seconds[0], answer.split_cpu_s, \
            answer.split_price_s
        self.state, self.last_verdicts = answer.state, answer.verdicts
        if not self.split_all:
            self.split_layers = answer.split_layers
        return answer.decision


def logical_counts(physical: np.ndarray, phy2log: np.ndarray, num_experts: int) -> np.ndarray:
    """float64 `[..., layers, E]`: rows per slot `[..., layers, P]` summed per logical expert of `phy2log
    [layers, P]` (what the engines do at the call, module note)."""
    physical = np.asarray(physical, dtype=np.float64)
    layers, slots = phy2log.shape
    lead = physical.shape[:-2]
    flat = physical.reshape(-1, layers, slots)
    keys = (np.arange(layers)[:, None] * num_experts + phy2log)[None] + \
        (np.arange(len(flat)) * layers * num_experts)[:, None, None]
    out = np.bincount(keys.ravel(), weights=flat.ravel(), minlength=len(flat) * layers * num_experts)
    return out.reshape(*lead, layers, num_experts)


def numpy_default_plan(window: np.ndarray, current: Placement, engine: str,
                       num_groups: int | None = None) -> np.ndarray:
    """The engines' default policy in numpy: DeepSeek EPLB of the window (summed), and for vLLM 0.33's
    `DefaultEplbPolicy` the slots of experts that stay on their GPU kept (`keep_unchanged_slots`)."""
    window = np.asarray(window, dtype=np.float64)
    total = window.sum(axis=0) if window.ndim == 3 else window
    rows = eplb_rebalance(total, current.num_physical, num_groups or 1, current.num_nodes, current.num_gpus)
    if engine == "vllm":
        rows = keep_unchanged_slots(rows, current.phy2log, current.slots_per_gpu)
    return rows


def make_controller(kind: str, cadence: EngineCadence, num_layers: int, num_experts: int,
                    rule: RebalanceRule | None = None, num_groups: int | None = None,
                    default_plan: Callable | None = None) -> Controller:
    """A controller by name (`CONTROLLERS`) at `cadence`; "ours" runs `rule` (and the per-batch split where the
    rule has one, `RebalanceRule.split`); "engine-default" runs `default_plan` (`EngineDefaultController.plan`;
    None: the numpy port)."""
    if kind == "static":
        return StaticController()
    if kind == "engine-default":
        return EngineDefaultController(cadence, num_layers, num_experts, num_groups=num_groups,
                                       name=f"{cadence.engine}-default", plan=default_plan)
    if kind == "ours":
        return RuleController(cadence, num_layers, num_experts, rule=rule)
    raise InputError("--controller", f"one of {', '.join(CONTROLLERS)}", kind)
