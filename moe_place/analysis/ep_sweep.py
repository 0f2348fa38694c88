"""EP sweep: the same expert loads spread over 8, 16, 32, ... GPUs (contiguous blocks by default)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from moe_place.analysis.balance import GpuBalance, gpu_balance
from moe_place.analysis.profile import check_expert_load
from moe_place.errors import InputError
from moe_place.placement import Placement

__all__ = ["EpPoint", "check_ep_sizes", "default_ep_sizes", "ep_sweep"]

#: EP sizes tried by default: those of these that divide the expert count.
STANDARD_EP_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)


def default_ep_sizes(num_experts: int) -> tuple[int, ...]:
    """The standard EP sizes that divide `num_experts`; `(num_experts,)` when none does."""
    sizes = tuple(g for g in STANDARD_EP_SIZES if g <= num_experts and num_experts % g == 0)
    return sizes or (num_experts,)


def check_ep_sizes(ep_sizes: Sequence[int], num_experts: int, where: str = "--ep") -> tuple[int, ...]:
    """Return the EP sizes sorted and de-duplicated; each must divide `num_experts`."""
    if not len(ep_sizes):
        raise InputError(where, "at least one EP size")
    for size in ep_sizes:
        if int(size) < 1 or num_experts % int(size):
            raise InputError(where, f"EP sizes that divide the {num_experts} experts", int(size))
    return tuple(sorted({int(s) for s in ep_sizes}))


@dataclass(frozen=True)
class EpPoint:
    """One EP size of a sweep: the placement used and its GPU balance."""

    ep_size: int
    placement: Placement
    balance: GpuBalance

    def __post_init__(self) -> None:
        if self.placement.num_gpus != self.ep_size or self.balance.num_gpus != self.ep_size:
            raise InputError("EpPoint", f"a placement and balance on {self.ep_size} GPUs")


def ep_sweep(expert_load: np.ndarray, ep_sizes: Sequence[int],
             placement_for: Callable[[int], Placement] | None = None) -> tuple[EpPoint, ...]:
    """Balance of `[layers, E]` loads at each EP size.

    placement_for: EP size -> placement of all layers; default `Placement.contiguous` (each GPU
    holds `E/G` consecutive experts, no redundant slots).
    """
    loads = check_expert_load(expert_load)
    layers, experts = loads.shape
    points = []
    for size in check_ep_sizes(ep_sizes, experts):
        placement = placement_for(size) if placement_for else Placement.contiguous(layers, experts, size)
        points.append(EpPoint(size, placement, gpu_balance(placement, loads)))
    return tuple(points)
