"""A one-line progress bar on stderr for long work: `plan fast [#####.....] 12/48 layers`."""

from __future__ import annotations

import sys
from typing import TextIO


class ProgressBar:
    """Draws `LABEL [###...] done/total UNIT` on one line, redrawn when the shown percentage changes.

    total: units of work; label: what runs; unit: what is counted (e.g. "layers", "steps").
    enabled: draw at all (default: only when the stream is a terminal, so that a log file does not
        get a line of carriage returns).
    """

    def __init__(self, total: int, label: str, unit: str, width: int = 30, stream: TextIO | None = None,
                 enabled: bool | None = None):
        self.total, self.label, self.unit, self.width = max(int(total), 0), label, unit, width
        self.stream = sys.stderr if stream is None else stream
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self.done = 0
        self._shown: int | None = None
        self._draw()

    def advance(self, count: int = 1) -> None:
        self.done = min(self.done + count, self.total)
        self._draw()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self) -> None:
        if not self.enabled:
            return
        percent = 100 * self.done // max(self.total, 1)
        if percent == self._shown and self.done < self.total:
            return
        self._shown = percent
        filled = self.width * self.done // max(self.total, 1)
        self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (self.width - filled)}] "
                          f"{self.done}/{self.total} {self.unit}")
        self.stream.flush()
