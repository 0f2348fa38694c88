"""Stand-ins for the rebalance machinery of vLLM 0.33.0 and SGLang 0.5.23, for CI (no engine installed).

Each stand-in is shaped like the engine's own call path, written from its sources (read, not copied):

- `StandinVllmEplb`: vLLM 0.33.0 `vllm/distributed/eplb/eplb_state.py` (`EplbState.add_model`, `step`,
  `_should_record_current_step`, `rearrange`, `_commit_eplb_maps`, `_move_to_workspace`) and
  `async_worker.py` (`run_rebalance_experts`, `transfer_run_periodically`):
  * start map linear: slot `p < E` holds expert `p`, redundant slot `E + i` expert `i % E`, every layer;
  * the rearrangement counter starts at `step_interval - step_interval // 4`; each step copies the pass's
    physical counts into a ring buffer of `window_size` steps when `step_interval - counter <=
    window_size` (the router adds to the pass only while the shared record flag, set at the end of the
    previous step and `True` at start-up, is on); the counter is then incremented, in async mode one
    pending layer is committed, and when the counter reaches `step_interval` it is reset and
    `rearrange` runs (async: not while a previous result is still being committed);
  * `rearrange` maps the window to logical experts through the map in use (scatter-add), sums it over
    the window (int64 `[layers, E]`) and calls `policy.rebalance_experts(weight, num_replicas,
    num_groups, num_nodes, num_ranks, old_global_expert_indices=map in use)`; the result is the map
    (`phy2log` only). Sync: committed at once. Async (vLLM's default): the worker calls the policy,
    then one layer is committed per following step, layer 0 first.
- `StandinSglangEplb`: SGLang 0.5.23 `python/sglang/srt/eplb/eplb_manager.py` (`EPLBManager._entrypoint`,
  `rebalance`), `expert_location.py` (`init_trivial`, `init_by_eplb`, `update`), `expert_distribution.py`
  (`_StatAccumulator`, `_CircularBuffer`, `_convert_global_physical_count_to_logical_count`) and
  `eplb_algorithms/__init__.py` (`rebalance_experts`, `compute_algorithm`):
  * start map `trivial`: slot `p` holds expert `p % E`;
  * each forward pass appends its physical counts to a circular buffer of
    `expert_distribution_recorder_buffer_size` passes (SGLang sets it to
    `eplb_rebalance_num_iterations`), then advances the manager's generator, which rebalances after
    every `eplb_rebalance_num_iterations` (n) passes it has yielded (so on passes n+1, 2n+1, ...);
  * a rebalance converts the whole buffer to logical counts `[buffer, layers, E]` (int32) through the map
    in use and calls the module attribute `sglang.srt.eplb.eplb_algorithms.rebalance_experts(
    tokens_per_expert, num_physical_experts, num_local_physical_experts, num_groups, num_nodes,
    algorithm)`, algorithm `auto` -> `deepseek_hierarchical` when `num_groups` is set and a multiple of
    the nodes, else `deepseek`; with `eplb_rebalance_layers_per_chunk` unset (the default) every layer
    takes the returned `phy2log` at once.
- The engines' default policies, `vllm_default_policy` (vLLM 0.33 `policy/default.py`
  `DefaultEplbPolicy`) and `sglang_deepseek` (SGLang 0.5.23 `eplb_algorithms/deepseek.py`): DeepSeek's
  EPLB steps as `moe_place.solvers.deepseek` implements them, with each engine's arithmetic where it
  differs from DeepSeek's `eplb.py` (whose float32 arithmetic the planner's `eplb` solver reproduces):
  * both engines accumulate pack loads in float64 (vLLM: a float64 array; SGLang: Python floats);
    `eplb.py` and `moe_place.solvers.deepseek.balanced_packing` in float32;
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
  0.33's, returning `phy2log` only; `sglang.srt.eplb.eplb_algorithms.rebalance_experts` and
  `sglang.srt.eplb.expert_location.get_global_expert_location_metadata`), so that moe-place's
  `install()` and `install_rebalance_hook()` plug into the stand-ins exactly as into the engines.
"""

from __future__ import annotations

import abc
import sys
import types
import typing
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from moe_place.placement import keep_unchanged_slots
from moe_place.solvers.deepseek import _inverse, replicate_experts

VLLM_VERSION = "0.33.0"
SGLANG_VERSION = "0.5.23"


# ---------------------------------------------------------------------- the engines' default policies
def _pack(weight: np.ndarray, num_packs: int, sort) -> tuple[np.ndarray, np.ndarray]:
    """Greedy packing into packs of exactly `n / num_packs` items with float64 pack loads, items taken in
    the order `sort(weight)` gives (descending; not called with one item per pack, as in both engines).
    Returns `(pack_index, rank_in_pack)`, int64 `[rows, n]`.

    The packing step of `moe_place.solvers.deepseek.balanced_packing` with both engines' float64
    accumulation (that one accumulates in float32, as DeepSeek's `eplb.py`).
    """
    rows, items = weight.shape
    per_pack = items // num_packs
    if per_pack == 1:
        pack_index = np.broadcast_to(np.arange(items, dtype=np.int64), (rows, items)).copy()
        return pack_index, np.zeros((rows, items), np.int64)
    order = sort(weight)
    pack_load = np.zeros((rows, num_packs), dtype=np.float64)
    pack_items = np.zeros((rows, num_packs), dtype=np.int64)
    pack_index = np.full((rows, items), -1, dtype=np.int64)
    rank_in_pack = np.full((rows, items), -1, dtype=np.int64)
    row_ids = np.arange(rows)
    for position in range(items):
        item = order[:, position]
        pack = np.argmin(np.where(pack_items < per_pack, pack_load, np.inf), axis=1)  # lightest open pack, first
        pack_index[row_ids, item] = pack
        rank_in_pack[row_ids, item] = pack_items[row_ids, pack]
        pack_load[row_ids, pack] += weight[row_ids, item]
        pack_items[row_ids, pack] += 1
    return pack_index, rank_in_pack


def _numpy_order(values: np.ndarray) -> np.ndarray:
    return np.argsort(-values, axis=-1)  # numpy's default kind, as vLLM sorts


def _torch_order(values: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).sort(-1, descending=True).indices.numpy()


def engine_eplb(weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int,
                flavour: str, order=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """DeepSeek EPLB's hierarchical steps with an engine's arithmetic (`flavour` "vllm" or "sglang", module note).

    weight: `[layers, E]` loads, taken as float32 (both engines call `.float()`). Pass `num_groups =
    num_nodes = 1` for the global policy. order: the descending sort of the packing steps, `values
    [rows, n]` -> indices (default the engine's own: numpy's `argsort` of the negated values, or torch's
    sort), which orders equal values as this machine's sort does. Returns `phy2log` int64 `[layers, P]`,
    `replica_rank` int64 `[layers, P]` (0 for an expert's first replica) and `logcnt` int64 `[layers, E]`.
    """
    weight = np.asarray(weight, dtype=np.float32)
    layers, experts = weight.shape
    group_size, groups_per_node = experts // num_groups, num_groups // num_nodes
    slots_per_gpu, per_node = num_replicas // num_gpus, experts // num_nodes
    vllm = flavour == "vllm"
    order = order or (_numpy_order if vllm else _torch_order)
    # step 1: groups to nodes (group sums in float32: numpy's for vLLM, torch's for SGLang)
    group_load = (weight.reshape(layers, num_groups, group_size).sum(axis=-1) if vllm else
                  torch.from_numpy(weight).unflatten(-1, (num_groups, group_size)).sum(-1).numpy())
    group_node, group_rank = _pack(group_load, num_nodes, order)
    log2node_log = (((group_node * groups_per_node + group_rank) * group_size)[..., None]
                    + np.arange(group_size)).reshape(layers, experts)
    node_log2log = _inverse(log2node_log)
    # step 2: replicas inside each node (vLLM's numpy divides in float64, SGLang's torch in float32)
    node_load = np.take_along_axis(weight, node_log2log, axis=1).reshape(layers * num_nodes, per_node)
    ratio_load = node_load.astype(np.float64) if vllm else node_load
    phy2node_log, rank, node_logcnt = replicate_experts(ratio_load, num_replicas // num_nodes)
    # step 3: the node's replicas onto its GPUs
    replica_load = np.take_along_axis(node_load / (node_logcnt if vllm else node_logcnt.astype(np.float32)),
                                      phy2node_log, axis=1)
    gpu, rank_in_gpu = _pack(replica_load, num_gpus // num_nodes, order)
    slot2phy = _inverse(gpu * slots_per_gpu + rank_in_gpu)
    slot2node_log = np.take_along_axis(phy2node_log, slot2phy, axis=1)
    slot2node_log = (slot2node_log.reshape(layers, num_nodes, -1)
                     + (np.arange(num_nodes) * per_node)[None, :, None]).reshape(layers, num_replicas)
    phy2log = np.take_along_axis(node_log2log, slot2node_log, axis=1)
    replica_rank = np.take_along_axis(rank, slot2phy, axis=1).reshape(layers, num_replicas)
    logcnt = np.take_along_axis(node_logcnt.reshape(layers, experts), log2node_log, axis=1)
    return phy2log, replica_rank, logcnt


def vllm_default_policy(weight, num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int,
                        old_global_expert_indices=None, *, order=None) -> torch.Tensor:
    """vLLM 0.33's `DefaultEplbPolicy.rebalance_experts` (module note): `phy2log` int64 `[layers, P]`.
    order: the packing steps' sort (`engine_eplb`; the tests replay the orders vLLM's own sort returned)."""
    loads = weight.float().cpu().numpy() if hasattr(weight, "float") else np.asarray(weight, dtype=np.float32)
    hierarchical = num_groups % num_nodes == 0
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
    """`vllm.distributed.eplb.policy` (registry, abstract and default policy) and `vllm.config.parallel`
    (`EPLBPolicyOption`) for the block; yields the registry dict, which `StandinVllmEplb` reads."""
    policy = types.ModuleType("vllm.distributed.eplb.policy")
    policy.AbstractEplbPolicy = AbstractEplbPolicy
    policy.DefaultEplbPolicy = DefaultEplbPolicy
    policy.EPLB_POLICIES = {"default": DefaultEplbPolicy}
    parallel = types.ModuleType("vllm.config.parallel")
    parallel.EPLBPolicyOption = typing.Literal["default"]
    tree = {name: types.ModuleType(name) for name in ("vllm", "vllm.distributed", "vllm.distributed.eplb",
                                                      "vllm.config")}
    tree.update({"vllm.distributed.eplb.policy": policy, "vllm.config.parallel": parallel})
    with _modules(tree):
        yield policy.EPLB_POLICIES


def compute_algorithm(raw_algorithm: str, num_groups: int | None, num_nodes: int) -> str:
    """SGLang's `compute_algorithm`: "auto" -> "deepseek_hierarchical" when the groups split over the nodes."""
    if raw_algorithm != "auto":
        return raw_algorithm
    return "deepseek_hierarchical" if num_groups is not None and num_groups % num_nodes == 0 else "deepseek"


def sglang_rebalance_experts(tokens_per_expert: torch.Tensor, num_physical_experts: int,
                             num_local_physical_experts: int, num_groups: int | None, num_nodes: int, algorithm: str):
    """SGLang's `eplb_algorithms.rebalance_experts` for the deepseek algorithms: the per-pass counts summed."""
    if algorithm not in ("deepseek", "deepseek_hierarchical"):
        raise NotImplementedError(algorithm)
    return sglang_deepseek(tokens_per_expert.sum(dim=0), num_physical_experts, num_groups, num_nodes,
                           num_physical_experts // num_local_physical_experts, algorithm == "deepseek_hierarchical")


@dataclass
class _Metadata:
    """The part of SGLang's `ExpertLocationMetadata` the hook reads: the map in use on the CPU."""

    physical_to_logical_map_cpu: torch.Tensor


@contextmanager
def standin_sglang_modules(num_iterations: int = 1000) -> Iterator[tuple[types.ModuleType, types.ModuleType]]:
    """`sglang.srt.eplb.eplb_algorithms` and `sglang.srt.eplb.expert_location` for the block; yields both:
    `StandinSglangEplb` calls the first one's `rebalance_experts` attribute (which the hook replaces) and
    publishes its map through the second. Also `sglang.srt.runtime_context`, whose `get_exec().moe`
    holds the server's `eplb_rebalance_num_iterations` (`num_iterations`), where SGLang 0.5.23's
    running server publishes it (`sglang/srt/runtime_context.py`) and the hook reads it."""
    algorithms = types.ModuleType("sglang.srt.eplb.eplb_algorithms")
    algorithms.rebalance_experts = sglang_rebalance_experts
    algorithms.compute_algorithm = compute_algorithm
    location = types.ModuleType("sglang.srt.eplb.expert_location")
    location.metadata = None
    location.get_global_expert_location_metadata = lambda: location.metadata
    runtime = types.ModuleType("sglang.srt.runtime_context")
    exec_args = types.SimpleNamespace(moe=types.SimpleNamespace(eplb_rebalance_num_iterations=num_iterations))
    runtime.get_exec = lambda: exec_args
    tree = {name: types.ModuleType(name) for name in ("sglang", "sglang.srt", "sglang.srt.eplb")}
    tree.update({"sglang.srt.eplb.eplb_algorithms": algorithms, "sglang.srt.eplb.expert_location": location,
                 "sglang.srt.runtime_context": runtime})
    with _modules(tree):
        yield algorithms, location


# ---------------------------------------------------------------------- the engines' rebalance machinery
class StandinVllmEplb:
    """vLLM 0.33's `EplbState` for one model, as far as it decides maps (module note).

    Drive it like vLLM's model runner: before each forward pass read `record` (the shared flag the
    router checks); if set, add the pass's physical counts with `add_pass_load`; after the pass call
    `step()`. `physical_to_logical_map` is the map in use `[layers, P]`.
    """

    def __init__(self, policies: dict, num_layers: int, num_experts: int, num_redundant: int, num_gpus: int,
                 num_nodes: int, num_groups: int, step_interval: int = 3000, window_size: int = 1000,
                 use_async: bool = True, policy: str = "default"):
        self.policy = policies[policy]  # `add_model` looks the class up once
        self.num_experts, self.num_gpus, self.num_groups = num_experts, num_gpus, num_groups
        self.num_nodes = num_nodes if num_gpus % num_nodes == 0 else 1
        self.num_physical = num_experts + num_redundant
        linear = list(range(num_experts)) + [i % num_experts for i in range(num_redundant)]
        self.physical_to_logical_map = torch.tensor(linear).unsqueeze(0).expand(num_layers, -1).contiguous()
        self.expert_load_pass = torch.zeros((num_layers, self.num_physical), dtype=torch.int32)
        self.window = torch.zeros((window_size, num_layers, self.num_physical), dtype=torch.int32)
        self.window_size, self.step_interval, self.use_async = window_size, step_interval, use_async
        self.window_step = 0
        self.rearrangement_step = max(0, step_interval - step_interval // 4)
        self.record = True  # the router's flag, on at start-up
        self.pending: list | None = None  # async: [new map, next layer to commit]

    def add_pass_load(self, physical_counts: torch.Tensor) -> None:
        self.expert_load_pass += physical_counts.to(torch.int32)

    def _should_record(self) -> bool:
        return self.step_interval - self.rearrangement_step <= self.window_size

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
        logical.scatter_add_(-1, self.physical_to_logical_map.unsqueeze(0).expand_as(self.window).long(), self.window)
        weight = logical[..., :-1].sum(dim=0)  # int64 [layers, E]
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
    `metadata.physical_to_logical_map_cpu` is the map in use `[layers, P]`. `modules`: the algorithms
    module, whose `rebalance_experts` attribute is called, and the expert-location module that
    publishes the metadata (`standin_sglang_modules()`).
    """

    def __init__(self, modules: tuple[types.ModuleType, types.ModuleType], num_layers: int, num_experts: int,
                 num_redundant: int, num_gpus: int, num_nodes: int, num_groups: int | None,
                 num_iterations: int = 1000, buffer_size: int | None = None, algorithm: str = "auto"):
        self.algorithms, location = modules
        self.num_layers, self.num_experts, self.num_gpus = num_layers, num_experts, num_gpus
        self.num_nodes, self.num_groups, self.raw_algorithm = num_nodes, num_groups, algorithm
        self.num_physical = num_experts + num_redundant
        trivial = torch.arange(self.num_physical).repeat(num_layers, 1) % num_experts
        self.metadata = _Metadata(trivial)
        location.metadata = self.metadata
        size = num_iterations if buffer_size is None else buffer_size
        if num_iterations < size:
            raise ValueError("eplb_rebalance_num_iterations must be at least the recorder's buffer size")
        self.buffer = torch.zeros((size, num_layers, self.num_physical), dtype=torch.int32)
        self.buffer_index = 0
        self.num_iterations = num_iterations
        self._generator = self._entrypoint()

    def on_forward_pass(self, physical_counts: torch.Tensor) -> None:
        self.buffer[self.buffer_index] = physical_counts.to(torch.int32)
        self.buffer_index = (self.buffer_index + 1) % len(self.buffer)
        next(self._generator)

    def _entrypoint(self):
        while True:
            for _ in range(self.num_iterations):
                yield
            self.rebalance()

    def rebalance(self) -> None:
        current = self.metadata.physical_to_logical_map_cpu
        logical = torch.zeros((len(self.buffer), self.num_layers, self.num_experts), dtype=self.buffer.dtype)
        logical.scatter_add_(2, current.unsqueeze(0).expand(len(self.buffer), -1, -1).long(), self.buffer)
        algorithm = self.algorithms.compute_algorithm(self.raw_algorithm, self.num_groups, self.num_nodes)
        phy2log, _, _ = self.algorithms.rebalance_experts(
            tokens_per_expert=logical, num_physical_experts=self.num_physical,
            num_local_physical_experts=self.num_physical // self.num_gpus, num_groups=self.num_groups,
            num_nodes=self.num_nodes, algorithm=algorithm)
        self.metadata.physical_to_logical_map_cpu = phy2log.to(torch.int64).cpu().clone()
