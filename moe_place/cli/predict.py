"""`moe-place predict SCENARIO`: every bound of the cost model for one scenario file."""

from __future__ import annotations

import argparse
import json
import sys

from moe_place.cli.options import add_hardware_from_option, add_out_argument, format_option, report_file
from moe_place.cli.output import emit, report_format
from moe_place.errors import InputError

HELP = "predict expert compute, dispatch/combine, pipeline, payback and offload bounds for a scenario file"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", metavar="SCENARIO", nargs="?",
                        help="scenario file (.toml or .json): hardware, topology, model, workload (see docs/predict.md)")
    format_option(parser)
    add_out_argument(parser, report_file, "FILE", "write the table/JSON to FILE", aliases=("--output",),
                     default_text="stdout")
    parser.add_argument("--schema", action="store_true", help="print the scenario schema and exit")
    add_hardware_from_option(parser)


def run(args: argparse.Namespace) -> int:
    from moe_place.cost.report import format_report
    from moe_place.cost.scenario import SCHEMA, load_scenario, predict

    if args.schema:
        sys.stdout.write(SCHEMA)
        return 0
    if args.scenario is None:
        raise InputError("SCENARIO", "a scenario file (or --schema)", "nothing")
    fmt, label = report_format(args.format, args.out)
    report = predict(load_scenario(args.scenario, args.hardware_from))
    if report.get("workload_from_plan"):
        taken = ", ".join(f"{key} = {value!r}" for key, value in report["workload_from_plan"].items())
        print(f"moe-place predict: note: as the workload's plan was made: {taken} (keys in [workload] win)",
              file=sys.stderr)
    text = json.dumps(report, indent=1) + "\n" if fmt == "json" else format_report(report)
    emit(text, args.out, label)
    return 0
