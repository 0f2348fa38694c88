"""A simple baseline plan: contiguous blocks plus redundant slots filled with the hottest experts.

This is the plan a user gets without a solver, used by the analyzer to show how much a plan
made on one window loses on the next. The solvers (`moe_place.solvers`) do better.

Per layer, each GPU keeps its contiguous block of `E/G` experts and gets `redundant_per_gpu`
extra slots. The extra slots are filled one at a time: the expert with the highest load per
replica gets one more replica, on the least loaded GPU that has a free slot and does not hold
that expert yet (if no GPU qualifies, the next hottest expert is tried).
"""

from __future__ import annotations

import numpy as np

from moe_place.analysis.profile import check_expert_load
from moe_place.errors import InputError
from moe_place.placement import Placement


def replicate_hottest(expert_load: np.ndarray, num_gpus: int, redundant_per_gpu: int = 1) -> Placement:
    """Placement of `[layers, E]` loads on `num_gpus` GPUs with `redundant_per_gpu` extra slots each."""
    loads = check_expert_load(expert_load)
    layers, experts = loads.shape
    if num_gpus < 1 or experts % num_gpus:
        raise InputError("num_gpus", f"a divisor of the {experts} experts", num_gpus)
    if redundant_per_gpu < 0 or (redundant_per_gpu and experts // num_gpus + redundant_per_gpu > experts):
        raise InputError("redundant_per_gpu", f"an integer in [0, {experts - experts // num_gpus}]", redundant_per_gpu)
    block = experts // num_gpus
    phy2log = np.empty((layers, num_gpus, block + redundant_per_gpu), dtype=np.int64)
    phy2log[:, :, :block] = np.arange(experts).reshape(num_gpus, block)
    phy2log[:, :, block:] = _fill_redundant(loads, num_gpus, redundant_per_gpu)
    return Placement(phy2log.reshape(layers, -1), experts, num_gpus)


def _fill_redundant(load: np.ndarray, num_gpus: int, redundant_per_gpu: int) -> np.ndarray:
    """int64 `[layers, G, redundant_per_gpu]`: the expert in each extra slot (greedy, see module).

    load: float64 `[layers, E]`. All layers advance together, one extra slot per layer per pass.
    """
    layers, experts = load.shape
    block = experts // num_gpus
    rows = np.arange(layers)
    holds = np.zeros((layers, num_gpus, experts), dtype=bool)  # holds[l, g, e]: GPU g has a replica of e
    holds[:, np.arange(experts) // block, np.arange(experts)] = True
    replicas = np.ones((layers, experts))
    gpu_load = load.reshape(layers, num_gpus, block).sum(axis=2)
    free = np.full((layers, num_gpus), redundant_per_gpu)
    extra = np.full((layers, num_gpus, redundant_per_gpu), -1, dtype=np.int64)
    for _ in range(num_gpus * redundant_per_gpu):
        share = load / replicas
        expert = share.argmax(axis=1)
        allowed = (free > 0) & ~holds[rows, :, expert]  # [layers, G]
        for layer in np.nonzero(~allowed.any(axis=1))[0]:  # rare: the hottest fits nowhere
            expert[layer], allowed[layer] = _next_fitting(share[layer], holds[layer], free[layer] > 0)
        gpu = np.where(allowed, gpu_load, np.inf).argmin(axis=1)
        # the expert's load is now split over one more replica
        old_share = share[rows, expert]
        new_share = load[rows, expert] / (replicas[rows, expert] + 1)
        gpu_load -= holds[rows, :, expert] * (old_share - new_share)[:, None]
        gpu_load[rows, gpu] += new_share
        holds[rows, gpu, expert] = True
        replicas[rows, expert] += 1
        extra[rows, gpu, redundant_per_gpu - free[rows, gpu]] = expert
        free[rows, gpu] -= 1
    assert (extra >= 0).all()
    return extra


def _next_fitting(share: np.ndarray, holds: np.ndarray, open_gpus: np.ndarray) -> tuple[int, np.ndarray]:
    """One layer: the hottest expert (load per replica) some open GPU can take, and the GPUs that can."""
    for expert in np.argsort(-share, kind="stable"):
        allowed = open_gpus & ~holds[:, expert]
        if allowed.any():
            return int(expert), allowed
    raise AssertionError("no expert fits a free slot")  # unreachable: redundant_per_gpu <= E - E/G
