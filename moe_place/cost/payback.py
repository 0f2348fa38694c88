"""Replica payback (formula 7): memory check, `N_min`, net gain of a list of copies.

The copies and their time over the real path are the migration model's
(`moe_place.cost.migration`: `Copy`, `copy_time_s`, serial `sum (W_e/B_path + alpha)` or parallel).
Each later batch saves `dt`; the first batch at which the saving has paid for the copy is
`N_min = floor(T_copy/dt) + 1`. Memory is checked first: a replica that does not fit the
receiver's free memory makes the move infeasible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from moe_place.cost.migration import Copy, copy_time_s
from moe_place.cost.topology import Topology
from moe_place.errors import InfeasibleError, InputError

__all__ = ["Payback", "check_memory", "n_min", "payback"]


def check_memory(copies: list[Copy], free_bytes_per_gpu: dict[int, float] | float) -> list[str]:
    """Problems (empty when every receiving GPU has room for the replicas it receives)."""
    need: dict[int, float] = {}
    for c in copies:
        if not c.local:
            need[c.dst_gpu] = need.get(c.dst_gpu, 0.0) + c.num_bytes
    problems = []
    for gpu, needed in sorted(need.items()):
        free = free_bytes_per_gpu if isinstance(free_bytes_per_gpu, (int, float)) else free_bytes_per_gpu.get(gpu, 0.0)
        if needed > free:
            problems.append(f"gpu{gpu} needs {needed / 2**20:g} MiB for replicas but has {free / 2**20:g} MiB free")
    return problems


def n_min(copy_time: float, saving_per_batch_s: float) -> int | None:
    """`floor(T_copy/dt) + 1`: the first batch at which the savings exceed the copy (None if dt <= 0)."""
    if saving_per_batch_s <= 0:
        return None
    n = math.floor(copy_time / saving_per_batch_s) + 1
    # the division can round across an integer; settle on the definition `N*dt > T_copy` exactly
    while n > 1 and (n - 1) * saving_per_batch_s > copy_time:
        n -= 1
    while not n * saving_per_batch_s > copy_time:
        n += 1
    return n


@dataclass(frozen=True)
class Payback:
    """The result of a replica move.

    copy_time_s: one-off copy cost; saving_per_batch_s: `dt`; n_min: first batch that pays back
    (None if nothing is saved or the move is infeasible); feasible: every replica fits in memory.
    """

    copy_time_s: float
    saving_per_batch_s: float
    feasible: bool = True
    problems: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.copy_time_s < 0:
            raise InputError("copy_time_s", "seconds >= 0", self.copy_time_s)
        if self.feasible == bool(self.problems):
            raise InputError("payback", "problems exactly when infeasible")

    @property
    def n_min(self) -> int | None:
        return n_min(self.copy_time_s, self.saving_per_batch_s) if self.feasible else None

    def net_gain_s(self, num_batches) -> np.ndarray | float:
        """Saving after `num_batches` batches minus the copy: `N*dt - T_copy`."""
        n = np.asarray(num_batches, dtype=np.float64)
        gain = n * self.saving_per_batch_s - self.copy_time_s
        return float(gain) if gain.ndim == 0 else gain

    def curve(self, max_batches: int) -> tuple[np.ndarray, np.ndarray]:
        """(batches `0..max_batches`, net gain in seconds) for plotting (seed Figure 9-24)."""
        n = np.arange(int(max_batches) + 1)
        return n, self.net_gain_s(n)


def payback(topology: Topology, copies: list[Copy], saving_per_batch_s: float, *, alpha_s: float = 0.0,
            mode: str = "serial", free_bytes_per_gpu: dict[int, float] | float | None = None,
            strict: bool = False) -> Payback:
    """Copy time over the topology's routes, memory check, and the payback of a replica move.

    free_bytes_per_gpu: free memory of each receiving GPU (one number for all); None skips the check.
    strict: raise `InfeasibleError` instead of returning `feasible=False`.
    """
    for c in copies:
        topology.check_gpu(c.src_gpu, "copy source")
        topology.check_gpu(c.dst_gpu, "copy destination")
    problems = check_memory(copies, free_bytes_per_gpu) if free_bytes_per_gpu is not None else []
    if problems and strict:
        more = f" (and {len(problems) - 1} more GPUs)" if len(problems) > 1 else ""
        raise InfeasibleError(f"replica does not fit: {problems[0]}{more}")
    return Payback(copy_time_s(topology, copies, alpha_s, mode), float(saving_per_batch_s),
                   feasible=not problems, problems=tuple(problems))
