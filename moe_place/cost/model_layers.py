"""Which decoder layers of each preset's served model hold experts: the index an engine keys a layer's map by.

The MoE layers follow `first_dense` dense ones (DeepSeek-V3/R1 `first_k_dense_replace` 3, Kimi-K2 1, the
others 0; every preset has `moe_layer_freq` 1 or no dense layer), and `mtp` multi-token-prediction layers,
MoE layers too, follow the decoder layers (DeepSeek-V3/R1 `num_nextn_predict_layers` 1: layer 61). Read in
TensorRT-LLM (NVIDIA/TensorRT-LLM): `tensorrt_llm/_torch/models/modeling_deepseekv3.py` (000561d) builds the
MoE for `layer_idx >= first_k_dense_replace` and `layer_idx % moe_layer_freq == 0`, its MTP layer is that
decoder layer; `tensorrt_llm/_torch/models/modeling_speculative.py` (00679c6) numbers the MTP layers from
`num_hidden_layers` (`min(max_draft_len, num_nextn_predict_layers)` of them, 1 for MTP-Eagle);
`tensorrt_llm/_torch/models/modeling_qwen3_moe.py` (03441af) makes every decoder layer MoE, `layer_idx` 0 to
`num_hidden_layers - 1`. From each model's config.json: DeepSeek-V3/R1 `first_k_dense_replace` 3,
`moe_layer_freq` 1, `num_nextn_predict_layers` 1; both Qwen3 MoE models `decoder_sparse_step` 1,
`mlp_only_layers` [] and no MTP layer.

| preset | decoder layers | dense | MoE layer ids | MTP layer ids |
| --- | --- | --- | --- | --- |
| DeepSeek-V3/R1 | 61 | 0-2 | 3-60 | 61 |
| Qwen3-235B-A22B | 94 | none | 0-93 | none |
| Qwen3-30B-A3B | 48 | none | 0-47 | none |
| Kimi-K2 | 61 | 0 | 1-60 | none |
| Mixtral-8x7B, OLMoE-1B-7B, GPT-OSS-120B | 32, 16, 36 | none | 0 to layers - 1 | none |

Kept beside `moe_place.cost.models` (whose presets the engines' records digest) rather than in it.
"""

from __future__ import annotations

from moe_place.cost.models import ExpertShape

__all__ = ["moe_layer_ids"]

# preset name: (dense decoder layers before the first MoE layer, MTP layers after the last decoder layer)
LAYOUTS = {"DeepSeek-V3": (3, 1), "Kimi-K2": (1, 0)}


def moe_layer_ids(shape: ExpertShape) -> tuple[int, ...]:
    """Decoder-layer index of every MoE layer the served model builds, MTP layers last: the
    `num_moe_layers` after the dense ones, then the MTP layers after those (module docstring)."""
    first, mtp = LAYOUTS.get(shape.name, (0, 0))
    return tuple(range(first, first + shape.num_moe_layers + mtp))
