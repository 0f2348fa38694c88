"""The real routing data shipped in `traces/data/` (see its PROVENANCE.md).

The files hold bare arrays without metadata; the metadata below comes from PROVENANCE.md.
Each file's keys are separate recordings (Qwen3) or text domains (OLMoE, Mixtral): read as
the steps of one trace, in the order given here. A bundled file is recognised by its content
(its size, then its sha256), whatever its name: a renamed copy is the same recording.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from moe_place.errors import InputError
from moe_place.io import file_sha256
from moe_place.traces.model import Trace, TraceMeta

__all__ = ["BundledTrace", "bundled_info", "bundled_path", "data_dir", "load_bundled"]


@dataclass(frozen=True)
class BundledTrace:
    file: str
    size: int     # bytes of the file, and
    sha256: str   # their digest: what recognises the file under any name
    model: str
    num_experts: int
    top_k: int
    layer_ids: tuple[int, ...]
    steps: tuple[str, ...]
    token_level: bool


BUNDLED = {
    b.file: b
    for b in (
        BundledTrace("qwen3-30b-a3b_prefill_topk.npz", 2386522,
                     "2d020ef3302052f34f7e262faa2117807ad6345adcab7c0bb86eb6bb00166f41", "Qwen/Qwen3-30B-A3B-Instruct-2507", 128, 8,
                     tuple(range(48)), ("ep_states", "token_distri_8", "token_distri_16"), True),
        BundledTrace("olmoe-1b-7b_expert_counts_L0_L7_L15.npz", 10690,
                     "4d5633987ad5f87df621faa2f138e6df96bff06f441ebbe7f312c8684813f036", "allenai/OLMoE-1B-7B-0924", 64, 8,
                     (0, 7, 15), ("arxiv", "book", "c4", "github", "tulu", "wikipedia"), False),
        BundledTrace("mixtral-8x7b_expert_counts_L0_L7_L15.npz", 2194,
                     "f91118f553588c89f980a34aac4f181a11d7def5783f17ca80cdf148811cb289", "mistralai/Mixtral-8x7B-v0.1", 8, 2,
                     (0, 7, 15), ("arxiv", "book", "c4", "github", "wikipedia"), False),
    )
}


def data_dir() -> Path:
    """The folder of the bundled traces inside the installed package."""
    return Path(str(resources.files("moe_place.traces") / "data"))


def bundled_path(name: str) -> Path:
    """Path of a bundled trace by file name (e.g. `qwen3-30b-a3b_prefill_topk.npz`)."""
    if name not in BUNDLED:
        raise InputError("bundled trace", f"one of {sorted(BUNDLED)}", name)
    return data_dir() / name


def bundled_info(path: str | Path) -> BundledTrace | None:
    """The bundled trace whose bytes the file at `path` holds, under any name; None for any other
    file (only a file of a bundled file's size is hashed)."""
    try:
        size = Path(path).stat().st_size
    except OSError:
        return None
    same_size = [b for b in BUNDLED.values() if b.size == size]
    if not same_size:
        return None
    digest = file_sha256(path)
    return next((b for b in same_size if b.sha256 == digest), None)


def load_bundled(path: str | Path, info: BundledTrace) -> Trace:
    """Load the file at `path` holding the bundled trace `info` (`bundled_info(path)`)."""
    path = Path(path)
    with np.load(path, allow_pickle=False) as npz:
        missing = [k for k in info.steps if k not in npz.files]
        if missing:
            raise InputError(str(path), f"arrays {list(info.steps)}", f"missing {missing}")
        arrays = [npz[k] for k in info.steps]
    meta = TraceMeta(num_experts=info.num_experts, top_k=info.top_k, layer_ids=info.layer_ids,
                     model=info.model, source=f"bundled:{info.file}", dtype=str(arrays[0].dtype),
                     step_names=info.steps)
    if info.token_level:
        return Trace(meta, topk_ids=tuple(arrays))
    return Trace(meta, counts=np.stack(arrays))
