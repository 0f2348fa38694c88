"""Step 4 of the time planner: the GPUs inside each node, and the balance-only plan's caps."""

from __future__ import annotations

import numpy as np

from moe_place.solvers.comm.replicas import ReplicaNodes
from moe_place.solvers.quick import quick_plan

__all__ = ["assemble", "balance_caps", "node_closed_feasible", "spread_within_nodes"]

FLOOR_HEADROOM = 0.25                 # caps are at least a quarter of the rows at which FLOPs outlast weight reads
SPREAD_SWAPS = 4                      # step 4's swaps inside a node: at most this many per slot of the node


def assemble(plans: list[ReplicaNodes], num_gpus: int, num_nodes: int, num_physical: int) -> list[np.ndarray]:
    """int64 `[P]` per plan: node n's slots `n*P/N ..` hold the experts present there, packed on its
    GPUs by `quick_plan` (replica counts and GPUs for the rows each serves there). Nodes with the same
    number of experts, over all plans, are planned in one vectorised call."""
    per_node, gpn = num_physical // num_nodes, num_gpus // num_nodes
    rows = [np.empty(num_physical, dtype=np.int64) for _ in plans]
    jobs: dict[int, list[tuple[int, int, np.ndarray]]] = {}
    for p, plan in enumerate(plans):
        for n in range(num_nodes):
            experts = np.flatnonzero(plan.present[:, n])
            jobs.setdefault(experts.size, []).append((p, n, experts))
    for size, items in sorted(jobs.items()):
        loads = np.stack([plans[p].served[experts, n] for p, n, experts in items]) + 1e-9  # idle experts take a slot
        local = quick_plan(loads, gpn, per_node)
        for (p, n, experts), slots in zip(items, local):
            rows[p][n * per_node:(n + 1) * per_node] = experts[slots]
    return rows


def spread_within_nodes(row: np.ndarray, served: np.ndarray, affinity: np.ndarray, gpu_cap: np.ndarray | None,
                        num_gpus: int, num_nodes: int) -> np.ndarray:
    """int64 `[P]`: `row` with slots swapped between the GPUs of each node (step 4, the compute hedge):
    first while that lowers the rows over `gpu_cap` (`[steps]`, summed over steps and GPUs), then
    while it lowers the `affinity` (`[E, E]`) of the experts sharing a GPU without raising that
    excess. Experts that fire together are hot together in other batches, so they go to different
    GPUs of their node. served: `served_per_step` `[steps, E, N]`, replicas of one expert on a node
    split its rows evenly. Each round, every node takes its best swap (all nodes at once, arrays
    `[N, ...]`); never two replicas of one expert on one GPU."""
    held = np.asarray(row, dtype=np.int64).reshape(num_nodes, -1).copy()   # [N, Q] expert of each slot
    per_node, gpn = held.shape[1], num_gpus // num_nodes
    experts = affinity.shape[0]
    gpu = np.arange(per_node) // (per_node // gpn)                       # GPU of each slot, inside its node
    on_gpu = (gpu[:, None] == np.arange(gpn)[None, :]).astype(np.float64)   # [Q, gpn]
    first, second = np.triu_indices(per_node, 1)
    apart = gpu[first] != gpu[second]
    first, second = first[apart], second[apart]                          # slot pairs on different GPUs
    g1, g2 = gpu[first], gpu[second]
    steps = served.shape[0]
    cap = (np.full(steps, np.inf) if gpu_cap is None else np.asarray(gpu_cap, dtype=np.float64))[None, :, None]
    node = np.arange(num_nodes)[:, None]
    count = np.zeros((num_nodes, experts))
    np.add.at(count, (node, held), 1.0)
    rows = served[:, held, node].transpose(1, 0, 2) / count[node, held][:, None, :]   # [N, steps, Q]
    for _ in range(SPREAD_SWAPS * per_node):
        load = rows @ on_gpu                                             # [N, steps, gpn]
        over = np.maximum(load - cap, 0.0)
        excess = over.sum(axis=(1, 2))                                   # [N]
        pair = affinity[held[:, :, None], held[:, None, :]]              # [N, Q, Q]
        near = pair @ on_gpu                                             # affinity of each slot to each GPU
        # affinity change if slots first and second swap GPUs (each leaves its GPU, joins the other's)
        change = (near[:, first, g2] - near[:, first, g1] + near[:, second, g1] - near[:, second, g2]
                  - 2 * pair[:, first, second] + pair[:, first, first] + pair[:, second, second])
        holds = np.zeros((num_nodes, gpn, experts), dtype=bool)
        holds[node, gpu[None, :], held] = True
        allowed = (held[:, first] != held[:, second]) & ~holds[node, g1[None, :], held[:, second]] \
            & ~holds[node, g2[None, :], held[:, first]]
        moved = rows[:, :, second] - rows[:, :, first]                   # [N, steps, pairs]: rows GPU g1 gains
        after = (excess[:, None] - over[:, :, g1].sum(axis=1) - over[:, :, g2].sum(axis=1)
                 + np.maximum(load[:, :, g1] + moved - cap, 0.0).sum(axis=1)
                 + np.maximum(load[:, :, g2] - moved - cap, 0.0).sum(axis=1))      # [N, pairs]
        repair = excess[:, None] > 0
        score = np.where(repair, after + 1e-9 * excess[:, None] * change,     # ties: the lower affinity
                         np.where(after <= 0, change, np.inf))
        better = allowed & np.where(repair, after < excess[:, None] * (1 - 1e-9), (after <= 0) & (change < -1e-9))
        moving = np.flatnonzero(better.any(axis=1))
        if not moving.size:
            break
        pick = np.argmin(np.where(better, score, np.inf)[moving], axis=1)
        a, b = first[pick], second[pick]
        held[moving, a], held[moving, b] = held[moving, b], held[moving, a].copy()
        rows[moving, :, a], rows[moving, :, b] = rows[moving, :, b], rows[moving, :, a].copy()
    return held.reshape(-1)


def balance_caps(loads: np.ndarray, phy2log: np.ndarray, num_gpus: int,
                 num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """(float64 `[steps]` busiest node rows, float64 `[steps]` busiest GPU rows) of the plan `phy2log [P]`
    (the balance-only plan) under each step's loads (`[steps, E]`), replicas splitting evenly: what
    the time plan's nodes and GPUs may carry on that step (the compute hedge of steps 2 and 4)."""
    row = np.asarray(phy2log, dtype=np.int64)
    count = np.bincount(row, minlength=loads.shape[1])
    share = loads[:, row] / count[row]                                   # [steps, P]
    steps = loads.shape[0]
    return (share.reshape(steps, num_nodes, -1).sum(axis=2).max(axis=1),
            share.reshape(steps, num_gpus, -1).sum(axis=2).max(axis=1))


def node_closed_feasible(num_experts: int, num_gpus: int, num_nodes: int, num_physical: int) -> bool:
    """Every node can hold its `E // N` experts and fill its GPUs' slots without two replicas of one
    expert on one GPU (`S <= E // N`)."""
    return num_experts // num_nodes >= num_physical // num_gpus and num_nodes > 1
