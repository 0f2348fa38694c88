"""Run a workload through an engine's own rebalance code, and judge what a policy does there.

Engines (`ENGINES`):
- "vllm": vLLM's real `EplbState` (`vllm/distributed/eplb/eplb_state.py`): `EplbState(ParallelConfig(eplb_config=
  EPLBConfig(...)))`, `add_model` with a stand-in MoE model, then per forward pass the pass's physical counts
  are added to `expert_load_pass` (while the router's shared record flag is on) and `EplbState.step()` runs,
  so vLLM's own start map, window, cadence, logical mapping, policy call and map commit decide. Stubbed:
  the EP/EPLB group accessors and process groups (one process stands for all ranks: the load all-reduce
  is the identity, since this process feeds the global load; lockstep flag all-reduces return the group
  size times the flag, every rank being in the same state), `get_node_count`, the communicator factory,
  the weight copies (`rearrange_expert_weights_inplace`, `transfer_layer`, `move_from_buffer`),
  `torch.Event`, `PIN_MEMORY` and the async worker's stream. `use_async=True` (vLLM's default) runs vLLM's
  own worker loop `async_worker.transfer_run_periodically` (which calls `run_rebalance_experts`, then
  produces one layer per forward pass) on a thread; after each step the harness waits until that thread
  is idle (waiting for the next rearrangement, or holding the next layer's result), so one layer is
  committed per step, the fastest the engine commits. The ParallelConfig is built without
  `enable_eplb` (its validator refuses a CPU platform); `EplbState` does not read that flag.
- "sglang": SGLang's real `EPLBManager` (`eplb_manager.py`) over a published `ServerArgs`
  (`RuntimeContext.override_server_args`, with the values SGLang's own argument hooks resolve for
  `--enable-eplb`: recorder mode `stat`, recorder buffer = `--eplb-rebalance-num-iterations`, dispatch
  `dynamic`, the one for `--moe-a2a-backend none`), the real `ExpertLocationMetadata.init_trivial`,
  `init_by_eplb` (which calls `eplb_algorithms.rebalance_experts`), `ExpertLocationUpdater.update` and
  `ExpertLocationMetadata.update`. Stubbed: the model-architecture lookup (`ModelConfigForExpertLocation.
  from_model_config` returns the size's layers, experts and groups), the recorder (a real `_CircularBuffer`
  of per-pass physical counts, dumped through SGLang's `_convert_global_physical_count_to_logical_count`
  without the all-reduce), the weight copy (`_update_expert_weights`) and the device module.
- "standin-vllm" / "standin-sglang": `inengine.standins` (no engine needed: CI).
Policies (`POLICIES`): "default" (the engine's own: vLLM's `DefaultEplbPolicy`, SGLang's `auto`
algorithm) or "moe-place" (`moe_place.engines.vllm.install()`, name "default", which works with
`use_async`; `moe_place.engines.sglang.install_rebalance_hook()`).

Workloads: `skewed_workload` (stationary Dirichlet-skewed popularity, then a new popularity), and the
replay's drifting traces (`drift_workload`, the specs of `bench/bench_replay.py` SCENARIOS). Per policy
call (`rebalance_rows`): its step, the busiest/mean GPU load (even split, mean over layers) of the steps
it serves until the next call (summed), slots changed, bytes copied between GPUs
(`moe_place.cost.migration.plan_copies` with the size's expert bytes), the policy's CPU time and, for a
hierarchical size, whether every expert group and its replicas sit inside one node. On drift traces
`price_run` adds, per step, the layer time of the map the engine runs (expert time, and dispatch + combine,
as the replay prices them: `moe_place.online.replay.served_steps`), what serving pays for each map change
under the engine's migration model (vLLM async: per committed layer, `ReplayCost.charge` with migration "async"; sync vLLM and SGLang's
default all-layers update: "stall") and the policy's own CPU time per call (`time.thread_time` in the
thread that calls it, the garbage collector held off as in the replay: `moe_place.online.controller.cpu_timer`;
its wall time is recorded beside). In SGLang's runs each call is also run
`SGLANG_CPU_REPEATS` times from a copy of the policy's state, and its CPU time is the least of the runs
(`Clock`), for both policies alike.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import subprocess
import threading
import time
import types
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator
from unittest import mock

import numpy as np
import torch

from moe_place.cost.cluster import ReplayCost, cluster_cost
from moe_place.cost.migration import plan_copies
from moe_place.cost.models import ExpertShape, get_model
from moe_place.engines import session as rule_session
from moe_place.engines.sglang import install_rebalance_hook, uninstall_rebalance_hook
from moe_place.engines.vllm import install, uninstall
from moe_place.online.controller import EngineCadence, cpu_timer
from moe_place.online.replay import parse_synthetic, served_steps
from moe_place.placement import Placement, even_split_gpu_loads
from moe_place.solvers.deepseek import plans_hierarchically

from inengine import standins

ROOT = Path(__file__).resolve().parents[2]

ENGINES = ("vllm", "sglang", "standin-vllm", "standin-sglang")
# What moe-place's policy is made of inside the engines: the files whose code runs when an engine installs and
# calls it (the adapters, the rebalance rule, its cost model, DeepSeek EPLB's plan it takes, and what they
# call), plus the SGLang environment hook, which runs only in a real SGLang. tests/test_engines_records.py
# traces the stand-in runs to check that every file that runs is listed. The harness, the stand-ins and the
# workloads are not here: they decide what is measured, not what the policy does, and change with git log.
# The in-engine records store a digest of each file (`rule_sources`): a record older than one of them is stale.
RULE_FILES = (
    "moe_place/engines/config.py", "moe_place/engines/vllm.py", "moe_place/engines/vllm_policy.py",
    "moe_place/engines/sglang.py", "moe_place/engines/sglang_managers.py", "moe_place/engines/sglang_startup.py",
    "moe_place/engines/session.py", "moe_place/engines/tensors.py", "moe_place/engines/guard.py",
    "moe_place/engines/batch_split.py", "moe_place/engines/sglang_split.py", "moe_place/online/policy.py",
    "moe_place/online/estimate.py", "moe_place/online/controller.py",
    # not the per-batch split's solve and choice (moe_place/split.py, online/splitting.py, engines/vllm_split.py):
    # these runs leave MOE_PLACE_SPLIT unset, so none of their code runs (the test that every file which runs is
    # here checks it; batch_split and sglang_split run, reading the setting); bench/check_split_engines.py
    # measures them
    "moe_place/cost/cluster.py", "moe_place/cost/expected_traffic.py", "moe_place/cost/files.py",
    "moe_place/cost/gemm.py", "moe_place/cost/gemm_profile.py", "moe_place/cost/replicas.py",
    "moe_place/cost/hardware.py", "moe_place/cost/migration.py", "moe_place/cost/models.py", "moe_place/cost/payback.py",
    "moe_place/cost/topology.py", "moe_place/cost/units.py", "moe_place/placement.py", "moe_place/errors.py",
    "solvers/deepseek.py",
)
POLICIES = ("default", "moe-place")
VLLM_DEFAULT_CADENCE = dict(step_interval=3000, window=1000)  # vLLM 0.33 EPLBConfig defaults
SGLANG_DEFAULT_CADENCE = dict(step_interval=1000, window=1000)  # --eplb-rebalance-num-iterations, buffer = it
SGLANG_CPU_REPEATS = 4   # SGLang's calls run 4 more times from a copy of the policy's state (`Clock`): the medians
# of single calls' CPU times moved 20-30% between runs on this machine, more than the policies differ


def git(*args: str) -> str | None:
    """`git ARGS` in this checkout: its stripped output, or None where git is missing or fails."""
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def checkout(*paths: str) -> dict:
    """What a record says of the code it ran: the commit, and whether moe-place's files (moe_place/, solvers/) or
    `paths` had changes not in it (None where git cannot say)."""
    changed = git("status", "--porcelain", "--", "moe_place", "solvers", *paths)
    return {"moe_place_commit": git("rev-parse", "HEAD"),
            "uncommitted_changes": None if changed is None else bool(changed)}


def rule_sources(root: Path = ROOT) -> dict:
    """`{"files": {path: sha256 of its bytes}, "sha256": digest of those lines}` for `RULE_FILES` under `root`."""
    files = {path: hashlib.sha256((root / path).read_bytes()).hexdigest() for path in RULE_FILES}
    combined = hashlib.sha256("".join(f"{path} {digest}\n" for path, digest in files.items()).encode()).hexdigest()
    return {"files": files, "sha256": combined}


# ---------------------------------------------------------------------- sizes and workloads
@dataclass(frozen=True)
class Size:
    """One cluster and model: `experts + redundant` slots per layer on `gpus` GPUs over `nodes` nodes.

    groups: expert groups (DeepSeek-V3: 8; the hierarchical policy when a multiple of `nodes`), None for a
        model without groups (vLLM passes 1, SGLang None). tokens / top_k: per forward pass.
    model: an expert-shape preset (`moe_place.cost.models`) or shape, for bytes and times.
    """

    name: str
    experts: int
    redundant: int
    gpus: int
    nodes: int
    layers: int
    groups: int | None
    tokens: int
    top_k: int
    model: Any

    @property
    def physical(self) -> int:
        return self.experts + self.redundant

    @property
    def shape(self) -> ExpertShape:
        """The expert shape of `model`, with this size's experts and layers (what the engine registers)."""
        base = get_model(self.model) if isinstance(self.model, str) else self.model
        return replace(base, num_experts=self.experts, num_moe_layers=self.layers, top_k=min(base.top_k, self.experts),
                       kv_cache=None)

    @property
    def hierarchical(self) -> bool:
        return plans_hierarchically(self.groups, self.nodes)

    @property
    def vllm_groups(self) -> int:
        return 1 if self.groups is None else self.groups

    def cost(self, migration: str = "stall") -> ReplayCost:
        """The cluster on H100s, a rebalance's copies batched (`EngineCadence.copy_schedule`, "parallel": both
        engines issue a layer's transfers as one batch), serving paying for them as `migration` says."""
        return cluster_cost(self.gpus, self.nodes, "H100", self.model, migration=migration,
                            copy_schedule=EngineCadence().copy_schedule)


SIZES = {
    "1x8-e64": Size("1x8-e64", 64, 8, 8, 1, 4, None, 2048, 8, "Qwen3-30B-A3B"),
    "2x8-e256": Size("2x8-e256", 256, 16, 16, 2, 4, None, 2048, 8, "DeepSeek-V3"),
    "4x8-e256-global": Size("4x8-e256-global", 256, 32, 32, 4, 4, None, 2048, 8, "DeepSeek-V3"),
    "4x8-e256-hier": Size("4x8-e256-hier", 256, 32, 32, 4, 4, 8, 2048, 8, "DeepSeek-V3"),
}
DIRICHLET_ALPHA = 0.5
TOKEN_POOL = 1 << 16
TOKEN_BLOCK = 64


@dataclass(frozen=True)
class Workload:
    """counts: int32 `[steps, layers, E]` logical dispatches per forward pass. change_step: first step of the
    second popularity (None: no change)."""

    name: str
    counts: np.ndarray
    change_step: int | None
    description: str


def routed_counts(popularity: np.ndarray, steps: int, tokens: int, top_k: int, rng: np.random.Generator,
                  chunk: int = 256) -> np.ndarray:
    """int32 `[steps, layers, E]`: each step, `tokens` tokens each pick `top_k` distinct experts.

    A token's experts are drawn without replacement with probabilities proportional to `popularity`
    (`[layers, E]`; the Gumbel top-k, i.e. the router's top-k of noisy logits). Each layer draws a pool of
    `TOKEN_POOL` such tokens in blocks of `TOKEN_BLOCK`; a step is `tokens / TOKEN_BLOCK` blocks drawn at
    random with replacement. A block sums independent tokens, so a step's counts have the mean and variance
    of `tokens` tokens drawn from the pool (at a sum of blocks per step instead of a count per token).
    """
    if tokens % TOKEN_BLOCK:
        raise ValueError(f"tokens: expected a multiple of {TOKEN_BLOCK}, got {tokens}")
    layers, experts = popularity.shape
    num_blocks, per_step = TOKEN_POOL // TOKEN_BLOCK, tokens // TOKEN_BLOCK
    out = np.zeros((steps, layers, experts), dtype=np.int32)
    for layer in range(layers):
        keys = np.log(popularity[layer]) + rng.gumbel(size=(TOKEN_POOL, experts))
        picks = np.argpartition(-keys, top_k - 1, axis=1)[:, :top_k]            # [pool, k] distinct experts
        block_of = np.repeat(np.arange(num_blocks), TOKEN_BLOCK * top_k)
        blocks = np.bincount(block_of * experts + picks.ravel(), minlength=num_blocks * experts)
        blocks = blocks.reshape(num_blocks, experts).astype(np.int32)
        for start in range(0, steps, chunk):
            n = min(chunk, steps - start)
            out[start:start + n, layer] = blocks[rng.integers(0, num_blocks, size=(n, per_step))].sum(axis=1)
    return out


def first_call(engine: str, step_interval: int) -> int:
    """The 0-based forward pass after which the policy is first called: vLLM's `step_interval // 4`-th (its
    counter starts at 3/4 of the interval), SGLang's `step_interval + 1`-th (its generator yields
    `step_interval` times first); later calls follow every `step_interval` passes."""
    return step_interval // 4 - 1 if "vllm" in engine else step_interval


def skewed_workload(size: Size, engine: str, step_interval: int, stationary_calls: int, changed_calls: int,
                    seed: int) -> Workload:
    """A stationary Dirichlet-skewed popularity (`DIRICHLET_ALPHA`) for `stationary_calls` policy calls at the
    engine's cadence, then a new popularity, drawn the same way, for `changed_calls` more. The change comes
    right after the last stationary call, so the next call sees only the new popularity."""
    first = first_call(engine, step_interval)
    change = first + (stationary_calls - 1) * step_interval + 1
    steps = first + (stationary_calls + changed_calls - 1) * step_interval + step_interval // 2
    rng = np.random.default_rng([seed, size.experts, size.gpus, size.nodes, size.groups or 0])
    before = rng.dirichlet(np.full(size.experts, DIRICHLET_ALPHA), size=size.layers)
    after = rng.dirichlet(np.full(size.experts, DIRICHLET_ALPHA), size=size.layers)
    counts = np.concatenate([routed_counts(before, change, size.tokens, size.top_k, rng),
                             routed_counts(after, steps - change, size.tokens, size.top_k, rng)])
    return Workload("skewed", counts, change,
                    f"Dirichlet({DIRICHLET_ALPHA}) popularity per layer, {size.tokens} tokens x top-{size.top_k} per "
                    f"step, new popularity from step {change} ({steps} steps)")


def drift_size(scenario: str, scenarios: dict) -> Size:
    """The Size of a bench_replay scenario: its cluster and model, one redundant slot per GPU, and its expert
    groups (DeepSeek-V3's 8 on the multi-node DeepSeek scenarios: what the engines read off that model)."""
    cfg = scenarios[scenario]
    experts = int(cfg["spec"].split("experts=")[1].split(",")[0])
    layers = int(cfg["spec"].split("layers=")[1].split(",")[0])
    groups = cfg.get("groups")
    return Size(scenario, experts, cfg["gpus"], cfg["gpus"], cfg["nodes"], layers, groups, 0, 8, cfg["model"])


def drift_workload(scenario: str, scenarios: dict, steps: int, seed: int) -> Workload:
    counts, params = parse_synthetic(scenarios[scenario]["spec"].format(steps=steps, seed=seed))
    return Workload(f"drift:{scenario}", counts.astype(np.int32), None,
                    f"bench_replay {scenario} (seed {seed}): {params}")


# ---------------------------------------------------------------------- what a run records
@dataclass
class PolicyCall:
    """One call of the policy: the forward pass it ran after, its CPU time (the calling thread's: vLLM's async
    worker or the serving thread) and wall time, the map in use it was given and the map it returned
    (int64 `[layers, P]`). The CPU time is what the totals count: on a shared machine the wall time also
    holds the waits for a core (work a policy hands to other threads, e.g. torch's intra-op pool, is not in
    the CPU time)."""

    step: int
    cpu_s: float
    wall_s: float
    before: np.ndarray
    after: np.ndarray
    cpu_first_s: float | None = None   # the CPU time of the call that counted, where `cpu_s` is the least of repeats


@dataclass
class Clock:
    """Collects the policy calls of a run; `step` is set by the driver before each forward pass.

    repeats / state: where `state` is set (`(save, load)`: `save()` returns the object that holds the policy's
    state between calls, `load(obj)` puts `obj` in its place; SGLang's runs,
    `SGLANG_CPU_REPEATS`), each call runs once for real, as the engine calls it, then `repeats` more times
    from a copy of the state the real run started from, after which the state the real run left is put back;
    `cpu_s` is the least CPU time of those runs (the call's cost with the machine's interruptions left out, for
    both policies alike), `cpu_first_s` the real run's. Only the real run's map is used."""

    step: int = -1
    calls: list[PolicyCall] = field(default_factory=list)
    repeats: int = 0
    state: tuple[Callable[[], Any], Callable[[Any], None]] | None = None

    def timed(self, call: Callable, before: Callable[[tuple, dict], Any], after: Callable[[Any], Any]):
        """`call` wrapped: times it and records the map it was given (`before(args, kwargs)`) and returned."""

        def run(*args, **kwargs):
            old = np.array(_numpy(before(args, kwargs)), dtype=np.int64)
            repeat = self.repeats > 0 and self.state is not None
            if repeat:
                save, load = self.state
                saved = copy.deepcopy(save())                       # the state the call starts from
            start = time.perf_counter()
            with cpu_timer() as seconds:
                out = call(*args, **kwargs)
            cpu, wall = seconds[0], time.perf_counter() - start
            tries = [cpu]
            if repeat:
                reached = save()                                    # the state the call left
                with mock.patch.object(rule_session, "log_first_call", lambda line: None):   # logged once
                    for _ in range(self.repeats):
                        load(copy.deepcopy(saved))
                        with cpu_timer() as seconds:
                            call(*args, **kwargs)
                        tries.append(seconds[0])
                load(reached)
            self.calls.append(PolicyCall(self.step, min(tries), wall, old, np.array(_numpy(after(out)), dtype=np.int64),
                                         cpu if repeat else None))
            return out

        return run


def _numpy(value) -> np.ndarray:
    return value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)


@dataclass
class EngineRun:
    """The maps an engine ran, step by step, and its policy calls.

    maps: the distinct maps in order of first use; map_of_step: int `[steps]`, the index in `maps` of the
    map each forward pass ran on. migration: the engine's migration model ("async" or "stall").
    """

    engine: str
    policy: str
    cadence: dict
    migration: str
    maps: list[np.ndarray]
    map_of_step: np.ndarray
    calls: list[PolicyCall]
    seconds: float


def physical_counts(phy2log: np.ndarray, counts: np.ndarray, replica_rank: np.ndarray,
                    logcnt: np.ndarray) -> np.ndarray:
    """int32 `[layers, P]`: logical counts `[layers, E]` split evenly over each expert's replicas (the first
    `count % replicas` replicas take one more), as the engines' routers split on average."""
    rows = np.arange(phy2log.shape[0])[:, None]
    per_slot = counts[rows, phy2log]
    replicas = logcnt[rows, phy2log]
    return (per_slot // replicas + (replica_rank < per_slot % replicas)).astype(np.int32)


def replica_ranks(phy2log: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """(rank of each slot among its expert's replicas `[layers, P]`, replicas per expert `[layers, E]`)."""
    layers, physical = phy2log.shape
    rank = np.zeros_like(phy2log)
    logcnt = np.zeros((layers, num_experts), dtype=np.int64)
    for layer in range(layers):
        order = np.argsort(phy2log[layer], kind="stable")
        sorted_ids = phy2log[layer, order]
        starts = np.searchsorted(sorted_ids, sorted_ids)
        rank[layer, order] = np.arange(physical) - starts
        logcnt[layer] = np.bincount(phy2log[layer], minlength=num_experts)
    return rank, logcnt


def drive(engine: Any, counts: np.ndarray, clock: Clock, on_step: Callable[[int], None] | None = None):
    """Serve `counts` step by step on `engine` (`map_in_use()`, `serve(physical_counts)`); returns the timeline."""
    maps: list[np.ndarray] = []
    map_of_step = np.zeros(len(counts), dtype=np.int64)
    split = None
    for step, logical in enumerate(counts):
        clock.step = step
        in_use = engine.map_in_use()
        if not maps or not np.array_equal(in_use, maps[-1]):
            maps.append(in_use)
            split = replica_ranks(in_use, logical.shape[1])
        map_of_step[step] = len(maps) - 1
        engine.serve(physical_counts(in_use, logical, *split))
        if on_step is not None:
            on_step(step)
    return maps, map_of_step


# ---------------------------------------------------------------------- the drivers
@contextmanager
def _patched(*patches: tuple[Any, str, Any]) -> Iterator[None]:
    with ExitStack() as stack:
        for owner, name, value in patches:
            stack.enter_context(mock.patch.object(owner, name, value))
        yield


class _Group:
    """A process group of `size` ranks seen from rank 0; `cpu`: a CPU (gloo) group, used for lockstep flags."""

    def __init__(self, size: int, cpu: bool):
        self._size, self.cpu = size, cpu

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


class _Coordinator:
    """The EP / EPLB group coordinator vLLM asks for (`get_ep_group()`, `get_eplb_group()`)."""

    def __init__(self, size: int):
        self.device_group, self.cpu_group, self.world_size = _Group(size, False), _Group(size, True), size


def _all_reduce(tensor, group=None, **_):
    """One process holds every rank's state: loads are already global (identity); lockstep flags sum over ranks."""
    if isinstance(group, _Group) and group.cpu:
        tensor.mul_(group.size())


class _Stream:
    def synchronize(self):
        pass


class _Communicator:
    def set_stream(self, stream):
        pass


@contextmanager
def _no_stream(stream):
    yield


class _VllmLayer:
    """A MoE layer as `MixtureOfExperts.set_eplb_state` sees it: expert weights (meta tensors of the size's
    expert shape: what vLLM registers, without the memory) and an `EplbLayerState`."""

    def __init__(self, layer_state_class, local_experts: int, shape):
        self.weights = standins.expert_weight_tensors(shape, local_experts)
        self.eplb_state = layer_state_class()

    def get_expert_weights(self):
        return self.weights

    def set_eplb_state(self, moe_layer_idx, expert_load_view, logical_to_physical_map, logical_replica_count):
        self.eplb_state.set_layer_state(moe_layer_idx, expert_load_view, logical_to_physical_map,
                                        logical_replica_count)


class _ModelConfig:
    """The part of vLLM's `ModelConfig` `add_model` reads: the model's name, its config, a hash."""

    def __init__(self, shape):
        self.model, self.hf_text_config = shape.name, standins.hf_config_of(shape)

    def compute_hash(self) -> str:
        return "moe-place-harness"


class _VllmEngine:
    """vLLM's real EplbState driven one forward pass at a time (module note)."""

    def __init__(self, eplb_state_module, state, model_state, worker: threading.Thread | None):
        self.state, self.model_state, self.worker = state, model_state, worker
        self.eplb_state_module = eplb_state_module

    def map_in_use(self) -> np.ndarray:
        return self.model_state.physical_to_logical_map.cpu().numpy().astype(np.int64)

    def serve(self, physical: np.ndarray) -> None:
        record = self.state.should_record_tensor
        if record is None or bool(record):  # the router adds to the pass only while the shared flag is on
            self.model_state.expert_load_pass += torch.from_numpy(physical)
        self.state.step()
        if self.worker is not None:
            self._wait_for_worker()

    def _wait_for_worker(self, timeout_s: float = 1800.0) -> None:
        """Until the async worker is idle: no rearrangement pending, or the next layer's result ready."""
        deadline = time.monotonic() + timeout_s
        ms = self.model_state
        while ms.rebalanced and ms.pending_result is None:
            if not self.worker.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("vLLM's async EPLB worker stopped without producing the next layer")
            time.sleep(0.0002)


def _time_vllm_policy(registry: dict, policy: str, clock: Clock, stack: ExitStack) -> None:
    """Put the policy under test into vLLM's registry as "default" (moe-place: `install()`, which is what works
    with `use_async`) behind a timer that records each call; the registry is restored when `stack` closes."""
    stack.enter_context(mock.patch.dict(registry))
    if policy == "moe-place":
        stack.callback(uninstall, install())
    base = registry["default"]
    timed = clock.timed(base.rebalance_experts,
                        lambda args, kwargs: args[5] if len(args) > 5 else kwargs["old_global_expert_indices"],
                        lambda out: out)
    registry["default"] = type(f"Timed{base.__name__}", (base,), {"rebalance_experts": classmethod(
        lambda cls, *args, **kwargs: timed(*args, **kwargs))})


def _run_vllm(policy: str, size: Size, counts: np.ndarray, cadence: dict, use_async: bool, clock: Clock,
              on_step=None):
    from vllm.config import ParallelConfig
    from vllm.config.parallel import EPLBConfig
    from vllm.distributed.eplb import async_worker, eplb_state
    from vllm.model_executor.models.interfaces import MixtureOfExperts

    registry = eplb_state.EPLB_POLICIES
    coordinator = _Coordinator(size.gpus)
    with ExitStack() as stack:
        stack.enter_context(_patched(
            (eplb_state, "get_ep_group", lambda: coordinator), (eplb_state, "get_eplb_group", lambda: coordinator),
            (async_worker, "get_eplb_group", lambda: coordinator), (eplb_state, "get_node_count", lambda: size.nodes),
            (eplb_state, "create_eplb_communicator", lambda **_: _Communicator()),
            (eplb_state, "all_reduce", _all_reduce), (torch.distributed, "all_reduce", _all_reduce),
            (eplb_state, "rearrange_expert_weights_inplace", lambda *a, **k: None),
            (eplb_state, "move_from_buffer", lambda **_: None), (async_worker, "transfer_layer", lambda **_: None),
            (async_worker, "device_stream", _no_stream), (torch, "Event", standins.NoDeviceEvent), (eplb_state, "PIN_MEMORY", False)))
        _time_vllm_policy(registry, policy, clock, stack)
        config = ParallelConfig(enable_expert_parallel=True, eplb_config=EPLBConfig(
            window_size=cadence["window"], step_interval=cadence["step_interval"], use_async=use_async,
            communicator="torch_gloo"))
        state = eplb_state.EplbState(config, torch.device("cpu"))
        model = type("HarnessMoE", (MixtureOfExperts,), {})()
        model.num_moe_layers, model.num_expert_groups = size.layers, size.vllm_groups
        model.num_logical_experts = model.num_routed_experts = size.experts
        model.num_redundant_experts, model.num_physical_experts = size.redundant, size.physical
        model.num_local_physical_experts, model.num_shared_experts = size.physical // size.gpus, 0
        model.moe_layers = [_VllmLayer(eplb_state.EplbLayerState, model.num_local_physical_experts, size.shape)
                            for _ in range(size.layers)]
        state.add_model(model, _ModelConfig(size.shape))
        worker = None
        if use_async:
            worker = threading.Thread(target=async_worker.transfer_run_periodically, args=(state, _Stream()),
                                      daemon=True)
            worker.start()
        engine = _VllmEngine(eplb_state, state, next(iter(state.model_states.values())), worker)
        return drive(engine, counts, clock, on_step)


class _StandinVllmEngine:
    def __init__(self, eplb: standins.StandinVllmEplb):
        self.eplb = eplb

    def map_in_use(self) -> np.ndarray:
        return self.eplb.physical_to_logical_map.numpy().astype(np.int64)

    def serve(self, physical: np.ndarray) -> None:
        if self.eplb.record:
            self.eplb.add_pass_load(torch.from_numpy(physical))
        self.eplb.step()


def _run_standin_vllm(policy: str, size: Size, counts: np.ndarray, cadence: dict, use_async: bool, clock: Clock,
                      on_step=None):
    with standins.standin_vllm_modules() as registry, ExitStack() as stack:
        _time_vllm_policy(registry, policy, clock, stack)
        eplb = standins.StandinVllmEplb(registry, size.layers, size.experts, size.redundant, size.gpus, size.nodes,
                                        size.vllm_groups, cadence["step_interval"], cadence["window"], use_async,
                                        model=size.shape)
        return drive(_StandinVllmEngine(eplb), counts, clock, on_step)


def _time_sglang_policy(algorithms, location, policy: str, clock: Clock, stack: ExitStack) -> None:
    """Put the policy under test into SGLang's `eplb_algorithms.rebalance_experts` (moe-place:
    `install_rebalance_hook()`) behind a timer that records each call with the map in use (`location`'s
    global metadata); the hook is removed when `stack` closes (the caller restores the attribute)."""
    if policy == "moe-place":
        handle = install_rebalance_hook()
        stack.callback(uninstall_rebalance_hook, handle)
        hook = handle.hook
        clock.state = (lambda: hook.sessions, lambda sessions: setattr(hook, "sessions", sessions))
    else:
        clock.state = (lambda: None, lambda _: None)   # SGLang's own algorithm keeps nothing between calls
    algorithms.rebalance_experts = clock.timed(
        algorithms.rebalance_experts,
        lambda args, kwargs: location.get_global_expert_location_metadata().physical_to_logical_map_cpu,
        lambda out: out[0])


class _Recorder:
    """SGLang's expert-distribution recorder in `stat` mode, one process for all ranks (module note)."""

    recording = True

    def __init__(self, distribution, location, buffer_size: int, layers: int, physical: int):
        self.distribution, self.location = distribution, location
        self.buffer = distribution._CircularBuffer((layers, physical), buffer_size, dtype=torch.int32, device="cpu")

    def start_record(self):
        pass

    def append(self, physical: torch.Tensor) -> None:
        self.buffer.append(physical)

    def dump_record(self, output_mode: str = "file"):
        assert output_mode == "object"
        metadata = self.location.get_global_expert_location_metadata()
        logical = self.distribution._convert_global_physical_count_to_logical_count(
            self.buffer.get_all(), num_layers=metadata.num_layers, num_logical_experts=metadata.num_logical_experts,
            physical_to_logical_map=metadata.physical_to_logical_map)
        return {"rank": 0, "logical_count": logical, "average_utilization_rate_over_window": None}


class _DeviceModule:
    def synchronize(self):
        pass

    def empty_cache(self):
        pass


class _WeightUpdater:
    """SGLang's weight updater: called only for experts no rank holds (none here: no rank fails)."""

    def update_weights_from_disk(self, *_, **__):
        raise RuntimeError("the harness never loses an expert: nothing to load from disk")


class _SglangEngine:
    def __init__(self, manager, recorder, location):
        self.manager, self.recorder, self.location = manager, recorder, location

    def map_in_use(self) -> np.ndarray:
        return self.location.get_global_expert_location_metadata().physical_to_logical_map_cpu.numpy().astype(np.int64)

    def serve(self, physical: np.ndarray) -> None:
        self.recorder.append(torch.from_numpy(physical))  # the recorder's pass ends before the manager's hook
        self.manager.on_forward_pass_end()


def _run_sglang(policy: str, size: Size, counts: np.ndarray, cadence: dict, clock: Clock, on_step=None):
    from sglang.srt.runtime_context import get_context, get_parallel, get_resources

    iterations = cadence["step_interval"]
    with ExitStack() as stack:
        stack.enter_context(get_context().override_server_args(
            enable_eplb=True, ep_num_redundant_experts=size.redundant, ep_size=size.gpus, tp_size=size.gpus,
            nnodes=size.nodes, device="cpu", eplb_rebalance_num_iterations=iterations,
            expert_distribution_recorder_mode="stat", expert_distribution_recorder_buffer_size=iterations,
            ep_dispatch_algorithm="dynamic"))
        stack.enter_context(get_parallel().override(tp_rank=0))
        from sglang.srt.eplb import (eplb_algorithms, eplb_manager, expert_distribution, expert_location,
                                     expert_location_updater)

        shape = expert_location.ModelConfigForExpertLocation(size.layers, size.experts, size.groups)
        stack.enter_context(_patched(
            (expert_location.ModelConfigForExpertLocation, "from_model_config", staticmethod(lambda _: shape)),
            (expert_location_updater, "_update_expert_weights", lambda **_: {}),
            (torch, "get_device_module", lambda *_: _DeviceModule()),
            (eplb_algorithms, "rebalance_experts", eplb_algorithms.rebalance_experts)))  # restored after the run
        previous = get_resources().expert_location_metadata
        stack.callback(setattr, get_resources(), "expert_location_metadata", previous)
        model_config = types.SimpleNamespace(model_path=size.shape.name, hf_config=standins.hf_config_of(size.shape))
        expert_location.set_global_expert_location_metadata(
            expert_location.ExpertLocationMetadata.init_trivial(model_config, moe_ep_rank=0), allow_overwrite=True)
        _time_sglang_policy(eplb_algorithms, expert_location, policy, clock, stack)
        recorder = _Recorder(expert_distribution, expert_location, iterations, size.layers, size.physical)
        stack.enter_context(_patched((eplb_manager, "get_global_expert_distribution_recorder", lambda: recorder)))
        local = size.physical // size.gpus
        model = type("HarnessModel", (), {"routed_experts_weights_of_layer": {
            layer: standins.expert_weight_tensors(size.shape, local) for layer in range(size.layers)}})()
        updater = expert_location_updater.ExpertLocationUpdater()
        manager = eplb_manager.EPLBManager(model_config=model_config, get_model=lambda: model,
                                           get_expert_location_updater=lambda: updater,
                                           get_expert_backup_client=lambda: None,
                                           get_weight_updater=_WeightUpdater)
        return drive(_SglangEngine(manager, recorder, expert_location), counts, clock, on_step)


class _StandinSglangEngine:
    def __init__(self, eplb: standins.StandinSglangEplb):
        self.eplb = eplb

    def map_in_use(self) -> np.ndarray:
        return self.eplb.metadata.physical_to_logical_map_cpu.numpy().astype(np.int64)

    def serve(self, physical: np.ndarray) -> None:
        self.eplb.on_forward_pass(torch.from_numpy(physical))


def _run_standin_sglang(policy: str, size: Size, counts: np.ndarray, cadence: dict, clock: Clock, on_step=None):
    with standins.standin_sglang_modules(cadence["step_interval"]) as modules, ExitStack() as stack:
        algorithms, location = modules
        _time_sglang_policy(algorithms, location, policy, clock, stack)
        eplb = standins.StandinSglangEplb(modules, size.layers, size.experts, size.redundant, size.gpus, size.nodes,
                                          size.groups, num_iterations=cadence["step_interval"], model=size.shape)
        return drive(_StandinSglangEngine(eplb), counts, clock, on_step)


def default_cadence(engine: str) -> dict:
    return dict(VLLM_DEFAULT_CADENCE if "vllm" in engine else SGLANG_DEFAULT_CADENCE)


def run_engine(engine: str, policy: str, size: Size, counts: np.ndarray, cadence: dict | None = None,
               use_async: bool = True, on_step: Callable[[int], None] | None = None) -> EngineRun:
    """Serve `counts` (`[steps, layers, E]`) through `engine` with `policy` at `cadence` (default: the
    engine's own; keys `step_interval`, `window`; SGLang's window is its buffer, the interval)."""
    if engine not in ENGINES:
        raise ValueError(f"engine: expected one of {', '.join(ENGINES)}, got {engine!r}")
    if policy not in POLICIES:
        raise ValueError(f"policy: expected one of {', '.join(POLICIES)}, got {policy!r}")
    cadence = dict(default_cadence(engine) if cadence is None else cadence)
    if "sglang" in engine:
        cadence["window"] = cadence["step_interval"]
        use_async = False  # layers_per_chunk unset (the default): every layer at once, serving waits
    clock = Clock(repeats=SGLANG_CPU_REPEATS if "sglang" in engine else 0)
    start = time.perf_counter()
    runner = {"vllm": _run_vllm, "standin-vllm": _run_standin_vllm}.get(engine)
    if runner is not None:
        maps, map_of_step = runner(policy, size, counts, cadence, use_async, clock, on_step)
    else:
        runner = _run_sglang if engine == "sglang" else _run_standin_sglang
        maps, map_of_step = runner(policy, size, counts, cadence, clock, on_step)
    return EngineRun(engine, policy, cadence, "async" if use_async else "stall", maps, map_of_step, clock.calls,
                     time.perf_counter() - start)


def engine_versions(engines: list[str]) -> dict:
    """Versions of what ran: the engines imported (vllm, sglang), torch, numpy, and the stand-ins' targets."""
    out = {"torch": torch.__version__, "numpy": np.__version__,
           "standins": {"vllm": standins.VLLM_VERSION, "sglang": standins.SGLANG_VERSION}}
    for name in ("vllm", "sglang"):
        if name in engines:
            out[name] = importlib.import_module(name).__version__
    return out


def importable(engine: str) -> bool:
    name = {"vllm": "vllm", "sglang": "sglang"}.get(engine)
    return name is None or importlib.util.find_spec(name) is not None


# ---------------------------------------------------------------------- judging a run
def busiest_over_mean(phy2log: np.ndarray, load: np.ndarray, num_gpus: int) -> float:
    """Mean over layers of the busiest GPU's load over the mean GPU's (even split); nan without load."""
    gpu = even_split_gpu_loads(phy2log, load, num_gpus)
    mean = gpu.mean(axis=1)
    if not (mean > 0).all():
        return float("nan")
    return float((gpu.max(axis=1) / mean).mean())


def groups_inside_nodes(phy2log: np.ndarray, size: Size) -> bool:
    """True when every expert group (consecutive ids, E / groups each) has all its replicas on one node."""
    group = phy2log // (size.experts // size.groups)
    node = np.arange(size.physical) // (size.physical // size.nodes)
    for layer in range(phy2log.shape[0]):
        pairs = np.unique(np.stack([group[layer], np.broadcast_to(node, group[layer].shape)]), axis=1)
        if len(np.unique(pairs[0])) != pairs.shape[1]:
            return False
    return True


def _placement(phy2log: np.ndarray, size: Size) -> Placement:
    return Placement(phy2log, size.experts, size.gpus, size.nodes, allow_colocated=True)


def copy_bytes(old: np.ndarray, new: np.ndarray, size: Size, cost: ReplayCost) -> int:
    """Bytes copied between GPUs to go from `old` to `new` (`plan_copies`, cheapest holder)."""
    copies = plan_copies(_placement(old, size), _placement(new, size), cost.topology, cost.expert_bytes)
    return int(sum(c.num_bytes for c in copies if not c.local))


def rebalance_rows(run: EngineRun, workload: Workload, size: Size) -> list[dict]:
    """One row per policy call (module note). `stale`: the workload changed within the steps the call serves
    (its map was planned for a load that ended); `applied`: the engine ran the returned map afterwards."""
    cost = size.cost()
    rows = []
    steps = len(workload.counts)
    for k, call in enumerate(run.calls):
        end = run.calls[k + 1].step if k + 1 < len(run.calls) else steps - 1
        served = workload.counts[call.step + 1:end + 1].sum(axis=0, dtype=np.float64)
        settle = min(call.step + 1 + (size.layers if run.migration == "async" else 0), steps - 1)
        row = {"call": k, "step": call.step, "served_steps": end - call.step,
               "busiest_over_mean": busiest_over_mean(call.after, served, size.gpus) if end > call.step else None,
               "slots_changed": int((call.after != call.before).sum()),
               "bytes_moved": copy_bytes(call.before, call.after, size, cost),
               "policy_s": call.cpu_s, "policy_wall_s": call.wall_s, "policy_first_s": call.cpu_first_s,
               "stale": workload.change_step is not None and call.step < workload.change_step <= end,
               "applied": bool(np.array_equal(run.maps[run.map_of_step[settle]], call.after)) if settle > call.step
               else None}
        if size.hierarchical:
            row["groups_inside_nodes"] = groups_inside_nodes(call.after, size)
        rows.append(row)
    return rows


def price_run(run: EngineRun, counts: np.ndarray, size: Size) -> dict:
    """Total time of a run on the cost model (module note): the layer time per step of the map in use (expert
    time, dispatch + combine), what serving pays for each map change under the run's migration model, and the
    policy's own CPU time where the engine waits for it (not in vLLM's async worker thread, which runs beside
    serving: `policy_cpu_s`; the calls as the engine made them, not the least of their repeats).
    `model_s` is the first two (deterministic), `total_s` all three (`policy_wall_s`: its wall time)."""
    cost = size.cost(run.migration)
    placements = [_placement(m, size) for m in run.maps]
    expert_s, comm_s, _ = served_steps(cost, [placements[i] for i in run.map_of_step], counts,
                                       np.zeros(counts.shape[:2], dtype=bool))
    migration_s = 0.0
    moved = 0
    for t in np.flatnonzero(np.diff(run.map_of_step)) + 1:
        old, new = placements[run.map_of_step[t - 1]], placements[run.map_of_step[t]]
        copies = cost.copies(old, new)
        migration_s += float(cost.charge(copies, old, counts[t]).charged_s)
        moved += int(sum(c.num_bytes for c in copies if not c.local))
    policy_cpu_s = float(sum(c.cpu_s if c.cpu_first_s is None else c.cpu_first_s for c in run.calls))   # as called
    policy_s = 0.0 if run.migration == "async" else policy_cpu_s   # vLLM's async worker: beside serving
    model_s = float(expert_s.sum() + comm_s.sum()) + migration_s
    return {"expert_s": float(expert_s.sum()), "comm_s": float(comm_s.sum()), "migration_s": migration_s,
            "policy_s": policy_s, "policy_cpu_s": policy_cpu_s, "model_s": model_s, "total_s": model_s + policy_s,
            "policy_wall_s": float(sum(c.wall_s for c in run.calls)), "bytes_moved": moved,
            "calls": len(run.calls), "map_changes": int(np.count_nonzero(np.diff(run.map_of_step)))}


# ---------------------------------------------------------------------- the targets of issue 21
BALANCE_TOLERANCE = 1.01  # busiest/mean at most 1% above the default's, after every rebalance


@dataclass(frozen=True)
class Target:
    name: str
    passed: bool
    detail: str

    def line(self) -> str:
        return f"{'PASS' if self.passed else 'FAIL'}  {self.name}: {self.detail}"


def judge_workload(label: str, default_rows: list[dict], ours_rows: list[dict], size: Size,
                   stationary_calls: int) -> list[Target]:
    """The in-engine targets on a stationary load and a change of workload (issue 21, "What the policy must do")."""
    worse = []
    for d, o in zip(default_rows, ours_rows):
        if d["stale"] or o["stale"] or d["busiest_over_mean"] is None or o["busiest_over_mean"] is None:
            continue
        if o["busiest_over_mean"] > d["busiest_over_mean"] * BALANCE_TOLERANCE:
            worse.append(f"call {o['call']} {o['busiest_over_mean']:.3f} vs {d['busiest_over_mean']:.3f}")
    judged = sum(1 for d, o in zip(default_rows, ours_rows) if not (d["stale"] or o["stale"]))
    targets = [Target(f"{label}: busiest/mean <= 1.01 x default after every rebalance", not worse and judged > 0,
                      f"{judged - len(worse)}/{judged} calls within (stale calls after the change not judged)"
                      + (f"; worse: {', '.join(worse[:4])}" + (" ..." if len(worse) > 4 else "") if worse else ""))]
    for key, what in (("slots_changed", "slots"), ("bytes_moved", "bytes")):
        ours, default = sum(r[key] for r in ours_rows), sum(r[key] for r in default_rows)
        targets.append(Target(f"{label}: fewer {what} moved than the default over the run", ours < default,
                              f"{ours:,} vs {default:,}"))
    noise = [r["slots_changed"] for r in ours_rows[1:stationary_calls]]
    before = [round(r["busiest_over_mean"], 3) for r in ours_rows[:stationary_calls - 1]]
    default_noise = [r["slots_changed"] for r in default_rows[1:stationary_calls]]
    targets.append(Target(f"{label}: no slot moved on sampling noise alone (stationary calls 2..{stationary_calls})",
                          bool(noise) and not any(noise), f"slots per call {noise}, busiest/mean of the map each "
                          f"call found {before} (default: slots {default_noise})"))
    if size.hierarchical:
        bad = [r["call"] for r in ours_rows if not r["groups_inside_nodes"]]
        default_bad = [r["call"] for r in default_rows if not r["groups_inside_nodes"]]
        targets.append(Target(f"{label}: every group and its replicas inside one node", not bad,
                              f"calls breaking it: {bad or 'none'} (default: {default_bad or 'none'})"))
    return targets


def judge_drift(label: str, at_default: list[tuple[dict, dict]], time_key: str = "total_s") -> list[Target]:
    """Drift target at the engine's own cadence: `at_default` (default, ours) priced runs. `time_key`:
    "total_s" (the policy's CPU time included where the engine waits for it) or "model_s" (without it: what
    a test can assert, timings being noisy)."""
    worse = [f"{d['scenario']}: {o[time_key]:.2f} vs {d[time_key]:.2f} s, {o['bytes_moved'] / 2**30:.2f} vs "
             f"{d['bytes_moved'] / 2**30:.2f} GiB" for d, o in at_default
             if not (o[time_key] <= d[time_key] and o["bytes_moved"] < d["bytes_moved"])]
    targets = [Target(f"{label}: drift, default cadence: total time <= default's on every run, fewer bytes",
                      not worse and bool(at_default), f"{len(at_default) - len(worse)}/{len(at_default)} runs"
                      + (f"; not: {'; '.join(worse)}" if worse else ""))]
    return targets


SAME_CADENCE = 1.005        # moe-place / default at every cadence run
BEST_AGAINST_BEST = 0.92    # moe-place at its best cadence / the default at its best


def judge_cadences(label: str, rows: list[dict], time_key: str = "total_s") -> list[Target]:
    """Drift targets over the cadences run per trace (`rows`: {scenario, runs: priced runs with "at" and
    "policy"}): moe-place at most `SAME_CADENCE` x the default at every cadence; best against best."""
    same, best = [], []
    for row in rows:
        by = {(r["at"], r["policy"]): r for r in row["runs"]}
        for at in sorted({r["at"] for r in row["runs"]}):
            same.append((row["scenario"], at, by[(at, "moe-place")][time_key] / by[(at, "default")][time_key]))
        bests = {p: min(r[time_key] for r in row["runs"] if r["policy"] == p) for p in POLICIES}
        best.append((row["scenario"], bests["moe-place"] / bests["default"]))
    worst = max(same, key=lambda x: x[2]) if same else ("", "", 0.0)
    return [Target(f"{label}: drift, every cadence run: moe-place total <= {SAME_CADENCE} x the default's",
                   bool(same) and worst[2] <= SAME_CADENCE,
                   f"worst {worst[2]:.4f} ({worst[0]}, {worst[1]}); "
                   + ", ".join(f"{s} {a} {r:.3f}" for s, a, r in same)),
            Target(f"{label}: drift, best against best: moe-place <= {BEST_AGAINST_BEST} x the default, "
                   "every trace",
                   bool(best) and max(r for _, r in best) <= BEST_AGAINST_BEST,
                   ", ".join(f"{s} {r:.4f}" for s, r in best))]


PREDICTION_TOLERANCE = 0.01   # the replay's total within 1% of the engine's own code's, every run (issue 46)
ADVICE_TOLERANCE = 1.005      # in the engine's code, the advised cadence within 0.5% of the best of the sweep


def judge_predictions(label: str, predictions: list[tuple[str, int, str, float]]) -> list[Target]:
    """The replay's prediction of every engine run (`predictions`: scenario, interval, policy, relative error of
    its total): within `PREDICTION_TOLERANCE`."""
    worst = max(predictions, key=lambda p: abs(p[3])) if predictions else ("", 0, "", 0.0)
    return [Target(f"{label}: drift, the replay's total within {PREDICTION_TOLERANCE:.0%} of the engine's code, every "
                   "run", bool(predictions) and abs(worst[3]) <= PREDICTION_TOLERANCE,
                   f"worst {worst[3]:+.2%} ({worst[0]}, {worst[2]} every {worst[1]}); {len(predictions)} runs, "
                   f"{sum(abs(p[3]) <= PREDICTION_TOLERANCE for p in predictions)} within")]


def judge_advice(label: str, advice: list[tuple[str, str, int, float]]) -> list[Target]:
    """What `moe-place cadence` advises, judged in the engine's code (`advice`: scenario, policy, advised interval,
    its total over the best of the engine's sweep): within `ADVICE_TOLERANCE`."""
    worst = max(advice, key=lambda a: a[3]) if advice else ("", "", 0, 1.0)
    return [Target(f"{label}: drift, the advised cadence within {ADVICE_TOLERANCE - 1:.1%} of the best of the sweep "
                   "in the engine's code, each policy",
                   bool(advice) and worst[3] <= ADVICE_TOLERANCE,
                   "; ".join(f"{s} {p} every {i}: {r:.4f}" for s, p, i, r in advice))]
