"""The engines' own default policies as `EngineDefaultController.plan` callables, for the replay and `cadence`.

The replay (`moe_place.online.replay`) charges a policy's CPU time where the engine waits for it
(SGLang's scheduler, vLLM's sync mode). Its built-in default, `numpy_default_plan`, returns the
engines' maps but takes a fraction of their own code's time (moe-place's vectorised numpy EPLB), so a
replay that charges it prices the baseline cheaper than the engine runs it. With the engine
installed, these run the engine's own code instead, as the engine calls it:

- vLLM 0.33 (`vllm/distributed/eplb/policy/default.py`): `DefaultEplbPolicy.rebalance_experts(weight
  [layers, E] summed over the window, num_replicas, num_groups, num_nodes, num_ranks, old map)`, the map
  it returns (`phy2log`, with its `preserve_intragpu_slots`);
- SGLang 0.5.23 (`sglang/srt/eplb/eplb_algorithms/__init__.py`): `rebalance_experts(tokens_per_expert
  [passes, layers, E], num_physical_experts, num_local_physical_experts, num_groups, num_nodes,
  compute_algorithm("auto", ...))`, its `phy2log` (what `ExpertLocationMetadata.init_by_eplb` takes).

Only the policy function is the engine's; the window, cadence and map switch are the replay's protocol
(`moe_place.online.controller.EngineCadence`), checked against the engines' own loops by
`bench/bench_engines.py`. `replay` and `cadence` run them where the engine is importable
(`--default-policy auto`, their default) and say which default they ran.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Callable

import numpy as np

from moe_place.errors import InputError
from moe_place.placement import Placement

__all__ = ["available", "default_plan", "version"]

ENGINES = ("vllm", "sglang")


def available(engine: str) -> bool:
    """Whether the engine's package is importable in this Python."""
    return engine in ENGINES and importlib.util.find_spec(engine) is not None


def version(engine: str) -> str:
    """The engine's installed version."""
    return importlib.import_module(engine).__version__


def default_plan(engine: str, num_groups: int | None = None) -> Callable[[np.ndarray, Placement], np.ndarray]:
    """`(window, current) -> phy2log` running the engine's own default policy (module note)."""
    import torch  # the engines' policies take tensors

    if engine == "vllm":
        from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

        def plan(window: np.ndarray, current: Placement) -> np.ndarray:
            weight = torch.from_numpy(np.asarray(window, dtype=np.float64).round().astype(np.int64))
            out = DefaultEplbPolicy.rebalance_experts(weight, current.num_physical, num_groups or 1,
                                                      current.num_nodes, current.num_gpus,
                                                      torch.from_numpy(np.array(current.phy2log)))
            return (out[0] if isinstance(out, tuple) else out).numpy()
        return plan
    if engine == "sglang":
        from sglang.srt.eplb import eplb_algorithms

        def plan(window: np.ndarray, current: Placement) -> np.ndarray:
            passes = torch.from_numpy(np.asarray(window).astype(np.int32))
            algorithm = eplb_algorithms.compute_algorithm("auto", num_groups, current.num_nodes)
            phy2log, _, _ = eplb_algorithms.rebalance_experts(
                tokens_per_expert=passes, num_physical_experts=current.num_physical,
                num_local_physical_experts=current.slots_per_gpu, num_groups=num_groups,
                num_nodes=current.num_nodes, algorithm=algorithm)
            return phy2log.numpy()
        return plan
    raise InputError("engine", f"one of {', '.join(ENGINES)}", engine)
