"""Option parsers shared by subcommands: each rejects a bad value with one clear line."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text!r}")
    return value


def int_list(text: str) -> list[int]:
    """A comma-separated list of positive integers, e.g. `8,16,32`."""
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return [positive_int(p) for p in parts]


def layer_selection(text: str) -> list[int]:
    """Layers as `0,5,7` or ranges `0-3,10` (inclusive), each >= 0."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if lo < 0 or hi < lo:
                    raise ValueError
                out.extend(range(lo, hi + 1))
            else:
                value = int(part)
                if value < 0:
                    raise ValueError
                out.append(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected layers like 0,5,7 or 0-3, got {text!r}") from None
    return sorted(set(out))
