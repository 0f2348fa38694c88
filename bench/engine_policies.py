"""The benches' machine facts (`machine`, `torch_threads`) and what every record says of its run (`provenance`);
the engines' own default policies are `moe_place.online.engine_default` (re-exported here for the bench scripts).
"""

from __future__ import annotations

import datetime
import inspect
import os
import platform
import subprocess
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


def provenance() -> dict:
    """What a record says of its run: this checkout's commit (None where git cannot say) and whether files differed
    from it, the UTC date, the machine (`machine`) and the layer-time model's defaults (`moe_place.cost.cluster`'s
    cluster and expert time, dispatch and combine as each step's expected DeepEP rows)."""
    from moe_place.cost.cluster import DEFAULT_BLOCK_M, cluster_cost
    from moe_place.cost.gemm import DEFAULT_WEIGHTS

    cluster = {name: p.default for name, p in inspect.signature(cluster_cost).parameters.items()
               if name in ("hardware", "nic_gbit_per_s", "model")}
    return {"commit": _git("rev-parse", "HEAD"), "uncommitted_changes": bool(_git("status", "--porcelain")),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
            "model_defaults": {"expert_time": DEFAULT_WEIGHTS, "block_m": DEFAULT_BLOCK_M, **cluster,
                               "dispatch_combine": "deepep, each step's expected rows"}}


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None
