"""`moe-place bench [SECTION] [--dry-run] [--output-json PATH]`: run the kernel microbenchmarks.

Forwards to `bench/microbench.py` of the source checkout moe-place is installed from (editable
install): the benchmarks are not part of the installed library.
"""

from __future__ import annotations

import argparse

HELP = "Kernel microbenchmarks (padding, grouped vs dense GEMM, skew, payback, dispatch): predicted vs measured."
SECTIONS = ("all", "padding", "gemm", "skew", "payback", "dispatch")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("section", nargs="?", default="all", choices=SECTIONS)
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes in the Triton interpreter on a CPU")
    parser.add_argument("--gpu", default=None, help="catalog part for predictions (default: detected)")
    parser.add_argument("--block-m", default=None, help="BLOCK_M values of the padding sweep, e.g. 16,32,64,128")
    parser.add_argument("--reps", default=None, help="timed repetitions per measurement")
    parser.add_argument("--output-json", default=None, help="write the results here (JSON)")


def run(args) -> int:
    import importlib.util
    import sys
    from pathlib import Path

    import moe_place
    from moe_place.errors import InputError

    script = Path(moe_place.__file__).resolve().parents[1] / "bench" / "microbench.py"
    if not script.exists():
        raise InputError("moe-place bench", "a source checkout with bench/microbench.py (pip install -e .)",
                         f"no {script}")
    spec = importlib.util.spec_from_file_location("moe_place_microbench", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    argv = [args.section] + (["--dry-run"] if args.dry_run else [])
    for flag, value in (("--gpu", args.gpu), ("--block-m", args.block_m), ("--reps", args.reps),
                        ("--output-json", args.output_json)):
        if value is not None:
            argv += [flag, str(value)]
    return module.main(argv)
