"""The time planner itself: steps 1-4 for one layer (`plan_layer`), and every layer with the decision of step 5
(`plan_time`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from moe_place.cost.comm import CommModel, layer_cost
from moe_place.cost.replicas import SlotTable
from moe_place.errors import InputError
from moe_place.placement import Placement
from moe_place.problem import PlacementProblem
from moe_place.progress import ProgressBar
from moe_place.solvers import solve
from moe_place.solvers.comm.bounds import layer_lower_bound_s
from moe_place.solvers.comm.decision import (DECISIONS, HeldOut, JUDGES, MIN_SAVING, comm_gains, compute_savings,
                                             cv_windows, expected_savings, guard, layer_gains, traffic_savings)
from moe_place.solvers.comm.gpus import (FLOOR_HEADROOM, assemble, balance_caps, node_closed_feasible,
                                         spread_within_nodes)
from moe_place.solvers.comm.grouping import GROUP_STRENGTH, NodeSearch
from moe_place.solvers.comm.node_split import balanced_nodes, community_nodes
from moe_place.solvers.comm.replicas import compute_rows_seconds, local_demand, replica_nodes, served_per_step
from moe_place.solvers.comm.tokens import LayerTokens
from moe_place.solvers.quick import quick_plan

__all__ = ["TimeLayer", "TimePlan", "plan_layer", "plan_time"]


def _held_out(figure) -> property:
    """A property: `figure` (of `decision`) of a layer's held-out windows against the balance-only plan's."""
    return property(lambda self: figure(self.windows, self.balance_windows))


@dataclass(frozen=True)
class TimeLayer:
    """One layer of a time plan.

    phy2log: int64 `[P]`. choice: "grouped" (steps 1-4) or "balance" (the balance-only plan: the
    decision of step 5 said no, the time limit came first, or no grouping is possible). predicted_s:
    the predicted layer time on the training tokens; lower_bound_s: `layer_lower_bound_s`.
    held_out_s / balance_held_out_s: layer time summed over the held-out windows of step 5, of the
    grouped plans and of the balance-only plans (None without cross-validation).
    windows / balance_windows: per held-out window, the grouped plan's and the balance-only plan's
    figures there (`HeldOut`, step 5's evidence; empty without cross-validation); `comm_gains`
    and `layer_gains` are the shares of the balance-only plan's dispatch + combine and layer time they
    saved, `traffic_savings` / `compute_savings` the dispatch + combine / compute saved as a share of
    its layer time (step 5). expected_saving: step 5's estimate over the layers (`expected_savings`),
    None without windows. replica_status: step 3's status.
    """

    phy2log: np.ndarray
    choice: str
    predicted_s: float
    lower_bound_s: float
    held_out_s: float | None
    balance_held_out_s: float | None
    replica_status: str = "node-closed"
    windows: tuple["HeldOut", ...] = ()
    balance_windows: tuple["HeldOut", ...] = ()
    expected_saving: float | None = None

    comm_gains = _held_out(comm_gains)
    layer_gains = _held_out(layer_gains)
    traffic_savings = _held_out(traffic_savings)
    compute_savings = _held_out(compute_savings)


@dataclass(frozen=True)
class TimePlan:
    """A whole-model plan for the layer time.

    placement: the plan. layers: one TimeLayer per layer. strength: the swaps of step 2 (None when
    no layer could be grouped). cv: held-out time summed over windows and layers, of the grouped
    plans (`"grouped"`) and of the balance-only plans (`"balance"`); empty without cross-validation.
    balance: the balance-only plan (`fast`), kept for reports. notes: lines about the time limit
    or a fallback. wall_s: seconds. decision: step 5's rule ("expected" or "guard"; None where nothing was
    decided on windows: no window, a fixed strength, or no grouping possible). min_saving: the guard's bar,
    None unless the guard decided. pooled: {"traffic", "compute"}: `Pooled`, the estimates over the layers
    (`expected_savings`; empty without windows).
    """

    placement: Placement
    layers: tuple[TimeLayer, ...]
    strength: int | None
    cv: dict = field(default_factory=dict)
    balance: Placement | None = None
    notes: tuple[str, ...] = ()
    wall_s: float = 0.0
    min_saving: float | None = None
    decision: str | None = None
    pooled: dict = field(default_factory=dict)


def plan_layer(tokens: LayerTokens, problem: PlacementProblem, model: CommModel, strengths: tuple[int, ...],
               exact: bool, start: str = "communities",
               balance_row: np.ndarray | None = None) -> dict[int, tuple[np.ndarray, str]]:
    """{strength: (phy2log `[P]`, replica status)}: steps 1-4 of one layer on `tokens` from the
    `communities` of the co-activation graph (`community_nodes`) or the `balanced` split.
    balance_row: the balance-only plan `[P]` of these tokens; its busiest node and GPU per step
    (`balance_caps`) cap the nodes (step 2) and the GPUs (step 4); None: no caps."""
    gpus, nodes = problem.num_gpus, problem.num_nodes
    if start == "communities":
        start = community_nodes(tokens, nodes, seed=problem.seed)
    else:
        start = balanced_nodes(tokens.loads.sum(axis=0), nodes)
    node_cap = gpu_cap = None
    if balance_row is not None:
        node_cap, gpu_cap = balance_caps(tokens.loads, balance_row, gpus, nodes)
        per_row, floor = compute_rows_seconds(model, problem.slots_per_gpu)
        free = FLOOR_HEADROOM * floor / per_row                          # rows a GPU may always carry
        node_cap, gpu_cap = np.maximum(node_cap, free * gpus // nodes), np.maximum(gpu_cap, free)
    search = NodeSearch(tokens, start, gpus, nodes, problem.slots_per_gpu, model, cap=node_cap)
    search.within_cap()
    snapshots = search.search(max(strengths), strengths)
    order = sorted(strengths, reverse=True)  # the search ends at the largest: no reset for it
    plans, homes = [], []
    for strength in order:
        if not np.array_equal(search.node_of, snapshots[strength]):
            search.reset(snapshots[strength])
        plans.append(replica_nodes(search, problem.num_physical, problem.seed, exact=exact))
        homes.append(search.node_of.copy())
    rows = assemble(plans, gpus, nodes, problem.num_physical)
    demand = local_demand(tokens, problem.num_experts, nodes, gpus // nodes)
    affinity = tokens.affinity()
    rows = [spread_within_nodes(row, served_per_step(plan, home, demand), affinity, gpu_cap, gpus, nodes)
            for row, plan, home in zip(rows, plans, homes)]
    return {strength: (row, plan.status) for strength, row, plan in zip(order, rows, plans)}


def plan_time(problem: PlacementProblem, steps: list[np.ndarray], model: CommModel,
              time_limit_s: float | None = None, progress: bool = False, strength: int | None = None,
              start: str = "communities", decision: str = "expected", judge: str = "comm",
              min_saving: float = MIN_SAVING) -> TimePlan:
    """Plan every layer of `problem` for the predicted layer time (the package docstring).

    steps: the training trace, one int `[tokens, layers, k]` array per step (the problem's layers).
    model: the cost model (topology with the problem's GPUs and nodes).
    time_limit_s: wall-clock safety stop for the whole plan (None: none).
    strength: group every layer at this strength with no cross-validation and no decision (to measure
        what grouping does when nothing holds it back, e.g. in benchmarks); None: `GROUP_STRENGTH`
        with the decision of step 5.
    start: `communities` (`community_nodes`, the default) or `balanced` (`balanced_nodes`): step 1.
    decision: step 5's rule: `expected` (the default: group where the expected saving estimated over the
        layers is positive, `expected_savings`) or `guard` (per layer, `guard`).
    judge, min_saving: the guard's (`guard`): what it judges on the windows (`comm` or `layer`) and its
        bar, a share of the balance-only layer time in [0, 1).
    Each layer's rows depend on that layer's tokens only; under `expected`, whether a layer is grouped
    depends on the windows of all the planned layers (a plan of some layers pools fewer).
    """
    if start not in ("balanced", "communities"):
        raise InputError("start", "balanced or communities", start)
    if decision not in DECISIONS:
        raise InputError("decision", f"one of {', '.join(DECISIONS)}", decision)
    if judge not in JUDGES:
        raise InputError("judge", f"one of {', '.join(JUDGES)}", judge)
    if not 0.0 <= min_saving < 1.0:
        raise InputError("min_saving", "a share of the layer time in [0, 1)", min_saving)
    began = time.monotonic()
    deadline = None if time_limit_s is None else began + time_limit_s
    model.check_placement(problem.num_gpus, problem.num_nodes, "topology")
    if problem.current is not None:
        raise InputError("--objective time", "no --current plan (migration-aware re-plans balance load only)")
    experts, layers = problem.num_experts, problem.num_layers
    gpus, nodes, physical = problem.num_gpus, problem.num_nodes, problem.num_physical
    steps = [np.asarray(s) for s in steps]
    if not steps or any(s.ndim != 3 or s.shape[1] != layers for s in steps):
        raise InputError("trace", f"token-level steps [tokens, {layers} layers, k] for --objective time")
    notes: list[str] = []

    def loads_of(on: list[np.ndarray]) -> np.ndarray:
        return np.stack([sum(np.bincount(s[:, i, :].ravel(), minlength=experts) for s in on)
                         for i in range(layers)]).astype(np.float64)

    balance = solve(PlacementProblem(loads_of(steps), gpus, physical, nodes, problem.num_groups, seed=problem.seed),
                    "fast").placement
    balance_rows = balance.phy2log

    def cost(i: int, row: np.ndarray, on: list[np.ndarray]):   # seeded by the layer's id, not its position
        return layer_cost(model, [s[:, i, :] for s in on], SlotTable(row, gpus, nodes, experts), problem.layer_id(i))

    def bound(i: int) -> float:
        return layer_lower_bound_s([s[:, i, :] for s in steps], model, experts, gpus, nodes, physical)

    def tokens_of(i: int, on: list[np.ndarray]) -> LayerTokens:
        return LayerTokens.from_steps([s[:, i, :] for s in on], experts, gpus, model.token_home)

    def out_of_time(i: int) -> bool:
        if deadline is None or time.monotonic() <= deadline:
            return False
        notes.append(f"time limit {time_limit_s:g} s ran out at layer {problem.layer_id(i)}: the layers from "
                     f"there keep the balance-only plan, and a rerun may differ")
        return True

    if not node_closed_feasible(experts, gpus, nodes, physical):
        notes.append(f"no grouping: {nodes} node(s) of {experts // nodes} experts cannot fill "
                     f"{problem.slots_per_gpu} slots per GPU with distinct experts; returned the balance-only plan")
        reports = [TimeLayer(balance_rows[i], "balance", cost(i, balance_rows[i], steps).layer_time_s, bound(i),
                             None, None) for i in range(layers)]
        return TimePlan(balance, tuple(reports), None, {}, balance, tuple(notes), time.monotonic() - began)

    decided = strength is None
    strength = GROUP_STRENGTH if decided else strength
    windows = cv_windows(steps) if decided else []
    if decided and not windows:
        notes.append("no held-out window (a single step of one token): returned the balance-only plan")
    bar = ProgressBar(layers * (2 if windows else 1), "plan time", "layer passes") if progress else None

    # step 5's evidence, layer by layer: per window, the grouped and balance-only plans of the other windows
    folds = [[s for v, window in enumerate(windows) if v != w for s in window] for w in range(len(windows))]
    fold_balance = [quick_plan(loads_of(train), gpus, physical) for train in folds]
    evidence: list[tuple[tuple[HeldOut, ...], tuple[HeldOut, ...]] | None] = [None] * layers
    stopped = False
    for i in range(layers if windows else 0):
        stopped = stopped or out_of_time(i)
        if not stopped:
            held, held_balance = [], []
            for w, validation in enumerate(windows):
                row = plan_layer(tokens_of(i, folds[w]), problem, model, (strength,), False, start,
                                 fold_balance[w][i])[strength][0]
                held.append(HeldOut.of(cost(i, row, validation)))
                held_balance.append(HeldOut.of(cost(i, fold_balance[w][i], validation)))
            evidence[i] = (tuple(held), tuple(held_balance))
        if bar:
            bar.advance(1)

    # step 5's decision
    judged = [i for i in range(layers) if evidence[i] is not None]
    estimates, pooled = expected_savings([evidence[i] for i in judged])
    expected = dict(zip(judged, estimates.tolist()))
    if not decided:
        group = [True] * layers
    elif decision == "guard":
        group = [evidence[i] is not None and guard(*evidence[i], judge, min_saving) for i in range(layers)]
    else:
        group = [expected.get(i, 0.0) > 0 for i in range(layers)]

    rows, reports = [], []
    for i in range(layers):
        stopped = stopped or (group[i] and out_of_time(i))
        grouped = group[i] and not stopped
        if grouped:
            row, status = plan_layer(tokens_of(i, steps), problem, model, (strength,), True, start,
                                     balance_rows[i])[strength]
        else:
            row, status = balance_rows[i], "node-closed"
        held, held_balance = evidence[i] or ((), ())
        rows.append(row)
        reports.append(TimeLayer(np.asarray(row), "grouped" if grouped else "balance",
                                 cost(i, row, steps).layer_time_s, bound(i),
                                 sum(h.layer_time_s for h in held) if held else None,
                                 sum(h.layer_time_s for h in held_balance) if held else None, status,
                                 held, held_balance, expected.get(i)))
        if bar:
            bar.advance(1)
    if bar:
        bar.close()
    cv = {"grouped": sum(sum(h.layer_time_s for h in e[0]) for e in evidence if e),
          "balance": sum(sum(h.layer_time_s for h in e[1]) for e in evidence if e)} if windows else {}
    return TimePlan(Placement(np.stack(rows), experts, gpus, nodes), tuple(reports), strength, cv, balance,
                    tuple(notes), time.monotonic() - began,
                    min_saving if windows and decision == "guard" else None,
                    decision if windows else None, pooled)
