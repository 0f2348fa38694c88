"""`moe-place` entry point: builds the subcommand parsers and turns errors into exit codes.

Each subcommand lives in `moe_place.cli.<name>` and defines
    HELP: str                              one line for `moe-place --help`
    add_arguments(parser) -> None          its options (argparse only, no heavy imports)
    run(args) -> int                       imports the library lazily, does the work
Exit codes: 0 ok, 1 a result failed a requested threshold, 2 bad input or usage.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from moe_place import __version__
from moe_place.errors import MoePlaceError

COMMANDS = ("analyze", "plan", "evaluate", "compare", "predict", "payback", "export", "replay", "synth", "bench",
            "report", "offload")


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line on stderr, exit code 2."""

    def error(self, message: str) -> None:  # noqa: D102 - argparse hook
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The `moe-place` parser. only: the subcommand the command line names - the parser then holds
    that one alone, which is all argparse needs to parse it (and what keeps a command's start short)."""
    parser = _Parser(prog="moe-place", description="MoE expert placement: analyze traces, plan replicas, predict time.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name in COMMANDS if only is None else (only,):
        module = importlib.import_module(f"moe_place.cli.{name}")
        command = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(command)
        command.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv[0] if argv and argv[0] in COMMANDS else None).parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except MoePlaceError as exc:
        print(f"moe-place {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback; files are written atomically, so none is partial
        print(f"moe-place {args.command}: interrupted", file=sys.stderr)
        return 130


def _version() -> str:
    return f"moe-place {__version__}"


if __name__ == "__main__":
    sys.exit(main())
