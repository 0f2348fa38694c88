"""`moe-place evaluate PLAN TRACE`: judge a plan on any trace (out of sample when it is not its own)."""

from __future__ import annotations

import argparse
import sys

import numpy as np

from moe_place.cli.options import (TIME_MODEL_DEFAULTS, add_hardware_from_option, add_progress_option,
                                   add_split_cost_arguments, add_steps_option, add_time_model_arguments,
                                   add_trace_options, fraction, non_negative_int, positive_int, trace_load_options)
from moe_place.cli.output import print_report
from moe_place.errors import InputError

DEFAULTS = {**TIME_MODEL_DEFAULTS, "split": "even", "seed": 0}  # what evaluate uses when neither says
HELP = ("per-layer busiest/mean GPU load, balancedness, bound and gap of a plan file on a trace, and the predicted "
        "layer time (dispatch + compute + combine, RDMA/NVLink bytes, nodes per token)")



def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", metavar="PLAN", help="plan file written by `moe-place plan`")
    parser.add_argument("trace", metavar="TRACE", help="routing trace file with the plan's layers and experts")
    parser.add_argument("--split", choices=("even", "local", "optimal", "per-batch"), default=None,
                        help="token split among replicas (default: the plan's, else even): per-batch splits each "
                             "step's dispatches so that the busiest GPU is least (the fast method the engine "
                             "plugins run), optimal the same exactly (an LP per layer and step); with either, the "
                             "layer time follows the split")
    add_split_cost_arguments(parser)
    parser.add_argument("--windows", type=positive_int, default=None, metavar="W",
                        help="judge W windows of consecutive steps, combined by --window-objective "
                             "(default: the steps summed)")
    parser.add_argument("--window-objective", choices=("max", "mean", "quantile"), default="max",
                        help="how the windows' busiest loads combine (default max)")
    parser.add_argument("--quantile", type=fraction, default=None,
                        help="the quantile for --window-objective quantile, in [0, 1] (default 0.9)")
    parser.add_argument("--format", choices=("table", "json"), default="table", help="output format (default table)")
    add_time_model_arguments(parser, from_plan=True)
    add_hardware_from_option(parser)
    parser.add_argument("--seed", type=non_negative_int, default=None,
                        help="seed of the random replica choices (default: the plan's, else 0)")
    add_steps_option(parser, "judge on")
    add_trace_options(parser)
    add_progress_option(parser)


def run(args: argparse.Namespace) -> int:
    from moe_place.analysis.imbalance import placement_imbalance
    from moe_place.cli.replay import split_charges
    from moe_place.cost.replicas import split_overhead_s
    from moe_place.cli.shared import (model_options_unlike_plan, options_from_plan, select_args_steps, time_figures,
                                      time_model_from_args)
    from moe_place.io import file_sha256
    from moe_place.planfile import read_plan
    from moe_place.solvers.evaluate import evaluate_placement
    from moe_place.traces.load import load_trace

    plan = read_plan(args.plan)
    taken = options_from_plan(args, plan)
    args.split = args.split or "even"
    args.seed = 0 if args.seed is None else args.seed
    trace = load_trace(args.trace, **trace_load_options(args))
    placement = plan.placement
    if trace.num_experts != placement.num_experts:
        raise InputError(f"{args.trace}: num_experts", f"{placement.num_experts} (the plan's)",
                         trace.num_experts)
    trace = trace.select_layer_ids(list(plan.layer_ids), where=f"{args.trace}: layers (the plan's layer ids)")
    file_steps = trace.num_steps
    trace = select_args_steps(args, trace)
    if args.quantile is not None and args.window_objective != "quantile":
        raise InputError("--quantile", "--window-objective quantile as well (it is used only there)",
                         f"--window-objective {args.window_objective}")
    quantile = 0.9 if args.quantile is None else args.quantile
    loads = trace.window_counts(args.windows)
    steps = trace.step_counts()
    window_of_step = np.concatenate([np.full(len(part), w) for w, part in
                                     enumerate(np.array_split(np.arange(len(steps)), len(loads)))]).astype(np.int64)
    reports = evaluate_placement(placement, loads, args.split, args.window_objective, quantile, plan.layer_ids,
                                 step_loads=steps, window_of_step=window_of_step)
    sample = sample_of(plan, file_sha256(args.trace), args.steps, file_steps)
    report = {"plan": str(args.plan), "trace": str(args.trace), "steps": args.steps, "sample": sample,
              "split": args.split, "windows": int(loads.shape[0]), "options_from_plan": taken,
              "layers": [r.to_dict() for r in reports],
              "trtllm_imbalance": placement_imbalance(placement, trace.step_counts()).to_dict()}
    overhead = split_overhead_s(placement.num_gpus, placement.num_nodes, **split_charges(args))  # a layer and step
    model = time_model_from_args(args, placement.num_gpus, placement.num_nodes, trace.meta.model, required=False,
                                 seed=args.seed)
    print(f"evaluate: note: {sample}", file=sys.stderr)  # after the last option check: an error is one line
    if model is None:
        report["time_note"] = (f"no layer time: the trace's model {trace.meta.model!r} names no expert-shape preset; "
                               f"give --model")
        print(f"evaluate: note: {report['time_note']}", file=sys.stderr)
    else:
        layers, top = time_figures(placement, trace, model, progress=not args.no_progress, split=args.split,
                                   split_overhead=overhead)
        for row, extra in zip(report["layers"], layers):
            row.update(extra)
        report.update(top)
        if "note" in top:
            print(f"evaluate: note: {top['note']}", file=sys.stderr)
    said = {key: value for key, value in taken.items() if DEFAULTS.get(key) != value}  # what changes a figure
    if said:
        used = ", ".join(f"--{key.replace('_', '-')} {value}" for key, value in said.items())
        print(f"evaluate: note: as the plan was made: {used} (options on the command line win)", file=sys.stderr)
    unlike = model_options_unlike_plan(args, plan) if model is not None else {}
    if unlike:   # judged under the one model all the same: two plans of one trace compare
        report["model_unlike_plan"] = {key: {"plan": old, "judged": new} for key, (old, new) in unlike.items()}

        def flags(which: int) -> str:
            return ", ".join(f"--{key.replace('_', '-')} {pair[which]}" for key, pair in unlike.items())
        print(f"evaluate: note: the plan was made under {flags(0)}; judged, as every plan, under {flags(1)} (give "
              f"{flags(0)} to judge it under the plan's)", file=sys.stderr)
    if args.format == "json":
        print_report(report, "json")
        return 0
    print_report(report, args.format, header=f"evaluate {args.plan} on {args.trace}: split {args.split}")
    print(trtllm_line(report["trtllm_imbalance"]))
    if model is not None:
        print_time_table(report)
    return 0


def sample_of(plan, trace_sha256: str, steps: list[int] | None, num_steps: int) -> str:
    """Whether the plan is judged on what it was made on: "in sample", "out of sample" or "partly
    in sample" (the plan's recorded trace digest and `--steps` against the judged steps of the file's
    `num_steps`), with why."""
    if plan.inputs.get("trace_sha256") != trace_sha256:
        return "out of sample: the plan was made on another trace file (its inputs.trace_sha256 differs)"
    recorded = (plan.inputs.get("options") or {}).get("steps")
    made_on = set(range(num_steps)) if recorded is None else set(recorded)
    judged = set(range(num_steps)) if steps is None else set(steps)
    made = "every step" if recorded is None else _steps_text(made_on)
    said = "every step" if steps is None else _steps_text(judged)
    if not made_on & judged:
        return f"out of sample: the plan was made on {made} of this trace, judged on {said}"
    kind = "in sample" if judged <= made_on else "partly in sample"
    return f"{kind}: the plan was made on {made} of this trace, judged on {said}"


def trtllm_line(imbalance: dict) -> str:
    """TensorRT-LLM's imbalance ratios (`moe_place.analysis.imbalance`) as one line, beside balancedness."""
    text = {key: "-" if imbalance[key] is None else f"{imbalance[key]:.4f}" for key in ("by_rank", "by_slot")}
    return (f"TensorRT-LLM imbalance, (max - mean) / mean per step averaged over steps and layers: by rank "
            f"{text['by_rank']}, by slot {text['by_slot']}")


def _steps_text(steps: set[int]) -> str:
    return f"step{'s' if len(steps) > 1 else ''} {','.join(map(str, sorted(steps)))}"


def print_time_table(report: dict) -> None:
    """The layer-time figures of `evaluate` as a table (microseconds, MB), with what they assume."""
    m = report["time_model"]
    overhead = (f", the split's all-reduce and solve {m['split_overhead_s'] * 1e6:.1f} us a layer and step (in the "
                f"layer time)" if m.get("split_overhead_s") is not None else "")
    lines = [f"layer time: {m['topology']}, {m['model']}, dispatch {m['dispatch']}, replica choice "
             f"{m['replica_choice']}{overhead}, tokens in {m['token_home']}, weights {m['weights']} (sums over the "
             "trace's steps)",
             f"{'layer':>6} {'nodes/token':>12} {'RDMA MB':>10} {'NVLink MB':>10} {'dispatch us':>12} "
             f"{'compute us':>11} {'combine us':>11} {'layer us':>10}"]

    def num(value, scale: float, width: int, digits: int) -> str:
        return f"{'-':>{width}}" if value is None else f"{value * scale:>{width}.{digits}f}"

    for row in report["layers"]:
        lines.append(f"{row['layer']:>6} {num(row['distinct_nodes_per_token'], 1, 12, 3)} "
                     f"{num(row['rdma_bytes'], 1e-6, 10, 2)} {num(row['nvlink_bytes'], 1e-6, 10, 2)} "
                     f"{num(row['dispatch_s'], 1e6, 12, 2)} {num(row['compute_s'], 1e6, 11, 2)} "
                     f"{num(row['combine_s'], 1e6, 11, 2)} {num(row['layer_time_s'], 1e6, 10, 2)}")
    if report.get("layer_time_s") is not None:
        lines.append(f"sum: layer time {report['layer_time_s'] * 1e3:.4f} ms, RDMA {report['rdma_bytes'] / 1e9:.4f} GB")
    else:
        lines.append(f"sum: compute {report['compute_s'] * 1e3:.4f} ms; {report['note']}")
    sys.stdout.write("\n".join(lines) + "\n")
