"""Multi-rank dispatch and combine over `torch.distributed.all_to_all_single`.

Idea
----
Every EP rank holds a share of the batch's tokens and `S = P/G` expert slots. One MoE layer is:

    1. plan     each (token, expert) pair picks a replica with the split policy (`dispatch.send_plan`);
    2. counts   ranks swap how many rows they send each other (an all-to-all of `G` integers);
    3. dispatch rows and their slot ids go to the ranks that hold the chosen replicas;
    4. experts  each rank runs its slots' experts on the rows it received (`expert_fn`);
    5. combine  the outputs go back the way they came, and each token takes its top-k weighted sum.

Backends: gloo on CPU (tests spawn several local processes), NCCL on GPUs. The bytes each rank
sends and receives are returned, so they can be checked against the traffic matrix `a[i][j]`
(formula 3: `V_D[i][j] = a[i][j] * d_D`, `V_C[j][i] = a[i][j] * d_C`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from moe_place.errors import InputError
from moe_place.kernels.combine import combine, combine_torch
from moe_place.kernels.dispatch import gather_rows, gather_rows_torch, send_plan

__all__ = ["RankTraffic", "ep_moe_layer"]

# expert_fn(rows [R, h], slots [R] physical slot ids) -> [R, h]: the expert work of this rank
ExpertFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class RankTraffic:
    """What one rank moved in one layer: rows per peer and bytes per phase.

    send_rows / recv_rows: int64 `[G]`, dispatch rows to / from each rank (this rank's row and
    column of `a`). Combine moves the same rows back, so its bytes mirror dispatch's.
    """

    rank: int
    send_rows: list[int]
    recv_rows: list[int]
    row_bytes: int

    @property
    def dispatch_send_bytes(self) -> int:
        return sum(self.send_rows) * self.row_bytes

    @property
    def dispatch_recv_bytes(self) -> int:
        return sum(self.recv_rows) * self.row_bytes


def ep_moe_layer(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, phy2log: torch.Tensor,
                 expert_fn: ExpertFn, policy: str = "even", group=None,
                 use_triton: bool = True) -> tuple[torch.Tensor, RankTraffic]:
    """Dispatch this rank's tokens, run `expert_fn` on the rows received, combine the results.

    x: `[T_r, h]` this rank's token rows; topk_ids: int `[T_r, k]`; topk_weights: `[T_r, k]`;
    phy2log: int `[P]`, one layer's placement (slot `p` lives on rank `p // (P/G)`).
    Must be called by every rank of `group` (collective). Returns `[T_r, h]` and the traffic.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if x.ndim != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise InputError("x/topk_ids/topk_weights", "[T, h], [T, k], [T, k] with one T",
                         f"{tuple(x.shape)}, {tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}")
    gather = gather_rows if use_triton else gather_rows_torch
    plan = send_plan(topk_ids, phy2log, world, rank, policy)
    # 2. counts: recv_counts[s] = rows rank s sends here
    send_counts = plan.send_counts.to(x.device)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_split, recv_split = send_counts.tolist(), recv_counts.tolist()
    # 3. dispatch rows and slot ids
    send_buf = gather(x, plan.token_of_row)
    recv_buf = x.new_empty((sum(recv_split), x.shape[1]))
    dist.all_to_all_single(recv_buf, send_buf, recv_split, send_split, group=group)
    recv_slots = plan.slot_of_row.new_empty(sum(recv_split))
    dist.all_to_all_single(recv_slots, plan.slot_of_row.contiguous(), recv_split, send_split, group=group)
    # 4. this rank's expert work
    y = expert_fn(recv_buf, recv_slots)
    if y.shape != recv_buf.shape:
        raise InputError("expert_fn", f"output of shape {tuple(recv_buf.shape)}", tuple(y.shape))
    # 5. combine: outputs go back in send-buffer order, then the weighted sum per token
    back = x.new_empty(send_buf.shape)
    dist.all_to_all_single(back, y.contiguous(), send_split, recv_split, group=group)
    merge = combine if use_triton else combine_torch
    out = merge(back, plan.row_of_pair, topk_weights.contiguous())
    traffic = RankTraffic(rank, send_split, recv_split, x.shape[1] * x.element_size())
    return out, traffic

