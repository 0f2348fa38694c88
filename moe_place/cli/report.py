"""`moe-place report RESULTS.json... [--out DIR]`: markdown + PNG plots from microbenchmark results
(rendered by `moe_place.kernels.report`), written to `DIR/report.md` and `DIR/*.png`."""

from __future__ import annotations

import argparse
from pathlib import Path

from moe_place.cli.options import output_dir
from moe_place.io import write_atomic

HELP = "Markdown report and PNG plots from microbenchmark result JSONs (predicted vs measured)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results", nargs="+",
                        help="result JSON files of `moe-place bench --out FILE.json` (or bash bench/gpu_check.sh)")
    parser.add_argument("--out", type=output_dir, default="report",
                        help="folder for report.md and the PNGs, created if missing (default: ./report)")
    parser.add_argument("--no-plots", action="store_true", help="markdown only")


def run(args) -> int:
    from moe_place.kernels.report import load_result, render_report

    results = [(Path(p), load_result(p)) for p in args.results]
    out = Path(args.out)
    text = render_report(results, out, plots=not args.no_plots)
    write_atomic(out / "report.md", text)
    print(text)
    return 0
