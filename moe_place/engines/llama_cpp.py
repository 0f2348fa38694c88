"""llama.cpp adapter: which layers' experts stay on the CPU, as `--n-cpu-moe N` or `-ot` patterns.

llama.cpp keeps a layer's routed experts in one tensor per projection (`blk.N.ffn_gate_exps`,
`ffn_up_exps`, `ffn_down_exps`, or a fused `ffn_gate_up_exps`), so a placement is per layer, not per
expert. `-ot` / `--override-tensor "REGEX=CPU"` keeps the tensors whose names the regex finds on the
CPU; `--n-cpu-moe N` adds one such override per block `0..N-1`, with the pattern of
`llm_ffn_exps_block_regex(i)` in `common/common.h`: `blk\\.{i}\\.ffn_(up|down|gate|gate_up)_(ch|)exps`.
Block numbers are the model's layer ids (dense blocks included: DeepSeek-V3's blocks 0-2 have no
routed experts, so `--n-cpu-moe 3` moves none). With `-ngl 999` everything else is on the GPU.
"""

from __future__ import annotations

import numpy as np

from moe_place.errors import InputError
from moe_place.solvers.offload_rules import n_cpu_moe_for

__all__ = ["launch_flags", "override_tensor_pattern"]

EXPERT_TENSORS = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"   # llama.cpp's LLM_FFN_EXPS_REGEX


def override_tensor_pattern(cpu_layer_ids) -> str | None:
    """`-ot` value keeping the experts of the given blocks on the CPU (None when there are none)."""
    ids = sorted({int(i) for i in cpu_layer_ids})
    if not ids:
        return None
    blocks = str(ids[0]) if len(ids) == 1 else "(" + "|".join(map(str, ids)) + ")"
    return rf"blk\.{blocks}{EXPERT_TENSORS}=CPU"


def launch_flags(resident, layer_ids: tuple[int, ...]) -> list[str]:
    """llama.cpp flags for a whole-layer placement (bool `[L, E]`, each row all True or all False):
    `--n-cpu-moe N` when the CPU layers are the first ones, else one `-ot` pattern."""
    on_gpu = np.asarray(resident, dtype=bool)
    whole = on_gpu.all(axis=1) | ~on_gpu.any(axis=1)
    if not whole.all():
        raise InputError("llama.cpp placement", "whole layers on the GPU or the CPU",
                         f"layer {layer_ids[int(np.argmin(whole))]} is split")
    cpu_ids = [int(i) for i, gpu in zip(layer_ids, on_gpu.all(axis=1)) if not gpu]
    flags = ["-ngl", "999"]
    if not cpu_ids:
        return flags
    first_n = n_cpu_moe_for(layer_ids, len(layer_ids) - len(cpu_ids))
    if all(i < first_n for i in cpu_ids) and all(i >= first_n for i in layer_ids if i not in cpu_ids):
        return flags + ["--n-cpu-moe", str(first_n)]
    return flags + ["-ot", override_tensor_pattern(cpu_ids)]
