"""sglang-kt (KTransformers) adapter: its GPU-expert rules (reimplemented, to judge plans against, in
`moe_place.solvers.offload_rules`), and a stats file that makes its own `frequency` rule pick a planned set.

What sglang-kt 0.7.2 does (`sglang/srt/layers/moe/kt_ep_wrapper.py`, `_init_kt_gpu_experts_masks`;
`server_args.py`), read from its published wheel:
- the GPU's expert count in all: `--kt-gpu-experts-ratio r` gives `int(L_moe * E * r)`, else
  `--kt-num-gpu-experts N` gives `N * L_moe` (`L_moe` MoE layers, `E` experts each);
- `--kt-expert-placement-strategy` (default `uniform`): `uniform` gives every MoE layer
  `total // L_moe` experts, the first `total % L_moe` layers one more, each layer's experts
  `0..n-1`; `front-loading` fills layers from the first MoE layer, experts `0..n-1` of each;
  `random` draws `total` (layer, expert) pairs with `torch.randperm` (seed 42); `frequency` loads
  `--init-expert-location FILE.pt` (a dict with `logical_count`, or a bare tensor) of shape
  `[buffer, num_hidden_layers, E]`, sums dim 0 and calls kt-kernel's
  `generate_gpu_experts_masks(activation_freq, total)` (`kt_kernel/experts_base.py`): one
  `torch.topk` over all layers' flattened counts, so the `total` largest counts win, and among
  equal counts the pick is torch's (unspecified). Dense layers' rows are then set all-GPU.
- `--kt-gpu-prefill-token-threshold T`: a batch of `T` tokens or more runs each MoE layer on the GPU
  after copying its CPU experts there (`num_tokens >= threshold`); the docs ask for one MoE layer of
  extra GPU memory for it. `--kt-enable-dynamic-expert-update`: after such a pass a layer's GPU set
  becomes the batch's most frequent experts (`select_top_experts_from_batch`, same count).

The stats file we write (`planned_stats`) makes the planned set a *strict* top-k: every planned
expert's count is larger than every other count (the trace's counts, rescaled below 2^22 so that
float32 holds them exactly, plus 2^22 + 1 for the planned ones), so any top-k, whatever its tie
rule, returns exactly the planned set; a larger total would add the most frequent others.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from moe_place.errors import InputError
from moe_place.io import write_atomic

__all__ = ["gpu_experts_ratio", "launch_flags", "planned_stats", "write_stats"]

LOGICAL_COUNT_KEY = "logical_count"
PLANNED_OFFSET = 2**22 + 1             # planned experts' counts start here (float32-exact below 2^24)
COUNT_SCALE_MAX = 2**22                # the trace's counts are rescaled to at most this


def planned_stats(resident, counts, layer_ids: tuple[int, ...], num_model_layers: int | None = None) -> np.ndarray:
    """int32 `[1, num_model_layers, E]`: a `logical_count` whose global top-`resident.sum()` is exactly
    `resident` (see the module note). resident bool `[L, E]`; counts `[L, E]` (the trace's, >= 0);
    layer_ids: the model layer of each row; rows of other model layers (dense ones) stay zero."""
    on_gpu = np.asarray(resident, dtype=bool)
    counts = np.asarray(counts, dtype=np.float64)
    if on_gpu.shape != counts.shape or on_gpu.ndim != 2:
        raise InputError("resident / counts", "two [layers, experts] arrays of one shape", (on_gpu.shape, counts.shape))
    ids = [int(i) for i in layer_ids]
    if len(ids) != on_gpu.shape[0] or len(set(ids)) != len(ids) or min(ids) < 0:
        raise InputError("layer ids", f"{on_gpu.shape[0]} distinct ids >= 0", ids)
    total_layers = max(ids) + 1 if num_model_layers is None else int(num_model_layers)
    if total_layers <= max(ids):
        raise InputError("--num-model-layers", f"more than the highest MoE layer id {max(ids)}", total_layers)
    if (counts < 0).any() or not np.isfinite(counts).all():
        raise InputError("counts", "finite counts >= 0")
    scale = COUNT_SCALE_MAX / counts.max() if counts.max() > COUNT_SCALE_MAX else 1.0
    values = np.floor(counts * scale).astype(np.int64) + np.where(on_gpu, PLANNED_OFFSET, 0)
    out = np.zeros((1, total_layers, on_gpu.shape[1]), dtype=np.int32)
    out[0, ids] = values
    return out


def gpu_experts_ratio(total: int, num_moe_layers: int, num_experts: int) -> str:
    """A `--kt-gpu-experts-ratio` value `r` (as text) with `int(num_moe_layers * num_experts * r) == total`
    in Python floats, as sglang-kt computes it: the middle of the interval, shortest text that works."""
    all_experts = num_moe_layers * num_experts
    if not 0 < total <= all_experts:
        raise InputError("GPU experts", f"in [1, {all_experts}]", total)
    for digits in range(1, 18):
        text = f"{(total + 0.5) / all_experts:.{digits}g}"
        if int(all_experts * float(text)) == total:
            return text
    raise AssertionError(total)  # 17 significant digits always round-trip


def launch_flags(total: int, num_moe_layers: int, num_experts: int, stats_path: str | None,
                 prefill_threshold: int | None = None) -> list[str]:
    """sglang-kt flags that load the planned set: `frequency` over our stats file, and the count
    (`--kt-num-gpu-experts` when every layer gets the same, else the ratio)."""
    flags = ["--kt-expert-placement-strategy", "frequency", "--init-expert-location", stats_path or "STATS.pt"]
    if total % num_moe_layers == 0:
        flags += ["--kt-num-gpu-experts", str(total // num_moe_layers)]
    else:
        flags += ["--kt-gpu-experts-ratio", gpu_experts_ratio(total, num_moe_layers, num_experts)]
    if prefill_threshold is not None:
        flags += ["--kt-gpu-prefill-token-threshold", str(prefill_threshold)]
    return flags


def write_stats(path: str | Path, logical_count: np.ndarray) -> None:
    """`{"logical_count": int32 tensor}` with torch.save, atomically (`.pt`, as sglang-kt reads it)."""
    path = Path(path)
    if path.suffix != ".pt":
        raise InputError(str(path), "a file name ending in .pt (sglang-kt loads it with torch.load)",
                         path.suffix or "no suffix")
    import torch  # optional dependency: only writing this file needs it

    buffer = io.BytesIO()
    torch.save({LOGICAL_COUNT_KEY: torch.from_numpy(np.ascontiguousarray(logical_count, dtype=np.int32))}, buffer)
    write_atomic(path, buffer.getvalue())

