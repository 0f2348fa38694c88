"""What the engine adapters need to price a move: expert shape, hardware, topology, controller settings.

Read from a small config file named by `MOE_PLACE_CONFIG` (TOML or JSON), then from environment
variables, which win over the file. Every key is optional:

    # moe-place.toml
    model = "DeepSeek-V3"        # expert-shape preset (moe_place.cost.models); or a [model] table
    hardware = "H100"            # GPU part of the catalog                   MOE_PLACE_HARDWARE
    nic_gbit = 400               # NIC per GPU, Gbit/s (multi-node)          MOE_PLACE_NIC_GBIT
    migration = "async"          # "async" (vLLM use_async, SGLang chunks) or "stall"   MOE_PLACE_MIGRATION
    copy_schedule = "serial"     # "serial" (formula 7) or "parallel"        MOE_PLACE_COPY_SCHEDULE
    max_moved_slots = 2          # slot changes per layer and rebalance      MOE_PLACE_MAX_MOVED_SLOTS
    step_interval = 3000         # engine steps between rebalance calls      MOE_PLACE_STEP_INTERVAL
    window_steps = 1000          # steps summed into a [layers, E] load window  MOE_PLACE_WINDOW_STEPS
    hysteresis = 1.0             # a move pays back within life / hysteresis  MOE_PLACE_HYSTERESIS
    min_saving = 0.005           # ignore a layer saving less than this share  MOE_PLACE_MIN_SAVING
    prior_steps = 64             # believed life of a hot spot before any is seen  MOE_PLACE_PRIOR_STEPS

`model` may also be set by `MOE_PLACE_MODEL`. Defaults are the replay bench's `ours` settings with
vLLM's cadence. The GPUs and nodes come from the engine's own call (its EP size and node count).
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
from moe_place.online.controller import EngineRebalancer, PaybackController
from moe_place.online.costing import cluster_cost
from moe_place.online.window import HotSpotTracker

CONFIG_ENV = "MOE_PLACE_CONFIG"
MODEL_ENV = "MOE_PLACE_MODEL"


@dataclass(frozen=True)
class EngineConfig:
    """The settings of the controller inside an engine (module docstring for each key)."""

    model: str | dict = "Qwen3-30B-A3B"
    hardware: str = "H100"
    nic_gbit: float = 400.0
    migration: str = "async"
    copy_schedule: str = "serial"
    max_moved_slots: int = 2
    step_interval: int = 3000
    window_steps: int = 1000
    hysteresis: float = 1.0
    min_saving: float = 0.005
    prior_steps: float = 64.0

    def __post_init__(self) -> None:
        if self.migration not in MIGRATION_MODELS:
            raise InputError("migration", f"one of {', '.join(MIGRATION_MODELS)}", self.migration)
        if self.copy_schedule not in COPY_SCHEDULES:
            raise InputError("copy_schedule", f"one of {', '.join(COPY_SCHEDULES)}", self.copy_schedule)
        for name in ("max_moved_slots", "step_interval", "window_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "max_moved_slots" else 1):
                raise InputError(name, "a whole number >= " + ("0" if name == "max_moved_slots" else "1"), value)
        for name in ("nic_gbit", "hysteresis", "min_saving", "prior_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise InputError(name, "a number >= 0", value)
        self.expert_shape()  # an unknown preset or a bad [model] table fails here, once

    def expert_shape(self) -> ExpertShape:
        return model_from_table(self.model, "model") if isinstance(self.model, dict) else get_model(self.model)

    def rebalancer(self, num_gpus: int, num_nodes: int, num_layers: int, num_experts: int,
                   num_groups: int | None = None) -> EngineRebalancer:
        """A fresh controller (with its own state) for one model on `num_gpus` GPUs over `num_nodes` servers."""
        cost = cluster_cost(num_gpus, num_nodes, self.hardware, self.expert_shape(), nic_gbit_per_s=self.nic_gbit,
                            copy_schedule=self.copy_schedule, migration=self.migration)
        controller = PaybackController(cost, num_layers, num_experts, hysteresis=self.hysteresis,
                                       min_relative_saving=self.min_saving, max_moved_slots=self.max_moved_slots,
                                       num_groups=num_groups, tracker=HotSpotTracker(prior_steps=self.prior_steps))
        return EngineRebalancer(controller, self.step_interval)


_ENV = {"hardware": "MOE_PLACE_HARDWARE", "nic_gbit": "MOE_PLACE_NIC_GBIT", "migration": "MOE_PLACE_MIGRATION",
        "copy_schedule": "MOE_PLACE_COPY_SCHEDULE", "max_moved_slots": "MOE_PLACE_MAX_MOVED_SLOTS",
        "step_interval": "MOE_PLACE_STEP_INTERVAL", "window_steps": "MOE_PLACE_WINDOW_STEPS",
        "hysteresis": "MOE_PLACE_HYSTERESIS", "min_saving": "MOE_PLACE_MIN_SAVING",
        "prior_steps": "MOE_PLACE_PRIOR_STEPS", "model": MODEL_ENV}


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
        kind = types[key]
        try:
            values[key] = int(text) if kind == "int" else float(text) if kind == "float" else text
        except ValueError:
            raise InputError(var, f"a {kind}", repr(text)) from None
    return EngineConfig(**values)


def _read_file(path: Path) -> dict:
    data = read_table_file(path)
    check_keys(data, {f.name for f in fields(EngineConfig)}, f"{path}:")
    return data
