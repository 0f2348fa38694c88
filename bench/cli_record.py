"""A record of one moe-place command: what it printed as JSON, with the provenance block added.

    python bench/cli_record.py --out OUT.json [--force] -- plan traces/data/qwen3-30b-a3b_prefill_topk.npz \\
        --gpus 16 --redundant auto --format json --no-progress --out /tmp/plan16.json

Runs `moe-place ARGS` in this process (its stdout captured, its stderr shown as it comes) and writes the JSON
object it printed to OUT.json through `records.write_record` (commit, date, machine, model defaults). The
exit code is the command's; nothing is written when it fails.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from records import add_record_options, refuse_overwrite, write_record  # noqa: E402  (bench/ is not a package)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then moe-place's arguments (printing JSON)")
    add_record_options(parser)
    args = parser.parse_args(argv)
    refuse_overwrite(parser, args)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or not args.output_json:
        parser.error("expected --out OUT.json -- ARGS (a moe-place command printing JSON)")
    from moe_place.cli.main import main as moe_place   # the command recorded (not plumbing): loaded to run it

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = moe_place(command)
    if code == 0:
        write_record(args.output_json, json.loads(printed.getvalue()))
    return code


if __name__ == "__main__":
    sys.exit(main())
