"""What the engine adapters need to price a move: expert shape, hardware, topology, rule settings.

Read from a small config file named by `MOE_PLACE_CONFIG` (TOML or JSON), then from environment
variables, which win over the file. Every key is optional:

    # moe-place.toml
    model = "DeepSeek-V3"        # expert-shape preset (moe_place.cost.models); or a [model] table
    hardware = "H100"            # GPU part of the catalog                   MOE_PLACE_HARDWARE
    nic_gbit = 400               # NIC per GPU, Gbit/s (multi-node)          MOE_PLACE_NIC_GBIT
    migration = "async"          # "async" (vLLM use_async, SGLang layer chunks) or "stall"  MOE_PLACE_MIGRATION
    copy_schedule = "serial"     # "serial" (formula 7) or "parallel"        MOE_PLACE_COPY_SCHEDULE
    step_interval = 3000         # engine steps between rebalance calls      MOE_PLACE_STEP_INTERVAL
    window_steps = 1000          # steps in the engine's load window         MOE_PLACE_WINDOW_STEPS
    min_gain = 0.005             # a layer moves only if its busiest GPU drops by this share of the mean  MOE_PLACE_MIN_GAIN
    noise_margin = 2.0           # ... and by this many times the measured noise floor  MOE_PLACE_NOISE_MARGIN
    max_moved_slots = 64         # a cap the engine states, slots per layer (default: none)  MOE_PLACE_MAX_MOVED_SLOTS
    max_mib = 1024               # a cap on MiB copied per rebalance (default: none)  MOE_PLACE_MAX_MIB

`model` may also be set by `MOE_PLACE_MODEL`. The GPUs and nodes come from the engine's own call
(its EP size and node count); `step_interval` and `window_steps` must be the engine's (vLLM
`--eplb-config` `step_interval` / `window_size`, SGLang `--eplb-rebalance-num-iterations` for
both): the rule believes a move's saving lasts at least until the next call.
An environment variable set to "none" clears a cap the file sets.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

from moe_place.cost.files import read_table_file
from moe_place.cost.migration import COPY_SCHEDULES, MIGRATION_MODELS
from moe_place.cost.models import ExpertShape, get_model, model_from_table
from moe_place.errors import InputError, check_keys
from moe_place.online.costing import cluster_cost
from moe_place.online.policy import RebalanceRule

CONFIG_ENV = "MOE_PLACE_CONFIG"
MODEL_ENV = "MOE_PLACE_MODEL"


@dataclass(frozen=True)
class EngineConfig:
    """The settings of the rule inside an engine (module docstring for each key)."""

    model: str | dict = "Qwen3-30B-A3B"
    hardware: str = "H100"
    nic_gbit: float = 400.0
    migration: str = "async"
    copy_schedule: str = "serial"
    step_interval: int = 3000
    window_steps: int = 1000
    min_gain: float = 0.005
    noise_margin: float = 2.0
    max_moved_slots: int | None = None
    max_mib: float | None = None

    def __post_init__(self) -> None:
        if self.migration not in MIGRATION_MODELS:
            raise InputError("migration", f"one of {', '.join(MIGRATION_MODELS)}", self.migration)
        if self.copy_schedule not in COPY_SCHEDULES:
            raise InputError("copy_schedule", f"one of {', '.join(COPY_SCHEDULES)}", self.copy_schedule)
        for name in ("step_interval", "window_steps", "max_moved_slots"):
            value = getattr(self, name)
            if value is None and name == "max_moved_slots":
                continue
            low = 0 if name == "max_moved_slots" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InputError(name, f"a whole number >= {low}", value)
        for name in ("nic_gbit", "min_gain", "noise_margin", "max_mib"):
            value = getattr(self, name)
            if value is None and name == "max_mib":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or value == float("inf"):
                raise InputError(name, "a finite number >= 0", value)
        self.expert_shape()  # an unknown preset or a bad [model] table fails here, once

    def expert_shape(self) -> ExpertShape:
        return model_from_table(self.model, "model") if isinstance(self.model, dict) else get_model(self.model)

    def rule(self, num_gpus: int, num_nodes: int, num_layers: int, num_experts: int,
             num_groups: int | None = None) -> RebalanceRule:
        """A fresh rule (with its own state) for one model on `num_gpus` GPUs over `num_nodes` servers."""
        cost = cluster_cost(num_gpus, num_nodes, self.hardware, self.expert_shape(), nic_gbit_per_s=self.nic_gbit,
                            copy_schedule=self.copy_schedule, migration=self.migration)
        return RebalanceRule(cost, num_layers, num_experts, num_groups=num_groups, min_gain=self.min_gain,
                             noise_margin=self.noise_margin, max_moved_slots=self.max_moved_slots,
                             max_bytes=None if self.max_mib is None else int(self.max_mib * 2 ** 20))


_ENV = {"hardware": "MOE_PLACE_HARDWARE", "nic_gbit": "MOE_PLACE_NIC_GBIT", "migration": "MOE_PLACE_MIGRATION",
        "copy_schedule": "MOE_PLACE_COPY_SCHEDULE", "step_interval": "MOE_PLACE_STEP_INTERVAL",
        "window_steps": "MOE_PLACE_WINDOW_STEPS", "min_gain": "MOE_PLACE_MIN_GAIN",
        "noise_margin": "MOE_PLACE_NOISE_MARGIN", "max_moved_slots": "MOE_PLACE_MAX_MOVED_SLOTS",
        "max_mib": "MOE_PLACE_MAX_MIB", "model": MODEL_ENV}
_CAPS = ("max_moved_slots", "max_mib")  # optional: "none" clears them


def load_engine_config(environ: Mapping[str, str] | None = None) -> EngineConfig:
    """The config file named by `MOE_PLACE_CONFIG` (if any), then the environment variables on top."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    path = env.get(CONFIG_ENV)
    if path:
        values.update(_read_file(Path(path)))
    types = {f.name: f.type for f in fields(EngineConfig)}
    for key, var in _ENV.items():
        text = env.get(var)
        if text is None or text == "":
            continue
        kind = str(types[key]).split(" | ")[0]
        if key in _CAPS and text.strip().lower() == "none":
            values[key] = None
            continue
        try:
            values[key] = int(text) if kind == "int" else float(text) if kind == "float" else text
        except ValueError:
            raise InputError(var, f"a {kind}" + (" or none" if key in _CAPS else ""), repr(text)) from None
    return EngineConfig(**values)


def _read_file(path: Path) -> dict:
    data = read_table_file(path)
    check_keys(data, {f.name for f in fields(EngineConfig)}, f"{path}:")
    return data
