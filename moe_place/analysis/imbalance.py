"""TensorRT-LLM's imbalance ratio: (max - mean) / mean of one iteration's loads, averaged over iterations.

How TensorRT-LLM computes it, from `examples/wide_ep/ep_load_balancer/report_load_statistics.py`
(NVIDIA/TensorRT-LLM at f00d21a; its projection of a map at aa71b35), read with the search tools: for
each MoE layer it stacks the expert counts of every iteration; with a map (`initial_global_assignments`)
each expert's count is split evenly over its replicas, giving each slot's load. By slot (`--per_expert`)
the units are the slots (the experts when there is no map); by rank they are the slots summed rank by
rank, `num_slots // ep_size` consecutive slots each (the experts `e // (E / ep_size)` without a map).
For each iteration it takes `max / mean - 1` over the units, averages that over the iterations, and its
"average" row is the mean of the layers' figures. 0 is an even load; 1.0 means the busiest unit does
twice the mean. Its README (2a9abd9) reports DeepSeek-R1 at EP32 without a balancer 1.564 by rank, and
0.115 at EP36 with the 288-slot map of `generate_eplb_config.py`.

moe-place prints it beside balancedness (mean / max of the summed loads, docs/MODEL.md): the ratio is
per iteration, so it also counts the imbalance that summing over iterations evens out. Steps are the
iterations. An iteration whose units are all idle has no ratio (TensorRT-LLM's is NaN there) and is left
out of the mean; a layer idle in every iteration gets NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_place.errors import InputError
from moe_place.placement import Placement

__all__ = ["Imbalance", "contiguous_imbalance", "imbalance_ratio", "placement_imbalance"]


def imbalance_ratio(loads: np.ndarray) -> np.ndarray:
    """float64 `[layers]`: `max / mean - 1` over the last axis of `[iterations, layers, units]` loads,
    averaged over the iterations whose mean is above 0 (NaN for a layer with none)."""
    loads = np.asarray(loads, dtype=np.float64)
    if loads.ndim != 3 or loads.shape[2] == 0:
        raise InputError("loads", "a 3-D array [iterations, layers, units]", f"shape {loads.shape}")
    mean = loads.mean(axis=2)
    busy = mean > 0
    ratio = np.where(busy, loads.max(axis=2) / np.where(busy, mean, 1.0) - 1.0, 0.0)
    counted = busy.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counted > 0, ratio.sum(axis=0) / counted, np.nan)


@dataclass(frozen=True)
class Imbalance:
    """TensorRT-LLM's imbalance ratios of one placement on a trace, per layer.

    by_rank: float64 `[layers]`, the ranks' loads (slots summed rank by rank).
    by_slot: float64 `[layers]`, the slots' loads (replicas split an expert's count evenly).
    """

    by_rank: np.ndarray
    by_slot: np.ndarray

    def to_dict(self) -> dict:
        """`by_rank`, `by_slot`: the means over layers (TensorRT-LLM's "average" row), and their per-layer lists
        (`by_rank_layers`, `by_slot_layers`), NaN as None."""
        return {"by_rank": _mean(self.by_rank), "by_slot": _mean(self.by_slot),
                "by_rank_layers": _list(self.by_rank), "by_slot_layers": _list(self.by_slot)}


def placement_imbalance(placement: Placement, step_counts: np.ndarray) -> Imbalance:
    """TensorRT-LLM's ratios of `placement` under `[iterations, layers, E]` expert counts (even split
    over replicas, as its `--projection_eplb_config_path` projects a map)."""
    step_counts = np.asarray(step_counts, dtype=np.float64)
    if step_counts.ndim != 3:
        raise InputError("step_counts", "a 3-D array [iterations, layers, experts]", f"shape {step_counts.shape}")
    slots = np.stack([placement.slot_loads(counts) for counts in step_counts])          # [iterations, layers, P]
    ranks = slots.reshape(*slots.shape[:2], placement.num_gpus, placement.slots_per_gpu).sum(axis=3)
    return Imbalance(by_rank=imbalance_ratio(ranks), by_slot=imbalance_ratio(slots))


def contiguous_imbalance(step_counts: np.ndarray, ep_size: int) -> Imbalance:
    """TensorRT-LLM's ratios without a balancer: expert `e` on rank `e // (E / ep_size)`, one slot each.

    `placement_imbalance` of `Placement.contiguous`, without building it: slot `e` holds expert `e`
    alone, so the slots' loads are the counts themselves (the same numbers, a tenth of the time)."""
    slots = np.asarray(step_counts, dtype=np.float64)
    if slots.ndim != 3:
        raise InputError("step_counts", "a 3-D array [iterations, layers, experts]", f"shape {slots.shape}")
    iterations, layers, experts = slots.shape
    if ep_size < 1 or experts % ep_size:
        raise InputError("ep_size", f"a divisor of the {experts} experts", ep_size)
    ranks = slots.reshape(iterations, layers, ep_size, experts // ep_size).sum(axis=3)
    return Imbalance(by_rank=imbalance_ratio(ranks), by_slot=imbalance_ratio(slots))


def _mean(values: np.ndarray) -> float | None:
    finite = values[np.isfinite(values)]
    return round(float(finite.mean()), 6) if finite.size else None


def _list(values: np.ndarray) -> list:
    return [None if not np.isfinite(v) else round(float(v), 6) for v in values]
