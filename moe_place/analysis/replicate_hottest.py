"""A simple baseline plan: contiguous blocks plus redundant slots filled with the hottest experts.

This is the plan a user gets without a solver, used by the analyzer to show how much a plan
made on one window loses on the next. The solvers (`moe_place.solvers`) do better.

Per layer, each GPU keeps its contiguous block of `E/G` experts and gets `redundant_per_gpu`
extra slots, filled one at a time: the least loaded GPU with a free slot takes a replica of the
hottest expert (by load per replica) that it does not hold yet and that keeps it at or below the
layer's busiest GPU; if none fits, it takes the coldest expert it may hold. So the busiest GPU
never gets busier than under the contiguous layout, unless a slot must be filled and every
expert it may still take carries load (a layer with fewer idle experts than extra slots).
"""

from __future__ import annotations

import numpy as np

from moe_place.analysis.profile import check_expert_load
from moe_place.errors import InputError
from moe_place.placement import Placement


def replicate_hottest(expert_load: np.ndarray, num_gpus: int, redundant_per_gpu: int = 1) -> Placement:
    """Placement of `[layers, E]` loads on `num_gpus` GPUs with `redundant_per_gpu` extra slots each."""
    experts = np.asarray(expert_load).shape[-1]
    return Placement(replicate_hottest_phy2log(expert_load, num_gpus, redundant_per_gpu), experts, num_gpus)


def replicate_hottest_phy2log(expert_load: np.ndarray, num_gpus: int, redundant_per_gpu: int = 1) -> np.ndarray:
    """int64 `[layers, E + G*redundant_per_gpu]`: the `phy2log` of `replicate_hottest`, unvalidated.

    For callers that plan thousands of layers at once (see `out_of_sample`) and need no `log2phy`.
    """
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
    return phy2log.reshape(layers, -1)


def _fill_redundant(load: np.ndarray, num_gpus: int, redundant_per_gpu: int) -> np.ndarray:
    """int64 `[layers, G, redundant_per_gpu]`: the expert in each extra slot (greedy, see module).

    load: float64 `[layers, E]`. All layers advance together, one extra slot per layer per pass.
    GPU g holds expert e if e is in its block (`e // (E/G) == g`) or in its extra slots so far.
    """
    layers, experts = load.shape
    block = experts // num_gpus
    rows = np.arange(layers)
    home = np.arange(experts) // block
    replicas = np.ones((layers, experts))
    gpu_load = load.reshape(layers, num_gpus, block).sum(axis=2)
    free = np.full((layers, num_gpus), redundant_per_gpu)
    extra = np.full((layers, num_gpus, redundant_per_gpu), -1, dtype=np.int64)
    for _ in range(num_gpus * redundant_per_gpu):
        share = load / replicas
        new_share = load / (replicas + 1)
        # 1. the least loaded GPU with a free slot
        gpu = np.where(free > 0, gpu_load, np.inf).argmin(axis=1)
        # 2. the hottest expert it may hold that keeps it at or below the busiest GPU, else the coldest
        may = home[None, :] != gpu[:, None]
        taken = extra[rows, gpu, :]
        layer_of, slot = np.nonzero(taken >= 0)
        may[layer_of, taken[layer_of, slot]] = False
        fits = may & (gpu_load[rows, gpu][:, None] + new_share <= gpu_load.max(axis=1)[:, None])
        expert = np.where(fits.any(axis=1), np.where(fits, share, -np.inf).argmax(axis=1),
                          np.where(may, new_share, np.inf).argmin(axis=1))
        assert may[rows, expert].all()  # redundant_per_gpu <= E - E/G leaves an expert to take
        # 3. the expert's load is now split over one more replica: its holders give some away
        holders = (np.arange(num_gpus)[None, :] == home[expert][:, None]) | (extra == expert[:, None, None]).any(axis=2)
        gained = new_share[rows, expert]
        gpu_load -= holders * (share[rows, expert] - gained)[:, None]
        gpu_load[rows, gpu] += gained
        replicas[rows, expert] += 1
        extra[rows, gpu, redundant_per_gpu - free[rows, gpu]] = expert
        free[rows, gpu] -= 1
    assert (extra >= 0).all()
    return extra
