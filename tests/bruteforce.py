"""Exact optimum of one tiny layer by enumeration: the oracle the solvers are tested against (test code,
imported by the tests beside it: `from bruteforce import brute_force_layer`).

Problem (docs/MODEL.md, even split): choose replica counts `r[e] >= 1` with `sum r = G*S` and
put the replicas on `G` GPUs with exactly `S` slots each, never two replicas of one expert on one
GPU, minimising the busiest GPU's load `max_g sum_{e on g} w[e] / r[e]`.

The search starts from a simple feasible plan (counts by largest share, replicas spread over the
GPUs with most free slots; deliberately independent of the solvers it checks), then walks the
experts hottest first; for each it picks a replica count and then the set of GPUs holding it.
Two kinds of pruning keep it small and exact:

1. GPU symmetry: GPUs holding the same experts so far are interchangeable, so within each such
   class only the first `c` GPUs are ever chosen (each class contributes a count, not a subset).
2. Bound: a branch stops as soon as a GPU reaches the best load found so far (we want one optimal
   plan, not all of them), when the room left below the best on GPUs with a free slot cannot take
   the load of the experts left, and when the slots left cannot be filled by the experts left.

Meant for <= 8 experts and <= 4 GPUs (a few milliseconds); larger cases are allowed up to
`MAX_EXPERTS` x `MAX_GPUS` but grow exponentially.
"""

from __future__ import annotations

from itertools import product

import numpy as np

from moe_place.errors import InfeasibleError, InputError

MAX_EXPERTS = 10
MAX_GPUS = 8
_REL_EPS = 1e-12  # branches within this of the best are dropped: one optimal plan is enough


def brute_force_layer(loads: np.ndarray, num_gpus: int, slots_per_gpu: int) -> tuple[float, np.ndarray]:
    """Exact busiest-GPU load and one optimal plan of a tiny layer.

    loads: float `[E]`, non-negative load of each logical expert.
    Returns `(optimum, phy2log)`: the optimal busiest-GPU load (float, computed as `w[e] / r[e]`
    sums, the same way `Placement.gpu_loads` does) and int64 `[G*S]` phy2log, slot `p` on GPU
    `p // S`, each GPU's experts in ascending id order.
    Raises InputError for sizes beyond `MAX_EXPERTS` / `MAX_GPUS` or bad loads, InfeasibleError
    when `E > G*S` (an expert without a slot) or `G*S > E*G` (a duplicate on some GPU is forced).
    """
    loads = np.asarray(loads, dtype=np.float64)
    if loads.ndim != 1 or loads.size == 0 or not np.isfinite(loads).all() or (loads < 0).any():
        raise InputError("loads", "a non-empty 1-D array of finite values >= 0", f"shape {loads.shape}")
    experts = loads.size
    if not 1 <= experts <= MAX_EXPERTS:
        raise InputError("loads", f"at most {MAX_EXPERTS} experts for brute force", experts)
    if not 1 <= num_gpus <= MAX_GPUS:
        raise InputError("num_gpus", f"1..{MAX_GPUS} for brute force", num_gpus)
    if slots_per_gpu < 1:
        raise InputError("slots_per_gpu", "an integer >= 1", slots_per_gpu)
    num_slots = num_gpus * slots_per_gpu
    if num_slots < experts:
        raise InfeasibleError(f"{num_slots} slots cannot hold {experts} experts once each")
    if num_slots > experts * num_gpus:
        raise InfeasibleError(f"{num_slots} slots on {num_gpus} GPUs need a duplicate expert on some GPU "
                              f"(only {experts} experts)")

    order = [int(e) for e in np.argsort(-loads, kind="stable")]  # hottest first: tight loads early
    search = _Search(loads, order, num_gpus, slots_per_gpu)
    search.best_holders = _greedy_holders(loads, order, num_gpus, slots_per_gpu)  # first incumbent
    search.best = _max_gpu_load(loads, search.best_holders, num_gpus)
    search.run()
    gpu_experts: list[list[int]] = [[] for _ in range(num_gpus)]
    for expert, gpus in search.best_holders.items():
        for gpu in gpus:
            gpu_experts[gpu].append(expert)
    phy2log = np.array([e for gpu in gpu_experts for e in sorted(gpu)], dtype=np.int64)
    return search.best, phy2log


class _Search:
    """Depth-first enumeration state (private to `brute_force_layer`)."""

    def __init__(self, loads: np.ndarray, order: list[int], num_gpus: int, slots_per_gpu: int):
        self.loads = loads
        self.order = order
        self.num_gpus = num_gpus
        self.slots = slots_per_gpu
        self.best = float("inf")
        self.best_holders: dict[int, tuple[int, ...]] | None = None
        self.gpu_load = [0.0] * num_gpus
        self.gpu_used = [0] * num_gpus
        self.gpu_content: list[tuple[int, ...]] = [()] * num_gpus  # experts placed so far (symmetry classes)
        self.holders: dict[int, tuple[int, ...]] = {}
        self.rest_load = [float(loads[order[d:]].sum()) for d in range(len(order))]  # load not yet placed

    def run(self, depth: int = 0) -> None:
        experts_left = len(self.order) - depth
        free = self.num_gpus * self.slots - sum(self.gpu_used)
        if experts_left == 0:
            value = _max_gpu_load(self.loads, self.holders, self.num_gpus)
            if free == 0 and value < self.best:
                self.best, self.best_holders = value, dict(self.holders)
            return
        expert = self.order[depth]
        # The experts left carry exactly their total load whatever their replica counts, and only
        # into GPUs with a free slot: if that room (below the best) cannot take it, stop.
        room = sum(max(0.0, self.best - load) for load, used in zip(self.gpu_load, self.gpu_used)
                   if used < self.slots)
        if room <= self.rest_load[depth] * (1 + _REL_EPS):
            return
        # r replicas for this expert; the experts after it need between 1 and G slots each.
        low = max(1, free - (experts_left - 1) * self.num_gpus)
        high = min(self.num_gpus, free - (experts_left - 1))
        open_gpus = sum(1 for used in self.gpu_used if used < self.slots)
        for replicas in range(low, min(high, open_gpus) + 1):
            share = self.loads[expert] / replicas
            for gpus in self._gpu_choices(replicas, share):
                if any(self.gpu_load[g] + share >= self.best * (1 - _REL_EPS) for g in gpus):
                    continue  # the best improved since the choices were listed
                self._place(expert, gpus, share, +1)
                self.run(depth + 1)
                self._place(expert, gpus, share, -1)

    def _gpu_choices(self, replicas: int, share: float):
        """Sets of `replicas` GPUs, one per GPU-symmetry class pattern, that keep every load < best."""
        classes: dict[tuple, list[int]] = {}
        for gpu in range(self.num_gpus):
            if self.gpu_used[gpu] < self.slots and self.gpu_load[gpu] + share < self.best * (1 - _REL_EPS):
                classes.setdefault((self.gpu_content[gpu], self.gpu_used[gpu]), []).append(gpu)
        members = list(classes.values())
        for counts in product(*(range(len(m) + 1) for m in members)):
            if sum(counts) == replicas:
                yield tuple(g for m, c in zip(members, counts) for g in m[:c])

    def _place(self, expert: int, gpus: tuple[int, ...], share: float, sign: int) -> None:
        for gpu in gpus:
            self.gpu_used[gpu] += sign
            if sign > 0:
                self.gpu_load[gpu] += share
                self.gpu_content[gpu] = self.gpu_content[gpu] + (expert,)
            else:
                self.gpu_load[gpu] -= share
                self.gpu_content[gpu] = self.gpu_content[gpu][:-1]
        if sign > 0:
            self.holders[expert] = gpus
        else:
            del self.holders[expert]


def _greedy_holders(loads: np.ndarray, order: list[int], num_gpus: int,
                    slots_per_gpu: int) -> dict[int, tuple[int, ...]]:
    """A quick feasible plan to start the search from (its load prunes the first branches).

    Replicas go one at a time to the expert with the largest share `w[e] / r[e]` (at most G each);
    then experts, hottest first, fill the least-loaded GPUs with a free slot, one replica per GPU.
    Such a plan always exists once `E <= G*S <= E*G` (the counts keep every expert within G GPUs
    and the slots balance by construction), so the search below only has to beat it.
    """
    replicas = np.ones(len(loads), dtype=np.int64)
    for _ in range(num_gpus * slots_per_gpu - len(loads)):
        share = np.where(replicas < num_gpus, loads / replicas, -1.0)
        replicas[int(np.argmax(share))] += 1
    gpu_load, gpu_free = np.zeros(num_gpus), np.full(num_gpus, slots_per_gpu)
    holders: dict[int, tuple[int, ...]] = {}
    for expert in sorted(order, key=lambda e: -int(replicas[e])):  # most replicas first: they need most GPUs
        # GPUs with the most free slots first (keeps later experts placeable), then least loaded.
        ranked = sorted(range(num_gpus), key=lambda g: (-gpu_free[g], gpu_load[g]))
        gpus = tuple(sorted(ranked[:replicas[expert]]))
        gpu_load[list(gpus)] += loads[expert] / replicas[expert]
        gpu_free[list(gpus)] -= 1
        holders[expert] = gpus
    assert (gpu_free == 0).all(), gpu_free
    return holders


def _max_gpu_load(loads: np.ndarray, holders: dict[int, tuple[int, ...]], num_gpus: int) -> float:
    """Busiest-GPU load of a complete plan, summed afresh (no drift from the search's += / -=)."""
    gpu_load = np.zeros(num_gpus)
    for expert in sorted(holders):
        gpus = holders[expert]
        gpu_load[list(gpus)] += loads[expert] / len(gpus)
    return float(gpu_load.max())
