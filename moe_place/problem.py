"""The placement problem, one instance per model: what every solver receives.

Per layer: loads of the `E` logical experts (one vector, or several windows/scenarios), `G` GPUs
on `N` nodes, `P` physical experts (slots) per layer with `P/G` on each GPU, the split policy,
an optional current placement (for migration-aware re-plans) and its migration limits.
The objective is the busiest GPU's load per layer (docs/MODEL.md, "The placement problem"):

    T = max_g sum_{replicas on g} w[e] / r[e]          (even split)

With several windows, the objective aggregates the per-window maxima (`max`, `mean` or a
`quantile`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_place.errors import InputError
from moe_place.placement import Placement, SlotGrid

__all__ = ["PlacementProblem", "combine_windows"]

SPLIT_POLICIES = ("even", "local", "optimal", "per-batch")
WINDOW_OBJECTIVES = ("max", "mean", "quantile")


def combine_windows(values: np.ndarray, objective: str, quantile: float = 0.9) -> float:
    """One value from per-window values `[windows]`: their max, mean or `quantile` (`objective`)."""
    values = np.asarray(values, dtype=np.float64)
    if objective == "max":
        return float(values.max())
    if objective == "mean":
        return float(values.mean())
    return float(np.quantile(values, quantile))


@dataclass(frozen=True)
class PlacementProblem(SlotGrid):
    """A whole-model placement problem.

    loads: float64 `[windows, layers, E]`, non-negative (dispatches per logical expert).
    num_gpus: `G`, the EP size over all nodes. num_nodes: `N`, `G % N == 0`.
    num_physical: `P`, slots per layer, `E <= P <= E*G`, `P % G == 0` (engine-compatible mode).
    num_groups: expert groups for EPLB's hierarchical policy (None: global policy).
    split: one of `SPLIT_POLICIES`: how the plan is reported (the solvers optimise the even split).
    window_objective / quantile: how per-window maxima combine when there are several windows.
    expert_bytes: bytes of one expert's weights (migration cost and memory budgets).
    current: the placement in use now, or None.
    max_moved_slots: cap on slots whose expert changes per layer (None: no cap).
    move_cost_weight: load units charged per moved slot in the objective (0: moves are free).
    layer_ids: model layer index of each layer (reporting only).
    seed: for every randomised choice; same problem + seed -> same plan.
    allow_colocated: plans may put two replicas of one expert on one GPU, as DeepSeek EPLB does
        (then EPLB's plan is a candidate on every layer, so no solver does worse than `eplb`).
    """

    loads: np.ndarray
    num_gpus: int
    num_physical: int
    num_nodes: int = 1
    num_groups: int | None = None
    split: str = "even"
    window_objective: str = "max"
    quantile: float = 0.9
    expert_bytes: int | None = None
    current: Placement | None = None
    max_moved_slots: int | None = None
    move_cost_weight: float = 0.0
    layer_ids: tuple[int, ...] = ()
    seed: int = 0
    allow_colocated: bool = False

    def __post_init__(self) -> None:
        loads = np.asarray(self.loads, dtype=np.float64)
        if loads.ndim == 2:
            loads = loads[None]
        if loads.ndim != 3 or 0 in loads.shape:
            raise InputError("loads", "a non-empty array [windows, layers, experts]", f"shape {loads.shape}")
        if not np.isfinite(loads).all():
            raise InputError("loads", "finite values", "NaN or inf")
        if (loads < 0).any():
            raise InputError("loads", "values >= 0", float(loads.min()))
        loads.setflags(write=False)
        object.__setattr__(self, "loads", loads)
        experts = loads.shape[2]
        if self.num_gpus < 1:
            raise InputError("num_gpus", "an integer >= 1", self.num_gpus)
        if self.num_nodes < 1 or self.num_gpus % self.num_nodes:
            raise InputError("num_nodes", f"a divisor of num_gpus={self.num_gpus}", self.num_nodes)
        if self.num_physical < experts:
            raise InputError("num_physical", f"at least one slot per logical expert (>= {experts})", self.num_physical)
        if self.num_physical % self.num_gpus:
            raise InputError("num_physical", f"a multiple of num_gpus={self.num_gpus} (equal slots per GPU)",
                             self.num_physical)
        if self.num_physical > experts * self.num_gpus:
            raise InputError("num_physical", f"at most {experts} slots per GPU (one per expert: no GPU may hold "
                             f"two replicas of one expert)", f"{self.num_physical // self.num_gpus} per GPU")
        if self.num_groups is not None and (self.num_groups < 1 or experts % self.num_groups):
            raise InputError("num_groups", f"a divisor of the {experts} experts", self.num_groups)
        if self.split not in SPLIT_POLICIES:
            raise InputError("split", f"one of {', '.join(SPLIT_POLICIES)}", self.split)
        if self.window_objective not in WINDOW_OBJECTIVES:
            raise InputError("window_objective", f"one of {', '.join(WINDOW_OBJECTIVES)}", self.window_objective)
        if not 0.0 <= self.quantile <= 1.0:
            raise InputError("quantile", "a value in [0, 1]", self.quantile)
        if self.layer_ids and len(self.layer_ids) != self.num_layers:
            raise InputError("layer_ids", f"{self.num_layers} ids", len(self.layer_ids))
        if self.current is not None:
            cur = self.current
            if (cur.num_layers, cur.num_physical, cur.num_experts, cur.num_gpus) != (
                    self.num_layers, self.num_physical, experts, self.num_gpus):
                raise InputError("current placement", f"{self.num_layers} layers x {self.num_physical} slots, "
                                 f"{experts} experts, {self.num_gpus} GPUs",
                                 f"{cur.num_layers} x {cur.num_physical}, {cur.num_experts}, "
                                 f"{cur.num_gpus}")
        if self.max_moved_slots is not None and self.max_moved_slots < 0:
            raise InputError("max_moved_slots", "an integer >= 0", self.max_moved_slots)
        if self.move_cost_weight < 0:
            raise InputError("move_cost_weight", "a value >= 0", self.move_cost_weight)

    # ------------------------------------------------------------------ shape
    @property
    def num_windows(self) -> int:
        return self.loads.shape[0]

    @property
    def num_layers(self) -> int:
        return self.loads.shape[1]

    @property
    def num_experts(self) -> int:
        return self.loads.shape[2]

    def layer_id(self, layer: int) -> int:
        return self.layer_ids[layer] if self.layer_ids else layer

    def layer_loads(self, layer: int) -> np.ndarray:
        """float64 `[windows, E]`: the loads of one layer."""
        return self.loads[:, layer, :]

    def planning_loads(self) -> np.ndarray:
        """float64 `[layers, E]`: the loads summed over windows (what single-vector solvers plan on)."""
        return self.loads.sum(axis=0)

    def current_row(self, layer: int) -> np.ndarray | None:
        """int64 `[P]`: current phy2log of one layer, or None."""
        return None if self.current is None else self.current.phy2log[layer]

    def aggregate(self, per_window_max: np.ndarray) -> float:
        """Combine a layer's busiest-GPU load per window `[windows]` into one objective value."""
        return combine_windows(per_window_max, self.window_objective, self.quantile)

    def placement(self, phy2log: np.ndarray) -> Placement:
        """Wrap solver output `[layers, P]` in a validated Placement of this problem's shape."""
        return Placement(np.asarray(phy2log), self.num_experts, self.num_gpus, self.num_nodes)
