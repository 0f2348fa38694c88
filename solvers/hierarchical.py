"""Hierarchical placement: every expert group, replicas included, inside one node.

DeepSeek-V3 routes group-limited: a token's experts come from at most a few expert groups, so
that it visits at most that many nodes, and that bound holds only if each group and all its
replicas live on one node. DeepSeek EPLB's hierarchical policy (used when the number of groups
is a multiple of the number of nodes) keeps it so; a plan that spreads a group over nodes breaks
the routing's assumption. `moe_place.solvers.solve` plans such a problem as the policy does,
with our solvers inside each node:

1. Groups to nodes, per layer: every node gets `groups / nodes` groups. In migration mode a
   layer keeps the node of every group as the current map has it, when the current map already
   keeps each group inside one node and re-packing would not lower the busiest node's load by
   more than `REPACK_GAIN`; otherwise the groups are packed by EPLB's rule (heaviest group first,
   to the lightest node with room), so the busiest node's share is balanced first.
2. Each node is a placement problem of its own: the node's `E/N` experts, its `G/N` GPUs and
   `P/N` slots (the current map's rows on them, in migration mode), planned by the solver asked for.
3. The node plans are written back into each node's slot range.

A node problem sees only its experts, so the plan is the best the solver finds under the
grouping, and the reported lower bound stays the whole problem's (valid for any grouping).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_place.placement import Placement
from moe_place.problem import PlacementProblem
from moe_place.solvers.deepseek import balanced_packing, plans_hierarchically

__all__ = ["NodeSplit", "current_group_nodes", "group_nodes", "is_hierarchical", "split_by_node"]

REPACK_GAIN = 0.01  # a layer re-packs its groups only when that lowers its busiest node's load by more than this share


def is_hierarchical(problem: PlacementProblem) -> bool:
    """True when `problem` asks for EPLB's hierarchical policy (`plans_hierarchically`) over several nodes (on one
    node there is nothing to split)."""
    return problem.num_nodes > 1 and plans_hierarchically(problem.num_groups, problem.num_nodes)


@dataclass(frozen=True)
class NodeSplit:
    """A hierarchical problem cut into node problems.

    experts: int64 `[nodes, layers, E/N]`: the logical experts node `n` holds in each layer
        (ascending); node problem `n`'s local expert `i` of layer `l` is `experts[n, l, i]`.
    problems: one `PlacementProblem` per node, the layers in order.
    """

    experts: np.ndarray
    problems: tuple[PlacementProblem, ...]

    def assemble(self, node_rows: list[np.ndarray]) -> np.ndarray:
        """int64 `[layers, P]`: node plans `[layers, P/N]` (local expert ids) as one whole-model map."""
        rows = [np.take_along_axis(self.experts[n], np.asarray(r, dtype=np.int64), axis=1)
                for n, r in enumerate(node_rows)]
        return np.concatenate(rows, axis=1)


def group_nodes(problem: PlacementProblem) -> np.ndarray:
    """int64 `[layers, groups]`: the node of every expert group (step 1 of the module note)."""
    layers, experts = problem.num_layers, problem.num_experts
    groups, nodes = int(problem.num_groups), problem.num_nodes
    group_load = problem.planning_loads().reshape(layers, groups, experts // groups).sum(axis=-1)
    packed, _ = balanced_packing(group_load.astype(np.float32), nodes)
    if problem.current is None:
        return packed
    kept = current_group_nodes(problem.current, groups, nodes)
    node_load = lambda assign: np.stack([(group_load * (assign == n)).sum(axis=1) for n in range(nodes)], axis=1)  # noqa: E731
    valid = (kept >= 0).all(axis=1)
    keep = valid & (node_load(packed).max(axis=1) >= (1 - REPACK_GAIN) * node_load(np.where(kept >= 0, kept, 0)).max(axis=1))
    return np.where(keep[:, None], kept, packed)


def current_group_nodes(current: Placement, num_groups: int, num_nodes: int) -> np.ndarray:
    """int64 `[layers, groups]`: the node holding each group in `current`, -1 on a layer where some
    group spans nodes or a node holds a number of groups other than `groups / nodes`."""
    layers, experts = current.num_layers, current.num_experts
    slot_node = np.arange(current.num_physical) // (current.num_physical // num_nodes)
    counts = np.zeros((layers, experts, num_nodes), dtype=np.int64)
    np.add.at(counts, (np.arange(layers)[:, None], current.phy2log, np.broadcast_to(slot_node, current.phy2log.shape)), 1)
    per_group = counts.reshape(layers, num_groups, experts // num_groups, num_nodes).sum(axis=2) > 0
    single = per_group.sum(axis=-1) == 1
    node = np.argmax(per_group, axis=-1)
    ok = single.all(axis=1)
    for n in range(num_nodes):
        ok &= (node == n).sum(axis=1) == num_groups // num_nodes
    return np.where(ok[:, None], node, -1)


def split_by_node(problem: PlacementProblem) -> NodeSplit:
    """The node problems of a hierarchical `problem` (steps 1-2 of the module note)."""
    layers, experts = problem.num_layers, problem.num_experts
    groups, nodes = int(problem.num_groups), problem.num_nodes
    group_size = experts // groups
    node_of_group = group_nodes(problem)                                   # [layers, groups]
    node_of_expert = np.repeat(node_of_group, group_size, axis=1)          # [layers, E]
    order = np.argsort(node_of_expert * experts + np.arange(experts), axis=1, kind="stable")
    node_experts = order.reshape(layers, nodes, experts // nodes).transpose(1, 0, 2)  # [nodes, layers, E/N]
    slots = problem.num_physical // nodes
    current = problem.current
    kept = None if current is None else (current_group_nodes(current, groups, nodes) == node_of_group).all(axis=1)
    out = []
    for n in range(nodes):
        local = np.take_along_axis(problem.loads, np.broadcast_to(node_experts[n], (problem.num_windows,) +
                                                                   node_experts[n].shape), axis=2)
        node_current = None
        if current is not None and kept.all():
            node_current = _local_rows(current.phy2log[:, n * slots:(n + 1) * slots], node_experts[n])
        out.append(PlacementProblem(
            loads=local, num_gpus=problem.num_gpus // nodes, num_physical=slots, num_nodes=1,
            split=problem.split, window_objective=problem.window_objective, quantile=problem.quantile,
            expert_bytes=problem.expert_bytes,
            current=None if node_current is None else Placement(node_current, experts // nodes,
                                                                problem.num_gpus // nodes),
            max_moved_slots=problem.max_moved_slots if node_current is not None else None,
            move_cost_weight=problem.move_cost_weight, layer_ids=problem.layer_ids, seed=problem.seed,
            allow_colocated=problem.allow_colocated))
    return NodeSplit(node_experts, tuple(out))


def _local_rows(rows: np.ndarray, node_experts: np.ndarray) -> np.ndarray:
    """int64 `[layers, P/N]`: `rows` (global expert ids of one node's slots) as the node's local ids."""
    local = np.empty_like(rows)
    for layer in range(rows.shape[0]):
        index = {int(e): i for i, e in enumerate(node_experts[layer])}
        local[layer] = [index[int(e)] for e in rows[layer]]
    return local
