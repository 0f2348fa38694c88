"""The engines' own rules for which experts stay on the GPU, reimplemented to compare plans against.

- sglang-kt 0.7.2 `--kt-expert-placement-strategy` (`strategy_mask`; what each strategy does is said in
  `moe_place.engines.sglang_kt`, the adapter that writes the stats file its `frequency` rule reads);
- llama.cpp `--n-cpu-moe N` (`n_cpu_moe_mask`, `n_cpu_moe_for`): the MoE layers with block id below `N` keep
  their experts on the CPU (`moe_place.engines.llama_cpp` writes the flags).

They live with the solvers because the offload planner is judged against them
(`moe_place.solvers.offload_compare`); the engines' adapters re-export them.
"""

from __future__ import annotations

import numpy as np

from moe_place.errors import InputError

__all__ = ["n_cpu_moe_for", "n_cpu_moe_mask", "strategy_mask"]

STRATEGIES = ("uniform", "frequency", "front-loading", "random")
RANDOM_SEED = 42                       # sglang-kt's generate_random_masks seed


def strategy_mask(strategy: str, counts, total: int, seed: int = RANDOM_SEED) -> np.ndarray:
    """bool `[L, E]`: the experts sglang-kt puts on the GPU under `strategy` with `total` GPU experts,
    every trace layer an MoE layer. counts `[L, E]`: the activation counts `frequency` reads.

    `frequency` breaks ties among equal counts by the lower (layer, expert) index: sglang-kt's
    `torch.topk` may pick any of them. `random` is a seeded numpy draw of `total` distinct pairs,
    the same rule (uniform over pairs) but not torch's numbers."""
    counts = np.asarray(counts)
    layers, experts = counts.shape
    total = int(min(max(total, 0), layers * experts))
    mask = np.zeros(layers * experts, dtype=bool)
    if strategy == "uniform":
        per_layer = total // layers + (np.arange(layers) < total % layers)
        return np.arange(experts)[None, :] < np.minimum(per_layer, experts)[:, None]
    if strategy == "front-loading":
        mask[:total] = True                      # layer by layer, experts 0..E-1 of each
    elif strategy == "frequency":
        mask[np.argsort(-counts.reshape(-1), kind="stable")[:total]] = True
    elif strategy == "random":
        mask[np.random.default_rng(seed).permutation(layers * experts)[:total]] = True
    else:
        raise InputError("sglang-kt strategy", f"one of {', '.join(STRATEGIES)}", repr(strategy))
    return mask.reshape(layers, experts)


def n_cpu_moe_mask(layer_ids: tuple[int, ...], num_experts: int, n: int) -> np.ndarray:
    """bool `[L, E]`: resident experts under `--n-cpu-moe n` (the MoE layers with block id < n on the CPU)."""
    ids = np.asarray(layer_ids)
    return np.repeat((ids >= int(n))[:, None], num_experts, axis=1)


def n_cpu_moe_for(layer_ids: tuple[int, ...], gpu_layers: int) -> int:
    """The `--n-cpu-moe N` that leaves the last `gpu_layers` MoE layers on the GPU."""
    ids = sorted(int(i) for i in layer_ids)
    if not 0 <= gpu_layers <= len(ids):
        raise InputError("GPU layers", f"in [0, {len(ids)}]", gpu_layers)
    return ids[-1] + 1 if gpu_layers == 0 else ids[len(ids) - gpu_layers]
