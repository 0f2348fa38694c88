"""`quick_plan`: a whole-model plan in tens of milliseconds, vectorised across layers.

The anytime plan: what `solve` falls back to for every layer a time limit does not reach, and
what the EPLB drop-in returns under a small `time_limit_s`. Same model as `fast` (even split,
`S = P/G` slots per GPU, never two replicas of one expert on one GPU), deterministic, numpy only.
Every step handles all layers at once (arrays `[layers, ...]`), so the cost is a few hundred
numpy calls whatever the number of layers.

1. Replica counts: the min-max apportionment (`bounds.apportion`, capped at `G` replicas).
   With two slots per GPU the counts are then searched on the sorted-pairing value (the best
   pairing of fixed pieces pairs largest with smallest, `bounds.pairing_lp_bound` (i)): each
   round gives one more replica to an expert of the heaviest pair, taken from one of the
   `PAIR_DONORS` experts whose pieces grow least, for every layer at once.
2. Placement. `S = 2`: the sorted pairing. `S >= 3`: conflict-aware LPT (pieces heaviest first,
   each to the lightest GPU with a free slot that does not hold its expert), one piece rank at
   a time across all layers. The pieces of one expert are consecutive in that order, so the
   conflict check needs only the GPUs of the expert being placed.
3. Swaps: on each layer's busiest GPU, the slot swap with one of the `SWAP_PARTNERS` lightest
   GPUs that lowers the larger of the two GPUs' loads the most; rounds until no layer improves (or `max_rounds`, or the
   deadline). A layer that stops improving leaves the active set.
A co-located pair that steps 1-2 cannot avoid (ties only) is swapped away (`_unpair` for two
slots per GPU, `fast._repair_colocation` otherwise).
"""

from __future__ import annotations

import time

import numpy as np

from moe_place.placement import colocated_gpus
from moe_place.solvers.bounds import apportion
from moe_place.solvers.fast import _repair_colocation

__all__ = ["pair_counts", "quick_plan"]

_TOL = 1e-12        # relative tolerance of load comparisons (as in fast)
_SCORE_TOL = 1e-6   # ... of the count search, which scores candidates in float32 (sorting is 2-3x faster)
PAIR_DONORS = 8     # candidate donors of a replica per layer and round (two slots per GPU)
PAIR_ROUNDS = 64    # at most this many count rounds (two slots per GPU)
STOP_GAP = 1e-4     # a layer this close to its lower bound stops (as in fast)
SWAP_PARTNERS = 8   # the busiest GPU swaps with one of this many lightest GPUs


def quick_plan(loads: np.ndarray, num_gpus: int, num_physical: int, *, max_rounds: int | None = None,
               deadline: float | None = None) -> np.ndarray:
    """int64 `[layers, P]`: a plan for every layer of `loads` (float64 `[layers, E]`), steps 1-3 above.

    max_rounds: cap on swap rounds (None: `2 * G * S`); deadline: `time.perf_counter()` seconds
    after which the swap rounds stop (the plan is valid at every round).
    """
    loads = np.atleast_2d(np.asarray(loads, dtype=np.float64))
    layers, experts = loads.shape
    slots = num_physical // num_gpus
    counts = apportion(loads, num_physical, cap=num_gpus)
    if slots == 2 and num_physical > experts:
        counts = pair_counts(loads, counts, num_gpus)
    pieces, _ = _sorted_pieces(loads, counts)                      # [L, P], heaviest first
    if slots == 1:
        table = pieces[:, :, None]
    elif slots == 2:
        table = np.stack([pieces[:, :num_gpus], pieces[:, ::-1][:, :num_gpus]], axis=2)
    else:
        table = _lpt(loads, counts, pieces, num_gpus, slots)
    share = loads / counts
    for layer in np.flatnonzero(colocated_gpus(table.reshape(layers, -1), num_gpus).any(axis=1)):
        if slots == 2:
            _unpair(table[layer], share[layer])
        else:  # LPT found only GPUs holding the expert open (ties at the end): rare
            _repair_colocation(table[layer], share[layer])
    rounds = 2 * num_gpus * slots if max_rounds is None else max_rounds
    if slots > 1 and num_gpus > 1:
        bound = np.maximum(loads.sum(axis=1) / num_gpus, share.max(axis=1))  # bounds 1-2 of moe_place.solvers.bounds
        table = _swap_rounds(share, table, bound, rounds, deadline)
    return np.sort(table, axis=2).reshape(layers, num_physical)


def _sorted_pieces(loads: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int64 `[L, P]` expert of each piece, float64 `[L, P]` its size), heaviest first; the pieces
    of one expert are consecutive (stable order, experts laid out one after another)."""
    pieces = _expand(np.broadcast_to(np.arange(loads.shape[1]), loads.shape), counts)
    pieces.sort(axis=1)  # expert-major layout, so that a stable sort keeps an expert's pieces together
    sizes = np.take_along_axis(loads / counts, pieces, axis=1)
    order = np.argsort(-sizes, axis=1, kind="stable")
    return np.take_along_axis(pieces, order, axis=1), np.take_along_axis(sizes, order, axis=1)


def _expand(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """`[rows, P]`: each row's `values[e]` repeated `counts[e] >= 1` times (every row sums to the same
    `P`), unordered: one copy of every value, then the extra copies (repeating only the extras is
    what makes this cheap: most experts have one replica)."""
    rows = values.shape[0]
    extra = np.repeat(values.ravel(), (counts - 1).ravel()).reshape(rows, -1)
    return np.concatenate([values, extra], axis=1)


def pair_counts(loads: np.ndarray, counts: np.ndarray, num_gpus: int, rounds: int = PAIR_ROUNDS) -> np.ndarray:
    """int64 `[L, E]`: replica counts improved for the sorted-pairing value (two slots per GPU).

    Each round, per layer: the heaviest pair of the sorted pairing holds a big piece (expert `a`)
    and a small one (`b`); candidates give `a` or `b` one more replica, taken from one of the
    `PAIR_DONORS` experts with two or more replicas whose pieces grow least. The best candidate is
    kept when it lowers the value; layers without one stop. `_pairing_value` scores them all.
    """
    w = loads
    r = counts.copy()
    layers, experts = w.shape
    active = np.arange(layers)
    value = _pairing_value((w / r).astype(np.float32), r, num_gpus)
    for _ in range(rounds):
        if active.size == 0:
            break
        wa, ra = w[active], r[active]
        big, small = _heaviest_pair(wa, ra, num_gpus)
        with np.errstate(divide="ignore"):
            growth = np.where(ra > 1, wa / np.maximum(ra - 1, 1) - wa / ra, np.inf)   # piece rise if one is taken
        cands = []
        width = min(PAIR_DONORS, experts)
        index = np.arange(active.size)[:, None]
        for giver in (big, small):
            blocked = growth.copy()
            blocked[np.arange(active.size), giver] = np.inf
            donors = np.argsort(blocked, axis=1, kind="stable")[:, :width]          # [A, D]
            ok = np.isfinite(np.take_along_axis(blocked, donors, axis=1)) & (ra[np.arange(active.size), giver]
                                                                          < num_gpus)[:, None]
            cand = np.repeat(ra[:, None, :], width, axis=1)                         # [A, D, E]
            cand[index, np.arange(width)[None, :], giver[:, None]] += 1
            cand[index, np.arange(width)[None, :], donors] -= 1
            cands.append((cand, ok))
        cand = np.concatenate([c for c, _ in cands], axis=1)                         # [A, 2D, E]
        ok = np.concatenate([o for _, o in cands], axis=1)
        cand = np.where(ok[:, :, None], cand, ra[:, None, :])  # invalid candidates: scored as no move
        flat = cand.reshape(-1, experts)
        scores = _pairing_value((np.repeat(wa, cand.shape[1], axis=0) / flat).astype(np.float32), flat,
                                num_gpus).reshape(ok.shape)
        scores = np.where(ok, scores, np.inf)
        best = np.argmin(scores, axis=1)
        best_value = scores[np.arange(active.size), best]
        better = best_value < value[active] * (1 - _SCORE_TOL)
        r[active[better]] = cand[np.flatnonzero(better), best[better]]
        value[active[better]] = best_value[better]
        active = active[better]
    return r


def _pairing_value(values: np.ndarray, counts: np.ndarray, num_gpus: int) -> np.ndarray:
    """float64 `[C]`: `max_i a_(i) + a_(P+1-i)` of each row's pieces (`values[c, e]` repeated
    `counts[c, e]` times, `P = 2G` pieces a row): `fast.pair_values` by a plain sort of the pieces."""
    pieces = np.sort(_expand(values, counts), axis=1)
    return (pieces[:, :num_gpus] + pieces[:, ::-1][:, :num_gpus]).max(axis=1)


def _heaviest_pair(loads: np.ndarray, counts: np.ndarray, num_gpus: int) -> tuple[np.ndarray, np.ndarray]:
    """(int64 `[L]` expert of the big piece, int64 `[L]` of the small piece) of each layer's
    heaviest pair in the sorted pairing."""
    pieces, sizes = _sorted_pieces(loads, counts)                  # heaviest first
    pair = sizes[:, :num_gpus] + sizes[:, ::-1][:, :num_gpus]
    i = np.argmax(pair, axis=1)
    rows = np.arange(loads.shape[0])
    return pieces[rows, i], pieces[:, ::-1][rows, i]


def _lpt(loads: np.ndarray, counts: np.ndarray, pieces: np.ndarray, num_gpus: int, slots: int) -> np.ndarray:
    """int64 `[L, G, S]`: pieces heaviest first, each to the lightest open GPU without its expert."""
    layers = loads.shape[0]
    rows = np.arange(layers)
    share = loads / counts
    load = np.zeros((layers, num_gpus))
    fill = np.zeros((layers, num_gpus), dtype=np.int64)
    mine = np.zeros((layers, num_gpus), dtype=bool)                # GPUs holding the expert being placed
    table = np.zeros((layers, num_gpus, slots), dtype=np.int64)
    previous = np.full(layers, -1)
    for k in range(pieces.shape[1]):
        expert = pieces[:, k]
        mine[expert != previous] = False
        closed = fill >= slots
        candidates = np.where(closed | mine, np.inf, load)
        gpu = np.argmin(candidates, axis=1)
        stuck = ~np.isfinite(candidates[rows, gpu])                # only GPUs with the expert are open
        if stuck.any():
            gpu[stuck] = np.argmin(np.where(closed, np.inf, load), axis=1)[stuck]
        table[rows, gpu, fill[rows, gpu]] = expert
        fill[rows, gpu] += 1
        load[rows, gpu] += share[rows, expert]
        mine[rows, gpu] = True
        previous = expert
    return table


def _unpair(table: np.ndarray, share: np.ndarray) -> None:
    """Two slots per GPU: swap each co-located replica with a piece of another GPU (in place),
    the swap that keeps the larger of the two GPUs' loads lowest.

    In the sorted pairing only the pairs around the middle can hold one expert twice (its equal
    pieces straddle the middle), so this runs for one or two GPUs of a few layers.
    """
    while True:
        same = np.flatnonzero(table[:, 0] == table[:, 1])
        if same.size == 0:
            return
        g = int(same[0])
        expert, size = int(table[g, 0]), float(share[table[g, 0]])
        sizes = share[table]                                            # [G, 2]
        # GPU h gives its slot j to g and takes one replica of `expert`: g = size + sizes[h, j],
        # h = size + sizes[h, 1 - j]
        ok = (table != expert).all(axis=1, keepdims=True) & np.ones((1, 2), dtype=bool)
        ok[g] = False
        worst = np.where(ok, size + np.maximum(sizes, sizes[:, ::-1]), np.inf)
        h, j = np.unravel_index(int(np.argmin(worst)), worst.shape)
        assert np.isfinite(worst[h, j]), "an expert with more replicas than GPUs"
        table[g, 1], table[h, j] = table[h, j], expert


def _swap_rounds(share: np.ndarray, table: np.ndarray, bound: np.ndarray, rounds: int,
                 deadline: float | None) -> np.ndarray:
    """Step 3 on every layer at once; returns the improved `[L, G, S]` table. A layer whose busiest
    load is within `STOP_GAP` of its lower bound `bound` `[L]` leaves the active set."""
    layers, gpus, slots = table.shape
    experts = share.shape[1]
    table = table.copy()
    held = np.zeros((layers, gpus, experts), dtype=bool)
    held[np.arange(layers)[:, None, None], np.arange(gpus)[None, :, None], table] = True
    active = np.arange(layers)
    width = min(SWAP_PARTNERS, gpus - 1)
    diff_buffer = np.empty((layers, slots, width, slots))
    score_buffer = np.empty_like(diff_buffer)
    # every slot's load and every GPU's, kept up to date by the swaps (a swap changes two GPUs)
    sizes_all = np.take_along_axis(share, table.reshape(layers, -1), axis=1).reshape(table.shape)
    load_all = sizes_all.sum(axis=2)                                   # [L, G]
    for _ in range(rounds):
        if active.size == 0 or (deadline is not None and time.perf_counter() > deadline):
            break
        a = np.arange(active.size)
        gpu_load = load_all[active]                                    # [A, G]
        busiest = np.argmax(gpu_load, axis=1)
        top = gpu_load[a, busiest]
        on_g, size_g = table[active, busiest], sizes_all[active, busiest]          # [A, S]
        # partners: the `SWAP_PARTNERS` lightest GPUs (the busiest one is never among them)
        partners = np.argsort(gpu_load, axis=1, kind="stable")[:, :width]          # [A, K]
        t_p = table[active[:, None], partners]                          # [A, K, S]
        sizes_p = sizes_all[active[:, None], partners]
        load_p = gpu_load[a[:, None], partners]                         # [A, K]
        # swap slot (busiest, i) with slot (h, j): the larger of the two new loads, [A, S, K, S]
        # (written into buffers allocated once: fresh arrays of this size cost page faults each round)
        diff, score = diff_buffer[:active.size], score_buffer[:active.size]
        np.subtract(size_g[:, :, None, None], sizes_p[:, None], out=diff)   # load leaving the busiest GPU
        np.subtract(top[:, None, None, None], diff, out=score)
        np.maximum(score, np.add(load_p[:, None, :, None], diff, out=diff), out=score)
        # forbidden swaps cost inf: the arriving expert is on the busiest GPU, or the leaving one on h
        layer = active[:, None, None]
        arrives = held[layer, busiest[:, None, None], t_p]                          # [A, K, S]
        leaves = held[layer, partners[:, :, None], on_g[:, None, :]]                # [A, K, S_i]
        score += np.where(arrives, np.inf, 0.0)[:, None]
        score += np.where(leaves, np.inf, 0.0).transpose(0, 2, 1)[:, :, :, None]
        score = score.reshape(active.size, -1)
        best = np.argmin(score, axis=1)
        better = (score[a, best] < top * (1 - _TOL)) & (top > bound[active] * (1 + STOP_GAP))
        if not better.any():
            break
        i, k, j = np.unravel_index(best[better], (slots, width, slots))
        h = partners[np.flatnonzero(better), k]
        layer, g = active[better], busiest[better]
        out, into = table[layer, g, i], table[layer, h, j]
        table[layer, g, i], table[layer, h, j] = into, out
        sizes_all[layer, g, i], sizes_all[layer, h, j] = sizes_all[layer, h, j], sizes_all[layer, g, i]
        load_all[layer, g], load_all[layer, h] = sizes_all[layer, g].sum(axis=-1), sizes_all[layer, h].sum(axis=-1)
        held[layer, g, out], held[layer, h, into] = False, False
        held[layer, g, into], held[layer, h, out] = True, True
        active = active[better]
    return table
