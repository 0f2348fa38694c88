"""What the engine adapters need to price a move: expert shape, hardware, topology, rule settings.

The engine tells what it serves: the adapters read, from the running engine, the model's name, the
bytes of one routed expert (vLLM: the expert weight tensors it registers with `EplbState`; SGLang: the
model's `routed_experts_weights_of_layer`), its MoE layers and experts (`EngineModel`), the GPUs and
nodes, and the cadence (vLLM's `step_interval` / `window_size`, SGLang's
`--eplb-rebalance-num-iterations`). The rest comes from a small config file named by `MOE_PLACE_CONFIG`
(TOML or JSON), then from environment variables, which win over the file. Every key is optional:

    # moe-place.toml
    hardware = "H100"            # GPU part of the catalog                   MOE_PLACE_HARDWARE
    nic_gbit = 400               # NIC per GPU, Gbit/s (multi-node)          MOE_PLACE_NIC_GBIT
    copy_schedule = "parallel"   # "parallel" (both engines batch a layer's transfers) or "serial" (formula 7)  MOE_PLACE_COPY_SCHEDULE
    min_gain = 0.005             # a layer moves only if its busiest GPU drops by this share of the mean  MOE_PLACE_MIN_GAIN
    noise_margin = 2.0           # ... and by this many times the measured noise floor  MOE_PLACE_NOISE_MARGIN
    estimate = "adaptive"        # the coming load: "adaptive" or "window" (the window's mean, the engines')  MOE_PLACE_ESTIMATE
    max_moved_slots = 64         # a cap the engine states, slots per layer (default: none)  MOE_PLACE_MAX_MOVED_SLOTS
    max_mib = 1024               # a cap on MiB copied per rebalance (default: none)  MOE_PLACE_MAX_MIB
    # what the engine says, if you want it checked (a value that disagrees with the engine's is an error):
    model = "DeepSeek-V3"        # expert-shape preset (moe_place.cost.models) or a [model] table  MOE_PLACE_MODEL
    step_interval = 3000         # engine steps between rebalance calls      MOE_PLACE_STEP_INTERVAL
    window_steps = 1000          # steps in the engine's load window         MOE_PLACE_WINDOW_STEPS
    migration = "async"          # how serving pays for copies: "async" (vLLM use_async, SGLang
                                 # --eplb-rebalance-layers-per-chunk) or "stall" (all layers at once)  MOE_PLACE_MIGRATION

`EngineConfig.expert_shape(engine)` prices copies with the engine's expert bytes; the expert's hidden
and intermediate sizes (its compute time) and top-k come from the engine's model config, else from a
configured `model`, else from the preset the model's name names, else from `DEFAULT_MODEL`. A
configured `model` whose expert differs from the engine's by more than `EXPERT_BYTES_TOLERANCE`, or
whose MoE layer count differs, is an InputError naming both; so is a configured cadence that is not the
engine's. Only where the engine says nothing (a policy called outside an engine) does the rule price
copies with the configured `model`, or `DEFAULT_MODEL`. The first call's log line (`first_call_line`)
says what the rule understood: model, expert bytes and where they came from, hardware, GPUs, cadence.
An environment variable set to "none" clears a cap the file sets.

Where the adapters and the drop-in (`moe_place.eplb`) plan afresh (no map in use yet), the solver and
its time limit come from `MOE_PLACE_SOLVER` and `MOE_PLACE_TIME_LIMIT`
(`moe_place.solvers.engine_call.solver_settings`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

from moe_place.cost.cluster import DEFAULT_NIC_GBIT, cluster_cost
from moe_place.cost.files import read_table_file
from moe_place.cost.hardware import DEFAULT_GPU, builtin_catalog
from moe_place.cost.migration import COPY_SCHEDULES, MIGRATION_MODELS
from moe_place.cost.models import DEFAULT_MODEL, ExpertShape, get_model, infer_model_name, model_from_table
from moe_place.engines.guard import LOG, ensure_handler
from moe_place.errors import InputError, check_keys
from moe_place.online.policy import ESTIMATES, RebalanceRule

__all__ = ["EngineConfig", "EngineModel", "config_dims", "expert_bytes_of", "first_call_line", "load_engine_config",
           "log_first_call"]

CONFIG_ENV = "MOE_PLACE_CONFIG"
MODEL_ENV = "MOE_PLACE_MODEL"
DEFAULT_CADENCE = (3000, 1000)    # vLLM 0.33's EPLBConfig step_interval / window_size, where the engine does not say
EXPERT_BYTES_TOLERANCE = 0.05     # a preset's bytes are weights only; the engine's include scales and padding


@dataclass(frozen=True)
class EngineModel:
    """What the engine says about the model it serves, read from the running engine.

    name: the model the engine loaded (its path or Hugging Face id).
    expert_bytes: bytes of one routed expert as the engine holds it: every weight tensor it registers
        for the expert (quantization scales included).
    num_moe_layers / num_experts: MoE layers and routed (logical) experts.
    hidden / intermediate / top_k: from the model's config, where the engine has it (None: unknown).
    source: where the figures were read (for the log line and errors).
    """

    name: str
    expert_bytes: int
    num_moe_layers: int
    num_experts: int
    hidden: int | None = None
    intermediate: int | None = None
    top_k: int | None = None
    source: str = "the engine"


def expert_bytes_of(tensors) -> int:
    """Bytes of one expert in tensors whose first dimension is the expert (`[local_experts, ...]` each)."""
    total = 0
    for tensor in tensors:
        experts = int(tensor.shape[0])
        total += (int(tensor.numel()) // experts if experts else 0) * int(tensor.element_size())
    return total


def config_dims(hf_config) -> dict:
    """hidden / intermediate / top_k of a Hugging Face model config (the keys MoE configs use), None where absent."""
    def first(*names):
        for name in names:
            value = getattr(hf_config, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return None

    return {"hidden": first("hidden_size"),
            "intermediate": first("moe_intermediate_size", "expert_intermediate_size", "intermediate_size"),
            "top_k": first("num_experts_per_tok", "moe_topk", "top_k", "num_experts_per_token")}


@dataclass(frozen=True)
class EngineConfig:
    """The settings of the rule inside an engine (module docstring for each key).

    model / step_interval / window_steps / migration: None (the default) takes the engine's; a value is
    checked against the engine's (an InputError naming both when they differ).
    """

    model: str | dict | None = None
    hardware: str = DEFAULT_GPU
    nic_gbit: float = DEFAULT_NIC_GBIT
    migration: str | None = None
    copy_schedule: str = "parallel"   # vLLM and SGLang issue a layer's copies as one batch_isend_irecv
    step_interval: int | None = None
    window_steps: int | None = None
    min_gain: float = 0.005
    noise_margin: float = 2.0
    estimate: str = "adaptive"
    max_moved_slots: int | None = None
    max_mib: float | None = None

    def __post_init__(self) -> None:
        if self.estimate not in ESTIMATES:
            raise InputError("estimate", f"one of {', '.join(ESTIMATES)}", self.estimate)
        if self.migration is not None and self.migration not in MIGRATION_MODELS:
            raise InputError("migration", f"one of {', '.join(MIGRATION_MODELS)}", self.migration)
        if self.copy_schedule not in COPY_SCHEDULES:
            raise InputError("copy_schedule", f"one of {', '.join(COPY_SCHEDULES)}", self.copy_schedule)
        for name in ("step_interval", "window_steps", "max_moved_slots"):
            value = getattr(self, name)
            if value is None:
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
        builtin_catalog().gpu(self.hardware)   # ... and an unknown GPU part

    def configured_shape(self) -> ExpertShape | None:
        """The `model` the config names (a preset or a [model] table), or None."""
        if self.model is None:
            return None
        return model_from_table(self.model, "model") if isinstance(self.model, dict) else get_model(self.model)

    def expert_shape(self, engine: EngineModel | None = None) -> ExpertShape:
        """The expert the rule prices: the engine's bytes and layers where it says (module note)."""
        configured = self.configured_shape()
        if engine is None:
            return configured or get_model(DEFAULT_MODEL)
        if configured is not None:
            off = abs(configured.expert_bytes - engine.expert_bytes) > EXPERT_BYTES_TOLERANCE * engine.expert_bytes
            if off or configured.num_moe_layers != engine.num_moe_layers:
                raise InputError("model", f"the model the engine serves: {engine.name}, {engine.expert_bytes:,} "
                                 f"bytes per expert and {engine.num_moe_layers} MoE layers ({engine.source})",
                                 f"{configured.name}: {configured.expert_bytes:,} bytes per expert and "
                                 f"{configured.num_moe_layers} MoE layers (MOE_PLACE_MODEL or {CONFIG_ENV})")
        preset = infer_model_name(engine.name)
        base = configured or (get_model(preset) if preset else get_model(DEFAULT_MODEL))
        hidden, intermediate = engine.hidden or base.hidden, engine.intermediate or base.intermediate
        top_k = min(engine.top_k or base.top_k, engine.num_experts)
        return ExpertShape(engine.name, hidden, intermediate, engine.num_experts, top_k, engine.num_moe_layers,
                           matrices=base.matrices,
                           dtype_bytes=engine.expert_bytes / (base.matrices * hidden * intermediate),
                           activation_bytes=base.activation_bytes)

    def cadence(self, engine_interval: int | None = None, engine_window: int | None = None) -> tuple[int, int]:
        """(steps between calls, steps in the load window): the engine's; a configured value must agree."""
        resolved = []
        for name, engine, default in (("step_interval", engine_interval, DEFAULT_CADENCE[0]),
                                      ("window_steps", engine_window, DEFAULT_CADENCE[1])):
            configured = getattr(self, name)
            if engine is not None and configured is not None and int(engine) != configured:
                raise InputError(name, f"the engine's {int(engine)} (the cadence it runs)",
                                 f"{configured} (MOE_PLACE_{name.upper()} or {CONFIG_ENV})")
            resolved.append(int(engine) if engine is not None else configured if configured is not None else default)
        return resolved[0], resolved[1]

    def resolved_migration(self, engine: str | None = None) -> str:
        """The migration model: the engine's (`engine`, "async" or "stall"); a configured one must agree."""
        if engine is not None and self.migration is not None and engine != self.migration:
            raise InputError("migration", f"the engine's {engine!r} (how it copies: async layer by layer, or all "
                             "layers while serving waits)", f"{self.migration!r} (MOE_PLACE_MIGRATION or {CONFIG_ENV})")
        return engine or self.migration or "async"

    def rule(self, num_gpus: int, num_nodes: int, num_layers: int, num_experts: int,
             num_groups: int | None = None, engine: EngineModel | None = None,
             migration: str | None = None) -> RebalanceRule:
        """A fresh rule (with its own state) for one model on `num_gpus` GPUs over `num_nodes` servers,
        pricing the engine's expert (`expert_shape(engine)`) under the engine's migration model."""
        cost = cluster_cost(num_gpus, num_nodes, self.hardware, self.expert_shape(engine), nic_gbit_per_s=self.nic_gbit,
                            copy_schedule=self.copy_schedule, migration=self.resolved_migration(migration))
        return RebalanceRule(cost, num_layers, num_experts, num_groups=num_groups, min_gain=self.min_gain,
                             noise_margin=self.noise_margin, estimate=self.estimate,
                             max_moved_slots=self.max_moved_slots,
                             max_bytes=None if self.max_mib is None else int(self.max_mib * 2 ** 20))


def first_call_line(engine_name: str, rule: RebalanceRule, engine: EngineModel | None, config: EngineConfig,
                    cadence: str) -> str:
    """The line the adapters log at the rule's first call: what it understood of the engine's setting."""
    cost = rule.cost
    shape, num_gpus, num_nodes = cost.model, cost.num_gpus, cost.topology.num_servers
    if engine is None:
        where = (f"the configured model {shape.name}" if config.model is not None else
                 f"the {DEFAULT_MODEL} preset: {engine_name} did not say what it serves")
        model = f"model unknown, {shape.expert_bytes / 2**20:.1f} MiB per expert ({where})"
    else:
        model = (f"model {engine.name}, {engine.expert_bytes / 2**20:.1f} MiB per expert ({engine.source}), "
                 f"{engine.num_moe_layers} MoE layers x {engine.num_experts} experts, expert {shape.hidden} x "
                 f"{shape.intermediate}")
    nodes = f" on {num_nodes} nodes" if num_nodes > 1 else ""
    return (f"moe-place: {engine_name} rebalance rule active: {model}; hardware {config.hardware}, {num_gpus} GPUs"
            f"{nodes}; {cadence}; migration {cost.migration}")


def log_first_call(line: str) -> None:
    """Log `line` at INFO on "moe_place.engines"; to stderr when nothing is set up to show it (vLLM
    configures only its own loggers)."""
    ensure_handler()
    LOG.info(line)


ENV_VARIABLES = {   # the EngineConfig key each variable sets
    "hardware": "MOE_PLACE_HARDWARE", "nic_gbit": "MOE_PLACE_NIC_GBIT", "migration": "MOE_PLACE_MIGRATION",
    "copy_schedule": "MOE_PLACE_COPY_SCHEDULE", "step_interval": "MOE_PLACE_STEP_INTERVAL",
    "window_steps": "MOE_PLACE_WINDOW_STEPS", "min_gain": "MOE_PLACE_MIN_GAIN", "noise_margin": "MOE_PLACE_NOISE_MARGIN",
    "estimate": "MOE_PLACE_ESTIMATE", "max_moved_slots": "MOE_PLACE_MAX_MOVED_SLOTS", "max_mib": "MOE_PLACE_MAX_MIB",
    "model": MODEL_ENV}
_CAPS = ("max_moved_slots", "max_mib")  # optional: "none" clears them


def load_engine_config(environ: Mapping[str, str] | None = None) -> EngineConfig:
    """The config file named by `MOE_PLACE_CONFIG` (if any), then the environment variables on top."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    path = env.get(CONFIG_ENV)
    if path:
        values.update(_read_file(Path(path)))
    types = {f.name: f.type for f in fields(EngineConfig)}
    for key, var in ENV_VARIABLES.items():
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
