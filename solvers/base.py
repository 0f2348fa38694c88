"""The solver protocol and registry: problem in, one layer's plan + report out.

Every solver plans one layer at a time (layers are independent in the engine-compatible
mode), so `moe_place.solvers.solve` can run layers in parallel processes. A solver is a class
with a `name`, registered with `@register`; the CLI and the engine plugin pick it by name.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Protocol

import numpy as np

from moe_place.errors import InputError
from moe_place.interrupts import run_stoppable
from moe_place.problem import PlacementProblem

__all__ = ["LayerSolution", "Solver", "get_solver", "register", "register_factory", "require_ortools", "solver_names",
           "stoppable_solve"]

STATUSES = ("optimal", "feasible", "heuristic")


@dataclass(frozen=True)
class LayerSolution:
    """One layer's plan.

    phy2log: int64 `[P]`, the logical expert in each slot (slot p on GPU p // (P/G)).
    status: "optimal" (proved), "feasible" (a solver stopped at its limit), "heuristic" (no proof).
    objective: the busiest-GPU load of this plan (windows combined as the problem says).
    lower_bound: a valid lower bound on the best achievable objective of this layer.
    wall_s: seconds spent on this layer (the only non-deterministic field).
    detail: solver-specific figures (e.g. CP-SAT's deterministic time, branches).
    """

    phy2log: np.ndarray
    status: str
    objective: float
    lower_bound: float
    wall_s: float
    detail: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert self.status in STATUSES, self.status
        assert self.lower_bound <= self.objective * (1 + 1e-9) + 1e-9, (self.lower_bound, self.objective)

    @property
    def gap(self) -> float:
        """Relative gap (objective - bound) / objective; 0 when the plan is proved optimal."""
        if self.objective <= 0:
            return 0.0
        return max(0.0, (self.objective - self.lower_bound) / self.objective)


class Solver(Protocol):
    """What a registered solver provides."""

    name: ClassVar[str]

    def prepare(self, problem: PlacementProblem, layers: list[int]) -> None:
        """Work shared by a run of `layers` of `problem` (vectorised bounds, say), before solve_layer."""
        ...

    def solve_layer(self, problem: PlacementProblem, layer: int, time_limit_s: float | None, *,
                    start: LayerSolution | None = None, deadline: float | None = None) -> LayerSolution:
        """Plan one layer of `problem`.

        time_limit_s: the solver's own budget for this layer, in its unit (cpsat: deterministic
            seconds); None: its default. What it decides with depends on this, never on the clock.
        start: a plan of this layer to start from (cpsat: hint and incumbent); solvers may ignore it.
        deadline: a wall-clock safety stop (`time.monotonic()` seconds): past it the solver returns
            its best plan so far with `detail["cut"] = True` (such a result may not repeat).
        """
        ...


_REGISTRY: dict[str, Callable[[], Solver]] = {}


def register(cls):
    """Class decorator: make a solver available by its `name`."""
    assert cls.name not in _REGISTRY, f"solver {cls.name!r} registered twice"
    _REGISTRY[cls.name] = cls
    return cls


def register_factory(name: str, factory: Callable[[], Solver]) -> None:
    """Make a solver available by `name` through `factory` (called at each `get_solver`): for solvers
    whose module needs an optional package, imported only when the solver is asked for."""
    assert name not in _REGISTRY, f"solver {name!r} registered twice"
    _REGISTRY[name] = factory


def require_ortools(what: str) -> None:
    """InputError unless OR-Tools is importable: it is optional (`pip install 'moe-place[solver]'`),
    so that the engine plugin installs beside engines that pin a protobuf OR-Tools cannot use."""
    if importlib.util.find_spec("ortools") is None:
        raise InputError("OR-Tools", f"installed for {what} (pip install 'moe-place[solver]')", "not installed")


def solver_names() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def get_solver(name: str) -> Solver:
    """An instance of the registered solver `name`; InputError listing the known names otherwise."""
    if name not in _REGISTRY:
        raise InputError("solver", f"one of {', '.join(solver_names())}", name)
    return _REGISTRY[name]()


def stoppable_solve(solver, model):
    """CP-SAT's `solver.solve(model)` (a `CpSolver` and a `CpModel`; OR-Tools itself is imported by the
    caller, as it is optional) that an interrupt (Ctrl-C, SIGTERM) stops through CP-SAT's own
    `stop_search`, raising `Interrupted` at once instead of after the search (`moe_place.interrupts`).
    CP-SAT's own SIGINT handler is turned off: it swallowed the interrupt and, after several solves,
    aborted the process (`std::bad_function_call`)."""
    solver.parameters.catch_sigint_signal = False
    return run_stoppable(lambda: solver.solve(model), solver.stop_search)
