"""`fast`: a deterministic construction + local search for one layer, in tens of milliseconds.

Model: the even split (docs/MODEL.md), exactly `S = P/G` slots per GPU, never two replicas of
one expert on one GPU. With several windows it plans on their summed loads and reports the
problem's window objective.

1. Start. The better of (a) replica counts from the min-max apportionment (bounds.apportion,
   capped at `G` replicas) packed by conflict-aware LPT (pieces heaviest first, each to the
   lightest GPU with a free slot that does not hold its expert) and (b) DeepSeek EPLB's plan
   when it has no co-located replicas. So `fast` starts no worse than `eplb`.
2. Target packing. For targets `T` between the lower bound and the best plan so far
   (bisection): start from the fewest replicas `ceil(w/T)`, pack pieces heaviest first into the
   lightest GPU where they fit under `T`; a piece that fits nowhere makes its expert take one
   more replica (all its pieces shrink) while spare slots remain; spare slots left at the end
   go to the heaviest piece that fits. This finds plans whose replica counts differ from the
   apportionment (e.g. 196.67 on [600, 560, 120, 120, 20, 10, 10, 10], 8 GPUs x 2 slots).
   Two slots per GPU (`S = 2`): a plan is a pairing of pieces, and for fixed counts the sorted
   pairing (largest with smallest) is the best one (bounds.pairing_lp_bound, (i)). So the
   counts are searched directly on that value (`pair_replicas`, ~10 ms at EP144) and the pieces
   paired (`pair_plan`); a pair of two replicas of one expert (possible only when all pieces
   between them are equal) is swapped away by `_repair_colocation`, which may cost some load,
   so step 3 follows. Done from the apportionment in step 1 (part of the construction, also in
   the anytime fallback) and again from the best plan after step 2.
3. Local search around the busiest GPU `g`, best improvement, until no move lowers
   `(max load, number of GPUs at the max)`: swap a slot of `g` with a slot elsewhere; move a
   replica of an expert on `g` to another expert (re-split); give an expert on `g` one more
   replica in place of a replica of another expert elsewhere; when none helps, swap two slots of
   `g` for two slots of another GPU (up to 12 slots per GPU); then re-split the slots of `g`
   and two light GPUs among the three in the best of all ways (up to 4 slots per GPU).
   Vectorised with numpy.
   It runs on the start (which narrows step 2's range) and again on the best plan after step 2.

Reported lower bound: the problem's window bound (bounds 1-3 of moe_place.solvers.bounds,
computed for all layers at once by `prepare`); for 2-slot layers with one window whose plan is
above it, also bound 4 (`bounds.pairing_lp_bound`, 3-6 small LPs, ~0.05 s a layer at EP144),
unless a time limit leaves the layer less than 0.1 s (the 1 s anytime path skips it). Where the
plan stays more than 1% above bound 4, up to 3 integer pairing tests (`bounds.pairing_ip`, bound
5) at 0.9% below the plan either certify it or hand back replica counts that pair lower (the new
plan, after local search); not with a current plan, nor when a limit leaves the layer < 2 s.

Migration-aware mode (`problem.current` given): starts from the current plan and keeps its slot
positions; only moves (step 3) that lower `busiest load + move_cost_weight * moved slots` are
taken, never past `max_moved_slots`. Unmoved experts keep their slots.

Deterministic: no randomness and no wall-clock decisions unless a `time_limit_s` cuts the
search short (it then returns the best plan so far).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import time
from typing import ClassVar

import numpy as np

from moe_place.placement import has_colocation
from moe_place.problem import PlacementProblem
from moe_place.solvers.base import LayerSolution, register
from moe_place.solvers.bounds import (apportion, layer_lower_bound, model_lower_bounds, pairing_ip, pairing_lp_bound,
                                     window_lower_bound)
from moe_place.solvers.deepseek import eplb_rebalance
from moe_place.solvers.evaluate import window_objective

__all__ = ["FastSolver", "fast_layer", "local_search", "lpt_pack", "pair_plan", "pair_replicas", "pair_values",
           "target_pack"]

_TOL = 1e-12  # relative tolerance of load comparisons
REPACK_MAX_SLOTS = 4  # exact three-GPU re-splits only up to this many slots per GPU (5775 ways at 4)
REPACK_PARTNERS = 8  # the busiest GPU is re-split with pairs of the lightest this many GPUs
PAIR_SWAP_MAX_SLOTS = 12  # two-for-two swaps only up to this many slots per GPU (their count grows as S**4)
PAIR_GIVERS = 4  # pair_replicas gives replicas to the experts of this many heaviest pairs
STOP_GAP = 1e-4  # a plan this close to the lower bound is good enough (auto mode hands the rest to cpsat)
IP_GAP = 0.01  # 2-slot layers still this far above bound 4 get the integer pairing test (bounds.pairing_ip)
_PAIRING_IP_MIN_S = 2.0  # ... when a time limit leaves the layer this much (a test costs 0.1-0.6 s at EP144)
_PAIRING_BOUND_MIN_S = 0.1  # bound 4 is reported only when a layer has this much time left (never in anytime runs)


# ---------------------------------------------------------------------- construction
def lpt_pack(loads: np.ndarray, replicas: np.ndarray, num_gpus: int) -> np.ndarray:
    """int64 `[G, S]`: pieces `w[e]/r[e]` heaviest first, each to the lightest open GPU without `e`.

    loads: float64 `[E]`; replicas: int `[E]`, `1 <= r[e] <= G`, `sum r = G*S`.
    A piece that finds only GPUs holding its expert is co-located, then repaired by a swap.
    `moe_place.solvers.quick` has the same rule vectorised over layers (`_lpt`); kept apart: this one
    repairs co-location by swaps right away, quick leaves it to its later steps, and each solver's plans
    are pinned by its own tests and records.
    """
    experts = loads.size
    slots = int(replicas.sum()) // num_gpus
    share = loads / replicas
    order = sorted(range(experts), key=lambda e: (-share[e], e))
    heap = [(0.0, g) for g in range(num_gpus)]
    content: list[list[int]] = [[] for _ in range(num_gpus)]
    load = [0.0] * num_gpus
    for e in order:
        for _ in range(int(replicas[e])):
            skipped = []
            while heap and e in content[heap[0][1]]:
                skipped.append(heapq.heappop(heap))
            if heap:
                _, g = heapq.heappop(heap)
            else:  # only GPUs holding e have room: co-locate now, repair below
                skipped.sort()
                _, g = skipped.pop(0)
            content[g].append(e)
            load[g] += share[e]
            if len(content[g]) < slots:
                heapq.heappush(heap, (load[g], g))
            for item in skipped:
                heapq.heappush(heap, item)
    table = np.array(content, dtype=np.int64)
    _repair_colocation(table, share)
    return table


def _repair_colocation(table: np.ndarray, share: np.ndarray) -> None:
    """Swap co-located replicas away (in place): always possible when every `r[e] <= G`."""
    num_gpus = table.shape[0]
    while True:
        if not has_colocation(table.ravel(), num_gpus):
            return
        dup = None
        for g in range(num_gpus):
            row = table[g]
            values, counts = np.unique(row, return_counts=True)
            if (counts > 1).any():
                dup = (g, int(values[counts > 1][0]))
                break
        if dup is None:
            return
        g, e = dup
        i = int(np.flatnonzero(table[g] == e)[0])
        load = share[table].sum(axis=1)
        best = None
        for h in range(num_gpus):
            if h == g or e in table[h]:
                continue
            for j, f in enumerate(table[h]):
                if f in table[g]:
                    continue
                worst = max(load[g] - share[e] + share[f], load[h] - share[f] + share[e])
                if best is None or worst < best[0]:
                    best = (worst, h, j)
        assert best is not None, "a replica count above the number of GPUs"
        _, h, j = best
        table[g, i], table[h, j] = table[h, j], table[g, i]


def target_pack(loads: np.ndarray, num_gpus: int, slots: int, target: float) -> np.ndarray | None:
    """int64 `[G, S]` with every GPU at most `target`, or None when this greedy finds none.

    Pieces start at the fewest replicas `max(1, ceil(w/T))`; see step 2 of the module docstring.
    Pure Python with two heaps (pieces by size, GPUs by load; stale entries skipped lazily).
    """
    experts = loads.size
    limit = target * (1 + _TOL)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(target > 0, loads / target, np.where(loads > 0, np.inf, 0.0))
    if not np.isfinite(ratio).all():
        return None
    replicas = np.maximum(1, np.ceil(ratio - _TOL)).astype(np.int64)
    if replicas.max() > num_gpus or replicas.sum() > num_gpus * slots:
        return None
    spare = num_gpus * slots - int(replicas.sum())
    w = loads.tolist()
    r = replicas.tolist()
    pending = list(r)                                  # pieces of each expert not placed yet
    load = [0.0] * num_gpus
    content: list[list[int]] = [[] for _ in range(num_gpus)]
    holders: list[list[int]] = [[] for _ in range(experts)]
    gpu_heap = [(0.0, g) for g in range(num_gpus)]     # (load, gpu); stale when load changed
    piece_heap = [(-w[e] / r[e], e) for e in range(experts)]
    heapq.heapify(piece_heap)
    while piece_heap:
        neg, e = piece_heap[0]
        piece = w[e] / r[e]
        if pending[e] == 0 or -neg != piece:
            heapq.heappop(piece_heap)
            if pending[e] and -neg != piece:
                heapq.heappush(piece_heap, (-piece, e))
            continue
        skipped, chosen = [], -1
        while gpu_heap:
            gl, g = gpu_heap[0]
            if gl != load[g] or len(content[g]) >= slots:
                heapq.heappop(gpu_heap)      # stale or full
                continue
            if e in content[g]:
                skipped.append(heapq.heappop(gpu_heap))
                continue
            chosen = g
            break
        for item in skipped:
            heapq.heappush(gpu_heap, item)
        if chosen >= 0 and load[chosen] + piece <= limit:
            heapq.heappop(gpu_heap)
            content[chosen].append(e)
            holders[e].append(chosen)
            load[chosen] += piece
            heapq.heappush(gpu_heap, (load[chosen], chosen))
            pending[e] -= 1
            continue
        if spare == 0 or r[e] >= num_gpus:
            return None
        spare -= 1  # split e once more: its placed pieces shrink, one more piece to place
        smaller = w[e] / (r[e] + 1)
        for g in holders[e]:
            load[g] -= piece - smaller
            heapq.heappush(gpu_heap, (load[g], g))
        r[e] += 1
        pending[e] += 1
        heapq.heappush(piece_heap, (-smaller, e))
    if spare:
        counts = np.array(r, dtype=np.float64)
        load_arr = np.array(load)
        for g in range(num_gpus):  # spare slots: one more replica of the heaviest piece that fits
            while len(content[g]) < slots:
                allowed = counts < num_gpus
                allowed[content[g]] = False
                grown = loads / (counts + 1)
                fits = allowed & (load_arr[g] + grown <= limit)
                if fits.any():
                    e = int(np.argmax(np.where(fits, loads / counts, -1.0)))
                else:
                    e = int(np.argmin(np.where(allowed, grown, np.inf)))
                load_arr[holders[e]] -= loads[e] / counts[e] - grown[e]
                counts[e] += 1
                content[g].append(e)
                holders[e].append(g)
                load_arr[g] += grown[e]
    return np.array(content, dtype=np.int64)


# ---------------------------------------------------------------------- two slots per GPU
def pair_values(values: np.ndarray, counts: np.ndarray, num_gpus: int) -> np.ndarray:
    """float64 `[C]`: sorted-pairing value `max_i a_(i) + a_(P+1-i)` of C candidate piece sets.

    values: float64 `[C, E]` piece size of each expert; counts: int `[C, E]` its number of
    pieces (`sum = P = 2G` in every row). With 2 slots per GPU this is the least busiest load
    of any pairing of those pieces (bounds.pairing_lp_bound, (i)), duplicates on a GPU allowed.
    """
    rows, experts = values.shape
    total = 2 * num_gpus
    order = np.argsort(values, axis=1, kind="stable")
    sorted_values = np.take_along_axis(values, order, axis=1)
    cum = np.cumsum(np.take_along_axis(counts, order, axis=1), axis=1)         # [C, E] ascending
    shift = np.arange(rows)[:, None] * (total + 1)
    ranks = np.arange(total)[None, :] + shift                                   # [C, P]
    index = np.searchsorted((cum + shift).ravel(), ranks.ravel(), side="right").reshape(rows, total)
    index -= np.arange(rows)[:, None] * experts
    ascending = np.take_along_axis(sorted_values, np.minimum(index, experts - 1), axis=1)
    return (ascending[:, :num_gpus] + ascending[:, ::-1][:, :num_gpus]).max(axis=1)


def pair_replicas(loads: np.ndarray, replicas: np.ndarray, num_gpus: int, max_iterations: int | None = None) -> np.ndarray:
    """int64 `[E]`: replica counts improved for the sorted-pairing value (2 slots per GPU).

    Local search over counts: the `PAIR_GIVERS` heaviest pairs of the sorted pairing (largest
    `a_(i) + a_(P+1-i)`) hold pieces of a few experts; try moving one replica from any other
    expert to one of them (its pieces shrink), all candidates evaluated at once by
    `pair_values`, and take the best that lowers the value (on a plateau of tied pairs, one that
    keeps it and unties a pair). Deterministic; ~10 ms for 256 experts on 144 GPUs.
    """
    w = np.asarray(loads, dtype=np.float64)
    r = np.asarray(replicas, dtype=np.int64).copy()
    experts = w.size
    iterations = max_iterations if max_iterations is not None else 4 * (2 * num_gpus - experts) + 50

    def score(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        values = w[None, :] / counts
        top = pair_values(values, counts, num_gpus)
        return top, values

    for _ in range(iterations):
        top, values = score(r[None])
        pieces = np.repeat(np.arange(experts), r)
        ascending = pieces[np.argsort(np.repeat(values[0], r), kind="stable")]
        sums = w[ascending[:num_gpus]] / r[ascending[:num_gpus]] + w[ascending[::-1][:num_gpus]] / r[ascending[::-1][:num_gpus]]
        heavy = np.argsort(-sums, kind="stable")[:PAIR_GIVERS]
        ties = int((sums >= top[0] * (1 - _TOL)).sum())
        moves = []
        for give in sorted(set(ascending[::-1][heavy].tolist()) | set(ascending[heavy].tolist())):
            if r[give] >= num_gpus:
                continue
            take = np.flatnonzero((r > 1) & (np.arange(experts) != give))
            if take.size == 0:
                continue
            cand = np.repeat(r[None], take.size, axis=0)
            cand[:, give] += 1
            cand[np.arange(take.size), take] -= 1
            moves.append(cand)
        if not moves:
            break
        cand = np.concatenate(moves)
        values = w[None, :] / cand
        tops = pair_values(values, cand, num_gpus)
        best = int(np.argmin(tops))
        if tops[best] < top[0] * (1 - _TOL):
            r = cand[best]
            continue
        if ties > 1:  # plateau: accept a move that keeps the value and removes one tied pair
            same = np.flatnonzero(tops <= top[0] * (1 + _TOL))
            done = False
            for k in same[:8]:
                vals = np.repeat(w / cand[k], cand[k])
                asc = np.sort(vals)
                if int(((asc[:num_gpus] + asc[::-1][:num_gpus]) >= top[0] * (1 - _TOL)).sum()) < ties:
                    r, done = cand[k], True
                    break
            if done:
                continue
        break
    return r


def pair_plan(loads: np.ndarray, replicas: np.ndarray, num_gpus: int) -> np.ndarray:
    """int64 `[G, 2]`: sorted pairing of the pieces (largest with smallest), co-located replicas
    swapped away by `_repair_colocation` (which may raise the busiest load; local search follows)."""
    w = np.asarray(loads, dtype=np.float64)
    share = w / replicas
    pieces = np.repeat(np.arange(w.size), replicas)
    ascending = pieces[np.argsort(share[pieces], kind="stable")]
    table = np.stack([ascending[::-1][:num_gpus], ascending[:num_gpus]], axis=1).astype(np.int64)
    _repair_colocation(table, share)
    return table


# ---------------------------------------------------------------------- local search
class _State:
    """A layer plan under change: slots `[G, S]`, counts `[G, E]`, replicas, shares, loads."""

    def __init__(self, loads: np.ndarray, table: np.ndarray):
        self.w = loads
        self.table = table.copy()
        self.num_gpus, self.slots = table.shape
        self.count = np.zeros((self.num_gpus, loads.size), dtype=np.int64)
        np.add.at(self.count, (np.repeat(np.arange(self.num_gpus), self.slots), self.table.ravel()), 1)
        self.refresh()

    def refresh(self) -> None:
        self.replicas = self.count.sum(axis=0)
        with np.errstate(divide="ignore", invalid="ignore"):
            self.share = np.where(self.replicas > 0, self.w / np.maximum(self.replicas, 1), 0.0)
        self.load = self.share[self.table].sum(axis=1)

    def set_slot(self, g: int, i: int, expert: int) -> None:
        self.count[g, self.table[g, i]] -= 1
        self.table[g, i] = expert
        self.count[g, expert] += 1


def local_search(loads: np.ndarray, table: np.ndarray, bound: float, current: np.ndarray | None = None,
                 move_cost: float = 0.0, max_moved: int | None = None, max_iterations: int | None = None,
                 deadline: float | None = None, stop_gap: float = STOP_GAP) -> np.ndarray:
    """Improve a plan `[G, S]` by the moves of step 3; returns the new `[G, S]` table.

    Stops when no move improves, after `max_iterations` moves, past `deadline`
    (time.perf_counter seconds) or once the busiest load is within `stop_gap` of `bound`.
    """
    state = _State(np.asarray(loads, dtype=np.float64), table)
    G, S = state.num_gpus, state.slots
    iterations = max_iterations if max_iterations is not None else 20 * G * S + 100
    migrating = current is not None
    moved = int((state.table != current).sum()) if migrating else 0
    for _ in range(iterations):
        if deadline is not None and time.perf_counter() > deadline:
            break
        load = state.load
        g = int(np.argmax(load))
        top = float(load[g])
        tol = _TOL * max(top, 1e-300)
        if top <= bound * (1 + stop_gap):
            break
        others = np.delete(load, g)
        second = float(others.max()) if others.size else 0.0
        move = _best_move(state, g, top, tol, current, moved, move_cost, max_moved, second)
        if move is None:
            break
        kind, args, delta_moved = move
        if kind == "swap":
            i, h, j = args
            a, b = state.table[g, i], state.table[h, j]
            state.set_slot(g, i, b)
            state.set_slot(h, j, a)
        elif kind == "repack":
            gpus, groups = args
            for gpu, group in zip(gpus, groups):
                for i, expert in enumerate(group):
                    state.set_slot(gpu, i, expert)
            # set_slot moves counts one slot at a time; recount the three GPUs exactly
            for gpu in gpus:
                state.count[gpu] = np.bincount(state.table[gpu], minlength=state.w.size)
        elif kind == "swap2":
            i1, i2, h, j1, j2 = args
            a1, a2, b1, b2 = state.table[g, i1], state.table[g, i2], state.table[h, j1], state.table[h, j2]
            state.set_slot(g, i1, b1)
            state.set_slot(g, i2, b2)
            state.set_slot(h, j1, a1)
            state.set_slot(h, j2, a2)
        else:
            h, j, expert = args
            state.set_slot(h, j, expert)
        moved += delta_moved
        state.refresh()
    return state.table


def _best_move(state: _State, g: int, top: float, tol: float, current: np.ndarray | None, moved: int,
               move_cost: float, max_moved: int | None, second: float):
    """The best improving move around the busiest GPU `g`, or None."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return _best_move_inner(state, g, top, tol, current, moved, move_cost, max_moved, second)


def _best_move_inner(state: _State, g: int, top: float, tol: float, current: np.ndarray | None, moved: int,
                     move_cost: float, max_moved: int | None, second: float):
    table, count, share, load, w = state.table, state.count, state.share, state.load, state.w
    G, S = table.shape
    replicas = state.replicas
    on_g = table[g]                                   # [S] experts on the busiest GPU
    share_g = share[on_g]                             # [S]
    held = count > 0                                  # [G, E]
    candidates = []                                   # (score, kind, args, delta_moved)

    # 1. swaps: slot (g, i) <-> slot (h, j)
    share_all = share[table]                           # [G, S]
    new_g = top - share_g[:, None, None] + share_all[None]                  # [S, G, S]
    new_h = load[None, :, None] - share_all[None] + share_g[:, None, None]  # [S, G, S]
    ok = (~held[g][table])[None] & (~held[:, on_g].T)[:, :, None]
    score = np.maximum(new_g, new_h)
    delta = None
    if current is not None:
        cur = current
        d_g = (table[None] != cur[g][:, None, None]).astype(np.int64) - (on_g != cur[g])[:, None, None]
        d_h = (on_g[:, None, None] != cur[None]).astype(np.int64) - (table != cur)[None].astype(np.int64)
        delta = d_g + d_h
    _collect(candidates, "swap", score, ok, delta)
    if current is None and candidates and candidates[0][0] < top - tol:
        i, h, j = candidates[0][2]  # an improving swap: take it before pricing re-splits
        return "swap", (i, h, j), 0

    # 2. re-split: slot (g, i) changes from expert a to expert b (a keeps >= 1 replica)
    with np.errstate(divide="ignore", invalid="ignore"):
        grown_a = np.where(replicas[on_g] > 1, w[on_g] / np.maximum(replicas[on_g] - 1, 1), np.inf)  # [S]
        shrunk_b = w / (replicas + 1)                                                              # [E]
    rise_a = grown_a - share_g                                                                     # [S]
    holder_load = np.where(held[:, on_g].T, load[None, :], -np.inf)                                # [S, G]
    holder_load[:, g] = -np.inf
    worst_a = holder_load.max(axis=1) + rise_a                                                     # [S]
    new_g2 = top - share_g[:, None] + shrunk_b[None, :]                                            # [S, E]
    score2 = np.maximum(new_g2, worst_a[:, None])
    ok2 = (replicas[on_g] > 1)[:, None] & (~held[g])[None, :] & (replicas < G)[None, :]
    delta2 = None
    if current is not None:
        experts = np.arange(w.size)
        delta2 = (experts[None, :] != current[g][:, None]).astype(np.int64) - (on_g != current[g])[:, None]
    _collect(candidates, "resplit_out", score2, ok2, delta2)

    # 3. re-split: slot (h, j) changes from expert c to expert a = on_g[i] (a gains a replica)
    with np.errstate(divide="ignore", invalid="ignore"):
        smaller_a = w[on_g] / (replicas[on_g] + 1)                                                 # [S]
        grown_c = np.where(replicas > 1, w / np.maximum(replicas - 1, 1), np.inf)                  # [E]
    drop_a = share_g - smaller_a                                                                   # [S]
    rise_c = grown_c - share                                                                       # [E]
    c = table                                                                                      # [G, S]
    new_g3 = top - drop_a[:, None, None] + (held[g][c] * rise_c[c])[None]                          # [S, G, S]
    new_h3 = (load[:, None] - share[c])[None] + smaller_a[:, None, None]                           # [S, G, S]
    # the busiest other holder of c after it grows (not h, not g)
    worst_c = _max_holder_excluding(held, load, g, c) + rise_c[c]                                  # [G, S]
    score3 = np.maximum(np.maximum(new_g3, new_h3), worst_c[None])
    ok3 = ((replicas[c] > 1) & (np.arange(G)[:, None] != g))[None] & (~held[:, on_g].T)[:, :, None] \
        & (replicas[on_g] < G)[:, None, None]
    delta3 = None
    if current is not None:
        delta3 = (on_g[:, None, None] != current[None]).astype(np.int64) - (table != current)[None].astype(np.int64)
    _collect(candidates, "resplit_in", score3, ok3, delta3)

    best = None
    for score_value, kind, index, d in candidates:
        if current is None:
            if score_value >= top - tol:
                continue
            value = score_value
        else:
            if max_moved is not None and moved + d > max_moved:
                continue
            value = max(score_value, second) + move_cost * (moved + d)
            if value >= top + move_cost * moved - tol or score_value >= top - tol:
                continue
        if best is None or value < best[0]:
            best = (value, kind, index, d)
    if best is None:
        move = None
        if current is None and 2 <= S <= PAIR_SWAP_MAX_SLOTS:
            move = _best_pair_swap(state, g, top, tol)
        if move is None and current is None and 2 <= S <= REPACK_MAX_SLOTS and G >= 3:
            move = _best_triple_repack(state, g, top, tol)
        return move
    _, kind, index, d = best
    if kind == "swap":
        i, h, j = index
        return "swap", (i, h, j), d
    if kind == "resplit_out":
        i, b = index
        return "resplit", (g, i, b), d
    i, h, j = index
    return "resplit", (h, j, int(on_g[i])), d


def _best_pair_swap(state: _State, g: int, top: float, tol: float):
    """Two slots of the busiest GPU `g` for two slots of another GPU (when no single move helps)."""
    table, share, load = state.table, state.share, state.load
    G, S = table.shape
    held = state.count > 0
    first, second = np.triu_indices(S, k=1)                          # [pairs] slot index pairs
    pair_share = share[table[:, first]] + share[table[:, second]]      # [G, pairs]
    a1, a2 = table[g, first], table[g, second]                         # [pairs] experts leaving g
    out = pair_share[g]                                                # [pairs]
    new_g = top - out[:, None, None] + pair_share[None]                # [pairs_g, G, pairs_h]
    new_h = load[None, :, None] - pair_share[None] + out[:, None, None]
    # experts arriving on g must not be there already; experts leaving g must not be on h
    ok_in = ~held[g][table[:, first]] & ~held[g][table[:, second]]     # [G, pairs_h]
    ok_out = ~held[:, a1].T & ~held[:, a2].T                           # [pairs_g, G]
    ok = ok_in[None] & ok_out[:, :, None]
    score = np.where(ok, np.maximum(new_g, new_h), np.inf)
    flat = int(np.argmin(score))
    if not score.flat[flat] < top - tol:
        return None
    p, h, q = np.unravel_index(flat, score.shape)
    return "swap2", (int(first[p]), int(second[p]), int(h), int(first[q]), int(second[q])), 0


@functools.lru_cache(maxsize=8)
def _three_way_partitions(slots: int) -> np.ndarray:
    """int8 `[M, 3*slots]`: every split of 3*slots items into 3 unordered groups of `slots`."""
    out: list[list[int]] = []

    def split(items: list[int], groups: list[tuple[int, ...]]) -> None:
        if not items:
            label = [0] * (3 * slots)
            for j, group in enumerate(groups):
                for item in group:
                    label[item] = j
            out.append(label)
            return
        first, rest = items[0], items[1:]
        for others in itertools.combinations(rest, slots - 1):
            split([x for x in rest if x not in others], groups + [(first, *others)])

    split(list(range(3 * slots)), [])
    return np.array(out, dtype=np.int8)


def _best_triple_repack(state: _State, g: int, top: float, tol: float):
    """Re-split the slots of the busiest GPU `g` and two light GPUs among the three, exactly
    (all ways; at most 5775 for 4 slots), keeping replica counts. The last-resort move."""
    table, share, load = state.table, state.share, state.load
    G, S = table.shape
    labels = _three_way_partitions(S)                                   # [M, 3S]
    light = [int(h) for h in np.argsort(load, kind="stable") if h != g][:REPACK_PARTNERS]
    triples = list(itertools.combinations(light, 2))
    gpus = np.array([(g, a, b) for a, b in triples])                    # [T, 3]
    experts = table[gpus].reshape(len(triples), 3 * S)                  # [T, 3S]
    sizes = share[experts]
    masks = [(labels == j).astype(np.float64) for j in range(3)]
    bins = np.stack([m @ sizes.T for m in masks])                       # [3, M, T]
    worst = bins.max(axis=0)                                            # [M, T]
    if (np.bincount(table.ravel(), minlength=share.size) > 1).any():    # replicas: no two on one GPU
        same = experts[:, :, None] == experts[:, None, :]               # [T, 3S, 3S]
        upper = np.triu(np.ones((3 * S, 3 * S), dtype=bool), k=1)
        together = (labels[:, :, None] == labels[:, None, :]) & upper   # [M, 3S, 3S]
        clash = together.reshape(len(labels), -1).astype(np.float64) @ (same & upper).reshape(len(triples), -1).T.astype(np.float64)
        worst = np.where(clash > 0, np.inf, worst)
    flat = int(np.argmin(worst))
    if not worst.flat[flat] < top - tol:
        return None
    m, t = np.unravel_index(flat, worst.shape)
    return "repack", (gpus[t].tolist(), [experts[t][labels[m] == j].tolist() for j in range(3)]), 0


def _collect(candidates: list, kind: str, score: np.ndarray, ok: np.ndarray, delta: np.ndarray | None) -> None:
    """Append the best valid entry of `score` (and, when migrating, the best per moved-slot change)."""
    masked = np.where(ok, score, np.inf)
    if delta is None:
        flat = int(np.argmin(masked))
        if np.isfinite(masked.flat[flat]):
            candidates.append((float(masked.flat[flat]), kind, np.unravel_index(flat, masked.shape), 0))
        return
    for d in (-2, -1, 0, 1, 2):
        sel = np.where(delta == d, masked, np.inf)
        flat = int(np.argmin(sel))
        if np.isfinite(sel.flat[flat]):
            candidates.append((float(sel.flat[flat]), kind, np.unravel_index(flat, sel.shape), d))


def _max_holder_excluding(held: np.ndarray, load: np.ndarray, g: int, experts: np.ndarray) -> np.ndarray:
    """`[G, S]`: for the expert c in slot (h, j), the largest load of a GPU holding c, not g or h."""
    columns = np.arange(held.shape[1])
    masked = np.where(held, load[:, None], -np.inf)  # [G, E]
    masked[g] = -np.inf
    first_gpu = np.argmax(masked, axis=0)             # [E]
    first = masked[first_gpu, columns]
    masked[first_gpu, columns] = -np.inf
    second = masked.max(axis=0)
    h = np.arange(held.shape[0])[:, None]
    return np.where(first_gpu[experts] == h, second[experts], first[experts])


# ---------------------------------------------------------------------- the solver
def fast_layer(loads: np.ndarray, num_gpus: int, num_physical: int, *, eplb_row: np.ndarray | None = None,
               current: np.ndarray | None = None, move_cost: float = 0.0, max_moved: int | None = None,
               bound: float | None = None, deadline: float | None = None,
               bisection_steps: int = 8, max_iterations: int | None = None, polish_start: bool = True) -> np.ndarray:
    """int64 `[P]`: a plan for one layer's loads `[E]` (steps 1-3 of the module docstring)."""
    loads = np.asarray(loads, dtype=np.float64)
    slots = num_physical // num_gpus
    if bound is None:
        bound = layer_lower_bound(loads, num_gpus, num_physical)
    if current is not None:
        table = np.asarray(current, dtype=np.int64).reshape(num_gpus, slots)
        return local_search(loads, table, bound, table.copy(), move_cost, max_moved, deadline=deadline).ravel()

    def busiest(table: np.ndarray) -> float:
        return float((loads / np.bincount(table.ravel(), minlength=loads.size))[table].sum(axis=1).max())

    replicas = apportion(loads[None], num_physical, cap=num_gpus)[0]
    best = lpt_pack(loads, replicas, num_gpus)
    if eplb_row is not None:
        candidate = np.asarray(eplb_row, dtype=np.int64).reshape(num_gpus, slots)
        if not has_colocation(candidate.ravel(), num_gpus) and busiest(candidate) < busiest(best):
            best = candidate
    pairing = slots == 2 and num_physical > loads.size
    if pairing:  # two slots per GPU: counts searched on the sorted pairing (cheap, part of the construction)
        paired = pair_plan(loads, pair_replicas(loads, replicas, num_gpus), num_gpus)
        if busiest(paired) < busiest(best) * (1 - _TOL):
            best = paired
    if polish_start:
        best = local_search(loads, best, bound, max_iterations=max_iterations, deadline=deadline)
    best_value = busiest(best)
    lo, hi = bound, best_value
    if num_physical == loads.size:
        bisection_steps = 0  # one replica each: nothing to re-split
    for _ in range(bisection_steps):  # step 2: target packing between the bound and the best
        if hi <= lo * (1 + STOP_GAP) or (deadline is not None and time.perf_counter() > deadline):
            break
        target = 0.5 * (lo + hi)
        packed = target_pack(loads, num_gpus, slots, target)
        if packed is None:
            lo = target
            continue
        value = busiest(packed)
        if value < best_value:
            best, best_value = packed, value
        hi = min(hi, value) if value <= target * (1 + _TOL) else min(hi, target)
    if pairing and not (deadline is not None and time.perf_counter() > deadline):
        # the same count search from the best plan so far (its counts came from steps 2-3)
        paired = pair_plan(loads, pair_replicas(loads, np.bincount(best.ravel(), minlength=loads.size), num_gpus),
                           num_gpus)
        value = busiest(paired)
        if value < best_value * (1 - _TOL):
            best, best_value = paired, value
    best = local_search(loads, best, bound, max_iterations=max_iterations, deadline=deadline)
    return np.sort(best, axis=1).ravel()


def _pairing_ip_step(problem: PlacementProblem, layer: int, loads: np.ndarray, phy2log: np.ndarray,
                     objective: float, bound: float, rounds: int = 3) -> tuple[np.ndarray, float, float]:
    """(plan `[P]`, its objective, a bound) after up to `rounds` integer pairing tests (bounds.pairing_ip,
    2 slots per GPU, one window) at 0.9% below the plan: an infeasible test certifies the plan within
    ~1%; a feasible one gives replica counts whose sorted pairing is the new plan if it is better."""
    for _ in range(rounds):
        if objective <= bound * (1 + IP_GAP):
            break
        target = max(bound, objective * (1 - 0.9 * IP_GAP))
        verdict, counts = pairing_ip(loads, problem.num_gpus, problem.num_physical, target)
        if verdict == "infeasible":
            bound = max(bound, target * (1 - 1e-9))
            break
        if verdict != "feasible":
            break
        table = local_search(loads, pair_plan(loads, counts, problem.num_gpus), bound)
        candidate = np.sort(table, axis=1).ravel()
        value = window_objective(problem, layer, candidate)
        if value >= objective * (1 - _TOL):
            break
        phy2log, objective = candidate, value
    return phy2log, objective, bound


@register
class FastSolver:
    """Construction + target packing + local search (module docstring); no proof of optimality
    unless the plan meets the lower bound.

    `prepare(problem, layers)` (called by `solve` before a run of layers) computes EPLB's plans
    and the lower bounds of those layers in one vectorised pass and keeps them for that problem;
    without it each layer computes its own (what a one-off call, e.g. a hint for CP-SAT, wants).
    """

    name: ClassVar[str] = "fast"

    def __init__(self) -> None:
        self._problem: PlacementProblem | None = None
        self._prepared: dict[int, tuple[np.ndarray | None, float]] = {}

    def prepare(self, problem: PlacementProblem, layers: list[int], quick: bool = False) -> None:
        """Precompute EPLB's plans and the window lower bounds of `layers` of `problem`
        (`quick`: only the bounds that cost milliseconds)."""
        if self._problem is not problem:
            self._problem, self._prepared = problem, {}
        todo = [i for i in layers if i not in self._prepared]
        if not todo:
            return
        sub = PlacementProblem(problem.loads[:, todo, :], problem.num_gpus, problem.num_physical, problem.num_nodes,
                      problem.num_groups, window_objective=problem.window_objective, quantile=problem.quantile)
        bounds = model_lower_bounds(sub, quick)
        rows = None
        if problem.current is None:
            rows = eplb_rebalance(sub.planning_loads(), problem.num_physical, problem.num_groups or 1,
                                  problem.num_nodes, problem.num_gpus)
        for k, layer in enumerate(todo):
            self._prepared[layer] = (None if rows is None else rows[k], float(bounds[k]))

    def _layer_figures(self, problem: PlacementProblem, layer: int) -> tuple[np.ndarray | None, float]:
        """(EPLB's plan `[P]` or None in migration mode, the window lower bound) of one layer."""
        if self._problem is not problem or layer not in self._prepared:
            row = None if problem.current is not None else eplb_rebalance(
                problem.planning_loads()[layer:layer + 1], problem.num_physical, problem.num_groups or 1,
                problem.num_nodes, problem.num_gpus)[0]
            return row, window_lower_bound(problem, layer)
        return self._prepared[layer]

    def solve_layer(self, problem: PlacementProblem, layer: int, time_limit_s: float | None, *,
                    start: LayerSolution | None = None, deadline: float | None = None) -> LayerSolution:
        """fast's plan of one layer; `start` is not used (fast builds its own start, EPLB's plan among
        its candidates). `time_limit_s` bounds the search (the costlier bounds are skipped when it
        leaves a layer under 0.1 s / 2 s); `deadline` only cuts it short."""
        begin = time.perf_counter()
        soft = None if time_limit_s is None else begin + time_limit_s
        hard = None if deadline is None else begin + (deadline - time.monotonic())
        stop = soft if hard is None else hard if soft is None else min(soft, hard)
        cut = False

        def room(seconds: float) -> bool:
            """True when a step of about `seconds` fits the time limit and the deadline; a step the
            deadline alone forbids marks the result as cut."""
            nonlocal cut
            now = time.perf_counter()
            if soft is not None and soft - now <= seconds:
                return False
            if hard is not None and hard - now <= seconds:
                cut = True
                return False
            return True

        eplb_row, window_bound = self._layer_figures(problem, layer)
        loads = problem.planning_loads()[layer]
        current = problem.current_row(layer)
        planning_bound = window_bound if problem.num_windows == 1 else None  # the same loads: reuse it
        phy2log = fast_layer(loads, problem.num_gpus, problem.num_physical, eplb_row=eplb_row, current=current,
                             move_cost=problem.move_cost_weight, max_moved=problem.max_moved_slots,
                             bound=planning_bound, deadline=stop)
        if hard is not None and time.perf_counter() > hard:
            cut = True
        objective = window_objective(problem, layer, phy2log)
        if (problem.num_physical == 2 * problem.num_gpus and problem.num_windows == 1
                and objective > window_bound * (1 + STOP_GAP) and room(_PAIRING_BOUND_MIN_S)):
            window_bound = max(window_bound, pairing_lp_bound(loads, problem.num_gpus, problem.num_physical,
                                                              window_bound, objective))
            if current is None and objective > window_bound * (1 + IP_GAP) and room(_PAIRING_IP_MIN_S):
                phy2log, objective, window_bound = _pairing_ip_step(problem, layer, loads, phy2log, objective,
                                                                    window_bound)
        bound = min(window_bound, objective)
        status = "optimal" if objective <= bound * (1 + 1e-9) else "heuristic"
        detail = {}
        if current is not None:
            detail["moved_slots"] = int((phy2log != current).sum())
        if cut:
            detail["cut"] = True
        return LayerSolution(phy2log, status, objective, bound, time.perf_counter() - begin, detail)
