"""`moe-place payback`: copy time, saving per batch, N_min and net-gain curve of a replica move.

Either a scenario file with a [payback] section, or the move on the command line:
    moe-place payback --topology "2 nodes x 8 H100, 400 Gbit/s NIC per GPU" --model Qwen3-235B-A22B \\
        --saving-ms 0.24046821 --alpha-us 5 --case "NVLink=0:1,0:2,0:3" --case "NIC=8:1,8:2,8:3" --plot gain.png
"""

from __future__ import annotations

import argparse
import json
import re

from moe_place.cli.output import emit, report_format, wrote
from moe_place.cli.options import (add_hardware_from_option, add_out_argument, format_option, int_list, png_file,
                                   positive_float, positive_int, report_file)
from moe_place.cost.hardware import BUILTIN_PARTS
from moe_place.cost.models import PRESETS
from moe_place.errors import InputError
from moe_place.io import write_atomic

HELP = "replica payback: copy time over the real path, saving per batch, N_min, net-gain curve (--plot)"


def _case(text: str) -> dict:
    """`NAME=SRC:DST,SRC:DST` -> {"name", "copies"}."""
    match = re.fullmatch(r"\s*([^=]+)=\s*(\d+:\d+(?:\s*,\s*\d+:\d+)*)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"expected NAME=SRC:DST,SRC:DST (GPU indices), got {text!r}")
    pairs = [[int(x) for x in pair.split(":")] for pair in re.split(r"\s*,\s*", match.group(2))]
    return {"name": match.group(1).strip(), "copies": pairs}


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def MOVE_FLAGS(args: argparse.Namespace) -> list[tuple[str, object]]:  # noqa: N802 - a table, read as one
    """The options that describe the move on the command line (None when not given)."""
    return [("--topology", args.topology), ("--model", args.model), ("--saving-ms", args.saving_ms),
            ("--case", args.case), ("--alpha-us", args.alpha_us), ("--parallel", args.parallel),
            ("--free-mib", args.free_mib), ("--batches", args.batches), ("--max-batches", args.max_batches)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", metavar="SCENARIO", nargs="?", help="scenario file (.toml/.json) with [payback]")
    parser.add_argument("--topology", metavar="SPEC",
                        help='the cluster without a SCENARIO, e.g. "2 nodes x 8 H100, 400 Gbit/s NIC per GPU" '
                             f"(GPU parts: {', '.join(BUILTIN_PARTS['gpu'])}; default: none)")
    parser.add_argument("--model", metavar="PRESET", default=None,
                        help=f"expert shape (copy size): one of {', '.join(PRESETS)} (default Qwen3-235B-A22B)")
    parser.add_argument("--saving-ms", type=positive_float, metavar="MS", help="time saved per batch by the move (required without a SCENARIO)")
    parser.add_argument("--case", type=_case, action="append", metavar="NAME=SRC:DST,...",
                        help="one copy plan, GPU indices (repeat to compare paths; required without a SCENARIO)")
    parser.add_argument("--alpha-us", type=_non_negative_float, default=None, metavar="US",
                        help="startup per copy, microseconds (default 0)")
    parser.add_argument("--parallel", action="store_true", default=None,
                        help="start all copies at once (default: one after another)")
    parser.add_argument("--free-mib", type=_non_negative_float, metavar="MIB",
                        help="free memory per receiving GPU, MiB (default: not checked)")
    parser.add_argument("--batches", type=int_list, default=None, metavar="N1,N2",
                        help="report the net gain after these many batches (default 16,64)")
    parser.add_argument("--max-batches", type=positive_int, default=None, metavar="N",
                        help="curve length, at most 100,000 (default 64)")
    format_option(parser)
    parser.add_argument("--plot", type=png_file, metavar="FILE.png",
                        help="also draw net gain vs batches per copy plan (PNG; default: none)")
    add_out_argument(parser, report_file, "FILE", "write the table/JSON to FILE", aliases=("--output",),
                     default_text="stdout")
    add_hardware_from_option(parser)


def _command_line_scenario(args: argparse.Namespace) -> dict | None:
    """The scenario table the move options describe, or None when a SCENARIO file gives it
    (InputError for move options given with one, or missing without one)."""
    given = [flag for flag, value in MOVE_FLAGS(args) if value is not None]
    if args.scenario is not None:
        if given:  # the scenario's [payback] section sets the move: a flag would be silently ignored
            raise InputError(given[0], "no move options with a SCENARIO file (its [payback] section sets them)",
                             f"{given[0]} and {args.scenario}")
        return None
    missing = [flag for flag, value in (("--topology", args.topology), ("--saving-ms", args.saving_ms),
                                        ("--case", args.case)) if value is None]
    if missing:
        raise InputError(missing[0], "a value (or a SCENARIO file)", "nothing")
    section = {"saving_per_batch_ms": args.saving_ms, "alpha_us": args.alpha_us or 0.0, "cases": args.case,
               "mode": "parallel" if args.parallel else "serial", "batches": args.batches or [16, 64],
               "max_batches": args.max_batches or 64}
    if args.free_mib is not None:
        section["free_mib"] = args.free_mib
    return {"name": "command line", "model": {"preset": args.model or "Qwen3-235B-A22B"},
            "topology": {"spec": args.topology}, "payback": section}


def run(args: argparse.Namespace) -> int:
    from moe_place.cost.files import read_table_file
    from moe_place.cost.plot import render_payback_png
    from moe_place.cost.report import format_report
    from moe_place.cost.scenario import load_scenario, payback_report, scenario_from_table, with_gemm_record

    fmt, label = report_format(args.format, args.out)
    table = _command_line_scenario(args)
    given = table["payback"] if table is not None else read_table_file(args.scenario).get("payback", {})
    if args.hardware_from is not None and isinstance(given, dict) and "saving_per_batch_ms" in given:
        raise InputError("--hardware-from", "a move the cost model prices (rows_after with a [workload]), not a given "
                         "saving (--saving-ms, saving_per_batch_ms)", args.hardware_from)
    if table is None:
        scenario = load_scenario(args.scenario, args.hardware_from)
        if "payback" not in scenario.data:
            raise InputError(f"{args.scenario}: [payback]", "a payback section", "nothing")
    else:
        scenario = with_gemm_record(scenario_from_table(table, "command line"), args.hardware_from)
    result = payback_report(scenario)
    batches = list(range(result["max_batches"] + 1))
    curves = {case["name"]: [n * result["saving_per_batch_s"] - case["copy_time_s"] for n in batches]
              for case in result["cases"]}
    report = {"scenario": scenario.name, "payback": result}
    if fmt == "json":
        text = json.dumps({**report, "curve": {"batches": batches, "net_gain_s": curves}}, indent=1) + "\n"
    else:
        text = format_report(report)
    if args.plot:
        write_atomic(args.plot, render_payback_png(result))
        wrote("plot", args.plot)
    emit(text, args.out, label)
    return 0
