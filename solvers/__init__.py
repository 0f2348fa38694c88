"""Placement solvers behind one protocol and registry, and `solve` to plan a whole model.

Registered solvers (`solver_names()`): `eplb` (DeepSeek EPLB, the baseline), `fast`
(construction + target packing + local search), `cpsat` (OR-Tools CP-SAT, starting from `fast`),
`trtllm` (TensorRT-LLM's offline greedy, the baseline of its `generate_eplb_config.py`).
`solve(problem, solver)` also takes "auto": `fast`, then `cpsat` on the layers whose gap to the
lower bound is above `AUTO_GAP` when a time limit gives it room; and "quick": step 1 below alone,
with no time limit (deterministic; about 50 ms for 58 layers x 288 slots on one core), what an
engine can afford at every rebalance. With a current placement, "quick" plans afresh and matches
the plan's GPUs and slots to the current map (`moe_place.placement.align_slots`).

Hierarchical problems (expert groups, several nodes, groups a multiple of nodes: DeepSeek EPLB's
hierarchical policy) are planned node by node with every group inside one node, whichever solver
is asked for (`moe_place.solvers.hierarchical`).

OR-Tools is optional (`pip install 'moe-place[solver]'`): `cpsat` loads it when first asked for,
and without it a request for `cpsat` is an InputError saying what to install.

How a time limit is spent (`solve(..., time_limit_s=T)`), so that the result depends on the
inputs and `T`, not on the wall clock:
1. The anytime plan of every layer: `quick.quick_plan` (vectorised across layers, tens of ms),
   or EPLB's plan where that is better and has no co-located replicas; in migration mode the
   current placement. Every layer has a valid plan from here on.
2. `fast` on every layer, complete and deterministic, when `T >= FAST_MIN_S_PER_LAYER * layers`
   (otherwise the anytime plan is the answer, and `Solution.notes` says so).
3. For `cpsat` and `auto`: CP-SAT on the layers with a gap, largest gap first, each starting from
   `fast`'s plan (hint and incumbent: never worse). Which layers and how many deterministic
   seconds each get is fixed from `T` and the model sizes alone (`cpsat_schedule`), and CP-SAT
   runs on deterministic time with one worker.
With `problem.allow_colocated`, EPLB's plan (co-located replicas included) is a candidate on every
layer at the end, so no solver returns a layer worse than `eplb`'s. The baselines (`BASELINES`: `eplb`,
`trtllm`) skip all this: each returns its algorithm's plan of every layer as the original makes it.
The wall clock is only a safety cap: when `T` runs out (a slow machine, or a limit below what
steps 2-3 need), the layers not finished keep their plan so far and `Solution.notes` says which
and that such a run may not repeat exactly. Without a limit every solver runs to completion.
"""

from __future__ import annotations

import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np

from moe_place.errors import InputError
from moe_place.interrupts import children, raise_if_interrupted, stop_children, worker_ignores_interrupts
from moe_place.placement import Placement, align_slots, has_colocation
from moe_place.problem import PlacementProblem
from moe_place.progress import ProgressBar
from moe_place.solvers import deepseek
from moe_place.solvers import fast as _fast  # noqa: F401  (registers "fast")
from moe_place.solvers import trtllm as _trtllm  # noqa: F401  (registers "trtllm")
from moe_place.solvers.base import (STATUSES, LayerSolution, get_solver, register, register_factory, require_ortools,
                                    solver_names)
from moe_place.solvers.bounds import model_lower_bounds
from moe_place.solvers.evaluate import model_objectives
from moe_place.solvers.hierarchical import is_hierarchical, split_by_node
from moe_place.solvers.quick import quick_plan

SOLVE_NAMES = ("auto", "quick")  # what `solve` takes besides the registered solvers
BASELINES = ("eplb", "trtllm")   # the engines' own algorithms: `solve` returns their plan as they make it
AUTO_GAP = 1e-4              # "auto" hands layers with a larger relative gap to cpsat
FAST_MIN_S_PER_LAYER = 0.01  # a time limit below this many seconds per layer returns the anytime plan
CPSAT_SHARE = 0.6            # share of the time limit planned for CP-SAT (the rest: steps 1-2, I/O)
CPSAT_WALL_PER_DET = 4.0     # wall seconds per CP-SAT deterministic second, planned (measured 1-4 on 2 cores)
CPSAT_BUILD_S_PER_VAR = 3e-5  # wall seconds to build the model, per placement literal (measured 0.76 s at E*G=8192)
CPSAT_MIN_DET_S = 0.05       # fewer deterministic seconds than this: the layer is not worth a model
DEADLINE_RESERVE, DEADLINE_RESERVE_S = 0.05, 0.1  # time kept back from the limit for assembling the plan

__all__ = ["AUTO_GAP", "LayerSolution", "SOLVE_NAMES", "Solution", "anytime_layers", "cpsat_build_s",
           "cpsat_schedule", "get_solver", "merge", "register", "solve", "solver_names"]


def _cpsat():
    """The cpsat module. OR-Tools is optional (`pip install 'moe-place[solver]'`), so the module that
    imports it is loaded when cpsat is first asked for, not with the package."""
    require_ortools("solver cpsat")
    from moe_place.solvers import cpsat  # late on purpose: see the docstring

    return cpsat


register_factory("cpsat", lambda: _cpsat().CpSatSolver())


@dataclass(frozen=True)
class Solution:
    """A whole-model plan.

    placement: the plan (co-located replicas allowed only when a solver such as `eplb` made them).
    layers: one LayerSolution per layer, in layer order.
    solver: the solver name asked for ("auto" included). wall_s: seconds for the whole solve.
    notes: one line each about how a time limit was spent when it did not cover the solve
        (the CLI prints them on stderr); empty when the result does not depend on the wall clock.
    cpsat_summary: when CP-SAT ran, one line on what it changed (better plans, higher bounds, or
        nothing) and the seconds it took; the CLI prints it too.
    """

    placement: Placement
    layers: tuple[LayerSolution, ...]
    solver: str
    wall_s: float
    notes: tuple[str, ...] = ()
    cpsat_summary: str | None = None

    def __post_init__(self) -> None:
        assert len(self.layers) == self.placement.num_layers, (len(self.layers), self.placement.num_layers)

    @property
    def status(self) -> str:
        """The weakest layer status: optimal < feasible < heuristic."""
        return max((s.status for s in self.layers), key=STATUSES.index)


def solve(problem: PlacementProblem, solver: str = "auto", time_limit_s: float | None = None, jobs: int = 1,
          progress: bool = False) -> Solution:
    """Plan every layer of `problem` (module docstring).

    solver: a registered name or "auto" (fast, then cpsat on layers with a gap above AUTO_GAP when
        a time limit is given; without one, "auto" is fast).
    time_limit_s: the budget for the whole plan in wall-clock seconds, kept (None: no limit).
    jobs: worker processes for the per-layer solves (the same result as jobs=1).
    progress: draw a progress bar on stderr.
    """
    if jobs < 1:
        raise InputError("jobs", "an integer >= 1", jobs)
    if time_limit_s is not None and not time_limit_s > 0:
        raise InputError("time_limit_s", "a positive number of seconds", time_limit_s)
    if solver not in SOLVE_NAMES and solver not in solver_names():
        raise InputError("solver", f"one of {', '.join(SOLVE_NAMES + solver_names())}", solver)
    if solver == "cpsat":
        require_ortools("solver cpsat")
    if solver == "quick" and problem.max_moved_slots is not None:
        raise InputError("solver", "fast or cpsat for a cap on moved slots (quick plans afresh)", "quick")
    start = time.monotonic()
    if is_hierarchical(problem) and solver not in BASELINES:
        return _solve_by_node(problem, solver, time_limit_s, jobs, progress, start)
    layers = list(range(problem.num_layers))
    notes: list[str] = []
    cpsat_summary = None
    # EPLB's plan, computed once for the anytime plan (a candidate there) and the co-located candidate
    needs_eplb = solver not in BASELINES and (solver == "quick" or time_limit_s is not None or problem.allow_colocated)
    eplb_rows = _eplb_rows(problem) if needs_eplb else None
    if solver in BASELINES:
        results = _run_layers(problem, solver, layers, jobs, progress)
    elif solver == "quick":
        results = anytime_layers(problem, fresh=True, eplb_rows=eplb_rows)
    elif time_limit_s is None:
        results = _run_layers(problem, "fast", layers, jobs, progress)
        if solver == "cpsat":
            begun, before = time.monotonic(), dict(results)
            _improve(results, _run_layers(problem, "cpsat", layers, jobs, progress, starts=results))
            cpsat_summary = _cpsat_note(before, results, layers, time.monotonic() - begun)
    else:
        # the deadline keeps back what assembling the plan takes after it (a few ms to 0.1 s)
        deadline = start + time_limit_s - min(DEADLINE_RESERVE_S, DEADLINE_RESERVE * time_limit_s)
        results = anytime_layers(problem, deadline, eplb_rows=eplb_rows)
        _note_cut(notes, problem, "the anytime plan", layers, results, time_limit_s)
        if time_limit_s < FAST_MIN_S_PER_LAYER * problem.num_layers:
            notes.append(f"time limit {time_limit_s:g} s is below what fast needs ({FAST_MIN_S_PER_LAYER:g} s a "
                         f"layer, {FAST_MIN_S_PER_LAYER * problem.num_layers:g} s here): returned the anytime plan")
        else:
            order = sorted(layers, key=lambda i: (-results[i].gap, i))  # the layers that need it most first
            fast = _run_layers(problem, "fast", order, jobs, progress, deadline=deadline)
            _improve(results, fast)
            _note_cut(notes, problem, "fast", order, fast, time_limit_s)
            if solver in ("cpsat", "auto"):
                threshold = AUTO_GAP if solver == "auto" else 0.0
                gaps = {i: results[i].gap for i in layers if i in fast and results[i].gap > threshold}
                schedule = cpsat_schedule(problem, gaps, time_limit_s)
                chosen = [i for i, _ in schedule]
                build = cpsat_build_s(problem)
                begun, before = time.monotonic(), dict(results)
                exact = _run_layers(problem, "cpsat", chosen, jobs, progress, deadline=deadline, starts=results,
                                    limits=dict(schedule), min_wall_s=build)
                _improve(results, exact)
                _note_cut(notes, problem, "cpsat", chosen, exact, time_limit_s)
                if chosen:
                    cpsat_summary = _cpsat_note(before, results, chosen, time.monotonic() - begun)
    if problem.allow_colocated and solver not in BASELINES:
        _improve(results, _colocated_eplb(problem, eplb_rows))
    solutions = tuple(results[i] for i in layers)
    phy2log = np.stack([s.phy2log for s in solutions])
    colocated = any(s.detail.get("colocated", False) for s in solutions)
    placement = Placement(phy2log, problem.num_experts, problem.num_gpus, problem.num_nodes,
                          allow_colocated=colocated)
    return Solution(placement, solutions, solver, time.monotonic() - start, tuple(notes), cpsat_summary)


def _solve_by_node(problem: PlacementProblem, solver: str, time_limit_s: float | None, jobs: int, progress: bool,
                   start: float) -> Solution:
    """A hierarchical problem (`moe_place.solvers.hierarchical`): groups to nodes, each node planned by
    `solver` on its own (the time limit shared evenly), the node plans put together. Objective and
    status per layer are the whole problem's, the lower bound its valid bound 1-2 (any grouping)."""
    split = split_by_node(problem)
    share = None if time_limit_s is None else time_limit_s / len(split.problems)
    node_solutions = [solve(node, solver, share, jobs, progress) for node in split.problems]
    phy2log = split.assemble([s.placement.phy2log for s in node_solutions])
    values = model_objectives(problem, phy2log)
    bounds = np.minimum(model_lower_bounds(problem, quick=True), values)
    wall = time.monotonic() - start
    layers = []
    for layer in range(problem.num_layers):
        detail = {"solver": solver, "hierarchical": True}
        if problem.current is not None:
            detail["moved_slots"] = int((phy2log[layer] != problem.current.phy2log[layer]).sum())
        status = "optimal" if values[layer] <= bounds[layer] * (1 + 1e-9) else "heuristic"
        layers.append(LayerSolution(phy2log[layer], status, float(values[layer]), float(bounds[layer]),
                                    wall / problem.num_layers, detail))
    notes = tuple(dict.fromkeys(note for s in node_solutions for note in s.notes))
    placement = Placement(phy2log, problem.num_experts, problem.num_gpus, problem.num_nodes,
                          allow_colocated=any(s.placement.allow_colocated for s in node_solutions))
    return Solution(placement, tuple(layers), solver, wall, notes)


def _eplb_rows(problem: PlacementProblem) -> np.ndarray:
    """int64 `[layers, P]`: DeepSeek EPLB's plan of every layer of `problem` (co-located replicas and all)."""
    return deepseek.eplb_rebalance(problem.planning_loads(), problem.num_physical, problem.num_groups or 1,
                                   problem.num_nodes, problem.num_gpus)


def anytime_layers(problem: PlacementProblem, deadline: float | None = None, fresh: bool = False,
                   eplb_rows: np.ndarray | None = None) -> dict[int, LayerSolution]:
    """Step 1 of the module docstring for every layer: {layer: solution}, in milliseconds to tens.

    Migration mode: the current placement (it moves nothing), unless `fresh`. Otherwise the better
    of `quick_plan` and EPLB's plan (when EPLB co-locates no replicas); with `fresh` and a current
    placement, that plan with its GPUs and slots matched to the current map (`align_slots`: the
    same loads, fewer moved slots). Bounds 1-2 only (cheap).
    deadline: `time.monotonic()` seconds; quick_plan's swap rounds stop there (marked `cut`).
    eplb_rows: EPLB's plan if the caller has it (`_eplb_rows`), else it is computed here.
    """
    started = time.perf_counter()
    bounds = model_lower_bounds(problem, quick=True)
    candidates: list[tuple[str, np.ndarray]] = []
    cut = False
    if problem.current is not None and not fresh:
        candidates.append(("current", np.asarray(problem.current.phy2log, dtype=np.int64)))
    else:
        loads = problem.planning_loads()
        stop = None if deadline is None else started + (deadline - time.monotonic())
        candidates.append(("quick", quick_plan(loads, problem.num_gpus, problem.num_physical, deadline=stop)))
        cut = stop is not None and time.perf_counter() > stop
        eplb = _eplb_rows(problem) if eplb_rows is None else eplb_rows
        colocated = np.array([has_colocation(row, problem.num_gpus) for row in eplb])
        candidates.append(("eplb", np.where(colocated[:, None], candidates[0][1], eplb)))
    values = np.stack([model_objectives(problem, plans) for _, plans in candidates])   # [candidates, layers]
    choice = np.argmin(values, axis=0)                                                # first on ties: quick
    if problem.current is not None and fresh:
        rows = np.stack([candidates[int(c)][1][layer] for layer, c in enumerate(choice)])
        aligned = align_slots(rows, problem.current.phy2log, problem.num_gpus)
        candidates = [(name, aligned) for name, _ in candidates]   # the same loads per layer, fewer moves
    wall = (time.perf_counter() - started) / problem.num_layers
    out = {}
    for layer in range(problem.num_layers):
        name, plans = candidates[int(choice[layer])]
        value = float(values[choice[layer], layer])
        bound = min(float(bounds[layer]), value)
        status = "optimal" if value <= bound * (1 + 1e-9) else "heuristic"
        detail = {"solver": name}
        if problem.current is not None:
            detail["moved_slots"] = int((plans[layer] != problem.current.phy2log[layer]).sum())
        if cut:
            detail["cut"] = True
        out[layer] = LayerSolution(np.array(plans[layer], dtype=np.int64), status, value, bound, wall, detail)
    return out


def _colocated_eplb(problem: PlacementProblem, rows: np.ndarray | None = None) -> dict[int, LayerSolution]:
    """EPLB's plan of every layer (`rows`, or `_eplb_rows`), co-located replicas and all (`problem.allow_colocated`)."""
    rows = _eplb_rows(problem) if rows is None else rows
    values = model_objectives(problem, rows)
    bounds = model_lower_bounds(problem, quick=True)
    return {layer: LayerSolution(rows[layer], "heuristic", float(values[layer]), min(float(bounds[layer]),
                                                                                   float(values[layer])), 0.0,
                                 {"solver": "eplb", "colocated": has_colocation(rows[layer], problem.num_gpus)})
            for layer in range(problem.num_layers)}


def cpsat_schedule(problem: PlacementProblem, gaps: dict[int, float], time_limit_s: float) -> list[tuple[int, float]]:
    """[(layer, deterministic seconds)]: which layers CP-SAT gets within a time limit, largest gap first.

    Planned from `time_limit_s` and the model sizes only (never from measured times), so the same
    inputs give the same schedule: `CPSAT_SHARE` of the limit, each layer costing
    `CPSAT_BUILD_S_PER_VAR` per placement literal to build and `CPSAT_WALL_PER_DET` per
    deterministic second; as many layers as can each get at least `CPSAT_MIN_DET_S`, capped at
    cpsat's default per layer.
    """
    order = sorted(gaps, key=lambda i: (-gaps[i], i))
    if not order:
        return []
    budget = CPSAT_SHARE * time_limit_s
    build = cpsat_build_s(problem)
    for count in range(len(order), 0, -1):
        det = (budget - count * build) / (CPSAT_WALL_PER_DET * count)
        if det >= CPSAT_MIN_DET_S:
            det = min(det, _cpsat().DEFAULT_TIME_LIMIT_S)
            return [(layer, det) for layer in order[:count]]
    return []


def cpsat_build_s(problem: PlacementProblem) -> float:
    """Planned wall seconds to build one layer's CP-SAT model (`CPSAT_BUILD_S_PER_VAR` per literal)."""
    return CPSAT_BUILD_S_PER_VAR * _cpsat().placement_literals(problem.num_experts, problem.num_gpus)


def merge(first: LayerSolution, second: LayerSolution) -> LayerSolution:
    """The better plan of two solves of one layer, with the better of their (valid) bounds."""
    best = second if second.objective < first.objective else first
    bound = min(max(first.lower_bound, second.lower_bound), best.objective)
    status = "optimal" if best.objective <= bound * (1 + 1e-9) or best.status == "optimal" else best.status
    detail = {**first.detail, **second.detail, "solver": best.detail.get("solver"),
              "colocated": bool(best.detail.get("colocated", False)),
              "solvers": first.detail.get("solvers", [first.detail.get("solver")]) + [second.detail.get("solver")]}
    return LayerSolution(best.phy2log, status, best.objective, bound, first.wall_s + second.wall_s, detail)


def _improve(results: dict[int, LayerSolution], new: dict[int, LayerSolution]) -> None:
    """Keep, per layer, the better of the plan so far and the new one (in place)."""
    for layer, solution in new.items():
        results[layer] = merge(results[layer], solution) if layer in results else solution


def _note_cut(notes: list[str], problem: PlacementProblem, name: str, layers: list[int],
              results: dict[int, LayerSolution], time_limit_s: float) -> None:
    """A line for `Solution.notes` when the wall clock stopped `name` on some of `layers`."""
    skipped = [i for i in layers if i not in results]
    cut = [i for i in layers if i in results and results[i].detail.get("cut")]
    if skipped or cut:
        ids = [problem.layer_id(i) for i in skipped + cut]
        shown = ", ".join(str(i) for i in ids[:8]) + (", ..." if len(ids) > 8 else "")
        notes.append(f"time limit {time_limit_s:g} s ran out during {name}: {len(skipped)} layer(s) not reached, "
                     f"{len(cut)} cut short (layers {shown}); they keep their plan so far, and a rerun may "
                     f"differ (a longer --time-limit makes it reproducible)")


def _cpsat_note(before: dict[int, LayerSolution], after: dict[int, LayerSolution], layers: list[int],
                wall_s: float) -> str:
    """A line saying what CP-SAT changed on `layers`: a better plan, a higher (certified) lower bound,
    or nothing (so that its seconds are not spent in silence)."""
    better = sum(after[i].objective < before[i].objective * (1 - 1e-12) for i in layers)
    raised = sum(after[i].lower_bound > before[i].lower_bound * (1 + 1e-12) for i in layers)
    mean_gap = lambda results: sum(results[i].gap for i in layers) / len(layers)  # noqa: E731
    what = (f"a better plan on {better} and a higher lower bound on {raised} of them (their mean gap "
            f"{mean_gap(before):.2%} -> {mean_gap(after):.2%})" if better or raised else
            f"no better plan and no higher lower bound on any of them (mean gap {mean_gap(before):.2%}): the "
            "plan is the one it had before CP-SAT")
    return f"CP-SAT, {wall_s:.1f} s for the {len(layers)} layer(s) with a gap: {what}"


def _solve_chunk(problem: PlacementProblem, name: str, layers: list[int], deadline: float | None,
                 starts: dict[int, LayerSolution] | None, limits: dict[int, float] | None,
                 prepare_layers: list[int] | None = None, solvers: dict | None = None,
                 min_wall_s: float = 0.0) -> list[LayerSolution | None]:
    """Solve `layers` in order with solver `name`; None for a layer reached when less than
    `min_wall_s` is left before `deadline` (time.monotonic seconds, one clock for all processes)."""
    instances = solvers if solvers is not None else {}  # one instance per solver name: they may cache
    if name not in instances:
        instances[name] = get_solver(name)
        instances[name].prepare(problem, prepare_layers or layers)
    out: list[LayerSolution | None] = []
    for layer in layers:
        raise_if_interrupted()  # between layers, also when the interrupt was swallowed inside one
        if deadline is not None and time.monotonic() >= deadline - min_wall_s:
            out.append(None)
            continue
        start = None if starts is None else starts.get(layer)
        limit = None if limits is None else limits.get(layer)
        solution = instances[name].solve_layer(problem, layer, limit, start=start, deadline=deadline)
        out.append(LayerSolution(solution.phy2log, solution.status, solution.objective, solution.lower_bound,
                                 solution.wall_s, {"solver": name, **solution.detail}))
    return out


def _run_in_processes(problem: PlacementProblem, name: str, layers: list[int], jobs: int, bar: ProgressBar | None,
                      results: dict[int, LayerSolution], deadline: float | None,
                      starts: dict[int, LayerSolution] | None, limits: dict[int, float] | None,
                      min_wall_s: float) -> None:
    """`_run_layers` on `jobs` worker processes, about 4 chunks of layers each; fills `results`.

    The workers ignore SIGINT; when this process is interrupted (or a worker fails) they are
    terminated at once instead of finishing their chunk (`moe_place.interrupts`)."""
    size = max(1, -(-len(layers) // (4 * jobs)))  # ~4 chunks per worker: progress without much pickling
    chunks = [layers[i:i + size] for i in range(0, len(layers), size)]
    before = children()
    pool = ProcessPoolExecutor(max_workers=jobs, initializer=worker_ignores_interrupts)
    try:
        futures = [pool.submit(_solve_chunk, problem, name, chunk, deadline,
                               None if starts is None else {i: starts[i] for i in chunk if i in starts},
                               limits, None, None, min_wall_s) for chunk in chunks]
        for chunk, future in zip(chunks, futures):
            for layer, solution in zip(chunk, future.result()):
                if solution is not None:
                    results[layer] = solution
            if bar:
                bar.advance(len(chunk))
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        stop_children(before)
        raise
    pool.shutdown()


def _run_layers(problem: PlacementProblem, name: str, layers: list[int], jobs: int, progress: bool,
                deadline: float | None = None, starts: dict[int, LayerSolution] | None = None,
                limits: dict[int, float] | None = None, min_wall_s: float = 0.0) -> dict[int, LayerSolution]:
    """Solve `layers` with solver `name` in `jobs` processes; {layer: solution} (layers past the deadline absent)."""
    if not layers:
        return {}
    bar = ProgressBar(len(layers), f"plan {name}", "layers") if progress else None
    results: dict[int, LayerSolution] = {}
    try:
        if jobs == 1 or len(layers) == 1:
            instances: dict = {}
            for layer in layers:
                solution = _solve_chunk(problem, name, [layer], deadline, starts, limits, layers, instances,
                                        min_wall_s)[0]
                if solution is not None:
                    results[layer] = solution
                if bar:
                    bar.advance(1)
        else:
            _run_in_processes(problem, name, layers, jobs, bar, results, deadline, starts, limits, min_wall_s)
    finally:  # also when interrupted: the message that follows starts on its own line
        if bar:
            bar.close()
    return results
