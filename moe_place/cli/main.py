"""`moe-place` entry point: builds the subcommand parsers and turns errors into exit codes.

Each subcommand lives in `moe_place.cli.<name>` and defines
    HELP: str                              one line for `moe-place --help`
    add_arguments(parser) -> None          its options (argparse only, no heavy imports)
    run(args) -> int                       imports the library lazily, does the work
Exit codes: 0 ok, 1 a benchmark missed its target (`bench`), 2 bad input or usage, 130 / 143
interrupted by SIGINT (Ctrl-C) / SIGTERM: one line on stderr, no traceback, no file left half
written (`moe_place.interrupts`).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from moe_place import __version__
from moe_place.errors import MoePlaceError
from moe_place.interrupts import raise_if_interrupted, signals_raise

COMMANDS = ("analyze", "plan", "evaluate", "compare", "predict", "payback", "export", "replay", "cadence", "synth",
            "bench", "report", "offload")


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
    command = argv[0] if argv and argv[0] in COMMANDS else None
    try:
        with signals_raise() as received:
            try:
                args = build_parser(command).parse_args(argv)
                code = int(args._run(args) or 0)
                raise_if_interrupted()  # the run ended although an interrupt came (something swallowed it)
                return code
            except BaseException as exc:
                code = _exit_code(exc, received.signum, command)
                if code is None:
                    raise
                return code
    except KeyboardInterrupt as exc:  # raised as the handlers were being installed or put back
        return _exit_code(exc, getattr(exc, "signum", None), command)


def _exit_code(exc: BaseException, signum: int | None, command: str | None) -> int | None:
    """The exit code for an exception that ended a subcommand, after its one line on stderr; None to let
    it propagate (argparse's SystemExit, a bug's traceback)."""
    if signum is not None or isinstance(exc, KeyboardInterrupt):  # whatever the interrupt became on its way
        if sys.stderr.isatty():  # over a progress bar's unfinished line (and the terminal's ^C)
            sys.stderr.write("\r\033[K")
        print(f"moe-place{' ' + command if command else ''}: interrupted", file=sys.stderr)
        return 128 + signum if signum is not None else 130
    if isinstance(exc, MoePlaceError):
        print(f"moe-place {command}: error: {exc}", file=sys.stderr)
        return 2
    if isinstance(exc, BrokenPipeError):
        return 0
    return None


def _version() -> str:
    return f"moe-place {__version__}"


if __name__ == "__main__":
    sys.exit(main())
