"""TensorRT-LLM's static expert map: the `moe_config.load_balancer` YAML its wide-EP MoE loads.

What TensorRT-LLM reads, from its sources (NVIDIA/TensorRT-LLM, read with the search tools; each file at
the commit given):
- `tensorrt_llm/_torch/model_config.py` (1a0dc5f), `MoeLoadBalancerConfig`: three fields, `num_slots`
  (int), `initial_global_assignments` (a map from MoE layer index to the list of `num_slots` expert ids,
  slot `j` holding expert `[layer][j]`) and `layer_updates_per_iter` (int, 0 = a static map: no expert
  moves while serving). `setup(ep_rank, ep_size)` requires `num_slots`; each rank owns
  `num_local_slots = num_slots // ep_size` consecutive slots (rank `r`: slots `r * num_local_slots`
  onward). `get_layer_initial_global_assignments(layer_idx)` requires the layer's key and a list of
  `num_slots` ids. The LLM API's version of the class (`tensorrt_llm/llmapi/llm_args.py`) raises on
  `num_slots` missing or not divisible by `ep_size`, on a layer's key missing and on a list of another
  length.
- `tensorrt_llm/_torch/modules/fused_moe/fused_moe_wide_ep.py` (99bca89): each MoE layer looks its list
  up by its `layer_idx` and asserts a list, `len == num_slots`, `num_slots >= num_experts` and that the
  list's set of ids is exactly `{0, ..., num_experts - 1}` (every expert at least once, none other).
- `tensorrt_llm/_torch/models/modeling_deepseekv3.py` (a43cf9e): `layer_idx` is the decoder-layer index,
  so DeepSeek-V3's keys are 3-60 (its layers 0-2 are dense and have no entry); a model whose every
  layer is MoE (Qwen3-MoE, Mixtral) has keys 0 to layers - 1.
- `examples/wide_ep/ep_load_balancer/README.md` (2a9abd9): the file is named in the server's
  `--extra_llm_api_options` YAML as `moe_config: {backend: WideEP, load_balancer: ./moe_load_balancer.yaml}`
  with `enable_attention_dp: true`, and `generate_eplb_config.py` writes it (the ranks' slot lists one after
  the other).
- Every MoE layer the server builds looks its key up, the MTP layers included: `MTPForCausalLM` in
  `tensorrt_llm/_torch/models/modeling_speculative.py` (00679c6) builds them as decoder layers numbered from
  `num_hidden_layers` (DeepSeek-V3: 61), and `get_layer_initial_global_assignments` in
  `tensorrt_llm/llmapi/llm_args.py` raises `KeyError` for a layer with no key once the map is given at all.
  Which layers a model has: `moe_place.cost.model_layers.moe_layer_ids`.
- The engine's own map, used for every layer when no map is given: `WideEPMoE.__init__` in
  `fused_moe_wide_ep.py` (01303b3) and `_init_load_balancer` in `tensorrt_llm/_torch/modules/fused_moe/
  interface.py` (567239f): slot `i` of rank `r` holds expert `(r * num_experts // ep_size + i) % num_experts`
  (`default_assignments`).

`load_balancer_config` turns a plan into that dict (slot order = the plan's `phy2log`, keys = the plan's
layer ids, or the model's when `--dense-layers` says which leading layers are dense), covering every MoE
layer of the served model (a layer the plan lacks is an InputError naming them all, or, asked for, the
engine's own map), `check_load_balancer` runs TensorRT-LLM's checks above on it (an InputError naming the
first one broken), and `load_balancer_yaml` writes it as YAML with one flow list per layer, the form
`generate_eplb_config.py` gives.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from moe_place.errors import InputError
from moe_place.io import write_atomic
from moe_place.placement import Placement

__all__ = ["check_load_balancer", "default_assignments", "format_layers", "load_balancer_config",
           "load_balancer_yaml", "model_layer_keys", "write_load_balancer"]

FIELDS = ("num_slots", "initial_global_assignments", "layer_updates_per_iter")  # MoeLoadBalancerConfig's fields
FILL_MISSING = ("error", "default")  # what a served MoE layer the plan lacks gets: refused, or the engine's own map


def model_layer_keys(layer_ids: Sequence[int], dense_layer_ids: Sequence[int] = ()) -> tuple[int, ...]:
    """TensorRT-LLM's layer index of each plan row: the plan's layer ids, or, when `dense_layer_ids` are
    given and the plan's ids are positions among the MoE layers (0, 1, ...), the i-th model layer that is
    not dense for row i (DeepSeek-V3 with dense 0-2: rows 0, 1, ... -> keys 3, 4, ...)."""
    ids = tuple(int(i) for i in layer_ids)
    dense = set(int(i) for i in dense_layer_ids)
    if not dense or ids != tuple(range(len(ids))):
        return ids
    keys, layer = [], 0
    while len(keys) < len(ids):
        if layer not in dense:
            keys.append(layer)
        layer += 1
    return tuple(keys)


def default_assignments(num_experts: int, num_slots: int, ep_size: int) -> list[int]:
    """TensorRT-LLM's own map of one layer (module docstring): the expert of each of `num_slots` slots,
    rank `r` holding its `num_slots // ep_size` slots from expert `r * num_experts // ep_size` on, wrapping."""
    local = num_slots // ep_size
    return [(rank * num_experts // ep_size + i) % num_experts for rank in range(ep_size) for i in range(local)]


def format_layers(ids: Sequence[int], noun: bool = False) -> str:
    """Layer ids as ranges: (3, 4, 5, 61) -> '3-5,61' (`noun`: 'layers 3-5,61', 'layer 61')."""
    parts: list[str] = []
    for layer in sorted(int(i) for i in ids):
        if parts and layer == int(parts[-1].rsplit("-", 1)[-1]) + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{layer}"
        else:
            parts.append(str(layer))
    text = ",".join(parts)
    return text if not noun else f"layer {text}" if len(ids) == 1 else f"layers {text}"


def load_balancer_config(placement: Placement, layer_keys: Sequence[int], moe_layers: Sequence[int] | None = None,
                         fill_missing: str = "error", model: str = "the served model") -> dict:
    """`{num_slots, initial_global_assignments: {layer key: [expert of each slot]}, layer_updates_per_iter: 0}`
    for `placement` (slot `p` on rank `p // (P / G)`, as TensorRT-LLM owns slots), with a key for every layer of
    `moe_layers` (the MoE layers `model` builds; default: `layer_keys`), checked as TensorRT-LLM checks it
    (`check_load_balancer`).

    A layer of `moe_layers` the plan has no row for: an InputError naming them all (TensorRT-LLM would raise
    KeyError at start-up), or with `fill_missing="default"` the engine's own map (`default_assignments`).
    Plan rows keyed by a layer that is not in `moe_layers` are left out (the engine never looks them up).
    """
    if len(layer_keys) != placement.num_layers:
        raise InputError("layer keys", f"one per plan layer ({placement.num_layers})", len(layer_keys))
    if fill_missing not in FILL_MISSING:
        raise InputError("fill missing", f"one of {', '.join(FILL_MISSING)}", fill_missing)
    served = tuple(int(i) for i in (layer_keys if moe_layers is None else moe_layers))
    planned = {int(key): [int(e) for e in row] for key, row in zip(layer_keys, np.asarray(placement.phy2log))}
    missing = [layer for layer in served if layer not in planned]
    if missing and fill_missing == "error":
        raise InputError("plan layers", f"a row for every MoE layer of {model} ({format_layers(served)}): "
                         f"TensorRT-LLM raises KeyError at start-up on one without; or --fill-missing default",
                         f"no row for {format_layers(missing, noun=True)}")
    default = default_assignments(placement.num_experts, placement.num_physical, placement.num_gpus)
    config = {"num_slots": int(placement.num_physical),
              "initial_global_assignments": {layer: planned.get(layer, list(default)) for layer in served},
              "layer_updates_per_iter": 0}
    check_load_balancer(config, placement.num_experts, placement.num_gpus, served)
    return config


def check_load_balancer(config: dict, num_experts: int, ep_size: int, moe_layers: Sequence[int]) -> None:
    """TensorRT-LLM's checks of a load-balancer config (module docstring), each an InputError naming the
    field: the three fields and no other; `num_slots` an integer, `>= num_experts`, divisible by
    `ep_size`; `layer_updates_per_iter` an integer >= 0; a list for every MoE layer in `moe_layers`, of
    `num_slots` expert ids whose set is `{0, ..., num_experts - 1}`."""
    unknown = sorted(set(config) - set(FIELDS))
    if unknown:
        raise InputError(unknown[0], f"only MoeLoadBalancerConfig's fields ({', '.join(FIELDS)})", "another key")
    slots = config.get("num_slots")
    if not _is_int(slots):
        raise InputError("num_slots", "an integer (MoeLoadBalancerConfig.setup needs it)", slots)
    if slots < num_experts:
        raise InputError("num_slots", f"at least num_experts={num_experts}", slots)
    if ep_size < 1 or slots % ep_size:
        raise InputError("num_slots", f"a multiple of the EP size {ep_size} (num_local_slots = num_slots // ep_size)",
                         slots)
    updates = config.get("layer_updates_per_iter", 0)
    if not _is_int(updates) or updates < 0:
        raise InputError("layer_updates_per_iter", "an integer >= 0 (0: a static map)", updates)
    assignments = config.get("initial_global_assignments")
    if not isinstance(assignments, dict):
        raise InputError("initial_global_assignments", "a map from MoE layer index to slot lists", type(assignments).__name__)
    for layer in moe_layers:
        where = f"initial_global_assignments[{layer}]"
        if layer not in assignments:
            raise InputError(where, "a list for every MoE layer (TensorRT-LLM looks each up by its layer index)",
                             "missing")
        row = assignments[layer]
        if not isinstance(row, list) or not all(_is_int(e) for e in row):
            raise InputError(where, "a list of expert ids", type(row).__name__)
        if len(row) != slots:
            raise InputError(where, f"num_slots={slots} expert ids", len(row))
        if set(row) != set(range(num_experts)):
            missing = sorted(set(range(num_experts)) - set(row))
            raise InputError(where, f"every expert 0-{num_experts - 1} at least once and no other id",
                             f"no expert {missing[0]}" if missing else f"id {sorted(set(row) - set(range(num_experts)))[0]}")


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def load_balancer_yaml(config: dict, comment: str = "") -> str:
    """The YAML text of a load-balancer config: `num_slots`, the per-layer flow lists in layer order,
    `layer_updates_per_iter`; `comment` as a leading `#` line."""
    lines = [f"# {comment}"] if comment else []
    lines.append(f"num_slots: {int(config['num_slots'])}")
    lines.append("initial_global_assignments:")
    for layer in sorted(config["initial_global_assignments"]):
        row = config["initial_global_assignments"][layer]
        lines.append(f"  {int(layer)}: [{', '.join(str(int(e)) for e in row)}]")
    lines.append(f"layer_updates_per_iter: {int(config['layer_updates_per_iter'])}")
    return "\n".join(lines) + "\n"


def write_load_balancer(out, config: dict, comment: str = "") -> None:
    """Write `load_balancer_yaml(config)` to `out`, atomically."""
    write_atomic(out, load_balancer_yaml(config, comment))
