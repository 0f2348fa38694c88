"""Expert shapes of common MoE models (one routed expert of one layer).

An expert is a gated MLP: `matrices` weight matrices of `hidden x intermediate` each (gate, up,
down = 3). `P_e = matrices * hidden * intermediate` parameters; `W_e = P_e * dtype_bytes` bytes.
Figures from each model's published `config.json`:

| preset | hidden | intermediate | experts | top-k | MoE layers | dtype | W_e |
| --- | --- | --- | --- | --- | --- | --- | --- |
| DeepSeek-V3/R1 | 7168 | 2048 | 256 | 8 | 58 of 61 (first 3 dense) | FP8 (1 B) | 42 MiB |
| Qwen3-235B-A22B | 4096 | 1536 | 128 | 8 | 94 | BF16 | 36 MiB |
| Qwen3-30B-A3B | 2048 | 768 | 128 | 8 | 48 | BF16 | 9 MiB |
| Mixtral-8x7B | 4096 | 14336 | 8 | 2 | 32 | BF16 | 336 MiB |
| OLMoE-1B-7B | 2048 | 1024 | 64 | 8 | 16 | BF16 | 12 MiB |
| GPT-OSS-120B | 2880 | 2880 | 128 | 4 | 36 | MXFP4 (4.25 bit incl. scales) | ~12.6 MiB |
| Kimi-K2 | 7168 | 2048 | 384 | 8 | 60 of 61 (first 1 dense) | FP8 (1 B) | 42 MiB |

Each preset also knows what one token's KV cache takes (`kv_cache`, `kv_bytes_per_token`), from
the same `config.json`: every transformer layer (dense ones included) caches per token either
`2 * num_key_value_heads * head_dim` elements (K and V, grouped-query attention) or, with MLA
(DeepSeek-V3, Kimi-K2), the compressed latent `kv_lora_rank + qk_rope_head_dim` (512 + 64) shared
by all heads. Elements are BF16, the engines' default KV-cache dtype (`auto`: the activations'
dtype, also for the FP8 checkpoints); an FP8 KV cache halves the bytes.

| preset | layers | cached per layer | KV bytes per token |
| --- | --- | --- | --- |
| DeepSeek-V3/R1 | 61 | MLA 512 + 64 | 70,272 |
| Qwen3-235B-A22B | 94 | 2 x 4 KV heads x 128 | 192,512 |
| Qwen3-30B-A3B | 48 | 2 x 4 KV heads x 128 | 98,304 |
| Mixtral-8x7B | 32 | 2 x 8 KV heads x 128 | 131,072 |
| OLMoE-1B-7B | 16 | 2 x 16 KV heads x 128 | 131,072 |
| GPT-OSS-120B | 36 | 2 x 8 KV heads x 64 | 73,728 |
| Kimi-K2 | 61 | MLA 512 + 64 | 70,272 |
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from moe_place.cost.files import get_number
from moe_place.cost.units import BYTES_PER_DTYPE
from moe_place.errors import InputError, check_keys

__all__ = ["ExpertShape", "KVCacheShape", "get_model", "infer_model_name", "model_from_table"]


@dataclass(frozen=True)
class KVCacheShape:
    """What one token's KV cache holds in a model (see the module docstring).

    layers: attention layers, every transformer layer of the model (dense ones included).
    elements_per_layer: cached elements per token and layer: `2 * kv_heads * head_dim` (K and V)
        for grouped-query attention, `kv_lora_rank + rope_dim` for MLA's shared latent.
    dtype_bytes: bytes per cached element (2: BF16).
    """

    layers: int
    elements_per_layer: int
    dtype_bytes: float = 2.0

    def __post_init__(self) -> None:
        for key in ("layers", "elements_per_layer"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"kv_cache.{key}", "an integer >= 1", value)
        if not self.dtype_bytes > 0:
            raise InputError("kv_cache.dtype_bytes", "a number > 0", self.dtype_bytes)

    @classmethod
    def grouped_query(cls, layers: int, kv_heads: int, head_dim: int, dtype_bytes: float = 2.0) -> "KVCacheShape":
        """K and V of `kv_heads` heads of `head_dim` per layer."""
        return cls(layers, 2 * kv_heads * head_dim, dtype_bytes)

    @classmethod
    def latent(cls, layers: int, kv_lora_rank: int, rope_dim: int, dtype_bytes: float = 2.0) -> "KVCacheShape":
        """MLA: one compressed latent of `kv_lora_rank` plus the decoupled RoPE key of `rope_dim` per layer."""
        return cls(layers, kv_lora_rank + rope_dim, dtype_bytes)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token's KV cache takes over all layers (rounded up to whole bytes)."""
        return math.ceil(self.layers * self.elements_per_layer * self.dtype_bytes)


@dataclass(frozen=True)
class ExpertShape:
    """One model's routed-expert shape and MoE layout.

    dtype_bytes: bytes per weight element (may be fractional: MXFP4 is 4.25/8).
    activation_bytes: bytes per activation element (BF16 = 2), used for dispatched rows.
    kv_cache: what one token's KV cache holds (None: not known, e.g. a custom shape).
    """

    name: str
    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    num_moe_layers: int
    matrices: int = 3
    dtype_bytes: float = BYTES_PER_DTYPE["bf16"]
    activation_bytes: float = BYTES_PER_DTYPE["bf16"]
    kv_cache: KVCacheShape | None = None

    def __post_init__(self) -> None:
        for key in ("hidden", "intermediate", "num_experts", "top_k", "num_moe_layers", "matrices"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"model {self.name}.{key}", "an integer >= 1", value)
        if self.top_k > self.num_experts:
            raise InputError(f"model {self.name}.top_k", f"at most num_experts={self.num_experts}", self.top_k)
        for key in ("dtype_bytes", "activation_bytes"):
            if not getattr(self, key) > 0:
                raise InputError(f"model {self.name}.{key}", "a number > 0", getattr(self, key))

    @property
    def params_per_expert(self) -> int:
        """`P_e`: weights of one expert."""
        return self.matrices * self.hidden * self.intermediate

    @property
    def expert_bytes(self) -> int:
        """`W_e`: bytes of one expert's weights (rounded up to whole bytes)."""
        return math.ceil(self.params_per_expert * self.dtype_bytes)

    @property
    def row_bytes(self) -> int:
        """Bytes of one dispatched activation row (`hidden * activation_bytes`)."""
        return math.ceil(self.hidden * self.activation_bytes)

    @property
    def kv_bytes_per_token(self) -> int | None:
        """Bytes of one token's KV cache over all layers, or None when the preset does not know it."""
        return None if self.kv_cache is None else self.kv_cache.bytes_per_token

    def flops_per_row(self) -> int:
        """`F_e(1) = 2 * P_e`: FLOPs of one (token, expert) dispatch."""
        return 2 * self.params_per_expert


# KV caches from each model's config.json (the keys named; BF16 elements, see the module docstring):
# DeepSeek-V3/R1: num_hidden_layers 61, kv_lora_rank 512, qk_rope_head_dim 64 (MLA).
# Qwen3-235B-A22B: num_hidden_layers 94, num_key_value_heads 4, head_dim 128.
# Qwen3-30B-A3B: num_hidden_layers 48, num_key_value_heads 4, head_dim 128.
# Mixtral-8x7B-v0.1: num_hidden_layers 32, num_key_value_heads 8, head_dim 4096 / 32 heads = 128.
# OLMoE-1B-7B: num_hidden_layers 16, num_key_value_heads 16, head_dim 2048 / 16 heads = 128.
# GPT-OSS-120B: num_hidden_layers 36, num_key_value_heads 8, head_dim 64. Its even layers use a 128-token
#   sliding window: an engine that keeps only the window there stores half of this per token of a long
#   sequence; counted here as full layers (the bytes a token can take, so the tokens held are not overstated).
# Kimi-K2 (moonshotai/Kimi-K2-Instruct): num_hidden_layers 61, first_k_dense_replace 1, n_routed_experts 384,
#   moe_intermediate_size 2048, hidden_size 7168, num_experts_per_tok 8, FP8 weights; kv_lora_rank 512,
#   qk_rope_head_dim 64 (MLA, DeepSeek-V3's attention).
DEFAULT_MODEL = "Qwen3-30B-A3B"   # the bundled traces' model: where neither the user, the trace nor the engine says
PRESETS: dict[str, ExpertShape] = {
    s.name: s for s in (
        ExpertShape("DeepSeek-V3", 7168, 2048, 256, 8, 58, dtype_bytes=1.0,
                    kv_cache=KVCacheShape.latent(61, kv_lora_rank=512, rope_dim=64)),
        ExpertShape("Qwen3-235B-A22B", 4096, 1536, 128, 8, 94,
                    kv_cache=KVCacheShape.grouped_query(94, kv_heads=4, head_dim=128)),
        ExpertShape("Qwen3-30B-A3B", 2048, 768, 128, 8, 48,
                    kv_cache=KVCacheShape.grouped_query(48, kv_heads=4, head_dim=128)),
        ExpertShape("Mixtral-8x7B", 4096, 14336, 8, 2, 32,
                    kv_cache=KVCacheShape.grouped_query(32, kv_heads=8, head_dim=128)),
        ExpertShape("OLMoE-1B-7B", 2048, 1024, 64, 8, 16,
                    kv_cache=KVCacheShape.grouped_query(16, kv_heads=16, head_dim=128)),
        ExpertShape("GPT-OSS-120B", 2880, 2880, 128, 4, 36, dtype_bytes=BYTES_PER_DTYPE["mxfp4"],
                    kv_cache=KVCacheShape.grouped_query(36, kv_heads=8, head_dim=64)),
        ExpertShape("Kimi-K2", 7168, 2048, 384, 8, 60, dtype_bytes=1.0,
                    kv_cache=KVCacheShape.latent(61, kv_lora_rank=512, rope_dim=64)),
    )
}
ALIASES = {"deepseek-r1": "DeepSeek-V3", "deepseek-v3/r1": "DeepSeek-V3", "qwen3-235b": "Qwen3-235B-A22B",
           "qwen3-30b": "Qwen3-30B-A3B", "mixtral": "Mixtral-8x7B", "olmoe": "OLMoE-1B-7B",
           "gpt-oss": "GPT-OSS-120B"}


def _key(name: str) -> str:
    return re.sub(r"[\s_]+", "-", str(name).strip().lower())


def get_model(name: str) -> ExpertShape:
    """A preset by name (case-insensitive); unknown names list the known ones."""
    wanted = _key(name)
    for preset in PRESETS.values():
        if _key(preset.name) == wanted:
            return preset
    if wanted in ALIASES:
        return PRESETS[ALIASES[wanted]]
    raise InputError("model preset", f"one of {', '.join(PRESETS)}", repr(name))


def infer_model_name(trace_model: str) -> str | None:
    """The preset a trace's model name names (e.g. 'Qwen/Qwen3-30B-A3B-Instruct-2507' ->
    'Qwen3-30B-A3B', 'deepseek-ai/DeepSeek-R1' -> 'DeepSeek-V3'), or None."""
    key = _key(trace_model)
    for name in PRESETS:
        if name.lower() in key:
            return name
    for alias, name in ALIASES.items():
        if alias in key:
            return name
    return None


def model_from_table(table: dict, where: str = "model") -> ExpertShape:
    """A preset (`preset = "..."`) with optional overrides, or a full custom shape.

    Keys: preset, name, hidden, intermediate, num_experts, top_k, num_moe_layers, matrices,
    dtype (bf16|fp8|mxfp4|...) or dtype_bytes, activation_dtype or activation_bytes.
    """
    known = {"preset", "name", "hidden", "intermediate", "num_experts", "top_k", "num_moe_layers", "matrices",
             "dtype", "dtype_bytes", "activation_dtype", "activation_bytes"}
    check_keys(table, known, where)
    base = get_model(table["preset"]).__dict__ if "preset" in table else {"name": table.get("name", "custom")}
    fields = dict(base)
    for key in ("hidden", "intermediate", "num_experts", "top_k", "num_moe_layers", "matrices"):
        if key in table:
            fields[key] = table[key]
    for key, dtype_key in (("dtype_bytes", "dtype"), ("activation_bytes", "activation_dtype")):
        if dtype_key in table:
            dtype = str(table[dtype_key]).lower()
            if dtype not in BYTES_PER_DTYPE:
                raise InputError(f"{where}.{dtype_key}", f"one of {list(BYTES_PER_DTYPE)}", repr(table[dtype_key]))
            fields[key] = BYTES_PER_DTYPE[dtype]
        if key in table:
            fields[key] = get_number(table, key, where)
    if "name" in table:
        fields["name"] = str(table["name"])
    missing = [k for k in ("hidden", "intermediate", "num_experts", "top_k", "num_moe_layers") if k not in fields]
    if missing:
        raise InputError(f"{where}.{missing[0]}", "an integer (or a preset = \"...\")", "nothing")
    return ExpertShape(**fields)
