"""`cpsat`: one layer's joint replicate-and-place problem as an OR-Tools CP-SAT model.

Problem (docs/MODEL.md, even split): loads `w[t, e]` of `E` experts in `W` windows, `G` GPUs
with `S` slots each (`P = G*S`). Choose replica counts `r[e] >= 1` and the GPUs holding them
(never two replicas of one expert on one GPU, exactly `S` per GPU); each replica of `e` serves
`w[t, e] / r[e]`. Minimise the busiest GPU's load, windows combined by their max or mean (a
quantile objective is planned as the max and reported as the quantile).

Model (`build_model`), chosen so that no product of variables appears:

- States instead of counts. Each expert picks one *state*: an exact replica count `k`, or a
  *bucket* of counts `low..high` (only for counts far above what the expert needs). A state
  carries a precomputed integer share per window, `q = floor(scale * w / k)`; a bucket carries
  `floor(scale * w / high)`, the smallest share any of its counts gives: a relaxation.
- `z[e, s, g]` = "GPU `g` holds a replica of `e` and `e` is in state `s`". The load of GPU `g`
  in window `t` is then linear: `sum q[t, e, s] * z[e, s, g]`.
- Counts are cut with the best plan known (the hint, objective `U`): a plan at most `U` gives
  every expert `r[e] >= ceil(w[e] / U)`, so states below are dropped; `r[e] <= G` and
  `r[e] <= P - sum of the other experts' least counts`. Exact counts start at the least count
  and run for as many values as a literal budget allows; the rest go in one bucket.
- GPU symmetry (any permutation of GPUs is the same plan) is broken by a lexicographic order:
  the columns of `x[e, g]` (rows: the hottest experts first) never increase from one GPU to the
  next (off in migration mode, where GPUs are told apart by their current contents). On five
  tiny cases this proved optimality 4-190x faster (deterministic time) than ordering GPUs by load.
- The known lower bound (`bounds.window_lower_bound`) and the hint's value bound the objective.
- Room (`room=True`): per window, the GPUs' load variables add up to at least the experts'
  loads (`share * low` per chosen state), so bound propagation sees, as a branch-and-bound
  would, when the load not yet placed cannot fit below the objective on the GPUs with room.
- Search order (`fixed_search=True`): hottest expert first, its state, then its GPUs
  (`FIXED_SEARCH` on that decision strategy).
  Measured (5 deterministic s each, 11 instances up to 16 experts x 8 GPUs x 3 slots): room +
  fixed search proved 5 optimal and gave the best plan on 9; without them 3 proofs, and on 16
  experts x 8 GPUs plans 0.3-2% worse (fast's plan was improved on 5 of 6 random layers).
- Migration mode (a current placement): a GPU keeps the experts it holds now for free; every
  other slot is a moved slot. `moved = P - sum_g sum_{e held by g now} x[e, g]` is linear; the
  objective adds `move_cost_weight * moved` and `max_moved_slots` caps it. Kept experts stay in
  their old slots in the returned plan.

Exact scaling: with integer loads, `scale` is the least common multiple of the exact counts
(when it stays below 2**40 times the total load), so every exact share is exact and CP-SAT's
objective is `scale` times the true one while no bucket is used. Otherwise (fractional loads, or an lcm too large)
`scale` makes the total load about 2**32 and shares round down: each GPU's model load is within
`S` units (`S / scale`, at most `P / 2**32` of the mean GPU load) below the true load. In both cases every model
load is at most `scale` times the true load, so CP-SAT's best bound divided by `scale` is a valid
bound on the true problem, and the objective we report is always the true float load of the
returned plan, evaluated afresh. "optimal" is reported only when that true objective meets the
bound (relative tolerance 1e-9, plus `S / scale` load units when shares were rounded).

Solving (`solve_model`): the hint (the `fast` heuristic's plan, or the current placement in
migration mode, whichever is better) is given to CP-SAT with `add_hint` and is the incumbent:
the returned plan is never worse than it. Determinism: one sequential worker (or, if asked for
more, `interleave_search`, CP-SAT's deterministic parallel mode), a fixed `random_seed`, and the
time limit spent as `max_deterministic_time` (CP-SAT's work units, close to seconds on an idle
core; on a loaded machine the wall time is longer), so two runs on the same input return the
same plan. A wall-clock safety limit (`WALL_SAFETY_FACTOR` x the limit + 10 s) only stops
runaway solves, and `detail["wall_limit_hit"]` says when it did (then runs may differ).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
from ortools.sat.python import cp_model

from moe_place.errors import InfeasibleError, InputError
from moe_place.placement import has_colocation, keep_unchanged_slots
from moe_place.problem import PlacementProblem, combine_windows
from moe_place.solvers.base import LayerSolution, stoppable_solve
from moe_place.solvers.bounds import windows_lower_bound
from moe_place.solvers.evaluate import even_gpu_loads
from moe_place.solvers.fast import FastSolver

__all__ = ["CpSatSolver", "LayerInstance", "LayerModel", "ModelResult", "ReplicaState", "build_model", "choose_scale",
           "count_ranges", "cpsat_layer", "placement_literals", "replica_states", "solve_model"]

DEFAULT_TIME_LIMIT_S = 10.0   # deterministic seconds per layer when the caller gives none
NUM_WORKERS = 1               # one sequential worker: deterministic, and with the lex ordering it proved
                              # tiny cases 10-30x faster (deterministic time) than 2 interleaved workers;
                              # layers run in parallel processes instead (`--jobs`)
WALL_SAFETY_FACTOR = 10.0     # wall-clock stop at this many times the deterministic limit (+ 10 s)
MAX_STATE_LITERALS = 16_000   # budget for the z literals: sets how many exact counts each expert gets
LEX_MAX_EXPERTS = 24          # the lex ordering of GPUs looks at the hottest experts only (still valid)
_EXACT_SCALE_LIMIT = 2 ** 40  # exact scaling only while scale * total load stays below this
_FLOOR_SCALE_TARGET = 2 ** 32  # rounded scaling: scale * total load is about this
_REL_TOL = 1e-9                # "optimal" when the true objective is within this of the bound


# ---------------------------------------------------------------------- inputs and states
@dataclass(frozen=True)
class LayerInstance:
    """One layer's CP-SAT input, taken from a validated `PlacementProblem` (`LayerInstance.of`).

    loads: float64 `[windows, E]`, non-negative. num_gpus: `G`. slots_per_gpu: `S`.
    objective: "max" | "mean" | "quantile" (how windows combine; quantile is planned as max).
    current: int64 `[P]` phy2log in use now (migration mode) or None.
    move_cost_weight: load units charged per moved slot. max_moved_slots: cap, or None.
    """

    loads: np.ndarray
    num_gpus: int
    slots_per_gpu: int
    objective: str = "max"
    quantile: float = 0.9
    current: np.ndarray | None = None
    move_cost_weight: float = 0.0
    max_moved_slots: int | None = None

    @classmethod
    def of(cls, problem: PlacementProblem, layer: int) -> "LayerInstance":
        """Layer `layer` of `problem` (which validated every size, load and option)."""
        return cls(problem.layer_loads(layer), problem.num_gpus, problem.slots_per_gpu, problem.window_objective,
                   problem.quantile, problem.current_row(layer), problem.move_cost_weight, problem.max_moved_slots)

    @property
    def num_experts(self) -> int:
        return self.loads.shape[1]

    @property
    def num_physical(self) -> int:
        return self.num_gpus * self.slots_per_gpu

    def evaluate(self, phy2log: np.ndarray, planned: bool = False) -> tuple[float, int]:
        """(windows-combined busiest-GPU load, moved slots) of a plan `[P]`, in true floats.

        planned=True combines windows as the model does (a quantile objective is planned as the max).
        """
        busiest = even_gpu_loads(np.asarray(phy2log), self.loads, self.num_gpus).max(axis=1)
        moved = 0 if self.current is None else int((np.asarray(phy2log) != self.current).sum())
        objective = "max" if planned and self.objective == "quantile" else self.objective
        return combine_windows(busiest, objective, self.quantile), moved

    def cost(self, phy2log: np.ndarray, planned: bool = False) -> float:
        """load + move_cost_weight * moved slots, in true floats (what the model minimises if planned)."""
        load, moved = self.evaluate(phy2log, planned)
        return load + self.move_cost_weight * moved

    def allows(self, phy2log: np.ndarray) -> bool:
        """True when the plan respects the move cap and puts no expert twice on one GPU."""
        if has_colocation(np.asarray(phy2log), self.num_gpus):
            return False
        return self.max_moved_slots is None or self.evaluate(phy2log)[1] <= self.max_moved_slots


@dataclass(frozen=True)
class ReplicaState:
    """One choice for an expert: `low..high` replicas (`low == high`: an exact count).

    share: int64 `[windows]`, scaled load of each replica, `floor(scale * w / high)`: exact for an
    exact count, the smallest possible share for a bucket (a relaxation).
    """

    low: int
    high: int
    share: np.ndarray


def count_ranges(instance: LayerInstance, upper_bound: float, exact_counts: int) -> list[list[tuple[int, int]]]:
    """Per expert, its replica-count ranges `(low, high)`: exact counts from the least one worth
    having, `exact_counts` of them, then one bucket up to the most it can get.

    upper_bound: the true (planned) cost of a known plan; plans above it are not looked for.
    """
    least = _least_counts(instance, upper_bound)
    physical, gpus = instance.num_physical, instance.num_gpus
    ranges = []
    for e in range(instance.num_experts):
        most = min(gpus, physical - (int(least.sum()) - int(least[e])))
        top_exact = min(most, int(least[e]) + exact_counts - 1)
        expert_ranges = [(k, k) for k in range(int(least[e]), top_exact + 1)]
        if top_exact < most:
            expert_ranges.append((top_exact + 1, most))
        ranges.append(expert_ranges)
    return ranges


def replica_states(instance: LayerInstance, ranges: list[list[tuple[int, int]]], scale: float) -> list[list[ReplicaState]]:
    """Per expert, its states: the count ranges with their scaled shares; neighbours with equal
    shares in every window merge into one state (the model does not need to tell them apart)."""
    states = []
    for e, expert_ranges in enumerate(ranges):
        expert_states: list[ReplicaState] = []
        for low, high in expert_ranges:
            share = np.floor(instance.loads[:, e] * scale / high).astype(np.int64)
            if expert_states and np.array_equal(expert_states[-1].share, share):
                expert_states[-1] = ReplicaState(expert_states[-1].low, high, share)
            else:
                expert_states.append(ReplicaState(low, high, share))
        states.append(expert_states)
    return states


def _least_counts(instance: LayerInstance, upper_bound: float) -> np.ndarray:
    """int64 `[E]`: replicas every expert needs in any plan of cost <= upper_bound.

    A replica of `e` sits on some GPU, so each window's busiest load is at least `w[t, e] / r[e]`;
    for the max objective all windows count, for the mean their mean (the quantile is planned as
    the max). Rounded conservatively (never above the true least count).
    """
    loads = instance.loads
    need = loads.mean(axis=0) if instance.objective == "mean" else loads.max(axis=0)
    if upper_bound <= 0:
        least = np.where(need > 0, instance.num_gpus, 1)
    else:
        least = np.ceil(need / upper_bound * (1 - 1e-9) - 1e-12)
    return np.clip(least, 1, instance.num_gpus).astype(np.int64)


def choose_scale(instance: LayerInstance, states_counts: list[int]) -> tuple[float, bool]:
    """(scale, exact): integer loads -> lcm of the exact counts if small enough, else a power of 2."""
    loads = instance.loads
    total = float(loads.sum(axis=1).max())
    if total <= 0:
        return 1.0, True
    if np.array_equal(loads, np.round(loads)):
        lcm = 1
        for k in sorted(set(states_counts)):
            lcm = math.lcm(lcm, k)
            if lcm * total >= _EXACT_SCALE_LIMIT:
                break
        else:
            return float(lcm), True
    return 2.0 ** math.floor(math.log2(_FLOOR_SCALE_TARGET / total)), False


# ---------------------------------------------------------------------- the model
@dataclass
class LayerModel:
    """A built CP-SAT model and the handles needed to read a plan back."""

    instance: LayerInstance
    model: cp_model.CpModel
    states: list[list[ReplicaState]]
    z: list[list[list[cp_model.IntVar]]]   # [e][s][g]: g holds e, e in state s
    x: list[list[cp_model.IntVar]]         # [e][g]: g holds e
    state_used: list[list[cp_model.IntVar]]  # [e][s]: e is in state s
    load: list[list[cp_model.IntVar]]      # [t][g]: scaled load of GPU g in window t
    window_max: list[cp_model.IntVar]      # [t] (one shared variable for the max objective)
    moved: cp_model.LinearExpr | None      # moved slots (migration mode)
    scale: float
    exact_scale: bool
    divisor: float                          # model objective / divisor = true objective units
    lex_equal: list[list]                   # [G-1][E] lex-ordering literals ([] if GPU symmetry is kept)
    detail: dict = field(default_factory=dict)


def build_model(instance: LayerInstance, hint: np.ndarray, lower_bound: float,
                max_state_literals: int = MAX_STATE_LITERALS, symmetry: str = "lex", room: bool = True,
                fixed_search: bool = True) -> LayerModel:
    """The CP-SAT model of one layer (module docstring), hinted with the plan `hint` `[P]`.

    hint: a plan allowed by `instance` (its true cost bounds the search from above).
    lower_bound: a valid bound on the windows-combined load (true units).
    """
    E, G, S, P = instance.num_experts, instance.num_gpus, instance.slots_per_gpu, instance.num_physical
    windows = instance.loads.shape[0]
    upper = instance.cost(hint, planned=True)
    exact_counts = max(2, max_state_literals // max(1, E * G))
    ranges = count_ranges(instance, upper, exact_counts)
    scale, exact_scale = choose_scale(instance, [low for expert in ranges for low, high in expert if low == high])
    states = replica_states(instance, ranges, scale)
    migrating = instance.current is not None
    model = cp_model.CpModel()

    # Variables. z[e][s][g]: GPU g holds a replica of expert e, and e is in state s.
    z = [[[model.new_bool_var(f"z_e{e}_s{s}_g{g}") for g in range(G)] for s in range(len(states[e]))]
         for e in range(E)]
    # state_used[e][s]: expert e is in state s (its replica count is in low..high of s).
    state_used = [[model.new_bool_var(f"state_e{e}_s{s}") for s in range(len(states[e]))] for e in range(E)]
    # x[e][g]: GPU g holds a replica of e (whatever the state).
    x = [[model.new_bool_var(f"x_e{e}_g{g}") for g in range(G)] for e in range(E)]

    for e in range(E):
        # Every expert is in exactly one state.
        model.add_exactly_one(state_used[e])
        for s, state in enumerate(states[e]):
            replicas = sum(z[e][s])
            # Its replica count lies in the state's range (nothing is placed for an unused state).
            model.add(replicas >= state.low * state_used[e][s])
            model.add(replicas <= state.high * state_used[e][s])
        for g in range(G):
            # GPU g holds e in at most one state (one replica of e per GPU), and x says whether it does.
            model.add(sum(z[e][s][g] for s in range(len(states[e]))) == x[e][g])

    # Every GPU has exactly S slots filled.
    for g in range(G):
        model.add(sum(x[e][g] for e in range(E)) == S)

    # Scaled load of GPU g in window t: the shares of the replicas it holds.
    load = [[sum(int(states[e][s].share[t]) * z[e][s][g] for e in range(E) for s in range(len(states[e])))
             for g in range(G)] for t in range(windows)]
    top = int(math.floor(upper * scale)) + S  # above any model load of a plan no worse than the hint
    # Room: the GPUs' loads add up to the experts' loads (each expert's shares times its count,
    # at least `share * low` in its state). As a linear constraint on bounded load variables it
    # lets propagation see when the load not yet placed cannot fit below the objective.
    load_var = [[model.new_int_var(0, top * windows, f"load_t{t}_g{g}") for g in range(G)] for t in range(windows)]
    for t in range(windows):
        for g in range(G):
            model.add(load_var[t][g] == load[t][g])
        if room:
            model.add(sum(load_var[t]) >= sum(int(states[e][s].share[t]) * states[e][s].low * state_used[e][s]
                                              for e in range(E) for s in range(len(states[e]))))
    load = load_var
    floor_bound = max(0, int(math.floor(lower_bound * scale)))  # never above scale x true optimum
    if instance.objective == "mean":
        # window_max[t]: the busiest GPU of window t; their mean is the objective.
        window_max = [model.new_int_var(0, top * windows, f"window_max_{t}") for t in range(windows)]
        for t in range(windows):
            for g in range(G):
                model.add(load[t][g] <= window_max[t])
        load_objective = sum(window_max)
        divisor = scale * windows
        model.add(load_objective >= floor_bound * windows)
    else:
        # One busiest-load variable for all windows (max objective; quantile planned as max).
        busiest = model.new_int_var(0, top, "busiest")
        window_max = [busiest]
        for t in range(windows):
            for g in range(G):
                model.add(load[t][g] <= busiest)
        load_objective = busiest
        divisor = scale
        if instance.objective == "max":
            model.add(busiest >= floor_bound)

    moved = None
    lex_equal: list[list] = []
    if migrating:
        # A GPU keeps the experts it holds now in place; every other slot of it is moved.
        now = instance.current.reshape(G, S)
        kept = sum(x[int(e)][g] for g in range(G) for e in set(now[g].tolist()))
        moved = P - kept
        if instance.max_moved_slots is not None:
            model.add(moved <= instance.max_moved_slots)
        move_cost = int(math.floor(instance.move_cost_weight * divisor))  # rounded down: a relaxation
        model.minimize(load_objective + move_cost * moved)
        model.add(load_objective + move_cost * moved <= int(math.floor(upper * divisor)) + S * windows)
    else:
        lex_equal = _break_gpu_symmetry(model, x, instance, symmetry)
        model.minimize(load_objective)

    # Search like a branch-and-bound: hottest expert first, its state (fewest replicas first),
    # then the GPUs that hold it (lowest GPU first, "holds" tried first: fits the lex order).
    if fixed_search:
        strategy = []
        for e in _expert_order(instance):
            strategy += state_used[e] + x[e]
        model.add_decision_strategy(strategy, cp_model.CHOOSE_FIRST, cp_model.SELECT_MAX_VALUE)

    layer_model = LayerModel(instance, model, states, z, x, state_used, load_var, window_max, moved, scale,
                             exact_scale, divisor, lex_equal)
    _add_hint(layer_model, hint)
    layer_model.detail.update(scale=scale, exact_scale=exact_scale, exact_counts=exact_counts,
                              num_states=sum(len(st) for st in states))
    return layer_model


def _break_gpu_symmetry(model: cp_model.CpModel, x: list, instance: LayerInstance, symmetry: str) -> list[list]:
    """Cut the GPU permutations: every plan keeps one representative.

    "lex": the columns of `x` restricted to the `LEX_MAX_EXPERTS` hottest experts (hottest first)
    are in non-increasing lexicographic order, encoded with `equal[i]` = "GPUs g and g+1 agree on
    the first i of those experts" (exact definition). Any plan's GPUs can be sorted so.
    "none": leave it to CP-SAT.
    Returns `equal` per adjacent pair, `[G-1][min(E, LEX_MAX_EXPERTS)]` (for the hint).
    """
    if symmetry == "none":
        return []
    if symmetry != "lex":
        raise InputError("symmetry", "lex or none", symmetry)
    order = _expert_order(instance)[:LEX_MAX_EXPERTS]  # a prefix of the rows: still one plan per orbit
    rows = len(order)
    pairs = []
    for g in range(instance.num_gpus - 1):
        # equal[i]: columns g and g+1 are equal on the first i experts of `order`.
        equal = [model.new_constant(1)] + [model.new_bool_var(f"lex_g{g}_{i}") for i in range(1, rows)]
        pairs.append(equal)
        for i in range(rows):
            a, b = x[order[i]][g], x[order[i]][g + 1]
            # While equal so far, GPU g holds expert order[i] if GPU g+1 does (a >= b).
            model.add_bool_or([equal[i].negated(), a, b.negated()])
            if i + 1 < rows:
                # equal[i+1] <=> equal[i] and a == b.
                model.add_implication(equal[i + 1], equal[i])
                model.add_bool_or([equal[i + 1].negated(), a.negated(), b])
                model.add_bool_or([equal[i + 1].negated(), a, b.negated()])
                model.add_bool_or([equal[i].negated(), a, b, equal[i + 1]])
                model.add_bool_or([equal[i].negated(), a.negated(), b.negated(), equal[i + 1]])
    return pairs


def _expert_order(instance: LayerInstance) -> list[int]:
    """Experts hottest first (summed over windows; ties by id): the row order of the lex ordering."""
    return [int(e) for e in np.argsort(-instance.loads.sum(axis=0), kind="stable")]


def _add_hint(layer_model: LayerModel, hint: np.ndarray) -> None:
    """Give CP-SAT the plan `hint` `[P]` (its GPUs reordered to meet the symmetry ordering)."""
    inst = layer_model.instance
    G, E = inst.num_gpus, inst.num_experts
    table = np.asarray(hint, dtype=np.int64).reshape(G, -1)
    counts = np.bincount(table.ravel(), minlength=E)
    state_of = [next(s for s, st in enumerate(layer_model.states[e]) if st.low <= counts[e] <= st.high)
                for e in range(E)]
    order = _expert_order(inst)[:LEX_MAX_EXPERTS]
    if layer_model.lex_equal:  # columns in non-increasing lex order, experts hottest first
        columns = [tuple(int(e in row) for e in order) for row in table.tolist()]
        table = table[sorted(range(G), key=lambda g: columns[g], reverse=True)]
    holds = np.zeros((G, E), dtype=bool)
    holds[np.repeat(np.arange(G), table.shape[1]), table.ravel()] = True
    for e in range(E):
        for s in range(len(layer_model.states[e])):
            layer_model.model.add_hint(layer_model.state_used[e][s], s == state_of[e])
            for g in range(G):
                layer_model.model.add_hint(layer_model.z[e][s][g], bool(s == state_of[e] and holds[g, e]))
        for g in range(G):
            layer_model.model.add_hint(layer_model.x[e][g], bool(holds[g, e]))
    shares = np.array([layer_model.states[e][state_of[e]].share for e in range(E)]).T  # [windows, E]
    gpu_loads = shares[:, table].sum(axis=2)  # [windows, G]: model loads of the (reordered) hint
    window_loads = gpu_loads.max(axis=1)      # [windows]: model busiest load per window
    for t, row in enumerate(layer_model.load):
        for g, var in enumerate(row):
            layer_model.model.add_hint(var, int(gpu_loads[t, g]))
    if len(layer_model.window_max) == 1:
        layer_model.model.add_hint(layer_model.window_max[0], int(window_loads.max()))
    else:
        for t, var in enumerate(layer_model.window_max):
            layer_model.model.add_hint(var, int(window_loads[t]))
    for g, equal in enumerate(layer_model.lex_equal):
        same = np.cumprod(holds[g, order] == holds[g + 1, order])  # prefix i+1 equal
        for i in range(1, len(order)):
            layer_model.model.add_hint(equal[i], bool(same[i - 1]))


# ---------------------------------------------------------------------- solving
@dataclass(frozen=True)
class ModelResult:
    """What one CP-SAT solve gave: a plan `[P]` (None if none found) and its figures."""

    phy2log: np.ndarray | None
    status: str               # CP-SAT's status name
    model_objective: float    # in true units (objective / divisor); inf without a solution
    model_bound: float        # valid lower bound in true units
    deterministic_time: float
    wall_s: float
    wall_limit_hit: bool
    branches: int
    conflicts: int


def solve_model(layer_model: LayerModel, time_limit_s: float, seed: int = 0,
                num_workers: int = NUM_WORKERS, wall_limit_s: float | None = None) -> ModelResult:
    """Run CP-SAT deterministically for `time_limit_s` deterministic seconds.

    wall_limit_s: a wall-clock stop (None: the safety limit); a run it stops may not repeat.
    """
    solver = cp_model.CpSolver()
    params = solver.parameters
    params.num_workers = num_workers
    params.interleave_search = num_workers > 1  # deterministic parallel search when several workers
    if layer_model.model.proto.search_strategy:
        params.search_branching = cp_model.FIXED_SEARCH  # follow the model's decision strategy
    params.random_seed = int(seed)
    params.max_deterministic_time = float(time_limit_s)
    params.max_time_in_seconds = WALL_SAFETY_FACTOR * float(time_limit_s) + 10.0 if wall_limit_s is None \
        else float(wall_limit_s)
    params.log_search_progress = False
    start = time.perf_counter()
    status = stoppable_solve(solver, layer_model.model)
    wall = time.perf_counter() - start
    name = solver.status_name(status)
    plan = None
    objective = math.inf
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        plan = _read_plan(layer_model, solver)
        objective = solver.objective_value / layer_model.divisor
    bound = solver.best_objective_bound / layer_model.divisor * (1 - 1e-12) if status != cp_model.INFEASIBLE else math.inf
    # Unproved and short of its deterministic limit: only the wall clock can have stopped it.
    dtime = solver.deterministic_time
    wall_limit_hit = status not in (cp_model.OPTIMAL, cp_model.INFEASIBLE) and dtime < 0.99 * time_limit_s
    return ModelResult(plan, name, objective, bound, dtime, wall, wall_limit_hit, solver.num_branches,
                       solver.num_conflicts)


def _read_plan(layer_model: LayerModel, solver: cp_model.CpSolver) -> np.ndarray:
    """phy2log `[P]` of CP-SAT's solution; in migration mode kept experts stay in their old slots."""
    inst = layer_model.instance
    G, S, E = inst.num_gpus, inst.slots_per_gpu, inst.num_experts
    gpu_experts: list[list[int]] = [[] for _ in range(G)]
    for e in range(E):
        for s in range(len(layer_model.states[e])):
            for g in range(G):
                if solver.boolean_value(layer_model.z[e][s][g]):
                    gpu_experts[g].append(e)
    if inst.current is None:
        return np.array([e for g in range(G) for e in sorted(gpu_experts[g])], dtype=np.int64)
    return keep_unchanged_slots(np.array([sorted(experts) for experts in gpu_experts], dtype=np.int64).ravel(),
                                inst.current, S)


# ---------------------------------------------------------------------- one layer, end to end
def cpsat_layer(instance: LayerInstance, hint: np.ndarray, lower_bound: float,
                time_limit_s: float = DEFAULT_TIME_LIMIT_S, seed: int = 0,
                max_state_literals: int = MAX_STATE_LITERALS, wall_limit_s: float | None = None) -> LayerSolution:
    """Plan one layer with CP-SAT, starting from `hint` `[P]` (module docstring).

    lower_bound: a valid bound on the windows-combined load (e.g. `bounds.windows_lower_bound`).
    time_limit_s: deterministic seconds for the search; wall_limit_s: optional wall-clock stop for
    the search (callers with a deadline; the result may then differ between runs).
    The result's objective is the true windows-combined busiest-GPU load of the plan; its
    lower bound is valid for the true problem (for the load alone when moves are charged).
    """
    start = time.perf_counter()
    hint = np.asarray(hint, dtype=np.int64)
    if instance.current is not None:
        hint = keep_unchanged_slots(hint, instance.current, instance.slots_per_gpu)
    if not instance.allows(hint):
        raise InputError("hint", "a plan with no expert twice on one GPU, within the move cap", hint.tolist())
    if instance.move_cost_weight == 0 and instance.objective != "quantile" \
            and instance.cost(hint) <= lower_bound * (1 + _REL_TOL):
        # The hint meets the bound: it is optimal, nothing to search.
        load, moved = instance.evaluate(hint)
        detail = {"cp_status": "NOT_RUN", "source": "hint", "hint_objective": load, "best_bound": lower_bound,
                  "gap": 0.0, "deterministic_time": 0.0}
        if instance.current is not None:
            detail.update(moved_slots=moved, cost=load)
        return LayerSolution(hint, "optimal", load, min(lower_bound, load), time.perf_counter() - start, detail)
    layer_model = build_model(instance, hint, lower_bound, max_state_literals)
    if wall_limit_s is not None:  # the model build counts against the wall-clock stop too
        wall_limit_s = max(0.01, wall_limit_s - (time.perf_counter() - start))
    result = solve_model(layer_model, time_limit_s, seed, wall_limit_s=wall_limit_s)

    hint_cost = instance.cost(hint)
    plan, source = hint, "hint"
    if result.phy2log is not None and instance.cost(result.phy2log) < hint_cost:
        plan, source = result.phy2log, "cpsat"
    load, moved = instance.evaluate(plan)
    cost = load + instance.move_cost_weight * moved
    # Bound on the objective CP-SAT minimised (cost); on the load alone when moves are charged.
    combined_bound = max(result.model_bound, lower_bound) if instance.objective != "quantile" else lower_bound
    combined_bound = min(combined_bound, cost)  # a bound above a plan's cost would be a rounding artefact
    load_bound = combined_bound if instance.move_cost_weight == 0 else min(lower_bound, load)
    # Rounded shares (no exact scale) can hide up to S units per GPU: "optimal" up to that resolution.
    resolution = 0.0 if layer_model.exact_scale else instance.slots_per_gpu / layer_model.scale
    proved = cost <= combined_bound * (1 + _REL_TOL) + resolution
    detail = dict(layer_model.detail)
    detail.update(
        cp_status=result.status, source=source, hint_objective=hint_cost, model_objective=result.model_objective,
        best_bound=combined_bound, gap=(cost - combined_bound) / cost if cost > 0 else 0.0,
        deterministic_time=result.deterministic_time, wall_limit_hit=result.wall_limit_hit,
        branches=result.branches, conflicts=result.conflicts, num_booleans=len(layer_model.model.proto.variables),
    )
    if instance.current is not None:
        detail.update(moved_slots=moved, cost=cost)
    return LayerSolution(plan, "optimal" if proved else "feasible", load, load_bound,
                         time.perf_counter() - start, detail)


def placement_literals(num_experts: int, num_gpus: int, max_state_literals: int = MAX_STATE_LITERALS) -> int:
    """About how many Boolean literals `build_model` creates for a layer: `x[e, g]` and `z[e, s, g]`
    for up to `exact_counts + 1` states per expert, and no more states than replica counts `1..G`
    (the planning estimate of `solvers.cpsat_schedule`)."""
    cells = num_experts * num_gpus
    return cells * (min(max(2, max_state_literals // max(1, cells)), num_gpus) + 2)


class CpSatSolver:
    """CP-SAT on one layer, hinted with `fast` (or the current plan); deterministic; proves when it can.

    Registered as "cpsat" by `moe_place.solvers` through a factory, so that OR-Tools (optional:
    `pip install 'moe-place[solver]'`) is imported only when cpsat is asked for."""

    name: ClassVar[str] = "cpsat"

    def prepare(self, problem: PlacementProblem, layers: list[int]) -> None:
        """Nothing to share: each layer is its own model."""

    def solve_layer(self, problem: PlacementProblem, layer: int, time_limit_s: float | None, *,
                    start: LayerSolution | None = None, deadline: float | None = None) -> LayerSolution:
        """CP-SAT for `time_limit_s` deterministic seconds (None: DEFAULT_TIME_LIMIT_S), from `start`
        (or `fast`'s plan) and the current plan in migration mode, whichever costs less; `deadline`
        caps the wall clock (then `detail["cut"]`)."""
        instance = LayerInstance.of(problem, layer)
        first = start.phy2log if start is not None else FastSolver().solve_layer(problem, layer, None).phy2log
        candidates = [np.asarray(first, dtype=np.int64)]
        if instance.current is not None:  # the current plan moves nothing: always within a cap
            candidates = [keep_unchanged_slots(c, instance.current, problem.slots_per_gpu) for c in candidates]
            candidates.append(instance.current)
        allowed = [c for c in candidates if instance.allows(c)]
        if not allowed:
            raise InfeasibleError(f"layer {problem.layer_id(layer)}: no starting plan within the move cap "
                                  f"(the current placement holds an expert twice on one GPU)")
        hint = min(allowed, key=instance.cost)
        bound = windows_lower_bound(instance.loads, problem.num_gpus, problem.num_physical,
                                    problem.window_objective, problem.quantile)
        if start is not None:
            bound = max(bound, min(start.lower_bound, instance.evaluate(hint)[0]))
        limit = DEFAULT_TIME_LIMIT_S if time_limit_s is None else time_limit_s
        wall = None if deadline is None else max(0.0, deadline - time.monotonic())
        solution = cpsat_layer(instance, hint, bound, limit, problem.seed, wall_limit_s=wall)
        if solution.detail.get("wall_limit_hit"):
            solution.detail["cut"] = True
        return solution
