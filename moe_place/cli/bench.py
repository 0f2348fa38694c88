"""`moe-place bench [SECTION] [--dry-run] [--out PATH]`: run the kernel microbenchmarks.

Forwards to `bench/microbench.py` of the source checkout moe-place is installed from (editable
install): the benchmarks are not part of the installed library.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import moe_place
from moe_place.cli.options import add_out_argument, int_list, json_file, positive_int
from moe_place.cost.hardware import BUILTIN_PARTS
from moe_place.errors import InputError
from moe_place.kernels.report import SECTIONS as MICROBENCH_SECTIONS

HELP = "Kernel microbenchmarks (padding, grouped vs dense GEMM, skew, payback, dispatch): predicted vs measured."
SECTIONS = ("all",) + MICROBENCH_SECTIONS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("section", nargs="?", default="all", choices=SECTIONS,
                        help=f"which microbenchmark: {', '.join(SECTIONS)} (default all)")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes in the Triton interpreter on a CPU")
    parser.add_argument("--gpu", default=None,
                        help=f"catalog part for predictions: one of {', '.join(BUILTIN_PARTS['gpu'])} "
                             "(default: detected, else H100 SXM)")
    parser.add_argument("--block-m", type=int_list, default=None, metavar="M1,M2,...",
                        help="BLOCK_M values of the padding sweep, e.g. 16,32,64,128 (default: 16,32,64,128 on a GPU)")
    parser.add_argument("--reps", type=positive_int, default=None, metavar="N",
                        help="timed repetitions per measurement (default 10 on a GPU, 2 in a dry run)")
    add_out_argument(parser, json_file, "FILE.json", "write the results as JSON to FILE; an existing file is kept "
                     "unless --force", aliases=("--output-json",), default_text="print only")
    parser.add_argument("--force", action="store_true", help="overwrite an existing --out file")


def run(args) -> int:
    script = Path(moe_place.__file__).resolve().parents[1] / "bench" / "microbench.py"
    if not script.exists():
        raise InputError("moe-place bench", "a source checkout with bench/microbench.py (pip install -e .)",
                         f"no {script}")
    spec = importlib.util.spec_from_file_location("moe_place_microbench", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    argv = [args.section] + (["--dry-run"] if args.dry_run else []) + (["--force"] if args.force else [])
    for flag, value in (("--gpu", args.gpu), ("--block-m", args.block_m), ("--reps", args.reps),
                        ("--out", args.out)):
        if value is not None:
            argv += [flag, ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    return module.main(argv)
