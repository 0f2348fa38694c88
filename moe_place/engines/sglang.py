"""SGLang adapter: write a plan as the file `--init-expert-location` loads.

SGLang (`python/sglang/srt/eplb/expert_location.py`) reads `--init-expert-location FILE` with
`torch.load` (`.pt`) or `json.loads` (`.json`) and, when the dict holds `physical_to_logical_map`,
passes the dict's entries as keyword arguments to its mapping constructor, so the file holds
that one key and nothing else:

    {"physical_to_logical_map": [[...], ...]}      # int, [num_model_layers, num_physical]

- rows cover every decoder layer of the model, dense ones included (SGLang's layer count is the
  model's `num_hidden_layers`; its recorder writes dense layers as zero rows). Dense layers and
  model layers the plan does not cover get the trivial row `p % E` (what `trivial` gives);
- the physical count is logical + `--ep-num-redundant-experts` and divisible by the EP size;
  slot `p` lives on GPU `p // (P / ep_size)`, as in moe-place.

Launch: `python -m sglang.launch_server ... --ep-size G --ep-num-redundant-experts R
--init-expert-location FILE`. SGLang's recorder dumps are read by `moe_place.traces.load_trace`
(planning input for `moe-place plan`).

Online (`--enable-eplb`): SGLang's `EPLBManager` rebalances every
`--eplb-rebalance-num-iterations` passes through `ExpertLocationMetadata.init_by_eplb`, which calls
`sglang.srt.eplb.eplb_algorithms.rebalance_experts(tokens_per_expert [passes, layers, E], ...)`,
and copies the changed layers (all at once unless `--eplb-rebalance-layers-per-chunk`).
`install_rebalance_hook()` puts `PaybackRebalance` in that function's place (reversibly): the
rebalance rule (`moe_place.online.policy.RebalanceRule`, what `replay --engine sglang --controller
ours` runs) decides, from the map SGLang runs, which layers take DeepSeek EPLB's plan of the
window aligned to the map in use (a gap above the noise floor that pays back), and otherwise
returns that map unchanged (SGLang then copies nothing). It reads the running server's
`--eplb-rebalance-num-iterations` for its horizon; the other settings come from
`moe_place.engines.config` (`MOE_PLACE_CONFIG` or `MOE_PLACE_*`; `migration = "stall"` matches
SGLang's default all-layers update). Call it in the server process before the first rebalance
(e.g. a sitecustomize module, or a launcher that imports it then runs SGLang).
"""

from __future__ import annotations

import importlib
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from moe_place.engines.config import EngineConfig, load_engine_config
from moe_place.eplb import placement_tensors, plan_placement
from moe_place.errors import InputError
from moe_place.io import write_atomic
from moe_place.online.policy import RebalanceRule, warm_up
from moe_place.placement import Placement

MAP_KEY = "physical_to_logical_map"
SUFFIXES = (".json", ".pt")
ALGORITHMS_MODULE = "sglang.srt.eplb.eplb_algorithms"
LOCATION_MODULE = "sglang.srt.eplb.expert_location"


@dataclass(frozen=True)
class InitExpertLocation:
    """A full-model `physical_to_logical_map` and where its rows came from.

    physical_to_logical_map: int64 `[num_model_layers, P]`.
    planned_layers: model layers whose row comes from the plan.
    trivial_layers: model layers given the trivial row `p % E` (dense layers, or MoE layers the
        plan does not cover: the CLI warns about the latter).
    dense_layers: the layers declared dense.
    """

    physical_to_logical_map: np.ndarray
    planned_layers: tuple[int, ...]
    trivial_layers: tuple[int, ...]
    dense_layers: tuple[int, ...]

    @property
    def unplanned_moe_layers(self) -> tuple[int, ...]:
        dense = set(self.dense_layers)
        return tuple(layer for layer in self.trivial_layers if layer not in dense)


def init_expert_location(placement: Placement, layer_ids: tuple[int, ...] = (), *,
                         num_model_layers: int | None = None,
                         dense_layer_ids: tuple[int, ...] = ()) -> InitExpertLocation:
    """Expand a plan to every model layer.

    layer_ids: the model layer of each plan row (default `0..layers-1`). When `dense_layer_ids`
        are given and the plan's ids are `0..n-1` with `n` equal to the number of MoE layers, the
        plan rows are taken as the MoE layers in order (a trace of MoE layers only).
    num_model_layers: decoder layers of the model (default: enough for every planned and dense layer).
    """
    rows = placement.num_layers
    ids = tuple(int(i) for i in layer_ids) if layer_ids else tuple(range(rows))
    if len(ids) != rows:
        raise InputError("layer_ids", f"{rows} ids, one per plan layer", len(ids))
    dense = tuple(sorted({int(d) for d in dense_layer_ids}))
    if dense and min(dense) < 0:
        raise InputError("dense layer ids", "integers >= 0", min(dense))
    if dense and ids == tuple(range(rows)) and set(ids) & set(dense):
        # the plan's rows are the MoE layers in order (a trace that kept MoE layers only)
        total = rows + len(dense) if num_model_layers is None else num_model_layers
        moe_layers = tuple(layer for layer in range(total) if layer not in set(dense))
        if len(moe_layers) != rows:
            raise InputError("num_model_layers", f"{rows} MoE layers besides the {len(dense)} dense ones",
                             f"{len(moe_layers)} MoE layers")
        ids = moe_layers
    needed = max(ids + dense) + 1
    total = needed if num_model_layers is None else num_model_layers
    if needed > total:
        raise InputError("num_model_layers", f"more than the highest layer id {needed - 1}", total)
    clash = sorted(set(ids) & set(dense))
    if clash:
        raise InputError("dense layer ids", "layers the plan does not cover", f"layer {clash[0]} is in the plan")
    experts, physical = placement.num_experts, placement.num_physical
    full = np.tile(np.arange(physical, dtype=np.int64) % experts, (total, 1))
    full[list(ids)] = placement.phy2log
    trivial = tuple(layer for layer in range(total) if layer not in set(ids))
    full.setflags(write=False)
    return InitExpertLocation(full, tuple(sorted(ids)), trivial, dense)


def write_init_expert_location(path: str | Path, location: InitExpertLocation | np.ndarray) -> None:
    """Write `{"physical_to_logical_map": ...}` atomically as `.json` or `.pt` (by the suffix)."""
    path = Path(path)
    matrix = location.physical_to_logical_map if isinstance(location, InitExpertLocation) else location
    matrix = np.asarray(matrix, dtype=np.int64)
    if path.suffix == ".json":
        write_atomic(path, json.dumps({MAP_KEY: matrix.tolist()}) + "\n")
    elif path.suffix == ".pt":
        import torch

        buffer = io.BytesIO()
        torch.save({MAP_KEY: torch.from_numpy(np.array(matrix))}, buffer)
        write_atomic(path, buffer.getvalue())
    else:
        raise InputError(str(path), f"a file name ending in {' or '.join(SUFFIXES)}", path.suffix or "no suffix")


def read_init_expert_location(path: str | Path) -> np.ndarray:
    """int64 `[layers, P]` from a `.json`/`.pt` file with `physical_to_logical_map` (as SGLang reads it)."""
    path = Path(path)
    if not path.exists():
        raise InputError(str(path), "an existing file", "no such file")
    if path.suffix == ".pt":
        import torch

        data = torch.load(path, weights_only=True, map_location="cpu")
    else:
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise InputError(str(path), "JSON", f"invalid JSON ({exc.msg})") from None
    if not isinstance(data, dict) or MAP_KEY not in data:
        raise InputError(str(path), f"a dict with {MAP_KEY}")
    value = data[MAP_KEY]
    matrix = value.numpy() if hasattr(value, "numpy") else np.asarray(value)
    if matrix.ndim != 2 or matrix.dtype.kind not in "iu":
        raise InputError(f"{path}: {MAP_KEY}", "an integer matrix [layers, physical]", f"shape {matrix.shape}")
    return matrix.astype(np.int64)


# ---------------------------------------------------------------------- online: the rebalance rule
def sglang_current_map():
    """SGLang's map in use, CPU `[layers, P]` (`get_global_expert_location_metadata()`), or None."""
    try:
        module = importlib.import_module(LOCATION_MODULE)
    except ImportError:
        return None
    metadata = module.get_global_expert_location_metadata()
    return None if metadata is None else metadata.physical_to_logical_map_cpu


def sglang_rebalance_interval() -> int | None:
    """SGLang's `--eplb-rebalance-num-iterations` of the running server, or None outside one."""
    try:
        module = importlib.import_module("sglang.srt.runtime_context")
        return int(module.get_exec().moe.eplb_rebalance_num_iterations)
    except Exception:  # noqa: BLE001 - no SGLang, or no server context in this process: use the config
        return None


@dataclass
class PaybackRebalance:
    """SGLang's `rebalance_experts(tokens_per_expert, num_physical_experts, num_local_physical_experts,
    num_groups, num_nodes, algorithm)` decided by the rebalance rule (module note).

    config: the rule's settings (None: `load_engine_config()`, read once per model). current_map: returns the map in
    use `[layers, P]` (default: SGLang's global expert location). The rule's state lives here,
    one per model shape, between SGLang's calls.
    Returns `(phy2log, log2phy, logcnt)` CPU int64 tensors, as SGLang's own algorithms do.
    """

    config: EngineConfig | None = None
    current_map: Callable[[], Any] = sglang_current_map
    sessions: dict = field(default_factory=dict)

    def __call__(self, tokens_per_expert, num_physical_experts: int, num_local_physical_experts: int,
                 num_groups: int | None, num_nodes: int, algorithm: Any = None):
        loads = tokens_per_expert.detach().to("cpu").numpy() if hasattr(tokens_per_expert, "detach") \
            else np.asarray(tokens_per_expert)   # the rule checks and converts the counts once
        if loads.ndim == 2:
            loads = loads[None]
        _, num_layers, num_experts = loads.shape
        gpus = num_physical_experts // num_local_physical_experts
        nodes = num_nodes if num_nodes >= 1 and gpus % num_nodes == 0 else 1
        current = None
        old = self.current_map()
        if old is not None:
            old = np.asarray(old.detach().to("cpu").numpy() if hasattr(old, "detach") else old, dtype=np.int64)
            if old.shape == (num_layers, num_physical_experts):
                current = Placement(old, num_experts, gpus, nodes, allow_colocated=True)
        if current is None:  # no map to migrate from: a fresh plan
            placement = plan_placement(loads.sum(axis=0), num_physical_experts, num_groups, nodes, gpus)
        else:
            key = (num_layers, num_experts, num_physical_experts, gpus, nodes)
            if key not in self.sessions:   # the settings are read once per model, with its rule
                config = self.config or load_engine_config()
                groups = num_groups if num_groups and num_experts % num_groups == 0 else None
                self.sessions[key] = (config.rule(gpus, nodes, num_layers, num_experts, groups), config)
            rule, config = self.sessions[key]
            decision = rule.decide(loads, current, sglang_rebalance_interval() or config.step_interval)
            placement = current if decision is None else decision.placement
        return placement_tensors(placement)


@dataclass
class RebalanceHook:
    """What `install_rebalance_hook` replaced, so that `uninstall_rebalance_hook` can put it back."""

    module: Any
    previous: Any
    hook: PaybackRebalance
    active: bool = True


def install_rebalance_hook(hook: PaybackRebalance | None = None) -> RebalanceHook:
    """Make SGLang's EPLB rebalance run `hook` (default: `PaybackRebalance()`); InputError without SGLang."""
    try:
        module = importlib.import_module(ALGORITHMS_MODULE)
    except ImportError:
        raise InputError("sglang", f"an importable SGLang with {ALGORITHMS_MODULE}", "not importable") from None
    warm_up()   # the rule's one-time costs now, not in SGLang's first rebalance
    handle = RebalanceHook(module, module.rebalance_experts, hook or PaybackRebalance())
    module.rebalance_experts = handle.hook
    return handle


def uninstall_rebalance_hook(handle: RebalanceHook) -> None:
    """Undo `install_rebalance_hook` (a second call is a no-op)."""
    if handle.active:
        handle.module.rebalance_experts = handle.previous
        handle.active = False
