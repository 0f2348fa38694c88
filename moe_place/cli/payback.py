"""`moe-place payback SCENARIO`: copy time, saving per batch, N_min and net-gain curve of a replica move."""

from __future__ import annotations

import argparse
import json
import sys

HELP = "replica payback of a scenario's [payback] section: copy time, saving per batch, N_min, net gain"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", metavar="SCENARIO", help="scenario file (.toml or .json) with a [payback] section")
    parser.add_argument("--format", choices=("table", "json"), default="table", help="output format (default table)")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw net gain vs batches per copy path (PNG)")
    parser.add_argument("--output", metavar="FILE", help="write the table/JSON to FILE instead of stdout")


def run(args: argparse.Namespace) -> int:
    from moe_place.cost.plot import render_payback_png
    from moe_place.cost.report import format_report
    from moe_place.cost.scenario import load_scenario, payback_report
    from moe_place.errors import InputError
    from moe_place.io import write_atomic

    scenario = load_scenario(args.scenario)
    if "payback" not in scenario.data:
        raise InputError(f"{args.scenario}: [payback]", "a payback section", "nothing")
    result = payback_report(scenario)
    batches = list(range(result["max_batches"] + 1))
    curves = {case["name"]: [n * result["saving_per_batch_s"] - case["copy_time_s"] for n in batches]
              for case in result["cases"]}
    report = {"scenario": scenario.name, "payback": result}
    if args.format == "json":
        text = json.dumps({**report, "curve": {"batches": batches, "net_gain_s": curves}}, indent=1) + "\n"
    else:
        text = format_report(report)
    if args.plot:
        write_atomic(args.plot, render_payback_png(result))
        print(f"wrote plot {args.plot}", file=sys.stderr)
    if args.output:
        write_atomic(args.output, text)
        print(f"wrote {args.format} {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
