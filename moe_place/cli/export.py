"""`moe-place export PLAN --engine sglang|vllm|eplb --out FILE`: write a plan in an engine's format.

- sglang: `{"physical_to_logical_map": [num_model_layers, P]}` as `.json` or `.pt`, for
  `--init-expert-location FILE` (rows for every model layer; dense layers get the trivial row).
- vllm: the plan file without its report (`moe_place.planfile`), read by the moe-place EPLB
  policy as a static placement (`MOE_PLACE_STATIC_PLAN=FILE`, see `moe_place.engines.vllm`).
A budget plan's per-layer slot counts cannot run on these engines (one slot count for every
layer): its evenly slotted placement is written, and a warning says so.
- eplb: DeepSeek EPLB's three tensors `phy2log`, `log2phy`, `logcnt` (int64) as `.pt` or `.npz`.
Every file is written atomically.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moe_place.cli.options import layer_selection, output_file, positive_int
from moe_place.errors import InputError

HELP = "write a plan as the file an engine loads (SGLang --init-expert-location, vLLM policy, EPLB tensors)"
ENGINES = ("sglang", "vllm", "eplb")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", metavar="PLAN", help="a plan file written by `moe-place plan --out`")
    parser.add_argument("--engine", required=True, choices=ENGINES, help="target format")
    parser.add_argument("--out", type=output_file, required=True, metavar="FILE",
                        help="output file (sglang: .json or .pt; vllm: .json; eplb: .pt or .npz)")
    parser.add_argument("--num-model-layers", type=positive_int, default=None, metavar="N",
                        help="sglang: decoder layers of the model (rows of the map; default: from the plan)")
    parser.add_argument("--dense-layers", type=layer_selection, default=[], metavar="IDS",
                        help="sglang: model layers without experts, e.g. 0-2 for DeepSeek-V3 (trivial rows; "
                             "default: none)")
    parser.add_argument("--format", choices=("table", "json"), default="table", help="format of the summary on stdout (default table)")


def run(args: argparse.Namespace) -> int:
    from moe_place.engines.export import export_plan
    from moe_place.planfile import read_plan

    plan = read_plan(args.plan)
    if args.engine != "sglang" and (args.num_model_layers or args.dense_layers):
        raise InputError("--num-model-layers/--dense-layers", "only with --engine sglang", f"--engine {args.engine}")
    overlap = sorted(set(args.dense_layers) & set(plan.layer_ids))
    if overlap:
        raise InputError("--dense-layers", "layers without experts (none of the plan's layer ids)",
                         f"layer {overlap[0]}, which the plan places experts for")
    summary = export_plan(plan, args.engine, Path(args.out), num_model_layers=args.num_model_layers,
                          dense_layer_ids=tuple(args.dense_layers))
    for warning in summary.pop("warnings", []):
        print(f"moe-place export: warning: {warning}", file=sys.stderr)
    if args.format == "json":
        print(json.dumps(summary, indent=1))
    else:
        for key, value in summary.items():
            print(f"{key:<25} {value}")
    return 0
