"""The per-batch split: each expert's dispatches of one batch shared among its replicas so that the
busiest GPU carries as few rows as it can.

Given one layer's map `phy2log [P]` (slot `p` on GPU `p // S`, `S = P / G`) and the batch's global
dispatches per logical expert `counts [E]` (summed over the EP ranks: one all-reduce), choose integer
rows per slot `shares [P] >= 0` with `sum_{p holds e} shares[p] = counts[e]`, minimising
`max_g sum_{p on g} shares[p]`. An expert with one replica has no choice; only the replicated experts
(`logcnt[e] >= 2`) move load, so the problem is small: a handful of experts, each over a few GPUs.

The method (`split_shares`), deterministic, so every rank computes the same shares from the same counts:
1. Start even: replica `i` of expert `e` takes `counts[e] // logcnt[e]`, plus one for the first
   `counts[e] % logcnt[e]` replicas (the engines' average split).
2. Sweep the replicated experts in colour classes (`colour_classes`: experts with the most replicas first,
   ties to the lower id, each into the first class none of whose experts shares one of its GPUs; a class's
   experts are independent, so it is poured at once, exactly as one after another). For each expert, take
   its rows off its GPUs and pour them back by water-filling: the GPUs it is on are raised, lowest first, to
   one common level. Each such step is the exact best for that expert with the others held (block
   coordinate descent on the sum of squared GPU loads, whose minimiser also minimises the busiest GPU), so
   the busiest GPU never rises. This runs in real numbers.
3. Stop a row when its busiest GPU is within `tolerance` of the lower bound below, or after `max_sweeps`
   sweeps; then round to whole rows (the floors, the rows left one at a time to the expert's least loaded
   GPU) and polish with `POLISH_SWEEPS` sweeps in whole rows. No clock decides anything.

The lower bound (`split_lower_bound`), valid for any split, fractional ones included (Hall's condition):
for any set `U` of GPUs, the experts all of whose replicas are on `U` must be served inside `U`, so
`max_g load >= (sum of those experts' counts) / |U|`. The bound takes the best of the `G` sets made of
the `k` busiest GPUs of the current split; at the optimum the busiest GPUs form such a set, so the bound
meets the split there, and the gap certifies how far any split is from the best.

Where the GPU rows go once the shares are known (`map_tokens`): each rank sends its own dispatches of an
expert to the replicas in proportion to the shares, by a weighted choice keyed by the dispatch's index
among that rank's dispatches of the expert, offset by the rank, so that a rank's count per replica is
within one row of its proportional share and small batches do not all start on replica 0.
"""

from __future__ import annotations

import numpy as np

from moe_place.errors import InputError

__all__ = ["colour_classes", "cumulative_shares", "even_shares", "gpu_rows", "map_tokens", "rank_phase",
           "round_shares", "split_lower_bound", "split_shares"]

MAX_SWEEPS = 64       # a cap only: on the drifting and real traces the bound is met in 2-40 sweeps
TOLERANCE = 1e-3      # stop once the busiest GPU is within 0.1% of the lower bound
POLISH_SWEEPS = 2     # sweeps in whole rows after rounding


def _check(phy2log: np.ndarray, counts: np.ndarray, num_gpus: int) -> tuple[np.ndarray, np.ndarray]:
    """(phy2log int64 `[B, P]`, counts int64 `[B, E]`) broadcast to a common batch; InputError otherwise."""
    rows = np.asarray(phy2log)
    load = np.asarray(counts)
    if rows.ndim not in (1, 2) or not np.issubdtype(rows.dtype, np.integer):
        raise InputError("phy2log", "integer expert ids [P] or [rows, P]", f"{rows.dtype} of shape {rows.shape}")
    if load.ndim not in (1, 2) or load.size == 0:
        raise InputError("counts", "dispatches per expert [E] or [rows, E]", f"shape {load.shape}")
    if load.dtype.kind == "f":
        if not np.isfinite(load).all() or (load != np.round(load)).any():
            raise InputError("counts", "whole, finite dispatch counts", load[~np.isfinite(load) | (load != np.round(load))][0])
    elif load.dtype.kind not in "iu":
        raise InputError("counts", "integer dispatch counts", f"dtype {load.dtype}")
    load = load.astype(np.int64)
    if (load < 0).any():
        raise InputError("counts", "counts >= 0", int(load[load < 0][0]))
    rows2, load2 = np.atleast_2d(rows).astype(np.int64), np.atleast_2d(load)
    batch = max(len(rows2), len(load2))
    if len(rows2) not in (1, batch) or len(load2) not in (1, batch):
        raise InputError("phy2log, counts", "the same number of rows (or one of them a single row)",
                         f"{len(rows2)} and {len(load2)}")
    experts, physical = load2.shape[1], rows2.shape[1]
    if num_gpus < 1 or physical % num_gpus:
        raise InputError("num_gpus", f"a divisor of the {physical} slots", num_gpus)
    if rows2.size and (rows2.min() < 0 or rows2.max() >= experts):
        raise InputError("phy2log", f"expert ids in [0, {experts}) (the counts' experts)",
                         int(rows2[(rows2 < 0) | (rows2 >= experts)][0]))
    return np.broadcast_to(rows2, (batch, physical)), np.broadcast_to(load2, (batch, experts))


def even_shares(phy2log: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """int64 `[B, P]`: the engines' average split in whole rows (step 1 of the module note).

    phy2log int `[B, P]`, counts int `[B, E]` (checked by the caller)."""
    batch, physical = phy2log.shape
    experts = counts.shape[1]
    keys = phy2log + (np.arange(batch) * experts)[:, None]
    logcnt = np.bincount(keys.ravel(), minlength=batch * experts).reshape(batch, experts)
    occurrence = _occurrence(keys)
    per = counts[np.arange(batch)[:, None], phy2log]
    cnt = logcnt[np.arange(batch)[:, None], phy2log]
    return per // cnt + (occurrence < per % cnt)


def _occurrence(keys: np.ndarray) -> np.ndarray:
    """int64 like `keys [B, P]`: how many earlier slots of the row share each slot's key."""
    batch, physical = keys.shape
    order = np.argsort(keys, axis=1, kind="stable")
    ranked = np.take_along_axis(keys, order, axis=1)
    start = np.zeros_like(ranked)
    new = np.ones_like(ranked, dtype=bool)
    new[:, 1:] = ranked[:, 1:] != ranked[:, :-1]
    index = np.broadcast_to(np.arange(physical), (batch, physical))
    start = np.maximum.accumulate(np.where(new, index, 0), axis=1)
    out = np.empty_like(keys)
    np.put_along_axis(out, order, index - start, axis=1)
    return out


def gpu_rows(shares: np.ndarray, num_gpus: int) -> np.ndarray:
    """int64 `[..., G]`: rows per GPU of `shares [..., P]`."""
    shares = np.asarray(shares)
    return shares.reshape(*shares.shape[:-1], num_gpus, -1).sum(axis=-1)


def split_lower_bound(phy2log: np.ndarray, counts: np.ndarray, num_gpus: int,
                      order_by: np.ndarray | None = None) -> np.ndarray:
    """float64 `[B]`: a lower bound on the busiest GPU's rows under any split (module note).

    order_by: float `[B, G]` GPU loads whose busiest-first prefixes are the sets tried (default: the
    even split's). Any order gives a valid bound; the split's own loads give a tight one at the optimum.
    """
    rows, load = _check(phy2log, counts, num_gpus)
    if order_by is None:
        order_by = gpu_rows(even_shares(rows, load), num_gpus)
    return _prefix_bound(rows, load, num_gpus, np.asarray(order_by, dtype=np.float64))


def _prefix_bound(rows: np.ndarray, load: np.ndarray, num_gpus: int, gpu_load: np.ndarray,
                  by_expert: np.ndarray | None = None) -> np.ndarray:
    """float64 `[B]`: the bound of the module note over the busiest-first prefixes of `gpu_load [B, G]`.
    by_expert: int `[B, P]` each row's slots ordered by expert (`np.argsort(rows, axis=1, kind="stable")`)."""
    batch, physical = rows.shape
    if by_expert is None:
        by_expert = np.argsort(rows, axis=1, kind="stable")
    order = np.argsort(-gpu_load, axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.broadcast_to(np.arange(num_gpus), order.shape), axis=1)
    slot_rank = np.take_along_axis(rank[:, np.arange(physical) // (physical // num_gpus)], by_expert, axis=1)
    ids = np.take_along_axis(rows, by_expert, axis=1)
    new = np.ones(ids.shape, dtype=bool)
    new[:, 1:] = ids[:, 1:] != ids[:, :-1]
    starts = np.flatnonzero(new.ravel())
    last = np.maximum.reduceat(slot_rank.ravel(), starts)      # each expert's last GPU in the order
    owner = starts // physical
    inside = np.bincount(owner * num_gpus + last, weights=load[owner, ids.ravel()[starts]].astype(np.float64),
                         minlength=batch * num_gpus)
    prefix = np.cumsum(inside.reshape(batch, num_gpus), axis=1)
    return (prefix / np.arange(1, num_gpus + 1)).max(axis=1)


def split_shares(phy2log: np.ndarray, counts: np.ndarray, num_gpus: int, *, max_sweeps: int = MAX_SWEEPS,
                 tolerance: float = TOLERANCE) -> np.ndarray:
    """int64 `[B, P]` (or `[P]` for one row): the per-batch split (module note).

    phy2log: int `[P]` or `[B, P]` (co-located replicas allowed); counts: int `[E]` or `[B, E]`, the batch's
    global dispatches per logical expert; either may be a single row for all. Rows are independent.
    """
    single = np.ndim(phy2log) == 1 and np.ndim(counts) == 1
    rows, load = _check(phy2log, counts, num_gpus)
    if isinstance(max_sweeps, bool) or not isinstance(max_sweeps, (int, np.integer)) or max_sweeps < 0:
        raise InputError("max_sweeps", "an integer >= 0", max_sweeps)
    if not tolerance >= 0:
        raise InputError("tolerance", "a share >= 0", tolerance)
    shares = even_shares(rows, load)
    table = _replica_table(rows, load, num_gpus)
    if table is not None and max_sweeps > 0:
        fractional = shares.astype(np.float64)
        _sweep(fractional, rows, load, num_gpus, table, max_sweeps, tolerance)
        shares = _whole_rows(fractional, num_gpus, table)
    return shares[0] if single else shares


def round_shares(phy2log: np.ndarray, counts: np.ndarray, fractional: np.ndarray, num_gpus: int) -> np.ndarray:
    """int64 like `fractional` (`[P]` or `[B, P]`): a split in real numbers (an LP's, say) in whole rows, as
    `split_shares` rounds its own: the floors, the rows left to each expert's least loaded GPUs, then
    `POLISH_SWEEPS` sweeps in whole rows."""
    single = np.ndim(fractional) == 1
    rows, load = _check(phy2log, counts, num_gpus)
    fractional = np.atleast_2d(np.asarray(fractional, dtype=np.float64))
    if fractional.shape != rows.shape or not np.isfinite(fractional).all() or (fractional < -1e-6).any():
        raise InputError("fractional shares", f"finite shares >= 0 of shape {rows.shape}", f"shape {fractional.shape}")
    table = _replica_table(rows, load, num_gpus)
    shares = even_shares(rows, load) if table is None else _whole_rows(fractional.clip(min=0.0), num_gpus, table)
    return shares[0] if single else shares


def _replica_table(rows: np.ndarray, load: np.ndarray, num_gpus: int):
    """The replicated experts of each row in colour classes (experts of one class share no GPU, so a class
    is water-filled at once, exactly as one after another): (slots int64 `[B, C, K, M]` -1 padded, their
    GPUs, whether a slot is the first of its expert on its GPU, how many of the expert's slots that GPU
    holds, the slot's index among them, all `[B, C, K, M]`; the experts' counts `[B, C, K]`); None when no
    row has a replicated expert. The classes depend on the map only: rows of one map share them."""
    batch, physical = rows.shape
    experts = load.shape[1]
    maps, which = np.unique(rows, axis=0, return_inverse=True)
    which = which.reshape(-1)
    tables = [colour_classes(m, experts, physical // num_gpus) for m in maps]
    if all(t is None for t in tables):
        return None
    width_c = max(t.shape[0] for t in tables if t is not None)
    width_k = max(t.shape[1] for t in tables if t is not None)
    width_m = max(t.shape[2] for t in tables if t is not None)
    per_map = np.full((len(maps), width_c, width_k, width_m), -1, dtype=np.int64)
    for i, t in enumerate(tables):
        if t is not None:
            per_map[i, :t.shape[0], :t.shape[1], :t.shape[2]] = t
    table = per_map[which]                                                      # [B, C, K, M]
    valid = table >= 0
    gpu = np.where(valid, table // (physical // num_gpus), -1)
    same = (gpu[..., :, None] == gpu[..., None, :]) & valid[..., :, None] & valid[..., None, :]
    earlier = np.tril(np.ones((width_m, width_m), dtype=bool), k=-1)
    first = valid & ~(same & earlier).any(axis=-1)
    multiplicity = same.sum(axis=-1)
    nth = (same & earlier).sum(axis=-1)
    expert = np.where(valid[..., 0], rows[np.arange(batch)[:, None, None], np.maximum(table[..., 0], 0)], -1)
    amount = np.where(expert >= 0, load[np.arange(batch)[:, None, None], np.maximum(expert, 0)], 0)
    return table, gpu, first, multiplicity, nth, amount


def colour_classes(phy2log: np.ndarray, num_experts: int, slots_per_gpu: int) -> np.ndarray | None:
    """int64 `[C, K, M]`: the slots of one map's replicated experts (-1 padded), `K` experts per class `c`
    sharing no GPU. Greedy: experts by most replicas first (ties: the lower id), each into the first
    class none of whose experts is on one of its GPUs. None when no expert is replicated."""
    logcnt = np.bincount(phy2log, minlength=num_experts)
    replicated = np.flatnonzero(logcnt >= 2)
    if replicated.size == 0:
        return None
    replicated = replicated[np.lexsort((replicated, -logcnt[replicated]))]
    classes: list[list[int]] = []
    used: list[set[int]] = []
    slots_of = {e: np.flatnonzero(phy2log == e) for e in replicated.tolist()}
    for e in replicated.tolist():
        gpus = set((slots_of[e] // slots_per_gpu).tolist())
        for members, taken in zip(classes, used):
            if not taken & gpus:
                members.append(e)
                taken |= gpus
                break
        else:
            classes.append([e])
            used.append(set(gpus))
    width_k = max(len(c) for c in classes)
    table = np.full((len(classes), width_k, int(logcnt.max())), -1, dtype=np.int64)
    for c, members in enumerate(classes):
        for k, e in enumerate(members):
            table[c, k, :len(slots_of[e])] = slots_of[e]
    return table


def _sweep(shares: np.ndarray, rows: np.ndarray, load: np.ndarray, num_gpus: int, table, max_sweeps: int,
           tolerance: float) -> None:
    """Steps 2-3 of the module note in real numbers, in place on `shares` float64 `[B, P]` (the rows still
    open are worked together, a colour class at a time)."""
    slots, gpu, first, multiplicity, nth, amount = table
    gpu_load = gpu_rows(shares, num_gpus)
    open_rows = np.arange(len(shares))
    by_expert = np.argsort(rows, axis=1, kind="stable")
    width_k, width_m = slots.shape[2], slots.shape[3]
    for _ in range(max_sweeps):
        for c in range(slots.shape[1]):
            live = open_rows[(amount[open_rows, c] > 0).any(axis=1)]
            if live.size == 0:
                continue
            n = live.size * width_k
            s = slots[live, c].reshape(n, width_m)
            g, f, m = gpu[live, c].reshape(n, width_m), first[live, c].reshape(n, width_m), \
                multiplicity[live, c].reshape(n, width_m)
            w = amount[live, c].reshape(n).astype(np.float64)
            owner = np.repeat(live, width_k)
            valid = s >= 0
            here = _per_gpu(np.where(valid, shares[owner[:, None], np.maximum(s, 0)], 0.0), g, valid)
            base = gpu_load[owner[:, None], np.maximum(g, 0)] - here
            fill = np.where(f, _level(base, w, f) - base, 0.0).clip(min=0.0)
            fill *= (w / np.maximum(fill.sum(axis=1), 1e-300))[:, None]                # the exact total
            new = _per_gpu(np.where(f, fill, 0.0), g, valid) / np.maximum(m, 1)
            shares[np.broadcast_to(owner[:, None], s.shape)[valid], s[valid]] = new[valid]
            gpu_load[np.broadcast_to(owner[:, None], g.shape)[f], g[f]] += (fill - here)[f]   # (row, GPU) pairs
            # are distinct: a class's experts share no GPU
        busiest = gpu_load[open_rows].max(axis=1)
        bound = _prefix_bound(rows[open_rows], load[open_rows], num_gpus, gpu_load[open_rows], by_expert[open_rows])
        open_rows = open_rows[busiest > bound * (1.0 + tolerance)]
        if open_rows.size == 0:
            return


def _per_gpu(values: np.ndarray, gpu: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """`[n, M]`: for each of an expert's slots, the sum of `values` over its slots on the same GPU."""
    same = (gpu[:, :, None] == gpu[:, None, :]) & valid[:, :, None] & valid[:, None, :]
    return (same * values[:, None, :]).sum(axis=-1)


def _level(base: np.ndarray, amount: np.ndarray, active: np.ndarray) -> np.ndarray:
    """float64 `[n, 1]`: the water level `L` with `sum over active i of max(0, L - base_i) = amount`: the least,
    over the active `i`, of `(amount + sum of the bases at or below base_i) / their number`."""
    width = base.shape[1]
    index = np.arange(width)
    b = np.where(active, base, np.inf)
    below = ((b[:, None, :] < b[:, :, None]) | ((b[:, None, :] == b[:, :, None]) &
                                                  (index[None, None, :] <= index[None, :, None]))) & active[:, None, :]
    total = (below * np.where(active, base, 0.0)[:, None, :]).sum(axis=-1)
    level = np.where(active, (amount[:, None] + total) / np.maximum(below.sum(axis=-1), 1), np.inf)
    return level.min(axis=1, keepdims=True)


def _whole_rows(fractional: np.ndarray, num_gpus: int, table) -> np.ndarray:
    """int64 `[B, P]`: the split in whole rows. Each replicated expert's slots keep the floors of their
    shares; the rows left (fewer than its GPUs) go one at a time to its least loaded GPU (ties: the
    lower slot), a colour class at a time."""
    shares = np.floor(fractional + 1e-9).astype(np.int64)
    gpu_load = gpu_rows(shares, num_gpus)
    for owner, s, g, f, m, k, w, valid in _class_views(table):
        current = np.where(valid, shares[owner[:, None], np.maximum(s, 0)], 0)
        here = _per_gpu(current, g, valid)
        add = _water_fill_whole(gpu_load[owner[:, None], np.maximum(g, 0)], w - current.sum(axis=1), f)
        _pour(shares, gpu_load, owner, s, g, f, m, k, valid, _per_gpu(np.where(f, add, 0), g, valid) + here, add)
    for _ in range(POLISH_SWEEPS):
        _polish(shares, gpu_load, table)
    return shares


def _polish(shares: np.ndarray, gpu_load: np.ndarray, table) -> None:
    """One sweep in whole rows, in place: each replicated expert's rows off its GPUs and poured back by
    `_water_fill_whole` (what rounding left one row high on a GPU can move to a neighbour)."""
    for owner, s, g, f, m, k, w, valid in _class_views(table):
        here = _per_gpu(np.where(valid, shares[owner[:, None], np.maximum(s, 0)], 0), g, valid)
        add = _water_fill_whole(gpu_load[owner[:, None], np.maximum(g, 0)] - here, w, f)
        _pour(shares, gpu_load, owner, s, g, f, m, k, valid, _per_gpu(np.where(f, add, 0), g, valid), add - here)


def _class_views(table):
    """Per colour class that holds rows, its replicated experts of every batch row side by side: (the batch
    row of each `[n]`; slots, GPUs, first-slot-on-its-GPU, replicas on that GPU, rank among them `[n, M]`;
    rows to split `[n]`; which of the M are slots `[n, M]`)."""
    slots, gpu, first, multiplicity, nth, amount = table
    width_k, width_m = slots.shape[2], slots.shape[3]
    for c in range(slots.shape[1]):
        live = np.flatnonzero((amount[:, c] > 0).any(axis=1))
        if live.size == 0:
            continue
        n = live.size * width_k
        s, g, f, m, k = (a[live, c].reshape(n, width_m) for a in (slots, gpu, first, multiplicity, nth))
        yield np.repeat(live, width_k), s, g, f, m, k, amount[live, c].reshape(n), s >= 0


def _pour(shares, gpu_load, owner, s, g, f, m, k, valid, total, change) -> None:
    """In place: each GPU's `total [n, M]` rows shared among its replicas of the expert (one more to the
    lower ranks), and the GPUs' loads moved by `change` (at each GPU's first slot)."""
    new = total // np.maximum(m, 1) + (k < total % np.maximum(m, 1))
    shares[np.broadcast_to(owner[:, None], s.shape)[valid], s[valid]] = new[valid]
    gpu_load[np.broadcast_to(owner[:, None], g.shape)[f], g[f]] += change[f]


def _water_fill_whole(level: np.ndarray, amount: np.ndarray, active: np.ndarray) -> np.ndarray:
    """int64 `[n, M]`: `amount [n]` whole rows added one at a time to the lowest active `level [n, M]`
    (ties: the lower index), in closed form: the floors under the real water level, then the rest one
    each to the lowest."""
    width = level.shape[1]
    index = np.arange(width)
    base = level.astype(np.float64)
    fill = np.where(active, np.floor(np.maximum(0.0, _level(base, amount, active) - base) + 1e-9), 0.0).astype(np.int64)
    over = fill.sum(axis=1) - amount
    while (over > 0).any():      # float rounding gave a row too many somewhere: take it back from the highest
        top = np.argmax(np.where(active & (fill > 0), level + fill, -1), axis=1)
        fill[np.arange(len(fill))[over > 0], top[over > 0]] -= 1
        over = fill.sum(axis=1) - amount
    left = amount - fill.sum(axis=1)
    key = np.where(active, level + fill, np.iinfo(np.int64).max // 4)
    order = np.lexsort((np.broadcast_to(index, key.shape), key), axis=1)
    place = np.empty_like(order)
    np.put_along_axis(place, order, np.broadcast_to(index, order.shape), axis=1)
    return fill + ((place < left[:, None]) & active)


# ---------------------------------------------------------------------- tokens to replicas
PHASE_UNITS = 1 << 16            # a rank's phase is a whole number of 1/65536ths of a dispatch
GOLDEN_PHASE = 40503             # round(0.6180339887 * 65536): each expert's phases turned by the golden ratio


def rank_phase(rank: np.ndarray, expert: np.ndarray, num_ranks: int) -> np.ndarray:
    """int64: the phase of rank `rank`'s dispatches of `expert`, in `1/PHASE_UNITS` of a dispatch: the ranks
    equally spaced, `(rank + 1/2) / num_ranks`, turned by the golden ratio per expert (so that one rank
    does not start every expert on the same replica)."""
    rank = np.asarray(rank, dtype=np.int64)
    expert = np.asarray(expert, dtype=np.int64)
    return ((2 * rank + 1) * PHASE_UNITS // (2 * num_ranks) + expert * GOLDEN_PHASE) % PHASE_UNITS


def map_tokens(topk_ids: np.ndarray, rank: np.ndarray, phy2log: np.ndarray, shares: np.ndarray,
               num_ranks: int) -> np.ndarray:
    """int64 `[T, k]`: the slot each (token, expert) pair goes to, given the batch's split `shares [P]`.

    topk_ids: int `[T, k]` logical ids of the batch's tokens (all ranks'); rank: int `[T]` the EP rank
    each token is on (its home). A rank's `c` dispatches of expert `e`, in token order `j = 0..c-1`, are
    placed at `u_j = (j + phase) / c` in `[0, 1)` (phase: `rank_phase`) and go to the replica whose
    interval of the cumulative shares `[S_(i-1), S_i) / counts[e]` holds `u_j` (slots in ascending order;
    exact integer arithmetic). So a rank sends each replica within one dispatch of `c * shares / counts`,
    and a rank with one dispatch of `e` lands on a replica that depends on its rank. What each rank
    computes locally from its own `topk_ids`, the global `shares` and its rank.
    """
    ids = np.asarray(topk_ids, dtype=np.int64)
    rank = np.asarray(rank, dtype=np.int64)
    row = np.asarray(phy2log, dtype=np.int64)
    share = np.asarray(shares, dtype=np.int64)
    tokens, k = ids.shape
    experts = int(row.max()) + 1 if row.size else 0
    if rank.shape != (tokens,) or (tokens and (rank.min() < 0 or rank.max() >= num_ranks)):
        raise InputError("rank", f"one rank in [0, {num_ranks}) per token", f"shape {rank.shape}")
    if share.shape != row.shape:
        raise InputError("shares", f"one share per slot ({row.size})", f"shape {share.shape}")
    if tokens == 0:
        return ids.copy()
    if ids.min() < 0 or ids.max() >= experts:
        raise InputError("topk_ids", f"expert ids in [0, {experts})", int(ids[(ids < 0) | (ids >= experts)][0]))
    log2phy, cumulative = cumulative_shares(row, share, experts)                  # [E, W], [E, W]
    total = cumulative[:, -1]
    flat_e, flat_r = ids.ravel(), np.repeat(rank, k)
    key = flat_r * experts + flat_e
    order = np.argsort(key, kind="stable")                                         # token order within (rank, e)
    sorted_key = key[order]
    first = np.searchsorted(sorted_key, sorted_key, side="left")
    ordinal = np.empty_like(key)
    ordinal[order] = np.arange(key.size) - first
    count = np.bincount(key, minlength=num_ranks * experts)[key]
    if (total[flat_e] < 1).any():
        raise InputError("shares", "at least the dispatches of every expert the batch routes to (they sum to counts[e])",
                         f"expert {int(flat_e[total[flat_e] < 1][0])} has none")
    phase = rank_phase(flat_r, flat_e, num_ranks)
    # replica i holds u when u * counts[e] < S_i, i.e. (j * Q + phase) * counts[e] < c * S_i * Q
    left = (ordinal * PHASE_UNITS + phase) * total[flat_e]
    right = count[:, None] * cumulative[flat_e] * PHASE_UNITS                      # [n, W]
    index = (left[:, None] >= right).sum(axis=1)
    return log2phy[flat_e, np.minimum(index, log2phy.shape[1] - 1)].reshape(tokens, k)


def cumulative_shares(phy2log: np.ndarray, shares: np.ndarray, experts: int) -> tuple[np.ndarray, np.ndarray]:
    """(slots of each expert ascending, -1 padded int64 `[E, W]`; the cumulative shares over them `[E, W]`, the
    last column repeated into the padding)."""
    order = np.argsort(phy2log, kind="stable")
    logcnt = np.bincount(phy2log, minlength=experts)
    width = int(logcnt.max()) if logcnt.size else 1
    start = np.cumsum(logcnt) - logcnt
    column = np.arange(phy2log.size) - start[phy2log[order]]
    log2phy = np.full((experts, width), -1, dtype=np.int64)
    log2phy[phy2log[order], column] = order
    part = np.zeros((experts, width), dtype=np.int64)
    part[phy2log[order], column] = shares[order]
    return log2phy, np.cumsum(part, axis=1)
