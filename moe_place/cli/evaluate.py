"""`moe-place evaluate PLAN TRACE`: judge a plan on any trace (out of sample when it is not its own)."""

from __future__ import annotations

import argparse

from moe_place.cli.options import add_trace_options, fraction, positive_int, trace_load_options

HELP = "per-layer busiest/mean GPU load, balancedness, bound and gap of a plan file on a trace"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", metavar="PLAN", help="plan file written by `moe-place plan`")
    parser.add_argument("trace", metavar="TRACE", help="routing trace file with the plan's layers and experts")
    parser.add_argument("--split", choices=("even", "local", "optimal"), default="even",
                        help="token split among replicas (default even)")
    parser.add_argument("--windows", type=positive_int, metavar="W",
                        help="judge W windows of consecutive steps, combined by --window-objective "
                             "(default: the steps summed)")
    parser.add_argument("--window-objective", choices=("max", "mean", "quantile"), default="max",
                        help="how the windows' busiest loads combine (default max)")
    parser.add_argument("--quantile", type=fraction, default=None,
                        help="the quantile for --window-objective quantile, in [0, 1] (default 0.9)")
    parser.add_argument("--format", choices=("table", "json"), default="table", help="output format (default table)")
    add_trace_options(parser)


def run(args: argparse.Namespace) -> int:
    from moe_place.cli.plan import print_report
    from moe_place.errors import InputError
    from moe_place.solvers.evaluate import evaluate_placement
    from moe_place.planfile import read_plan
    from moe_place.traces.load import load_trace

    plan = read_plan(args.plan)
    trace = load_trace(args.trace, **trace_load_options(args))
    placement = plan.placement
    if trace.num_experts != placement.num_logical_experts:
        raise InputError(f"{args.trace}: num_experts", f"{placement.num_logical_experts} (the plan's)",
                         trace.num_experts)
    trace = trace.select_layer_ids(list(plan.layer_ids), where=f"{args.trace}: layers (the plan's layer ids)")
    if args.quantile is not None and args.window_objective != "quantile":
        raise InputError("--quantile", "--window-objective quantile as well (it is used only there)",
                         f"--window-objective {args.window_objective}")
    quantile = 0.9 if args.quantile is None else args.quantile
    loads = trace.window_counts(args.windows)
    reports = evaluate_placement(placement, loads, args.split, args.window_objective, quantile, plan.layer_ids)
    report = {"plan": str(args.plan), "trace": str(args.trace), "split": args.split,
              "windows": int(loads.shape[0]), "layers": [r.to_dict() for r in reports]}
    print_report(report, args.format, header=f"evaluate {args.plan} on {args.trace}: split {args.split}")
    return 0
