"""A plan from the arguments an engine's EPLB call carries: `(loads, num_replicas, num_groups, num_nodes, num_gpus)`.

Engines hand their balancer DeepSeek EPLB's arguments; `plan_placement` turns them into a
`PlacementProblem` as EPLB reads them (`effective_topology`: hierarchical only when the groups are a
multiple of the nodes) and plans it with `moe_place.solvers.solve`. The solver and its time limit are
arguments; the drop-in `moe_place.eplb` and the engine adapters read them from `MOE_PLACE_SOLVER` /
`MOE_PLACE_TIME_LIMIT` with `solver_settings`.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from moe_place.errors import InputError
from moe_place.placement import Placement
from moe_place.problem import PlacementProblem
from moe_place.solvers import solve
from moe_place.solvers.deepseek import plans_hierarchically

__all__ = ["effective_topology", "plan_placement", "solver_settings"]

DEFAULT_SOLVER = "quick"  # deterministic and bounded: an engine waits for it (moe_place.eplb's module note)
SOLVER_ENV = "MOE_PLACE_SOLVER"
TIME_LIMIT_ENV = "MOE_PLACE_TIME_LIMIT"


def effective_topology(num_experts: int, num_groups: int | None, num_nodes: int, num_gpus: int) -> tuple[int | None, int]:
    """`(num_groups, num_nodes)` as EPLB would use them.

    EPLB plans hierarchically (expert groups packed onto nodes) only when `num_groups` is a
    multiple of `num_nodes`; otherwise it plans globally, as if there were one group and one
    node. Engines pass `num_groups` 0 or 1 for models without expert groups, and vLLM falls back
    to one node when `num_gpus % num_nodes != 0`; both are accepted here the same way.
    """
    if num_nodes < 1 or num_gpus % num_nodes:
        num_nodes = 1
    if not plans_hierarchically(num_groups, num_nodes) or num_experts % num_groups:
        return None, num_nodes
    return num_groups, num_nodes


def plan_placement(loads: np.ndarray, num_replicas: int, num_groups: int | None, num_nodes: int, num_gpus: int, *,
                   solver: str = DEFAULT_SOLVER, time_limit_s: float | None = None,
                   current: Placement | None = None, max_moved_slots: int | None = None,
                   move_cost_weight: float = 0.0, seed: int = 0, allow_colocated: bool = False) -> Placement:
    """Plan a placement for `loads` (float64 `[layers, E]` or `[windows, layers, E]`) with our solvers.

    solver / time_limit_s: as `moe_place.solvers.solve` takes them ("quick", "fast", "cpsat", ...).
    With `current`, the solver keeps unchanged experts in their slots (migration-aware mode).
    allow_colocated: EPLB's plan, co-located replicas and all, is a candidate on every layer
        (`PlacementProblem.allow_colocated`): the plan is then never worse than EPLB's.
    Errors name the engines' arguments (`num_replicas`, not the problem's `num_physical`).
    """
    loads = np.asarray(loads, dtype=np.float64)
    if loads.ndim == 2:
        loads = loads[None]
    if time_limit_s is not None and not time_limit_s > 0:
        raise InputError("time_limit_s", "a positive number of seconds", time_limit_s)
    groups, nodes = effective_topology(loads.shape[-1], num_groups, num_nodes, num_gpus)
    if current is not None and current.num_nodes != nodes:
        current = Placement(current.phy2log, current.num_experts, current.num_gpus, nodes,
                            allow_colocated=current.allow_colocated)
    try:  # PlacementProblem validates; its size names become the engines' here
        problem = PlacementProblem(loads=loads, num_gpus=num_gpus, num_physical=num_replicas, num_nodes=nodes,
                                   num_groups=groups, current=current, max_moved_slots=max_moved_slots,
                                   move_cost_weight=move_cost_weight, seed=seed, allow_colocated=allow_colocated)
    except InputError as exc:
        raise InputError({"num_physical": "num_replicas"}.get(exc.where, exc.where), exc.expected, exc.got) from None
    solution = solve(problem, solver=solver, time_limit_s=time_limit_s)
    for note in solution.notes:  # e.g. a time limit that returned the anytime plan
        logging.getLogger("moe_place").info("rebalance_experts: %s", note)
    return solution.placement


def solver_settings(solver: str | None = None, time_limit_s: float | None = None) -> tuple[str, float | None]:
    """The solver name and time limit of a fresh plan: the arguments first, then `MOE_PLACE_SOLVER` /
    `MOE_PLACE_TIME_LIMIT`, then the default ("quick", no limit)."""
    name = solver or os.environ.get(SOLVER_ENV) or DEFAULT_SOLVER
    if time_limit_s is None and os.environ.get(TIME_LIMIT_ENV):
        text = os.environ[TIME_LIMIT_ENV]
        try:
            time_limit_s = float(text)
        except ValueError:
            raise InputError(TIME_LIMIT_ENV, "a number of seconds", text) from None
    if time_limit_s is not None and not time_limit_s > 0:
        raise InputError("time_limit_s", "a positive number of seconds", time_limit_s)
    return name, time_limit_s
