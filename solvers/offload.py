"""Which experts stay resident on the GPU when the rest run on the CPU (offloaded serving).

The problem (docs/MODEL.md, "Tiered GPU/host experts"). `L` MoE layers of `E` experts, one GPU
with room for `K` expert copies in all, batch sizes (scenarios) `s` with weights `w[s]`. Choose a
resident set `R[l]` per layer, `sum |R[l]| <= K`, minimising

    sum_s w[s] * sum_l max(A[s,l](R[l]), B[s,l](R[l]))
    A[s,l](R) = [R misses an expert] * tau[s] + sum_{e not in R} c[s,l,e]     the CPU side
    B[s,l](R) = sum_{e in R} g[s,l,e]                                        the GPU side

with `c` and `g` the expected CPU and GPU time of expert `e` in a batch of scenario `s`
(`moe_place.cost.offload.expected_costs`) and `tau[s]` the layer's row transfer.

How it is solved:
1. Per layer, order the experts by the weighted CPU time they would take, `sum_s w[s]*c[s,l,e]`,
   most first; the `k` first are the plan's resident set for `k` experts (`k = 0..E`), and its
   value `f[l][k]` is priced exactly.
2. Bound per layer: the objective is at least `sum_s w[s]*A` and at least `sum_s w[s]*B`; the
   first is smallest for the same `k` first experts, the second for the `k` experts of least
   weighted GPU time, so `lb[l][k] = max` of the two is a valid lower bound for any set of `k`.
   Where the CPU side binds (`A >= B` in every scenario), `f[l][k] = lb[l][k]`: the set is optimal.
3. Memory over layers: an exact multiple-choice knapsack over `f` (`solvers.budget.allocate_slots`,
   one unit = one expert); the same knapsack over `lb` bounds every plan of `K` experts.
4. Where a gap stays open (the GPU side binds somewhere), CP-SAT solves that layer and count
   exactly when `E` is small enough (`EXACT_MAX_EXPERTS`), within the time limit, the chosen
   counts first, then the layer's other counts with a gap: binaries `x[e]` (resident), `sum x = k`, `t[s] >= A[s]`, `t[s] >= B[s]`, minimise
   `sum w[s]*t[s]`; the coefficients are rounded down to integer picoseconds so CP-SAT's bound
   stays a lower bound of the real objective. Then step 3 runs again on the improved tables.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from moe_place.cost.models import ExpertShape
from moe_place.cost.offload import OffloadRates, expected_costs
from moe_place.errors import InputError
from moe_place.solvers.base import stoppable_solve
from moe_place.solvers.budget import allocate_slots

EXACT_MAX_EXPERTS = 512          # CP-SAT per layer only up to this many experts (the model stays small)
PICOSECONDS = 1e12               # CP-SAT coefficient unit (integers): 1 ps against layer times of us-ms
GAP_TOLERANCE = 1e-9             # relative: a gap below this is closed (floating-point sums)


@dataclass(frozen=True)
class OffloadProblem:
    """Expected costs of every expert per scenario, and the GPU's room.

    layer_ids: the model layer of each row. scenario_names / scenario_tokens / weights: `[S]`.
    cpu_s, gpu_s: float64 `[S, L, E]`, expected seconds of expert `e` of layer `l` in one batch of
    scenario `s` on the CPU (weights read from DRAM) and resident on the GPU. transfer_s: `[S]`,
    the row transfer of a layer that keeps some expert on the CPU. capacity: `K`, expert copies the
    GPU can hold (all layers together).
    """

    layer_ids: tuple[int, ...]
    scenario_names: tuple[str, ...]
    scenario_tokens: tuple[int, ...]
    weights: np.ndarray
    cpu_s: np.ndarray
    gpu_s: np.ndarray
    transfer_s: np.ndarray
    capacity: int

    def __post_init__(self) -> None:
        cpu, gpu = np.asarray(self.cpu_s, dtype=np.float64), np.asarray(self.gpu_s, dtype=np.float64)
        scenarios = len(self.scenario_names)
        if scenarios < 1 or cpu.ndim != 3 or cpu.shape != gpu.shape or cpu.shape[0] != scenarios:
            raise InputError("offload problem", "cpu_s and gpu_s of one shape [scenarios, layers, experts]",
                             (cpu.shape, gpu.shape, scenarios))
        if cpu.shape[1] != len(self.layer_ids) or cpu.shape[1] < 1 or cpu.shape[2] < 1:
            raise InputError("offload problem", f"{len(self.layer_ids)} layers (layer_ids) of >= 1 expert", cpu.shape)
        weights = np.asarray(self.weights, dtype=np.float64)
        transfer = np.asarray(self.transfer_s, dtype=np.float64)
        if weights.shape != (scenarios,) or transfer.shape != (scenarios,) or len(self.scenario_tokens) != scenarios:
            raise InputError("offload problem", f"{scenarios} weights, tokens and transfer times",
                             (weights.shape, transfer.shape, len(self.scenario_tokens)))
        for name, values in (("cpu_s", cpu), ("gpu_s", gpu), ("transfer_s", transfer), ("weights", weights)):
            if not np.isfinite(values).all() or (values < 0).any():
                raise InputError(f"offload problem {name}", "finite numbers >= 0")
        if not weights.sum() > 0:
            raise InputError("scenario weights", "at least one weight > 0", weights.tolist())
        if isinstance(self.capacity, bool) or not isinstance(self.capacity, (int, np.integer)) or self.capacity < 1:
            raise InputError("GPU capacity", "at least one expert", self.capacity)
        for name, values in (("cpu_s", cpu), ("gpu_s", gpu), ("weights", weights), ("transfer_s", transfer)):
            values.setflags(write=False)
            object.__setattr__(self, name, values)
        object.__setattr__(self, "capacity", int(self.capacity))

    @classmethod
    def from_counts(cls, counts, num_tokens: int, scenarios: list[tuple[str, int, float]], model: ExpertShape,
                    rates: OffloadRates, capacity: int, layer_ids: tuple[int, ...] | None = None) -> "OffloadProblem":
        """From planning counts: counts int `[L, E]` (tokens routed to each expert over `num_tokens`
        tokens; a token picks distinct experts, so `counts / num_tokens` is each expert's share) and
        scenarios `(name, tokens per batch, weight)`."""
        counts = np.asarray(counts, dtype=np.float64)
        if counts.ndim != 2 or num_tokens < 1:
            raise InputError("planning counts", "[layers, experts] counts of >= 1 token", counts.shape)
        if (counts > num_tokens * (1 + 1e-9)).any():
            raise InputError("planning counts", f"at most {num_tokens} tokens per expert (distinct experts per token)",
                             int(counts.max()))
        return cls.from_shares(counts / float(num_tokens), scenarios, model, rates, capacity, layer_ids)

    @classmethod
    def from_shares(cls, share, scenarios: list[tuple[str, int, float]], model: ExpertShape, rates: OffloadRates,
                    capacity: int, layer_ids: tuple[int, ...] | None = None) -> "OffloadProblem":
        """From each expert's share of the tokens, float `[L, E]` in [0, 1] (a token's probability to
        pick it), and scenarios `(name, tokens per batch, weight)`."""
        share = np.asarray(share, dtype=np.float64)
        if share.ndim != 2 or not np.isfinite(share).all() or (share < 0).any() or (share > 1 + 1e-9).any():
            raise InputError("expert shares", "[layers, experts] probabilities in [0, 1]", share.shape)
        costs = [expected_costs(share, tokens, model, rates) for _, tokens, _ in scenarios]
        ids = tuple(range(share.shape[0])) if layer_ids is None else tuple(layer_ids)
        return cls(ids, tuple(name for name, _, _ in scenarios), tuple(int(t) for _, t, _ in scenarios),
                   np.array([w for _, _, w in scenarios], dtype=np.float64),
                   np.stack([c.cpu_s for c in costs]), np.stack([c.gpu_s for c in costs]),
                   np.array([c.transfer_s for c in costs]), int(capacity))

    @property
    def num_layers(self) -> int:
        return self.cpu_s.shape[1]

    @property
    def num_experts(self) -> int:
        return self.cpu_s.shape[2]

    @property
    def num_scenarios(self) -> int:
        return self.cpu_s.shape[0]

    def sides_s(self, resident) -> tuple[np.ndarray, np.ndarray]:
        """(CPU side, GPU side), float64 `[S, L]`, of a resident mask bool `[L, E]`."""
        on_gpu = self.check_mask(resident)
        some_cpu = ~on_gpu.all(axis=-1)
        cpu = self.transfer_s[:, None] * some_cpu[None] + np.where(on_gpu[None], 0.0, self.cpu_s).sum(axis=-1)
        return cpu, np.where(on_gpu[None], self.gpu_s, 0.0).sum(axis=-1)

    def scenario_times_s(self, resident) -> np.ndarray:
        """float64 `[S]`: each scenario's predicted step time (sum over layers) of a resident mask."""
        cpu, gpu = self.sides_s(resident)
        return np.maximum(cpu, gpu).sum(axis=-1)

    def objective_s(self, resident) -> float:
        """The weighted step time the planner minimises."""
        return float(self.weights @ self.scenario_times_s(resident))

    def check_mask(self, resident) -> np.ndarray:
        on_gpu = np.asarray(resident)
        if on_gpu.shape != (self.num_layers, self.num_experts) or on_gpu.dtype != bool:
            raise InputError("resident mask", f"bool [{self.num_layers}, {self.num_experts}]",
                             f"{on_gpu.dtype} {on_gpu.shape}")
        return on_gpu


@dataclass(frozen=True)
class OffloadPlan:
    """The resident experts chosen, and how good they are on the planning problem.

    resident: bool `[L, E]`. value_s: the objective. lower_bound_s: no plan of `capacity` experts does
    better. layer_bound_s: `[L]`, each layer's bound at its expert count. status: "optimal" (the gap is
    closed) or "heuristic". exact_layers: layers CP-SAT solved. notes: what the time limit cut.
    """

    resident: np.ndarray
    value_s: float
    lower_bound_s: float
    layer_value_s: np.ndarray
    layer_bound_s: np.ndarray
    exact_layers: tuple[int, ...] = ()
    wall_s: float = 0.0
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        assert self.resident.dtype == bool and self.resident.ndim == 2
        assert self.lower_bound_s <= self.value_s * (1 + 1e-9) + 1e-15, (self.lower_bound_s, self.value_s)
        self.resident.setflags(write=False)

    @property
    def experts_per_layer(self) -> np.ndarray:
        return self.resident.sum(axis=1)

    @property
    def num_resident(self) -> int:
        return int(self.resident.sum())

    @property
    def gap(self) -> float:
        """`value / bound - 1` (0 when proved optimal)."""
        if self.lower_bound_s <= 0:
            return 0.0 if self.value_s <= 0 else float("inf")
        return max(0.0, self.value_s / self.lower_bound_s - 1)

    @property
    def status(self) -> str:
        return "optimal" if self.gap <= GAP_TOLERANCE else "heuristic"


# ---------------------------------------------------------------------- step 1-2: per-layer tables
@dataclass(frozen=True)
class LayerTables:
    """Per layer: order float `[L, E]` (experts, best resident first), value / bound `[L, E + 1]`
    (the order's first `k` experts resident; the bound of any `k`)."""

    order: np.ndarray
    value: np.ndarray
    bound: np.ndarray


def layer_tables(problem: OffloadProblem) -> LayerTables:
    """Steps 1 and 2 of the module note, for every layer and count at once."""
    w = problem.weights[:, None, None]
    saving = (w * problem.cpu_s).sum(axis=0)                            # [L, E] weighted CPU time
    order = np.argsort(-saving, axis=1, kind="stable")                  # ties: the lower expert id
    cpu = np.take_along_axis(problem.cpu_s, order[None], axis=2)        # [S, L, E] in that order
    gpu = np.take_along_axis(problem.gpu_s, order[None], axis=2)
    zeros = np.zeros(cpu.shape[:2] + (1,))
    cpu_left = cpu.sum(axis=2, keepdims=True) - np.concatenate([zeros, np.cumsum(cpu, axis=2)], axis=2)
    gpu_used = np.concatenate([zeros, np.cumsum(gpu, axis=2)], axis=2)  # [S, L, E + 1]
    e = problem.num_experts
    some_cpu = (np.arange(e + 1) < e)[None, None, :]
    side_a = cpu_left + problem.transfer_s[:, None, None] * some_cpu
    value = (w * np.maximum(side_a, gpu_used)).sum(axis=0)
    cheapest_gpu = np.sort((w * problem.gpu_s).sum(axis=0), axis=1)    # [L, E] weighted GPU time, least first
    gpu_bound = np.concatenate([np.zeros((problem.num_layers, 1)), np.cumsum(cheapest_gpu, axis=1)], axis=1)
    bound = np.minimum(np.maximum((w * side_a).sum(axis=0), gpu_bound), value)
    return LayerTables(order, value, bound)


def mask_of(order: np.ndarray, counts) -> np.ndarray:
    """bool `[L, E]`: the first `counts[l]` experts of each layer's order resident."""
    ranks = np.empty_like(order)
    np.put_along_axis(ranks, order, np.arange(order.shape[1])[None].repeat(order.shape[0], 0), axis=1)
    return ranks < np.asarray(counts)[:, None]


# ---------------------------------------------------------------------- step 4: one layer exactly
@dataclass(frozen=True)
class LayerSolve:
    resident: np.ndarray   # bool [E]
    value_s: float
    bound_s: float
    status: str


def exact_layer(problem: OffloadProblem, layer: int, count: int, time_limit_s: float,
                hint: np.ndarray | None = None) -> LayerSolve:
    """CP-SAT on one layer and expert count (step 4 of the module note)."""
    from ortools.sat.python import cp_model  # OR-Tools is a dependency; imported here as cpsat.py does

    e, s = problem.num_experts, problem.num_scenarios
    if not 0 <= count <= e:
        raise InputError("expert count", f"in [0, {e}]", count)
    w = problem.weights[:, None]
    cpu = np.floor(w * problem.cpu_s[:, layer] * PICOSECONDS).astype(np.int64)      # [S, E] weighted, rounded down
    gpu = np.floor(w * problem.gpu_s[:, layer] * PICOSECONDS).astype(np.int64)
    tau = np.floor(problem.weights * problem.transfer_s * PICOSECONDS).astype(np.int64) * (count < e)
    model = cp_model.CpModel()
    x = [model.NewBoolVar(f"resident_{j}") for j in range(e)]                       # expert j on the GPU
    model.Add(sum(x) == count)                                                       # exactly `count` of them
    top = int(max((tau + cpu.sum(axis=1)).max(), gpu.sum(axis=1).max())) + 1
    t = [model.NewIntVar(0, top, f"layer_time_{i}") for i in range(s)]              # scenario i's weighted time
    for i in range(s):
        model.Add(t[i] >= int(tau[i]) + sum(int(cpu[i, j]) * (1 - x[j]) for j in range(e)))  # >= the CPU side
        model.Add(t[i] >= sum(int(gpu[i, j]) * x[j] for j in range(e)))                     # >= the GPU side
    model.Minimize(sum(t))
    if hint is not None:
        for j in range(e):
            model.AddHint(x[j], bool(hint[j]))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.01, float(time_limit_s))
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    status = stoppable_solve(solver, model)  # Ctrl-C stops it through stop_search (moe_place.interrupts)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return LayerSolve(np.zeros(e, bool), np.inf, 0.0, solver.StatusName(status).lower())
    chosen = np.array([bool(solver.Value(v)) for v in x])
    mask = np.zeros((problem.num_layers, e), dtype=bool)
    mask[layer] = chosen
    cpu_side, gpu_side = problem.sides_s(mask)
    value = float(problem.weights @ np.maximum(cpu_side[:, layer], gpu_side[:, layer]))
    # every coefficient was rounded down, so the rounded objective never exceeds the real one, and
    # CP-SAT's bound on it bounds the real objective too
    bound = float(solver.BestObjectiveBound()) / PICOSECONDS
    return LayerSolve(chosen, value, min(bound, value), "optimal" if status == cp_model.OPTIMAL else "feasible")


# ---------------------------------------------------------------------- the plan
def plan_offload(problem: OffloadProblem, time_limit_s: float = 10.0) -> OffloadPlan:
    """The resident experts of least predicted weighted step time under `problem.capacity` (module note)."""
    start = time.perf_counter()
    tables = layer_tables(problem)
    value, bound = tables.value.copy(), tables.bound.copy()
    layers = range(problem.num_layers)
    capacity = min(problem.capacity, problem.num_layers * problem.num_experts)
    counts, _ = allocate_slots([value[l] for l in layers], capacity)
    resident = mask_of(tables.order, counts)
    exact: set[int] = set()
    notes: list[str] = []
    chosen_sets: dict[tuple[int, int], np.ndarray] = {}
    plan_value = float(sum(value[l, counts[l]] for l in layers))
    may_help = _may_improve(bound, capacity, plan_value)
    open_cells = [(l, k) for l in layers for k in range(problem.num_experts + 1)
                  if value[l, k] > bound[l, k] * (1 + GAP_TOLERANCE) and may_help[l, k]]
    if open_cells and problem.num_experts > EXACT_MAX_EXPERTS:
        notes.append(f"{len({l for l, _ in open_cells})} layers keep a gap: CP-SAT runs only up to "
                     f"{EXACT_MAX_EXPERTS} experts")
    elif open_cells:
        # the chosen counts first, then the other counts with a gap nearest them, while the time lasts
        open_cells.sort(key=lambda cell: (abs(cell[1] - counts[cell[0]]), cell))
        deadline = start + time_limit_s
        for done, (l, k) in enumerate(open_cells):
            left = deadline - time.perf_counter()
            if left <= 0:
                notes.append(f"time limit: {len(open_cells) - done} of {len(open_cells)} (layer, count) pairs with a "
                             "gap not solved exactly")
                break
            hint = mask_of(tables.order[l:l + 1], [k])[0]
            solved = exact_layer(problem, l, k, max(left / (len(open_cells) - done), 0.05), hint=hint)
            exact.add(l)
            bound[l, k] = max(bound[l, k], solved.bound_s)
            if solved.value_s < value[l, k]:
                value[l, k] = solved.value_s
                chosen_sets[(l, k)] = solved.resident
        counts, _ = allocate_slots([value[l] for l in layers], capacity)
        resident = mask_of(tables.order, counts)
        for l in layers:
            if (l, counts[l]) in chosen_sets:
                resident[l] = chosen_sets[(l, counts[l])]
    if (value <= bound * (1 + GAP_TOLERANCE)).all():  # every cell certified: the knapsack over values is exact
        total_bound = float(sum(value[l, counts[l]] for l in layers))
    else:
        _, total_bound = allocate_slots([bound[l] for l in layers], capacity)
    cpu_side, gpu_side = problem.sides_s(resident)
    per_layer = problem.weights @ np.maximum(cpu_side, gpu_side)
    total = float(per_layer.sum())
    layer_bound = np.array([bound[l, counts[l]] for l in layers])
    return OffloadPlan(resident, total, min(float(total_bound), total), per_layer, layer_bound, tuple(sorted(exact)),
                       time.perf_counter() - start, tuple(notes))


def _may_improve(bound: np.ndarray, capacity: int, plan_value: float) -> np.ndarray:
    """bool `[L, E + 1]`: the (layer, count) cells that some allocation of at most `capacity` experts
    could use to beat `plan_value`, by a Lagrangian bound. For any `lam >= 0` and counts summing to at
    most `capacity`, `sum_l bound[l, k_l] >= sum_l min_k (bound[l, k] + lam*k) - lam*capacity`; fixing
    cell (l, k) replaces layer l's minimum by `bound[l, k] + lam*k`. `lam` maximises the bound (a
    concave function of lam, golden-section search)."""
    counts = np.arange(bound.shape[1])

    def dual(lam: float) -> float:
        return float((bound + lam * counts).min(axis=1).sum() - lam * capacity)

    lo, hi = 0.0, float(np.ptp(bound)) + 1e-30
    ratio = (np.sqrt(5) - 1) / 2
    for _ in range(80):
        a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        if dual(a) < dual(b):
            lo = a
        else:
            hi = b
    lam = lo
    shifted = bound + lam * counts
    best = shifted.min(axis=1)
    with_cell = best.sum() - best[:, None] + shifted - lam * capacity
    return with_cell < plan_value * (1 - GAP_TOLERANCE)


def whole_layer_plan(problem: OffloadProblem, gpu_layers: int) -> np.ndarray:
    """bool `[L, E]`: the `gpu_layers` layers whose experts all on the GPU save the most (llama.cpp
    moves whole layers: `-ot`); the others entirely on the CPU. Exact: each layer's saving is its own."""
    if not 0 <= gpu_layers <= problem.num_layers:
        raise InputError("GPU layers", f"in [0, {problem.num_layers}]", gpu_layers)
    none = np.zeros((problem.num_layers, problem.num_experts), dtype=bool)
    cpu_side, gpu_side = problem.sides_s(none)
    on_cpu = problem.weights @ np.maximum(cpu_side, gpu_side)
    cpu_side, gpu_side = problem.sides_s(~none)
    on_gpu = problem.weights @ np.maximum(cpu_side, gpu_side)
    chosen = np.argsort(-(on_cpu - on_gpu), kind="stable")[:gpu_layers]
    none[chosen] = True
    return none
