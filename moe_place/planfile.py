"""The plan file: a versioned JSON document holding a placement, its report and its inputs.

The one plan format: `moe-place plan` writes it, every engine adapter reads it (the vLLM policy's
static plan, `moe-place export` for SGLang and DeepSeek EPLB), and `moe-place export --engine
vllm` writes it without its `report` (an engine needs the maps, not the figures).

Format (`format_version` 1); every key is present except `report` (absent in an engine export)
and `budget` (present only in a budget-mode plan):

    {
      "format_version": 1,
      "kind": "moe-place plan",
      "num_layers": L,                  # MoE layers in the plan
      "num_logical_experts": E,
      "num_physical_experts": P,        # slots per layer, P = E + redundant, P % G == 0
      "num_gpus": G,                    # EP size over all nodes
      "num_nodes": N,                   # GPU g is on node g // (G / N)
      "allow_colocated": false,         # true only for plans with two replicas of one expert on a GPU
      "layer_ids": [..L ints..],        # model layer index of each plan layer
      "phy2log": [[..P ints..] x L],    # logical expert of each slot; slot p on GPU p // (P/G)
      "log2phy": [[[..] x E] x L],      # slots of each expert, ascending, padded with -1
      "logcnt": [[..E ints..] x L],     # replicas of each expert
      "report": {
        "solver": "auto", "status": "optimal|feasible|heuristic", "wall_s": 1.2, "split": "even",
        "layers": [{"layer": id, "max_gpu_load": .., "mean_gpu_load": .., "balancedness": ..,
                    "lower_bound": .., "gap": .., "status": ..}, ...],
        "split_placement": {..}         # `plan --split per-batch` only: the search's figures per layer
      },
      "inputs": {"trace": "path", "trace_sha256": "hex", "options": {...}, "seed": 0},
      "budget": {                       # budget mode: per-layer slot counts under one memory budget
        "expert_bytes": B, "gpu_budget_bytes": M,   # sum(slots_per_gpu) * B <= M
        "slots_per_gpu": [..L ints..],  # S[l], every GPU the same within a layer
        "phy2log": [[..G*S[l] ints..] x L]          # each layer's own plan (rows differ in length)
      }
    }

Engines give every layer the same number of slots, so they run `phy2log` (in budget mode the same
budget spread evenly over the layers); `budget.phy2log` is the per-layer plan the budget buys,
validated like any placement (`PlanFile.budget`), for tools that can run per-layer slot counts.

`inputs.options.split` is the split the plan was made with: `per-batch` means the replicas were
placed for the per-batch split (`moe_place.solvers.split_placement`), and `evaluate` judges the plan
with that split unless its command line names another; `even`, `local` and `optimal` were the
report's split only.

`write_plan` validates (builds a `Placement`) before writing and writes atomically;
`read_plan` checks the version, the keys (a key the format does not have is an error naming it and
the closest known key: a misspelt one would otherwise be ignored), the shapes and that
`log2phy`/`logcnt` agree with `phy2log`, raising one InputError naming the file and field
otherwise. `report` and `inputs` are free-form records of how the plan was made (read by people
and by `evaluate` for its defaults), so their keys are not checked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moe_place.errors import InputError, check_keys
from moe_place.io import read_input_text, write_json_atomic
from moe_place.placement import Placement

__all__ = ["BudgetLayers", "PlanFile", "parse_plan", "read_plan", "write_plan"]

FORMAT_VERSION = 1
KIND = "moe-place plan"
LAYER_KEYS = ("layer", "max_gpu_load", "mean_gpu_load", "balancedness", "lower_bound", "gap", "status")
TOP_KEYS = ("format_version", "num_layers", "num_logical_experts", "num_physical_experts", "num_gpus", "num_nodes",
            "layer_ids", "phy2log", "log2phy", "logcnt", "inputs")
OPTIONAL_KEYS = ("kind", "allow_colocated", "report", "budget")  # every other key is an error naming it
BUDGET_KEYS = ("expert_bytes", "gpu_budget_bytes", "slots_per_gpu", "phy2log")


@dataclass(frozen=True)
class BudgetLayers:
    """The per-layer plans of a budget-mode plan file.

    layers: per plan layer a one-layer `Placement` with its own slots (`G * slots_per_gpu[l]`).
    expert_bytes / gpu_budget_bytes: `W_e` and the per-GPU budget the slot counts fit in.
    """

    layers: tuple[Placement, ...]
    expert_bytes: int
    gpu_budget_bytes: int

    def __post_init__(self) -> None:
        if self.used_bytes > self.gpu_budget_bytes:
            raise InputError("budget", f"slots within gpu_budget_bytes={self.gpu_budget_bytes}",
                             f"{self.used_bytes} bytes per GPU")

    @property
    def slots_per_gpu(self) -> tuple[int, ...]:
        return tuple(p.slots_per_gpu for p in self.layers)

    @property
    def used_bytes(self) -> int:
        return sum(self.slots_per_gpu) * self.expert_bytes

    def to_json(self) -> dict[str, Any]:
        return {"expert_bytes": int(self.expert_bytes), "gpu_budget_bytes": int(self.gpu_budget_bytes),
                "slots_per_gpu": list(self.slots_per_gpu), "phy2log": [p.phy2log[0].tolist() for p in self.layers]}


@dataclass(frozen=True)
class PlanFile:
    """A plan as read from or written to disk.

    placement: the validated plan. layer_ids: model layer index of each plan layer.
    report / inputs: the JSON objects described in the module docstring (report None: left out).
    budget: the per-layer plans of budget mode, or None.
    """

    placement: Placement
    layer_ids: tuple[int, ...]
    report: dict[str, Any] | None = field(default_factory=dict)
    inputs: dict[str, Any] = field(default_factory=dict)
    budget: BudgetLayers | None = None

    def __post_init__(self) -> None:
        if len(self.layer_ids) != self.placement.num_layers:
            raise InputError("layer_ids", f"{self.placement.num_layers} ids", len(self.layer_ids))
        if self.budget is not None:
            layers = self.budget.layers
            if len(layers) != self.placement.num_layers or any(
                    (b.num_gpus, b.num_experts) != (self.placement.num_gpus, self.placement.num_experts)
                    for b in layers):
                raise InputError("budget", f"one plan per layer for {self.placement.num_gpus} GPUs and "
                                 f"{self.placement.num_experts} experts", f"{len(layers)} plans")

    def without_report(self) -> "PlanFile":
        """The same plan with no report (what an engine export holds)."""
        return PlanFile(self.placement, self.layer_ids, None, self.inputs, self.budget)

    def to_json(self) -> dict[str, Any]:
        p = self.placement
        document = {
            "format_version": FORMAT_VERSION,
            "kind": KIND,
            "num_layers": p.num_layers,
            "num_logical_experts": p.num_experts,
            "num_physical_experts": p.num_physical,
            "num_gpus": p.num_gpus,
            "num_nodes": p.num_nodes,
            "allow_colocated": bool(p.allow_colocated),
            "layer_ids": [int(i) for i in self.layer_ids],
            "phy2log": p.phy2log.tolist(),
            "log2phy": p.log2phy.tolist(),
            "logcnt": p.logcnt.tolist(),
            "inputs": self.inputs,
        }
        if self.report is not None:
            document["report"] = self.report
        if self.budget is not None:
            document["budget"] = self.budget.to_json()
        return document


def write_plan(path: str | Path, plan: PlanFile) -> None:
    """Validate `plan` (round-trip through the checks of `parse_plan`) and write it atomically
    (`plan.without_report()` for an engine export)."""
    document = plan.to_json()
    parse_plan(json.loads(json.dumps(document)), str(path))  # the same checks a reader applies
    write_json_atomic(path, document)


def read_plan(path: str | Path) -> PlanFile:
    """Read and validate a plan file; InputError naming the file and field on any problem."""
    path = Path(path)
    text = read_input_text(path, "a plan file")
    try:
        document = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise InputError(str(path), "a JSON plan file", f"unreadable JSON ({exc})") from None
    except ValueError as exc:  # NaN / Infinity: plan files are strict JSON
        raise InputError(str(path), "a strict JSON plan file (finite numbers)", str(exc)) from None
    return parse_plan(document, str(path))


def _reject_constant(name: str):
    raise ValueError(f"{name} in the file")


def parse_plan(document: Any, where: str = "plan") -> PlanFile:
    """Validate a decoded plan document and build the PlanFile."""
    if not isinstance(document, dict):
        raise InputError(where, "a JSON object", type(document).__name__)
    missing = [k for k in TOP_KEYS if k not in document]
    if missing:
        raise InputError(where, f"the plan keys {', '.join(TOP_KEYS)}", f"missing {', '.join(missing)}")
    check_keys(document, TOP_KEYS + OPTIONAL_KEYS, f"{where}:")  # a misspelt `budget` must not drop the budget plan
    version = document["format_version"]
    if version != FORMAT_VERSION:
        raise InputError(f"{where}: format_version", f"{FORMAT_VERSION}", version)
    ints = {}
    for key in ("num_layers", "num_logical_experts", "num_physical_experts", "num_gpus", "num_nodes"):
        value = document[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InputError(f"{where}: {key}", "a positive integer", value)
        ints[key] = value
    layers, experts, physical = ints["num_layers"], ints["num_logical_experts"], ints["num_physical_experts"]
    phy2log = _int_array(document["phy2log"], f"{where}: phy2log", (layers, physical))
    layer_ids = document["layer_ids"]
    if (not isinstance(layer_ids, list) or len(layer_ids) != layers
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layer_ids)
            or len(set(layer_ids)) != layers):
        raise InputError(f"{where}: layer_ids", f"{layers} distinct layer indices >= 0", layer_ids)
    try:
        placement = Placement(phy2log, experts, ints["num_gpus"], ints["num_nodes"],
                              allow_colocated=bool(document.get("allow_colocated", False)))
    except InputError as exc:
        raise InputError(f"{where}: {exc.where}", exc.expected, exc.got) from None
    logcnt = _int_array(document["logcnt"], f"{where}: logcnt", (layers, experts))
    if not np.array_equal(logcnt, placement.logcnt):
        raise InputError(f"{where}: logcnt", "the replica counts of phy2log", "different counts")
    log2phy = _int_array(document["log2phy"], f"{where}: log2phy", placement.log2phy.shape)
    if not np.array_equal(log2phy, placement.log2phy):
        raise InputError(f"{where}: log2phy", "the slots of each expert in phy2log (ascending, -1 padded)",
                         "different slots")
    report, inputs = document.get("report"), document["inputs"]
    if report is not None and (not isinstance(report, dict) or not isinstance(report.get("layers", []), list)):
        raise InputError(f"{where}: report", "an object with a list of layers")
    for i, row in enumerate((report or {}).get("layers", [])):
        if not isinstance(row, dict) or any(k not in row for k in LAYER_KEYS):
            raise InputError(f"{where}: report.layers[{i}]", f"the keys {', '.join(LAYER_KEYS)}")
    if not isinstance(inputs, dict):
        raise InputError(f"{where}: inputs", "an object")
    budget = _parse_budget(document.get("budget"), placement, f"{where}: budget")
    return PlanFile(placement, tuple(layer_ids), report, inputs, budget)


def _parse_budget(section: Any, placement: Placement, where: str) -> BudgetLayers | None:
    """The `budget` section as per-layer placements (None when absent)."""
    if section is None:
        return None
    if not isinstance(section, dict) or any(k not in section for k in BUDGET_KEYS):
        raise InputError(where, f"an object with {', '.join(BUDGET_KEYS)}")
    check_keys(section, BUDGET_KEYS, where)
    ints = {}
    for key in ("expert_bytes", "gpu_budget_bytes"):
        value = section[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InputError(f"{where}.{key}", "a positive integer of bytes", value)
        ints[key] = value
    slots, rows = section["slots_per_gpu"], section["phy2log"]
    layers = placement.num_layers
    if not isinstance(slots, list) or len(slots) != layers or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in slots):
        raise InputError(f"{where}.slots_per_gpu", f"{layers} slot counts >= 1", slots)
    if not isinstance(rows, list) or len(rows) != layers:
        raise InputError(f"{where}.phy2log", f"{layers} rows, one per layer", type(rows).__name__)
    plans = []
    for layer, (count, row) in enumerate(zip(slots, rows)):
        here = f"{where}.phy2log[{layer}]"
        arr = _int_array([row] if isinstance(row, list) else row, here, (1, placement.num_gpus * count))
        try:
            plans.append(Placement(arr, placement.num_experts, placement.num_gpus, placement.num_nodes,
                                   allow_colocated=placement.allow_colocated))
        except InputError as exc:
            raise InputError(here, exc.expected, exc.got) from None
    try:
        return BudgetLayers(tuple(plans), ints["expert_bytes"], ints["gpu_budget_bytes"])
    except InputError as exc:
        raise InputError(where, exc.expected, exc.got) from None


def _int_array(value: Any, where: str, shape: tuple[int, ...]) -> np.ndarray:
    try:
        arr = np.array(value)
    except ValueError:
        raise InputError(where, f"a rectangular integer array of shape {list(shape)}", "ragged lists") from None
    if arr.shape != tuple(shape):
        raise InputError(where, f"shape {list(shape)}", list(arr.shape))
    if arr.size and arr.dtype.kind not in "iu":
        raise InputError(where, "integers", f"dtype {arr.dtype}")
    return arr.astype(np.int64)
