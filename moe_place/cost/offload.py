"""Experts in host memory: CPU or GPU execution (formula 8, C10), how many experts fit on the
GPU (C11, C12) and the stability of a shared expert pool (formula 9).

Formula 8, for one expert on `m` rows (`alpha` per transfer, link `B_L`, CPU `C_C`, DRAM `B_D`,
GPU `C_G`, HBM `B_H`, hidden `h`, activation bytes `b`):
    T_C(m) = 2*alpha + 2*m*h*b/B_L + max(2*m*P_e/C_C, W_e/B_D)   rows go to the CPU and back
    T_G(m) = alpha + W_e/B_L + max(2*m*P_e/C_G, W_e/B_H)         weights go to the GPU
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_place.cost.models import ExpertShape
from moe_place.errors import InputError


@dataclass(frozen=True)
class OffloadRates:
    """Effective rates of one CPU-GPU pair (already multiplied by any efficiency)."""

    cpu_flops_per_s: float
    dram_bytes_per_s: float
    gpu_flops_per_s: float
    hbm_bytes_per_s: float
    link_bytes_per_s: float
    alpha_s: float = 0.0

    def __post_init__(self) -> None:
        for key in ("cpu_flops_per_s", "dram_bytes_per_s", "gpu_flops_per_s", "hbm_bytes_per_s", "link_bytes_per_s"):
            if not getattr(self, key) > 0:
                raise InputError(key, "a number > 0", getattr(self, key))
        if self.alpha_s < 0:
            raise InputError("alpha_s", "seconds >= 0", self.alpha_s)


def cpu_time_s(rows, model: ExpertShape, rates: OffloadRates):
    """`T_C(m)` of one expert (rows may be an array)."""
    m = np.asarray(rows, dtype=np.float64)
    out = (2 * rates.alpha_s + 2 * m * model.hidden * model.activation_bytes / rates.link_bytes_per_s
           + np.maximum(2 * m * model.params_per_expert / rates.cpu_flops_per_s,
                        model.expert_bytes / rates.dram_bytes_per_s))
    return float(out) if out.ndim == 0 else out


def gpu_time_s(rows, model: ExpertShape, rates: OffloadRates):
    """`T_G(m)` of one expert (rows may be an array)."""
    m = np.asarray(rows, dtype=np.float64)
    out = (rates.alpha_s + model.expert_bytes / rates.link_bytes_per_s
           + np.maximum(2 * m * model.params_per_expert / rates.gpu_flops_per_s,
                        model.expert_bytes / rates.hbm_bytes_per_s))
    return float(out) if out.ndim == 0 else out


def crossover_rows(model: ExpertShape, rates: OffloadRates, max_rows: int = 1 << 20) -> int | None:
    """Smallest `m >= 1` with `T_G(m) < T_C(m)` (the GPU becomes faster); None if never up to `max_rows`.

    `T_C - T_G` is non-decreasing in `m` whenever the CPU's per-row cost exceeds the GPU's
    (`2*P_e/C_C + 2*h*b/B_L >= 2*P_e/C_G`), so a binary search finds the first row count.
    """
    per_row_cpu = 2 * model.params_per_expert / rates.cpu_flops_per_s + 2 * model.hidden * model.activation_bytes / rates.link_bytes_per_s
    if per_row_cpu < 2 * model.params_per_expert / rates.gpu_flops_per_s:
        raise InputError("offload rates", "a CPU path that costs more per row than the GPU path")
    if not gpu_time_s(max_rows, model, rates) < cpu_time_s(max_rows, model, rates):
        return None
    lo, hi = 1, max_rows
    if gpu_time_s(lo, model, rates) < cpu_time_s(lo, model, rates):
        return lo
    while hi - lo > 1:  # invariant: GPU not faster at lo, faster at hi
        mid = (lo + hi) // 2
        if gpu_time_s(mid, model, rates) < cpu_time_s(mid, model, rates):
            hi = mid
        else:
            lo = mid
    return hi


# ---------------------------------------------------------------------- capacity (C11, C12)
def replica_bytes(model: ExpertShape, extra_per_layer: int = 1, layers: int | None = None) -> int:
    """Bytes of `extra_per_layer` replicas per layer on one GPU over `layers` layers (default all MoE layers).
    C11: one 36 MiB replica in each of 94 layers = 3384 MiB; only the 8 most crowded layers = 288 MiB."""
    layers = model.num_moe_layers if layers is None else layers
    if extra_per_layer < 0 or layers < 0:
        raise InputError("replicas", "counts >= 0", (extra_per_layer, layers))
    return model.expert_bytes * extra_per_layer * layers


def resident_bytes(model: ExpertShape, experts_per_layer: int, layers: int | None = None) -> int:
    """Bytes of `experts_per_layer` resident experts in every layer (C12: 32 x 36 MiB x 94 = 105.75 GiB)."""
    layers = model.num_moe_layers if layers is None else layers
    if not 0 <= experts_per_layer <= model.num_experts:
        raise InputError("resident experts per layer", f"a count in [0, {model.num_experts}]", experts_per_layer)
    return model.expert_bytes * experts_per_layer * layers


def max_resident_per_layer(model: ExpertShape, memory_bytes: float, layers: int | None = None) -> int:
    """Most experts per layer that fit in `memory_bytes` when every layer keeps the same number."""
    layers = model.num_moe_layers if layers is None else layers
    return min(model.num_experts, int(memory_bytes // (model.expert_bytes * layers)))


# ---------------------------------------------------------------------- pool stability (formula 9)
@dataclass(frozen=True)
class PoolStability:
    """`lambda*E[F_j] < C_j` for every expert GPU and `lambda*E[V_l] < B_l` for every link.

    utilization: float64 `[resources]`, `lambda*demand/capacity`; necessary, not sufficient (bursts
    and heavy tails still queue)."""

    names: tuple[str, ...]
    utilization: np.ndarray
    rate_batches_per_s: float

    @property
    def stable(self) -> bool:
        return bool((self.utilization < 1).all())

    @property
    def max_rate_batches_per_s(self) -> float:
        """The admission rate at which the busiest resource reaches utilization 1."""
        peak = float(self.utilization.max())
        return float("inf") if not peak > 0 else self.rate_batches_per_s / peak

    @property
    def binding(self) -> str:
        return self.names[int(np.argmax(self.utilization))]


def pool_stability(rate_batches_per_s: float, demand_per_batch, capacity_per_s, names=None) -> PoolStability:
    """Formula 9: `demand_per_batch[r]` (FLOPs or bytes per batch) against `capacity_per_s[r]`."""
    demand = np.asarray(demand_per_batch, dtype=np.float64)
    capacity = np.asarray(capacity_per_s, dtype=np.float64)
    if demand.shape != capacity.shape or demand.ndim != 1:
        raise InputError("pool", "demand and capacity lists of one length", (demand.shape, capacity.shape))
    if (capacity <= 0).any() or (demand < 0).any() or not rate_batches_per_s >= 0:
        raise InputError("pool", "capacities > 0, demands >= 0, rate >= 0")
    names = tuple(names) if names is not None else tuple(f"resource{i}" for i in range(demand.size))
    return PoolStability(names, rate_batches_per_s * demand / capacity, float(rate_batches_per_s))
