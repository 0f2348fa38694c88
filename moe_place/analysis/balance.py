"""GPU balance of a placement: rows per GPU, busiest/mean GPU, balancedness (vLLM, SGLang).

Loads are split evenly over an expert's replicas (what EPLB assumes); see `Placement.gpu_loads`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_place.analysis.profile import check_expert_load, max_over_mean
from moe_place.errors import InputError
from moe_place.placement import Placement, balancedness

__all__ = ["GpuBalance", "balance_of_gpu_loads", "gpu_balance", "sglang_balancedness", "vllm_balancedness"]

#: SGLang adds this to both sides of mean/max so an idle layer counts as balanced.
SGLANG_EPSILON = 1e-5


def sglang_balancedness(gpu_load: np.ndarray) -> np.ndarray:
    """float64 `[...]`: SGLang's utilization rate `(mean + 1e-5) / (max + 1e-5)` along the last axis."""
    gpu_load = np.asarray(gpu_load, dtype=np.float64)
    return (gpu_load.mean(axis=-1) + SGLANG_EPSILON) / (gpu_load.max(axis=-1) + SGLANG_EPSILON)


def vllm_balancedness(gpu_load: np.ndarray) -> float:
    """vLLM's logged EPLB balancedness of `[layers, G]` GPU loads: one number for the model.

    The sum over layers of the mean GPU load divided by the sum over layers of the busiest GPU
    load (so crowded layers weigh more than in the mean of per-layer ratios); 0 if all are 0.
    """
    gpu_load = np.asarray(gpu_load, dtype=np.float64)
    if gpu_load.ndim != 2:
        raise InputError("gpu_load", "a 2-D array [layers, gpus]", f"shape {gpu_load.shape}")
    total_max = float(gpu_load.max(axis=1).sum())
    return float(gpu_load.mean(axis=1).sum()) / total_max if total_max > 0 else 0.0


@dataclass(frozen=True)
class GpuBalance:
    """How evenly a placement spreads each layer's rows over its GPUs.

    gpu_load: float64 `[layers, G]` rows (dispatches) each GPU computes.
    max_over_mean: `[layers]` busiest GPU over the mean GPU (s_expert, docs/MODEL.md; 1 = balanced).
    balancedness: `[layers]` mean over busiest GPU (1 / max_over_mean).
    sglang_balancedness: `[layers]` SGLang's `(mean + 1e-5) / (max + 1e-5)`.
    vllm_balancedness: vLLM's model-wide figure, see `vllm_balancedness()`.
    """

    gpu_load: np.ndarray
    max_over_mean: np.ndarray
    balancedness: np.ndarray
    sglang_balancedness: np.ndarray
    vllm_balancedness: float

    def __post_init__(self) -> None:
        if self.gpu_load.ndim != 2:
            raise InputError("GpuBalance.gpu_load", "a 2-D array [layers, gpus]", f"shape {self.gpu_load.shape}")
        layers = self.gpu_load.shape[0]
        for name in ("max_over_mean", "balancedness", "sglang_balancedness"):
            if getattr(self, name).shape != (layers,):
                raise InputError(f"GpuBalance.{name}", f"shape ({layers},)", getattr(self, name).shape)

    @property
    def num_gpus(self) -> int:
        return self.gpu_load.shape[1]


def balance_of_gpu_loads(gpu_load: np.ndarray) -> GpuBalance:
    """The balance figures of `[layers, G]` GPU loads."""
    gpu_load = check_expert_load(gpu_load, "gpu_load")
    return GpuBalance(gpu_load=gpu_load, max_over_mean=max_over_mean(gpu_load),
                      balancedness=balancedness(gpu_load), sglang_balancedness=sglang_balancedness(gpu_load),
                      vllm_balancedness=vllm_balancedness(gpu_load))


def gpu_balance(placement: Placement, expert_load: np.ndarray) -> GpuBalance:
    """Balance of `placement` under `[layers, E]` logical expert loads (even split over replicas)."""
    return balance_of_gpu_loads(placement.gpu_loads(check_expert_load(expert_load)))
