"""Placement solvers behind one protocol and registry, and `solve` to plan a whole model.

Registered solvers (`solver_names()`): `eplb` (DeepSeek EPLB, the baseline), `fast`
(construction + target packing + local search), `cpsat` (OR-Tools CP-SAT, when its module is
present). `solve(problem, solver="auto")` runs `fast` on every layer, then `cpsat` on the layers
whose gap to the lower bound is above `AUTO_GAP`, within the total time limit.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np

from moe_place.errors import InputError
from moe_place.placement import Placement
from moe_place.problem import PlacementProblem
from moe_place.solvers import eplb as _eplb  # noqa: F401  (registers "eplb")
from moe_place.solvers import fast as _fast  # noqa: F401  (registers "fast")
from moe_place.solvers.base import STATUSES, LayerSolution, get_solver, register, solver_names

try:  # the CP-SAT model lives in its own module (registers "cpsat")
    from moe_place.solvers import cpsat as _cpsat  # noqa: F401
except ModuleNotFoundError as exc:  # pragma: no cover - only while the module is absent
    if exc.name != "moe_place.solvers.cpsat":
        raise

AUTO_GAP = 1e-4  # "auto" hands layers with a larger relative gap to cpsat
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

    solver: a registered name or "auto" (fast everywhere, then cpsat where the gap is above
        AUTO_GAP, within the time limit; without a time limit "auto" is just fast).
    time_limit_s: the budget for the whole plan (None: each solver's own default, deterministic).
    jobs: worker processes for the per-layer solves (same result as jobs=1).
    progress: draw a progress bar on stderr.
    """
    if jobs < 1:
        raise InputError("jobs", "an integer >= 1", jobs)
    if time_limit_s is not None and not time_limit_s > 0:
        raise InputError("time_limit_s", "a positive number of seconds", time_limit_s)
    if solver != "auto":
        get_solver(solver)  # InputError listing the names when unknown
    start = time.perf_counter()
    layers = list(range(problem.num_layers))
    first = "fast" if solver == "auto" else solver
    share = FAST_SHARE if solver == "auto" and "cpsat" in solver_names() else 1.0
    limit = None if time_limit_s is None else time_limit_s * share * jobs / len(layers)
    results = _run_layers(problem, first, layers, limit, jobs, progress)
    if solver == "auto" and time_limit_s is not None and "cpsat" in solver_names():
        open_layers = [i for i in layers if results[i].gap > AUTO_GAP]
        remaining = time_limit_s - (time.perf_counter() - start)
        if open_layers and remaining > 0.05:
            limit = min(remaining, remaining * jobs / len(open_layers))
            exact = _run_layers(problem, "cpsat", open_layers, limit, jobs, progress)
            for i in open_layers:
                results[i] = merge(results[i], exact[i])
    solutions = tuple(results[i] for i in layers)
    phy2log = np.stack([s.phy2log for s in solutions])
    colocated = any(s.detail.get("colocated", False) for s in solutions)
    placement = Placement(phy2log, problem.num_experts, problem.num_gpus, problem.num_nodes,
                          allow_colocated=colocated)
    return Solution(placement, solutions, solver, time.perf_counter() - start)


def merge(first: LayerSolution, second: LayerSolution) -> LayerSolution:
    """The better plan of two solves of one layer, with the better of their (valid) bounds."""
    best = second if second.objective < first.objective else first
    bound = min(max(first.lower_bound, second.lower_bound), best.objective)
    status = "optimal" if best.objective <= bound * (1 + 1e-9) or best.status == "optimal" else best.status
    detail = {**first.detail, **second.detail, "solvers": [first.detail.get("solver"), second.detail.get("solver")]}
    return LayerSolution(best.phy2log, status, best.objective, bound, first.wall_s + second.wall_s, detail)


def _solve_chunk(problem: PlacementProblem, name: str, layers: list[int], limit: float | None) -> list[LayerSolution]:
    solver = get_solver(name)
    out = []
    for layer in layers:
        solution = solver.solve_layer(problem, layer, limit)
        out.append(LayerSolution(solution.phy2log, solution.status, solution.objective, solution.lower_bound,
                                 solution.wall_s, {"solver": name, **solution.detail}))
    return out


def _run_layers(problem: PlacementProblem, name: str, layers: list[int], limit: float | None, jobs: int,
                progress: bool) -> dict[int, LayerSolution]:
    """Solve `layers` with solver `name`, in `jobs` processes; {layer: solution}."""
    bar = _Progress(len(layers), name) if progress else None
    results: dict[int, LayerSolution] = {}
    if jobs == 1 or len(layers) == 1:
        for layer in layers:
            results[layer] = _solve_chunk(problem, name, [layer], limit)[0]
            if bar:
                bar.advance(1)
    else:
        size = max(1, -(-len(layers) // (4 * jobs)))  # ~4 chunks per worker: progress without much pickling
        chunks = [layers[i:i + size] for i in range(0, len(layers), size)]
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = [pool.submit(_solve_chunk, problem, name, chunk, limit) for chunk in chunks]
            for chunk, future in zip(chunks, futures):
                for layer, solution in zip(chunk, future.result()):
                    results[layer] = solution
                if bar:
                    bar.advance(len(chunk))
    if bar:
        bar.close()
    return results


class _Progress:
    """A one-line progress bar on stderr: `plan fast [#####.....] 12/48 layers`."""

    def __init__(self, total: int, label: str, width: int = 30):
        self.total, self.label, self.width, self.done = total, label, width, 0
        self._draw()

    def advance(self, count: int) -> None:
        self.done += count
        self._draw()

    def _draw(self) -> None:
        filled = self.width * self.done // max(self.total, 1)
        sys.stderr.write(f"\rplan {self.label} [{'#' * filled}{'.' * (self.width - filled)}] "
                         f"{self.done}/{self.total} layers")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()
