"""Dispatch: gather token rows into expert order, and plan which rank each dispatch is sent to.

Idea
----
Locally, dispatch is a row gather: row `i` of the expert-ordered activations is token
`sorted_pair_ids[i] // k` (`align.ExpertLayout`). Across EP ranks, each (token, logical expert)
pair first picks one replica (physical slot) of the expert with the *split policy*, and the rows
are packed into one send buffer ordered by destination rank, then slot:

    even    round-robin over the replicas: the j-th pair of expert e sent by source rank s takes
            replica `(j + s) % logcnt[e]` (each replica gets ~1/logcnt of the rows, EPLB's assumption)
    local   a replica on the source's own rank when there is one (no traffic), else round-robin
            as in `even` (SGLang's `static` dispatch)

`send_plan` does this bookkeeping (torch, on the device of `topk_ids`); the traffic matrix it
implies, `a[s][d]` = rows rank s sends to rank d, is what `alltoall` moves and the cost model's
formula 3 prices. `gather_rows` is the Triton row-gather kernel; `gather_rows_torch` its reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from moe_place.errors import InputError
from moe_place.kernels.align import ExpertLayout, exclusive_cumsum

__all__ = ["SendPlan", "choose_slots", "dispatch", "dispatch_torch", "gather_rows", "gather_rows_torch", "send_plan",
           "split_tokens"]

SPLIT_POLICIES = ("even", "local")
ELEMENTS_PER_PROGRAM = 8192  # row-copy tile: rows x columns per program


# ---------------------------------------------------------------------------------------- kernel
@triton.jit
def _gather_rows_kernel(
    src_ptr, dst_ptr, index_ptr,  # dst[i, :] = src[index[i], :]
    num_rows, H,
    stride_src, stride_dst,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_mask = rows < num_rows
    mask = row_mask[:, None] & (cols[None, :] < H)
    src_rows = tl.load(index_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    values = tl.load(src_ptr + src_rows[:, None] * stride_src + cols[None, :], mask=mask)
    tl.store(dst_ptr + rows.to(tl.int64)[:, None] * stride_dst + cols[None, :], values, mask=mask)


# ---------------------------------------------------------------------------------------- wrappers
def gather_rows(src: torch.Tensor, index: torch.Tensor, block_r: int | None = None, block_h: int = 1024,
                check_index: bool = True) -> torch.Tensor:
    """`src[index]` with a Triton kernel. src: `[n, h]` (unit column stride); index: int `[m]` in `[0, n)`.

    A program copies `block_r x block_h` elements (default: 8192, about 64 registers per thread).
    check_index: verify the ids are in range first (a device-to-host sync; the kernel has no bounds
    checks). Pass False on a hot path whose ids are already known good (it can then be graph-captured).
    """
    if src.ndim != 2 or src.stride(1) != 1:
        raise InputError("src", "a 2-D tensor [rows, h] with contiguous rows", f"shape {tuple(src.shape)}")
    if index.ndim != 1 or index.dtype.is_floating_point:
        raise InputError("index", "a 1-D integer tensor", f"{index.dtype} {tuple(index.shape)}")
    if check_index and index.numel() and (int(index.min()) < 0 or int(index.max()) >= src.shape[0]):
        raise InputError("index", f"row ids in [0, {src.shape[0]})", f"[{int(index.min())}, {int(index.max())}]")
    out = torch.empty((index.numel(), src.shape[1]), dtype=src.dtype, device=src.device)
    if out.numel() == 0:
        return out
    block_h = min(block_h, triton.next_power_of_2(src.shape[1]))
    block_r = block_r or max(1, ELEMENTS_PER_PROGRAM // block_h)
    grid = (triton.cdiv(index.numel(), block_r), triton.cdiv(src.shape[1], block_h))
    _gather_rows_kernel[grid](src, out, index, index.numel(), src.shape[1], src.stride(0), out.stride(0),
                              BLOCK_R=block_r, BLOCK_H=block_h)
    return out


def gather_rows_torch(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return src[index.long()]


def dispatch(x: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """Token rows in expert order: x `[T, h]` -> `[T*k, h]` (row i is token `sorted_pair_ids[i] // k`)."""
    if x.ndim != 2 or x.shape[0] * layout.top_k != layout.num_pairs:
        raise InputError("x", f"[{layout.num_pairs // max(layout.top_k, 1)}, h] token rows", tuple(x.shape))
    return gather_rows(x, layout.sorted_pair_ids // layout.top_k)


def dispatch_torch(x: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    return x[layout.sorted_pair_ids // layout.top_k]


# ---------------------------------------------------------------------------------------- ranks
@dataclass(frozen=True)
class SendPlan:
    """Where the dispatches of one source rank go.

    slot_of_pair: int64 `[T*k]`, physical slot chosen for each pair (token*k + choice).
    pair_of_row: int64 `[T*k]`, pair id of each send-buffer row (ordered by destination rank, slot).
    row_of_pair: int64 `[T*k]`, the inverse: send-buffer row of each pair (used by combine).
    send_counts: int64 `[G]`, rows sent to each rank (one row of the traffic matrix `a`).
    """

    top_k: int
    slots_per_gpu: int
    slot_of_pair: torch.Tensor
    pair_of_row: torch.Tensor
    row_of_pair: torch.Tensor
    send_counts: torch.Tensor

    @property
    def token_of_row(self) -> torch.Tensor:
        return self.pair_of_row // self.top_k

    @property
    def slot_of_row(self) -> torch.Tensor:
        return self.slot_of_pair[self.pair_of_row]


def choose_slots(topk_ids: torch.Tensor, phy2log: torch.Tensor, num_gpus: int, source_gpu: int,
                 policy: str = "even") -> torch.Tensor:
    """int64 `[T, k]`: the physical slot each (token, expert) pair of `source_gpu` is sent to.

    topk_ids: int `[T, k]` logical expert ids; phy2log: int `[P]` one layer's placement.
    """
    phy2log = torch.as_tensor(phy2log, dtype=torch.int64, device=topk_ids.device)
    if policy not in SPLIT_POLICIES:
        raise InputError("split policy", f"one of {SPLIT_POLICIES}", policy)
    if phy2log.ndim != 1 or phy2log.numel() % num_gpus:
        raise InputError("phy2log", f"one layer [P] with P divisible by {num_gpus} GPUs", tuple(phy2log.shape))
    if not 0 <= source_gpu < num_gpus:
        raise InputError("source_gpu", f"a rank in [0, {num_gpus})", source_gpu)
    num_experts = int(phy2log.max()) + 1
    slots_per_gpu = phy2log.numel() // num_gpus
    flat = topk_ids.reshape(-1).to(torch.int64)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        raise InputError("topk_ids", f"expert ids in [0, {num_experts})", f"max {int(flat.max())}")
    # replicas of every expert, in slot order: replica_slots[e, r], -1 padded
    logcnt = torch.bincount(phy2log, minlength=num_experts)
    order = torch.sort(phy2log, stable=True).indices
    starts = torch.cumsum(logcnt, 0) - logcnt
    # occurrence j of each expert among this source's pairs (token order)
    sorted_pairs = torch.sort(flat, stable=True).indices
    first_row = exclusive_cumsum(torch.bincount(flat, minlength=num_experts))
    occurrence = torch.empty_like(flat)
    occurrence[sorted_pairs] = torch.arange(flat.numel(), device=flat.device) - first_row[flat[sorted_pairs]]
    replica = (occurrence + source_gpu) % logcnt[flat]
    slot = order[starts[flat] + replica]
    if policy == "local":
        # a replica on the source's own GPU, if the expert has one there
        on_source = order.new_full((num_experts,), -1)
        local_slots = torch.arange(source_gpu * slots_per_gpu, (source_gpu + 1) * slots_per_gpu, device=flat.device)
        on_source[phy2log[local_slots]] = local_slots
        local = on_source[flat]
        slot = torch.where(local >= 0, local, slot)
    return slot.reshape(topk_ids.shape)


def send_plan(topk_ids: torch.Tensor, phy2log: torch.Tensor, num_gpus: int, source_gpu: int,
              policy: str = "even") -> SendPlan:
    """The send buffer layout of one source rank: rows grouped by destination rank, then slot."""
    slot = choose_slots(topk_ids, phy2log, num_gpus, source_gpu, policy).reshape(-1)
    slots_per_gpu = int(torch.as_tensor(phy2log).numel()) // num_gpus
    pair_of_row = torch.sort(slot, stable=True).indices  # slot order is rank order, then slot
    row_of_pair = torch.empty_like(pair_of_row)
    row_of_pair[pair_of_row] = torch.arange(pair_of_row.numel(), device=slot.device)
    send_counts = torch.bincount(slot // slots_per_gpu, minlength=num_gpus)
    return SendPlan(int(topk_ids.shape[1]), slots_per_gpu, slot, pair_of_row, row_of_pair, send_counts)


def split_tokens(num_tokens: int, num_gpus: int) -> np.ndarray:
    """int64 `[G+1]`: rank r holds tokens `bounds[r]:bounds[r+1]` (equal contiguous shares)."""
    return (np.arange(num_gpus + 1, dtype=np.int64) * num_tokens) // num_gpus
