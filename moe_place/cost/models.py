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
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from moe_place.cost.files import get_number
from moe_place.cost.units import BYTES_PER_DTYPE
from moe_place.errors import InputError, check_keys


@dataclass(frozen=True)
class ExpertShape:
    """One model's routed-expert shape and MoE layout.

    dtype_bytes: bytes per weight element (may be fractional: MXFP4 is 4.25/8).
    activation_bytes: bytes per activation element (BF16 = 2), used for dispatched rows.
    """

    name: str
    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    num_moe_layers: int
    matrices: int = 3
    dtype_bytes: float = 2.0
    activation_bytes: float = 2.0

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
    def layer_bytes(self) -> int:
        """Bytes of one layer's routed experts."""
        return self.expert_bytes * self.num_experts

    @property
    def row_bytes(self) -> int:
        """Bytes of one dispatched activation row (`hidden * activation_bytes`)."""
        return math.ceil(self.hidden * self.activation_bytes)

    def flops_per_row(self) -> int:
        """`F_e(1) = 2 * P_e`: FLOPs of one (token, expert) dispatch."""
        return 2 * self.params_per_expert


PRESETS: dict[str, ExpertShape] = {
    s.name: s for s in (
        ExpertShape("DeepSeek-V3", 7168, 2048, 256, 8, 58, dtype_bytes=1.0),
        ExpertShape("Qwen3-235B-A22B", 4096, 1536, 128, 8, 94),
        ExpertShape("Qwen3-30B-A3B", 2048, 768, 128, 8, 48),
        ExpertShape("Mixtral-8x7B", 4096, 14336, 8, 2, 32),
        ExpertShape("OLMoE-1B-7B", 2048, 1024, 64, 8, 16),
        ExpertShape("GPT-OSS-120B", 2880, 2880, 128, 4, 36, dtype_bytes=BYTES_PER_DTYPE["mxfp4"]),
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
