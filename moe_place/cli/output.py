"""Where a subcommand's result goes: stdout, or a file written atomically (said on stderr)."""

from __future__ import annotations

import sys

from moe_place.io import write_atomic


def emit(text: str, output: str | None, label: str) -> None:
    """Write `text` to the file `output` (atomically), or to stdout when `output` is None."""
    if output:
        write_atomic(output, text)
        print(f"wrote {label} {output}", file=sys.stderr)
    else:
        sys.stdout.write(text)


def wrote(what: str, path: str) -> None:
    """Tell the user (on stderr) that a file was written."""
    print(f"wrote {what} {path}", file=sys.stderr)
