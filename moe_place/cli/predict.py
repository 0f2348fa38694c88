"""`moe-place predict SCENARIO`: every bound of the cost model for one scenario file."""

from __future__ import annotations

import argparse
import json
import sys

from moe_place.cli.options import output_file
from moe_place.cli.output import emit
from moe_place.errors import InputError

HELP = "predict expert compute, dispatch/combine, pipeline, payback and offload bounds for a scenario file"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", metavar="SCENARIO", nargs="?",
                        help="scenario file (.toml or .json): hardware, topology, model, workload (see README)")
    parser.add_argument("--format", choices=("table", "json"), default="table", help="output format (default table)")
    parser.add_argument("--output", type=output_file, metavar="FILE", help="write the table/JSON to FILE (default: stdout)")
    parser.add_argument("--schema", action="store_true", help="print the scenario schema and exit")


def run(args: argparse.Namespace) -> int:
    from moe_place.cost.report import format_report
    from moe_place.cost.scenario import SCHEMA, load_scenario, predict

    if args.schema:
        sys.stdout.write(SCHEMA)
        return 0
    if args.scenario is None:
        raise InputError("SCENARIO", "a scenario file (or --schema)", "nothing")
    report = predict(load_scenario(args.scenario))
    text = json.dumps(report, indent=1) + "\n" if args.format == "json" else format_report(report)
    emit(text, args.output, args.format)
    return 0
