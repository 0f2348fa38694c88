"""Budget mode: how many expert slots each layer gets under one memory budget per GPU.

Engines give every layer the same number of physical experts. When the budget is bytes rather
than slots, a layer whose load is skewed gains more from an extra replica than a flat one, so
spending the same memory unevenly shortens the sum of the layers' waits (row C11 of docs/MODEL.md:
layer times add up along the forward pass).

Given loads `w[l, e]` of `L` layers, `G` GPUs and `expert_bytes` per expert copy, each layer
gets `S[l]` slots on every GPU (`P[l] = G * S[l]`, so GPUs stay equal within a layer), subject to

    sum_l S[l] * expert_bytes <= gpu_budget_bytes        (the experts' memory on one GPU)
    ceil(E / G) <= S[l] <= E                               (every expert once; one copy per GPU)

minimising `sum_l T[l](S[l])`, where `T[l](S)` is the busiest-GPU load of the plan a layer
solver (default: `fast`) makes for layer `l` with `S` slots per GPU. The choice over layers is a
multiple-choice knapsack, solved exactly by dynamic programming over the spare slots
(`allocate_slots`); the table `T` is heuristic, so the allocation is optimal for the plans the
layer solver finds, not for the true optima, and each layer is priced only up to the slot count
where its plan comes within `tolerance` (0.1%) of its average load, which no count can beat. The report compares with the same budget spread
evenly (every layer `min(E, budget_slots // L)` slots, as engines would).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from moe_place.errors import InfeasibleError, InputError
from moe_place.solvers.evaluate import even_gpu_loads
from moe_place.solvers.fast import fast_layer

__all__ = ["BudgetPlan", "allocate_budget", "allocate_slots"]

LayerPlanner = Callable[[np.ndarray, int, int], np.ndarray]
"""`(loads [E], num_gpus, slots_per_gpu) -> phy2log [G*S]`: one layer's plan for a slot count."""


@dataclass(frozen=True)
class BudgetPlan:
    """Per-layer slot counts chosen under a per-GPU byte budget, and what they gain.

    slots_per_gpu: `S[l]` per layer. phy2log: per layer an int64 `[G * S[l]]` plan (lengths differ).
    max_load: busiest-GPU load of each layer's plan. even_slots_per_gpu / even_max_load: the same
    budget spread evenly (the uniform `R = G * even_slots_per_gpu - E` on every layer). used_bytes:
    `sum S[l] * expert_bytes` (per GPU); even_used_bytes: the even spread's; freed_bytes: what the plan
    frees per GPU against it (negative: it uses that much more of the budget).
    """

    num_gpus: int
    num_experts: int
    expert_bytes: int
    gpu_budget_bytes: int
    slots_per_gpu: tuple[int, ...]
    phy2log: tuple[np.ndarray, ...]
    max_load: tuple[float, ...]
    even_slots_per_gpu: int
    even_max_load: tuple[float, ...]

    def __post_init__(self) -> None:
        layers = len(self.slots_per_gpu)
        assert len(self.phy2log) == layers == len(self.max_load) == len(self.even_max_load)
        for row, slots in zip(self.phy2log, self.slots_per_gpu):
            assert row.shape == (self.num_gpus * slots,), (row.shape, slots)
        assert self.used_bytes <= self.gpu_budget_bytes, (self.used_bytes, self.gpu_budget_bytes)

    @property
    def num_layers(self) -> int:
        return len(self.slots_per_gpu)

    @property
    def used_bytes(self) -> int:
        return sum(self.slots_per_gpu) * self.expert_bytes

    @property
    def even_used_bytes(self) -> int:
        return self.even_slots_per_gpu * self.num_layers * self.expert_bytes

    @property
    def freed_bytes(self) -> int:
        return self.even_used_bytes - self.used_bytes

    @property
    def even_redundant(self) -> int:
        """The uniform `R` of the even spread: redundant experts per layer."""
        return self.num_gpus * self.even_slots_per_gpu - self.num_experts

    @property
    def total_max_load(self) -> float:
        """Sum over layers of the busiest-GPU load (layer times add up)."""
        return float(sum(self.max_load))

    @property
    def even_total_max_load(self) -> float:
        return float(sum(self.even_max_load))

    @property
    def gain(self) -> float:
        """Relative drop of the summed busiest loads vs the even spread (0.05: 5% shorter)."""
        even = self.even_total_max_load
        return (even - self.total_max_load) / even if even > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "num_gpus": self.num_gpus, "num_logical_experts": self.num_experts,
            "expert_bytes": self.expert_bytes, "gpu_budget_bytes": self.gpu_budget_bytes,
            "used_bytes": self.used_bytes, "slots_per_gpu": list(self.slots_per_gpu),
            "num_physical": [self.num_gpus * s for s in self.slots_per_gpu],
            "phy2log": [row.tolist() for row in self.phy2log], "max_load": list(self.max_load),
            "even_slots_per_gpu": self.even_slots_per_gpu, "even_max_load": list(self.even_max_load),
            "even_redundant": self.even_redundant, "even_used_bytes": self.even_used_bytes,
            "freed_bytes": self.freed_bytes,
            "total_max_load": self.total_max_load, "even_total_max_load": self.even_total_max_load,
            "gain": self.gain,
        }


def allocate_slots(cost: list[np.ndarray], budget: int) -> tuple[list[int], float]:
    """Exact multiple-choice knapsack: one option per layer, option `k` costs `k` units.

    cost: per layer a float array `[options]`, `cost[l][k]` = value of giving layer `l` `k`
    extra units (k = 0 .. len - 1). budget: units available in total (>= 0).
    Returns `(choice per layer, total cost)` minimising the summed cost with
    `sum choice <= budget`; among equal totals the fewest units are used.
    DP over (layers x units): `best[b]` = least cost of the layers so far using exactly `b` units.
    """
    if budget < 0:
        raise InputError("budget", "at least 0 spare units", budget)
    best = np.zeros(1)                 # before any layer: 0 units used, cost 0
    picks: list[np.ndarray] = []       # per layer, the option chosen for each units-used total
    for options in cost:
        options = np.asarray(options, dtype=np.float64)
        width = min(budget, len(best) - 1 + len(options) - 1) + 1
        new = np.full(width, np.inf)
        pick = np.zeros(width, dtype=np.int64)
        for k, value in enumerate(options):  # layer takes k units
            span = min(len(best), width - k)
            if span <= 0:
                break
            candidate = best[:span] + value
            better = candidate < new[k:k + span]
            new[k:k + span] = np.where(better, candidate, new[k:k + span])
            pick[k:k + span] = np.where(better, k, pick[k:k + span])
        best = new
        picks.append(pick)
    used = int(np.argmin(best))        # first minimum: the fewest units among the best
    total = float(best[used])
    choice = []
    for pick in reversed(picks):
        k = int(pick[used])
        choice.append(k)
        used -= k
    return choice[::-1], total


def allocate_budget(loads: np.ndarray, num_gpus: int, expert_bytes: int, gpu_budget_bytes: int,
                    max_slots_per_gpu: int | None = None, planner: LayerPlanner | None = None,
                    tolerance: float = 1e-3) -> BudgetPlan:
    """Choose each layer's slots per GPU under `gpu_budget_bytes` (module docstring).

    loads: float `[layers, E]` (e.g. `PlacementProblem.planning_loads()`).
    expert_bytes: bytes of one expert copy; gpu_budget_bytes: bytes one GPU gives to the experts
    of all layers together. max_slots_per_gpu: optional cap on any layer's slots per GPU.
    planner: the layer solver that prices each slot count (default: `fast`).
    tolerance: a layer's slot counts are priced upwards until its plan is within this fraction
    of its average load `sum(w)/G`, a bound for every slot count: more slots could lower that
    layer by at most this fraction, and pricing them all (up to E per GPU) would be slow.
    Raises InputError for bad arguments, InfeasibleError when the budget cannot hold one copy
    of every expert in every layer.
    """
    loads = np.asarray(loads, dtype=np.float64)
    if loads.ndim != 2 or 0 in loads.shape or not np.isfinite(loads).all() or (loads < 0).any():
        raise InputError("loads", "finite values >= 0 of shape [layers, experts]", f"shape {loads.shape}")
    layers, experts = loads.shape
    if num_gpus < 1:
        raise InputError("num_gpus", "an integer >= 1", num_gpus)
    if expert_bytes < 1:
        raise InputError("expert_bytes", "a positive number of bytes", expert_bytes)
    if gpu_budget_bytes < 0:
        raise InputError("expert memory budget", "a non-negative number of bytes", gpu_budget_bytes)
    if not 0 <= tolerance < 1:
        raise InputError("tolerance", "a fraction in [0, 1)", tolerance)
    least = math.ceil(experts / num_gpus)
    budget_slots = gpu_budget_bytes // expert_bytes
    if budget_slots < layers * least:
        raise InfeasibleError(
            f"an expert memory budget of {gpu_budget_bytes} bytes per GPU holds {budget_slots} expert copies "
            f"({expert_bytes} bytes each), but {layers} layers x {experts} experts on {num_gpus} GPUs need at "
            f"least {layers * least} per GPU ({least} per layer, one copy of each expert); "
            f"give at least {layers * least * expert_bytes} bytes")
    most = min(experts, budget_slots - (layers - 1) * least)  # never more than one copy per GPU
    if max_slots_per_gpu is not None:
        if max_slots_per_gpu < least:
            raise InputError("max_slots_per_gpu", f"at least {least} (one copy of each expert)", max_slots_per_gpu)
        most = min(most, max_slots_per_gpu)
    planner = planner or _fast_planner

    # Price the slot counts of every layer with the layer solver, fewest first, until its plan
    # is within `tolerance` of the average load sum(w)/G (a bound for every slot count).
    rows: list[list[np.ndarray]] = []
    cost: list[np.ndarray] = []
    for layer in range(layers):
        average = loads[layer].sum() / num_gpus
        layer_rows, layer_cost = [], []
        for slots in range(least, most + 1):
            row = np.asarray(planner(loads[layer], num_gpus, slots), dtype=np.int64)
            layer_rows.append(row)
            layer_cost.append(_busiest(row, loads[layer], num_gpus))
            if layer_cost[-1] <= average * (1 + tolerance):
                break
        rows.append(layer_rows)
        cost.append(np.array(layer_cost))

    choice, _ = allocate_slots(cost, budget_slots - layers * least)
    even = min(most, budget_slots // layers)
    even_cost = [float(c[min(even - least, len(c) - 1)]) for c in cost]  # past a layer's last price: the same
    return BudgetPlan(
        num_gpus=num_gpus, num_experts=experts, expert_bytes=int(expert_bytes),
        gpu_budget_bytes=int(gpu_budget_bytes),
        slots_per_gpu=tuple(least + k for k in choice),
        phy2log=tuple(rows[layer][k] for layer, k in enumerate(choice)),
        max_load=tuple(float(cost[layer][k]) for layer, k in enumerate(choice)),
        even_slots_per_gpu=even,
        even_max_load=tuple(even_cost),
    )


def _busiest(phy2log: np.ndarray, loads: np.ndarray, num_gpus: int) -> float:
    return float(even_gpu_loads(phy2log, loads, num_gpus).max())


def _fast_planner(loads: np.ndarray, num_gpus: int, slots_per_gpu: int) -> np.ndarray:
    return fast_layer(loads, num_gpus, num_gpus * slots_per_gpu)
