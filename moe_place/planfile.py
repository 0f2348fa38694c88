"""The plan file: a versioned JSON document holding a placement, its report and its inputs.

Format (`format_version` 1); every key is always present:

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
                    "lower_bound": .., "gap": .., "status": ..}, ...]
      },
      "inputs": {"trace": "path", "trace_sha256": "hex", "options": {...}, "seed": 0}
    }

`write_plan` validates (builds a `Placement`) before writing and writes atomically;
`read_plan` checks the version, the keys, the shapes and that `log2phy`/`logcnt` agree with
`phy2log`, raising one InputError naming the file and field otherwise.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moe_place.errors import InputError
from moe_place.io import read_input_text, write_json_atomic
from moe_place.placement import Placement

FORMAT_VERSION = 1
KIND = "moe-place plan"
LAYER_KEYS = ("layer", "max_gpu_load", "mean_gpu_load", "balancedness", "lower_bound", "gap", "status")
TOP_KEYS = ("format_version", "num_layers", "num_logical_experts", "num_physical_experts", "num_gpus", "num_nodes",
            "layer_ids", "phy2log", "log2phy", "logcnt", "report", "inputs")


@dataclass(frozen=True)
class PlanFile:
    """A plan as read from or written to disk.

    placement: the validated plan. layer_ids: model layer index of each plan layer.
    report / inputs: the JSON objects described in the module docstring.
    """

    placement: Placement
    layer_ids: tuple[int, ...]
    report: dict[str, Any] = field(default_factory=dict)
    inputs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.layer_ids) != self.placement.num_layers:
            raise InputError("layer_ids", f"{self.placement.num_layers} ids", len(self.layer_ids))

    def to_json(self) -> dict[str, Any]:
        p = self.placement
        return {
            "format_version": FORMAT_VERSION,
            "kind": KIND,
            "num_layers": p.num_layers,
            "num_logical_experts": p.num_logical_experts,
            "num_physical_experts": p.num_physical_experts,
            "num_gpus": p.num_gpus,
            "num_nodes": p.num_nodes,
            "allow_colocated": bool(p.allow_colocated),
            "layer_ids": [int(i) for i in self.layer_ids],
            "phy2log": p.phy2log.tolist(),
            "log2phy": p.log2phy.tolist(),
            "logcnt": p.logcnt.tolist(),
            "report": self.report,
            "inputs": self.inputs,
        }


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes (the trace digest recorded in `inputs`)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_plan(path: str | Path, plan: PlanFile) -> None:
    """Validate `plan` (round-trip through the checks of `parse_plan`) and write it atomically."""
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
    report, inputs = document["report"], document["inputs"]
    if not isinstance(report, dict) or not isinstance(report.get("layers", []), list):
        raise InputError(f"{where}: report", "an object with a list of layers")
    for i, row in enumerate(report.get("layers", [])):
        if not isinstance(row, dict) or any(k not in row for k in LAYER_KEYS):
            raise InputError(f"{where}: report.layers[{i}]", f"the keys {', '.join(LAYER_KEYS)}")
    if not isinstance(inputs, dict):
        raise InputError(f"{where}: inputs", "an object")
    return PlanFile(placement, tuple(layer_ids), report, inputs)


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
