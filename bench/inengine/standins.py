"""Stand-ins for the rebalance machinery of vLLM 0.33.0 and SGLang 0.5.23, for CI (no engine installed).

Each stand-in is shaped like the engine's own call path, written from its sources (read, not copied):

- `StandinVllmEplb`: vLLM 0.33.0 `vllm/distributed/eplb/eplb_state.py` (`EplbState.add_model`, `step`,
  `_should_record_current_step`, `rearrange`, `_commit_eplb_maps`, `_move_to_workspace`) and
  `async_worker.py` (`run_rebalance_experts`, `transfer_run_periodically`):
  * `add_model(model, model_config)` (a method, as vLLM's, which moe-place's `install()` wraps to read the
    model's expert weights, `model.expert_weights`, and the cadence): looks the policy up, builds the maps;
  * start map linear: slot `p < E` holds expert `p`, redundant slot `E + i` expert `i % E`, every layer;
  * the rearrangement counter starts at `step_interval - step_interval // 4`; each step copies the pass's
    physical counts into a ring buffer of `window_size` steps when `step_interval - counter <=
    window_size`, or, with `log_stats` (vLLM's `log_balancedness`, `gpu_model_runner.py` passes it to
    `step`), also when the next balancedness log (every `log_balancedness_interval` steps) is within
    `window_size` steps (the router adds to the pass only while the shared record flag, set at the end
    of the previous step and `True` at start-up, is on); the counter is then incremented, in async mode
    one pending layer is committed, and when the counter reaches `step_interval` it is reset and
    `rearrange` runs (async: not while a previous result is still being committed). Recording more
    steps for the log does not change the window the policy sees: the ring buffer holds the last
    `window_size` recorded steps, which are the last `window_size` steps either way (a test checks it);
  * `rearrange` maps the window to logical experts through the map in use, its -1 slots (elastic EP:
    slots being added or removed) sent to a dropped extra column (`masked_fill(map < 0, E)`, so their
    counts are not in the weight), sums it over the window (int64 `[layers, E]`) and calls
    `policy.rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_ranks,
    old_global_expert_indices=map in use)` (-1 slots included); the result is the map (`phy2log` only).
    Sync: committed at once. Async (vLLM's default): the worker calls the policy, then one layer is
    committed per following step, layer 0 first.
- `StandinSglangEplb`: SGLang 0.5.23 `python/sglang/srt/eplb/eplb_manager.py` (`EPLBManager.__init__`,
  `_entrypoint`, `rebalance`, `_check_rebalance_needed`), `expert_location.py` (`init_trivial`,
  `init_by_eplb`, `update`), `expert_distribution.py` (`_StatAccumulator.dump`, `_CircularBuffer`,
  `_convert_global_physical_count_to_logical_count`, `_UtilizationRateAccumulatorMixin`,
  `compute_utilization_rate`), `eplb_algorithms/__init__.py` (`EplbAlgorithm`, `rebalance_experts`,
  `compute_algorithm`) and `eplb_algorithms/elasticity_aware.py`:
  * an `EPLBManager` is built with the model's config and a getter of the model, whose
    `routed_experts_weights_of_layer` holds each MoE layer's expert tensors (moe-place reads the
    expert size there);
  * start map `trivial`: slot `p` holds expert `p % E`;
  * each forward pass appends its physical counts to a circular buffer of
    `expert_distribution_recorder_buffer_size` passes (SGLang sets it to
    `eplb_rebalance_num_iterations`), then advances the manager's generator, which rebalances after
    every `eplb_rebalance_num_iterations` (n) passes it has yielded (so on passes n+1, 2n+1, ...);
  * a rebalance converts the whole buffer to logical counts `[buffer, layers, E]` (int32) through the map
    in use and all-reduces them over the ranks (a sum: `ranks_counting_each_token` ranks record each
    token's routing where the MoE input is replicated over ranks, so the policy sees that many times the
    dispatches; 1, the default, where each rank records its own tokens); with
    `--eplb-min-rebalancing-utilization-threshold` below 1 (`min_utilization`) it is skipped while the
    mean GPU utilization (mean / max GPU load per layer, averaged over layers, over the last 1000
    passes) is above the threshold: the policy is not called; then it calls the module attribute
    `sglang.srt.eplb.eplb_algorithms.rebalance_experts(tokens_per_expert, num_physical_experts,
    num_local_physical_experts, num_groups, num_nodes, algorithm)` with an `EplbAlgorithm` member:
    `auto` -> `deepseek_hierarchical` when `num_groups` is set and a multiple of the nodes, else
    `deepseek`; with `eplb_rebalance_layers_per_chunk` unset (the default) every layer takes the
    returned `phy2log` at once;
  * the elastic branch: `elasticity_aware[_hierarchical]` reads the active ranks from
    `sglang.srt.elastic_ep.elastic_ep.ElasticEPStateManager.instance()` (`active_ranks`); with fewer
    active ranks than GPUs it plans globally over the active ranks' slots and gives each inactive rank's
    slots expert 0 with no entry in `log2phy` (no token goes there).
- The engines' default policies, `vllm_default_policy` (vLLM 0.33 `policy/default.py`
  `DefaultEplbPolicy`) and `sglang_deepseek` (SGLang 0.5.23 `eplb_algorithms/deepseek.py`): DeepSeek's
  EPLB steps as `moe_place.solvers.deepseek` implements them, with each engine's arithmetic where it
  differs from DeepSeek's `eplb.py` (whose float32 arithmetic the planner's `eplb` solver reproduces):
  * both engines accumulate pack loads in float64 (vLLM: a float64 array; SGLang: Python floats);
    `eplb.py` in float32 (`moe_place.solvers.deepseek.rebalance_steps` does either: `accumulate`, `ratio`);
  * vLLM divides float32 loads by int64 replica counts in numpy, which gives float64 (replication
    step and the per-replica loads packed onto GPUs); SGLang's torch gives float32, as `eplb.py`;
  * vLLM orders items by numpy's default (unstable) `argsort`, SGLang by torch's default sort, on the
    loads in those dtypes; vLLM then reorders each GPU's slots so that experts it keeps stay in place
    (`preserve_intragpu_slots`, which `moe_place.placement.keep_unchanged_slots` mirrors). numpy's
    `argsort` orders equal loads by the CPU's features (AVX-512, AVX2, baseline each their own way), so
    vLLM's map of a window with equal loads depends on the CPU; torch's CPU sort does not.
  The tests check these against outputs of the real policies (`tests/data/make_engine_default_expected.py`),
  vLLM's with the orders its own sort returned there replayed (`order`).
- `standin_vllm_modules()` / `standin_sglang_modules()`: module trees named like the engines' (the
  policy registry `vllm.distributed.eplb.policy.EPLB_POLICIES` with `AbstractEplbPolicy` annotated as
  0.33's, returning `phy2log` only, and `vllm.distributed.eplb.eplb_state.EplbState`;
  `sglang.srt.eplb.eplb_algorithms.rebalance_experts`, `sglang.srt.eplb.eplb_manager.EPLBManager`,
  `sglang.srt.eplb.expert_location.get_global_expert_location_metadata` and
  `sglang.srt.elastic_ep.elastic_ep.ElasticEPStateManager`), so that moe-place's `install()` and
  `install_rebalance_hook()` plug into the stand-ins exactly as into the engines. `write_sglang_tree`
  writes the SGLang tree to disk as packages (for a process spawned as SGLang spawns its schedulers).
"""

from __future__ import annotations

import abc
import importlib
import enum
import math
import sys
import types
import typing
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from moe_place.cost.models import ExpertShape, get_model
from moe_place.placement import keep_unchanged_slots
from moe_place.solvers.deepseek import numpy_group_sum, plans_hierarchically, rebalance_steps

VLLM_VERSION = "0.33.0"
SGLANG_VERSION = "0.5.23"


# ---------------------------------------------------------------------- the engines' default policies
def _numpy_order(values: np.ndarray) -> np.ndarray:
    return np.argsort(-values, axis=-1)  # numpy's default kind, as vLLM sorts


def _torch_order(values: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).sort(-1, descending=True).indices.numpy()


def _torch_group_sum(weight: np.ndarray, num_groups: int) -> np.ndarray:
    return torch.from_numpy(weight).unflatten(-1, (num_groups, -1)).sum(-1).numpy()  # SGLang sums in torch


def engine_eplb(weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int,
                flavour: str, order=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """DeepSeek EPLB's steps (`moe_place.solvers.deepseek.rebalance_steps`) with an engine's arithmetic
    (`flavour` "vllm" or "sglang", module note): pack loads in float64, vLLM's ratios in float64.

    weight: `[layers, E]` loads, taken as float32 (both engines call `.float()`). Pass `num_groups =
    num_nodes = 1` for the global policy. order: the descending sort of the packing steps, `values
    [rows, n]` -> indices (default the engine's own: numpy's `argsort` of the negated values, or torch's
    sort), which orders equal values as this machine's sort does. Returns `phy2log` int64 `[layers, P]`,
    `replica_rank` int64 `[layers, P]` (0 for an expert's first replica) and `logcnt` int64 `[layers, E]`.
    """
    vllm = flavour == "vllm"
    return rebalance_steps(np.asarray(weight, dtype=np.float32), num_replicas, num_groups, num_nodes, num_gpus,
                           order or (_numpy_order if vllm else _torch_order), accumulate=np.float64,
                           ratio=np.float64 if vllm else np.float32,
                           group_sum=numpy_group_sum if vllm else _torch_group_sum)


def vllm_default_policy(weight, num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int,
                        old_global_expert_indices=None, *, order=None) -> torch.Tensor:
    """vLLM 0.33's `DefaultEplbPolicy.rebalance_experts` (module note): `phy2log` int64 `[layers, P]`.
    order: the packing steps' sort (`engine_eplb`; the tests replay the orders vLLM's own sort returned)."""
    loads = weight.float().cpu().numpy() if hasattr(weight, "float") else np.asarray(weight, dtype=np.float32)
    hierarchical = plans_hierarchically(num_groups, num_nodes)
    phy2log, _, _ = engine_eplb(loads, num_replicas, num_groups if hierarchical else 1,
                                num_nodes if hierarchical else 1, num_ranks, "vllm", order)
    if old_global_expert_indices is not None and num_ranks > 0 and num_replicas % num_ranks == 0:
        old = np.asarray(old_global_expert_indices.cpu().numpy() if hasattr(old_global_expert_indices, "cpu")
                         else old_global_expert_indices)
        phy2log = keep_unchanged_slots(phy2log, old, num_replicas // num_ranks)
    return torch.from_numpy(np.ascontiguousarray(phy2log, dtype=np.int64))


def sglang_deepseek(weight, num_replicas: int, num_groups: int | None, num_nodes: int, num_gpus: int,
                    enable_hierarchical: bool):
    """SGLang 0.5.23's `eplb_algorithms.deepseek.rebalance_experts`: `(phy2log, log2phy, logcnt)` int64 tensors,
    `log2phy` `[layers, E, max(logcnt)]` listing each expert's slots in the order its replicas were made."""
    loads = weight.float().cpu().numpy() if hasattr(weight, "float") else np.asarray(weight, dtype=np.float32)
    groups, nodes = (num_groups, num_nodes) if enable_hierarchical else (1, 1)
    phy2log, rank, logcnt = engine_eplb(loads, num_replicas, groups, nodes, num_gpus, "sglang")
    layers, experts = logcnt.shape
    width = int(logcnt.max())
    log2phy = np.full((layers, experts * width), -1, dtype=np.int64)
    np.put_along_axis(log2phy, phy2log * width + rank, np.broadcast_to(np.arange(num_replicas), phy2log.shape), 1)
    return tuple(torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
                 for a in (phy2log, log2phy.reshape(layers, experts, width), logcnt))


# ---------------------------------------------------------------------- SGLang's elastic algorithm
def sglang_elasticity_aware(weight, num_replicas: int, num_groups: int | None, num_nodes: int, num_gpus: int,
                            enable_hierarchical: bool, active_ranks: torch.Tensor):
    """SGLang 0.5.23's `eplb_algorithms/elasticity_aware.py` `rebalance_experts`: with every rank active the
    deepseek algorithm; with fewer, a global plan over the active ranks' slots, each inactive rank's slots
    then inserted holding expert 0, `log2phy` listing active slots only."""
    active = int(active_ranks.sum())
    if active >= num_gpus:
        return sglang_deepseek(weight, num_replicas, num_groups, num_nodes, num_gpus, enable_hierarchical)
    per_gpu = num_replicas // num_gpus
    phy2log, log2phy, logcnt = sglang_deepseek(weight, per_gpu * active, 1, 1, active, False)
    layers = phy2log.shape[0]
    slices = list(phy2log.view(layers, active, per_gpu).unbind(dim=1))
    for index, up in enumerate(active_ranks.tolist()):
        if not up:
            slices.insert(index, torch.zeros_like(slices[0]))
            log2phy = torch.where(log2phy >= index * per_gpu, log2phy + per_gpu, log2phy)
    return torch.stack(slices, dim=1).reshape(layers, -1).contiguous(), log2phy, logcnt


# ---------------------------------------------------------------------- what the engines register of a model
def expert_weight_tensors(shape: ExpertShape, local_experts: int) -> list[torch.Tensor]:
    """One MoE layer's expert tensors as the engines register them, `[local_experts, ...]` each, on the meta
    device (shapes and dtypes, no memory): gate/up `[2I, H]` and down `[H, I]` in the shape's dtype (BF16
    or a 1-byte type, which vLLM registers as uint8), or one uint8 tensor of the expert's bytes otherwise."""
    dtype = {2.0: torch.bfloat16, 1.0: torch.uint8}.get(float(shape.dtype_bytes))
    if dtype is None or shape.matrices != 3:
        return [torch.empty(local_experts, shape.expert_bytes, dtype=torch.uint8, device="meta")]
    return [torch.empty(local_experts, 2 * shape.intermediate, shape.hidden, dtype=dtype, device="meta"),
            torch.empty(local_experts, shape.hidden, shape.intermediate, dtype=dtype, device="meta")]


class NoDeviceEvent:
    """`torch.Event` without a device: every event is complete at once (vLLM's rearrangement times itself with one)."""

    def __init__(self, *_, **__):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def elapsed_time(self, other) -> float:
        return 0.0


def hf_config_of(shape: ExpertShape) -> types.SimpleNamespace:
    """The model-config keys the engines read for an expert (Hugging Face names)."""
    return types.SimpleNamespace(hidden_size=shape.hidden, moe_intermediate_size=shape.intermediate,
                                 num_experts_per_tok=shape.top_k)


def _shape(model: str | ExpertShape | None) -> ExpertShape:
    return get_model(model or "Qwen3-30B-A3B") if not isinstance(model, ExpertShape) else model


# ---------------------------------------------------------------------- module trees named like the engines'
@contextmanager
def _modules(tree: dict[str, types.ModuleType]) -> Iterator[None]:
    """Put `tree` into `sys.modules` for the block, then restore what was there (the real engine included)."""
    saved = {name: sys.modules.get(name) for name in tree}
    sys.modules.update(tree)
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


class AbstractEplbPolicy(abc.ABC):
    """vLLM 0.33's policy interface (`policy/abstract.py`): a classmethod returning `phy2log` only."""

    @classmethod
    @abc.abstractmethod
    def rebalance_experts(cls, weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                          num_ranks: int, old_global_expert_indices: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError


class DefaultEplbPolicy(AbstractEplbPolicy):
    """The stand-in for vLLM 0.33's default policy (`vllm_default_policy`)."""

    @classmethod
    def rebalance_experts(cls, weight, num_replicas, num_groups, num_nodes, num_ranks,
                          old_global_expert_indices=None) -> torch.Tensor:
        return vllm_default_policy(weight, num_replicas, num_groups, num_nodes, num_ranks, old_global_expert_indices)


@contextmanager
def standin_vllm_modules() -> Iterator[dict]:
    """`vllm.distributed.eplb.policy` (registry, abstract and default policy), `vllm.distributed.eplb.eplb_state`
    (`EplbState`: `StandinVllmEplb`) and `vllm.config.parallel` (`EPLBPolicyOption`) for the block; yields the
    registry dict, which `StandinVllmEplb` reads."""
    policy = types.ModuleType("vllm.distributed.eplb.policy")
    policy.AbstractEplbPolicy = AbstractEplbPolicy
    policy.DefaultEplbPolicy = DefaultEplbPolicy
    policy.EPLB_POLICIES = {"default": DefaultEplbPolicy}
    state = types.ModuleType("vllm.distributed.eplb.eplb_state")
    state.EplbState = StandinVllmEplb
    state.EPLB_POLICIES = policy.EPLB_POLICIES
    parallel = types.ModuleType("vllm.config.parallel")
    parallel.EPLBPolicyOption = typing.Literal["default"]
    tree = {name: types.ModuleType(name) for name in ("vllm", "vllm.distributed", "vllm.distributed.eplb",
                                                      "vllm.config")}
    tree.update({"vllm.distributed.eplb.policy": policy, "vllm.distributed.eplb.eplb_state": state,
                 "vllm.config.parallel": parallel})
    with _modules(tree):
        yield policy.EPLB_POLICIES


class EplbAlgorithm(enum.Enum):
    """SGLang 0.5.23's `eplb_algorithms.EplbAlgorithm` (the members, by name)."""

    deepseek = enum.auto()
    deepseek_hierarchical = enum.auto()
    deepseek_vec = enum.auto()
    deepseek_vec_hierarchical = enum.auto()
    elasticity_aware = enum.auto()
    elasticity_aware_hierarchical = enum.auto()


def compute_algorithm(raw_algorithm: str, num_groups: int | None, num_nodes: int) -> EplbAlgorithm:
    """SGLang's `compute_algorithm`: "auto" -> `deepseek_hierarchical` when the groups split over the nodes."""
    if raw_algorithm != "auto":
        return EplbAlgorithm[raw_algorithm]
    hierarchical = plans_hierarchically(num_groups, num_nodes)
    return EplbAlgorithm.deepseek_hierarchical if hierarchical else EplbAlgorithm.deepseek


class ElasticEPStateManager:
    """SGLang 0.5.23's `elastic_ep.ElasticEPStateManager` as `rebalance_experts` reads it: `instance()`, None
    unless elastic EP runs (then every rank counts as healthy), else a state with `active_ranks`."""

    _instance = None

    @classmethod
    def instance(cls):
        return cls._instance

    @classmethod
    def healthy_rank_state(cls, *, ep_size: int) -> torch.Tensor:
        return torch.ones(ep_size, dtype=torch.int32)


def sglang_rebalance_experts(tokens_per_expert: torch.Tensor, num_physical_experts: int,
                             num_local_physical_experts: int, num_groups: int | None, num_nodes: int,
                             algorithm: EplbAlgorithm):
    """SGLang's `eplb_algorithms.rebalance_experts` for the deepseek and elasticity-aware algorithms: the
    per-pass counts summed; the elastic ones read the active ranks from `ElasticEPStateManager`."""
    gpus = num_physical_experts // num_local_physical_experts
    weight = tokens_per_expert.sum(dim=0)
    if algorithm in (EplbAlgorithm.deepseek, EplbAlgorithm.deepseek_hierarchical):
        return sglang_deepseek(weight, num_physical_experts, num_groups, num_nodes, gpus,
                               algorithm == EplbAlgorithm.deepseek_hierarchical)
    if algorithm in (EplbAlgorithm.elasticity_aware, EplbAlgorithm.elasticity_aware_hierarchical):
        manager = importlib.import_module("sglang.srt.elastic_ep.elastic_ep").ElasticEPStateManager  # lazily, as SGLang
        state = manager.instance()
        active = state.active_ranks if state is not None else manager.healthy_rank_state(ep_size=gpus)
        return sglang_elasticity_aware(weight, num_physical_experts, num_groups, num_nodes, gpus,
                                       algorithm == EplbAlgorithm.elasticity_aware_hierarchical, active)
    raise NotImplementedError(algorithm)


class EPLBManager:
    """The part of SGLang 0.5.23's `EPLBManager.__init__` moe-place sees: keyword arguments, among them the
    model's config and a getter of the model (read at rebalance time: the model loads after)."""

    def __init__(self, *, model_config, get_model, get_expert_location_updater=None, get_expert_backup_client=None,
                 get_weight_updater=None):
        self.model_config, self.get_model = model_config, get_model


@dataclass
class _Metadata:
    """The part of SGLang's `ExpertLocationMetadata` the hook and the harness read: the map in use on the CPU
    and the slots of each expert (`[layers, E, X]`, -1 padded; None until the first rebalance)."""

    physical_to_logical_map_cpu: torch.Tensor
    logical_to_all_physical_map_cpu: torch.Tensor | None = None


def _sglang_tree(num_iterations: int, layers_per_chunk: int | None = None) -> dict[str, types.ModuleType]:
    algorithms = types.ModuleType("sglang.srt.eplb.eplb_algorithms")
    algorithms.EplbAlgorithm = EplbAlgorithm
    algorithms.rebalance_experts = sglang_rebalance_experts
    algorithms.compute_algorithm = compute_algorithm
    manager = types.ModuleType("sglang.srt.eplb.eplb_manager")
    manager.EPLBManager = type("EPLBManager", (EPLBManager,), {})   # a class per tree: a hook patches its own
    location = types.ModuleType("sglang.srt.eplb.expert_location")
    location.metadata = None
    location.get_global_expert_location_metadata = lambda: location.metadata
    elastic = types.ModuleType("sglang.srt.elastic_ep.elastic_ep")
    elastic.ElasticEPStateManager = type("ElasticEPStateManager", (ElasticEPStateManager,), {"_instance": None})
    runtime = types.ModuleType("sglang.srt.runtime_context")
    exec_args = types.SimpleNamespace(moe=types.SimpleNamespace(eplb_rebalance_num_iterations=num_iterations,
                                                                eplb_rebalance_layers_per_chunk=layers_per_chunk))
    runtime.get_exec = lambda: exec_args
    tree = {name: types.ModuleType(name) for name in ("sglang", "sglang.srt", "sglang.srt.eplb",
                                                      "sglang.srt.elastic_ep")}
    tree.update({"sglang.srt.eplb.eplb_algorithms": algorithms, "sglang.srt.eplb.eplb_manager": manager,
                 "sglang.srt.eplb.expert_location": location, "sglang.srt.elastic_ep.elastic_ep": elastic,
                 "sglang.srt.runtime_context": runtime})
    return tree


@contextmanager
def standin_sglang_modules(num_iterations: int = 1000) -> Iterator[tuple[types.ModuleType, types.ModuleType]]:
    """`sglang.srt.eplb.eplb_algorithms`, `.eplb_manager`, `.expert_location` and
    `sglang.srt.elastic_ep.elastic_ep` for the block; yields the first and the third: `StandinSglangEplb` calls
    the algorithms module's `rebalance_experts` attribute (which the hook replaces), builds an `EPLBManager`
    and publishes its map through the expert-location module. Also `sglang.srt.runtime_context`, whose
    `get_exec().moe` holds the server's `eplb_rebalance_num_iterations` (`num_iterations`) and
    `eplb_rebalance_layers_per_chunk` (None: every layer at once, SGLang's default), where SGLang 0.5.23's
    running server publishes them (`sglang/srt/runtime_context.py`) and the hook reads them."""
    tree = _sglang_tree(num_iterations)
    with _modules(tree):
        yield tree["sglang.srt.eplb.eplb_algorithms"], tree["sglang.srt.eplb.expert_location"]


def write_sglang_tree(root: Path, num_iterations: int = 1000) -> None:
    """The stand-in SGLang tree as packages under `root` (`root/sglang/srt/eplb/eplb_algorithms/__init__.py`,
    ...), each re-exporting this module's stand-ins (`bench/inengine` is imported from `bench/`), for a
    process that imports `sglang.srt.eplb...` from disk, as a spawned SGLang scheduler does."""
    bench = Path(__file__).resolve().parents[1]
    prelude = f"import sys\nsys.path.insert(0, {str(bench)!r})\nfrom inengine import standins as _s\n"
    files = {
        "sglang/__init__.py": "", "sglang/srt/__init__.py": "", "sglang/srt/eplb/__init__.py": "",
        "sglang/srt/elastic_ep/__init__.py": "",
        "sglang/srt/eplb/eplb_algorithms/__init__.py":
            prelude + "EplbAlgorithm = _s.EplbAlgorithm\nrebalance_experts = _s.sglang_rebalance_experts\n"
                      "compute_algorithm = _s.compute_algorithm\n",
        "sglang/srt/eplb/eplb_manager.py": prelude + "class EPLBManager(_s.EPLBManager):\n    pass\n",
        "sglang/srt/eplb/expert_location.py":
            "metadata = None\n\n\ndef get_global_expert_location_metadata():\n    return metadata\n",
        "sglang/srt/elastic_ep/elastic_ep.py":
            prelude + "class ElasticEPStateManager(_s.ElasticEPStateManager):\n    _instance = None\n",
        "sglang/srt/runtime_context.py":
            "import types\n_exec = types.SimpleNamespace(moe=types.SimpleNamespace(eplb_rebalance_num_iterations="
            f"{int(num_iterations)}, eplb_rebalance_layers_per_chunk=None))\n\n\ndef get_exec():\n    return _exec\n",
    }
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


# ---------------------------------------------------------------------- the engines' rebalance machinery
class StandinVllmEplb:
    """vLLM 0.33's `EplbState` for one model, as far as it decides maps (module note).

    Drive it like vLLM's model runner: before each forward pass read `record` (the shared flag the
    router checks); if set, add the pass's physical counts with `add_pass_load`; after the pass call
    `step()`. `physical_to_logical_map` is the map in use `[layers, P]`. model: the expert shape the model's
    registered weights have (a preset name or shape; default Qwen3-30B-A3B), named `model_name`.
    log_stats / log_interval: vLLM's `log_balancedness` and `log_balancedness_interval`. forward: the forward
    pass's state (`EplbModelState`), whose MoE layers the model registers (`model.moe_layers`), or None.
    """

    def __init__(self, policies: dict, num_layers: int, num_experts: int, num_redundant: int, num_gpus: int,
                 num_nodes: int, num_groups: int, step_interval: int = 3000, window_size: int = 1000,
                 use_async: bool = True, policy: str = "default", model: str | ExpertShape | None = None,
                 model_name: str | None = None, log_stats: bool = False, log_interval: int = 1,
                 forward: "EplbModelState | None" = None):
        self.policies, self.policy_name = policies, policy
        self.parallel_config = types.SimpleNamespace(eplb_config=types.SimpleNamespace(
            step_interval=step_interval, window_size=window_size, use_async=use_async, policy=policy,
            log_balancedness=log_stats, log_balancedness_interval=log_interval))
        self.num_gpus, self.num_groups = num_gpus, num_groups
        self.num_nodes = num_nodes if num_gpus % num_nodes == 0 else 1
        self.window_size, self.step_interval, self.use_async = window_size, step_interval, use_async
        self.log_stats, self.log_interval = log_stats, log_interval
        shape = _shape(model)
        physical = num_experts + num_redundant
        layer = expert_weight_tensors(shape, physical // num_gpus)
        standin = types.SimpleNamespace(num_moe_layers=num_layers, num_logical_experts=num_experts,
                                        num_routed_experts=num_experts, num_redundant_experts=num_redundant,
                                        num_physical_experts=physical, expert_weights=[layer] * num_layers,
                                        moe_layers=[] if forward is None else forward.model.moe_layers)
        config = types.SimpleNamespace(model=model_name or shape.name, hf_text_config=hf_config_of(shape))
        self.add_model(standin, config)

    def add_model(self, model, model_config) -> None:
        """vLLM's `add_model`: the policy looked up once, the linear start map, the pass and the window."""
        self.policy = self.policies[self.policy_name]
        self.num_experts, num_layers = model.num_logical_experts, model.num_moe_layers
        self.num_physical = model.num_physical_experts
        linear = list(range(self.num_experts)) + [i % self.num_experts for i in range(model.num_redundant_experts)]
        self.physical_to_logical_map = torch.tensor(linear).unsqueeze(0).expand(num_layers, -1).contiguous()
        self.expert_load_pass = torch.zeros((num_layers, self.num_physical), dtype=torch.int32)
        self.window = torch.zeros((self.window_size, num_layers, self.num_physical), dtype=torch.int32)
        self.window_step = 0
        self.rearrangement_step = max(0, self.step_interval - self.step_interval // 4)
        self.record = True  # the router's flag, on at start-up
        self.pending: list | None = None  # async: [new map, next layer to commit]

    def add_pass_load(self, physical_counts: torch.Tensor) -> None:
        self.expert_load_pass += physical_counts.to(torch.int32)

    def _should_record(self) -> bool:
        for_rearrange = self.step_interval - self.rearrangement_step <= self.window_size
        if not self.log_stats:
            return for_rearrange
        until_log = (self.log_interval - self.rearrangement_step % self.log_interval) % self.log_interval
        return for_rearrange or until_log <= self.window_size

    def step(self) -> None:
        if self._should_record():
            self.window[self.window_step].copy_(self.expert_load_pass)
            self.expert_load_pass.zero_()
            self.window_step = (self.window_step + 1) % self.window_size
        self.rearrangement_step += 1
        if self.pending is not None:  # async: the worker's next layer is ready; commit it
            new, layer = self.pending
            self.physical_to_logical_map[layer] = new[layer]
            self.pending = None if layer + 1 == len(new) else [new, layer + 1]
        if self.rearrangement_step >= self.step_interval:
            if self.pending is None:
                self.rearrangement_step = 0
                self.rearrange()
        self.record = self._should_record()

    def rearrange(self) -> None:
        layers = self.physical_to_logical_map.shape[0]
        logical = torch.zeros((self.window_size, layers, self.num_experts + 1), dtype=self.window.dtype)
        index = self.physical_to_logical_map.masked_fill(self.physical_to_logical_map < 0, self.num_experts)
        logical.scatter_add_(-1, index.unsqueeze(0).expand_as(self.window).long(), self.window)
        weight = logical[..., :-1].sum(dim=0)  # int64 [layers, E], -1 slots' counts dropped
        old = self.physical_to_logical_map.cpu()  # async: the worker's snapshot, taken before any commit
        new = self.policy.rebalance_experts(weight.cpu(), self.num_physical, self.num_groups, self.num_nodes,
                                            self.num_gpus, old)
        if not isinstance(new, torch.Tensor) or new.device.type != "cpu":
            raise TypeError(f"vLLM {VLLM_VERSION} expects the policy to return phy2log, a CPU tensor; got {type(new)}")
        if self.use_async:
            self.pending = [new, 0]
        else:
            self.physical_to_logical_map.copy_(new)


class StandinSglangEplb:
    """SGLang 0.5.23's EPLB manager, recorder and expert location for one model (module note).

    Drive it like SGLang's model runner: after each forward pass call `on_forward_pass(physical_counts)`.
    `metadata.physical_to_logical_map_cpu` is the map in use `[layers, P]` (`logical_to_all_physical_map_cpu`
    the slots each expert's tokens go to). `modules`: the algorithms module, whose `rebalance_experts`
    attribute is called, and the expert-location module that publishes the metadata
    (`standin_sglang_modules()`); the manager and elastic-state modules are SGLang's names in `sys.modules`.
    model / model_name: the expert shape of the model's weights and its name (default Qwen3-30B-A3B);
    dense_layers: model layers without experts (zero rows in the counts, no weights). active_ranks: SGLang's
    elastic state (None: no elastic EP). min_utilization: `--eplb-min-rebalancing-utilization-threshold`.
    ranks_counting_each_token: ranks whose recorders count each token (the all-reduce sums them).
    calls / skipped: the rebalances that called the algorithm, and those `_check_rebalance_needed` skipped.
    """

    HISTORY = 1000   # SGLang's EPLB_BALANCEDNESS_WINDOW_SIZES[-1]: the passes the utilization is averaged over

    def __init__(self, modules: tuple[types.ModuleType, types.ModuleType], num_layers: int, num_experts: int,
                 num_redundant: int, num_gpus: int, num_nodes: int, num_groups: int | None,
                 num_iterations: int = 1000, buffer_size: int | None = None, algorithm: str = "auto",
                 model: str | ExpertShape | None = None, model_name: str | None = None,
                 dense_layers: tuple[int, ...] = (), active_ranks: torch.Tensor | None = None,
                 min_utilization: float = 1.0, ranks_counting_each_token: int = 1):
        self.algorithms, location = modules
        self.num_layers, self.num_experts, self.num_gpus = num_layers, num_experts, num_gpus
        self.num_nodes, self.num_groups, self.raw_algorithm = num_nodes, num_groups, algorithm
        self.num_physical = num_experts + num_redundant
        shape = _shape(model)
        weights = {layer: expert_weight_tensors(shape, self.num_physical // num_gpus)
                   for layer in range(num_layers) if layer not in set(dense_layers)}
        model_object = types.SimpleNamespace(routed_experts_weights_of_layer=weights)
        config = types.SimpleNamespace(model_path=model_name or shape.name, hf_config=hf_config_of(shape))
        self.manager = sys.modules["sglang.srt.eplb.eplb_manager"].EPLBManager(
            model_config=config, get_model=lambda: model_object)
        elastic = sys.modules["sglang.srt.elastic_ep.elastic_ep"].ElasticEPStateManager
        elastic._instance = None if active_ranks is None else types.SimpleNamespace(active_ranks=active_ranks)
        trivial = torch.arange(self.num_physical).repeat(num_layers, 1) % num_experts
        self.metadata = _Metadata(trivial)
        location.metadata = self.metadata
        size = num_iterations if buffer_size is None else buffer_size
        if num_iterations < size:
            raise ValueError("eplb_rebalance_num_iterations must be at least the recorder's buffer size")
        self.buffer = torch.zeros((size, num_layers, self.num_physical), dtype=torch.int32)
        self.buffer_index = 0
        self.num_iterations = num_iterations
        self.min_utilization, self.ranks_counting_each_token = min_utilization, ranks_counting_each_token
        self.history: deque = deque(maxlen=self.HISTORY)
        self.calls = self.skipped = 0
        self._generator = self._entrypoint()

    def on_forward_pass(self, physical_counts: torch.Tensor) -> None:
        self.buffer[self.buffer_index] = physical_counts.to(torch.int32)
        self.buffer_index = (self.buffer_index + 1) % len(self.buffer)
        if not math.isclose(self.min_utilization, 1.0):   # the recorder tracks utilization only then
            gpu = physical_counts.float().reshape(self.num_layers, self.num_gpus, -1).sum(-1)
            self.history.append(float(((gpu.mean(-1) + 1e-5) / (gpu.max(-1).values + 1e-5)).mean()))
        next(self._generator)

    def _entrypoint(self):
        while True:
            for _ in range(self.num_iterations):
                yield
            self.rebalance()

    def _rebalance_needed(self) -> bool:
        if math.isclose(self.min_utilization, 1.0):
            return True   # SGLang reports no utilization then
        utilization = sum(self.history) / len(self.history) if self.history else 0.0
        return utilization <= self.min_utilization

    def rebalance(self) -> None:
        current = self.metadata.physical_to_logical_map_cpu
        logical = torch.zeros((len(self.buffer), self.num_layers, self.num_experts), dtype=self.buffer.dtype)
        logical.scatter_add_(2, current.unsqueeze(0).expand(len(self.buffer), -1, -1).long(), self.buffer)
        logical = logical * self.ranks_counting_each_token   # the all-reduce: a sum over the ranks' records
        if not self._rebalance_needed():
            self.skipped += 1
            return
        algorithm = self.algorithms.compute_algorithm(self.raw_algorithm, self.num_groups, self.num_nodes)
        phy2log, log2phy, _ = self.algorithms.rebalance_experts(
            tokens_per_expert=logical, num_physical_experts=self.num_physical,
            num_local_physical_experts=self.num_physical // self.num_gpus, num_groups=self.num_groups,
            num_nodes=self.num_nodes, algorithm=algorithm)
        self.calls += 1
        self.metadata.physical_to_logical_map_cpu = phy2log.to(torch.int64).cpu().clone()
        self.metadata.logical_to_all_physical_map_cpu = log2phy.to(torch.int64).cpu().clone()


# ---------------------------------------------------------------------- the replica choice (per-batch split)
# vLLM 0.33's router and EPLB map commits, and SGLang 0.5.23's `lp` dispatch path, as far as the split touches
# them (read in `fused_moe/router/base_router.py`, `distributed/eplb/eplb_state.py`; `srt/eplb/lplb_solver.py`,
# `srt/model_executor/model_runner_components/moe_ep_setup.py`, `srt/eplb/expert_location_dispatch.py`,
# `srt/layers/moe/topk.py`). The LP itself (SGLang's CUDA interior-point solver) is stood in for by the even
# split: what the stand-in keeps is where SGLang calls what, with which arguments, and the collective.
KNUTH_MULTIPLIER = 2654435769


@dataclass
class EplbLayerState:
    """vLLM's `EplbLayerState`: one MoE layer's views of the model's EPLB tensors (`set_layer_state`) and the
    shared record flag and unpadded-token counts."""

    expert_load_view: torch.Tensor | None = None
    logical_to_physical_map: torch.Tensor | None = None
    logical_replica_count: torch.Tensor | None = None
    should_record_tensor: torch.Tensor | None = None
    num_unpadded_tokens_tensors: list | None = None

    def set_layer_state(self, moe_layer_idx: int, expert_load_view, logical_to_physical_map,
                        logical_replica_count) -> None:
        self.expert_load_view = expert_load_view[moe_layer_idx]
        self.logical_to_physical_map = logical_to_physical_map[moe_layer_idx]
        self.logical_replica_count = logical_replica_count[moe_layer_idx]


def eplb_map_to_physical_and_record(topk_ids, expert_load_view, logical_to_physical_map, logical_replica_count,
                                    record_enabled, num_unpadded_tokens=None):
    """vLLM's mapping as its CUDA kernel computes it: replica `hash(token index) % replicas` (Knuth), and one
    added to the chosen slot per dispatch of an unpadded token while `record_enabled`."""
    flat = topk_ids.reshape(-1).long()
    k = topk_ids.shape[-1] if topk_ids.dim() > 1 else 1
    index = torch.arange(flat.numel())
    valid = (flat >= 0) & (flat < logical_replica_count.shape[0])
    safe = torch.where(valid, flat, 0)
    replicas = logical_replica_count[safe].long().clamp(min=1)
    replica = ((index // k) * KNUTH_MULTIPLIER & 0xFFFFFFFF) % replicas
    physical = torch.where(valid, logical_to_physical_map[safe, replica].long(), -1)
    keep = valid & (physical >= 0) & (physical < expert_load_view.shape[0]) & record_enabled.bool()
    if num_unpadded_tokens is not None:
        keep &= index < num_unpadded_tokens * k
    expert_load_view.index_add_(0, physical.clamp(min=0), keep.to(expert_load_view.dtype))
    return physical.to(topk_ids.dtype).reshape(topk_ids.shape)


class BaseRouter:
    """vLLM's `BaseRouter` as its forward pass runs it: routing (here a plain softmax top-k), then
    `_apply_eplb_mapping`, which calls the module's `eplb_map_to_physical_and_record` with the layer's state."""

    def __init__(self, top_k: int, global_num_experts: int, eplb_state: EplbLayerState | None = None):
        self.top_k, self.global_num_experts, self.eplb_state = top_k, global_num_experts, eplb_state

    def _apply_eplb_mapping(self, topk_ids):
        state = self.eplb_state
        if state is None:
            return topk_ids
        mapping = sys.modules["vllm.model_executor.layers.fused_moe.router.base_router"].eplb_map_to_physical_and_record
        return mapping(topk_ids=topk_ids, logical_to_physical_map=state.logical_to_physical_map,
                       logical_replica_count=state.logical_replica_count, expert_load_view=state.expert_load_view,
                       record_enabled=state.should_record_tensor,
                       num_unpadded_tokens=state.num_unpadded_tokens_tensors[0])

    def select_experts(self, hidden_states, router_logits):
        weights, ids = torch.softmax(router_logits.float(), dim=-1).topk(self.top_k, dim=-1)
        return weights.to(hidden_states.dtype), self._apply_eplb_mapping(ids.to(torch.int32))


def compute_logical_maps(phy2log: torch.Tensor, num_experts: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's `compute_logical_maps` of `phy2log [layers, P]` (slots ascending, -1 padded to `width`)."""
    layers, physical = phy2log.shape
    log2phy = torch.full((layers, num_experts, width), -1, dtype=torch.int64)
    count = torch.zeros((layers, num_experts), dtype=torch.int64)
    for slot in range(physical):
        rows = torch.arange(layers)
        experts = phy2log[:, slot].long()
        ok = experts >= 0
        log2phy[rows[ok], experts[ok], count[rows[ok], experts[ok]]] = slot
        count[rows[ok], experts[ok]] += 1
    return log2phy, count


class EplbModelState:
    """vLLM's `EplbModelState` for the forward pass: the maps the routers read (`[layers, ...]`), the pass's
    load, the shared record flag, and a model whose `moe_layers` hold each layer's `BaseRouter` (the class of the
    router module in `sys.modules`: `standin_vllm_forward`)."""

    def __init__(self, phy2log: torch.Tensor, num_experts: int, top_k: int, num_redundant: int):
        layers, physical = phy2log.shape
        router_class = sys.modules["vllm.model_executor.layers.fused_moe.router.base_router"].BaseRouter
        self.physical_to_logical_map = phy2log.clone().long()
        self.logical_to_physical_map, self.logical_replica_count = compute_logical_maps(
            self.physical_to_logical_map, num_experts, num_redundant + 1)
        self.expert_load_pass = torch.zeros((layers, physical), dtype=torch.int32)
        self.should_record_tensor = torch.ones((), dtype=torch.bool)
        self.num_unpadded_tokens_tensors = [torch.tensor(0)]
        routers = []
        for layer in range(layers):
            state = EplbLayerState(should_record_tensor=self.should_record_tensor,
                                   num_unpadded_tokens_tensors=self.num_unpadded_tokens_tensors)
            state.set_layer_state(layer, self.expert_load_pass, self.logical_to_physical_map,
                                  self.logical_replica_count)
            routers.append(router_class(top_k, num_experts, state))
        self.model = types.SimpleNamespace(num_moe_layers=layers, num_logical_experts=num_experts,
                                           moe_layers=[types.SimpleNamespace(router=r, eplb_state=r.eplb_state)
                                                       for r in routers])


def _commit_eplb_maps(model_state: EplbModelState, new_physical_to_logical_map: torch.Tensor) -> None:
    """vLLM's `_commit_eplb_maps`: every layer's maps at once (sync mode)."""
    model_state.physical_to_logical_map.copy_(new_physical_to_logical_map)
    log2phy, count = compute_logical_maps(model_state.physical_to_logical_map, model_state.model.num_logical_experts,
                                          model_state.logical_to_physical_map.shape[-1])
    model_state.logical_to_physical_map.copy_(log2phy)
    model_state.logical_replica_count.copy_(count)


def _commit_eplb_maps_for_layer(model_state: EplbModelState, new_physical_to_logical_map: torch.Tensor,
                                layer: int) -> None:
    """vLLM's `_commit_eplb_maps_for_layer`: one layer's maps (async mode, one layer per step)."""
    model_state.physical_to_logical_map[layer].copy_(new_physical_to_logical_map)
    log2phy, count = compute_logical_maps(new_physical_to_logical_map[None], model_state.model.num_logical_experts,
                                          model_state.logical_to_physical_map.shape[-1])
    model_state.logical_to_physical_map[layer].copy_(log2phy[0])
    model_state.logical_replica_count[layer].copy_(count[0])


@dataclass
class GroupCoordinator:
    """The part of vLLM's and SGLang's `GroupCoordinator` the split uses, over a torch.distributed group (gloo in
    the tests): `device_group`, `cpu_group`, `rank_in_group`, `world_size`, `all_reduce` (a sum, returned)."""

    device_group: object = None
    cpu_group: object = None
    rank_in_group: int = 0
    world_size: int = 1

    @classmethod
    def world(cls) -> "GroupCoordinator":
        import torch.distributed as dist

        group = dist.group.WORLD
        return cls(group, group, dist.get_rank(), dist.get_world_size())

    def all_reduce(self, tensor):
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(tensor, group=self.device_group)
        return tensor


def _vllm_forward_modules(group: GroupCoordinator) -> dict[str, types.ModuleType]:
    router = types.ModuleType("vllm.model_executor.layers.fused_moe.router.base_router")
    router.BaseRouter = type("BaseRouter", (BaseRouter,), {})   # a class per tree: the split patches its own
    router.eplb_map_to_physical_and_record = eplb_map_to_physical_and_record
    router.dbo_current_ubatch_id = lambda: 0
    parallel = types.ModuleType("vllm.distributed.parallel_state")
    parallel.get_ep_group = lambda: group
    return {"vllm.model_executor.layers.fused_moe.router.base_router": router,
            "vllm.distributed.parallel_state": parallel}


@contextmanager
def standin_vllm_forward(group: GroupCoordinator | None = None) -> Iterator[dict]:
    """`standin_vllm_modules()` plus the forward pass's modules: the router (`BaseRouter`, its mapping) and
    `get_ep_group()` returning `group` (default: one rank), with the commit functions in the EPLB state module.
    Yields the module tree (by name)."""
    group = group or GroupCoordinator()
    with standin_vllm_modules():
        state = sys.modules["vllm.distributed.eplb.eplb_state"]
        state._commit_eplb_maps, state._commit_eplb_maps_for_layer = _commit_eplb_maps, _commit_eplb_maps_for_layer
        state.EplbLayerState = EplbLayerState
        tree = _vllm_forward_modules(group)
        tree.update({name: types.ModuleType(name) for name in (
            "vllm.model_executor", "vllm.model_executor.layers", "vllm.model_executor.layers.fused_moe",
            "vllm.model_executor.layers.fused_moe.router")})
        with _modules(tree):
            yield {name: sys.modules[name] for name in (*tree, "vllm.distributed.eplb.eplb_state",
                                                        "vllm.distributed.eplb.policy")}


# SGLang's lp path
LPLB_SUPPORTED_MODEL_ARCHS = frozenset({"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"})   # part of SGLang's list


def assert_lplb_supported_model(architecture: str) -> None:
    """SGLang's gate: `lp` only for the model classes whose empty-token ranks still call `solve`."""
    if architecture not in LPLB_SUPPORTED_MODEL_ARCHS:
        raise NotImplementedError(f"{architecture} does not support --ep-dispatch-algorithm lp")


class LPLBSolver:
    """SGLang's `LPLBSolver` as the top-k calls it: `solve(topk_ids)` counts this rank's dispatches, all-reduces
    them over `ep_group` (every rank, an empty batch too) and returns `log2phy_prob [E, X]`. The LP on the GPU is
    stood in for by the even split (1 / replicas)."""

    def __init__(self, phy2log, log2phy, num_gpus, ep_group=None, logical_to_all_physical_map_num_valid=None):
        if phy2log.shape[0] % num_gpus:
            raise ValueError("LPLBSolver requires num_phy to be divisible by num_gpus")
        self.num_gpus, self.ep_group, self.log2phy = num_gpus, ep_group, log2phy.long()
        self.num_logical = log2phy.shape[0]

    def solve(self, topk_ids):
        local = torch.zeros(self.num_logical, dtype=torch.int32)
        local.scatter_add_(0, topk_ids.flatten().long(), torch.ones(topk_ids.numel(), dtype=torch.int32))
        counts = local.float()
        if self.ep_group is not None:
            counts = self.ep_group.all_reduce(counts)
        valid = (self.log2phy >= 0).float()
        return valid / valid.sum(dim=1, keepdim=True).clamp(min=1)


@dataclass
class ExpertLocationMetadata:
    """The part of SGLang's `ExpertLocationMetadata` the lp path reads (`[layers, ...]`; X = P, -1 padded)."""

    physical_to_logical_map: torch.Tensor
    logical_to_all_physical_map: torch.Tensor
    logical_to_all_physical_map_num_valid: torch.Tensor
    ep_size: int

    @classmethod
    def of(cls, phy2log: torch.Tensor, num_experts: int, ep_size: int) -> "ExpertLocationMetadata":
        log2phy, count = compute_logical_maps(phy2log, num_experts, phy2log.shape[1])
        return cls(phy2log.long(), log2phy, count, ep_size)

    @property
    def num_layers(self) -> int:
        return int(self.physical_to_logical_map.shape[0])


@dataclass
class ExpertLocationDispatchInfo:
    """SGLang's per-layer dispatch info (`ExpertLocationDispatchInfo.init_new(layer_id)`), the fields the lp path
    reads (no static table: SGLang builds none with `lp`)."""

    ep_dispatch_algorithm: str
    partial_logical_to_all_physical_map: torch.Tensor
    partial_logical_to_all_physical_map_num_valid: torch.Tensor
    num_physical_experts: int

    @classmethod
    def of(cls, metadata: ExpertLocationMetadata, layer: int) -> "ExpertLocationDispatchInfo":
        return cls("lp", metadata.logical_to_all_physical_map[layer],
                   metadata.logical_to_all_physical_map_num_valid[layer],
                   int(metadata.physical_to_logical_map.shape[1]))


def _topk_ids_logical_to_physical_dynamic(topk_ids, info):
    """SGLang's dynamic dispatch: a uniform replica per dispatch (its random draw; by row when rank-invariant)."""
    flat = topk_ids.flatten().long()
    valid = info.partial_logical_to_all_physical_map_num_valid[flat]
    pick = torch.randint(0, 65536, flat.shape) % valid
    return info.partial_logical_to_all_physical_map[flat, pick].to(topk_ids.dtype).view(topk_ids.shape)


def _topk_ids_logical_to_physical_probability(topk_ids, info, log2phy_prob):
    """SGLang's probability dispatch (a CUDA kernel there): a replica drawn per dispatch with the probabilities."""
    flat = topk_ids.flatten().long()
    if flat.numel() == 0:
        return topk_ids
    pick = torch.multinomial(log2phy_prob[flat].clamp(min=0) + 1e-12, 1)[:, 0]
    return info.partial_logical_to_all_physical_map[flat, pick].to(topk_ids.dtype).view(topk_ids.shape)


def _sglang_lp_tree(group: GroupCoordinator, attn_dp: bool) -> dict[str, types.ModuleType]:
    resources = types.SimpleNamespace(lplb_solvers={}, expert_location_metadata=None)
    solver = types.ModuleType("sglang.srt.eplb.lplb_solver")
    solver.LPLBSolver = LPLBSolver
    solver.assert_lplb_supported_model = assert_lplb_supported_model
    solver.get_resources = lambda: resources
    solver.get_global_lplb_solver = lambda layer_id: resources.lplb_solvers.get(layer_id)
    setup = types.ModuleType("sglang.srt.model_executor.model_runner_components.moe_ep_setup")
    setup.LPLBSolver = LPLBSolver
    setup.assert_lplb_supported_model = assert_lplb_supported_model
    parallel = types.SimpleNamespace(moe_ep_group=group, attn_dp_enabled=attn_dp)

    def init_lplb_solvers(*, model_config) -> None:   # SGLang's, reading its module's names at call time
        architectures = getattr(model_config.hf_config, "architectures", None)
        if architectures:
            setup.assert_lplb_supported_model(architectures[0])
        metadata = resources.expert_location_metadata
        if metadata is None:
            return
        resources.lplb_solvers.clear()
        for layer in range(metadata.num_layers):
            resources.lplb_solvers[layer] = setup.LPLBSolver(
                phy2log=metadata.physical_to_logical_map[layer], log2phy=metadata.logical_to_all_physical_map[layer],
                num_gpus=metadata.ep_size, ep_group=parallel.moe_ep_group,
                logical_to_all_physical_map_num_valid=metadata.logical_to_all_physical_map_num_valid[layer])

    setup.init_lplb_solvers = init_lplb_solvers
    dispatch = types.ModuleType("sglang.srt.eplb.expert_location_dispatch")
    dispatch.ExpertLocationDispatchInfo = ExpertLocationDispatchInfo
    dispatch._topk_ids_logical_to_physical_dynamic = _topk_ids_logical_to_physical_dynamic
    dispatch._topk_ids_logical_to_physical_probability = _topk_ids_logical_to_physical_probability

    def topk_ids_logical_to_physical(topk_ids, info, log2phy_prob=None):   # SGLang's, for "lp"
        if log2phy_prob is None:
            raise RuntimeError("ep_dispatch_algorithm='lp' but log2phy_prob is None at dispatch time")
        return dispatch._topk_ids_logical_to_physical_probability(topk_ids, info, log2phy_prob)

    dispatch.topk_ids_logical_to_physical = topk_ids_logical_to_physical
    runtime = types.ModuleType("sglang.srt.runtime_context")
    runtime.get_parallel = lambda: parallel
    runtime.get_resources = lambda: resources
    runtime.get_exec = lambda: types.SimpleNamespace(moe=types.SimpleNamespace(
        ep_dispatch_algorithm="lp", eplb_rebalance_num_iterations=1000, eplb_rebalance_layers_per_chunk=None))
    tree = {name: types.ModuleType(name) for name in ("sglang", "sglang.srt", "sglang.srt.eplb",
                                                      "sglang.srt.model_executor",
                                                      "sglang.srt.model_executor.model_runner_components")}
    tree.update({"sglang.srt.eplb.lplb_solver": solver, setup.__name__: setup, dispatch.__name__: dispatch,
                 "sglang.srt.runtime_context": runtime})
    return tree


@contextmanager
def standin_sglang_lp(group: GroupCoordinator | None = None, attn_dp: bool = False) -> Iterator[dict]:
    """SGLang's lp path for the block (module note above): the solver module (with the resources holding the
    metadata and the solvers), `moe_ep_setup.init_lplb_solvers`, the dispatch module, and `get_parallel()` with
    `moe_ep_group = group` (default one rank) and `attn_dp_enabled`. Yields the modules by name."""
    tree = _sglang_lp_tree(group or GroupCoordinator(), attn_dp)
    with _modules(tree):
        yield tree


def sglang_topk(tree: dict, layer_id: int, topk_ids, info: ExpertLocationDispatchInfo):
    """SGLang's top-k post-processing on the lp path (`_post_process_topk_ids`, CUDA branch): the layer's solver
    solves the batch, then `topk_ids_logical_to_physical` maps it; an empty batch calls `solve` alone
    (`TopK.empty_topk_output`)."""
    solver = tree["sglang.srt.eplb.lplb_solver"].get_global_lplb_solver(layer_id)
    prob = solver.solve(topk_ids)
    if topk_ids.numel() == 0:
        return topk_ids
    return tree["sglang.srt.eplb.expert_location_dispatch"].topk_ids_logical_to_physical(topk_ids, info, prob)
