"""What a step and a rebalance cost on a given cluster: the cost model, vectorised for replay.

A layer takes dispatch + the busiest GPU's expert time + combine (docs/MODEL.md, "One model"). Expert
time is the busiest GPU's calibrated grouped-GEMM time (formula 11, with the padding of formula 4 and
the tile traffic of formula 5; the GPU's `gemm_profile()`): `moe_place.cost.gemm.expert_times_s` over
every GPU and layer at once. Rows of a slot are its expert's dispatches split over the replicas as the
replica choice says, rounded up to whole rows. Dispatch and combine are those the GPUs' rows are
expected to move (`moe_place.cost.expected_traffic`, DeepEP's routing): a count-level step does not
say which token chose which experts.

A rebalance is priced by the migration model `moe_place.cost.migration`: one copy per slot whose
expert changes, from the cheapest holder in the map in use; copy time `serial` (formula 7) or
`parallel`; and what serving pays for it, `stall` (the copy time) or `async` (the copies run
beside serving and delay dispatch/combine where they share a link; the switch waits for them).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from moe_place.cost.expected_traffic import expected_phase_times_s
from moe_place.cost.gemm import DEFAULT_WEIGHTS, expert_times_s
from moe_place.cost.hardware import DEFAULT_GPU, GpuSpec, builtin_catalog
from moe_place.cost.migration import COPY_SCHEDULES, MIGRATION_MODELS, Copy, Migration, MigrationCharge
from moe_place.cost.models import DEFAULT_MODEL, ExpertShape, get_model
from moe_place.cost.replicas import DEFAULT_SOLVE_S, SPLIT_OFF_CHOICES, slot_rows, split_overhead_s
from moe_place.cost.topology import Topology, build_cluster
from moe_place.cost.units import gbit_per_s
from moe_place.errors import InputError
from moe_place.placement import Placement, even_split_slot_loads
from moe_place.split import MAX_SWEEPS

DEFAULT_ALPHA_S = 5e-6
DEFAULT_BLOCK_M = 64
DEFAULT_BLOCK_N = 128
DEFAULT_NIC_GBIT = 400.0   # one 400 Gbit/s NIC per GPU (ConnectX-7), the H100 clusters' usual

__all__ = ["COPY_SCHEDULES", "MIGRATION_MODELS", "Copy", "ReplayCost", "cluster_cost", "cluster_topology"]


@dataclass(frozen=True)
class ReplayCost:
    """The cost model of one cluster and model, for per-step expert time and rebalance copies.

    model: the expert shape (`W_e`, FLOPs per row). topology: the cluster (G GPUs).
    block_m / block_n: GEMM tile sizes (formulas 4 and 5). alpha_s: fixed cost per copy.
    weights: the expert time, `moe_place.cost.gemm`'s mode (default formula 11; "tiles" is formula 5, row C9's).
    copy_schedule: "serial" or "parallel"; migration: "stall" or "async" (`moe_place.cost.migration`).
    replica_choice: how serving sends an expert's rows to its replicas (`moe_place.cost.replicas`: `even`,
    the engines' own `vllm`, `sglang-static`, `sglang-dynamic`); `rows_times_s`, what the rule prices its
    plans with, is always the even split. split_solve_s: the per-batch split's solve per layer;
    split_allreduce_s: its all-reduce of the counts (None: NCCL's latency model on the topology).
    """

    model: ExpertShape
    topology: Topology
    block_m: int = DEFAULT_BLOCK_M
    block_n: int = DEFAULT_BLOCK_N
    alpha_s: float = DEFAULT_ALPHA_S
    copy_schedule: str = "serial"
    migration: str = "stall"
    weights: str = DEFAULT_WEIGHTS
    replica_choice: str = "even"
    split_solve_s: float = DEFAULT_SOLVE_S
    split_allreduce_s: float | None = None

    def __post_init__(self) -> None:
        if self.block_m < 1 or self.block_n < 1:
            raise InputError("block sizes", "integers >= 1", (self.block_m, self.block_n))
        if self.replica_choice not in SPLIT_OFF_CHOICES:
            raise InputError("replica choice", f"one of {', '.join(SPLIT_OFF_CHOICES)}", self.replica_choice)
        self.moves  # validates the schedule, the migration model and alpha
        self.split_overhead_s  # validates the solve time

    @cached_property
    def moves(self) -> Migration:
        """The migration model of this cluster (copies, their time, what serving pays)."""
        return Migration(self.topology, self.model.expert_bytes, self.alpha_s,
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
                              self.gpu.memory_bytes_per_s, weights=self.weights, block_m=self.block_m,
                              block_n=self.block_n, matrices=m.matrices, profile=self.gpu.gemm_profile())

    @property
    def split_overhead_s(self) -> float:
        """Seconds the per-batch split adds to a layer where it is on (`moe_place.cost.replicas`)."""
        return split_overhead_s(self.num_gpus, self.topology.num_servers, self.split_solve_s, self.split_allreduce_s)

    def slot_rows(self, phy2log: np.ndarray, expert_load: np.ndarray, split: bool = False,
                  max_sweeps: int = MAX_SWEEPS) -> np.ndarray:
        """float64 `[rows, P]`: rows per slot of map rows `phy2log [rows, P]` under loads `[rows, E]`: the
        replica choice's (`replica_choice`), or the per-batch split's where `split` (`max_sweeps` its cap)."""
        return slot_rows(phy2log, expert_load, self.num_gpus, "per-batch" if split else self.replica_choice,
                         num_nodes=self.topology.num_servers, top_k=self.model.top_k, static_tables=self._static,
                         max_sweeps=max_sweeps)

    @cached_property
    def _static(self) -> dict:
        return {}

    def comm_times_s(self, gpu_rows: np.ndarray) -> np.ndarray:
        """float64 `[rows]`: dispatch + combine of layer-steps whose GPUs compute `gpu_rows [rows, G]` (the rows
        they are expected to move: `moe_place.cost.expected_traffic`, DeepEP's routing; combine sends a row
        back as it came)."""
        row_bytes = self.model.row_bytes
        dispatch, combine = expected_phase_times_s(self.topology, gpu_rows, self.model.top_k, row_bytes, row_bytes)
        return dispatch + combine

    def layer_times_s(self, placement: Placement, expert_load: np.ndarray) -> np.ndarray:
        """float64 `[layers]`: busiest-GPU expert time of each layer for `expert_load [layers, E]`, its rows
        reaching the replicas as `replica_choice` says (no dispatch or combine: `served_times_s` has them)."""
        slots = self.slot_rows(placement.phy2log, np.asarray(expert_load, dtype=np.float64))
        return self.gpu_times_s(slots.reshape(placement.num_layers, placement.num_gpus, -1)).max(axis=-1)

    def served_times_s(self, phy2log: np.ndarray, expert_load: np.ndarray, split: bool = False,
                       max_sweeps: int = MAX_SWEEPS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What the replay charges each layer of each step: (busiest-GPU expert time `[rows]`, the split's
        overhead included where `split`; dispatch + combine `[rows]`; balancedness, mean over max GPU rows
        `[rows]`) of map rows `phy2log [rows, P]` serving batches `expert_load [rows, E]`."""
        slots = self.slot_rows(phy2log, expert_load, split, max_sweeps).reshape(len(phy2log), self.num_gpus, -1)
        expert, comm, per_gpu = self._parts_s(slots)
        busiest = per_gpu.max(axis=-1)
        balance = np.divide(per_gpu.mean(axis=-1), busiest, out=np.ones(len(busiest)), where=busiest > 0)
        return expert + (self.split_overhead_s if split else 0.0), comm, balance

    def rows_times_s(self, phy2log: np.ndarray, expert_load: np.ndarray, num_gpus: int) -> np.ndarray:
        """float64 `[rows]`: the layer time (dispatch + busiest-GPU expert time + combine) of map rows `phy2log
        [rows, P]` under loads `expert_load [rows, E]`: what the rule prices its plans with (`rows_parts_s`)."""
        expert, comm = self.rows_parts_s(phy2log, expert_load, num_gpus)
        return expert + comm

    def rows_parts_s(self, phy2log: np.ndarray, expert_load: np.ndarray, num_gpus: int
                     ) -> tuple[np.ndarray, np.ndarray]:
        """(busiest-GPU expert time `[rows]`, dispatch + combine `[rows]`) of map rows `phy2log [rows, P]` under
        loads `expert_load [rows, E]`, split evenly over replicas and unchecked (`even_split_slot_loads`): for a
        caller whose maps are valid."""
        expert, comm, _ = self._parts_s(even_split_slot_loads(phy2log, expert_load).reshape(len(phy2log), num_gpus, -1))
        return expert, comm

    def _parts_s(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(busiest-GPU expert time `[rows]`, dispatch + combine `[rows]`, rows per GPU `[rows, G]`) of rows per slot
        `slots [rows, G, slots per GPU]`: the one layer time of `served_times_s` and `rows_parts_s`."""
        per_gpu = slots.sum(axis=-1)
        return self.gpu_times_s(slots).max(axis=-1), self.comm_times_s(per_gpu), per_gpu

    # ------------------------------------------------------------------ migration
    def copies(self, old: Placement, new: Placement, layers: np.ndarray | None = None) -> list[Copy]:
        """The copies that turn `old` into `new` (`moe_place.cost.migration.plan_copies`)."""
        return self.moves.copies(old, new, layers)

    def charge(self, copies: list[Copy], placement: Placement, expert_load: np.ndarray) -> MigrationCharge:
        """What serving pays for `copies` while `placement` serves steps of `expert_load [layers, E]`."""
        moves = self.moves
        if moves.model == "stall":
            return moves.charge(copies)
        expert, comm, _ = self.served_times_s(placement.phy2log, np.asarray(expert_load, dtype=np.float64))
        return moves.charge(copies, float(expert.sum()), float(comm.sum()))


def cluster_topology(num_gpus: int, num_nodes: int = 1, hardware: str | GpuSpec = DEFAULT_GPU,
                     nic_gbit_per_s: float = DEFAULT_NIC_GBIT) -> Topology:
    """`num_nodes` servers of `num_gpus / num_nodes` GPUs of part `hardware` (a catalog name, or a `GpuSpec` such as
    `moe_place.cost.hardware.gpu_from_record`'s; NVLink and PCIe: the part's), joined by one NIC of
    `nic_gbit_per_s` per GPU: the cluster every command assumes unless told otherwise."""
    if num_nodes < 1 or num_gpus % num_nodes:
        raise InputError("--nodes", f"a divisor of --gpus {num_gpus}", num_nodes)
    gpu = hardware if isinstance(hardware, GpuSpec) else builtin_catalog().gpu(hardware)
    return build_cluster(gpu, num_nodes, num_gpus // num_nodes,
                         nic_bytes_per_s=gbit_per_s(nic_gbit_per_s) if num_nodes > 1 else 0.0)


def cluster_cost(num_gpus: int, num_nodes: int = 1, hardware: str | GpuSpec = DEFAULT_GPU,
                 model: str | ExpertShape = DEFAULT_MODEL,
                 nic_gbit_per_s: float = DEFAULT_NIC_GBIT, copy_schedule: str = "serial", alpha_s: float = DEFAULT_ALPHA_S,
                 block_m: int = DEFAULT_BLOCK_M, migration: str = "stall", replica_choice: str = "even",
                 split_solve_s: float = DEFAULT_SOLVE_S, split_allreduce_s: float | None = None) -> ReplayCost:
    """A `ReplayCost` for `num_nodes` servers of `num_gpus / num_nodes` GPUs of part `hardware` (a catalog
    name, or a `GpuSpec` such as `moe_place.cost.hardware.gpu_from_record`'s)."""
    topology = cluster_topology(num_gpus, num_nodes, hardware, nic_gbit_per_s)
    shape = get_model(model) if isinstance(model, str) else model
    return ReplayCost(shape, topology, block_m=block_m, alpha_s=alpha_s, copy_schedule=copy_schedule,
                      migration=migration, replica_choice=replica_choice, split_solve_s=split_solve_s,
                      split_allreduce_s=split_allreduce_s)
