"""Score a placement with the cost model: per-layer expert time (busiest GPU) and the copies a
move from one placement to another needs. These are the entry points the solvers and the online
controller call; they take a `Placement` and loads, never a solver.
"""

from __future__ import annotations

import numpy as np

from moe_place.cost.gemm import gpu_expert_work
from moe_place.cost.hardware import GpuSpec
from moe_place.cost.models import ExpertShape
from moe_place.cost.payback import Copy
from moe_place.cost.topology import Topology
from moe_place.errors import InputError
from moe_place.placement import Placement


def placement_layer_times_s(placement: Placement, expert_load: np.ndarray, model: ExpertShape, gpu: GpuSpec, *,
                            weights: str = "once", block_m: int | None = None, block_n: int = 128) -> np.ndarray:
    """float64 `[layers]`: expert time of each layer = the busiest GPU's `max(F/C, W/B)`.

    expert_load: `[layers, E]` rows (dispatches) per logical expert; replicas split them evenly.
    weights: `none`, `once` (each slot with rows reads its expert once) or `tiles` (formula 5).
    """
    slots = placement.slot_loads(expert_load).reshape(placement.num_layers, placement.num_gpus, -1)
    out = np.zeros(placement.num_layers)
    for layer in range(placement.num_layers):
        out[layer] = max(gpu_expert_work(rows, model.hidden, model.intermediate, model.dtype_bytes, gpu.flops_per_s,
                                         gpu.memory_bytes_per_s, weights=weights, block_m=block_m, block_n=block_n,
                                         matrices=model.matrices).time_s for rows in slots[layer])
    return out


def copies_for_move(old: Placement, new: Placement, model: ExpertShape, topology: Topology) -> list[Copy]:
    """The weight copies that turn `old` into `new`: one per (layer, GPU, expert) that `new` places on a
    GPU which did not hold that expert before, fetched from the old holder with the widest route
    (ties: the lowest GPU index). Returned in layer, GPU order."""
    if (old.num_gpus, old.num_logical_experts, old.num_layers) != (new.num_gpus, new.num_logical_experts,
                                                                   new.num_layers):
        raise InputError("placements", "the same GPUs, experts and layers before and after",
                         f"{old.num_gpus}/{old.num_logical_experts}/{old.num_layers} vs "
                         f"{new.num_gpus}/{new.num_logical_experts}/{new.num_layers}")
    if new.num_gpus > topology.num_gpus:
        raise InputError("placement num_gpus", f"at most the topology's {topology.num_gpus} GPUs", new.num_gpus)
    old_by_gpu, new_by_gpu = old.slots_by_gpu(), new.slots_by_gpu()
    copies: list[Copy] = []
    for layer in range(new.num_layers):
        holders: dict[int, list[int]] = {}
        for g in range(old.num_gpus):
            for e in set(old_by_gpu[layer, g].tolist()):
                holders.setdefault(e, []).append(g)
        for g in range(new.num_gpus):
            had = set(old_by_gpu[layer, g].tolist())
            for e in sorted(set(new_by_gpu[layer, g].tolist()) - had):
                src = max(holders[e], key=lambda h: (topology.path_bandwidth_bytes_per_s(h, g), -h))
                copies.append(Copy(src, g, float(model.expert_bytes)))
    return copies
