"""Write a plan in an engine's format (what `moe-place export` does), atomically.

engine "sglang": `moe_place.engines.sglang` (`--init-expert-location` file, .json or .pt).
engine "vllm":   the plan file without its report (.json, `moe_place.planfile`), the static plan the
                 moe-place policy reads (`MOE_PLACE_STATIC_PLAN`).
engine "eplb":   DeepSeek EPLB's `(phy2log, log2phy, logcnt)`, int64, as `.pt` (torch.save of a
                 dict of tensors) or `.npz` (numpy arrays of the same names).
engine "trtllm": TensorRT-LLM's `moe_config.load_balancer` YAML (`moe_place.engines.trtllm`), `.yaml`/`.yml`,
                 with a key for every MoE layer of the served model (`served_moe_layers`).
Every summary's `launch` is the whole command that serves the file (`moe_place.engines.launch.export_launch`).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from moe_place.cost.model_layers import moe_layer_ids
from moe_place.cost.models import PRESETS, ExpertShape, get_model, infer_model_name
from moe_place.engines import sglang, trtllm
from moe_place.engines.launch import export_launch
from moe_place.errors import InputError
from moe_place.io import write_atomic
from moe_place.placement import Placement
from moe_place.planfile import PlanFile, write_plan

__all__ = ["export_plan", "served_moe_layers", "write_eplb_tensors"]

SUFFIXES = {"sglang": (".json", ".pt"), "vllm": (".json",), "eplb": (".pt", ".npz"), "trtllm": (".yaml", ".yml")}


def served_moe_layers(plan: PlanFile, model: str | None = None,
                      moe_layers: tuple[int, ...] | None = None) -> tuple[str, tuple[int, ...]]:
    """(name, MoE layer ids) of the model the plan will be served on: `moe_layers` when given, else the
    preset `model` names, else the preset the plan's recorded options name (`inputs.options.model`); the
    preset's layers include its MTP layers (`moe_place.cost.model_layers.moe_layer_ids`). An InputError when none is known,
    or when the preset's expert count is not the plan's."""
    recorded = (plan.inputs.get("options") or {}).get("model") if isinstance(plan.inputs, dict) else None
    name = model or (infer_model_name(recorded) if isinstance(recorded, str) else None)
    shape: ExpertShape | None = get_model(name) if name else None
    if shape is not None and shape.num_experts != plan.placement.num_experts:
        raise InputError("--model", f"a model with the plan's {plan.placement.num_experts} experts",
                         f"{shape.name} ({shape.num_experts} experts)")
    if moe_layers:
        return (shape.name if shape else "the served model"), tuple(sorted(set(moe_layers)))
    if shape is None:
        raise InputError("--model", f"the served model, a preset ({', '.join(PRESETS)}), or --moe-layers IDS: "
                         f"TensorRT-LLM looks up a map for every MoE layer it builds", "a plan that names no model")
    return shape.name, moe_layer_ids(shape)


def export_plan(plan: PlanFile, engine: str, out: Path, *, num_model_layers: int | None = None,
                dense_layer_ids: tuple[int, ...] = (), model: str | None = None,
                moe_layers: tuple[int, ...] | None = None, fill_missing: str = "error") -> dict:
    """Write `plan` for `engine` to `out`; returns a summary (with `warnings` and `notes`).

    Engines give every layer the same slot count: a budget plan's per-layer plans (`plan.budget`)
    stay in the plan file, its evenly slotted placement is exported (a warning says so).
    trtllm only: `model` (a preset name), `moe_layers` (the served model's MoE layer ids, which win) and
    `fill_missing` ("error" or "default", `trtllm.load_balancer_config`).
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
               "num_physical_experts": placement.num_physical, "warnings": [], "notes": []}
    redundant = placement.num_physical - placement.num_experts
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
        summary["ep_num_redundant_experts"] = redundant
        if location.unplanned_moe_layers:
            summary["warnings"].append(
                f"{len(location.unplanned_moe_layers)} model layers are not in the plan and get the trivial "
                f"row (first: {location.unplanned_moe_layers[0]}); pass --dense-layers if they are dense")
    elif engine == "vllm":
        write_plan(out, plan.without_report())
        summary["num_layers"] = placement.num_layers
    elif engine == "trtllm":
        summary.update(_export_trtllm(plan, out, summary, dense_layer_ids, model, moe_layers, fill_missing))
    else:
        write_eplb_tensors(out, placement)
        summary["num_layers"] = placement.num_layers
    summary["launch"] = export_launch(engine, out, placement.num_gpus, redundant)
    return summary


def _export_trtllm(plan: PlanFile, out: Path, summary: dict, dense_layer_ids: tuple[int, ...], model: str | None,
                   moe_layers: tuple[int, ...] | None, fill_missing: str) -> dict:
    """Write the load balancer with a key for every MoE layer of the served model; the summary's trtllm rows.

    Plan ids 0, 1, ... (a trace of MoE layers only) with no `--dense-layers` go to the served model's MoE
    layers in order: the layers below its first MoE layer are dense by definition. Notes and warnings are
    added to `summary`."""
    placement, layer_ids = plan.placement, tuple(plan.layer_ids)
    name, served = served_moe_layers(plan, model, moe_layers)
    positions = layer_ids == tuple(range(len(layer_ids)))
    dense = dense_layer_ids
    if not dense and positions and served[0] > 0 and len(layer_ids) <= len(served):
        dense = tuple(range(served[0]))
        summary["notes"].append(
            f"the plan's layer ids 0-{len(layer_ids) - 1} are taken as positions among {name}'s MoE layers (a trace "
            f"that kept MoE layers only): row i goes to MoE layer i from layer {served[0]} (its layers "
            f"{trtllm.format_layers(dense)} are dense)")
    keys = trtllm.model_layer_keys(layer_ids, dense)
    config = trtllm.load_balancer_config(placement, keys, served, fill_missing, name)
    left_out = sorted(set(keys) - set(served))
    filled = sorted(set(served) - set(keys))
    if left_out:
        summary["warnings"].append(f"plan rows for {trtllm.format_layers(left_out, noun=True)} are not MoE layers of "
                                   f"{name} ({trtllm.format_layers(served)}): left out")
    if filled:
        summary["warnings"].append(f"{trtllm.format_layers(filled, noun=True)} not in the plan: TensorRT-LLM's "
                                   f"own map there (--fill-missing default)")
    trtllm.write_load_balancer(out, config, f"moe-place plan for TensorRT-LLM's moe_config.load_balancer: "
                               f"{name}, {len(served)} MoE layers ({len(filled)} with the engine's own map), "
                               f"{placement.num_experts} experts, {placement.num_physical} slots on EP "
                               f"{placement.num_gpus}")
    return {"model": name, "num_layers": len(served), "layer_keys": trtllm.format_layers(served),
            "planned_layers": len(served) - len(filled), "default_map_layers": trtllm.format_layers(filled) or "none",
            "num_local_slots": placement.slots_per_gpu}


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
