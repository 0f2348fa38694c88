"""The benches' machine facts (`machine`, `torch_threads`); the engines' own default policies are
`moe_place.online.engine_default` (re-exported here for the bench scripts).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

from moe_place.online.engine_default import ENGINES, available, default_plan, version  # noqa: F401 (re-exported)


def torch_threads(threads: int) -> int:
    """Sets torch's intra-op threads for the engines' own policies (torch code) and returns the threads in force.
    The benches run them on 1: their tensors are a few thousand counts, too small to split, and a second thread only
    spin-waits, which the calling thread's CPU time counts on a busy machine."""
    import torch

    torch.set_num_threads(threads)
    return torch.get_num_threads()


def machine() -> dict:
    """The CPU a record's times were measured on (policies' CPU times per call, and their ratio, differ
    between machines): its model as /proc/cpuinfo names it (else `platform`'s), its cores, and whether it
    has AVX-512."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return {"cpu": fields.get("model name") or platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "avx512": "avx512f" in fields.get("flags", "").split()}
