"""Experts in host memory: CPU or GPU execution (formula 8, C10), how many experts fit on the
GPU (C11, C12) and the stability of a shared expert pool (formula 9).

Formula 8, for one expert on `m` rows (`alpha` per transfer, link `B_L`, CPU `C_C`, DRAM `B_D`,
GPU `C_G`, HBM `B_H`, hidden `h`, activation bytes `b`):
    T_C(m) = 2*alpha + 2*m*h*b/B_L + max(2*m*P_e/C_C, W_e/B_D)   rows go to the CPU and back
    T_G(m) = alpha + W_e/B_L + max(2*m*P_e/C_G, W_e/B_H)         weights go to the GPU

A tiered layer (docs/MODEL.md, "Tiered GPU/host experts"): a layer keeps the experts of a set `R`
resident on the GPU and runs the others on the CPU, both at once, as sglang-kt does. A batch of
`n` tokens with `m[e]` rows per expert takes
    CPU side  [R misses an expert] * (2*alpha + 2*n*h*b/B_L) + sum_{e not in R, m[e] > 0} max(2*m[e]*P_e/C_C, W_e/B_D)
    GPU side  sum_{e in R, m[e] > 0} max(2*m[e]*P_e/C_G, W_e/B_H)
    layer     max(CPU side, GPU side)
(sglang-kt copies the batch's hidden states to the CPU once per layer, not once per expert).
Its full-GPU pass for a large prefill (`--kt-gpu-prefill-token-threshold`) copies every
non-resident expert over the link, `alpha + W_e/B_L` each, the resident ones inside the GPU
(`2*W_e/B_H`: read and write), then runs all experts on the GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from moe_place.cost.hardware import CpuSpec, GpuSpec
from moe_place.cost.models import ExpertShape
from moe_place.errors import InputError

__all__ = ["ExpectedCosts", "OffloadRates", "PoolStability", "TierTimes", "cpu_compute_s", "cpu_time_s",
           "crossover_rows", "expected_compute_s", "expected_costs", "expected_tiered_s", "expert_copy_s",
           "full_gpu_layer_s", "gpu_compute_s", "gpu_time_s", "max_resident_per_layer", "pool_stability",
           "prefill_threshold_tokens", "replica_bytes", "resident_bytes", "rows_transfer_s", "tiered_times"]


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

    @classmethod
    def of(cls, gpu: GpuSpec, cpu: CpuSpec, kernel: str, socket: str = "local",
           link_bytes_per_s: float | None = None, alpha_s: float = 0.0) -> "OffloadRates":
        """The rates of catalog parts: the CPU's `kernel` and `socket` DRAM, the GPU's effective
        compute and HBM, and the link (default: the GPU's PCIe, per direction)."""
        link = gpu.pcie_bytes_per_s if link_bytes_per_s is None else link_bytes_per_s
        return cls(cpu.flops_per_s(kernel), cpu.memory_bytes_per_s(socket), gpu.flops_per_s,
                   gpu.memory_bytes_per_s, link, alpha_s)


def _scalar_or_array(out: np.ndarray):
    return float(out) if out.ndim == 0 else out


def cpu_compute_s(rows, model: ExpertShape, rates: OffloadRates):
    """`max(2*m*P_e/C_C, W_e/B_D)`: the CPU half of `T_C(m)` without the row transfers (rows may be an array)."""
    m = np.asarray(rows, dtype=np.float64)
    return _scalar_or_array(np.maximum(2 * m * model.params_per_expert / rates.cpu_flops_per_s,
                                       model.expert_bytes / rates.dram_bytes_per_s))


def gpu_compute_s(rows, model: ExpertShape, rates: OffloadRates):
    """`max(2*m*P_e/C_G, W_e/B_H)`: a resident expert's GPU time, `T_G(m)` without the weight copy."""
    m = np.asarray(rows, dtype=np.float64)
    return _scalar_or_array(np.maximum(2 * m * model.params_per_expert / rates.gpu_flops_per_s,
                                       model.expert_bytes / rates.hbm_bytes_per_s))


def rows_transfer_s(rows, model: ExpertShape, rates: OffloadRates):
    """`2*alpha + 2*m*h*b/B_L`: `m` activation rows to the CPU and back."""
    m = np.asarray(rows, dtype=np.float64)
    return _scalar_or_array(2 * rates.alpha_s + 2 * m * model.row_bytes / rates.link_bytes_per_s)


def expert_copy_s(model: ExpertShape, rates: OffloadRates) -> float:
    """`alpha + W_e/B_L`: one expert's weights over the link (formula 8's copy; formula 7's per copy)."""
    return rates.alpha_s + model.expert_bytes / rates.link_bytes_per_s


def cpu_time_s(rows, model: ExpertShape, rates: OffloadRates):
    """`T_C(m)` of one expert (rows may be an array)."""
    return _scalar_or_array(np.asarray(rows_transfer_s(rows, model, rates) + cpu_compute_s(rows, model, rates)))


def gpu_time_s(rows, model: ExpertShape, rates: OffloadRates):
    """`T_G(m)` of one expert (rows may be an array)."""
    return _scalar_or_array(np.asarray(rates.alpha_s + model.expert_bytes / rates.link_bytes_per_s
                                       + gpu_compute_s(rows, model, rates)))


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


# ---------------------------------------------------------------------- tiered layers (CPU and GPU at once)
@dataclass(frozen=True)
class TierTimes:
    """Time of tiered layers, float64 arrays of one shape (e.g. `[batches, layers]`), seconds.

    cpu_s: the CPU side (row transfers + non-resident experts); gpu_s: the resident experts;
    layer_s: `max(cpu_s, gpu_s)`, the two sides run at once."""

    cpu_s: np.ndarray
    gpu_s: np.ndarray

    @property
    def layer_s(self) -> np.ndarray:
        return np.maximum(self.cpu_s, self.gpu_s)


def tiered_times(rows, resident, tokens, model: ExpertShape, rates: OffloadRates) -> TierTimes:
    """Tiered layer times of concrete batches (see the module note).

    rows: `[..., E]` rows per expert (a batch's dispatches to each expert of a layer).
    resident: bool `[..., E]` (broadcast against rows): the experts the GPU holds.
    tokens: `[...]` tokens of each batch (broadcast against rows without its last axis).
    """
    m = np.asarray(rows, dtype=np.float64)
    on_gpu = np.broadcast_to(np.asarray(resident, dtype=bool), m.shape)
    used = m > 0
    cpu_work = np.where(used & ~on_gpu, cpu_compute_s(m, model, rates), 0.0).sum(axis=-1)
    gpu_work = np.where(used & on_gpu, gpu_compute_s(m, model, rates), 0.0).sum(axis=-1)
    some_cpu = ~on_gpu.all(axis=-1)
    transfer = np.where(some_cpu, rows_transfer_s(np.asarray(tokens, dtype=np.float64), model, rates), 0.0)
    return TierTimes(transfer + cpu_work, gpu_work)


def full_gpu_layer_s(rows, resident, model: ExpertShape, rates: OffloadRates) -> np.ndarray:
    """sglang-kt's full-GPU pass of a layer: copy each non-resident expert over the link, each resident
    one inside the GPU, run all experts on the GPU. rows `[..., E]`, resident bool `[..., E]` -> `[...]`."""
    m = np.asarray(rows, dtype=np.float64)
    on_gpu = np.broadcast_to(np.asarray(resident, dtype=bool), m.shape)
    copies = ((~on_gpu).sum(axis=-1) * expert_copy_s(model, rates)
              + on_gpu.sum(axis=-1) * 2 * model.expert_bytes / rates.hbm_bytes_per_s)
    return copies + np.where(m > 0, gpu_compute_s(m, model, rates), 0.0).sum(axis=-1)


def expected_compute_s(share, tokens: int, flops_per_s: float, bytes_per_s: float, model: ExpertShape) -> np.ndarray:
    """`E[max(2*m*P_e/C, W_e/B) * [m > 0]]` for `m ~ Binomial(tokens, share)`: the expected time of an
    expert that each of `tokens` i.i.d. tokens picks with probability `share` (float64, shape of share).

    `max(a*m, w) = a*m + (w - a*m)^+`, and `w - a*m > 0` only for `m < w/a` rows, so the expectation is
    `a*tokens*share` plus a short sum over those `m` (at most `w/a` terms: 97 for the 8452Y's AMX)."""
    q = np.clip(np.asarray(share, dtype=np.float64), 0.0, 1.0)
    n = int(tokens)
    if n < 1:
        raise InputError("tokens", "an integer >= 1", tokens)
    a = 2 * model.params_per_expert / flops_per_s
    w = model.expert_bytes / bytes_per_s
    out = a * n * q
    last = min(n, int(np.ceil(w / a)) - 1)
    if last < 1:
        return out
    # experts whose mean row count is far above `last` have P(m <= last) below e^-40 (Chernoff:
    # P(m <= last) <= exp(-(mu - last)^2 / (2 mu)) for mu = n*q > last): their correction is dropped
    mu = n * q
    near = (q > 0) & ~((mu > last) & ((mu - last) ** 2 > 80 * mu))
    if not near.any():
        return out
    qn = q[near]
    m = np.arange(1, last + 1, dtype=np.float64)[:, None]
    log_choose = np.array([[math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)]
                           for k in range(1, last + 1)])
    with np.errstate(divide="ignore", invalid="ignore"):
        log_p = log_choose + m * np.log(qn) + np.where(n - m > 0, (n - m) * np.log1p(-qn), 0.0)
    p = np.exp(np.nan_to_num(log_p, nan=-np.inf))          # P(m rows), m = 1..last, for the near experts
    out = np.array(out, dtype=np.float64)
    out[near] += (w - a * m[:, 0]) @ p
    return out


@dataclass(frozen=True)
class ExpectedCosts:
    """Expected per-expert costs of one batch size (float64 `[layers, E]`, seconds) and the layer's
    row transfer (seconds, paid by every layer that keeps an expert on the CPU)."""

    tokens: int
    cpu_s: np.ndarray
    gpu_s: np.ndarray
    transfer_s: float


def expected_costs(share, tokens: int, model: ExpertShape, rates: OffloadRates) -> ExpectedCosts:
    """Per-expert expected CPU and GPU time of a batch of `tokens` tokens, each picking expert `e` of a
    layer with probability `share[l, e]` (its routed tokens over all tokens: rows sum to top-k)."""
    return ExpectedCosts(int(tokens),
                         expected_compute_s(share, tokens, rates.cpu_flops_per_s, rates.dram_bytes_per_s, model),
                         expected_compute_s(share, tokens, rates.gpu_flops_per_s, rates.hbm_bytes_per_s, model),
                         float(rows_transfer_s(tokens, model, rates)))


def expected_tiered_s(costs: ExpectedCosts, resident) -> TierTimes:
    """Expected CPU and GPU sides per layer (`[layers]`) of a resident mask `[layers, E]`: the fluid
    model (each side at its expected time) that the offload planner optimises."""
    on_gpu = np.asarray(resident, dtype=bool)
    some_cpu = ~on_gpu.all(axis=-1)
    return TierTimes(np.where(some_cpu, costs.transfer_s, 0.0) + np.where(on_gpu, 0.0, costs.cpu_s).sum(axis=-1),
                     np.where(on_gpu, costs.gpu_s, 0.0).sum(axis=-1))


def prefill_threshold_tokens(share, resident, model: ExpertShape, rates: OffloadRates,
                             max_tokens: int = 1 << 22) -> int | None:
    """The smallest batch (tokens) from which sglang-kt's full-GPU pass of every layer is faster, in all,
    than the tiered layers (formula 8's crossover, C10, at the level of a layer), in the fluid model;
    None if not up to `max_tokens`. share `[layers, E]` as `expected_costs`, resident bool `[layers, E]`.

    Found by doubling, then bisection: the tiered side grows by the CPU's cost per row, the
    full-GPU pass by the GPU's (smaller) one, so past the crossover the GPU stays ahead."""
    on_gpu = np.asarray(resident, dtype=bool)

    def gpu_wins(n: int) -> bool:
        costs = expected_costs(share, n, model, rates)
        full = (on_gpu.size - on_gpu.sum()) * expert_copy_s(model, rates) \
            + on_gpu.sum() * 2 * model.expert_bytes / rates.hbm_bytes_per_s + costs.gpu_s.sum()
        return bool(full < expected_tiered_s(costs, on_gpu).layer_s.sum())

    hi = 1
    while not gpu_wins(hi):
        if hi >= max_tokens:
            return None
        hi = min(2 * hi, max_tokens)
    lo = hi // 2
    if lo < 1:
        return 1
    while hi - lo > 1:  # invariant: the GPU pass is not faster at lo, faster at hi
        mid = (lo + hi) // 2
        if gpu_wins(mid):
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
