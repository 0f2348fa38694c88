"""vLLM adapter, the policy: moe-place's rebalance rule behind vLLM's EPLB policy interfaces.

vLLM (`vllm/distributed/eplb/`, moved to `vllm/backends/distributed/eplb/` with a shim at the old
path) asks its policy for a new map every `step_interval` steps. Two interfaces exist:
- "legacy" (vLLM 0.33 and earlier): the classmethod
  `rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_ranks[, old_global_expert_indices])`
  with `weight` the logical load window `[layers, E]` summed over `window_size` steps. It returns
  the tuple `(phy2log, log2phy, logcnt)` in older releases (`log2phy` padded with -1 to
  `num_redundant + 1` columns) or `phy2log` only in recent ones ("tuple" / "phy2log": `returns`).
- "context" (vLLM main, out-of-tree policies): an instance holds configuration;
  `create_state(num_moe_layers)` makes per-model state; `rebalance_experts(self, context,
  policy_state) -> EplbPlan` plans from an `EplbRebalanceContext` (`load_window_cpu [samples,
  layers, E]` per-step loads, `physical_to_logical_map_cpu [layers, P]`, `topology`,
  `num_replicas`) with the state read-only; `on_layer_committed(policy_state, plan, layer_idx)`
  is the only hook that advances the state. A transitional form names the planning method
  `plan_rebalance` and keeps the legacy classmethod as a fallback ("plan_rebalance").
`make_policy(interface="auto")` reads the interface off the installed vLLM's `AbstractEplbPolicy`
(legacy when vLLM is absent), as `returns="auto"` reads the return style.

What the policy decides: the rebalance rule (`moe_place.online.policy.RebalanceRule`, docs/MODEL.md
"The rebalance rule"), the same decision `moe-place replay --controller ours` makes at vLLM's
cadence: from the map in use, DeepSeek EPLB's plan of the window aligned to it, taken for the
layers where the gap is above the measured noise floor and the copies pay back within the
horizon (the next call, the pattern's age, or the measured retention's life of a saving;
formula 7 with the migration model, `async` as vLLM's `use_async`), whole; otherwise the map
in use unchanged (vLLM then copies nothing). Where vLLM gives no usable map in use, a fresh plan
(`moe_place.solvers.engine_call.plan_placement`). The rule's state between calls
(`moe_place.engines.session.RuleSession`, one per model) lives in `policy_state` for the context
interface, as vLLM keeps every policy's; vLLM 0.33's classmethod interface hands the policy no state,
so there it lives with the policy class. What vLLM knows comes from vLLM: the adapter's
`install()` (`moe_place.engines.vllm`) wraps `EplbState.add_model`, which records per model
(`ENGINE_MODELS`) its name, the bytes of one expert (the expert weight tensors vLLM registers for
EPLB, `model.expert_weights`), its MoE layers and experts and vLLM's `step_interval` / `window_size`;
the GPUs and nodes are vLLM's call's own. The hardware, the rule's thresholds and caps:
`moe_place.engines.config` (`MOE_PLACE_CONFIG` file or `MOE_PLACE_*` variables), where a model or
cadence that disagrees with vLLM's is an InputError naming both, raised in `add_model` (the server
does not start). The first call logs one line (`moe_place.engines.config.first_call_line`).
With `MOE_PLACE_STATIC_PLAN=FILE` (a plan file, e.g. from `moe-place export --engine vllm`) the
policy returns that placement at every rebalance instead: vLLM moves to it once.
An exception inside the policy never reaches vLLM (`moe_place.engines.guard`): the call logs one warning with
the reason and vLLM's own default policy answers it (the context interface: the map in use, unchanged); the
rule's sessions stay as they were, so the next call starts from the last good one. With the per-batch split
on (`MOE_PLACE_SPLIT=per-batch`), each call also offers the rule's per-layer split choice to vLLM's router
(`moe_place.engines.batch_split`, `moe_place.engines.vllm_split`).

torch and vLLM are imported lazily.
"""

from __future__ import annotations

import importlib
import inspect
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterable, Iterator, Mapping

import numpy as np

from moe_place.engines.batch_split import FLAGS, split_enabled
from moe_place.engines.config import EngineConfig, EngineModel, load_engine_config
from moe_place.engines.guard import Guard
from moe_place.engines.session import RuleSession
from moe_place.engines.tensors import placement_tensors, to_numpy, weight_to_numpy
from moe_place.errors import InputError
from moe_place.placement import Placement
from moe_place.planfile import read_plan
from moe_place.solvers.deepseek import check_eplb_arguments
from moe_place.solvers.engine_call import plan_placement, solver_settings

__all__ = ["MoePlaceContextPolicy", "MoePlaceEplbPolicy", "MoePlacePlanRebalancePolicy", "MoePlaceState",
           "PolicyCore", "VllmModel", "current_placement", "importable", "interface_of", "make_plan", "make_policy",
           "policy_module", "return_style", "static_placement", "style_of", "vllm_abstract_policy"]

RETURN_STYLES = ("auto", "tuple", "phy2log")
INTERFACES = ("auto", "legacy", "plan_rebalance", "context")
RETURNS_ENV = "MOE_PLACE_VLLM_RETURNS"
STATIC_PLAN_ENV = "MOE_PLACE_STATIC_PLAN"
# Where vLLM keeps its policy registry (the module path moved between releases).
POLICY_MODULES = ("vllm.distributed.eplb.policy", "vllm.backends.distributed.eplb.policy")


@dataclass(frozen=True)
class VllmModel:
    """What vLLM's `EplbState.add_model` was given for one model: the model (None: vLLM registered no expert
    weights) and vLLM's cadence."""

    model: EngineModel | None
    step_interval: int | None
    window_size: int | None
    use_async: bool | None = None


# (MoE layers, logical experts) -> what vLLM registered for that model: filled by the adapter's wrapped
# add_model (`moe_place.engines.vllm.record_vllm_model`), read when a model's rule starts (vLLM's policy
# call names no model: its shape finds it)
ENGINE_MODELS: dict[tuple[int, int], VllmModel] = {}
SETTINGS = ("returns", "solver", "time_limit_s", "max_moved_slots", "static_plan", "config")


# ---------------------------------------------------------------------- the decision
class PolicyCore:
    """Settings and the decision shared by both interfaces (class attributes; see `make_policy`).

    returns: "auto" | "tuple" | "phy2log" (legacy interface only).
    config: the rule's settings (None: `load_engine_config()` at first use).
    solver / time_limit_s: moe-place's solver for a fresh plan, made where vLLM gives no usable map in use
        (None: `MOE_PLACE_SOLVER` / `MOE_PLACE_TIME_LIMIT`, default "quick", `solvers.engine_call.solver_settings`).
    max_moved_slots: a cap on slots changed per layer and call (None: the config's).
    static_plan: path of a fixed placement (None: `MOE_PLACE_STATIC_PLAN`, unset: plan online).
    """

    returns: ClassVar[str] = "auto"
    config: ClassVar[EngineConfig | None] = None
    solver: ClassVar[str | None] = None
    time_limit_s: ClassVar[float | None] = None
    max_moved_slots: ClassVar[int | None] = None
    static_plan: ClassVar[str | None] = None

    @classmethod
    def engine_config(cls) -> EngineConfig:
        config = cls.config or load_engine_config()
        if cls.max_moved_slots is not None and cls.max_moved_slots != config.max_moved_slots:
            config = EngineConfig(**{**config.__dict__, "max_moved_slots": cls.max_moved_slots})
        return config

    @classmethod
    def decide(cls, window: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int,
               old, sessions: Mapping, window_steps: int | None = None) -> tuple[Placement, Mapping]:
        """(the map to run next, the sessions after this call): `sessions` itself is left as it was.

        window: float `[samples, layers, E]` per-step loads or `[layers, E]` summed over `window_steps`.
        old: the map in use `[layers, P]` (tensor or array) or None. sessions: the rule's sessions, one per
        model shape (`RuleSession`), from the caller's state.
        """
        loads = np.asarray(window, dtype=np.float64)
        total = loads if loads.ndim == 2 else loads.sum(axis=0)
        num_layers, num_experts = total.shape
        check_eplb_arguments(num_experts, num_replicas, num_groups, num_nodes, num_ranks)
        static = cls.static_plan or os.environ.get(STATIC_PLAN_ENV)
        if static:
            return static_placement(static, num_layers, num_experts, num_replicas, num_ranks), sessions
        current = current_placement(old, num_experts, num_ranks, (num_layers, num_replicas))
        if current is None:   # no map to migrate from: a fresh plan
            solver, limit = solver_settings(cls.solver, cls.time_limit_s)
            return plan_placement(total, num_replicas, num_groups, num_nodes, num_ranks, solver=solver,
                                  time_limit_s=limit), sessions
        key = (num_layers, num_experts, num_replicas, num_ranks, num_nodes)
        session = sessions.get(key)
        if session is None:   # the settings are read once per model, with its rule
            session = cls.new_session(num_layers, num_experts, num_replicas, num_groups, num_nodes, num_ranks)
        servers = session.rule.cost.topology.num_servers
        if current.num_nodes != servers:
            current = Placement(current.phy2log, num_experts, num_ranks, servers, allow_colocated=True)
        if window_steps is None:  # a summed window: vLLM 0.33's first call comes a quarter interval in
            window_steps = session.window_steps if session.calls else min(session.window_steps,
                                                                           max(1, session.interval // 4))
        placement, session = session.decide(loads, current, window_steps)
        if session.split_layers is not None:
            FLAGS.offer((num_layers, num_experts), session.split_layers)
        return placement, {**sessions, key: session}

    @classmethod
    def new_session(cls, num_layers: int, num_experts: int, num_replicas: int, num_groups: int, num_nodes: int,
                    num_ranks: int) -> RuleSession:
        """The rule for one model, priced with what vLLM registered for it (`ENGINE_MODELS`), and its log line."""
        config = cls.engine_config()
        seen = ENGINE_MODELS.get((num_layers, num_experts))
        engine = None if seen is None else seen.model
        interval, window = config.cadence(*(() if seen is None else (seen.step_interval, seen.window_size)))
        groups = num_groups if num_groups and num_experts % num_groups == 0 else None
        nodes = num_nodes if num_nodes >= 1 and num_ranks % num_nodes == 0 else 1
        migration = None if seen is None or seen.use_async is None else ("async" if seen.use_async else "stall")
        where = "vLLM's EPLB config" if seen is not None else "vLLM's defaults: vLLM did not say"
        return RuleSession.start(config, "vLLM", engine, interval, window,
                                 f"every {interval} steps, window {window} steps ({where})", num_ranks, nodes,
                                 num_layers, num_experts, groups, migration,
                                 split="vllm" if split_enabled() else None)


# ---------------------------------------------------------------------- the legacy interface
class MoePlaceEplbPolicy(PolicyCore):
    """An EPLB policy with vLLM's classmethod interface; configure by subclassing (`make_policy`) or env vars.

    vLLM 0.33's interface is a classmethod and hands the policy no state, so the rule's sessions live with
    the class (`_sessions`, one per model shape; each `make_policy` class has its own), as does its guard
    (`_guard`: the reasons it has logged).
    """

    _sessions: ClassVar[Mapping] = {}
    _guard: ClassVar[Guard] = Guard("vLLM")

    @classmethod
    def rebalance_experts(cls, weight, num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int,
                          old_global_expert_indices=None):
        """Plan `num_replicas` slots per layer for `weight [layers, E]` on `num_ranks` GPUs.

        old_global_expert_indices: int `[layers, num_replicas]`, the map in use (optional); slots
            holding -1 (ranks being added or removed) make it unusable and it is ignored.
        Returns `phy2log` or `(phy2log, log2phy, logcnt)` (CPU int64 tensors), per `returns`.
        Any exception: one warning, and vLLM's default policy's answer (module note).
        """
        arguments = (weight, num_replicas, num_groups, num_nodes, num_ranks, old_global_expert_indices)
        default = _vllm_class("DefaultEplbPolicy")   # None outside vLLM: nothing to fall back to
        return cls._guard.call("vllm.policy", lambda: cls._rebalance(*arguments),
                               None if default is None else lambda: default.rebalance_experts(*arguments))

    @classmethod
    def _rebalance(cls, weight, num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int,
                   old_global_expert_indices):
        placement, sessions = cls.decide(weight_to_numpy(weight), num_replicas, num_groups, num_nodes, num_ranks,
                                         old_global_expert_indices, cls._sessions)
        if return_style(cls.returns) == "phy2log":   # vLLM 0.33 takes the map alone
            import torch  # lazy, as in placement_tensors: vLLM has it

            answer = torch.from_numpy(np.array(placement.phy2log, dtype=np.int64))
        else:
            answer = placement_tensors(placement, log2phy_width=num_replicas - placement.num_experts + 1)
        cls._sessions = sessions   # only a call that answered advances the rule
        return answer


# ---------------------------------------------------------------------- the context interface
@dataclass
class MoePlaceState:
    """Per-model state of the context interface: the rule's sessions (`RuleSession`, one per model shape)."""

    num_moe_layers: int
    sessions: Mapping = field(default_factory=dict)


class MoePlaceContextPolicy(PolicyCore):
    """vLLM's context interface (module note): configuration on the instance's class, state in `policy_state`.

    `rebalance_experts` reads the state and hands the advanced one along with the plan (the state read is
    left as it was); `on_layer_committed` adopts it, so the state moves only when vLLM commits the plan.
    """

    _guard: ClassVar[Guard] = Guard("vLLM")

    def create_state(self, num_moe_layers: int):
        base = _vllm_class("EplbPolicyState")
        if base is None:
            return MoePlaceState(num_moe_layers)
        state = base()
        state.moe_place = MoePlaceState(num_moe_layers)
        return state

    def rebalance_experts(self, context, policy_state):
        """An `EplbPlan` (CPU int64 `[layers, P]`) for the context; `policy_state` is only read. Any exception:
        one warning, and the map in use unchanged (vLLM moves nothing)."""
        return type(self)._guard.call("vllm.policy", lambda: self._plan(context, policy_state),
                                      lambda: make_plan(context.physical_to_logical_map_cpu, None))

    def _plan(self, context, policy_state):
        ours = _our_state(policy_state)
        loads = to_numpy(context.load_window_cpu, np.float64, copy=True)
        if loads.ndim == 2:
            loads = loads[None]
        topo = context.topology
        placement, sessions = self.decide(loads, int(context.num_replicas), int(topo.num_groups), int(topo.num_nodes),
                                          int(topo.num_ranks), context.physical_to_logical_map_cpu, ours.sessions,
                                          window_steps=len(loads))
        return make_plan(placement_tensors(placement)[0], MoePlaceState(ours.num_moe_layers, sessions))

    def on_layer_committed(self, policy_state, plan, layer_idx: int) -> None:
        """Adopt the state the plan was made with (once per plan, whichever layer commits first); any exception:
        one warning, and the state stays as it was."""
        type(self)._guard.call("vllm.policy", lambda: self._adopt(policy_state, plan), lambda: None)

    @staticmethod
    def _adopt(policy_state, plan) -> None:
        advanced = getattr(plan, "moe_place_state", None)
        if advanced is None:
            return
        ours = _our_state(policy_state)
        if ours is not advanced:
            ours.sessions = advanced.sessions
            if isinstance(policy_state, MoePlaceState):
                return
            policy_state.moe_place = ours


class MoePlacePlanRebalancePolicy(MoePlaceEplbPolicy, MoePlaceContextPolicy):
    """The transitional interface: `plan_rebalance(self, context, policy_state)` plus the legacy classmethod."""

    def plan_rebalance(self, context, policy_state):
        return MoePlaceContextPolicy.rebalance_experts(self, context, policy_state)


def _our_state(policy_state) -> MoePlaceState:
    if isinstance(policy_state, MoePlaceState):
        return policy_state
    ours = getattr(policy_state, "moe_place", None)
    if ours is None:
        raise InputError("policy_state", "a state from this policy's create_state", type(policy_state).__name__)
    return ours


def make_plan(phy2log, state: MoePlaceState | None):
    """vLLM's `EplbPlan` for `phy2log`, carrying the advanced state for `on_layer_committed` (None: the state
    stays as it was)."""
    base = _vllm_class("EplbPlan")
    if base is None:
        return _Plan(phy2log, state)
    plan = base(phy2log)
    object.__setattr__(plan, "moe_place_state", state)  # frozen upstream dataclass: no field for it
    return plan


@dataclass(frozen=True)
class _Plan:
    """Stand-in for vLLM's `EplbPlan` when vLLM is not importable."""

    physical_to_logical_map: Any
    moe_place_state: MoePlaceState | None


def make_policy(name: str = "MoePlaceEplbPolicy", interface: str = "auto", **settings: Any) -> type:
    """A policy class for the installed vLLM's interface (`INTERFACES`; "auto": read it off vLLM) with
    `settings` (the class attributes of `PolicyCore`).

    When vLLM is importable the class also derives from its `AbstractEplbPolicy`, so
    `issubclass(cls, AbstractEplbPolicy)` holds for code that checks.
    """
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        raise InputError("make_policy", f"settings among {', '.join(SETTINGS)}", ", ".join(sorted(unknown)))
    if "returns" in settings and settings["returns"] not in RETURN_STYLES:
        raise InputError("returns", f"one of {', '.join(RETURN_STYLES)}", settings["returns"])
    if interface not in INTERFACES:
        raise InputError("interface", f"one of {', '.join(INTERFACES)}", interface)
    abstract = vllm_abstract_policy()
    if interface == "auto":
        interface = "legacy" if abstract is None else interface_of(abstract)
    ours = {"legacy": MoePlaceEplbPolicy, "plan_rebalance": MoePlacePlanRebalancePolicy,
            "context": MoePlaceContextPolicy}[interface]
    bases: tuple[type, ...] = (ours,) if abstract is None else (ours, abstract)
    namespace = dict(settings)
    namespace["_guard"] = Guard("vLLM")   # the reasons this class has logged (moe_place.engines.guard)
    if interface != "context":
        namespace["_sessions"] = {}  # the controller state of this class's legacy calls
    return type(name, bases, namespace)


def interface_of(abstract: type) -> str:
    """"context", "plan_rebalance" or "legacy": the interface an `AbstractEplbPolicy` declares."""
    if "plan_rebalance" in getattr(abstract, "__abstractmethods__", ()):
        return "plan_rebalance"
    method = inspect.getattr_static(abstract, "rebalance_experts", None)
    if method is not None and not isinstance(method, classmethod):
        params = list(inspect.signature(method).parameters)
        if params[:3] == ["self", "context", "policy_state"]:
            return "context"
    return "legacy"


def current_placement(old, num_experts: int, num_gpus: int, shape: tuple[int, int]) -> Placement | None:
    """The map vLLM runs now as a Placement, or None when absent or unusable (wrong shape, -1 slots)."""
    if old is None:
        return None
    old = to_numpy(old)
    if old.shape != shape or old.size == 0 or old.min() < 0 or old.max() >= num_experts:
        return None
    try:
        # vLLM's own default policy may put two replicas of one expert on one GPU
        return Placement(old.astype(np.int64), num_experts, num_gpus, allow_colocated=True)
    except InputError:
        return None


def return_style(configured: str = "auto") -> str:
    """"tuple" or "phy2log": the env var, else `configured`, else what the installed vLLM expects."""
    style = os.environ.get(RETURNS_ENV) or configured
    if style not in RETURN_STYLES:
        raise InputError(RETURNS_ENV, f"one of {', '.join(RETURN_STYLES)}", style)
    if style != "auto":
        return style
    abstract = vllm_abstract_policy()
    return "tuple" if abstract is None else style_of(abstract.rebalance_experts)


def style_of(method) -> str:
    """"tuple" when `method`'s return annotation is a tuple, else "phy2log"."""
    annotation = inspect.signature(method).return_annotation
    if isinstance(annotation, str):
        return "tuple" if annotation.replace(" ", "").lower().startswith(("tuple", "typing.tuple")) else "phy2log"
    return "tuple" if typing.get_origin(annotation) is tuple or annotation is tuple else "phy2log"


def vllm_abstract_policy() -> type | None:
    """vLLM's `AbstractEplbPolicy`, or None when vLLM is not importable."""
    return _vllm_class("AbstractEplbPolicy")


def _vllm_class(name: str) -> type | None:
    module = policy_module()
    return None if module is None else getattr(module, name, None)


def importable(names: Iterable[str]) -> Iterator[Any]:
    """The modules of `names` that import, in order (vLLM's module paths moved between releases)."""
    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        yield module


def policy_module():
    """The vLLM module that holds `EPLB_POLICIES`, or None."""
    return next((module for module in importable(POLICY_MODULES) if hasattr(module, "EPLB_POLICIES")), None)


# ---------------------------------------------------------------------- static placement files
def static_placement(path: str | Path, num_layers: int, num_experts: int, num_replicas: int,
                     num_ranks: int) -> Placement:
    """The placement of a plan file (`moe_place.planfile`), checked against vLLM's model and EP size."""
    placement = read_plan(path).placement
    if placement.phy2log.shape != (num_layers, num_replicas) or placement.num_experts != num_experts:
        raise InputError(str(path), f"a placement of {num_layers} layers x {num_replicas} slots, {num_experts} experts",
                         f"{placement.num_layers} x {placement.num_physical}, "
                         f"{placement.num_experts} experts")
    if placement.num_gpus != num_ranks:
        raise InputError(str(path), f"a placement for {num_ranks} EP ranks", f"one for {placement.num_gpus}")
    return placement
