"""The per-batch split on the GPU: the solve (rows of each replicated expert per slot) and the mapping of a
rank's dispatches to slots. The numpy model of both is `moe_place.split` (its docstring is the spec).

Idea
----
Per MoE layer and batch, the engine does (every rank, the same way):

    counts_local [E]  = count_dispatches(topk_ids)        this rank's dispatches per logical expert
    counts [E]        = all_reduce(counts_local)          the batch's global dispatches (one all-reduce)
    shares [P]        = split_solve(table, counts)        whole rows per slot, summing to counts per expert
    slots [T, k]      = map_tokens(topk_ids, ..., shares) the physical slot of each of this rank's dispatches

`SplitTable.from_map` builds, once per map and on the host, what the kernels read: the replicated experts in
colour classes (experts of one class share no GPU, so a class is worked at once: `moe_place.split`'s
`colour_classes`), each slot's GPU, and the slots of each expert (`log2phy`).

The solve (`split_solve`): one program per layer, latency-bound; its state lives in registers.
1. Units. Rows are counted in integer units of 1/`UNITS` row (int32), not in float32: every step below is
   integer arithmetic, so any order of summation gives the same bits. The torch reference then agrees exactly
   with the kernel whatever order Triton's reductions take (a float32 sum over a tile has no order Triton
   promises, and a serial one would cost a pass per element), every rank of the EP group computes the same
   shares, and `moe_place.split`'s float64 reals are followed to 1/256 row: on the bundled trace the busiest
   GPU came out equal to numpy's on every layer at EP16+32, EP32+32 and EP64+64 (the tests hold it within a
   row). The price: at most `MAX_DISPATCHES` (8.4 million) dispatches per layer, and an integer division per
   expert and drop pass.
2. Start: the layer's whole class table is read at once (one trip to memory); each replicated expert's units
   over its GPUs in proportion to its slots there (the engines' even split, the units of the division's
   remainder on its first slot's GPU). GPU loads: a `[G]` tile.
3. `sweeps` Gauss-Seidel sweeps over the colour classes (`moe_place.split` step 2): a class's experts' units
   come off their GPUs and are poured back by water-filling, one unit at a time to the lowest GPU (ties: the
   lower slot), in closed form (`_water_fill`): the level drops GPUs at or above it until none is (at most
   one pass per replica, usually two or three), then the floors below the level and the units left one each
   to the GPUs at the level in slot order. A class's GPU loads are read from the `[G]` tile with `tl.gather`
   (a shuffle through shared memory: Triton has no indexed register read) and written back by a second
   gather through the class's inverse map (each GPU holds at most one expert of a class, so no two writes
   meet). The classes go in the table's order (the colouring's: most replicas first), as `moe_place.split`'s
   `_sweep` does. A FIXED number of sweeps, not the numpy stop rule: the bound `_prefix_bound` ranks the GPUs
   and takes each expert's last GPU in that order, O(G^2 + E * replicas) work per check, more than a sweep; a
   fixed count gives the CUDA graph a fixed latency; and on the bundled trace 4 sweeps already meet the
   accuracy bar (tests/test_kernels_split.py), `SWEEPS` doubles that.
4. Whole rows (`moe_place.split._whole_rows`, `_polish`): each GPU keeps the floor of its units; the rows each
   expert has left are poured by the same water-filling in whole rows onto the whole-row loads, class by class,
   then `POLISH_SWEEPS` sweeps in whole rows. A GPU's rows of an expert are split evenly over the expert's
   slots on that GPU (co-located replicas), the lower slots taking the extra row.
Slots of experts with one replica take the expert's count.

The mapping (`count_dispatches`, then `map_tokens`), exactly `moe_place.split.map_tokens` for one rank: the
`j`-th of the rank's `c` dispatches of expert `e` in token order goes to the replica whose interval of the
cumulative shares holds `(j + phase) / c`, in integers. `j` must not depend on the order in which GPU
threads run, so it is counted, not claimed with atomics:
1. `_count_kernel`: one program per block of `BLOCK_DISPATCHES` consecutive dispatches: its histogram over
   experts (`tl.histogram`) -> `block_counts [B, E]`.
2. `_scan_kernel`: per expert, an exclusive prefix sum over blocks -> `block_start [B, E]` (dispatches of `e` in
   earlier blocks) and the total, `counts_local [E]` (the all-reduce's input).
3. `_map_kernel`: one program per block: `j = block_start[b, e] + ` the earlier dispatches of `e` in the block
   (a `[BLOCK, BLOCK]` comparison, lower triangle), then the replica by integer comparisons against the
   cumulative shares of `e`, read through `log2phy` (int64: `(j * 2^16 + phase) * counts[e]` passes 2^31).
Steps 1-2 run before the all-reduce, step 3 after the solve.

`split_solve_torch`, `count_dispatches_torch` and `map_tokens_torch` are the plain-torch references (the
water level there by sorting, not by dropping GPUs: an independent route to the same integers).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from moe_place.errors import InputError
from moe_place.split import GOLDEN_PHASE, PHASE_UNITS, POLISH_SWEEPS, colour_classes, cumulative_shares

__all__ = ["DispatchCounts", "SplitTable", "count_dispatches", "count_dispatches_torch", "map_tokens",
           "map_tokens_torch", "split_solve", "split_solve_torch"]

UNITS = 256                 # a row is 256 units in the solve's real-number phase (step 1 of the note)
MAX_DISPATCHES = (2**31 - 1) // UNITS - 1024   # a layer's dispatches (sum of counts) that keep units in int32
SWEEPS = 8                  # Gauss-Seidel sweeps; 4 meet the accuracy bar on the bundled trace (step 3)
BLOCK_DISPATCHES = 128      # dispatches per program of the mapping (its in-block comparison is BLOCK^2)
SCAN_BLOCKS = 32            # rows of block_counts a scan program sums per step (of 32 experts)


# ---------------------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class SplitTable:
    """What the kernels read of a map (`phy2log [L, P]`), built once per map on the host (`from_map`).

    The replicated experts of layer `l` in colour classes `c < num_classes[l]`; class `c` holds up to `BK`
    experts `k` (`class_expert [L, C, BK]`, -1 padded), each with up to `BM` slots `m` in ascending order:

        class_slot [L, C, BK, BM]    the slot, -1 padded
        class_gpu                    its GPU (`slot // S`; 0 in padding)
        class_lead                   the position `m` of the expert's first slot on that GPU (-1 in padding):
                                     `lead == m` marks the one slot per (expert, GPU) that carries its load
        class_mult, class_nth        the expert's slots on that GPU, and this slot's index among them
        class_inverse [L, C, BG]     for GPU `g`: `k * BM + m` of the class's leading slot on `g`, -1 if none

    phy2log int32 `[L, P]`; replicated int32 `[L, P]` (1 where the slot's expert has two or more replicas);
    num_classes int32 `[L]`; log2phy int32 `[L, E, W]` each expert's slots ascending, -1 padded; logcnt int32
    `[L, E]`. `BK`, `BM`, `BG` are powers of two (the kernel's tile sizes). All on one device.
    """

    num_gpus: int
    num_experts: int
    phy2log: torch.Tensor
    replicated: torch.Tensor
    num_classes: torch.Tensor
    class_expert: torch.Tensor
    class_slot: torch.Tensor
    class_gpu: torch.Tensor
    class_lead: torch.Tensor
    class_mult: torch.Tensor
    class_nth: torch.Tensor
    class_inverse: torch.Tensor
    log2phy: torch.Tensor
    logcnt: torch.Tensor

    @property
    def num_layers(self) -> int:
        return int(self.phy2log.shape[0])

    @property
    def num_slots(self) -> int:
        return int(self.phy2log.shape[1])

    @property
    def slots_per_gpu(self) -> int:
        return self.num_slots // self.num_gpus

    @classmethod
    def from_map(cls, phy2log, num_gpus: int, num_experts: int | None = None, device="cpu") -> "SplitTable":
        """The table of `phy2log` (int `[P]` or `[L, P]`, slot `p` on GPU `p // (P / num_gpus)`; co-located
        replicas allowed); `num_experts` defaults to the largest id + 1."""
        rows = np.atleast_2d(np.asarray(phy2log))
        if rows.ndim != 2 or rows.size == 0 or not np.issubdtype(rows.dtype, np.integer):
            raise InputError("phy2log", "integer expert ids [P] or [layers, P]", f"{rows.dtype} {rows.shape}")
        rows = rows.astype(np.int64)
        layers, physical = rows.shape
        if num_gpus < 1 or physical % num_gpus:
            raise InputError("num_gpus", f"a divisor of the {physical} slots", num_gpus)
        experts = int(rows.max()) + 1 if num_experts is None else num_experts
        if rows.min() < 0 or rows.max() >= experts:
            raise InputError("phy2log", f"expert ids in [0, {experts})", int(rows[(rows < 0) | (rows >= experts)][0]))
        per_gpu = physical // num_gpus
        logcnt = np.stack([np.bincount(r, minlength=experts) for r in rows])
        classes = [colour_classes(r, experts, per_gpu) for r in rows]
        width_c = max([1] + [t.shape[0] for t in classes if t is not None])
        block_k = triton.next_power_of_2(max([1] + [t.shape[1] for t in classes if t is not None]))
        block_m = triton.next_power_of_2(max([1] + [t.shape[2] for t in classes if t is not None]))
        block_g = triton.next_power_of_2(num_gpus)
        slot = np.full((layers, width_c, block_k, block_m), -1, dtype=np.int64)
        for layer, t in enumerate(classes):
            if t is not None:
                slot[layer, :t.shape[0], :t.shape[1], :t.shape[2]] = t
        valid = slot >= 0
        gpu = np.where(valid, slot // per_gpu, 0)
        same = (gpu[..., :, None] == gpu[..., None, :]) & valid[..., :, None] & valid[..., None, :]
        earlier = np.tril(np.ones((block_m, block_m), dtype=bool), k=-1)
        lead = np.where(valid, np.argmax(same, axis=-1), -1)          # the first m' on the same GPU
        mult = same.sum(axis=-1)
        nth = (same & earlier).sum(axis=-1)
        expert = np.where(valid[..., 0], np.take_along_axis(rows, np.maximum(slot[..., 0], 0).reshape(layers, -1),
                                                            axis=1).reshape(valid.shape[:-1]), -1)
        inverse = np.full((layers, width_c, block_g), -1, dtype=np.int64)
        entry = np.arange(block_k * block_m).reshape(block_k, block_m)
        leading = valid & (lead == np.arange(block_m))
        where = np.nonzero(leading)
        inverse[where[0], where[1], gpu[where]] = entry[where[2], where[3]]
        log2phy = np.full((layers, experts, int(logcnt.max())), -1, dtype=np.int64)
        for layer, r in enumerate(rows):
            own = cumulative_shares(r, np.zeros_like(r), experts)[0]
            log2phy[layer, :, :own.shape[1]] = own
        num_classes = [0 if t is None else t.shape[0] for t in classes]

        def tensor(a):
            return torch.as_tensor(np.ascontiguousarray(a), dtype=torch.int32, device=device)

        return cls(num_gpus, experts, tensor(rows), tensor(logcnt[np.arange(layers)[:, None], rows] >= 2),
                   tensor(num_classes), tensor(expert), tensor(slot), tensor(gpu), tensor(lead), tensor(mult),
                   tensor(nth), tensor(inverse), tensor(log2phy), tensor(logcnt))


# ---------------------------------------------------------------------------------------- the solve
@triton.jit
def _water_fill(level, amount, active):
    """int32 `[BK, BM]`: `amount [BK]` units (>= 0) poured on the `active` entries of each row of `level [BK, BM]`,
    one at a time to the lowest (ties: the lower `m`), in closed form. The real level `L` of a row is the mean
    of `amount` and the levels below it; the entries at or above `ceil(mean)` are dropped until none is."""
    inside = active & (amount[:, None] > 0)
    n = tl.sum(inside.to(tl.int32), axis=1)
    total = amount + tl.sum(tl.where(inside, level, 0), axis=1)
    drop = inside & (level >= ((total + n - 1) // tl.maximum(n, 1))[:, None])
    while tl.max(tl.max(drop.to(tl.int32), axis=1), axis=0) > 0:
        inside = inside & (drop == 0)
        n = tl.sum(inside.to(tl.int32), axis=1)
        total = amount + tl.sum(tl.where(inside, level, 0), axis=1)
        drop = inside & (level >= ((total + n - 1) // tl.maximum(n, 1))[:, None])
    floor = total // tl.maximum(n, 1)                                  # floor(L)
    at = active & (amount[:, None] > 0) & (level <= floor[:, None])
    fill = tl.where(at, floor[:, None] - level, 0)
    rest = amount - tl.sum(fill, axis=1)                               # < the entries at the floor
    rank = tl.cumsum(at.to(tl.int32), axis=1) - at.to(tl.int32)         # their order by m
    return fill + (at & (rank < rest[:, None])).to(tl.int32)


@triton.jit
def _gather_load(load, gpu, BK: tl.constexpr, BM: tl.constexpr):
    """int32 `[BK, BM]`: `load [BG]` at `gpu [BK, BM]`."""
    return tl.reshape(tl.gather(load, tl.reshape(gpu, (BK * BM,)), 0), (BK, BM))


@triton.jit
def _scatter_add(load, delta, inverse, BK: tl.constexpr, BM: tl.constexpr):
    """int32 `[BG]`: `load` plus, on each GPU a class's leading slot is on, that slot's `delta [BK, BM]`."""
    return load + tl.where(inverse >= 0, tl.gather(tl.reshape(delta, (BK * BM,)), tl.maximum(inverse, 0), 0), 0)


@triton.jit
def _scatter_add_all(load, values, inverse, BC: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, BG: tl.constexpr):
    """int32 `[BG]`: `load` plus every class's `values [BC, BK, BM]` at its leading slot on each GPU (`inverse
    [BC, BG]`, -1 where a class has none)."""
    index = tl.where(inverse >= 0, tl.arange(0, BC)[:, None] * (BK * BM) + inverse, 0)
    picked = tl.reshape(tl.gather(tl.reshape(values, (BC * BK * BM,)), tl.reshape(index, (BC * BG,)), 0), (BC, BG))
    return load + tl.sum(tl.where(inverse >= 0, picked, 0), axis=0)


@triton.jit
def _split_solve_kernel(
    counts_ptr, shares_ptr,                       # counts [L, E] (int32/int64), shares [L, P] out
    phy2log_ptr, replicated_ptr, num_classes_ptr,  # the SplitTable's tensors
    expert_ptr, slot_ptr, gpu_ptr, lead_ptr, mult_ptr, nth_ptr, inverse_ptr,
    layer0, C, P, S, G, sweeps,                   # first layer of the launch; sizes; Gauss-Seidel sweeps
    stride_counts, stride_shares,
    UNITS: tl.constexpr, POLISH: tl.constexpr,
    BC: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, BG: tl.constexpr, BS: tl.constexpr,
):
    layer = layer0 + tl.program_id(0)
    counts_ptr += tl.program_id(0).to(tl.int64) * stride_counts
    shares_ptr += tl.program_id(0).to(tl.int64) * stride_shares
    classes = tl.load(num_classes_ptr + layer)
    # 0. slots of experts with one replica: the count; the GPU loads they make (whole rows)
    g_idx = tl.arange(0, BG)
    s_idx = tl.arange(0, BS)
    slot_2d = g_idx[:, None] * S + s_idx[None, :]
    in_map = (g_idx[:, None] < G) & (s_idx[None, :] < S)
    expert_2d = tl.load(phy2log_ptr + layer * P + slot_2d, mask=in_map, other=0)
    single = in_map & (tl.load(replicated_ptr + layer * P + slot_2d, mask=in_map, other=1) == 0)
    count_2d = tl.load(counts_ptr + expert_2d, mask=single, other=0).to(tl.int32)
    tl.store(shares_ptr + slot_2d, count_2d.to(shares_ptr.dtype.element_ty), mask=single)
    fixed = tl.sum(count_2d, axis=1)                                   # [BG] rows

    c_idx = tl.arange(0, BC)
    k_idx = tl.arange(0, BK)
    m_idx = tl.arange(0, BM)
    entry = k_idx[:, None] * BM + m_idx[None, :]
    # 1. every class's table at once (one trip to memory, not one per class), the even start, the GPU loads
    in_table = c_idx < classes
    tables = (layer * C + c_idx).to(tl.int64)
    lead_all = tl.load(lead_ptr + tables[:, None, None] * (BK * BM) + entry[None, :, :], mask=in_table[:, None, None],
                       other=-1)
    mult_all = tl.load(mult_ptr + tables[:, None, None] * (BK * BM) + entry[None, :, :], mask=in_table[:, None, None],
                       other=1)
    experts = tl.load(expert_ptr + tables[:, None] * BK + k_idx[None, :], mask=in_table[:, None], other=-1)
    rows = tl.load(counts_ptr + experts, mask=experts >= 0, other=0).to(tl.int32)             # [BC, BK]
    inverse = tl.load(inverse_ptr + tables[:, None] * BG + g_idx[None, :], mask=in_table[:, None], other=-1)
    leading_all = lead_all == m_idx[None, None, :]
    replicas = tl.maximum(tl.sum((lead_all >= 0).to(tl.int32), axis=2), 1)
    amount = rows * UNITS
    units = tl.where(leading_all, (amount // replicas)[:, :, None] * mult_all, 0) \
        + tl.where(leading_all & (m_idx[None, None, :] == 0), (amount % replicas)[:, :, None], 0)   # [BC, BK, BM]
    load = _scatter_add_all(fixed * UNITS, units, inverse, BC, BK, BM, BG)
    # 2. Gauss-Seidel sweeps in units, a class at a time (its table comes from the cache now)
    for step in range(0, sweeps * classes):
        c = step % classes
        table = (layer * C + c).to(tl.int64)
        leading = tl.load(lead_ptr + table * BK * BM + entry) == m_idx[None, :]
        gpu = tl.load(gpu_ptr + table * BK * BM + entry)
        mine = tl.sum(tl.where(c_idx[:, None, None] == c, units, 0), axis=0)
        new = _water_fill(_gather_load(load, gpu, BK, BM) - mine, tl.sum(tl.where(c_idx[:, None] == c, amount, 0), 0),
                          leading)
        load = _scatter_add(load, new - mine, tl.sum(tl.where(c_idx[:, None] == c, inverse, 0), axis=0), BK, BM)
        units = tl.where(c_idx[:, None, None] == c, new[None, :, :], units)
    # 3. whole rows: the floors, then each expert's rows left poured onto the whole-row loads, then the polish
    whole = units // UNITS
    load = _scatter_add_all(fixed, whole, inverse, BC, BK, BM, BG)
    for step in range(0, (POLISH + 1) * classes):
        c = step % classes
        table = (layer * C + c).to(tl.int64)
        lead = tl.load(lead_ptr + table * BK * BM + entry)
        leading = lead == m_idx[None, :]
        gpu = tl.load(gpu_ptr + table * BK * BM + entry)
        mine = tl.sum(tl.where(c_idx[:, None, None] == c, whole, 0), axis=0)
        rows_c = tl.sum(tl.where(c_idx[:, None] == c, rows, 0), axis=0)
        if step < classes:   # rounding: the rows left on top of the floors
            new = mine + _water_fill(_gather_load(load, gpu, BK, BM), rows_c - tl.sum(mine, axis=1), leading)
        else:                # polish: all of the expert's rows off and back
            new = _water_fill(_gather_load(load, gpu, BK, BM) - mine, rows_c, leading)
        load = _scatter_add(load, new - mine, tl.sum(tl.where(c_idx[:, None] == c, inverse, 0), axis=0), BK, BM)
        whole = tl.where(c_idx[:, None, None] == c, new[None, :, :], whole)
        if step >= POLISH * classes:   # the class's last pass: its slots' shares
            valid = lead >= 0
            on_gpu = tl.reshape(tl.gather(tl.reshape(new, (BK * BM,)),
                                          tl.reshape(k_idx[:, None] * BM + tl.maximum(lead, 0), (BK * BM,)), 0),
                                (BK, BM))
            mult = tl.maximum(tl.load(mult_ptr + table * BK * BM + entry), 1)
            nth = tl.load(nth_ptr + table * BK * BM + entry)
            share = on_gpu // mult + (nth < on_gpu % mult).to(tl.int32)
            slot = tl.load(slot_ptr + table * BK * BM + entry)
            tl.store(shares_ptr + tl.maximum(slot, 0), share.to(shares_ptr.dtype.element_ty), mask=valid)


def split_solve(table: SplitTable, counts: torch.Tensor, sweeps: int = SWEEPS, layer: int | None = None,
                out: torch.Tensor | None = None, check_counts: bool = True,
                num_warps: int | None = None) -> torch.Tensor:
    """Whole rows per slot, like `counts` (int32 or int64): `[L, P]` for counts `[L, E]` of every layer of the
    table, or `[P]` for counts `[E]` of layer `layer` (default 0). One program per layer (module note).

    sweeps: Gauss-Seidel sweeps (>= 0; 0 keeps the even split, then rounds and polishes it).
    out: where to write the shares (`[L, P]` or `[P]`, unit column stride, the counts' dtype), else a new tensor.
    check_counts: verify the counts are >= 0 and their sum at most `MAX_DISPATCHES` per layer (a device-to-host
    sync); False on a hot path (it can then be captured in a CUDA graph).
    num_warps: default 4, 8 for class tiles over 512 entries (EP64 and wider with many replicas).
    """
    counts2, layer0 = _solve_inputs(table, counts, sweeps, layer, check_counts)
    shape = (counts2.shape[0], table.num_slots)
    if out is None:
        out = torch.empty(shape[1:] if counts.ndim == 1 else shape, dtype=counts2.dtype, device=counts2.device)
    shares = out.view(shape) if out.ndim == 1 else out
    if tuple(shares.shape) != shape or shares.dtype != counts2.dtype or shares.stride(1) != 1 \
            or out.ndim != counts.ndim or out.device != counts.device:
        raise InputError("out", f"{counts2.dtype} {list(shape[1:] if counts.ndim == 1 else shape)} on {counts.device}, "
                         "unit column stride", f"{out.dtype} {tuple(out.shape)} on {out.device}")
    width_c, block_k, block_m = table.class_slot.shape[1:]
    num_warps = num_warps or (4 if block_k * block_m <= 512 else 8)
    _split_solve_kernel[(counts2.shape[0],)](
        counts2, shares, table.phy2log, table.replicated, table.num_classes, table.class_expert, table.class_slot,
        table.class_gpu, table.class_lead, table.class_mult, table.class_nth, table.class_inverse,
        layer0, width_c, table.num_slots, table.slots_per_gpu, table.num_gpus, sweeps,
        counts2.stride(0), shares.stride(0),
        UNITS=UNITS, POLISH=POLISH_SWEEPS, BC=triton.next_power_of_2(width_c), BK=block_k, BM=block_m,
        BG=table.class_inverse.shape[2], BS=triton.next_power_of_2(table.slots_per_gpu), num_warps=num_warps)
    return out


def _solve_inputs(table: SplitTable, counts: torch.Tensor, sweeps: int, layer: int | None,
                  check: bool) -> tuple[torch.Tensor, int]:
    """(counts `[n, E]` with unit column stride, the first table layer they belong to); InputError otherwise."""
    if counts.dtype not in (torch.int32, torch.int64):
        raise InputError("counts", "int32 or int64 dispatches per expert", counts.dtype)
    if counts.device != table.phy2log.device:
        raise InputError("counts", f"a tensor on the table's device ({table.phy2log.device})", counts.device)
    if isinstance(sweeps, bool) or not isinstance(sweeps, int) or sweeps < 0:
        raise InputError("sweeps", "an integer >= 0", sweeps)
    if counts.ndim == 1:
        layer = 0 if layer is None else layer
        if not 0 <= layer < table.num_layers:
            raise InputError("layer", f"a layer of the table in [0, {table.num_layers})", layer)
        counts2 = counts[None]
    elif counts.ndim == 2 and layer is None and counts.shape[0] == table.num_layers:
        counts2, layer = counts, 0
    else:
        raise InputError("counts", f"[E] with a layer, or [{table.num_layers}, E] for every layer of the table",
                         f"shape {tuple(counts.shape)} (layer {layer})")
    if counts2.shape[1] != table.num_experts:
        raise InputError("counts", f"{table.num_experts} experts (the table's)", counts2.shape[1])
    counts2 = counts2 if counts2.stride(1) == 1 else counts2.contiguous()
    if check and counts2.numel():
        if int(counts2.min()) < 0:
            raise InputError("counts", "counts >= 0", int(counts2.min()))
        if int(counts2.sum(dim=1).max()) > MAX_DISPATCHES:
            raise InputError("counts", f"at most {MAX_DISPATCHES} dispatches per layer (int32 units)",
                             int(counts2.sum(dim=1).max()))
    return counts2, layer


def split_solve_torch(table: SplitTable, counts: torch.Tensor, sweeps: int = SWEEPS,
                      layer: int | None = None) -> torch.Tensor:
    """The plain-torch reference of `split_solve` (same arguments, same integers), vectorised over layers."""
    counts2, layer0 = _solve_inputs(table, counts, sweeps, layer, True)
    layers = slice(layer0, layer0 + counts2.shape[0])
    load_of = counts2.long()
    n = load_of.shape[0]
    phy2log = table.phy2log[layers].long()
    expert = table.class_expert[layers].long()
    slot, gpu, lead, mult, nth = (getattr(table, f"class_{name}")[layers].long()
                                  for name in ("slot", "gpu", "lead", "mult", "nth"))
    width_c, block_k, block_m = slot.shape[1:]
    m = torch.arange(block_m, device=slot.device)
    leading = lead == m
    rows = torch.where(expert >= 0, load_of.gather(1, expert.clamp(min=0).reshape(n, -1)).reshape(expert.shape), 0)
    shares = load_of.gather(1, phy2log)                                 # one-replica slots: the count
    gpu_of_slot = torch.arange(table.num_slots, device=slot.device) // table.slots_per_gpu
    fixed = torch.zeros(n, table.num_gpus, dtype=torch.int64, device=slot.device).scatter_add_(
        1, gpu_of_slot.expand(n, -1), torch.where(table.replicated[layers].bool(), 0, shares))

    def per_gpu(load, values, c):      # load [n, G] plus values [n, BK, BM] of class c at its leading slots
        return load.scatter_add(1, gpu[:, c].reshape(n, -1), torch.where(leading[:, c], values, 0).reshape(n, -1))

    def gathered(load, c):             # [n, BK, BM]: the GPU loads at class c's slots
        return load.gather(1, gpu[:, c].reshape(n, -1)).reshape(n, block_k, block_m)

    # 1. the even start, in units
    units = rows * UNITS
    replicas = (lead >= 0).sum(dim=-1).clamp(min=1)
    state = torch.where(leading, (units // replicas)[..., None] * mult, 0) \
        + torch.where(leading & (m == 0), (units % replicas)[..., None], 0)
    load = fixed * UNITS
    for c in range(width_c):
        load = per_gpu(load, state[:, c], c)
    # 2. Gauss-Seidel sweeps (a layer's padding classes change nothing)
    for _ in range(sweeps):
        for c in range(width_c):
            new = _water_fill_torch(gathered(load, c) - state[:, c], units[:, c], leading[:, c])
            load = per_gpu(load, new - state[:, c], c)
            state[:, c] = new
    # 3. whole rows: floors, the rows left, then the polish sweeps
    whole = state // UNITS
    load = fixed
    for c in range(width_c):
        load = per_gpu(load, whole[:, c], c)
    for c in range(width_c):
        new = whole[:, c] + _water_fill_torch(gathered(load, c), rows[:, c] - whole[:, c].sum(dim=-1), leading[:, c])
        load = per_gpu(load, new - whole[:, c], c)
        whole[:, c] = new
    for _ in range(POLISH_SWEEPS):
        for c in range(width_c):
            new = _water_fill_torch(gathered(load, c) - whole[:, c], rows[:, c], leading[:, c])
            load = per_gpu(load, new - whole[:, c], c)
            whole[:, c] = new
    # 4. a GPU's rows over the expert's slots on it
    on_gpu = whole.gather(-1, lead.clamp(min=0))
    share = on_gpu // mult.clamp(min=1) + (nth < on_gpu % mult.clamp(min=1)).long()
    valid = slot >= 0
    owner = torch.arange(n, device=slot.device)[:, None, None, None].expand_as(slot)
    shares[owner[valid], slot[valid]] = share[valid]
    shares = shares.to(counts2.dtype)
    return shares[0] if counts.ndim == 1 else shares


def _water_fill_torch(level: torch.Tensor, amount: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """int64 like `level [..., M]`: what `_water_fill` computes, with the level found by sorting: the least,
    over the prefixes of the active levels in ascending order, of floor((amount + their sum) / their number)."""
    inside = active & (amount[..., None] > 0)
    big = 1 << 40
    ascending = torch.where(inside, level, big).sort(dim=-1).values
    number = torch.arange(1, level.shape[-1] + 1, device=level.device)
    candidates = torch.where(ascending < big, (amount[..., None] + ascending.cumsum(dim=-1)) // number, big)
    floor = candidates.amin(dim=-1)
    at = inside & (level <= floor[..., None])
    fill = torch.where(at, floor[..., None] - level, 0)
    rest = amount - fill.sum(dim=-1)
    rank = at.long().cumsum(dim=-1) - at.long()
    return fill + (at & (rank < rest[..., None])).long()


# ---------------------------------------------------------------------------------------- the mapping
@triton.jit
def _count_kernel(
    ids_ptr, block_counts_ptr,               # topk_ids [T, k] (int32/int64), block_counts [B, E] out (int32)
    num_dispatches, top_k, stride_t, stride_j, E,
    BLOCK: tl.constexpr, BE: tl.constexpr,
):
    block = tl.program_id(0)
    i = block * BLOCK + tl.arange(0, BLOCK)
    live = i < num_dispatches
    expert = tl.load(ids_ptr + (i // top_k).to(tl.int64) * stride_t + (i % top_k) * stride_j, mask=live, other=0)
    histogram = tl.histogram(expert.to(tl.int32), BE, mask=live)
    e = tl.arange(0, BE)
    tl.store(block_counts_ptr + block.to(tl.int64) * E + e, histogram, mask=e < E)


@triton.jit
def _scan_kernel(
    block_counts_ptr, block_start_ptr, counts_ptr,   # block_counts [B, E]; block_start [B, E], counts [E] out
    num_blocks, E,
    BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr,
):
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    carry = tl.zeros((BLOCK_E,), dtype=tl.int32)         # dispatches of e in the blocks before this step's
    for first in range(0, num_blocks, BLOCK_B):
        b = first + tl.arange(0, BLOCK_B)
        mask = (b[:, None] < num_blocks) & (e[None, :] < E)
        offsets = b.to(tl.int64)[:, None] * E + e[None, :]
        here = tl.load(block_counts_ptr + offsets, mask=mask, other=0)
        tl.store(block_start_ptr + offsets, carry[None, :] + tl.cumsum(here, axis=0) - here, mask=mask)
        carry += tl.sum(here, axis=0)
    tl.store(counts_ptr + e, carry, mask=e < E)


@triton.jit
def _map_kernel(
    ids_ptr, slots_ptr,                      # topk_ids [T, k]; slots [T, k] out (int32)
    block_start_ptr, counts_ptr,             # count_dispatches' block_start [B, E] and counts [E] (this rank's)
    shares_ptr, log2phy_ptr, logcnt_ptr,     # shares [P] (global); the layer's log2phy [E, W], logcnt [E]
    num_dispatches, top_k, stride_t, stride_j, stride_out_t, stride_out_j, E, W, phase0,
    PHASE_UNITS: tl.constexpr, GOLDEN: tl.constexpr, BLOCK: tl.constexpr, BW: tl.constexpr,
):
    block = tl.program_id(0)
    lane = tl.arange(0, BLOCK)
    i = block * BLOCK + lane
    live = i < num_dispatches
    expert = tl.load(ids_ptr + (i // top_k).to(tl.int64) * stride_t + (i % top_k) * stride_j, mask=live,
                     other=0).to(tl.int32)
    # the dispatch's index j among this rank's dispatches of its expert, in token order
    earlier = (expert[:, None] == expert[None, :]) & (lane[None, :] < lane[:, None]) & live[None, :]
    j = tl.load(block_start_ptr + block.to(tl.int64) * E + expert, mask=live, other=0) \
        + tl.sum(earlier.to(tl.int32), axis=1)
    c = tl.load(counts_ptr + expert, mask=live, other=1).to(tl.int64)
    phase = (phase0 + expert.to(tl.int64) * GOLDEN) % PHASE_UNITS
    # the replica: u = (j + phase / 2^16) / c against the cumulative shares S_w / counts[e], in integers
    w = tl.arange(0, BW)
    replicas = tl.load(logcnt_ptr + expert, mask=live, other=1)
    has = live[:, None] & (w[None, :] < replicas[:, None])
    slot = tl.load(log2phy_ptr + expert[:, None] * W + w[None, :], mask=has, other=0)
    share = tl.load(shares_ptr + slot, mask=has, other=0).to(tl.int64)
    cumulative = tl.cumsum(share, axis=1)
    total = tl.sum(share, axis=1)
    left = (j.to(tl.int64) * PHASE_UNITS + phase) * total
    index = tl.sum((has & (left[:, None] >= c[:, None] * cumulative * PHASE_UNITS)).to(tl.int32), axis=1)
    index = tl.minimum(index, replicas - 1)
    chosen = tl.load(log2phy_ptr + expert * W + index, mask=live, other=0)
    tl.store(slots_ptr + (i // top_k).to(tl.int64) * stride_out_t + (i % top_k) * stride_out_j, chosen, mask=live)


@dataclass(frozen=True)
class DispatchCounts:
    """One rank's dispatches per logical expert, whole and per block (what `map_tokens` reads).

    counts: int32 `[E]` (the all-reduce's input); block_start: int32 `[B, E]`, the dispatches of expert `e` in
    the blocks before block `b` (blocks of `block` consecutive dispatches, token-major); block: the block size.
    """

    counts: torch.Tensor
    block_start: torch.Tensor
    block: int


def count_dispatches(topk_ids: torch.Tensor, num_experts: int, block: int = BLOCK_DISPATCHES,
                     check_ids: bool = True) -> DispatchCounts:
    """This rank's dispatches per expert (steps 1-2 of the mapping). topk_ids: int `[T, k]` in `[0, E)`.

    check_ids: verify the ids are in range first (a device-to-host sync); False on a hot path."""
    _check_ids(topk_ids, num_experts, check_ids)
    if block < 1 or block & (block - 1):
        raise InputError("block", "a power of two", block)
    dispatches = topk_ids.numel()
    blocks = max(1, triton.cdiv(dispatches, block))
    device = topk_ids.device
    block_counts = torch.empty((blocks, num_experts), dtype=torch.int32, device=device)
    block_start = torch.empty_like(block_counts)
    counts = torch.empty(num_experts, dtype=torch.int32, device=device)
    _count_kernel[(blocks,)](topk_ids, block_counts, dispatches, max(topk_ids.shape[1], 1), topk_ids.stride(0),
                             topk_ids.stride(1), num_experts, BLOCK=block, BE=triton.next_power_of_2(num_experts))
    block_e = min(32, triton.next_power_of_2(num_experts))
    _scan_kernel[(triton.cdiv(num_experts, block_e),)](block_counts, block_start, counts, blocks, num_experts,
                                                       BLOCK_B=SCAN_BLOCKS, BLOCK_E=block_e)
    return DispatchCounts(counts, block_start, block)


def count_dispatches_torch(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 `[E]`: the plain-torch reference of `count_dispatches(...).counts`."""
    return torch.bincount(topk_ids.reshape(-1).long(), minlength=num_experts)


def map_tokens(topk_ids: torch.Tensor, rank: int, num_ranks: int, table: SplitTable, shares: torch.Tensor,
               local: DispatchCounts, layer: int = 0, out: torch.Tensor | None = None,
               check: bool = True) -> torch.Tensor:
    """int32 `[T, k]`: the slot of each of rank `rank`'s dispatches `topk_ids [T, k]`, given the batch's split
    `shares [P]` (`split_solve` of the all-reduced counts) and `local = count_dispatches(topk_ids, E)`. The
    values of `moe_place.split.map_tokens` for this rank's tokens.

    out: an int32 `[T, k]` tensor to write the slots to (any strides), else a new one.
    check: verify the shares cover every expert the rank routes to (a device-to-host sync); False on a hot path.
    """
    experts = table.num_experts
    _check_ids(topk_ids, experts, False)
    if not 0 <= rank < num_ranks:
        raise InputError("rank", f"a rank in [0, {num_ranks})", rank)
    if not 0 <= layer < table.num_layers:
        raise InputError("layer", f"a layer of the table in [0, {table.num_layers})", layer)
    if shares.shape != (table.num_slots,) or shares.dtype not in (torch.int32, torch.int64) or shares.stride(0) != 1:
        raise InputError("shares", f"int32/int64 rows per slot [{table.num_slots}], unit stride",
                         f"{shares.dtype} {tuple(shares.shape)} stride {shares.stride()}")
    dispatches = topk_ids.numel()
    blocks = triton.cdiv(dispatches, local.block)
    if local.counts.shape != (experts,) or local.block_start.shape[0] < blocks:
        raise InputError("local", f"count_dispatches of these topk_ids over {experts} experts",
                         f"counts {tuple(local.counts.shape)}, {local.block_start.shape[0]} blocks")
    if check:
        total = torch.zeros(experts, dtype=torch.int64, device=shares.device).index_add_(
            0, table.phy2log[layer].long(), shares.long())
        short = (local.counts > 0) & (total < 1)
        if bool(short.any()):
            raise InputError("shares", "at least the dispatches of every expert the rank routes to",
                             f"expert {int(torch.nonzero(short)[0])} has none")
    slots = torch.empty(topk_ids.shape, dtype=torch.int32, device=topk_ids.device) if out is None else out
    if slots.shape != topk_ids.shape or slots.dtype != torch.int32 or slots.device != topk_ids.device:
        raise InputError("out", f"int32 {list(topk_ids.shape)} on {topk_ids.device}",
                         f"{slots.dtype} {tuple(slots.shape)} on {slots.device}")
    if dispatches == 0:
        return slots
    width = table.log2phy.shape[2]
    _map_kernel[(blocks,)](
        topk_ids, slots, local.block_start, local.counts, shares, table.log2phy[layer], table.logcnt[layer],
        dispatches, topk_ids.shape[1], topk_ids.stride(0), topk_ids.stride(1), slots.stride(0), slots.stride(1),
        experts, width,
        (2 * rank + 1) * PHASE_UNITS // (2 * num_ranks),
        PHASE_UNITS=PHASE_UNITS, GOLDEN=GOLDEN_PHASE, BLOCK=local.block, BW=triton.next_power_of_2(width))
    return slots


def map_tokens_torch(topk_ids: torch.Tensor, rank: int, num_ranks: int, phy2log: torch.Tensor,
                     shares: torch.Tensor) -> torch.Tensor:
    """int64 `[T, k]`: the plain-torch reference of `map_tokens` (ordinals by a stable sort, no blocks)."""
    ids = topk_ids.reshape(-1).long()
    row = phy2log.long()
    experts = int(row.max()) + 1
    order = torch.sort(row, stable=True).indices                       # slots of each expert, ascending
    logcnt = torch.bincount(row, minlength=experts)
    start = torch.cumsum(logcnt, 0) - logcnt
    width = int(logcnt.max())
    column = torch.arange(row.numel(), device=row.device) - start[row[order]]
    log2phy = torch.full((experts, width), -1, dtype=torch.int64, device=row.device)
    log2phy[row[order], column] = order
    part = torch.zeros((experts, width), dtype=torch.int64, device=row.device)
    part[row[order], column] = shares.long()[order]
    cumulative = part.cumsum(dim=1)
    by_expert = torch.sort(ids, stable=True).indices                   # token order within each expert
    count = torch.bincount(ids, minlength=experts)
    ordinal = torch.empty_like(ids)
    ordinal[by_expert] = torch.arange(ids.numel(), device=ids.device) - (torch.cumsum(count, 0) - count)[ids[by_expert]]
    phase = ((2 * rank + 1) * PHASE_UNITS // (2 * num_ranks) + ids * GOLDEN_PHASE) % PHASE_UNITS
    left = (ordinal * PHASE_UNITS + phase) * cumulative[ids, -1]
    right = count[ids, None] * cumulative[ids] * PHASE_UNITS
    index = ((left[:, None] >= right) & (torch.arange(width, device=ids.device) < logcnt[ids, None])).sum(dim=1)
    return log2phy[ids, torch.minimum(index, logcnt[ids] - 1)].reshape(topk_ids.shape)


def _check_ids(topk_ids: torch.Tensor, num_experts: int, check_range: bool) -> None:
    if topk_ids.ndim != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise InputError("topk_ids", "int32/int64 expert ids [tokens, k]", f"{topk_ids.dtype} {tuple(topk_ids.shape)}")
    if num_experts < 1:
        raise InputError("num_experts", "at least 1", num_experts)
    if check_range and topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= num_experts):
        raise InputError("topk_ids", f"expert ids in [0, {num_experts})",
                         f"[{int(topk_ids.min())}, {int(topk_ids.max())}]")
