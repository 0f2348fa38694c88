"""Placement solvers behind one protocol and registry, and `solve` to plan a whole model.

Registered solvers (`solver_names()`): `eplb` (DeepSeek EPLB, the baseline), `fast`
(construction + target packing + local search), `cpsat` (OR-Tools CP-SAT, when its module is
present). `solve(problem, solver="auto")` runs `fast` on every layer, then `cpsat` on the layers
whose gap to the lower bound is above `AUTO_GAP`, within the total time limit.
"""

from __future__ import annotations

import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np

from moe_place.errors import InputError
from moe_place.placement import Placement
from moe_place.problem import PlacementProblem
from moe_place.progress import ProgressBar
from moe_place.solvers import eplb as _eplb  # noqa: F401  (registers "eplb")
from moe_place.solvers import fast as _fast  # noqa: F401  (registers "fast")
from moe_place.solvers.base import STATUSES, LayerSolution, get_solver, register, solver_names

try:  # the CP-SAT model lives in its own module (registers "cpsat")
    from moe_place.solvers import cpsat as _cpsat  # noqa: F401
except ModuleNotFoundError as exc:  # pragma: no cover - only while the module is absent
    if exc.name != "moe_place.solvers.cpsat":
        raise

AUTO_GAP = 1e-4  # "auto" hands layers with a larger relative gap to cpsat
DEADLINE_SAFETY = 0.9  # share of a wall-clock budget planned against; the rest absorbs fallbacks
FAST_SHARE = 0.5  # "auto" with a time limit: the fraction of it that fast may use

__all__ = ["AUTO_GAP", "LayerSolution", "Solution", "get_solver", "register", "solve", "solver_names"]


@dataclass(frozen=True)
class Solution:
    """A whole-model plan.

    placement: the plan (co-located replicas allowed only when a solver such as `eplb` made them).
    layers: one LayerSolution per layer, in layer order.
    solver: the solver name asked for ("auto" included). wall_s: seconds for the whole solve.
    """

    placement: Placement
    layers: tuple[LayerSolution, ...]
    solver: str
    wall_s: float

    def __post_init__(self) -> None:
        assert len(self.layers) == self.placement.num_layers, (len(self.layers), self.placement.num_layers)

    @property
    def status(self) -> str:
        """The weakest layer status: optimal < feasible < heuristic."""
        return max((s.status for s in self.layers), key=STATUSES.index)


def solve(problem: PlacementProblem, solver: str = "auto", time_limit_s: float | None = None, jobs: int = 1,
          progress: bool = False) -> Solution:
    """Plan every layer of `problem`.

    solver: a registered name or "auto" (fast everywhere, then cpsat on the layers whose gap is
        above AUTO_GAP, largest gap first, while the time limit lasts; without a time limit
        "auto" is just fast).
    time_limit_s: the budget for the whole plan in wall-clock seconds (None: no limit, and the
        result is deterministic). Layers are given an even share; a layer started after the
        budget is spent gets `fast`'s construction only (the anytime fallback), so the plan
        always covers every layer. CP-SAT layers get limits that leave room for its wall-clock
        safety margin (EXACT_WALL_FACTOR, EXACT_OVERHEAD_S); a slow model build can still overrun.
    jobs: worker processes for the per-layer solves (same result as jobs=1 without a limit).
    progress: draw a progress bar on stderr.
    """
    if jobs < 1:
        raise InputError("jobs", "an integer >= 1", jobs)
    if time_limit_s is not None and not time_limit_s > 0:
        raise InputError("time_limit_s", "a positive number of seconds", time_limit_s)
    if solver != "auto":
        get_solver(solver)  # InputError listing the names when unknown
    start = time.monotonic()
    deadline = None if time_limit_s is None else start + time_limit_s
    layers = list(range(problem.num_layers))
    first = "fast" if solver == "auto" else solver
    use_cpsat = solver == "auto" and time_limit_s is not None and "cpsat" in solver_names()
    share = FAST_SHARE if use_cpsat else 1.0
    # keep a tenth of the budget for the layers past it (they still get fast's construction)
    first_deadline = None if deadline is None else start + time_limit_s * share * DEADLINE_SAFETY
    results = _run_layers(problem, first, layers, None, jobs, progress, first_deadline, fallback=True)
    if use_cpsat:
        open_layers = sorted((i for i in layers if results[i].gap > AUTO_GAP), key=lambda i: -results[i].gap)
        exact = _run_layers(problem, "cpsat", open_layers, None, jobs, progress, deadline, fallback=False)
        for i, solution in exact.items():
            results[i] = merge(results[i], solution)
    solutions = tuple(results[i] for i in layers)
    phy2log = np.stack([s.phy2log for s in solutions])
    colocated = any(s.detail.get("colocated", False) for s in solutions)
    placement = Placement(phy2log, problem.num_experts, problem.num_gpus, problem.num_nodes,
                          allow_colocated=colocated)
    return Solution(placement, solutions, solver, time.monotonic() - start)


def merge(first: LayerSolution, second: LayerSolution) -> LayerSolution:
    """The better plan of two solves of one layer, with the better of their (valid) bounds."""
    best = second if second.objective < first.objective else first
    bound = min(max(first.lower_bound, second.lower_bound), best.objective)
    status = "optimal" if best.objective <= bound * (1 + 1e-9) or best.status == "optimal" else best.status
    detail = {**first.detail, **second.detail, "solver": best.detail.get("solver"),
              "solvers": [first.detail.get("solver"), second.detail.get("solver")]}
    return LayerSolution(best.phy2log, status, best.objective, bound, first.wall_s + second.wall_s, detail)


# With a deadline, an exact solver (cpsat) gets a limit its wall-clock safety margin still fits in:
# CP-SAT stops at EXACT_WALL_FACTOR x its limit + 5 s, and building the model takes time too
# (at most EXACT_OVERHEAD_S, and at most half of what is left, is set aside for that).
EXACT_WALL_FACTOR = 4.0
EXACT_OVERHEAD_S = 10.0
MIN_EXACT_LIMIT_S = 0.1
QUICK_PREPARE_S = 0.05  # below this many seconds per layer, `prepare` skips the costlier bounds


def _solve_chunk(problem: PlacementProblem, name: str, layers: list[int], limit: float | None,
                 deadline: float | None, fallback: bool, later: int = 0,
                 solvers: dict | None = None, prepare_layers: list[int] | None = None) -> list[LayerSolution | None]:
    """Solve `layers` in order with solver `name` and per-layer limit `limit`.

    With a deadline (time.monotonic seconds, one clock for all processes), each layer gets an even
    share of the time left over the layers still to come in this worker (`later` more after this
    list); past the deadline a layer gets fast's construction (fallback=True) or is skipped (None).
    """
    out: list[LayerSolution | None] = []
    instances = solvers if solvers is not None else {}  # one instance per solver name: they may cache
    if name not in instances:
        instances[name] = get_solver(name)
        if hasattr(instances[name], "prepare"):  # optional hook: vectorised work for a run of layers
            run = layers if solvers is None else prepare_layers or layers
            tight = deadline is not None and (deadline - time.monotonic()) / len(run) < QUICK_PREPARE_S
            instances[name].prepare(problem, run, quick=tight)
    for position, layer in enumerate(layers):
        used, layer_limit = name, limit
        if deadline is not None:
            left = deadline - time.monotonic()
            share = left / (len(layers) - position + later)
            if name != "fast":  # leave room for the solver's wall-clock margin and model build
                overhead = min(EXACT_OVERHEAD_S, 0.5 * left)  # a short budget must still reach the solver
                share = min(share, (left - overhead) / EXACT_WALL_FACTOR)
            if share < (0.0 if name == "fast" else MIN_EXACT_LIMIT_S):
                if not fallback:
                    out.append(None)
                    continue
                used, layer_limit = "fast", 0.0
            else:
                layer_limit = share if limit is None else min(limit, share)
        if used not in instances:
            instances[used] = get_solver(used)
        solution = instances[used].solve_layer(problem, layer, layer_limit)
        out.append(LayerSolution(solution.phy2log, solution.status, solution.objective, solution.lower_bound,
                                 solution.wall_s, {"solver": used, **solution.detail}))
    return out


def _run_layers(problem: PlacementProblem, name: str, layers: list[int], limit: float | None, jobs: int,
                progress: bool, deadline: float | None = None, fallback: bool = True) -> dict[int, LayerSolution]:
    """Solve `layers` with solver `name` in `jobs` processes; {layer: solution} (skipped layers absent)."""
    if not layers:
        return {}
    bar = ProgressBar(len(layers), f"plan {name}", "layers") if progress else None
    results: dict[int, LayerSolution] = {}
    if jobs == 1 or len(layers) == 1:
        instances: dict = {}
        for position, layer in enumerate(layers):
            solution = _solve_chunk(problem, name, [layer], limit, deadline, fallback, len(layers) - position - 1,
                                    instances, layers)[0]
            if solution is not None:
                results[layer] = solution
            if bar:
                bar.advance(1)
    else:
        size = max(1, -(-len(layers) // (4 * jobs)))  # ~4 chunks per worker: progress without much pickling
        chunks = [layers[i:i + size] for i in range(0, len(layers), size)]
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = [pool.submit(_solve_chunk, problem, name, chunk, limit, deadline, fallback,
                                   -(-(len(layers) - i * size - len(chunk)) // jobs))
                       for i, chunk in enumerate(chunks)]
            for chunk, future in zip(chunks, futures):
                for layer, solution in zip(chunk, future.result()):
                    if solution is not None:
                        results[layer] = solution
                if bar:
                    bar.advance(len(chunk))
    if bar:
        bar.close()
    return results
