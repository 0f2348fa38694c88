"""The benches' torch threads (`torch_threads`) for the engines' own default policies, which are
`moe_place.online.engine_default` (re-exported here for the bench scripts); a record's machine and provenance are
bench/records.py's."""

from __future__ import annotations

from moe_place.online.engine_default import ENGINES, available, default_plan, version  # noqa: F401 (re-exported)


def torch_threads(threads: int) -> int:
    """Sets torch's intra-op threads for the engines' own policies (torch code) and returns the threads in force.
    The benches run them on 1: their tensors are a few thousand counts, too small to split, and a second thread only
    spin-waits, which the calling thread's CPU time counts on a busy machine."""
    import torch

    torch.set_num_threads(threads)
    return torch.get_num_threads()
