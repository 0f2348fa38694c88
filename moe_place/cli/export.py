"""`moe-place export PLAN --engine sglang|vllm|eplb|trtllm --out FILE`: write a plan in an engine's format.

- sglang: `{"physical_to_logical_map": [num_model_layers, P]}` as `.json` or `.pt`, for
  `--init-expert-location FILE` (rows for every model layer; dense layers get the trivial row).
- vllm: the plan file without its report (`moe_place.planfile`), read by the moe-place EPLB
  policy as a static placement (`MOE_PLACE_STATIC_PLAN=FILE`, see `moe_place.engines.vllm`).
A budget plan's per-layer slot counts cannot run on these engines (one slot count for every
layer): its evenly slotted placement is written, and a warning says so.
- eplb: DeepSeek EPLB's three tensors `phy2log`, `log2phy`, `logcnt` (int64) as `.pt` or `.npz`.
- trtllm: TensorRT-LLM's `moe_config.load_balancer` YAML (`num_slots`, `initial_global_assignments`
  keyed by its MoE layer index, `layer_updates_per_iter: 0`), checked as TensorRT-LLM checks it
  (`moe_place.engines.trtllm`), with a key for every MoE layer of the served model (`--model`, or the
  plan's model, MTP layers included; `--moe-layers` names them itself): a plan that misses some is one
  line naming them, exit 2, unless `--fill-missing default` gives them TensorRT-LLM's own map;
  `--dense-layers` maps a plan made on MoE layers only to model layers.
Every file is written atomically; the summary's `launch` is the whole command that serves it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from moe_place.cli.options import add_out_argument, layer_count, layer_selection, output_file
from moe_place.errors import InputError

FILL_MISSING = ("error", "default")  # moe_place.engines.trtllm.FILL_MISSING (the library is imported lazily)

HELP = ("write a plan as the file an engine loads (SGLang --init-expert-location, vLLM policy, EPLB tensors, "
        "TensorRT-LLM load balancer)")
ENGINES = ("sglang", "vllm", "eplb", "trtllm")
DENSE_ENGINES = ("sglang", "trtllm")  # those that take --dense-layers
TRTLLM_OPTIONS = (("model", "--model"), ("moe_layers", "--moe-layers"), ("fill_missing", "--fill-missing"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", metavar="PLAN", help="a plan file written by `moe-place plan --out`")
    parser.add_argument("--engine", required=True, choices=ENGINES, help="target format")
    add_out_argument(parser, output_file, "FILE", "output file (sglang: .json or .pt; vllm: .json; eplb: .pt or .npz; "
                     "trtllm: .yaml; .pt needs torch)", required=True)
    parser.add_argument("--num-model-layers", type=layer_count, default=None, metavar="N",
                        help="sglang: decoder layers of the model (rows of the map; default: from the plan)")
    parser.add_argument("--dense-layers", type=layer_selection, default=[], metavar="IDS",
                        help="sglang, trtllm: model layers without experts, e.g. 0-2 for DeepSeek-V3 (sglang: trivial "
                             "rows; trtllm: a plan on MoE layers only is keyed by model layer; default: none)")
    parser.add_argument("--model", default=None, metavar="NAME",
                        help="trtllm: the served model's preset, whose MoE layers (MTP included, e.g. DeepSeek-V3: 3-61) "
                             "each get a key (default: the model the plan names)")
    parser.add_argument("--moe-layers", type=layer_selection, default=None, metavar="IDS",
                        help="trtllm: the served model's MoE layer ids, e.g. 3-60 for DeepSeek-V3 served without MTP "
                             "(default: the model's)")
    parser.add_argument("--fill-missing", choices=FILL_MISSING, default=None,
                        help="trtllm: a served MoE layer the plan has no row for: error (exit 2, the default) or "
                             "default (TensorRT-LLM's own map there)")
    parser.add_argument("--format", choices=("table", "json"), default="table", help="format of the summary on stdout (default table)")


def run(args: argparse.Namespace) -> int:
    from moe_place.engines.export import export_plan
    from moe_place.planfile import read_plan

    if Path(args.out).suffix == ".pt" and importlib.util.find_spec("torch") is None:  # before any work
        other = {"sglang": ".json", "eplb": ".npz"}.get(args.engine, ".json")
        raise InputError(f"--out {args.out}", f"torch installed for a .pt file (pip install torch), or the {other} "
                         f"form (--out {Path(args.out).with_suffix(other)})", "no torch")
    plan = read_plan(args.plan)
    if args.engine != "sglang" and args.num_model_layers:
        raise InputError("--num-model-layers", "only with --engine sglang", f"--engine {args.engine}")
    if args.engine not in DENSE_ENGINES and args.dense_layers:
        raise InputError("--dense-layers", "only with --engine sglang or trtllm", f"--engine {args.engine}")
    for key, option in TRTLLM_OPTIONS:
        if args.engine != "trtllm" and getattr(args, key) is not None:
            raise InputError(option, "only with --engine trtllm", f"--engine {args.engine}")
    ids = tuple(plan.layer_ids)
    positions = ids == tuple(range(len(ids)))  # a trace of MoE layers only (synth, vLLM): ids are positions
    overlap = sorted(set(args.dense_layers) & set(ids))
    if overlap and not positions:
        raise InputError("--dense-layers", "layers without experts (none of the plan's layer ids)",
                         f"layer {overlap[0]}, which the plan places experts for")
    try:
        summary = export_plan(plan, args.engine, Path(args.out), num_model_layers=args.num_model_layers,
                              dense_layer_ids=tuple(args.dense_layers), model=args.model,
                              moe_layers=tuple(args.moe_layers) if args.moe_layers else None,
                              fill_missing=args.fill_missing or "error")
    except InputError as exc:  # the library's argument names, as the options that set them
        option = {"num_model_layers": "--num-model-layers", "dense layer ids": "--dense-layers",
                  "plan layers": str(args.plan), "model preset": "--model"}.get(exc.where)
        if option is None:
            raise
        raise InputError(option, exc.expected, exc.got) from None
    if overlap:
        print(f"moe-place export: note: the plan's layer ids are 0-{len(ids) - 1}, positions among the MoE layers "
              f"(a trace that kept MoE layers only), and --dense-layers names some of them: plan row i goes to the "
              f"i-th model layer that is not dense", file=sys.stderr)
    for note in summary.pop("notes", []):
        print(f"moe-place export: note: {note}", file=sys.stderr)
    for warning in summary.pop("warnings", []):
        print(f"moe-place export: warning: {warning}", file=sys.stderr)
    if args.format == "json":
        print(json.dumps(summary, indent=1))
    else:
        for key, value in summary.items():
            print(f"{key:<25} {value}")
    return 0
