"""Progress of long work on stderr: `plan fast [#####.....] 12/48 layers` on a terminal, plain lines elsewhere.

On a terminal the bar is one line, redrawn in place. Off a terminal (a log file, a pipe, CI) a line of carriage
returns would be unreadable, so the bar prints a plain line instead, `plan fast: 12/48 layers (25%) after 10 s`,
at most every `INTERVAL_S` seconds while the work advances, and a last one when it ends if it printed any: a
phase shorter than that prints nothing. The clock (monotonic) only decides when a line is printed, never what
the work computes.
"""

from __future__ import annotations

import re
import sys
import time
from typing import Callable, TextIO

__all__ = ["ProgressBar"]

INTERVAL_S = 5.0  # off a terminal: seconds between lines (often enough to show the work is alive, few in a log)
# One such line, as `ProgressBar` prints it (for readers of a log that set them apart: a terminal redraws them)
LINE = re.compile(r"[^\n]+: \d+/\d+ [^\n]+ \(\d+%\) after \d+ s(, done)?")


class ProgressBar:
    """Shows `done/total UNIT` of the work `label` on `stream` (default stderr), never on stdout.

    total: units of work; label: what runs; unit: what is counted (e.g. "layers", "steps").
    enabled: show anything at all (False: nothing; None or True: yes).
    redraw: one line redrawn in place when the shown percentage changes (default: when the stream is a
        terminal); otherwise a plain line every `interval_s` seconds (default `INTERVAL_S`) of `clock` as the
        work advances, and a last one at `close` when any was printed.
    clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(self, total: int, label: str, unit: str, width: int = 30, stream: TextIO | None = None,
                 enabled: bool | None = None, redraw: bool | None = None, interval_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.total, self.label, self.unit, self.width = max(int(total), 0), label, unit, width
        self.stream = sys.stderr if stream is None else stream
        if redraw is None:
            isatty = getattr(self.stream, "isatty", None)
            redraw = bool(isatty and isatty())
        self.enabled, self.redraw = enabled is not False, redraw
        self.interval_s, self.clock = INTERVAL_S if interval_s is None else interval_s, clock
        self.done = 0
        self._shown: int | None = None
        self._started = self._last_line = clock()
        self._lines = 0
        self._draw()

    def advance(self, count: int = 1) -> None:
        self.done = min(self.done + count, self.total)
        if not self.enabled:
            return
        if self.redraw:
            self._draw()
        elif self.clock() - self._last_line >= self.interval_s:
            self._line()

    def close(self) -> None:
        if not self.enabled:
            return
        if self.redraw:
            self.stream.write("\n")
            self.stream.flush()
        elif self._lines:
            self._line(", done")

    def _line(self, end: str = "") -> None:
        now = self.clock()
        percent = 100 * self.done // max(self.total, 1)
        self.stream.write(f"{self.label}: {self.done}/{self.total} {self.unit} ({percent}%) after "
                          f"{now - self._started:.0f} s{end}\n")
        self.stream.flush()
        self._last_line, self._lines = now, self._lines + 1

    def _draw(self) -> None:
        if not (self.enabled and self.redraw):
            return
        percent = 100 * self.done // max(self.total, 1)
        if percent == self._shown and self.done < self.total:
            return
        self._shown = percent
        filled = self.width * self.done // max(self.total, 1)
        self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (self.width - filled)}] "
                          f"{self.done}/{self.total} {self.unit}")
        self.stream.flush()
