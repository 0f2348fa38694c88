"""Step 3 of the time planner: which nodes take replicas of which experts (`replica_nodes`, CP-SAT)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_place.cost.comm import CommModel
from moe_place.solvers.base import require_ortools, stoppable_solve
from moe_place.solvers.comm.grouping import NodeSearch
from moe_place.solvers.comm.tokens import LayerTokens

__all__ = ["ReplicaNodes", "compute_rows_seconds", "local_demand", "replica_nodes", "served_per_step"]

REPLICA_DET_S = 0.2                   # CP-SAT deterministic seconds for the replica nodes of one layer
REPLICA_CANDIDATES = 4                # candidate experts per spare slot offered to CP-SAT
HOME_FIRST = ("sglang-static", "node-aware")  # dispatchers that prefer a replica on the token's node


@dataclass(frozen=True)
class ReplicaNodes:
    """Where replicas go beyond each expert's own node (step 3).

    present: bool `[E, N]`, expert e has at least one slot on node n (its own node always).
    served: float64 `[E, N]`, training rows each node is expected to serve for each expert.
    status: the CP-SAT status name, or "node-closed" when no remote replica was considered.
    """

    present: np.ndarray
    served: np.ndarray
    status: str = "node-closed"


def local_demand(tokens: LayerTokens, num_experts: int, num_nodes: int, gpus_per_node: int) -> np.ndarray:
    """float64 `[steps, E, N]`: dispatches to each expert from the tokens homed on each node, per step."""
    k = tokens.ids.shape[1]
    home_node = np.repeat(tokens.home // gpus_per_node, k)
    flat = (np.repeat(tokens.step, k) * num_experts + tokens.ids.ravel()) * num_nodes + home_node
    size = tokens.num_steps * num_experts * num_nodes
    return np.bincount(flat, minlength=size).reshape(tokens.num_steps, num_experts, num_nodes).astype(np.float64)


def served_per_step(plan: "ReplicaNodes", node_of: np.ndarray, demand: np.ndarray) -> np.ndarray:
    """float64 `[steps, E, N]`: rows each node serves for each expert per step under `plan` (a remote
    replica serves its node's demand, the expert's own node the rest). demand: `local_demand`."""
    experts = node_of.size
    own = np.zeros_like(plan.present)
    own[np.arange(experts), node_of] = True
    served = np.where((plan.present & ~own)[None], demand, 0.0)
    served[:, np.arange(experts), node_of] = demand.sum(axis=2) - served.sum(axis=2)
    return served


def replica_nodes(search: NodeSearch, num_physical: int, seed: int = 0, det_time_s: float = REPLICA_DET_S,
                  exact: bool = True) -> ReplicaNodes:
    """Step 3 for the state of `search` (its node assignment and token counts).

    exact: CP-SAT (the final plan); False: the same choice made greedily, slot by slot (cross-
    validation, where thousands of these are made).
    """
    tokens, model = search.tokens, search.model
    experts, nodes, gpn = search.node_of.size, search.num_nodes, search.gpn
    demand = local_demand(tokens, experts, nodes, gpn).sum(axis=0)         # [E, N]
    own = np.zeros((experts, nodes), dtype=bool)
    own[np.arange(experts), search.node_of] = True
    spare = num_physical // nodes - own.sum(axis=0)
    if model.replica_choice not in HOME_FIRST or spare.max() <= 0 or nodes == 1:
        return ReplicaNodes(own, np.where(own, demand.sum(axis=1, keepdims=True), 0.0))
    # saving[e, n]: priced visits to e's node by tokens homed on n for which e is the only reason
    price = search.visit_prices() * search.seconds_per_row                  # seconds per visit
    only = search.count[np.repeat(np.arange(tokens.ids.shape[0]), tokens.ids.shape[1]),
                        search.node_of[tokens.ids].ravel()] == 1
    rows = np.repeat(np.arange(tokens.ids.shape[0]), tokens.ids.shape[1])[only]
    experts_hit = tokens.ids.ravel()[only]
    home_node = tokens.home[rows] // gpn
    saving = np.zeros((experts, nodes))
    np.add.at(saving, (experts_hit, home_node), price[rows, search.node_of[experts_hit]])
    saving[own] = 0.0
    if exact:
        present, status = _replica_cpsat(search, demand, saving, spare, seed, det_time_s)
    else:
        present, status = _replica_greedy(search, demand, saving, spare), "greedy"
    present |= own
    served = np.where(present & ~own, demand, 0.0)
    served[np.arange(experts), search.node_of] = demand.sum(axis=1) - served.sum(axis=1)
    return ReplicaNodes(present, served, status)


def compute_rows_seconds(model: CommModel, slots: int) -> tuple[float, float]:
    """(seconds per row on the busiest GPU, the per-step weight-read floor in seconds) of the model,
    for a GPU of `slots` slots."""
    one_row = model.compute_times_s(np.full((1, slots), 1e6 / slots), 1)[0, 0] / 1e6
    floor = model.compute_times_s(np.full((1, slots), 1e-9), 1)[0, 0]
    return float(one_row), float(floor)


def _node_loads(search: NodeSearch, demand: np.ndarray, present: np.ndarray) -> np.ndarray:
    """float64 `[N]`: training rows per node when remote replicas in `present` serve their node's demand."""
    own = np.zeros_like(present)
    own[np.arange(present.shape[0]), search.node_of] = True
    remote = present & ~own
    moved = np.where(remote, demand, 0.0)
    load = moved.sum(axis=0)
    np.add.at(load, search.node_of, demand.sum(axis=1) - moved.sum(axis=1))
    return load


def _replica_greedy(search: NodeSearch, demand: np.ndarray, saving: np.ndarray, spare: np.ndarray) -> np.ndarray:
    """bool `[E, N]` remote replicas: each spare slot to the largest saving still positive after the
    compute change it causes (a slot at a time, nodes in turn)."""
    per_row, floor = compute_rows_seconds(search.model, search.slots_per_gpu)
    steps = search.tokens.num_steps
    present = np.zeros_like(saving, dtype=bool)
    left = spare.copy()
    gpn = search.gpn

    def compute(load: np.ndarray) -> float:
        return max(steps * floor, load.max() / gpn * per_row)

    base = compute(_node_loads(search, demand, present))
    while left.max() > 0:
        gain = np.where(present | (left[None, :] <= 0), -np.inf, saving)
        e, n = np.unravel_index(int(np.argmax(gain)), gain.shape)
        if not gain[e, n] > 0:
            break
        present[e, n] = True
        value = compute(_node_loads(search, demand, present))
        if saving[e, n] <= value - base:
            present[e, n] = False
            saving = saving.copy()
            saving[e, n] = 0.0
            continue
        base, left[n] = value, left[n] - 1
    return present


def _replica_cpsat(search: NodeSearch, demand: np.ndarray, saving: np.ndarray, spare: np.ndarray, seed: int,
                   det_time_s: float) -> tuple[np.ndarray, str]:
    """bool `[E, N]` remote replicas chosen by CP-SAT (package docstring, step 3), and the status name."""
    experts, nodes = saving.shape
    per_row, floor = compute_rows_seconds(search.model, search.slots_per_gpu)
    steps, gpn = search.tokens.num_steps, search.gpn
    unit = 1e-12  # objective in picoseconds
    present = np.zeros((experts, nodes), dtype=bool)
    cand = []  # per node, the REPLICA_CANDIDATES * spare experts that save most
    for n in range(nodes):
        order = np.argsort(-saving[:, n], kind="stable")[:REPLICA_CANDIDATES * max(int(spare[n]), 0)]
        cand += [(int(e), n) for e in order if saving[e, n] > 0]
    if not cand:
        return present, "no candidate"
    base_load = _node_loads(search, demand, present)
    row_unit = max(1.0, demand.sum() / 1e6)          # rows per model unit: loads stay below ~1e6 units
    top = int(demand.sum() / row_unit) + 1
    require_ortools("plan --objective time (the replica-node model)")
    from ortools.sat.python import cp_model  # OR-Tools is optional: see solvers.base

    model = cp_model.CpModel()
    x = {c: model.NewBoolVar(f"replica_e{c[0]}_n{c[1]}") for c in cand}     # a replica of e on node n
    for n in range(nodes):  # at most the node's spare slots
        model.Add(sum(v for (e, m), v in x.items() if m == n) <= int(spare[n]))
    loads = []
    for n in range(nodes):
        # rows node n serves: its own experts' demand, less what their replicas elsewhere serve, plus its replicas'
        gives = [int(round(demand[e, m] / row_unit)) * v for (e, m), v in x.items() if search.node_of[e] == n]
        takes = [int(round(demand[e, m] / row_unit)) * v for (e, m), v in x.items() if m == n]
        load = model.NewIntVar(0, top, f"rows_node{n}")
        model.Add(load == int(round(base_load[n] / row_unit)) - sum(gives) + sum(takes))
        loads.append(load)
    busiest = model.NewIntVar(0, top, "busiest_node_rows")
    model.AddMaxEquality(busiest, loads)
    # busiest GPU's compute over the training steps: max(steps * floor, busiest node rows / GPUs per node * F/C)
    compute = model.NewIntVar(0, 1 << 60, "compute_ps")
    model.Add(compute >= int(round(steps * floor / unit)))
    model.Add(compute >= int(round(row_unit * per_row / gpn / unit)) * busiest)
    model.Minimize(compute - sum(int(round(saving[e, n] / unit)) * v for (e, n), v in x.items()))
    for v in x.values():
        model.AddHint(v, 0)  # the node-closed plan
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = int(seed)
    solver.parameters.max_deterministic_time = float(det_time_s)
    solver.parameters.max_time_in_seconds = 10.0 * det_time_s + 10.0  # a safety stop only
    status = stoppable_solve(solver, model)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        for (e, n), v in x.items():
            present[e, n] = bool(solver.Value(v))
    return present, solver.StatusName(status)
