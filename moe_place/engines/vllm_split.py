"""vLLM adapter, the per-batch split: the router's replica choice, replaced on the layers where the split pays.

vLLM 0.33 turns a layer's logical top-k ids into physical slots in its router: `BaseRouter._apply_eplb_mapping`
(`model_executor/layers/fused_moe/router/base_router.py`) calls `eplb_map_to_physical_and_record(topk_ids,
expert_load_view, logical_to_physical_map, logical_replica_count, record_enabled, num_unpadded_tokens)` with the
layer's `EplbLayerState`: a Triton kernel picks the replica by a hash of the token's index and adds one to the
chosen slot of `expert_load_view` for each dispatch of the first `num_unpadded_tokens` tokens while
`record_enabled` holds (the load EPLB's window reads). On other platforms the function returns the ids unchanged.

With `MOE_PLACE_SPLIT=per-batch` and moe-place's policy (`MOE_PLACE_VLLM_POLICY`), `install_split` (run where
the adapter's wrapped `EplbState.add_model` sees a model) replaces `BaseRouter._apply_eplb_mapping`, the
method (it has the layer's state; the module function has no layer). On a layer whose split flag is on: count
-> all-reduce over the EP group (`get_ep_group().device_group`) -> split -> map
(`moe_place.engines.batch_split.split_step`, `map_dispatches`), and the chosen slots recorded into `expert_load_view` exactly as
vLLM's kernel records its own (one per dispatch of an unpadded token, while `record_enabled`). On every other
layer, while a CUDA graph is being captured (the numpy split cannot be captured: the graphs replay vLLM's
choice), and where the split fails (one warning, `moe_place.engines.guard`): vLLM's own method. Nothing of
vLLM's platform check is patched: on a CPU the replacement runs as on a GPU (layers with the flag off take
vLLM's CPU mapping, the ids unchanged).

Which layer a router serves: `add_model` tags each MoE layer's `EplbLayerState` (`model.moe_layers[i]`) with
the model and the layer index. The flags (`moe_place.engines.batch_split.SplitFlags`) are adopted where vLLM
commits a map, at the same step on every rank: `_commit_eplb_maps` (sync mode: every layer at the
rearrangement step) and `_commit_eplb_maps_for_layer` (async mode: one layer per step), wrapped in
`eplb_state`; the agreement is an all-reduce (MIN) over the EP group's CPU group.
Not covered: DeepGEMM's mega-MoE layer (`deep_gemm_mega_moe.py`) calls the mapping function itself; its layers
keep vLLM's choice on every rank.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from moe_place.engines.batch_split import FLAGS, map_dispatches, split_step
from moe_place.engines.guard import Guard
from moe_place.engines.tensors import to_numpy

__all__ = ["VllmSplit", "install_split", "record", "uninstall_split", "vllm_ep_group"]

ROUTER_MODULE = "vllm.model_executor.layers.fused_moe.router.base_router"
STATE_MODULE = "vllm.distributed.eplb.eplb_state"
COMMITS = ("_commit_eplb_maps", "_commit_eplb_maps_for_layer")


def vllm_ep_group():
    """vLLM's EP group coordinator (`device_group`, `cpu_group`, `rank_in_group`, `world_size`)."""
    return importlib.import_module("vllm.distributed.parallel_state").get_ep_group()


@dataclass
class VllmSplit:
    """The split installed into vLLM: what was patched (to undo it), the layers it knows, its guard.

    layers: `id(EplbLayerState)` -> (model key `(layers, experts)`, layer index). group: returns the EP group
    coordinator (vLLM's `get_ep_group`; tests give a gloo one). patches: (owner, attribute, original).
    """

    group: Callable[[], Any] = vllm_ep_group
    guard: Guard = field(default_factory=lambda: Guard("vLLM"))
    layers: dict = field(default_factory=dict)
    patches: list = field(default_factory=list)
    ubatch: Callable[[], int] = lambda: 0

    def tag_layers(self, model) -> tuple[int, int]:
        """Record which layer each MoE layer's `EplbLayerState` serves; returns the model's key."""
        key = (int(model.num_moe_layers), int(model.num_logical_experts))
        for index, layer in enumerate(model.moe_layers):
            state = getattr(layer, "eplb_state", None)
            if state is not None:
                self.layers[id(state)] = (key, index)
        return key

    def route(self, router, original: Callable, topk_ids):
        """The patched `_apply_eplb_mapping`: the split where the layer's flag is on, else vLLM's (module note)."""
        state = router.eplb_state
        where = None if state is None else self.layers.get(id(state))
        if where is None or not FLAGS.is_on(*where) or _capturing(topk_ids):
            return original(router, topk_ids)
        return self.guard.call("vllm.router", lambda: self._split(state, topk_ids, original, router),
                               lambda: original(router, topk_ids))

    def _split(self, state, topk_ids, original: Callable, router):
        import torch  # lazy: vLLM has it

        group = self.group()
        log2phy = to_numpy(state.logical_to_physical_map)
        view = state.expert_load_view
        row = np.full(view.shape[0], -1, dtype=np.int64)        # phy2log of the layer, from its log2phy
        experts = np.broadcast_to(np.arange(log2phy.shape[0])[:, None], log2phy.shape)
        row[log2phy[log2phy >= 0]] = experts[log2phy >= 0]

        ranks = int(group.world_size)

        def all_reduce(local):
            if ranks > 1:
                torch.distributed.all_reduce(local, group=group.device_group)
            return local

        done = split_step(topk_ids, log2phy.shape[0], row, ranks, all_reduce, self.guard, "vllm.router")
        if done is None:
            return original(router, topk_ids)
        slots = map_dispatches(topk_ids, row, done[1], int(group.rank_in_group), ranks)
        record(view, slots, state.should_record_tensor, _unpadded(state, self.ubatch()))
        return slots

    def adopt(self, model_state, layers) -> None:
        """After vLLM committed `layers` of a model's map: take up the split's flags (every rank, same step)."""
        key = self.guard.call("vllm.commit", lambda: (int(model_state.model.num_moe_layers),
                                                      int(model_state.model.num_logical_experts)), lambda: None)
        if key is None:   # the same vLLM objects on every rank: every rank ends here alike
            return
        if layers is None:
            layers = range(key[0])
        self.guard.call("vllm.commit", lambda: FLAGS.adopt(key, list(layers), self._agree), lambda: None)

    def _agree(self, proposal: np.ndarray) -> np.ndarray:
        import torch  # lazy: vLLM has it

        group = self.group()
        flags = torch.from_numpy(np.ascontiguousarray(proposal, dtype=np.int32))
        if int(group.world_size) > 1:
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MIN, group=group.cpu_group)
        return to_numpy(flags)


def record(view, slots, record_enabled, unpadded) -> None:
    """Add one to `view [P]` at each slot of `slots [T, k]` in `[0, P)` of the first `unpadded` tokens (a 0-d
    tensor, or None: all), while `record_enabled` (0-d bool tensor) holds: what vLLM's kernel records."""
    import torch  # lazy: vLLM has it

    flat = slots.reshape(-1).long()
    keep = (flat >= 0) & (flat < view.shape[0])
    if unpadded is not None:
        index = torch.arange(flat.numel(), device=flat.device)
        keep &= index < unpadded.to(flat.device) * max(slots.shape[-1], 1)
    if record_enabled is not None:
        keep &= record_enabled.to(flat.device).bool()
    view.index_add_(0, flat.clamp(0, view.shape[0] - 1).to(view.device), keep.to(view.device, view.dtype))


def _unpadded(state, ubatch: int):
    tensors = state.num_unpadded_tokens_tensors
    return None if tensors is None else tensors[ubatch]


def _capturing(topk_ids) -> bool:
    if not getattr(topk_ids, "is_cuda", False):
        return False
    import torch  # lazy: vLLM has it

    return bool(torch.cuda.is_current_stream_capturing())


def install_split(split: VllmSplit, router_module=None, state_module=None) -> VllmSplit:
    """Patch vLLM's router and map commits for the split (once per process: a second call is a no-op).

    router_module / state_module: the modules holding `BaseRouter` and the commit functions (default: vLLM's)."""
    router_module = router_module or importlib.import_module(ROUTER_MODULE)
    state_module = state_module or importlib.import_module(STATE_MODULE)
    router = router_module.BaseRouter
    if getattr(router._apply_eplb_mapping, "moe_place_entry", None) is not None:
        return split
    original = router._apply_eplb_mapping
    ubatch = getattr(router_module, "dbo_current_ubatch_id", None)
    if ubatch is not None:
        split.ubatch = ubatch

    def _apply_eplb_mapping(self, topk_ids):
        return split.route(self, original, topk_ids)

    _apply_eplb_mapping.moe_place_entry = "vllm.router"
    _apply_eplb_mapping.moe_place_wraps = original
    split.patches.append((router, "_apply_eplb_mapping", original))
    router._apply_eplb_mapping = _apply_eplb_mapping
    for name, layer_argument in zip(COMMITS, (False, True)):
        commit = getattr(state_module, name)

        def committed(*args, _commit=commit, _per_layer=layer_argument, **kwargs):
            _commit(*args, **kwargs)   # vLLM's own commit, as vLLM called it (it passes the maps by keyword)
            split.adopt(*_commit_arguments(args, kwargs, _per_layer))

        committed.moe_place_entry = "vllm.commit"
        committed.moe_place_wraps = commit
        split.patches.append((state_module, name, commit))
        setattr(state_module, name, committed)
    return split


def _commit_arguments(args: tuple, kwargs: dict, per_layer: bool) -> tuple[Any, list[int] | None]:
    """(model_state, the layers committed: None for all) of a call `_commit_eplb_maps[_for_layer](model_state,
    new_physical_to_logical_map[, layer])`, positional or by keyword."""
    model_state = args[0] if args else kwargs.get("model_state")
    if not per_layer:
        return model_state, None
    layer = args[2] if len(args) > 2 else kwargs.get("layer")
    return model_state, None if layer is None else [int(layer)]


def uninstall_split(split: VllmSplit) -> None:
    """Undo `install_split`."""
    for owner, name, original in reversed(split.patches):
        setattr(owner, name, original)
    split.patches.clear()
