"""Align (token, expert) pairs for a grouped GEMM: sort by expert, count, pad to BLOCK_M.

Idea
----
A batch of `T` tokens with top-`k` routing makes `T*k` dispatches ("pairs"); pair `p` is
token `p // k`, choice `p % k`. A grouped GEMM wants each expert's rows next to each other:

    contiguous layout   rows of expert e are `offsets[e] : offsets[e+1]` (no padding); a tile of
                        BLOCK_M rows never crosses an expert boundary, its last rows are masked.
    padded layout       every expert's rows are rounded up to a multiple of BLOCK_M, so each
                        M-block holds exactly one expert (vLLM `moe_align_block_size` style);
                        `block_expert_ids[b]` is that expert, `padded_row_ids` maps each padded
                        row to its row in the contiguous order, -1 for a padding row.

Both layouts launch the same tiles; the padded rows are the work the GPU does for nothing
(formula 4, worked example C8). `ExpertLayout.num_padded_rows` is the number of rows the
kernel executes, and must equal `moe_place.cost.gemm.padded_rows`.

This is index bookkeeping, written in torch (runs on the device of `topk_ids`); `align_numpy`
is the independent plain-numpy reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moe_place.errors import InputError

__all__ = ["ExpertLayout", "align", "align_numpy", "exclusive_cumsum", "layout_from_rows"]


@dataclass(frozen=True)
class ExpertLayout:
    """Where each dispatch lives in expert order, and the M-tiles the grouped GEMM launches.

    num_experts, top_k, block_m: the sizes it was built for.
    sorted_pair_ids: int64 `[num_pairs]`, pair id (`token*k + choice`) of each row in expert
        order; stable, so pairs of one expert keep token order.
    rows_per_expert: int64 `[E]`, dispatches per expert.
    offsets: int64 `[E+1]`, contiguous (unpadded) row offsets.
    padded_offsets: int64 `[E+1]`, row offsets in the padded layout.
    tile_expert: int64 `[num_tiles]`, expert of each M-tile (one expert per tile).
    tile_row_start / tile_row_end: int64 `[num_tiles]`, contiguous rows `[start, end)` of each tile
        (`end - start <= block_m`; an empty expert padded with `pad_empty` gives `start == end`).
    padded_row_ids: int64 `[num_tiles*block_m]`, contiguous row of each padded row, -1 for padding.
    """

    num_experts: int
    top_k: int
    block_m: int
    sorted_pair_ids: torch.Tensor
    rows_per_expert: torch.Tensor
    offsets: torch.Tensor
    padded_offsets: torch.Tensor
    tile_expert: torch.Tensor
    tile_row_start: torch.Tensor
    tile_row_end: torch.Tensor
    padded_row_ids: torch.Tensor

    @property
    def num_pairs(self) -> int:
        return int(self.sorted_pair_ids.numel())

    @property
    def num_tiles(self) -> int:
        return int(self.tile_expert.numel())

    @property
    def num_padded_rows(self) -> int:
        """Rows the grouped GEMM executes: `num_tiles * block_m`."""
        return self.num_tiles * self.block_m

    def inverse_rows(self) -> torch.Tensor:
        """int64 `[num_pairs]`: row (in expert order) of each pair id."""
        inv = torch.empty_like(self.sorted_pair_ids)
        inv[self.sorted_pair_ids] = torch.arange(self.num_pairs, device=inv.device)
        return inv


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int, pad_empty: bool = False) -> ExpertLayout:
    """Sort the dispatches of `topk_ids` by expert and build both layouts.

    topk_ids: int `[T, k]` logical expert ids in `[0, num_experts)`.
    block_m: tile height BLOCK_M (>= 1).
    pad_empty: give an expert without rows one tile anyway (what a kernel that launches a fixed
        grid per expert does; row C8 "pad all").
    """
    _check(topk_ids, num_experts, block_m)
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    # 1. stable sort of the pairs by expert: rows of one expert keep token order
    sorted_pair_ids = torch.sort(flat, stable=True).indices
    # 2. counts and contiguous offsets
    rows = torch.bincount(flat, minlength=num_experts)
    offsets = exclusive_cumsum(rows)
    # 3. tiles per expert, padded offsets
    tiles = (rows + block_m - 1) // block_m
    if pad_empty:
        tiles = torch.clamp(tiles, min=1)
    tile_offsets = exclusive_cumsum(tiles)
    padded_offsets = tile_offsets * block_m
    # 4. one expert per tile; each tile's rows [start, end) in the contiguous order
    num_tiles = int(tile_offsets[-1])
    tile_expert = torch.repeat_interleave(torch.arange(num_experts, device=device), tiles)
    tile_in_expert = torch.arange(num_tiles, device=device) - tile_offsets[:-1][tile_expert]
    tile_row_start = offsets[:-1][tile_expert] + tile_in_expert * block_m
    tile_row_end = torch.minimum(tile_row_start + block_m, offsets[1:][tile_expert])
    # 5. padded row -> contiguous row (-1 for padding)
    lane = torch.arange(block_m, device=device)
    row = tile_row_start[:, None] + lane[None, :]
    padded_row_ids = torch.where(row < tile_row_end[:, None], row, torch.full_like(row, -1)).reshape(-1)
    return ExpertLayout(num_experts, int(topk_ids.shape[1]), block_m, sorted_pair_ids, rows, offsets,
                        padded_offsets, tile_expert, tile_row_start, tile_row_end, padded_row_ids)


def align_numpy(topk_ids: np.ndarray, num_experts: int, block_m: int, pad_empty: bool = False) -> dict:
    """Plain-numpy reference of `align`: the same fields as numpy arrays, built with loops."""
    flat = np.asarray(topk_ids).reshape(-1)
    rows = np.zeros(num_experts, dtype=np.int64)
    sorted_pair_ids = []
    for expert in range(num_experts):
        pairs = [p for p, e in enumerate(flat) if e == expert]
        rows[expert] = len(pairs)
        sorted_pair_ids.extend(pairs)
    tile_expert, padded_row_ids, padded_offsets = [], [], [0]
    start = 0
    for expert in range(num_experts):
        n = int(rows[expert])
        tiles = -(-n // block_m) if (n or not pad_empty) else 1
        for t in range(tiles):
            tile_expert.append(expert)
            for lane in range(block_m):
                r = t * block_m + lane
                padded_row_ids.append(start + r if r < n else -1)
        padded_offsets.append(padded_offsets[-1] + tiles * block_m)
        start += n
    return {
        "sorted_pair_ids": np.array(sorted_pair_ids, dtype=np.int64),
        "rows_per_expert": rows,
        "offsets": np.concatenate(([0], np.cumsum(rows))),
        "padded_offsets": np.array(padded_offsets, dtype=np.int64),
        "tile_expert": np.array(tile_expert, dtype=np.int64),
        "padded_row_ids": np.array(padded_row_ids, dtype=np.int64),
    }


def layout_from_rows(rows_per_expert, block_m: int, pad_empty: bool = False, device="cpu") -> ExpertLayout:
    """A layout with the given rows per expert (token `t` of expert `e` routed with top-1).

    Handy for benchmarks and tests that set the load of each expert directly.
    """
    rows = [int(r) for r in rows_per_expert]
    if any(r < 0 for r in rows):
        raise InputError("rows_per_expert", "non-negative counts", rows)
    ids = torch.repeat_interleave(torch.arange(len(rows), device=device), torch.tensor(rows, device=device))
    return align(ids[:, None], len(rows), block_m, pad_empty)


def exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    """int64 `[n + 1]`: 0, x[0], x[0] + x[1], ..., sum(x) (the offsets of consecutive groups of sizes `x`)."""
    out = torch.zeros(x.numel() + 1, dtype=torch.int64, device=x.device)
    torch.cumsum(x, 0, out=out[1:])
    return out


def _check(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    if topk_ids.ndim != 2:
        raise InputError("topk_ids", "a 2-D tensor [tokens, k]", f"shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise InputError("topk_ids", "integer expert ids", topk_ids.dtype)
    if num_experts < 1:
        raise InputError("num_experts", "at least 1", num_experts)
    if block_m < 1:
        raise InputError("block_m", "at least 1", block_m)
    if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= num_experts):
        raise InputError("topk_ids", f"expert ids in [0, {num_experts})",
                         f"[{int(topk_ids.min())}, {int(topk_ids.max())}]")
