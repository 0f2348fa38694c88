"""What a step and a rebalance cost on a given cluster: the cost model, vectorised for replay.

Expert time of one layer is the busiest GPU's `max(F/C, W/B)` (SPEC formula 1) with the tile
traffic of formula 5 and padding of formula 4, as `moe_place.cost.gemm.expert_time_s` computes it
for one GPU; here the same formula runs over every GPU and layer at once (tests pin it to
`expert_time_s`). Rows of a slot are its expert's dispatches split evenly over the replicas,
rounded up to whole rows.

A rebalance copies each slot whose expert changes from the cheapest source that holds that
expert in the map in use (same GPU, then the widest route of `moe_place.cost.topology`). The
copy time is `moe_place.cost.payback.copy_time_s`: `serial` (formula 7, `sum W_e/B_path + alpha`,
a copy within one GPU costs nothing) or `parallel` (all copies at once, bounded by the most
loaded link, what vLLM's batched send/receive approaches).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_place.cost.gemm import tile_row_bytes
from moe_place.cost.hardware import GpuSpec, builtin_catalog
from moe_place.cost.models import ExpertShape, get_model
from moe_place.cost.payback import Copy as LinkCopy
from moe_place.cost.payback import copy_time_s
from moe_place.cost.topology import Topology, build_cluster
from moe_place.cost.units import gbit_per_s
from moe_place.errors import InputError
from moe_place.placement import Placement

COPY_SCHEDULES = ("serial", "parallel")
DEFAULT_ALPHA_S = 5e-6
DEFAULT_BLOCK_M = 64
DEFAULT_BLOCK_N = 128


@dataclass(frozen=True)
class Copy:
    """One expert copy of a rebalance: `expert` of `layer` into `slot` on `dst_gpu` from `src_gpu`.

    time_s: this copy alone (`W_e/B_path + alpha`, 0 within one GPU); path: the link kinds crossed.
    """

    layer: int
    slot: int
    expert: int
    src_gpu: int
    dst_gpu: int
    num_bytes: int
    time_s: float
    path: str


@dataclass(frozen=True)
class ReplayCost:
    """The cost model of one cluster and model, for per-step expert time and rebalance copies.

    model: the expert shape (`W_e`, FLOPs per row). topology: the cluster (G GPUs).
    block_m / block_n: GEMM tile sizes (formulas 4 and 5). alpha_s: fixed cost per copy.
    copy_schedule: "serial" or "parallel" (see the module note).
    """

    model: ExpertShape
    topology: Topology
    block_m: int = DEFAULT_BLOCK_M
    block_n: int = DEFAULT_BLOCK_N
    alpha_s: float = DEFAULT_ALPHA_S
    copy_schedule: str = "serial"

    def __post_init__(self) -> None:
        if self.copy_schedule not in COPY_SCHEDULES:
            raise InputError("copy_schedule", f"one of {', '.join(COPY_SCHEDULES)}", self.copy_schedule)
        if self.block_m < 1 or self.block_n < 1:
            raise InputError("block sizes", "integers >= 1", (self.block_m, self.block_n))
        if self.alpha_s < 0:
            raise InputError("alpha_s", "seconds >= 0", self.alpha_s)

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
        tiles = np.ceil(rows / self.block_m)
        flops = 2.0 * m.params_per_expert * tiles.sum(axis=-1) * self.block_m
        weight_bytes = m.params_per_expert * m.dtype_bytes
        row_bytes = tile_row_bytes(m.hidden, m.intermediate, m.dtype_bytes, self.block_n)
        memory = tiles.sum(axis=-1) * weight_bytes + rows.sum(axis=-1) * row_bytes
        return np.maximum(flops / self.gpu.flops_per_s, memory / self.gpu.memory_bytes_per_s)

    def layer_times_s(self, placement: Placement, expert_load: np.ndarray) -> np.ndarray:
        """float64 `[layers]`: busiest-GPU expert time of each layer for `expert_load [layers, E]`."""
        slots = placement.slot_loads(expert_load).reshape(placement.num_layers, placement.num_gpus, -1)
        return self.gpu_times_s(slots).max(axis=-1)

    def step_time_s(self, placement: Placement, expert_load: np.ndarray) -> float:
        """Expert-layer time of one step: the sum over layers of the busiest GPU's time."""
        return float(self.layer_times_s(placement, expert_load).sum())

    # ------------------------------------------------------------------ migration
    def single_copy_time_s(self, src_gpu: int, dst_gpu: int) -> float:
        """Seconds to copy one expert from `src_gpu` to `dst_gpu` alone (0 within one GPU)."""
        return self.migration_time_s([Copy(0, 0, 0, src_gpu, dst_gpu, self.expert_bytes, 0.0, "")])

    def copies(self, old: Placement, new: Placement, layers: np.ndarray | None = None) -> list[Copy]:
        """The copies that turn `old` into `new`: one per slot whose expert changes.

        The source of each copy is the replica of the expert in `old` with the cheapest route to
        the slot's GPU (the old map stays valid until the switch, so every old replica can serve).
        layers: restrict to these layers (default: all).
        """
        moved = new.moved_slots(old)
        per_gpu = old.slots_per_gpu
        out: list[Copy] = []
        for layer in (range(old.num_layers) if layers is None else layers):
            for slot in np.flatnonzero(moved[layer]):
                expert = int(new.phy2log[layer, slot])
                dst = int(slot // per_gpu)
                sources = np.unique(np.flatnonzero(old.phy2log[layer] == expert) // per_gpu)
                if dst in sources:
                    src, seconds = dst, 0.0
                else:
                    width = [self.topology.path_bandwidth_bytes_per_s(int(s), dst) for s in sources]
                    src = int(sources[int(np.argmax(width))])
                    seconds = self.expert_bytes / max(width) + self.alpha_s
                path = "same GPU" if src == dst else self.topology.path_kind(src, dst)
                out.append(Copy(int(layer), int(slot), expert, src, dst, self.expert_bytes, seconds, path))
        return out

    def migration_time_s(self, copies: list[Copy]) -> float:
        """Seconds the copies take under `copy_schedule` (`moe_place.cost.payback.copy_time_s`)."""
        links = [LinkCopy(c.src_gpu, c.dst_gpu, c.num_bytes) for c in copies]
        return copy_time_s(self.topology, links, self.alpha_s, self.copy_schedule)


def cluster_cost(num_gpus: int, num_nodes: int = 1, hardware: str = "H100", model: str | ExpertShape = "Qwen3-30B-A3B",
                 nic_gbit_per_s: float = 400.0, copy_schedule: str = "serial", alpha_s: float = DEFAULT_ALPHA_S,
                 block_m: int = DEFAULT_BLOCK_M) -> ReplayCost:
    """A `ReplayCost` for `num_nodes` servers of `num_gpus / num_nodes` GPUs of part `hardware`."""
    if num_nodes < 1 or num_gpus % num_nodes:
        raise InputError("--nodes", f"a divisor of --gpus {num_gpus}", num_nodes)
    gpu = builtin_catalog().gpu(hardware)
    topology = build_cluster(gpu, num_nodes, num_gpus // num_nodes,
                             nic_bytes_per_s=gbit_per_s(nic_gbit_per_s) if num_nodes > 1 else 0.0)
    shape = get_model(model) if isinstance(model, str) else model
    return ReplayCost(shape, topology, block_m=block_m, alpha_s=alpha_s, copy_schedule=copy_schedule)
