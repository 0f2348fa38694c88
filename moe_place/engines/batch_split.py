"""The per-batch split inside the engines: one variable, `MOE_PLACE_SPLIT=per-batch`, shared by both adapters.

Per MoE layer and batch, on every rank of the EP group (`moe_place.split` is the spec):

    local [E]   = this rank's dispatches per logical expert          (`count_dispatches`)
    counts [E]  = all-reduce(local) over the EP group                the batch's global dispatches
    shares [P]  = split_shares(row, counts, G)                       the same on every rank (same counts in)
    slots [T,k] = map_tokens(topk_ids, rank, row, shares)            this rank's dispatches to slots

`split_of` and `map_dispatches` are the last two lines (`split_step` the middle three); on the CPU (and, until moe-place's kernels are merged, on the GPU) it runs
`moe_place.split`'s numpy reference, so the engines' code can be driven on a CPU. Where the adapters call it:
vLLM's router (`moe_place.engines.vllm_split`), SGLang's `lp` dispatch path (`moe_place.engines.sglang_split`).

Which layers split: the rule's per-layer choice (`moe_place.online.splitting.SplitChoice`), made at each policy
call (`moe_place.engines.session.RuleSession`), where the split saves more than its all-reduce and solve cost.
Every rank makes the policy call on the same all-reduced window, so every rank proposes the same flags; the
engine's forward pass must still switch them at the same step on every rank, or one rank all-reduces a layer
whose peers do not (a collective that never completes). So a call's flags are only offered (`SplitFlags.offer`)
and are taken up where the engine installs a new map, which every rank does at the same step (vLLM commits a
layer's map in lockstep; SGLang rebuilds its LP solvers after every update), through one all-reduce taking
the least flag of every rank (`SplitFlags.adopt`): a layer splits only where every rank says so. Before the
first policy call no layer splits.

`SplitFlags` is the one registry both the policy (vLLM's async worker thread, SGLang's EPLB manager) and the
forward pass read: the engines give no other channel between them (as `ENGINE_MODELS`, one per process).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from moe_place.engines.guard import Guard
from moe_place.engines.tensors import to_numpy
from moe_place.errors import InputError
from moe_place.split import map_tokens, split_shares

__all__ = ["SplitFlags", "check_split_setting", "count_dispatches", "map_dispatches", "split_enabled", "split_of",
           "split_step"]

SPLIT_ENV = "MOE_PLACE_SPLIT"
SPLIT_MODES = ("even", "per-batch")   # even (or unset): the engine's own replica choice, as without moe-place


def split_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """True when `MOE_PLACE_SPLIT` is "per-batch"; False when unset, empty or "even"; InputError otherwise."""
    value = (os.environ if environ is None else environ).get(SPLIT_ENV, "") or "even"
    if value not in SPLIT_MODES:
        raise InputError(SPLIT_ENV, f"one of {', '.join(SPLIT_MODES)} (unset: even)", repr(value))
    return value == "per-batch"


def check_split_setting(rule_on: bool, rule_variable: str, environ: Mapping[str, str] | None = None) -> bool:
    """`split_enabled`, checked at start-up: the split needs the rule (its per-layer choice), so
    `MOE_PLACE_SPLIT=per-batch` without the rule's variable (`rule_variable`) is an InputError."""
    enabled = split_enabled(environ)
    if enabled and not rule_on:
        raise InputError(SPLIT_ENV, f"per-batch only with moe-place's rule ({rule_variable}): the rule chooses the "
                         "layers where the split pays", "per-batch without it")
    return enabled


def count_dispatches(topk_ids, num_experts: int):
    """int64 `[E]` torch tensor on `topk_ids`' device: this rank's dispatches per logical expert (ids outside
    `[0, E)`, the engines' padding, are not counted)."""
    import torch  # lazy: the engines have torch; moe-place's core does not need it

    ids = topk_ids.reshape(-1).long()
    valid = (ids >= 0) & (ids < num_experts)
    return torch.zeros(num_experts, dtype=torch.int64, device=ids.device).index_add_(
        0, ids.clamp(0, num_experts - 1), valid.long())


def split_of(counts, row, num_ranks: int) -> np.ndarray:
    """int64 `[P]`: the batch's split of the global `counts` (int `[E]`, the all-reduced `count_dispatches`)
    over the layer's map `row` (int `[P]`, slot `p` on rank `p // (P / num_ranks)`); every rank gets the same
    shares from the same counts. moe-place's numpy reference (`moe_place.split.split_shares`): the GPU kernels
    (`moe_place.kernels.split`) take the CUDA path once merged, here and in `map_dispatches`."""
    return split_shares(to_numpy(row, np.int64), to_numpy(counts, np.int64), num_ranks)


def map_dispatches(topk_ids, row, shares, rank: int, num_ranks: int):
    """Slots like `topk_ids` (int `[T, k]`, this rank's dispatches; ids outside `[0, E)` map to -1), given the
    batch's `shares` (`split_of`): `moe_place.split.map_tokens` for this rank."""
    import torch  # lazy: see count_dispatches

    phy2log, share = to_numpy(row, np.int64), to_numpy(shares, np.int64)
    experts = int(phy2log.max()) + 1
    ids = to_numpy(topk_ids, np.int64)
    valid = (ids >= 0) & (ids < experts)
    slots = np.full(ids.shape, -1, dtype=np.int64)
    if valid.any():    # a rank's dispatches in token order, as map_tokens reads [T, k]
        mapped = map_tokens(ids[valid][:, None], np.full(int(valid.sum()), rank), phy2log, share, num_ranks)
        slots[valid] = mapped[:, 0]
    return torch.from_numpy(slots).to(device=topk_ids.device, dtype=topk_ids.dtype)


def split_step(topk_ids, num_experts: int, row, num_ranks: int, all_reduce: Callable, guard: Guard, entry: str):
    """(global counts int64 `[E]`, shares int64 `[P]`): the all-reduce of this rank's counts (`all_reduce(local)`
    returns the sum over the EP group) and the batch's split, or None where anything failed (the caller then
    takes the engine's own choice; the guard has logged why). The all-reduce runs whatever happens before it:
    a rank that failed to count joins it with zeros, so its peers never wait on it."""
    import torch  # lazy: see count_dispatches

    local = guard.call(entry, lambda: count_dispatches(topk_ids, num_experts), lambda: None)
    counted = local is not None
    if not counted:
        local = torch.zeros(num_experts, dtype=torch.int64, device=topk_ids.device)
    total = guard.call(entry, lambda: all_reduce(local), lambda: None)
    if total is None or not counted:
        return None
    return guard.call(entry, lambda: (to_numpy(total, np.int64), split_of(total, row, num_ranks)), lambda: None)


@dataclass
class SplitFlags:
    """The split's per-layer flags of each model (key: `(num_layers, num_experts)`): the rule's last choice
    (`offer`) and the flags the forward pass runs (`adopt`, `is_on`). Module note."""

    pending: dict = field(default_factory=dict)    # key -> bool [layers], the last policy call's
    adopted: dict = field(default_factory=dict)    # key -> bool [layers], what the forward pass runs

    def offer(self, key: tuple[int, int], flags) -> None:
        """The rule's choice of one call, to be adopted where the engine installs a map."""
        self.pending[key] = np.array(flags, dtype=bool)

    def adopt(self, key: tuple[int, int], layers, agree: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """Take up the offered flags of `layers` (indices) through `agree` (the least over the EP group, int32
        `[layers]` in and out; every rank calls it at the same step); returns the flags now in force."""
        num_layers = key[0]
        proposal = self.pending.get(key)
        if proposal is None or proposal.shape != (num_layers,):
            proposal = np.zeros(num_layers, dtype=bool)
        agreed = np.asarray(agree(proposal.astype(np.int32))) > 0
        now = self.adopted.get(key)
        now = np.zeros(num_layers, dtype=bool) if now is None else now.copy()
        now[np.asarray(layers, dtype=np.int64)] = agreed[np.asarray(layers, dtype=np.int64)]
        self.adopted[key] = now
        return now

    def is_on(self, key: tuple[int, int], layer: int) -> bool:
        flags = self.adopted.get(key)
        return flags is not None and 0 <= layer < len(flags) and bool(flags[layer])

    def clear(self, key: tuple[int, int]) -> None:
        self.pending.pop(key, None)
        self.adopted.pop(key, None)


FLAGS = SplitFlags()
