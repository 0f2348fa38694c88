"""A validated expert placement: `phy2log`, `log2phy`, `logcnt` for every layer.

A `Placement` is what every solver returns, what `plan` writes, what `evaluate` judges and
what the engine adapters export. It is checked once, when it is built: every logical expert
has at least one replica, ids are in range, every GPU has the same number of slots, and (unless
`allow_colocated=True`, needed only to import plans made by DeepSeek EPLB, which can put two
replicas of one expert on one GPU) no GPU holds two replicas of one expert.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from moe_place.errors import InputError

__all__ = ["Placement", "SlotGrid", "align_slots", "balance_ratio", "balancedness", "colocated_gpus",
           "even_split_gpu_loads", "even_split_slot_loads", "has_colocation", "keep_unchanged_slots",
           "max_overlap_matching", "replica_counts"]


class SlotGrid:
    """What `Placement` and `PlacementProblem` derive alike from their `num_physical` slots per layer (P),
    `num_experts` (E), `num_gpus` (G) and `num_nodes` (N)."""

    @property
    def slots_per_gpu(self) -> int:
        return self.num_physical // self.num_gpus

    @property
    def gpus_per_node(self) -> int:
        return self.num_gpus // self.num_nodes

    @property
    def num_redundant(self) -> int:
        return self.num_physical - self.num_experts


@dataclass(frozen=True)
class Placement(SlotGrid):
    """Where each layer's physical experts (slots) live.

    phy2log: int64 `[layers, P]`, logical expert of each slot; slot `p` is on GPU `p // (P/G)`.
    num_experts: `E`; every id in `0..E-1` must appear in every layer. (The plan file and the
        engines call it `num_logical_experts`, and P `num_physical_experts`: those names stay at
        that boundary, `moe_place.planfile` and `moe_place.engines`.)
    num_gpus: `G`, the EP size; `P % G == 0`.
    num_nodes: `N`; `G % N == 0`, GPU `g` is on node `g // (G/N)`.
    """

    phy2log: np.ndarray
    num_experts: int
    num_gpus: int
    num_nodes: int = 1
    allow_colocated: bool = False
    logcnt: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        phy2log = np.asarray(self.phy2log)
        if phy2log.ndim != 2:
            raise InputError("phy2log", "a 2-D array [layers, physical]", f"shape {phy2log.shape}")
        if phy2log.size and not np.issubdtype(phy2log.dtype, np.integer):
            raise InputError("phy2log", "integer expert ids", f"dtype {phy2log.dtype}")
        phy2log = np.array(phy2log, dtype=np.int64, order="C")   # its own copy: the caller's array (an
        # engine's map tensor, say) may change after this, and it stays writable for its owner
        num_layers, num_physical = phy2log.shape
        experts, gpus, nodes = self.num_experts, self.num_gpus, self.num_nodes
        if experts < 1:
            raise InputError("num_experts", "at least 1", experts)
        if gpus < 1 or num_physical % gpus:
            raise InputError("num_gpus", f"a divisor of the {num_physical} physical experts", gpus)
        if nodes < 1 or gpus % nodes:
            raise InputError("num_nodes", f"a divisor of num_gpus={gpus}", nodes)
        if num_physical < experts:
            raise InputError("phy2log", f"at least num_experts={experts} slots per layer", num_physical)
        if phy2log.size and (phy2log.min() < 0 or phy2log.max() >= experts):
            bad = phy2log[(phy2log < 0) | (phy2log >= experts)][0]
            raise InputError("phy2log", f"logical expert ids in [0, {experts})", int(bad))
        logcnt = replica_counts(phy2log, experts)
        if num_layers and logcnt.min() < 1:
            layer, expert = np.argwhere(logcnt < 1)[0]
            raise InputError(f"phy2log[{layer}]", f"every logical expert at least once (expert {expert} has no slot)")
        if not self.allow_colocated:
            dup = colocated_gpus(phy2log, gpus)
            if dup.any():
                layer, gpu = np.argwhere(dup)[0]
                raise InputError(f"phy2log[{layer}]", f"at most one replica of an expert per GPU (GPU {gpu} holds two)")
        phy2log.setflags(write=False)
        logcnt.setflags(write=False)
        object.__setattr__(self, "phy2log", phy2log)
        object.__setattr__(self, "logcnt", logcnt)

    @cached_property
    def log2phy(self) -> np.ndarray:
        """int64 `[layers, E, max(logcnt)]`: slots of each expert, ascending, padded with -1.

        Built on first use (it can be large when one expert has many replicas).
        """
        return _log2phy(self.phy2log, self.logcnt)

    # ------------------------------------------------------------------ shape
    @property
    def num_layers(self) -> int:
        return len(self.phy2log)

    @property
    def num_physical(self) -> int:
        return self.phy2log.shape[1]

    def gpu_of_slot(self) -> np.ndarray:
        """int64 `[P]`: the GPU of each slot."""
        return np.arange(self.num_physical) // self.slots_per_gpu

    # ------------------------------------------------------------------ loads
    def slot_loads(self, expert_load: np.ndarray) -> np.ndarray:
        """float64 `[layers, P]`: load each slot serves when replicas split evenly.

        expert_load: `[layers, E]` loads of logical experts (counts or any non-negative weight).
        """
        expert_load = self._check_loads(expert_load)
        rows = np.arange(self.num_layers)[:, None]
        share = expert_load / self.logcnt
        return share[rows, self.phy2log]

    def gpu_loads(self, expert_load: np.ndarray) -> np.ndarray:
        """float64 `[layers, G]`: load of each GPU under the even split."""
        return even_split_gpu_loads(self.phy2log, self._check_loads(expert_load), self.num_gpus)

    def _check_loads(self, expert_load: np.ndarray) -> np.ndarray:
        loads = np.asarray(expert_load, dtype=np.float64)
        if loads.shape != (self.num_layers, self.num_experts):
            raise InputError("expert_load", f"shape [{self.num_layers}, {self.num_experts}]", loads.shape)
        return loads

    # ------------------------------------------------------------------ constructors
    @classmethod
    def contiguous(cls, num_layers: int, num_experts: int, num_gpus: int, num_nodes: int = 1,
                   num_redundant: int = 0) -> "Placement":
        """Experts in equal contiguous blocks per GPU (slot `p` holds expert `p % E`).

        With `num_redundant = 0` this is the engines' default (SGLang's `trivial`): GPU `g` holds
        experts `g*E/G .. (g+1)*E/G - 1`. Redundant slots wrap around to experts 0, 1, ...
        """
        num_physical = num_experts + num_redundant
        row = np.arange(num_physical, dtype=np.int64) % num_experts
        return cls(np.tile(row, (num_layers, 1)), num_experts, num_gpus, num_nodes)

    # ------------------------------------------------------------------ comparison
    def moved_slots(self, old: "Placement") -> np.ndarray:
        """bool `[layers, P]`: slots whose logical expert differs from `old` (weights to copy)."""
        if old.phy2log.shape != self.phy2log.shape:
            raise InputError("current placement", f"phy2log of shape {self.phy2log.shape}", old.phy2log.shape)
        return self.phy2log != old.phy2log


def colocated_gpus(phy2log: np.ndarray, num_gpus: int) -> np.ndarray:
    """bool `[..., G]`: which GPUs hold two replicas of one expert. phy2log: int `[..., P]`, slot `p`
    on GPU `p // (P/G)`. The one co-location check: solvers that forbid it and the plan validation use it."""
    rows = np.asarray(phy2log)
    per_gpu = np.sort(rows.reshape(rows.shape[:-1] + (num_gpus, -1)), axis=-1)
    return (per_gpu[..., 1:] == per_gpu[..., :-1]).any(axis=-1)


def has_colocation(phy2log: np.ndarray, num_gpus: int) -> bool:
    """True when some GPU of some layer holds two replicas of one expert. phy2log: int `[P]` or `[layers, P]`."""
    return bool(colocated_gpus(phy2log, num_gpus).any())


def balance_ratio(mean: np.ndarray, peak: np.ndarray) -> np.ndarray:
    """float64: `mean / peak` elementwise, 1 where `peak` is 0 (an idle layer counts as balanced)."""
    mean, peak = np.asarray(mean, dtype=np.float64), np.asarray(peak, dtype=np.float64)
    return np.divide(mean, peak, out=np.ones_like(peak), where=peak > 0)


def balancedness(gpu_load: np.ndarray) -> np.ndarray:
    """float64 `[...]`: mean over max GPU load along the last axis, in (0, 1]; 1 where all are 0."""
    gpu_load = np.asarray(gpu_load, dtype=np.float64)
    return balance_ratio(gpu_load.mean(axis=-1), gpu_load.max(axis=-1))


def _layer_expert_keys(phy2log: np.ndarray, num_experts: int) -> np.ndarray:
    """int64 like `phy2log [rows, P]`: each slot's (row, expert) as one flat index `row * E + expert`."""
    return phy2log + (np.arange(len(phy2log)) * num_experts)[:, None]


def replica_counts(phy2log: np.ndarray, num_experts: int) -> np.ndarray:
    """int64 `[rows, E]`: how many slots of each row of `phy2log [rows, P]` hold each expert."""
    return _replica_counts(_layer_expert_keys(phy2log, num_experts), len(phy2log), num_experts)


def _replica_counts(keys: np.ndarray, rows: int, num_experts: int) -> np.ndarray:
    """`replica_counts` from the slots' `_layer_expert_keys`."""
    return np.bincount(keys.ravel(), minlength=rows * num_experts).reshape(rows, num_experts)


def even_split_slot_loads(phy2log: np.ndarray, expert_load: np.ndarray) -> np.ndarray:
    """float64 `[rows, P]`: the load of each slot of `phy2log` int `[rows, P]` under the even split.

    expert_load: `[rows, E]`. Each replica of an expert carries `load / replicas in its row`. No
    validation (callers that need it build a `Placement`), so it serves hot loops and plans with
    co-located replicas alike.
    """
    loads = np.asarray(expert_load, dtype=np.float64)
    rows, experts = loads.shape
    keys = _layer_expert_keys(phy2log, experts)
    share = loads / np.maximum(_replica_counts(keys, rows, experts), 1)
    return share.ravel()[keys]                               # flat indexing: this is a hot loop's


def even_split_gpu_loads(phy2log: np.ndarray, expert_load: np.ndarray, num_gpus: int) -> np.ndarray:
    """float64 `[rows, G]`: GPU loads of `phy2log` int `[rows, P]` under the even split (slot `p` is
    on GPU `p // (P/G)`; `even_split_slot_loads`, unchecked likewise)."""
    slots = even_split_slot_loads(phy2log, expert_load)
    return slots.reshape(len(slots), num_gpus, -1).sum(axis=-1)


def keep_unchanged_slots(new_rows: np.ndarray, old_rows: np.ndarray, slots_per_gpu: int) -> np.ndarray:
    """int64 like `new_rows` (`[P]` or `[layers, P]`): each GPU's slots reordered so that experts it
    already holds in `old_rows` keep their slot.

    Per GPU, old slots in order: a slot whose old expert is among the GPU's new experts (not yet
    placed) keeps it; the remaining new experts fill the other slots in their order in `new_rows`
    (the order vLLM's default policy preserves slots in). Only the order inside each GPU changes,
    so every GPU holds the same experts as in `new_rows` (the same loads), and a slot whose expert
    is unchanged needs no copy: the moved slots can only drop.
    """
    new = np.asarray(new_rows, dtype=np.int64)
    old = np.asarray(old_rows, dtype=np.int64)
    if new.shape != old.shape or new.shape[-1] % slots_per_gpu:
        raise InputError("keep_unchanged_slots", f"two maps of one shape, slots a multiple of {slots_per_gpu}",
                         f"{new.shape} and {old.shape}")
    fresh = new.reshape(-1, slots_per_gpu)                   # one row per (layer, GPU)
    before = old.reshape(-1, slots_per_gpu)
    # old slot i keeps its expert e when the GPU's new experts hold e at least as often as the old
    # slots up to i do: the k-th old copy of e pairs with the k-th new copy (in slot order)
    old_keys, new_keys = before, fresh
    if _has_repeats(before) or _has_repeats(fresh):   # co-located replicas: number the copies
        old_keys = before * slots_per_gpu + _occurrence(before)
        new_keys = fresh * slots_per_gpu + _occurrence(fresh)
    same = old_keys[:, :, None] == new_keys[:, None, :]      # [rows, old slot, new entry]
    kept = same.any(axis=2)
    used = same.any(axis=1)                                  # new entries already given a slot
    # the remaining new experts, in their order, fill the free slots in order
    return _fill_in_order(before, kept, fresh, used).reshape(new.shape)


def _fill_in_order(values: np.ndarray, kept: np.ndarray, spares: np.ndarray, spent: np.ndarray) -> np.ndarray:
    """Like `values [n, S]` where `kept`; per row, the other positions, in order, take the entries of
    `spares [n, S]` not `spent`, in order (the k-th free position the k-th unspent spare: each row has
    as many of one as of the other)."""
    rows = np.arange(len(values))[:, None]
    filled = np.empty_like(values)
    filled[rows, np.argsort(kept, axis=1, kind="stable")] = spares[rows, np.argsort(spent, axis=1, kind="stable")]
    return np.where(kept, values, filled)


def _has_repeats(rows: np.ndarray) -> bool:
    """True when a row of `rows [n, S]` holds a value twice."""
    ordered = np.sort(rows, axis=1)
    return bool((ordered[:, 1:] == ordered[:, :-1]).any())


def _occurrence(rows: np.ndarray) -> np.ndarray:
    """int64 like `rows [n, S]`: per entry, how many entries before it in its row hold the same value."""
    before = np.tri(rows.shape[1], k=-1, dtype=bool)        # [i, j]: j comes before i
    return ((rows[:, :, None] == rows[:, None, :]) & before).sum(axis=2)


def align_slots(new_rows: np.ndarray, old_rows: np.ndarray, num_gpus: int, num_nodes: int = 1) -> np.ndarray:
    """int64 `[layers, P]`: `new_rows` with its GPUs renumbered so that as many experts as possible
    stay on the GPU that holds them in `old_rows`, then its slots ordered by `keep_unchanged_slots`.

    A plan's GPUs are interchangeable (renumbering them moves whole GPU loads, so every GPU load
    stays what it was), but a solver numbers them its own way, and an engine copies an expert into
    every slot whose expert changes: matched to the map in use, a fresh plan moves only what it
    must. Per layer, new GPU `j` takes the place of old GPU `i` by a large-overlap matching of
    their expert sets (`max_overlap_matching`: greedy, largest overlap first).
    num_nodes > 1: whole nodes are matched first (by the experts they hold), then GPUs inside each
    matched pair of nodes, so every node keeps the experts the plan gave it together (a
    hierarchical plan keeps its expert groups inside one node).
    """
    new = np.atleast_2d(np.asarray(new_rows, dtype=np.int64))
    old = np.atleast_2d(np.asarray(old_rows, dtype=np.int64))
    layers, physical = new.shape
    if old.shape != new.shape or physical % num_gpus or num_gpus % num_nodes:
        raise InputError("align_slots", f"two maps of one shape, {num_gpus} GPUs on {num_nodes} nodes",
                         f"{new.shape} and {old.shape}")
    slots = physical // num_gpus
    per_node = num_gpus // num_nodes
    experts = int(max(new.max(), old.max())) + 1
    # overlap[l, i, j]: experts old GPU i and new GPU j of layer l both hold (all layers at once):
    # copies of each expert per GPU, old times new, summed over experts (a batched product)
    cell = (np.arange(layers * num_gpus).reshape(layers, num_gpus).repeat(slots, axis=1)) * experts  # (l, GPU)
    size, shape = layers * num_gpus * experts, (layers, num_gpus, experts)
    held_old = (np.bincount((cell + old).ravel(), minlength=size) > 0).reshape(shape).astype(np.float64)
    held_new = np.bincount((cell + new).ravel(), minlength=size).reshape(shape).astype(np.float64)
    overlap = held_old @ held_new.transpose(0, 2, 1)
    if num_nodes == 1:
        place = max_overlap_matching(overlap)                                # new GPU j -> old GPU place[l, j]
    else:
        blocks = overlap.reshape(layers, num_nodes, per_node, num_nodes, per_node)
        nodes = max_overlap_matching(blocks.sum(axis=(2, 4)))               # new node b -> old node nodes[l, b]
        pairs = blocks[np.arange(layers)[:, None], nodes, :, np.arange(num_nodes)[None, :], :]  # [L, b, i, j]
        place = (nodes[:, :, None] * per_node + max_overlap_matching(pairs)).reshape(layers, num_gpus)
    out = np.empty((layers, num_gpus, slots), dtype=np.int64)
    out[np.arange(layers)[:, None], place] = new.reshape(layers, num_gpus, slots)
    out = out.reshape(layers, physical)
    return keep_unchanged_slots(out, old, slots)


def max_overlap_matching(score: np.ndarray) -> np.ndarray:
    """int64 `[..., n]`: for square `score [..., rows, columns]` matrices of overlaps (any leading
    batch shape), the row matched to each column: greedy from the largest entries (each row and
    column once; ties by the lowest row-major index), columns left unmatched (no positive entry
    free) take the free rows in order. A greedy matching keeps at least half the best total; on
    these sparse overlaps (a GPU shares experts with few others) it was within 1% of a
    pairwise-exchange search, at a fraction of the time."""
    score = np.asarray(score, dtype=np.float64)
    batch, n = score.shape[:-2], score.shape[-1]
    flat = score.reshape(-1, n, n)
    count = flat.shape[0]
    row_of = _greedy_by_walk(flat) if count < WALK_MATCHING_BELOW else _greedy_by_rounds(flat)
    # unmatched columns, in order, take the free rows, in order
    taken = np.zeros((count, n), dtype=bool)
    hit = row_of >= 0
    taken[np.nonzero(hit)[0], row_of[hit]] = True
    every_row = np.broadcast_to(np.arange(n), (count, n))
    return _fill_in_order(row_of, hit, every_row, taken).reshape(*batch, n)


WALK_MATCHING_BELOW = 16
"""`max_overlap_matching` walks fewer matrices than this one at a time down their sorted entries (cheaper
for one engine call's few layers), more all at once in rounds with numpy; both take the same entries."""


def _greedy_by_rounds(flat: np.ndarray) -> np.ndarray:
    """int64 `[count, n]`: the greedy's row of each column of `flat [count, n, n]`, -1 where no positive
    entry was left free. All matrices at once: n rounds, each taking every matrix's largest free entry."""
    count, n = flat.shape[0], flat.shape[-1]
    every = np.arange(count)
    row_of = np.full((count, n), -1, dtype=np.int64)
    free = np.where(flat > 0, flat, -np.inf)                 # entries still takeable
    for _ in range(n):
        best = np.argmax(free.reshape(count, -1), axis=1)
        i, j = np.divmod(best, n)
        ok = np.isfinite(free[every, i, j])
        if not ok.any():
            break
        row_of[every[ok], j[ok]] = i[ok]
        free[every[ok], i[ok], :] = -np.inf                  # row i and column j are taken
        free[every[ok], :, j[ok]] = -np.inf
    return row_of


def _greedy_by_walk(flat: np.ndarray) -> np.ndarray:
    """`_greedy_by_rounds`, one matrix at a time: its positive entries in descending order (row-major on
    ties), each taken when its row and column are still free."""
    count, n = flat.shape[0], flat.shape[-1]
    entries = flat.reshape(count, -1)
    order = np.argsort(-entries, axis=1, kind="stable")
    positive = (entries > 0).sum(axis=1).tolist()
    rows, columns = (order // n).tolist(), (order % n).tolist()
    row_of = np.full((count, n), -1, dtype=np.int64)
    for matrix in range(count):
        row_free, column_row, left = [True] * n, [-1] * n, n
        for i, j in zip(rows[matrix][:positive[matrix]], columns[matrix][:positive[matrix]]):
            if row_free[i] and column_row[j] < 0:
                row_free[i], column_row[j], left = False, i, left - 1
                if not left:
                    break
        row_of[matrix] = column_row
    return row_of


def _log2phy(phy2log: np.ndarray, logcnt: np.ndarray) -> np.ndarray:
    """int64 `[layers, E, max(logcnt)]`: slots of each expert in ascending order, -1 padded."""
    num_layers, num_physical = phy2log.shape
    experts = logcnt.shape[1]
    width = int(logcnt.max()) if logcnt.size else 0
    out = np.full((num_layers, experts, width), -1, dtype=np.int64)
    if out.size:
        keys = _layer_expert_keys(phy2log, experts).ravel()
        order = np.argsort(keys, kind="stable")            # every (layer, expert)'s slots, ascending
        starts = np.cumsum(logcnt.ravel()) - logcnt.ravel()
        rank = np.arange(keys.size) - np.repeat(starts, logcnt.ravel())
        out.reshape(-1, width)[keys[order], rank] = order % num_physical
    out.setflags(write=False)
    return out
