"""The cores this process may use, and the one rule for every count of workers a user sets.

`--jobs` (worker processes) and `$MOE_PLACE_THREADS` (threads counting a trace) take 1 up to the
usable cores: more only wait for each other and cost memory, so a larger count is refused with one
line naming it, whichever way it was given.
"""

from __future__ import annotations

import os

__all__ = ["parse_workers", "usable_cores", "workers_expected"]


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else (os.cpu_count() or 1)


def workers_expected() -> str:
    """What a worker count must be, for an error's `expected`: "an integer in [1, 2] (...)"."""
    return f"an integer in [1, {usable_cores()}] (the cores this process may use)"


def parse_workers(text: str) -> int | None:
    """The worker count in `text` if it is an integer in [1, usable cores], else None (the caller's
    error then names its option or variable with `workers_expected()`)."""
    try:
        value = int(text)
    except ValueError:
        return None
    return value if 1 <= value <= usable_cores() else None
