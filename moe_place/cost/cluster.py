"""What a step and a rebalance cost on a given cluster: the cost model, vectorised for replay.

Expert time of one layer is the busiest GPU's `max(F/C, W/B)` (formula 1) with the tile
traffic of formula 5 and padding of formula 4: `moe_place.cost.gemm.expert_times_s` over every
GPU and layer at once. Rows of a slot are its expert's dispatches split evenly over the
replicas, rounded up to whole rows.

A rebalance is priced by the migration model `moe_place.cost.migration`: one copy per slot whose
expert changes, from the cheapest holder in the map in use; copy time `serial` (formula 7) or
`parallel`; and what serving pays for it, `stall` (the copy time) or `async` (the copies run
beside serving and delay dispatch/combine where they share a link; the switch waits for them).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from moe_place.cost.gemm import expert_times_s
from moe_place.cost.hardware import GpuSpec, builtin_catalog
from moe_place.cost.migration import COPY_SCHEDULES, MIGRATION_MODELS, Copy, Migration, MigrationCharge
from moe_place.cost.models import ExpertShape, get_model
from moe_place.cost.topology import Topology, build_cluster
from moe_place.cost.units import gbit_per_s
from moe_place.errors import InputError
from moe_place.placement import Placement, even_split_slot_loads

DEFAULT_ALPHA_S = 5e-6
DEFAULT_BLOCK_M = 64
DEFAULT_BLOCK_N = 128

__all__ = ["COPY_SCHEDULES", "MIGRATION_MODELS", "Copy", "ReplayCost", "cluster_cost", "cluster_topology"]


@dataclass(frozen=True)
class ReplayCost:
    """The cost model of one cluster and model, for per-step expert time and rebalance copies.

    model: the expert shape (`W_e`, FLOPs per row). topology: the cluster (G GPUs).
    block_m / block_n: GEMM tile sizes (formulas 4 and 5). alpha_s: fixed cost per copy.
    copy_schedule: "serial" or "parallel"; migration: "stall" or "async" (`moe_place.cost.migration`).
    """

    model: ExpertShape
    topology: Topology
    block_m: int = DEFAULT_BLOCK_M
    block_n: int = DEFAULT_BLOCK_N
    alpha_s: float = DEFAULT_ALPHA_S
    copy_schedule: str = "serial"
    migration: str = "stall"

    def __post_init__(self) -> None:
        if self.block_m < 1 or self.block_n < 1:
            raise InputError("block sizes", "integers >= 1", (self.block_m, self.block_n))
        self.moves  # validates the schedule, the migration model and alpha

    @cached_property
    def moves(self) -> Migration:
        """The migration model of this cluster (copies, their time, what serving pays)."""
        return Migration(self.topology, self.model.expert_bytes, self.model.row_bytes, self.alpha_s,
                         self.copy_schedule, self.migration)

    @property
    def gpu(self) -> GpuSpec:
        return self.topology.gpu

    @property
    def num_gpus(self) -> int:
        return self.topology.num_gpus

    @property
    def expert_bytes(self) -> int:
        return self.model.expert_bytes

    # ------------------------------------------------------------------ expert time
    def gpu_times_s(self, slot_rows: np.ndarray) -> np.ndarray:
        """float64 `[..., G]`: each GPU's expert time for rows per slot `[..., G, S]`.

        Rows are rounded up to whole rows; an empty slot costs nothing (no tile, no weight read).
        """
        rows = np.ceil(np.asarray(slot_rows, dtype=np.float64) - 1e-9).clip(min=0)
        m = self.model
        return expert_times_s(rows, m.hidden, m.intermediate, m.dtype_bytes, self.gpu.flops_per_s,
                              self.gpu.memory_bytes_per_s, weights="tiles", block_m=self.block_m,
                              block_n=self.block_n, matrices=m.matrices)

    def layer_times_s(self, placement: Placement, expert_load: np.ndarray) -> np.ndarray:
        """float64 `[layers]`: busiest-GPU expert time of each layer for `expert_load [layers, E]`."""
        slots = placement.slot_loads(expert_load).reshape(placement.num_layers, placement.num_gpus, -1)
        return self.gpu_times_s(slots).max(axis=-1)

    def rows_times_s(self, phy2log: np.ndarray, expert_load: np.ndarray, num_gpus: int) -> np.ndarray:
        """float64 `[rows]`: `layer_times_s` of map rows `phy2log [rows, P]` under loads `expert_load
        [rows, E]`, unchecked (`even_split_slot_loads`): for a caller whose maps are valid."""
        slots = even_split_slot_loads(phy2log, expert_load).reshape(len(phy2log), num_gpus, -1)
        return self.gpu_times_s(slots).max(axis=-1)

    def step_time_s(self, placement: Placement, expert_load: np.ndarray) -> float:
        """Expert-layer time of one step: the sum over layers of the busiest GPU's time."""
        return float(self.layer_times_s(placement, expert_load).sum())

    # ------------------------------------------------------------------ migration
    def copies(self, old: Placement, new: Placement, layers: np.ndarray | None = None) -> list[Copy]:
        """The copies that turn `old` into `new` (`moe_place.cost.migration.plan_copies`)."""
        return self.moves.copies(old, new, layers)

    def migration_time_s(self, copies: list[Copy]) -> float:
        """Seconds the copies take under `copy_schedule`."""
        return self.moves.copy_time_s(copies)

    def charge(self, copies: list[Copy], placement: Placement, expert_load: np.ndarray) -> MigrationCharge:
        """What serving pays for `copies` while `placement` serves steps of `expert_load [layers, E]`."""
        moves = self.moves
        if moves.model == "stall":
            return moves.charge(copies)
        return moves.charge(copies, self.step_time_s(placement, expert_load),
                            moves.comm_time_s(placement, expert_load))


def cluster_topology(num_gpus: int, num_nodes: int = 1, hardware: str = "H100",
                     nic_gbit_per_s: float = 400.0) -> Topology:
    """`num_nodes` servers of `num_gpus / num_nodes` GPUs of part `hardware` (NVLink and PCIe: the part's),
    joined by one NIC of `nic_gbit_per_s` per GPU: the cluster every command assumes unless told otherwise."""
    if num_nodes < 1 or num_gpus % num_nodes:
        raise InputError("--nodes", f"a divisor of --gpus {num_gpus}", num_nodes)
    return build_cluster(builtin_catalog().gpu(hardware), num_nodes, num_gpus // num_nodes,
                         nic_bytes_per_s=gbit_per_s(nic_gbit_per_s) if num_nodes > 1 else 0.0)


def cluster_cost(num_gpus: int, num_nodes: int = 1, hardware: str = "H100", model: str | ExpertShape = "Qwen3-30B-A3B",
                 nic_gbit_per_s: float = 400.0, copy_schedule: str = "serial", alpha_s: float = DEFAULT_ALPHA_S,
                 block_m: int = DEFAULT_BLOCK_M, migration: str = "stall") -> ReplayCost:
    """A `ReplayCost` for `num_nodes` servers of `num_gpus / num_nodes` GPUs of part `hardware`."""
    topology = cluster_topology(num_gpus, num_nodes, hardware, nic_gbit_per_s)
    shape = get_model(model) if isinstance(model, str) else model
    return ReplayCost(shape, topology, block_m=block_m, alpha_s=alpha_s, copy_schedule=copy_schedule,
                      migration=migration)
