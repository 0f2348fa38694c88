"""TensorRT-LLM's offline EPLB greedy, reimplemented in numpy from its source: a baseline solver.

Provenance. TensorRT-LLM's `examples/wide_ep/ep_load_balancer/generate_eplb_config.py` (NVIDIA/TensorRT-LLM
at 76a646e) sums each MoE layer's expert counts over the chosen iterations, casts them to float32
(`expert_load_factor`), and calls two C++ functions through its bindings, `do_replication` then
`do_placement`, with `ep_size` ranks of `num_slots // ep_size` slots each; the layer's map is the ranks'
slot lists one after the other. The two functions are in
`cpp/tensorrt_llm/runtime/moeLoadBalancer/moeLoadBalancer.cpp` (at 65b31db), read with the search
tools. This module follows what they do, step by step (not their code):

1. Replication (`trtllm_replicas`): every expert gets one replica. If the slots equal the experts,
   that is all. If every load is 0, the slots are spread evenly, the first `slots % E` experts one
   more. Otherwise each remaining slot goes, one at a time, to the expert with the largest
   `load / replicas` (a max-heap of (size, expert id): on a tie the larger expert id wins).
2. Placement (`trtllm_placement`): each expert's replicas carry `load / replicas` each; all replicas
   are sorted by that size, largest first, ties by smaller expert id; each in turn goes to the rank
   with the least load so far that still has a free slot (a min-heap of (load, rank): on a tie the
   smaller rank), at the rank's next free slot. Loads add up in double precision.

Replicas of one expert may land on one rank (nothing in step 2 prevents it): such a plan says so
(`detail["colocated"]`) and needs `Placement(..., allow_colocated=True)`, as DeepSeek EPLB's does.
The registered solver `"trtllm"` plans one layer of a `PlacementProblem` on its loads summed over
windows, which is what the script plans on.
"""

from __future__ import annotations

import heapq
import time
from typing import ClassVar

import numpy as np

from moe_place.errors import InputError
from moe_place.placement import has_colocation
from moe_place.problem import PlacementProblem
from moe_place.solvers.base import LayerSolution, register
from moe_place.solvers.bounds import window_lower_bound
from moe_place.solvers.evaluate import window_objective

__all__ = ["TrtllmSolver", "trtllm_placement", "trtllm_plan", "trtllm_replicas"]


def _load_factor(load: np.ndarray) -> np.ndarray:
    """float64 `[E]`: the loads as TensorRT-LLM hands them to its C++ greedy (float32, then double)."""
    load = np.asarray(load, dtype=np.float64)
    if load.ndim != 1 or not np.isfinite(load).all() or (load < 0).any():
        raise InputError("load", "a 1-D array of finite loads >= 0", f"shape {load.shape}")
    return load.astype(np.float32).astype(np.float64)


def trtllm_replicas(load: np.ndarray, num_slots: int) -> np.ndarray:
    """int64 `[E]`: replicas per expert, step 1 of the module docstring (`do_replication`)."""
    factor = _load_factor(load)
    num_experts = factor.shape[0]
    if num_slots < num_experts:
        raise InputError("num_slots", f"at least the {num_experts} experts", num_slots)
    replicas = np.ones(num_experts, dtype=np.int64)
    if num_slots == num_experts:
        return replicas
    if factor.sum() == 0.0:
        replicas[:] = num_slots // num_experts
        replicas[:num_slots % num_experts] += 1
        return replicas
    heap = [(-size, -expert) for expert, size in enumerate(factor.tolist())]  # max-heap of (size, expert id)
    heapq.heapify(heap)
    for _ in range(num_slots - num_experts):
        _, neg_expert = heapq.heappop(heap)
        expert = -neg_expert
        replicas[expert] += 1
        heapq.heappush(heap, (-(factor[expert] / replicas[expert]), neg_expert))
    return replicas


def trtllm_placement(load: np.ndarray, replicas: np.ndarray, num_ranks: int) -> np.ndarray:
    """int64 `[P]`: the expert of each slot, rank by rank, step 2 of the module docstring (`do_placement`)."""
    factor = _load_factor(load)
    replicas = np.asarray(replicas, dtype=np.int64)
    num_slots = int(replicas.sum())
    if replicas.shape != factor.shape or (replicas < 1).any():
        raise InputError("replicas", f"[{factor.shape[0]}] counts >= 1", replicas.tolist())
    if num_ranks < 1 or num_slots % num_ranks:
        raise InputError("num_ranks", f"a divisor of the {num_slots} slots", num_ranks)
    per_rank = num_slots // num_ranks
    sizes = factor / replicas
    order = sorted(((float(sizes[e]), e) for e in range(factor.shape[0]) for _ in range(replicas[e])),
                   key=lambda item: (-item[0], item[1]))
    ranks: list[list[int]] = [[] for _ in range(num_ranks)]
    heap = [(0.0, rank) for rank in range(num_ranks)]  # a min-heap of (load, rank)
    for size, expert in order:
        load_so_far, rank = heapq.heappop(heap)
        ranks[rank].append(expert)
        if len(ranks[rank]) < per_rank:
            heapq.heappush(heap, (load_so_far + size, rank))
    return np.array([expert for rank in ranks for expert in rank], dtype=np.int64)


def trtllm_plan(load: np.ndarray, num_slots: int, num_ranks: int) -> np.ndarray:
    """int64 `[P]`: TensorRT-LLM's offline map of one layer, `generate_eplb_config.py`'s two calls."""
    return trtllm_placement(load, trtllm_replicas(load, num_slots), num_ranks)


@register
class TrtllmSolver:
    """TensorRT-LLM's greedy on one layer (the module docstring), on the loads summed over windows.

    The plan is returned as the greedy makes it, co-located replicas included (then
    `detail["colocated"]` is True and the plan needs `allow_colocated=True`).
    """

    name: ClassVar[str] = "trtllm"

    def prepare(self, problem: PlacementProblem, layers: list[int]) -> None:
        """Nothing to share: the greedy plans a layer in milliseconds."""

    def solve_layer(self, problem: PlacementProblem, layer: int, time_limit_s: float | None, *,
                    start: LayerSolution | None = None, deadline: float | None = None) -> LayerSolution:
        """The greedy's plan (time limit, start and deadline unused: it runs in milliseconds)."""
        begun = time.perf_counter()
        phy2log = trtllm_plan(problem.planning_loads()[layer], problem.num_physical, problem.num_gpus)
        objective = window_objective(problem, layer, phy2log)
        bound = min(window_lower_bound(problem, layer), objective)
        status = "optimal" if objective <= bound * (1 + 1e-9) else "heuristic"  # met the bound: proved
        return LayerSolution(phy2log, status, objective, bound, time.perf_counter() - begun,
                             {"colocated": has_colocation(phy2log, problem.num_gpus)})
