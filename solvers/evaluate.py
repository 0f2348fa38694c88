"""Per-layer figures of any placement on any loads, under the three split policies.

Split policies (how an expert's dispatches are shared by its replicas, see the glossary):
- `even`: each replica takes `1/logcnt` of its expert's load (what EPLB and the engines assume).
- `local`: our model of SGLang's `static` dispatch. Tokens originate evenly on the `G` GPUs
  (each GPU sends `w[e] / G` of expert `e`); a token whose own GPU holds a replica of `e` uses
  it (split evenly if that GPU holds several), otherwise it is split evenly over all `logcnt[e]`
  replicas. GPU `g` thus serves `w[e]/G * ([g holds e] + c[e,g] * (G - h[e]) / logcnt[e])`,
  with `c[e,g]` replicas of `e` on `g` and `h[e]` GPUs holding `e`. Note what this model implies:
  when no GPU holds two replicas of one expert (`c <= 1`, `h = logcnt`), every holder serves
  exactly `w[e] / logcnt[e]`, the even split; local dispatch only shifts load when sources are
  uneven (not visible in count-level traces) or replicas are co-located (EPLB plans).
- `optimal`: the per-batch split that minimises the busiest GPU, exactly (a linear program per layer
  and batch, solved with OR-Tools GLOP): choose `x[p] >= 0` per slot with
  `sum_{p holds e} x[p] = w[e]`, minimise `max_g sum_{p on g} x[p]`.
- `per-batch`: the same split by the fast method the engines run (`moe_place.split.split_shares`, in
  whole rows; within 0.5% of `optimal` on every layer of the bundled trace, tests/test_split.py).
The per-batch splits (`optimal`, `per-batch`) split each batch (step) on its own counts; a window's GPU
loads are the sums over its steps (`split_gpu_loads`).

Figures per layer: `max_gpu_load` (busiest GPU; with several windows the windows' maxima
combined by the objective: max, mean or quantile), `mean_gpu_load`, `balancedness`
(mean / max, 1 for an idle layer; with several windows the mean of the per-window values),
`lower_bound` (moe_place.solvers.bounds: all its bounds for the even split, the ones that hold
for any split otherwise) and `gap`
(`(max - bound) / max`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from moe_place.errors import InputError
from moe_place.placement import Placement, balance_ratio, even_split_gpu_loads
from moe_place.split import gpu_rows, split_shares
from moe_place.problem import SPLIT_POLICIES, PlacementProblem, combine_windows
from moe_place.solvers.base import require_ortools
from moe_place.solvers.bounds import windows_lower_bound

__all__ = ["LayerReport", "evaluate_placement", "even_gpu_loads", "layer_figures", "local_gpu_loads",
           "model_objectives", "optimal_split", "split_gpu_loads", "window_objective"]


@dataclass(frozen=True)
class LayerReport:
    """The figures of one layer (see the module docstring)."""

    layer: int
    max_gpu_load: float
    mean_gpu_load: float
    balancedness: float
    lower_bound: float
    gap: float

    def to_dict(self) -> dict:
        return asdict(self)


def even_gpu_loads(phy2log: np.ndarray, loads: np.ndarray, num_gpus: int) -> np.ndarray:
    """float64 `[windows, G]`: GPU loads of one layer's plan under the even split.

    phy2log: int `[P]` (colocated replicas allowed); loads: `[windows, E]` or `[E]`.
    """
    loads = np.atleast_2d(np.asarray(loads, dtype=np.float64))
    rows = np.broadcast_to(np.asarray(phy2log, dtype=np.int64), (loads.shape[0], len(phy2log)))
    return even_split_gpu_loads(rows, loads, num_gpus)


def local_gpu_loads(phy2log: np.ndarray, loads: np.ndarray, num_gpus: int) -> np.ndarray:
    """float64 `[windows, G]`: GPU loads of one layer's plan under the local split (see above)."""
    loads = np.atleast_2d(np.asarray(loads, dtype=np.float64))
    experts = loads.shape[1]
    slots = phy2log.size // num_gpus
    gpu = np.arange(phy2log.size) // slots
    copies = np.zeros((num_gpus, experts))
    np.add.at(copies, (gpu, phy2log), 1.0)
    logcnt = copies.sum(axis=0)
    holders = (copies > 0).sum(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        remote = np.where(logcnt > 0, (num_gpus - holders) / np.maximum(logcnt, 1), 0.0)
    weight = (copies > 0) + copies * remote  # [G, E]: multiples of w[e] / G served by GPU g
    return loads @ weight.T / num_gpus


def optimal_split(phy2log: np.ndarray, load: np.ndarray, num_gpus: int) -> tuple[float, np.ndarray]:
    """(the least busiest-GPU load over all splits, a split that reaches it: float64 `[P]`), exactly: the
    LP of the module docstring on the slots of one layer and batch (`phy2log [P]`, `load [E]`)."""
    require_ortools("--split optimal")
    from ortools.linear_solver import pywraplp  # OR-Tools is optional: see solvers.base

    load = np.asarray(load, dtype=np.float64)
    total = float(load.sum())
    if total <= 0:
        return 0.0, np.zeros(phy2log.size)
    scale = total  # solve in units of the layer's total load: tolerances stay relative
    slots = phy2log.size // num_gpus
    solver = pywraplp.Solver.CreateSolver("GLOP")
    busiest = solver.NumVar(0.0, solver.infinity(), "busiest")
    share = [solver.NumVar(0.0, solver.infinity(), f"x{p}") for p in range(phy2log.size)]
    by_expert: dict[int, list] = {}
    for p, expert in enumerate(phy2log.tolist()):
        by_expert.setdefault(expert, []).append(share[p])
    for expert, parts in by_expert.items():  # every dispatch is served by some replica
        solver.Add(solver.Sum(parts) == float(load[expert]) / scale)
    for g in range(num_gpus):  # no GPU above the busiest
        solver.Add(solver.Sum(share[g * slots:(g + 1) * slots]) <= busiest)
    solver.Minimize(busiest)
    status = solver.Solve()
    assert status == pywraplp.Solver.OPTIMAL, status
    return float(busiest.solution_value()) * scale, np.array([x.solution_value() * scale for x in share])


def split_gpu_loads(phy2log: np.ndarray, step_loads: np.ndarray, num_gpus: int, split: str,
                    window_of_step: np.ndarray | None = None, windows: int = 1) -> np.ndarray:
    """float64 `[windows, G]`: GPU loads of one layer's plan when each step is split on its own counts.

    step_loads: `[steps, E]` dispatches per step; split: `per-batch` (`split_shares`, whole rows) or
    `optimal` (the LP, real numbers); window_of_step: int `[steps]` the window each step belongs to
    (default: all in window 0)."""
    step_loads = np.atleast_2d(np.asarray(step_loads))
    if split == "per-batch":
        per_step = gpu_rows(split_shares(np.asarray(phy2log, dtype=np.int64), np.rint(step_loads).astype(np.int64),
                                         num_gpus), num_gpus).astype(np.float64)
    elif split == "optimal":
        per_step = np.array([gpu_rows(optimal_split(phy2log, row, num_gpus)[1], num_gpus) for row in step_loads])
    else:
        raise InputError("split", "per-batch or optimal (a split of each step)", split)
    which = np.zeros(len(step_loads), dtype=np.int64) if window_of_step is None else np.asarray(window_of_step)
    out = np.zeros((windows, num_gpus))
    np.add.at(out, which, per_step)
    return out


def layer_figures(phy2log: np.ndarray, loads: np.ndarray, num_gpus: int, split: str = "even",
                  objective: str = "max", quantile: float = 0.9, layer: int = 0,
                  lower_bound: float | None = None, gpu_loads: np.ndarray | None = None) -> LayerReport:
    """The figures of one layer. phy2log: int `[P]`; loads: `[windows, E]` or `[E]`.

    gpu_loads: float `[windows, G]` the GPU loads of a per-batch split (`split_gpu_loads`: each step split on
    its own counts); without it, `optimal` and `per-batch` split each window's summed loads."""
    if split not in SPLIT_POLICIES:
        raise InputError("split", f"one of {', '.join(SPLIT_POLICIES)}", split)
    loads = np.atleast_2d(np.asarray(loads, dtype=np.float64))
    mean = loads.sum(axis=1) / num_gpus  # [windows]
    if gpu_loads is not None:
        busiest = np.asarray(gpu_loads, dtype=np.float64).max(axis=1)
    elif split in ("optimal", "per-batch"):
        busiest = split_gpu_loads(phy2log, loads, num_gpus, split, np.arange(len(loads)), len(loads)).max(axis=1)
    else:
        per_gpu = (even_gpu_loads if split == "even" else local_gpu_loads)(phy2log, loads, num_gpus)
        busiest = per_gpu.max(axis=1)
    balance = balance_ratio(mean, busiest)
    top = combine_windows(busiest, objective, quantile)
    if lower_bound is None:
        lower_bound = windows_lower_bound(loads, num_gpus, phy2log.size, objective, quantile, even=split == "even")
    lower_bound = min(lower_bound, top) if split == "optimal" else lower_bound  # LP tolerance
    gap = max(0.0, (top - lower_bound) / top) if top > 0 else 0.0
    return LayerReport(layer, top, float(mean.mean()), float(balance.mean()), float(lower_bound), gap)


def evaluate_placement(placement: Placement, loads: np.ndarray, split: str = "even", objective: str = "max",
                       quantile: float = 0.9, layer_ids: tuple[int, ...] | None = None,
                       step_loads: np.ndarray | None = None, window_of_step: np.ndarray | None = None
                       ) -> list[LayerReport]:
    """Figures of every layer of `placement` on `loads` `[layers, E]` or `[windows, layers, E]`.

    step_loads: `[steps, layers, E]` the steps the windows sum, and window_of_step int `[steps]` which window
    each belongs to: with a per-batch split (`optimal`, `per-batch`) each step is split on its own counts."""
    loads = np.asarray(loads, dtype=np.float64)
    if loads.ndim == 2:
        loads = loads[None]
    if loads.ndim != 3 or loads.shape[1:] != (placement.num_layers, placement.num_experts):
        raise InputError("loads", f"[windows, {placement.num_layers} layers, {placement.num_experts} experts]",
                         f"shape {loads.shape}")
    ids = layer_ids or tuple(range(placement.num_layers))
    per_batch = step_loads is not None and split in ("optimal", "per-batch")
    return [layer_figures(placement.phy2log[i], loads[:, i, :], placement.num_gpus, split, objective, quantile,
                          ids[i], gpu_loads=split_gpu_loads(placement.phy2log[i], step_loads[:, i, :],
                                                            placement.num_gpus, split, window_of_step, len(loads))
                          if per_batch else None)
            for i in range(placement.num_layers)]


def window_objective(problem: PlacementProblem, layer: int, phy2log: np.ndarray) -> float:
    """The objective solvers minimise: the even-split busiest load of one layer, windows combined."""
    busiest = even_gpu_loads(np.asarray(phy2log), problem.layer_loads(layer), problem.num_gpus).max(axis=1)
    return problem.aggregate(busiest)


def model_objectives(problem: PlacementProblem, phy2log: np.ndarray) -> np.ndarray:
    """float64 `[layers]`: `window_objective` of every layer of a whole-model plan int `[layers, P]`,
    in one vectorised pass."""
    windows, layers, experts = problem.loads.shape
    rows = np.broadcast_to(np.asarray(phy2log, dtype=np.int64), (windows, layers, problem.num_physical))
    busiest = even_split_gpu_loads(rows.reshape(windows * layers, -1), problem.loads.reshape(windows * layers, experts),
                                   problem.num_gpus).max(axis=1).reshape(windows, layers)
    if windows == 1:
        return busiest[0]
    return np.array([problem.aggregate(busiest[:, i]) for i in range(layers)])
