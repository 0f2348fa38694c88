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
only numpy. This module is the drop-in only: the replay and the engine adapters plan with
`moe_place.solvers.engine_call.plan_placement` and convert with `moe_place.engines.tensors`, as it does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from moe_place.engines.tensors import (is_torch_tensor, maps_as_result, placement_tensors, torch_descending_order,
                                       weight_to_numpy)
from moe_place.errors import ParameterError
from moe_place.solvers.deepseek import check_eplb_arguments, eplb_maps
from moe_place.solvers.engine_call import plan_placement, solver_settings

if TYPE_CHECKING:  # pragma: no cover
    import torch  # lazy: torch only for the returned tensors


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
        return maps_as_result(maps, as_numpy)
    loads = weight_to_numpy(weight)
    check_eplb_arguments(loads.shape[1], num_replicas, num_groups, num_nodes, num_gpus)
    if num_replicas > loads.shape[1] * num_gpus:
        raise ParameterError("num_replicas", f"at most {loads.shape[1]} slots per GPU for solver {name!r} (it never "
                             f"puts two replicas of one expert on one GPU; solver='eplb' does, as DeepSeek EPLB)",
                             f"{num_replicas} on {num_gpus} GPUs")
    placement = plan_placement(loads, num_replicas, num_groups, num_nodes, num_gpus,
                               solver=name, time_limit_s=limit, seed=seed, allow_colocated=allow_colocated)
    return placement_tensors(placement, as_numpy=as_numpy)


__all__ = ["rebalance_experts"]
