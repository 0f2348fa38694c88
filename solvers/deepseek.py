"""DeepSeek EPLB, reimplemented in numpy from its published algorithm: our baseline.

DeepSeek's expert-parallel load balancer (github.com/deepseek-ai/EPLB, `eplb.py`) plans every
layer in three steps, each a greedy rule on the even-split load model:

1. Pack expert groups onto nodes (hierarchical policy only): groups sorted by load, heaviest
   first, each to the lightest node that still has room (every node gets the same number of
   groups).
2. Replicate inside each node: start with one replica per expert, then hand out the node's
   remaining slots one at a time, each to the expert with the largest `load / replicas`.
3. Pack the replicas onto the node's GPUs: replicas sorted by `load / replicas`, heaviest
   first, each to the lightest GPU that still has a free slot (every GPU gets `P/G` replicas).

The hierarchical policy is used when the number of groups is a multiple of the number of
nodes; otherwise the global policy runs the same steps with one group and one node. Arithmetic
is float32 as in the original, and argument errors are `ParameterError`s (an `InputError` that
is also an `AssertionError`, as the original asserts). Replicas of one expert can land on the
same GPU (EPLB issue #22): a plan from here may need `Placement(..., allow_colocated=True)`.

Ties. Both sorts (steps 1 and 3) order equal loads somehow, and the order decides where equal
items go. By default ties go to the lowest index (a stable sort), which gave the same maps as
vLLM 0.33's numpy port of this algorithm on tied integer loads. The original sorts with torch's default
sort, which is not stable above 16 elements: pass `descending_order` (an argsort) to reproduce
it; `moe_place.eplb.rebalance_experts(solver="eplb")` passes torch's own sort, so the drop-in
returns exactly what `eplb.py` returns on the same torch, ties included. Replicas of one expert
always tie in step 3, so this also decides the order of an expert's slots in `log2phy`.

Public entry points (named apart from the drop-in `moe_place.eplb.rebalance_experts`):
- `eplb_maps(weight, num_replicas, num_groups, num_nodes, num_gpus)` returns the original's
  three maps `(phy2log, log2phy, logcnt)`, `log2phy` in the original's replica order.
- `eplb_rebalance(...)` returns `phy2log` only (what recent vLLM policies return).
- the registered solver `"eplb"` plans one layer of a `PlacementProblem`.
"""

from __future__ import annotations

import heapq
import time
from typing import Callable, ClassVar

import numpy as np

from moe_place.errors import ParameterError
from moe_place.placement import has_colocation
from moe_place.problem import PlacementProblem
from moe_place.solvers.base import LayerSolution, register
from moe_place.solvers.bounds import window_lower_bound
from moe_place.solvers.evaluate import window_objective

__all__ = ["EplbSolver", "balanced_packing", "check_eplb_arguments", "eplb_maps", "eplb_rebalance", "numpy_group_sum",
           "plans_hierarchically", "rebalance_steps", "replicate_experts", "stable_descending_order"]

DescendingOrder = Callable[[np.ndarray], np.ndarray]
"""`(values float32 [rows, n]) -> int64 [rows, n]`: per row, the indices from the largest value down."""


def stable_descending_order(values: np.ndarray) -> np.ndarray:
    """int64 `[rows, n]`: indices by descending value, ties by lowest index (the default order)."""
    return np.argsort(-values, axis=1, kind="stable")


def balanced_packing(weight: np.ndarray, num_packs: int, descending_order: DescendingOrder = stable_descending_order,
                     accumulate: type = np.float32) -> tuple[np.ndarray, np.ndarray]:
    """Greedy packing of `n` items into `num_packs` packs of exactly `n / num_packs` items each.

    weight: float32 `[rows, n]` (or float64), each row packed on its own.
    descending_order: the order items are taken in (heaviest first; see "Ties" above).
    accumulate: the dtype of the packs' loads: float32 as DeepSeek's `eplb.py` sums them, float64 as
        vLLM 0.33's and SGLang 0.5.23's own ports do (bench/inengine/standins.py).
    Returns `(pack_index, rank_in_pack)`, both int64 `[rows, n]`: the pack of each item and its
    position inside the pack (the order in which it was put there).
    """
    rows, items = weight.shape
    assert items % num_packs == 0, (items, num_packs)
    per_pack = items // num_packs
    if per_pack == 1:
        pack_index = np.broadcast_to(np.arange(items, dtype=np.int64), (rows, items)).copy()
        return pack_index, np.zeros((rows, items), dtype=np.int64)
    order = np.asarray(descending_order(weight), dtype=np.int64)
    taken = np.take_along_axis(weight, order, axis=1)        # [rows, n] in packing order
    if rows < HEAP_PACKING_BELOW_ROWS and taken.dtype == np.float32 and accumulate == np.float32:
        packs, rank = _pack_rows_by_heap(taken, num_packs, per_pack)
    else:
        packs, rank = _pack_rows_at_once(taken, num_packs, per_pack, accumulate)
    pack_index = np.empty((rows, items), dtype=np.int64)
    rank_in_pack = np.empty((rows, items), dtype=np.int64)
    np.put_along_axis(pack_index, order, packs, axis=1)
    np.put_along_axis(rank_in_pack, order, rank, axis=1)
    return pack_index, rank_in_pack


HEAP_PACKING_BELOW_ROWS = 12
"""`balanced_packing` packs fewer rows than this one row at a time with a heap (cheaper for the few
rows of one engine call on one node), more rows all at once with numpy; both give the same packs."""


def _pack_rows_at_once(taken: np.ndarray, num_packs: int, per_pack: int,
                       accumulate: type = np.float32) -> tuple[np.ndarray, np.ndarray]:
    """`(pack, rank)` int64 `[rows, n]` of the items of `taken` (in packing order), the packs' loads summed in
    `accumulate`: all rows together, one numpy step per item position."""
    rows, items = taken.shape
    # the packs' loads, flat (row-major): a full pack's load becomes inf, so "the lightest pack
    # with room, first on ties" is a plain argmin (the other packs keep their sums)
    load = np.zeros(rows * num_packs, dtype=accumulate)
    count = np.zeros(rows * num_packs, dtype=np.int64)
    base = np.arange(rows) * num_packs
    packs = np.empty((rows, items), dtype=np.int64)          # the pack of the item at each position
    by_row = load.reshape(rows, num_packs)                   # a view of `load`
    for position in range(items):
        pack = np.argmin(by_row, axis=1)
        packs[:, position] = pack
        flat = base + pack
        load[flat] += taken[:, position]
        count[flat] += 1
        load[flat[count[flat] == per_pack]] = np.inf
    # an item's rank in its pack: the items put there before it (every pack ends with per_pack)
    by_pack = np.argsort(packs, axis=1, kind="stable")      # positions grouped by pack, in order
    rank = np.empty_like(packs)
    np.put_along_axis(rank, by_pack, np.arange(items)[None, :] - np.take_along_axis(packs, by_pack, axis=1) * per_pack,
                      axis=1)
    return packs, rank


def _pack_rows_by_heap(taken: np.ndarray, num_packs: int, per_pack: int) -> tuple[np.ndarray, np.ndarray]:
    """`_pack_rows_at_once`, one row at a time: the packs with room in a heap of `(float32 load, pack)`,
    so the top is the lightest, lowest index on ties (numpy's argmin); a full pack leaves the heap."""
    rows, items = taken.shape
    packs = np.empty((rows, items), dtype=np.int64)
    rank = np.empty((rows, items), dtype=np.int64)
    zero = np.float32(0.0)
    for row in range(rows):
        heap = [(zero, pack) for pack in range(num_packs)]   # sorted: a heap already
        count = [0] * num_packs
        row_packs, row_ranks = [], []
        for w in taken[row]:                                 # np.float32 items: float32 sums
            load, pack = heap[0]
            row_packs.append(pack)
            row_ranks.append(count[pack])
            count[pack] += 1
            if count[pack] == per_pack:
                heapq.heappop(heap)
            else:
                heapq.heapreplace(heap, (load + w, pack))
        packs[row], rank[row] = row_packs, row_ranks
    return packs, rank


def replicate_experts(weight: np.ndarray, num_physical: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Give `num_physical - n` extra replicas, one at a time, to the largest `load / replicas`.

    weight: float32 `[rows, n]` loads of `n` logical experts.
    Returns `phy2log` int64 `[rows, num_physical]` (the first `n` slots hold experts `0..n-1`,
    the extra slots follow in the order they were handed out), `replica_rank` int64
    `[rows, num_physical]` (0 for the first replica of an expert, 1 for the second, ...) and
    `logcnt` int64 `[rows, n]`.
    """
    rows, experts = weight.shape
    assert num_physical >= experts, (num_physical, experts)
    phy2log = np.broadcast_to(np.arange(num_physical, dtype=np.int64), (rows, num_physical)).copy()
    replica_rank = np.zeros((rows, num_physical), dtype=np.int64)
    logcnt = np.ones((rows, experts), dtype=np.int64)
    row_ids = np.arange(rows)
    per_replica = weight / logcnt.astype(np.float32)                   # float32, updated where a count changes
    for slot in range(experts, num_physical):
        expert = np.argmax(per_replica, axis=1)                        # first on ties
        phy2log[:, slot] = expert
        count = logcnt[row_ids, expert]
        replica_rank[:, slot] = count
        logcnt[row_ids, expert] = count + 1
        per_replica[row_ids, expert] = weight[row_ids, expert] / (count + 1).astype(np.float32)
    return phy2log, replica_rank, logcnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    """Row-wise inverse of permutations `[rows, n]`."""
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inv


GroupSum = Callable[[np.ndarray, int], np.ndarray]
"""`(weight float32 [layers, E], num_groups) -> float32 [layers, num_groups]`: the groups' loads (step 1)."""


def numpy_group_sum(weight: np.ndarray, num_groups: int) -> np.ndarray:
    """float32 `[layers, num_groups]`: each group's load, summed as numpy sums (`eplb.py`'s and vLLM's order)."""
    return weight.reshape(weight.shape[0], num_groups, -1).sum(axis=-1)


def rebalance_steps(weight: np.ndarray, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int,
                    descending_order: DescendingOrder = stable_descending_order, *, accumulate: type = np.float32,
                    ratio: type = np.float32, group_sum: GroupSum = numpy_group_sum
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The three steps above, the one composition of them (the engines' stand-ins call it with their arithmetic).

    weight: float32 `[layers, E]`; pass `num_groups = num_nodes = 1` for the global policy. accumulate: the
    packs' load dtype (`balanced_packing`); ratio: the dtype of `load / replicas` in steps 2 and 3 (float32 as
    `eplb.py` and SGLang's torch, float64 as vLLM's numpy divides by int64 counts); group_sum: step 1's sums.
    Returns `phy2log`, `replica_rank` and `logcnt`, int64 `[layers, P]`, `[layers, P]`, `[layers, E]`.
    """
    layers, experts = weight.shape
    group_size = experts // num_groups
    groups_per_node = num_groups // num_nodes
    slots_per_gpu = num_physical // num_gpus
    experts_per_node = experts // num_nodes

    # Step 1: groups to nodes. "Node-major" ids (nlog) number the experts node by node; the global
    # policy's one group on one node numbers them as they are.
    one_node = num_groups == 1 and num_nodes == 1
    if one_node:
        node_load = weight
    else:
        group_node, group_rank = balanced_packing(group_sum(weight, num_groups), num_nodes, descending_order,
                                                  accumulate)
        group_start = (group_node * groups_per_node + group_rank) * group_size  # [layers, groups]
        log2nlog = (group_start[:, :, None] + np.arange(group_size)).reshape(layers, experts)
        nlog2log = _inverse(log2nlog)
        node_load = np.take_along_axis(weight, nlog2log, axis=1).reshape(layers * num_nodes, experts_per_node)

    # Step 2: replicas inside each node; rows are (layer, node) pairs from here on.
    node_ratio = node_load.astype(ratio, copy=False)
    phy2nlog, replica_rank, nlogcnt = replicate_experts(node_ratio, num_physical // num_nodes)

    # Step 3: the node's replicas onto its GPUs. "GPU-major" ids (gphy) are the final slot ids.
    replica_load = np.take_along_axis(node_ratio / nlogcnt.astype(ratio), phy2nlog, axis=1)
    gpu_index, rank_in_gpu = balanced_packing(replica_load, num_gpus // num_nodes, descending_order, accumulate)
    gphy2phy = _inverse(gpu_index * slots_per_gpu + rank_in_gpu)

    gphy2nlog = np.take_along_axis(phy2nlog, gphy2phy, axis=1)
    rank = np.take_along_axis(replica_rank, gphy2phy, axis=1).reshape(layers, num_physical)
    if one_node:
        return gphy2nlog, rank, nlogcnt
    node_offset = (np.arange(num_nodes) * experts_per_node)[None, :, None]
    gphy2nlog = (gphy2nlog.reshape(layers, num_nodes, -1) + node_offset).reshape(layers, num_physical)
    phy2log = np.take_along_axis(nlog2log, gphy2nlog, axis=1)
    logcnt = np.take_along_axis(nlogcnt.reshape(layers, experts), log2nlog, axis=1)
    return phy2log, rank, logcnt


def eplb_maps(weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int, *,
              descending_order: DescendingOrder = stable_descending_order
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """DeepSeek EPLB's three maps for `weight`.

    weight: `[layers, E]` non-negative loads (token counts) of the logical experts.
    num_replicas: `P`, physical experts per layer, a multiple of `num_gpus`, `>= E`.
    num_groups: expert groups; hierarchical policy when `num_groups % num_nodes == 0` (then
        `E % num_groups == 0` and `num_gpus % num_nodes == 0` are required), global otherwise.
    descending_order: the sort of steps 1 and 3 (see "Ties" in the module docstring).
    Returns `phy2log` int64 `[layers, P]`, `log2phy` int64 `[layers, E, max(logcnt)]` (-1 padded,
    each expert's slots in the order its replicas were created, as the original lists them) and
    `logcnt` int64 `[layers, E]`. Bad arguments raise `ParameterError` where the original asserts.
    """
    weight = _check_weight(weight)
    layers, experts = weight.shape
    hierarchical = check_eplb_arguments(experts, num_replicas, num_groups, num_nodes, num_gpus)
    groups, nodes = (num_groups, num_nodes) if hierarchical else (1, 1)
    phy2log, rank, logcnt = rebalance_steps(weight, num_replicas, groups, nodes, num_gpus, descending_order)
    width = int(logcnt.max())
    log2phy = np.full((layers, experts * width), -1, dtype=np.int64)
    np.put_along_axis(log2phy, phy2log * width + rank,
                      np.broadcast_to(np.arange(num_replicas, dtype=np.int64), phy2log.shape), axis=1)
    return phy2log, log2phy.reshape(layers, experts, width), logcnt


def eplb_rebalance(weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int,
                   num_gpus: int) -> np.ndarray:
    """int64 `[layers, P]`: the `phy2log` of `eplb_maps` (arguments as there), without building `log2phy`."""
    weight = _check_weight(weight)
    hierarchical = check_eplb_arguments(weight.shape[1], num_replicas, num_groups, num_nodes, num_gpus)
    groups, nodes = (num_groups, num_nodes) if hierarchical else (1, 1)
    return rebalance_steps(weight, num_replicas, groups, nodes, num_gpus)[0]


def plans_hierarchically(num_groups: int | None, num_nodes: int) -> bool:
    """Whether EPLB plans hierarchically (expert groups packed onto nodes first): the original's test,
    `num_groups % num_nodes == 0`, which vLLM's default policy and SGLang's `auto` apply as well; no groups
    (None or 0, what engines pass for a model without them) is the global policy. The one place moe-place
    decides it."""
    return bool(num_groups) and num_nodes >= 1 and num_groups % num_nodes == 0


def check_eplb_arguments(num_experts: int, num_replicas: int, num_groups: int, num_nodes: int,
                         num_gpus: int) -> bool:
    """Check the EPLB signature's sizes where the original asserts; True for the hierarchical policy.

    The original plans hierarchically when `num_groups % num_nodes == 0` and then asserts that the
    groups split the experts and the nodes split the GPUs; both policies need `num_replicas` a
    multiple of `num_gpus` and at least one slot per expert. `num_groups` 0 (what engines pass for
    models without expert groups, where the original divides by zero) selects the global policy.
    Raises `ParameterError` naming the argument. These are EPLB's own preconditions, not a
    `PlacementProblem`: EPLB accepts more slots than one per expert and GPU (it co-locates
    replicas), which a placement problem rules out.
    """
    if num_gpus < 1:
        raise ParameterError("num_gpus", "an integer >= 1", num_gpus)
    hierarchical = plans_hierarchically(num_groups, num_nodes)
    if hierarchical:
        if num_experts % num_groups:
            raise ParameterError("num_groups", f"a divisor of the {num_experts} logical experts", num_groups)
        if num_gpus % num_nodes:
            raise ParameterError("num_nodes", f"a divisor of num_gpus={num_gpus}", num_nodes)
    if num_replicas % num_gpus:
        raise ParameterError("num_replicas", f"a multiple of num_gpus={num_gpus}", num_replicas)
    if num_replicas < num_experts:
        raise ParameterError("num_replicas", f"at least one slot per logical expert (>= {num_experts})",
                             num_replicas)
    return hierarchical


def _check_weight(weight: np.ndarray) -> np.ndarray:
    """float32 `[layers, E]` of `weight`; ParameterError unless a non-empty 2-D array of finite loads >= 0."""
    arr = np.asarray(weight)
    if arr.ndim != 2 or 0 in arr.shape:
        raise ParameterError("weight", "a non-empty 2-D array [layers, num_logical_experts]", f"shape {arr.shape}")
    if arr.dtype.kind not in "iuf" or not np.isfinite(arr).all() or (arr < 0).any():
        raise ParameterError("weight", "finite loads >= 0", f"dtype {arr.dtype}")
    return arr.astype(np.float32)


@register
class EplbSolver:
    """DeepSeek EPLB on one layer (hierarchical if the problem's groups divide by its nodes).

    The plan is returned as EPLB makes it, two replicas of one expert on one GPU included
    (then `detail["colocated"]` is True and the plan needs `allow_colocated=True`).
    """

    name: ClassVar[str] = "eplb"

    def prepare(self, problem: PlacementProblem, layers: list[int]) -> None:
        """Nothing to share: EPLB plans a layer in well under a millisecond."""

    def solve_layer(self, problem: PlacementProblem, layer: int, time_limit_s: float | None, *,
                    start: LayerSolution | None = None, deadline: float | None = None) -> LayerSolution:
        """EPLB's plan (time limit, start and deadline unused: it takes well under a millisecond)."""
        start = time.perf_counter()
        weight = problem.planning_loads()[layer:layer + 1]
        phy2log = eplb_rebalance(weight, problem.num_physical, problem.num_groups or 1, problem.num_nodes,
                                 problem.num_gpus)[0]
        colocated = has_colocation(phy2log, problem.num_gpus)
        objective = window_objective(problem, layer, phy2log)
        bound = window_lower_bound(problem, layer)
        bound = min(bound, objective)
        status = "optimal" if objective <= bound * (1 + 1e-9) else "heuristic"  # met the bound: proved
        return LayerSolution(phy2log, status, objective, bound, time.perf_counter() - start, {"colocated": colocated})
