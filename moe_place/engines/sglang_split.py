"""SGLang adapter, the per-batch split: moe-place's solver behind SGLang's own `lp` dispatch path.

SGLang 0.5.23's `--ep-dispatch-algorithm lp` (`srt/eplb/lplb_solver.py`): `init_lplb_solvers`
(`srt/model_executor/model_runner_components/moe_ep_setup.py`, at start and after every expert-location update)
builds one `LPLBSolver(phy2log, log2phy, num_gpus, ep_group, logical_to_all_physical_map_num_valid)` per layer;
in each forward pass the top-k (`srt/layers/moe/topk.py`, on CUDA) calls `solver.solve(topk_ids)` (count, an
all-reduce over the EP group, an LP on the GPU: `log2phy_prob [E, X]`), and `topk_ids_logical_to_physical` draws
each dispatch's replica with those probabilities (`expert_location_dispatch._topk_ids_logical_to_physical_
probability`, a CUDA kernel). A rank with no tokens calls `solve` on an empty batch (`TopK.empty_topk_output`), so
the all-reduce completes; SGLang allows `lp` only for the model classes it validated that way
(`assert_lplb_supported_model`), and needs Hopper and Math-DX for its kernels.

With `MOE_PLACE_SPLIT=per-batch` (and the rule, `MOE_PLACE_SGLANG=1`), the start-up hook
(`moe_place.engines.sglang_startup`) puts, as SGLang imports the modules (`install_setup`, `install_dispatch`):
- `SplitLPSolver` in `moe_ep_setup.LPLBSolver`'s place: `solve` counts, all-reduces (`ep_group.all_reduce`, a sum;
  float32 as SGLang's own) and splits the batch (`moe_place.engines.batch_split`): every rank gets the same
  shares; it returns `log2phy_prob` = shares / counts (SGLang's meaning) and keeps the shares. On a layer whose
  split flag is off it neither counts nor all-reduces;
- a probability dispatch that, for a solver of ours, sends this rank's dispatches to the slots by moe-place's
  rank-phased mapping of the shares (`map_dispatches`: each rank within one dispatch of its share, where drawing
  with the probabilities would not be); where the flag is off, or the split failed (one warning), SGLang's own
  `dynamic` dispatch (a uniform replica per dispatch; SGLang builds no `static` table with `lp`);
- `init_lplb_solvers` wrapped: after SGLang's own, the split's flags are adopted (`SplitFlags.adopt`, the least
  over the EP group by one all-reduce; every rank rebuilds its solvers at the same pass);
- SGLang's model gate kept where its deadlock is real: with attention DP (a DP rank may be idle and must reach
  `solve` through `empty_topk_output`) a model outside SGLang's list is refused at start, as SGLang refuses it;
  without attention DP every rank runs each forward pass, and the gate is lifted (docs/sglang.md says what a
  model must do: reach the top-k on every rank in every forward pass).
No Hopper, Math-DX or CUDA kernel of SGLang's is needed; SGLang takes the `lp` path only on CUDA GPUs.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moe_place.engines.batch_split import FLAGS, map_dispatches, split_step
from moe_place.engines.guard import LOG, Guard, ensure_handler
from moe_place.engines.sglang_managers import DISPATCH_MODULE, SETUP_MODULE
from moe_place.engines.tensors import to_numpy

__all__ = ["SglangSplit", "SplitLPSolver", "adopt_flags", "attention_dp_enabled", "dispatch", "install_dispatch",
           "install_setup", "sglang_dispatch_algorithm", "uninstall_split"]

SOLVER_MODULE = "sglang.srt.eplb.lplb_solver"
RUNTIME_MODULE = "sglang.srt.runtime_context"


@dataclass
class SglangSplit:
    """The split installed into SGLang: its guard and what was patched (owner, attribute, original)."""

    guard: Guard = field(default_factory=lambda: Guard("SGLang"))
    patches: list = field(default_factory=list)


class SplitLPSolver:
    """SGLang's `LPLBSolver` interface with moe-place's split (module note). One per layer.

    phy2log: int `[P]`; log2phy: int `[E, X]` (-1 padded); num_gpus: the EP size; ep_group: SGLang's
    `GroupCoordinator` (`all_reduce`, `rank_in_group`), None for one rank. on: the layer's split flag (set by
    the wrapped `init_lplb_solvers`). shares: the last batch's split, int64 `[P]` (None: flag off or failed).
    split: the installation whose guard logs (`install_setup` makes the subclass SGLang builds, bound to it).
    """

    split: SglangSplit | None = None

    def __init__(self, phy2log, log2phy, num_gpus: int, ep_group=None, logical_to_all_physical_map_num_valid=None):
        import torch  # lazy: SGLang has it

        self.num_gpus = int(num_gpus)
        self.ep_group = ep_group
        self.row, self.log2phy = to_numpy(phy2log, np.int64, copy=True), to_numpy(log2phy, np.int64, copy=True)
        self.num_logical = self.log2phy.shape[0]
        if len(self.row) % self.num_gpus:
            raise ValueError(f"SplitLPSolver: {len(self.row)} slots do not split over {self.num_gpus} GPUs")
        self.rank = 0 if ep_group is None else int(ep_group.rank_in_group)
        self.on = False
        self.shares: np.ndarray | None = None
        self._prob = torch.zeros(tuple(log2phy.shape), dtype=torch.float32, device=phy2log.device)
        self._prob.moe_place_solver = self   # the dispatch finds the solver (and its shares) through its answer

    def solve(self, topk_ids):
        """`log2phy_prob [E, X]` (float32): the batch's split as probabilities; every rank calls it on every
        forward pass, with an empty batch where it has no tokens (SGLang's contract)."""
        self.shares = None
        if not self.on:
            return self._prob
        return self.split.guard.call("sglang.lplb_solve", lambda: self._solve(topk_ids), lambda: self._prob)

    def _solve(self, topk_ids):
        import torch  # lazy: SGLang has it

        def all_reduce(local):
            summed = local.float()
            return summed if self.ep_group is None else self.ep_group.all_reduce(summed)

        done = split_step(topk_ids, self.num_logical, self.row, self.num_gpus, all_reduce, self.split.guard,
                          "sglang.lplb_solve")
        if done is None:
            return self._prob
        counts, shares = done
        valid = self.log2phy >= 0
        per = np.where(valid, shares[np.maximum(self.log2phy, 0)], 0).astype(np.float64)
        even = valid / np.maximum(valid.sum(axis=1, keepdims=True), 1)
        prob = np.where(counts[:, None] > 0, per / np.maximum(counts[:, None], 1), even)
        self._prob.copy_(torch.from_numpy(prob.astype(np.float32)))
        self.shares = shares
        return self._prob


def dispatch(original, dynamic, topk_ids, info, log2phy_prob):
    """SGLang's `_topk_ids_logical_to_physical_probability`, for a solver of ours: its shares mapped (module
    note); SGLang's dynamic dispatch where its flag is off or the split failed; SGLang's own for other solvers."""
    solver = getattr(log2phy_prob, "moe_place_solver", None)
    if solver is None:
        return original(topk_ids, info, log2phy_prob)
    if solver.shares is None:
        return dynamic(topk_ids, info)
    return solver.split.guard.call("sglang.lplb_dispatch", lambda: map_dispatches(topk_ids, solver.row, solver.shares,
                                                                           solver.rank, solver.num_gpus),
                            lambda: dynamic(topk_ids, info))


def adopt_flags(split: SglangSplit) -> None:
    """After SGLang (re)built its solvers: the rule's flags, agreed over the EP group, set on each layer's solver."""
    solvers = split.guard.call("sglang.lplb_init", _our_solvers, lambda: {})
    if not solvers:   # no solver of ours on this rank: none on any (one map, one build)
        return
    first = next(iter(solvers.values()))
    key = (max(solvers) + 1, first.num_logical)

    def agree(proposal: np.ndarray) -> np.ndarray:
        import torch  # lazy: SGLang has it

        votes = torch.from_numpy(proposal.astype(np.float32)).to(first._prob.device)
        total = votes if first.ep_group is None else first.ep_group.all_reduce(votes)
        size = 1 if first.ep_group is None else int(first.ep_group.world_size)
        return (to_numpy(total) >= size - 0.5).astype(np.int32)   # every rank said yes

    flags = split.guard.call("sglang.lplb_init", lambda: FLAGS.adopt(key, range(key[0]), agree),
                             lambda: np.zeros(key[0], dtype=bool))
    for layer, solver in solvers.items():
        solver.on = bool(flags[layer])


def _our_solvers() -> dict:
    table = importlib.import_module(SOLVER_MODULE).get_resources().lplb_solvers
    return {int(layer): s for layer, s in table.items() if isinstance(s, SplitLPSolver)}


def attention_dp_enabled() -> bool | None:
    """Whether the running SGLang uses attention DP (`get_parallel().attn_dp_enabled`); None outside a server."""
    try:
        return bool(importlib.import_module(RUNTIME_MODULE).get_parallel().attn_dp_enabled)
    except Exception:  # noqa: BLE001 - no SGLang, or no server context in this process
        return None


def install_setup(split: SglangSplit, setup=None) -> SglangSplit:
    """Put the split's solver, its flag adoption and the model gate into SGLang's `moe_ep_setup` (`setup`,
    default SGLang's, imported): module note. Done where the module is imported (`sglang_startup`), before
    SGLang's model runner binds `init_lplb_solvers`. A second call is a no-op."""
    setup = setup or importlib.import_module(SETUP_MODULE)
    if getattr(setup.init_lplb_solvers, "moe_place_entry", None) is not None:
        return split
    solver_class = type("SplitLPSolver", (SplitLPSolver,), {"split": split})
    init, gate = setup.init_lplb_solvers, setup.assert_lplb_supported_model

    def init_lplb_solvers(*args, **kwargs):
        init(*args, **kwargs)        # SGLang's own: builds our solvers (its LPLBSolver name is ours)
        adopt_flags(split)

    def assert_lplb_supported_model(architecture: str) -> None:
        try:
            gate(architecture)
        except NotImplementedError:
            if attention_dp_enabled() is not False:   # a DP rank may be idle: SGLang's reason holds
                raise
            ensure_handler()   # every rank runs each forward pass: no idle rank to wait on
            LOG.info("moe-place: SGLang's lp path runs moe-place's split for %s, outside SGLang's validated models "
                     "(no attention DP: every rank reaches the top-k in each forward pass)", architecture)

    init_lplb_solvers.moe_place_entry = "sglang.lplb_init"
    assert_lplb_supported_model.moe_place_entry = "sglang.lplb_init"
    _patch(split, setup, {"LPLBSolver": solver_class, "init_lplb_solvers": init_lplb_solvers,
                          "assert_lplb_supported_model": assert_lplb_supported_model})
    return split


def install_dispatch(split: SglangSplit, dispatcher=None) -> SglangSplit:
    """Put the split's mapping into SGLang's probability dispatch (`expert_location_dispatch`, default SGLang's,
    imported): for a solver of ours, its shares; else SGLang's own. A second call is a no-op."""
    dispatcher = dispatcher or importlib.import_module(DISPATCH_MODULE)
    probability = dispatcher._topk_ids_logical_to_physical_probability
    if getattr(probability, "moe_place_entry", None) is not None:
        return split

    def _topk_ids_logical_to_physical_probability(topk_ids, info, log2phy_prob):
        return dispatch(probability, dispatcher._topk_ids_logical_to_physical_dynamic, topk_ids, info, log2phy_prob)

    _topk_ids_logical_to_physical_probability.moe_place_entry = "sglang.lplb_dispatch"
    _patch(split, dispatcher, {"_topk_ids_logical_to_physical_probability": _topk_ids_logical_to_physical_probability})
    return split


def _patch(split: SglangSplit, owner, values: dict) -> None:
    for name, value in values.items():
        split.patches.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)


def uninstall_split(split: SglangSplit) -> None:
    """Undo `install_setup` and `install_dispatch`."""
    for owner, name, original in reversed(split.patches):
        setattr(owner, name, original)
    split.patches.clear()


def sglang_dispatch_algorithm() -> Any:
    """SGLang's `--ep-dispatch-algorithm` of the running server, or None outside one."""
    try:
        return importlib.import_module(RUNTIME_MODULE).get_exec().moe.ep_dispatch_algorithm
    except Exception:  # noqa: BLE001 - no SGLang, or no server context in this process
        return None
