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

__all__ = ["replicate_hottest", "replicate_hottest_phy2log"]

#: Subtracted from the share of an expert a GPU may not take (or that would not fit): below any
#: real share (loads are finite and >= 0), so one argmax picks among the allowed experts.
EXCLUDED = 1e300


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
    """int `[layers, G, redundant_per_gpu]`: the expert in each extra slot (greedy, see module).

    load: float64 `[layers, E]`. All layers advance together, one extra slot per layer per pass.
    GPU g holds expert e if e is in its block (`e // (E/G) == g`) or in its extra slots so far.
    A pass reads each `[layers, E]` element a few times only: the shares are updated where they
    change (one expert per layer); the choice is one argmax of `share - EXCLUDED * ruled_out`; the
    busiest GPU's load is read at its argmax (along short rows several times faster than a max);
    the loads change on the expert's holders only (its home GPU, and the GPUs with an extra slot
    equal to it: one compare over `[layers, G, redundant_per_gpu]`, on ids of the narrowest integer
    type that holds them). These are the same float operations on
    the same values as recomputing every share and subtracting `holders * lost` from every GPU, so
    the plans are exactly those of that plain formulation.
    """
    layers, experts = load.shape
    block = experts // num_gpus
    rows = np.arange(layers)
    at_row_expert, at_row_gpu = rows * experts, rows * num_gpus  # flat index of [row, 0]
    home = np.arange(experts) // block
    replicas = np.ones((layers, experts))
    share = load / replicas  # the load per replica now, and with one more replica
    new_share = load / (replicas + 1)
    gpu_load = load.reshape(layers, num_gpus, block).sum(axis=2)
    extra = np.full((layers, num_gpus, redundant_per_gpu), -1, dtype=np.min_scalar_type(-experts))
    if redundant_per_gpu == 0:
        return extra
    open_load = gpu_load.copy()  # gpu_load, and inf once a GPU has no free slot left
    free = np.full(layers * num_gpus, redundant_per_gpu)
    after = np.empty((layers, experts))  # scratch: the GPU's load with one more replica of each expert
    over = np.empty((layers, experts), dtype=bool)
    score = np.empty((layers, experts))
    holds = np.empty(extra.shape, dtype=bool)  # scratch: extra slots holding the choice
    flat_share, flat_new, flat_replicas, flat_load = (a.reshape(-1) for a in (share, new_share, replicas, load))
    flat_gpu_load, flat_open, flat_score = gpu_load.reshape(-1), open_load.reshape(-1), score.reshape(-1)
    blocks = score.reshape(layers, num_gpus, block)  # [row, gpu]: the GPU's own block of scores
    slots = extra.reshape(-1)
    for _ in range(num_gpus * redundant_per_gpu):
        # 1. the least loaded GPU with a free slot
        gpu = open_load.argmin(axis=1)
        at_gpu = at_row_gpu + gpu
        # 2. the hottest expert it may hold that keeps it at or below the busiest GPU, else the coldest
        np.add(flat_gpu_load[at_gpu][:, None], new_share, out=after)
        busiest = flat_gpu_load[at_row_gpu + gpu_load.argmax(axis=1)]
        np.greater(after, busiest[:, None], out=over)
        # score = share - EXCLUDED * over, branch-free (share + -1e300 is -1e300; share + -0.0 is share)
        np.multiply(over, -EXCLUDED, out=score)
        score += share
        blocks[rows, gpu] = -EXCLUDED  # its own block
        taken = extra.reshape(-1, redundant_per_gpu)[at_gpu]
        if redundant_per_gpu > 1:  # with one extra slot per GPU, a GPU with a free one holds no extra yet
            layer_of, slot = np.nonzero(taken >= 0)
            score[layer_of, taken[layer_of, slot]] = -EXCLUDED  # its extra slots so far
        expert = score.argmax(axis=1)
        at = at_row_expert + expert
        stuck = np.flatnonzero(flat_score[at] < 0)  # nothing fits
        if stuck.size:
            may = home[None, :] != gpu[stuck, None]
            held = taken[stuck]
            layer_of, slot = np.nonzero(held >= 0)
            may[layer_of, held[layer_of, slot]] = False
            expert[stuck] = np.where(may, new_share[stuck], np.inf).argmin(axis=1)
            assert may[np.arange(stuck.size), expert[stuck]].all()  # redundant_per_gpu <= E - E/G
            at = at_row_expert + expert
        # 3. the expert's load is now split over one more replica: its holders give some away
        gained = flat_new[at]
        lost = flat_share[at] - gained
        at_home = at_row_gpu + home[expert]
        flat_gpu_load[at_home] -= lost
        flat_open[at_home] -= lost
        # the GPUs holding it in an extra slot: one per row at most once (a GPU takes an expert once)
        np.equal(extra, expert.astype(extra.dtype)[:, None, None], out=holds)
        at_holder = np.flatnonzero(holds.any(axis=2) if redundant_per_gpu > 1 else holds)  # flat [row, gpu]
        lost_there = lost[at_holder // num_gpus]
        flat_gpu_load[at_holder] -= lost_there
        flat_open[at_holder] -= lost_there
        flat_gpu_load[at_gpu] += gained
        flat_open[at_gpu] += gained
        flat_replicas[at] += 1
        flat_share[at] = flat_load[at] / flat_replicas[at]
        flat_new[at] = flat_load[at] / (flat_replicas[at] + 1)
        # 4. the slot is filled: the GPU joins the expert's holders
        slot = at_gpu * redundant_per_gpu + redundant_per_gpu - free[at_gpu]
        slots[slot] = expert
        free[at_gpu] -= 1
        flat_open[at_gpu[free[at_gpu] == 0]] = np.inf
    assert (extra >= 0).all()
    return extra
