"""Out-of-sample loss: a placement planned on one window, judged on the next.

Engines plan on the loads of the last window and run the plan on the next one. When hot
experts move, the plan loses part of its gain. For each transition `w -> w+1` this module
compares, on window `w+1`'s loads:
- `contiguous`: no planning at all (the engines' default layout);
- `out_of_sample`: the plan made on window `w` (what an engine actually runs);
- `in_sample`: the plan made on window `w+1` itself (what the same planner gets with hindsight).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from moe_place.analysis.profile import max_over_mean
from moe_place.analysis.replicate_hottest import replicate_hottest_phy2log
from moe_place.errors import InputError
from moe_place.placement import Placement, even_split_gpu_loads

__all__ = ["OutOfSample", "out_of_sample"]

Planner = Callable[[np.ndarray], Placement]
"""Loads `[layers, E]` -> a placement of every layer."""


@dataclass(frozen=True)
class OutOfSample:
    """Busiest/mean GPU (s_expert) on window `w+1`, float64 `[windows-1, layers]` each.

    ep_size: GPUs of the plans. planner: a name for the planner used.
    """

    ep_size: int
    planner: str
    contiguous: np.ndarray
    out_of_sample: np.ndarray
    in_sample: np.ndarray

    def __post_init__(self) -> None:
        shape = self.contiguous.shape
        if len(shape) != 2 or self.out_of_sample.shape != shape or self.in_sample.shape != shape:
            raise InputError("OutOfSample", "three arrays of one shape [transitions, layers]")

    @property
    def loss(self) -> np.ndarray:
        """float64 `[windows-1, layers]`: how much busier the busiest GPU is than with hindsight
        (`out_of_sample / in_sample - 1`; 0 = the plan lost nothing)."""
        return self.out_of_sample / self.in_sample - 1.0


def out_of_sample(window_load: np.ndarray, ep_size: int, planner: Planner | None = None,
                  planner_name: str = "replicate_hottest") -> OutOfSample:
    """Judge plans made on each window on the next one.

    window_load: `[windows, layers, E]`, at least two windows.
    planner: loads `[rows, E]` -> a placement of `rows` independent layers on `ep_size` GPUs; it
        is called once with every window's layers stacked (`rows = windows * layers`). Default
        `replicate_hottest(loads, ep_size, redundant_per_gpu=1)`.
    """
    loads = np.asarray(window_load, dtype=np.float64)
    if loads.ndim != 3 or loads.shape[0] < 2:
        raise InputError("window_load", "at least two windows [windows, layers, experts]", f"shape {loads.shape}")
    windows, layers, experts = loads.shape
    if experts % ep_size:
        raise InputError("ep_size", f"a divisor of the {experts} experts", ep_size)
    stacked = loads.reshape(windows * layers, experts)
    if planner is None:
        phy2log = replicate_hottest_phy2log(stacked, ep_size, redundant_per_gpu=1)
    else:
        placement = planner(stacked)
        if placement.num_gpus != ep_size or placement.num_layers != windows * layers:
            raise InputError("planner", f"a placement of {windows * layers} layers on {ep_size} GPUs")
        phy2log = placement.phy2log
    # row w*layers + l is layer l's plan made on window w; judged on window w (in sample) and w+1
    next_loads = np.concatenate([loads[1:], loads[-1:]]).reshape(windows * layers, experts)

    def judged(judged_loads: np.ndarray) -> np.ndarray:
        return max_over_mean(even_split_gpu_loads(phy2log, judged_loads, ep_size)).reshape(windows, layers)

    # contiguous blocks: GPU g sums experts g*E/G .. (g+1)*E/G - 1 (what Placement.contiguous gives)
    contiguous = max_over_mean(loads.reshape(windows, layers, ep_size, -1).sum(axis=-1))
    return OutOfSample(ep_size=ep_size, planner=planner_name, contiguous=contiguous[1:],
                       out_of_sample=judged(next_loads)[:-1], in_sample=judged(stacked)[1:])
