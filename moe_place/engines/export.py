"""Write a plan in an engine's format (what `moe-place export` does), atomically.

engine "sglang": `moe_place.engines.sglang` (`--init-expert-location` file, .json or .pt).
engine "vllm":   the plan file without its report (.json, `moe_place.planfile`), the static plan the
                 moe-place policy reads (`MOE_PLACE_STATIC_PLAN`).
engine "eplb":   DeepSeek EPLB's `(phy2log, log2phy, logcnt)`, int64, as `.pt` (torch.save of a
                 dict of tensors) or `.npz` (numpy arrays of the same names).
engine "trtllm": TensorRT-LLM's `moe_config.load_balancer` YAML (`moe_place.engines.trtllm`), `.yaml`/`.yml`.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from moe_place.engines import sglang, trtllm
from moe_place.engines.vllm_policy import STATIC_PLAN_ENV
from moe_place.errors import InputError
from moe_place.io import write_atomic
from moe_place.placement import Placement
from moe_place.planfile import PlanFile, write_plan

SUFFIXES = {"sglang": (".json", ".pt"), "vllm": (".json",), "eplb": (".pt", ".npz"), "trtllm": (".yaml", ".yml")}


def export_plan(plan: PlanFile, engine: str, out: Path, *, num_model_layers: int | None = None,
                dense_layer_ids: tuple[int, ...] = ()) -> dict:
    """Write `plan` for `engine` to `out`; returns a summary (with `warnings`).

    Engines give every layer the same slot count: a budget plan's per-layer plans (`plan.budget`)
    stay in the plan file, its evenly slotted placement is exported (a warning says so).
    """
    placement, layer_ids = plan.placement, tuple(plan.layer_ids)
    out = Path(out)
    if engine not in SUFFIXES:
        raise InputError("--engine", f"one of {', '.join(SUFFIXES)}", engine)
    if out.suffix not in SUFFIXES[engine]:
        raise InputError(f"--out {out}", f"a file name ending in {' or '.join(SUFFIXES[engine])} for {engine}",
                         out.suffix or "no suffix")
    summary = {"engine": engine, "out": str(out), "num_gpus": placement.num_gpus,
               "num_logical_experts": placement.num_experts,
               "num_physical_experts": placement.num_physical, "warnings": []}
    if plan.budget is not None:
        summary["warnings"].append(
            f"the budget plan's per-layer slot counts ({min(plan.budget.slots_per_gpu)}-"
            f"{max(plan.budget.slots_per_gpu)} per GPU) cannot run on {engine}, which gives every layer the same "
            f"count: exported the same budget spread evenly ({placement.slots_per_gpu} per GPU on every layer)")
    if engine == "sglang":
        location = sglang.init_expert_location(placement, layer_ids, num_model_layers=num_model_layers,
                                               dense_layer_ids=dense_layer_ids)
        sglang.write_init_expert_location(out, location)
        summary["num_model_layers"] = int(location.physical_to_logical_map.shape[0])
        summary["planned_layers"] = len(location.planned_layers)
        summary["trivial_layers"] = len(location.trivial_layers)
        summary["ep_num_redundant_experts"] = placement.num_physical - placement.num_experts
        if location.unplanned_moe_layers:
            summary["warnings"].append(
                f"{len(location.unplanned_moe_layers)} model layers are not in the plan and get the trivial "
                f"row (first: {location.unplanned_moe_layers[0]}); pass --dense-layers if they are dense")
        summary["launch"] = (f"--ep-size {placement.num_gpus} --ep-num-redundant-experts "
                             f"{summary['ep_num_redundant_experts']} --init-expert-location {out}")
    elif engine == "vllm":
        write_plan(out, plan.without_report())
        summary["num_layers"] = placement.num_layers
        summary["launch"] = (f"{STATIC_PLAN_ENV}={out} with moe_place.engines.vllm installed; "
                             f"--eplb-config '{{\"num_redundant_experts\": "
                             f"{placement.num_physical - placement.num_experts}}}'")
    elif engine == "trtllm":
        keys = trtllm.model_layer_keys(layer_ids, dense_layer_ids)
        config = trtllm.load_balancer_config(placement, keys)
        trtllm.write_load_balancer(out, config, f"moe-place plan for TensorRT-LLM's moe_config.load_balancer: "
                                   f"{placement.num_layers} MoE layers, {placement.num_experts} experts, "
                                   f"{placement.num_physical} slots on EP {placement.num_gpus}")
        summary["num_layers"] = placement.num_layers
        summary["layer_keys"] = f"{keys[0]}-{keys[-1]}" if keys == tuple(range(keys[0], keys[-1] + 1)) else \
            ",".join(map(str, keys))
        summary["num_local_slots"] = placement.slots_per_gpu
        summary["launch"] = (f"--ep_size {placement.num_gpus} and --extra_llm_api_options holding "
                             f"'moe_config: {{load_balancer: {out}}}'")
    else:
        write_eplb_tensors(out, placement)
        summary["num_layers"] = placement.num_layers
    return summary


def write_eplb_tensors(out: Path, placement: Placement) -> None:
    """`phy2log`, `log2phy` (-1 padded to max(logcnt)), `logcnt` as int64, .pt or .npz."""
    arrays = {"phy2log": np.asarray(placement.phy2log), "log2phy": np.asarray(placement.log2phy),
              "logcnt": np.asarray(placement.logcnt)}
    buffer = io.BytesIO()
    if out.suffix == ".npz":
        np.savez(buffer, **arrays)
    else:
        import torch  # lazy: only the .pt format needs torch

        torch.save({k: torch.from_numpy(np.array(v, dtype=np.int64)) for k, v in arrays.items()}, buffer)
    write_atomic(out, buffer.getvalue())
