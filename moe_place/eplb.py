"""Drop-in for DeepSeek EPLB's `rebalance_experts`, backed by moe-place's solvers.

Code that calls DeepSeek's balancer switches by changing one import:

    # from eplb import rebalance_experts
    from moe_place.eplb import rebalance_experts
    phy2log, log2phy, logcnt = rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)

Same arguments, same result shapes and dtypes (torch int64 on the CPU; numpy int64 arrays for a
`weight` that is not a torch tensor, e.g. a numpy array, which works without torch installed):
- `phy2log` `[layers, num_replicas]`: the logical expert of each physical slot; slot `p` lives
  on GPU `p // (num_replicas / num_gpus)`.
- `log2phy` `[layers, E, max(logcnt)]`: the slots of each logical expert, padded with -1.
  With `solver="eplb"` in the original's replica order (the order its replicas were created);
  with our solvers in ascending slot order, the order SGLang derives from a bare map
  (`ExpertLocationMetadata.init_by_mapping`). Engines pick among an expert's slots by this list
  (SGLang's static dispatch takes the first one on the token's GPU, else a fair choice), so the
  order changes which replica serves a token, never which expert.
- `logcnt` `[layers, E]`: replicas per logical expert.

Where the original asserts on an argument, this raises `ParameterError` (an `AssertionError`
and an `InputError`, same text): `num_replicas` not a multiple of `num_gpus` or below `E`, and
on the hierarchical policy (`num_groups % num_nodes == 0`) groups that do not split the experts
or nodes that do not split the GPUs. `num_groups` 0 means no groups (global policy).

`solver="eplb"` (or `MOE_PLACE_SOLVER=eplb`) returns exactly what DeepSeek's `eplb.py` returns
on the same torch, all three tensors, ties included: it runs the faithful reimplementation
(`moe_place.solvers.deepseek`) with torch's own sort, as the original sorts, and accepts what
the original accepts, more slots per GPU than experts (replicas forced onto one GPU) included.
The original takes torch tensors only; given numpy loads, `solver="eplb"` sorts with a stable
numpy sort instead (equal loads: the lower expert first), so it matches `eplb.py` wherever no two
loads that the sort compares are equal, and needs no torch.

The other solvers plan with `moe_place.solvers.solve`, with EPLB's plan a candidate on every
layer (`allow_colocated=True`, the default), so the answer is never worse than `eplb.py`'s; it
then holds two replicas of an expert on one GPU only where EPLB's does and wins
(`allow_colocated=False`: never). They refuse more than `E` slots per GPU with a
`ParameterError` saying so. The default is
"quick", the anytime plan (`moe_place.solvers.quick`, vectorised across layers): deterministic,
no time limit needed, about 50 ms for DeepSeek-V3's 58 layers x 288 slots on one core, since an
engine stalls while its balancer runs. "fast" (no limit: seconds to minutes at large EP), "cpsat"
(OR-Tools, proves optimality on small layers) and a `time_limit_s` are there by keyword or by
the environment: `MOE_PLACE_SOLVER` and `MOE_PLACE_TIME_LIMIT` (seconds; kept: below 0.01 s per
layer the answer is the anytime plan, with more time fast and then the solver asked for improve
on it, see `moe_place.solvers.solve`). The policy choice follows EPLB's rule: hierarchical when
`num_groups` is a multiple of `num_nodes` (then every expert group and its replicas stay inside
one node, as DeepSeek's hierarchical EPLB keeps them: `moe_place.solvers.hierarchical`), global
otherwise.

torch is imported lazily: importing this module, and calling the drop-in with numpy loads, need
only numpy.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from moe_place.errors import InputError, ParameterError
from moe_place.placement import Placement
from moe_place.problem import PlacementProblem
from moe_place.solvers import solve
from moe_place.solvers.deepseek import check_eplb_arguments, eplb_maps

if TYPE_CHECKING:  # pragma: no cover
    import torch  # lazy: torch only for the returned tensors

SOLVER_ENV = "MOE_PLACE_SOLVER"
TIME_LIMIT_ENV = "MOE_PLACE_TIME_LIMIT"
DEFAULT_SOLVER = "quick"  # deterministic and bounded: an engine waits for it (module note)


def solver_settings(solver: str | None = None, time_limit_s: float | None = None) -> tuple[str, float | None]:
    """The solver name and time limit: keywords first, then `MOE_PLACE_SOLVER` / `MOE_PLACE_TIME_LIMIT`."""
    name = solver or os.environ.get(SOLVER_ENV) or DEFAULT_SOLVER
    if time_limit_s is None and os.environ.get(TIME_LIMIT_ENV):
        text = os.environ[TIME_LIMIT_ENV]
        try:
            time_limit_s = float(text)
        except ValueError:
            raise InputError(TIME_LIMIT_ENV, "a number of seconds", text) from None
    if time_limit_s is not None and not time_limit_s > 0:
        raise InputError("time_limit_s", "a positive number of seconds", time_limit_s)
    return name, time_limit_s


def weight_to_numpy(weight: Any, dtype: type = np.float64) -> np.ndarray:
    """`[layers, E]` of `dtype` from a torch tensor (any dtype/device) or an array-like.

    ParameterError unless a non-empty 2-D array of finite loads >= 0. A tensor is converted by
    torch (`.float()` for float32, as DeepSeek's original converts, `.double()` otherwise).
    """
    if is_torch_tensor(weight):  # copy to the host first
        host = weight.detach().to("cpu")
        weight = (host.float() if dtype == np.float32 else host.double()).numpy()
    try:
        loads = np.asarray(weight, dtype=dtype)
    except (TypeError, ValueError):
        raise ParameterError("weight", "a numeric array [layers, num_logical_experts]", type(weight).__name__) from None
    if loads.ndim != 2 or 0 in loads.shape:
        raise ParameterError("weight", "a non-empty 2-D array [layers, num_logical_experts]", f"shape {loads.shape}")
    if not np.isfinite(loads).all() or (loads < 0).any():
        raise ParameterError("weight", "finite loads >= 0", "NaN, inf or a negative load")
    return loads


def effective_topology(num_experts: int, num_groups: int | None, num_nodes: int, num_gpus: int) -> tuple[int | None, int]:
    """`(num_groups, num_nodes)` as EPLB would use them.

    EPLB plans hierarchically (expert groups packed onto nodes) only when `num_groups` is a
    multiple of `num_nodes`; otherwise it plans globally, as if there were one group and one
    node. Engines pass `num_groups` 0 or 1 for models without expert groups, and vLLM falls back
    to one node when `num_gpus % num_nodes != 0`; both are accepted here the same way.
    """
    if num_nodes < 1 or num_gpus % num_nodes:
        num_nodes = 1
    if not num_groups or num_groups < 1 or num_experts % num_groups or num_groups % num_nodes:
        return None, num_nodes
    return num_groups, num_nodes


def plan_placement(loads: np.ndarray, num_replicas: int, num_groups: int | None, num_nodes: int, num_gpus: int, *,
                   solver: str | None = None, time_limit_s: float | None = None,
                   current: Placement | None = None, max_moved_slots: int | None = None,
                   move_cost_weight: float = 0.0, seed: int = 0, allow_colocated: bool = False) -> Placement:
    """Plan a placement for `loads` (float64 `[layers, E]` or `[windows, layers, E]`) with our solvers.

    With `current`, the solver keeps unchanged experts in their slots (migration-aware mode).
    allow_colocated: EPLB's plan, co-located replicas and all, is a candidate on every layer
        (`PlacementProblem.allow_colocated`): the plan is then never worse than EPLB's.
    """
    loads = np.asarray(loads, dtype=np.float64)
    if loads.ndim == 2:
        loads = loads[None]
    groups, nodes = effective_topology(loads.shape[-1], num_groups, num_nodes, num_gpus)
    if current is not None and current.num_nodes != nodes:
        current = Placement(current.phy2log, current.num_experts, current.num_gpus, nodes,
                            allow_colocated=current.allow_colocated)
    name, limit = solver_settings(solver, time_limit_s)
    try:  # PlacementProblem validates; its size names become the engines' here
        problem = PlacementProblem(loads=loads, num_gpus=num_gpus, num_physical=num_replicas, num_nodes=nodes,
                                   num_groups=groups, current=current, max_moved_slots=max_moved_slots,
                                   move_cost_weight=move_cost_weight, seed=seed, allow_colocated=allow_colocated)
    except InputError as exc:
        raise InputError({"num_physical": "num_replicas"}.get(exc.where, exc.where), exc.expected, exc.got) from None
    solution = solve(problem, solver=name, time_limit_s=limit)
    for note in solution.notes:  # e.g. a time limit that returned the anytime plan
        logging.getLogger("moe_place").info("rebalance_experts: %s", note)
    return solution.placement


def placement_tensors(placement: Placement, log2phy_width: int | None = None, as_numpy: bool = False):
    """`(phy2log, log2phy, logcnt)` as CPU torch int64 tensors (`as_numpy`: writable numpy int64 arrays).

    log2phy_width: pad `log2phy` with -1 to this many columns (vLLM's default policy uses
    `num_redundant + 1`); None keeps `max(logcnt)` as DeepSeek EPLB does.
    """
    log2phy = np.asarray(placement.log2phy)
    if log2phy_width is not None:
        if log2phy_width < log2phy.shape[-1]:
            raise InputError("log2phy_width", f"at least max(logcnt)={log2phy.shape[-1]}", log2phy_width)
        pad = np.full(log2phy.shape[:-1] + (log2phy_width - log2phy.shape[-1],), -1, dtype=np.int64)
        log2phy = np.concatenate([log2phy, pad], axis=-1)
    return _as_result((placement.phy2log, log2phy, placement.logcnt), as_numpy)


def _as_result(maps, as_numpy: bool) -> tuple:
    """The maps as writable int64 copies: numpy arrays, or CPU torch tensors."""
    arrays = tuple(np.array(m, dtype=np.int64) for m in maps)
    if as_numpy:
        return arrays
    import torch  # lazy: torch only for the returned tensors

    return tuple(torch.from_numpy(a) for a in arrays)


def rebalance_experts(weight: "torch.Tensor", num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int,
                      *, solver: str | None = None, time_limit_s: float | None = None, seed: int = 0,
                      allow_colocated: bool = True):
    """DeepSeek EPLB's entry point, planned by moe-place.

    Parameters:
        weight: `[layers, num_logical_experts]` load statistics (any numeric dtype, any device): a
            torch tensor, as engines pass it, or a numpy array (then the results are numpy too).
        num_replicas: physical experts per layer, a multiple of `num_gpus`.
        num_groups: expert groups (hierarchical policy when a multiple of `num_nodes`; 0: none).
        num_nodes: server nodes; on the hierarchical policy `num_gpus` must be a multiple of it.
        num_gpus: GPUs (EP ranks).
        solver / time_limit_s: override `MOE_PLACE_SOLVER` / `MOE_PLACE_TIME_LIMIT`.
        seed: for randomised solver choices; same inputs and seed give the same plan.
        allow_colocated: EPLB's own plan is a candidate on every layer, so the answer is never worse
            than what `eplb.py` returns; it may then hold two replicas of an expert on one GPU where
            EPLB's plan does and is better (False: never, at the price of that guarantee).

    Returns:
        phy2log: int64 `[layers, num_replicas]`, the logical expert of each slot.
        log2phy: int64 `[layers, num_logical_experts, max(logcnt)]`, the slots of each expert, -1
            padded (replica order for solver "eplb", ascending otherwise: see the module note).
        logcnt: int64 `[layers, num_logical_experts]`, replicas per expert.
    All three on the CPU, as EPLB returns them (numpy arrays for numpy loads). Bad arguments:
    `ParameterError` (module note).
    """
    as_numpy = not is_torch_tensor(weight)
    name, limit = solver_settings(solver, time_limit_s)
    if name == "eplb":  # torch's own sort for tensors (ties as eplb.py), a stable one for numpy (module note)
        order = {} if as_numpy else {"descending_order": torch_descending_order}
        maps = eplb_maps(weight_to_numpy(weight, np.float32), num_replicas, num_groups, num_nodes, num_gpus, **order)
        return _as_result(maps, as_numpy)
    loads = weight_to_numpy(weight)
    check_eplb_arguments(loads.shape[1], num_replicas, num_groups, num_nodes, num_gpus)
    if num_replicas > loads.shape[1] * num_gpus:
        raise ParameterError("num_replicas", f"at most {loads.shape[1]} slots per GPU for solver {name!r} (it never "
                             f"puts two replicas of one expert on one GPU; solver='eplb' does, as DeepSeek EPLB)",
                             f"{num_replicas} on {num_gpus} GPUs")
    placement = plan_placement(loads, num_replicas, num_groups, num_nodes, num_gpus,
                               solver=name, time_limit_s=limit, seed=seed, allow_colocated=allow_colocated)
    return placement_tensors(placement, as_numpy=as_numpy)


def is_torch_tensor(value: Any) -> bool:
    """True for a torch tensor (what has `.detach()`), told without importing torch."""
    return hasattr(value, "detach")


def torch_descending_order(values: np.ndarray) -> np.ndarray:
    """int64 `[rows, n]`: torch's default descending sort of float32 `values [rows, n]`, the sort
    DeepSeek's `eplb.py` packs with (not stable above 16 elements: its tie order is torch's)."""
    import torch  # lazy: only the solver="eplb" path of the drop-in sorts with torch

    tensor = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    return tensor.sort(-1, descending=True).indices.numpy()


__all__ = ["rebalance_experts"]
