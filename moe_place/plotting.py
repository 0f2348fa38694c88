"""The one way moe-place draws: a matplotlib `Figure` on its own Agg canvas, saved to PNG bytes.

No pyplot and no `matplotlib.use`: library code must not change process-wide state (an
application embedding moe-place keeps its own backend), and the bytes go to `io.write_atomic`.
"""

from __future__ import annotations

import io
from typing import Any

__all__ = ["new_figure", "png_bytes"]


def new_figure(figsize: tuple[float, float], layout: str | None = None) -> Any:
    """A `matplotlib.figure.Figure` with an Agg canvas attached (draw on `fig.subplots(...)`)."""
    # matplotlib is imported here, not at the top: commands that draw nothing start without it
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, layout=layout)
    FigureCanvasAgg(fig)
    return fig


def png_bytes(fig: Any, dpi: int = 110) -> bytes:
    """The figure as PNG bytes."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()
