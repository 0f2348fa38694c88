"""SGLang adapter: write a plan as the file `--init-expert-location` loads.

SGLang (`python/sglang/srt/eplb/expert_location.py`) reads `--init-expert-location FILE` with
`torch.load` (`.pt`) or `json.loads` (`.json`) and, when the dict holds `physical_to_logical_map`,
passes the dict's entries as keyword arguments to its mapping constructor, so the file holds
that one key and nothing else:

    {"physical_to_logical_map": [[...], ...]}      # int, [num_model_layers, num_physical]

- rows cover every decoder layer of the model, dense ones included (SGLang's layer count is the
  model's `num_hidden_layers`; its recorder writes dense layers as zero rows). Dense layers and
  model layers the plan does not cover get the trivial row `p % E` (what `trivial` gives);
- the physical count is logical + `--ep-num-redundant-experts` and divisible by the EP size;
  slot `p` lives on GPU `p // (P / ep_size)`, as in moe-place.

Launch: `python -m sglang.launch_server ... --ep-size G --ep-num-redundant-experts R
--init-expert-location FILE`. SGLang's recorder dumps are read by `moe_place.traces.load_trace`
(planning input for `moe-place plan`).

Online (`--enable-eplb`): SGLang's `EPLBManager` rebalances every
`--eplb-rebalance-num-iterations` passes through `ExpertLocationMetadata.init_by_eplb`, which calls
`sglang.srt.eplb.eplb_algorithms.rebalance_experts(tokens_per_expert [passes, layers, E], ...,
algorithm)`, and copies the changed layers (all at once unless `--eplb-rebalance-layers-per-chunk`).
`install_rebalance_hook()` puts `PaybackRebalance` in that function's place (reversibly): the
rebalance rule (`moe_place.online.policy.RebalanceRule`, what `replay --engine sglang --controller
ours` runs) decides, from the map SGLang runs, which layers take DeepSeek EPLB's plan of the
window aligned to the map in use (a gap above the noise floor that pays back), and otherwise
returns that map unchanged (SGLang then copies nothing).

The server's choice of algorithm (`--eplb-algorithm`, the `algorithm` argument) is honoured:
- `deepseek`, `deepseek_vec`, `elasticity_aware` (and `auto` resolving to `deepseek`): the rule, with
  global plans; their `_hierarchical` forms: the rule with hierarchical plans (groups inside nodes);
- `elasticity_aware*` while a rank is down (SGLang's `ElasticEPStateManager` reports fewer active
  ranks than GPUs): the call goes back to SGLang's own algorithm, which places no expert on an
  inactive rank (the rule plans over all GPUs); any algorithm this module does not know: the same.
What SGLang knows comes from SGLang: the model's name, one expert's bytes (the tensors of its
`routed_experts_weights_of_layer`, read through the `EPLBManager` SGLang built, which
`install_rebalance_hook()` and the environment hook record: `sglang_managers.MANAGERS`), its MoE
layers, the GPUs, nodes and groups of the call, `--eplb-rebalance-num-iterations` and the recorder's
window, and how it copies (`--eplb-rebalance-layers-per-chunk` unset: every layer at once while
serving waits, "stall"; set: "async"); the rest from `moe_place.engines.config` (`MOE_PLACE_CONFIG`
or `MOE_PLACE_*`), where a model, cadence or migration model that disagrees with SGLang's is an
InputError naming both. The rule's first call logs one line
(`moe_place.engines.config.first_call_line`).

Never a server down (`moe_place.engines.guard`): an exception inside the hook (the rule, the estimate, the
probes of SGLang's state) logs one warning with the reason and SGLang's own `rebalance_experts` answers the
call; the rule's sessions stay as they were. A model whose layers register no expert weight tensors counts as
unknown (the rule prices copies with the configured model). The settings (`MOE_PLACE_*`) are read and checked
when the hook installs, at the scheduler's start (a bad value stops it there, with one line), with SGLang's
`--eplb-rebalance-num-iterations` and migration where SGLang has published them.
With `MOE_PLACE_SPLIT=per-batch` each call also offers the rule's per-layer split choice to SGLang's `lp`
dispatch path (`moe_place.engines.sglang_split`).

Two ways in: `MOE_PLACE_SGLANG=1` in the server's environment (`moe_place.engines.sglang_startup`:
every SGLang process of the environment, the spawned schedulers included, no user code), or
`install_rebalance_hook()` in the process that runs the EPLB manager (in-process use: tests, a
scheduler you start yourself).
"""

from __future__ import annotations

import importlib
import io
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from moe_place.engines import sglang_managers
from moe_place.engines.batch_split import FLAGS, SPLIT_ENV, check_split_setting
from moe_place.engines.config import EngineConfig, EngineModel, config_dims, expert_bytes_of, load_engine_config
from moe_place.engines.guard import Guard
from moe_place.engines.session import RuleSession
from moe_place.engines.sglang_split import sglang_dispatch_algorithm
from moe_place.engines.tensors import placement_tensors, to_numpy
from moe_place.errors import InputError
from moe_place.io import write_atomic
from moe_place.online.policy import warm_up
from moe_place.placement import Placement
from moe_place.solvers.deepseek import plans_hierarchically
from moe_place.solvers.engine_call import plan_placement, solver_settings

__all__ = ["InitExpertLocation", "PaybackRebalance", "RebalanceHook", "check_settings", "init_expert_location",
           "install_rebalance_hook", "sglang_active_ranks", "sglang_current_map", "sglang_engine_model",
           "sglang_migration", "sglang_rebalance_interval", "uninstall_rebalance_hook", "write_init_expert_location"]

MAP_KEY = "physical_to_logical_map"
SUFFIXES = (".json", ".pt")
ALGORITHMS_MODULE = sglang_managers.ALGORITHMS_MODULE
LOCATION_MODULE = "sglang.srt.eplb.expert_location"
ELASTIC_MODULE = "sglang.srt.elastic_ep.elastic_ep"
# SGLang 0.5.23's EplbAlgorithm names the rule answers for (global, hierarchical); others go back to SGLang
RULE_ALGORITHMS = {"deepseek": False, "deepseek_hierarchical": True, "deepseek_vec": False,
                   "deepseek_vec_hierarchical": True, "elasticity_aware": False, "elasticity_aware_hierarchical": True}


@dataclass(frozen=True)
class InitExpertLocation:
    """A full-model `physical_to_logical_map` and where its rows came from.

    physical_to_logical_map: int64 `[num_model_layers, P]`.
    planned_layers: model layers whose row comes from the plan.
    trivial_layers: model layers given the trivial row `p % E` (dense layers, or MoE layers the
        plan does not cover: the CLI warns about the latter).
    dense_layers: the layers declared dense.
    """

    physical_to_logical_map: np.ndarray
    planned_layers: tuple[int, ...]
    trivial_layers: tuple[int, ...]
    dense_layers: tuple[int, ...]

    @property
    def unplanned_moe_layers(self) -> tuple[int, ...]:
        dense = set(self.dense_layers)
        return tuple(layer for layer in self.trivial_layers if layer not in dense)


def init_expert_location(placement: Placement, layer_ids: tuple[int, ...] = (), *,
                         num_model_layers: int | None = None,
                         dense_layer_ids: tuple[int, ...] = ()) -> InitExpertLocation:
    """Expand a plan to every model layer.

    layer_ids: the model layer of each plan row (default `0..layers-1`). When `dense_layer_ids`
        are given and the plan's ids are `0..n-1` with `n` equal to the number of MoE layers, the
        plan rows are taken as the MoE layers in order (a trace of MoE layers only).
    num_model_layers: decoder layers of the model (default: enough for every planned and dense layer).
    """
    rows = placement.num_layers
    ids = tuple(int(i) for i in layer_ids) if layer_ids else tuple(range(rows))
    if len(ids) != rows:
        raise InputError("layer_ids", f"{rows} ids, one per plan layer", len(ids))
    dense = tuple(sorted({int(d) for d in dense_layer_ids}))
    if dense and min(dense) < 0:
        raise InputError("dense layer ids", "integers >= 0", min(dense))
    if dense and ids == tuple(range(rows)) and set(ids) & set(dense):
        # the plan's rows are the MoE layers in order (a trace that kept MoE layers only)
        total = rows + len(dense) if num_model_layers is None else num_model_layers
        moe_layers = tuple(layer for layer in range(total) if layer not in set(dense))
        if len(moe_layers) != rows:
            raise InputError("num_model_layers", f"{rows} MoE layers besides the {len(dense)} dense ones",
                             f"{len(moe_layers)} MoE layers")
        ids = moe_layers
    needed = max(ids + dense) + 1
    total = needed if num_model_layers is None else num_model_layers
    if needed > total:
        raise InputError("num_model_layers", f"more than the highest layer id {needed - 1}", total)
    clash = sorted(set(ids) & set(dense))
    if clash:
        raise InputError("dense layer ids", "layers the plan does not cover", f"layer {clash[0]} is in the plan")
    experts, physical = placement.num_experts, placement.num_physical
    full = np.tile(np.arange(physical, dtype=np.int64) % experts, (total, 1))
    full[list(ids)] = placement.phy2log
    trivial = tuple(layer for layer in range(total) if layer not in set(ids))
    full.setflags(write=False)
    return InitExpertLocation(full, tuple(sorted(ids)), trivial, dense)


def write_init_expert_location(path: str | Path, location: InitExpertLocation | np.ndarray) -> None:
    """Write `{"physical_to_logical_map": ...}` atomically as `.json` or `.pt` (by the suffix)."""
    path = Path(path)
    matrix = location.physical_to_logical_map if isinstance(location, InitExpertLocation) else location
    matrix = np.asarray(matrix, dtype=np.int64)
    if path.suffix == ".json":
        write_atomic(path, json.dumps({MAP_KEY: matrix.tolist()}) + "\n")
    elif path.suffix == ".pt":
        import torch

        buffer = io.BytesIO()
        torch.save({MAP_KEY: torch.from_numpy(np.array(matrix))}, buffer)
        write_atomic(path, buffer.getvalue())
    else:
        raise InputError(str(path), f"a file name ending in {' or '.join(SUFFIXES)}", path.suffix or "no suffix")


# ---------------------------------------------------------------------- online: the rebalance rule
def sglang_current_map():
    """SGLang's map in use, CPU `[layers, P]` (`get_global_expert_location_metadata()`), or None."""
    try:
        module = importlib.import_module(LOCATION_MODULE)
    except ImportError:
        return None
    metadata = module.get_global_expert_location_metadata()
    return None if metadata is None else metadata.physical_to_logical_map_cpu


def sglang_rebalance_interval() -> int | None:
    """SGLang's `--eplb-rebalance-num-iterations` of the running server, or None outside one."""
    try:
        module = importlib.import_module("sglang.srt.runtime_context")
        return int(module.get_exec().moe.eplb_rebalance_num_iterations)
    except Exception:  # noqa: BLE001 - no SGLang, or no server context in this process: use the config
        return None


def sglang_migration() -> str | None:
    """How the running SGLang copies a rebalance: "async" with `--eplb-rebalance-layers-per-chunk` (a chunk
    of layers per pass), "stall" without (every layer at once, serving waits); None outside a server."""
    try:
        module = importlib.import_module("sglang.srt.runtime_context")
        chunk = module.get_exec().moe.eplb_rebalance_layers_per_chunk
    except Exception:  # noqa: BLE001 - no SGLang, or no server context in this process: use the config
        return None
    return "stall" if chunk is None else "async"


def sglang_active_ranks():
    """The ranks SGLang counts as up (int tensor, 1 = active), as its `elasticity_aware` algorithm reads
    them (`ElasticEPStateManager.instance().active_ranks`), or None when none are marked (all healthy)."""
    try:
        module = importlib.import_module(ELASTIC_MODULE)
    except ImportError:
        return None
    state = module.ElasticEPStateManager.instance()
    return None if state is None else state.active_ranks


def sglang_engine_model(num_layers: int, num_experts: int, local_slots: int) -> EngineModel | None:
    """What SGLang serves, from the newest `EPLBManager` of SGLang's current class whose model fits the call
    (MoE layer ids below `num_layers`, `local_slots` experts per GPU): its name (`model_path`), one expert's
    bytes (the tensors of `routed_experts_weights_of_layer`, `[local experts, ...]` each), its MoE layers;
    None when no such manager was recorded (`sglang_managers.MANAGERS`) or its layers hold no expert weight
    tensors (nothing to price a copy with: the rule then uses the configured model)."""
    module = sys.modules.get(sglang_managers.MANAGER_MODULE)
    current = getattr(module, "EPLBManager", None)
    for cls, model_config, get_model in reversed(sglang_managers.MANAGERS):
        if cls is not current or not callable(get_model):
            continue
        weights = getattr(get_model(), "routed_experts_weights_of_layer", None)
        if not weights or max(weights) >= num_layers or any(int(t.shape[0]) != local_slots for t in weights[min(weights)]):
            continue
        expert_bytes = expert_bytes_of(weights[min(weights)])
        if expert_bytes <= 0:
            continue
        hf_config = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
        name = getattr(model_config, "model_path", None) or "an unnamed model"
        return EngineModel(str(name), expert_bytes, len(weights), num_experts, **config_dims(hf_config),
                           source="SGLang's routed expert weights")
    return None


@dataclass
class PaybackRebalance:
    """SGLang's `rebalance_experts(tokens_per_expert, num_physical_experts, num_local_physical_experts,
    num_groups, num_nodes, algorithm)` decided by the rebalance rule (module note).

    config: the rule's settings (None: `load_engine_config()`, read once per model). current_map: returns the map in
    use `[layers, P]` (default: SGLang's global expert location). fallback: SGLang's own function, for the
    calls the rule hands back (an elastic call with a rank down, an algorithm it does not know; set by
    `install_rebalance_hook`). engine_model / active_ranks / interval: what SGLang says (defaults: read from
    the running SGLang). The rule's state lives here, one per model shape, between SGLang's calls.
    guard: the reasons logged where the rule failed and SGLang's own function answered (module note).
    Returns `(phy2log, log2phy, logcnt)` CPU int64 tensors, as SGLang's own algorithms do.
    """

    config: EngineConfig | None = None
    current_map: Callable[[], Any] = sglang_current_map
    fallback: Callable | None = None
    engine_model: Callable[[int, int, int], EngineModel | None] = sglang_engine_model
    active_ranks: Callable[[], Any] = sglang_active_ranks
    interval: Callable[[], int | None] = sglang_rebalance_interval
    migration: Callable[[], str | None] = sglang_migration
    sessions: dict = field(default_factory=dict)
    handed_back: int = 0
    guard: Guard = field(default_factory=lambda: Guard("SGLang"))

    def __call__(self, tokens_per_expert, num_physical_experts: int, num_local_physical_experts: int,
                 num_groups: int | None, num_nodes: int, algorithm: Any = None):
        arguments = (tokens_per_expert, num_physical_experts, num_local_physical_experts, num_groups, num_nodes,
                     algorithm)
        fallback = self.fallback   # None outside SGLang: nothing to fall back to
        # which calls SGLang answers itself (probes of its state: where they fail, SGLang answers too); SGLang's own
        # function runs outside the guard, so its own errors stay SGLang's
        name = self.guard.call("sglang.rebalance", lambda: self._rule_algorithm(*arguments),
                               None if fallback is None else lambda: None)
        if name is None:
            return self._hand_back(*arguments)
        return self.guard.call("sglang.rebalance", lambda: self._answer(name, *arguments),
                               None if fallback is None else lambda: fallback(*arguments))

    def _rule_algorithm(self, tokens_per_expert, num_physical_experts: int, num_local_physical_experts: int,
                        num_groups: int | None, num_nodes: int, algorithm: Any = None) -> str | None:
        """The name of the algorithm the rule answers for, or None where the call goes back to SGLang (module
        note: an algorithm the rule does not know, an elastic one with a rank down)."""
        name = getattr(algorithm, "name", algorithm)   # SGLang passes its EplbAlgorithm enum
        gpus = num_physical_experts // num_local_physical_experts
        if name is None:
            name = "deepseek_hierarchical" if plans_hierarchically(num_groups, max(num_nodes, 1)) \
                else "deepseek"   # what SGLang's "auto" resolves to
        if name not in RULE_ALGORITHMS or (str(name).startswith("elasticity_aware") and self._ranks_down(gpus)):
            return None
        return name

    def _answer(self, name: str, tokens_per_expert, num_physical_experts: int, num_local_physical_experts: int,
                num_groups: int | None, num_nodes: int, algorithm: Any = None):
        gpus = num_physical_experts // num_local_physical_experts
        loads = to_numpy(tokens_per_expert)   # the rule checks and converts the counts once
        if loads.ndim == 2:
            loads = loads[None]
        _, num_layers, num_experts = loads.shape
        nodes = num_nodes if num_nodes >= 1 and gpus % num_nodes == 0 else 1
        groups = num_groups if RULE_ALGORITHMS[name] else None
        current = None
        old = self.current_map()
        if old is not None:
            old = to_numpy(old, np.int64)
            if old.shape == (num_layers, num_physical_experts):
                current = Placement(old, num_experts, gpus, nodes, allow_colocated=True)
        if current is None:  # no map to migrate from: a fresh plan
            solver, limit = solver_settings()
            placement = plan_placement(loads.sum(axis=0), num_physical_experts, groups, nodes, gpus, solver=solver,
                                       time_limit_s=limit)
        else:
            key = (num_layers, num_experts, num_physical_experts, gpus, nodes, groups)
            session = self.sessions.get(key)
            if session is None:   # the settings are read once per model, with its rule
                session = self._new_session(num_layers, num_experts, gpus, nodes, groups, len(loads),
                                            num_local_physical_experts)
            placement, session = session.decide(loads, current)
            answer = placement_tensors(placement)
            if session.split_layers is not None:
                FLAGS.offer((num_layers, num_experts), session.split_layers)
            self.sessions[key] = session   # only a call that answered advances the rule
            return answer
        return placement_tensors(placement)

    def _ranks_down(self, gpus: int) -> bool:
        active = self.active_ranks()
        return active is not None and int(active.sum()) < gpus   # SGLang's own test for its elastic branch

    def _hand_back(self, *args):
        if self.fallback is None:
            raise InputError("sglang", "SGLang's own EPLB algorithm to hand this call back to (install the hook with "
                             "install_rebalance_hook, which keeps it)", "no fallback")
        self.handed_back += 1
        return self.fallback(*args)

    def _new_session(self, num_layers: int, num_experts: int, gpus: int, nodes: int, groups: int | None,
                     window: int, local_slots: int) -> RuleSession:
        config = self.config or load_engine_config()
        engine = self.engine_model(num_layers, num_experts, local_slots)
        said = self.interval()
        interval, window = config.cadence(said, window if said is not None else None)
        where = "SGLang's --eplb-rebalance-num-iterations" if said is not None else "the config: SGLang did not say"
        return RuleSession.start(config, "SGLang", engine, interval, window,
                                 f"every {interval} passes, window {window} passes ({where})", gpus, nodes,
                                 num_layers, num_experts, groups, self.migration(),
                                 split="sglang-dynamic" if check_split_setting(True, "MOE_PLACE_SGLANG") else None)


@dataclass
class RebalanceHook:
    """What `install_rebalance_hook` replaced, so that `uninstall_rebalance_hook` can put it back."""

    module: Any
    previous: Any
    hook: PaybackRebalance
    active: bool = True
    manager_patch: tuple[Any, Any] | None = None   # (EPLBManager, its own __init__) where this call wrapped it


def install_rebalance_hook(hook: PaybackRebalance | None = None) -> RebalanceHook:
    """Make SGLang's EPLB rebalance run `hook` (default: `PaybackRebalance()`), with SGLang's own function
    as its fallback, and record the EPLB managers SGLang builds from now on (for the expert size);
    InputError without SGLang. The settings are checked here (`check_settings`): a bad one is an InputError now,
    at the scheduler's start."""
    try:
        module = importlib.import_module(ALGORITHMS_MODULE)
    except ImportError:
        raise InputError("sglang", f"an importable SGLang with {ALGORITHMS_MODULE}", "not importable") from None
    hook = hook or PaybackRebalance()
    check_settings(hook)
    warm_up()   # the rule's one-time costs now, not in SGLang's first rebalance
    if hook.fallback is None:
        hook.fallback = module.rebalance_experts
    handle = RebalanceHook(module, module.rebalance_experts, hook)
    manager_module = sys.modules.get(sglang_managers.MANAGER_MODULE)
    if manager_module is None:
        try:
            manager_module = importlib.import_module(sglang_managers.MANAGER_MODULE)
        except ImportError:
            manager_module = None
    if manager_module is not None:
        init = getattr(getattr(manager_module, "EPLBManager", None), "__init__", None)
        if sglang_managers.watch_managers(manager_module):
            handle.manager_patch = (manager_module.EPLBManager, init)
    module.rebalance_experts = handle.hook
    return handle


def check_settings(hook: PaybackRebalance) -> None:
    """The hook's settings against what SGLang says now (InputError naming the field): the `MOE_PLACE_*` values,
    `MOE_PLACE_SPLIT` (per-batch only with `--ep-dispatch-algorithm lp`, the path it takes), and, where the
    running SGLang has published them, its rebalance interval and migration (the model is checked at the first
    call: its weights load later)."""
    config = hook.config or load_engine_config()
    algorithm = sglang_dispatch_algorithm()
    if check_split_setting(True, "MOE_PLACE_SGLANG") and algorithm is not None and algorithm != "lp":
        raise InputError(SPLIT_ENV, "per-batch with --ep-dispatch-algorithm lp (the dispatch path the split takes)",
                         f"--ep-dispatch-algorithm {algorithm}")
    config.cadence(hook.interval())
    config.resolved_migration(hook.migration())


def uninstall_rebalance_hook(handle: RebalanceHook) -> None:
    """Undo `install_rebalance_hook` (a second call is a no-op)."""
    if handle.active:
        handle.module.rebalance_experts = handle.previous
        if handle.manager_patch is not None:
            manager, init = handle.manager_patch
            manager.__init__ = init
        handle.active = False
