"""Drive moe-place's per-batch split (`MOE_PLACE_SPLIT=per-batch`) through the real engines' code on a CPU, over
gloo ranks, and record what ran in the engine's code and what was stood in.

Run it with an engine's Python and the overlay of this checkout (`bench/engine_overlay.sh`):

    bash bench/engine_overlay.sh /work/engine-venvs/vllm/bin/python /tmp/overlay-vllm
    PYTHONPATH=/tmp/overlay-vllm /work/engine-venvs/vllm/bin/python bench/check_split_engines.py --engine vllm \
        --out bench/results/split_engines_vllm.json --force
    bash bench/engine_overlay.sh /work/engine-venvs/sglang/bin/python /tmp/overlay-sglang
    PYTHONPATH=/tmp/overlay-sglang /work/engine-venvs/sglang/bin/python bench/check_split_engines.py --engine sglang \
        --out bench/results/split_engines_sglang.json --force

Each prints its checks; `--out` writes the record (bench/results/split_engines_{engine}.json). Two EP ranks, each a process spawned
as the engines spawn theirs, joined by a gloo group (60 s timeout: a hang fails, it does not wait); the 3-rank
runs are CI's, on the stand-ins (tests/test_engines_split.py). Two, because the model's map is built for two: with
three ranks the hot experts sit on a rank that holds no replica, and the rule, rightly, leaves the split off.
The model: 2 MoE layers, 8 experts on 12 slots (experts 0-3 twice), the hot experts 4 and 5 on rank 0 beside a
replica of each of 0-3, so the engines' even split of 0-3 overloads rank 0; moe-place's rule may not move a slot
(`MOE_PLACE_MAX_MOVED_SLOTS=0`), so what changes is the split alone.

vLLM 0.33.0 (`--engine vllm`), in vLLM's code: `EplbState` (`add_model`, `step`, `rearrange` in sync mode with its
all-reduce of the load window over the gloo group, `_commit_eplb_maps`), `MixtureOfExperts.set_eplb_state`,
`EplbLayerState` (`set_layer_state`, `_propagate_shared_tensors`), the policy registry (moe-place's `install()`), and
a router of vLLM's `BaseRouter` class (`select_experts` -> `_select_experts` -> `_validate_eplb_state` ->
`_apply_eplb_mapping`, where moe-place's split sits). Stood in: the EP group accessor (`get_ep_group`: the gloo
world group; `get_eplb_group` too), `get_node_count`, the EPLB communicator and the weight copies (`rearrange_expert_weights_inplace`:
no weights move on a CPU), `torch.Event`, the router's top-k (`_compute_routing`: a plain softmax top-k; vLLM's
needs its custom ops), the expert weights (meta tensors), and the load vLLM's CUDA kernel records before the
split is on (on a CPU vLLM's mapping returns the ids and records nothing: the script adds the counts its hash
would choose, `inengine.standins.eplb_map_to_physical_and_record`).

SGLang 0.5.23 (`--engine sglang`), in SGLang's code: `moe_ep_setup.init_lplb_solvers` (with moe-place's solver in
its `LPLBSolver` name, as the start-up hook installs it), the solvers' registry (`get_resources().lplb_solvers`),
`ExpertLocationMetadata` and its global, `ExpertLocationDispatchInfo`, `topk._post_process_topk_ids` (its CUDA
branch: the solve and `topk_ids_logical_to_physical`, the padded-row mask), the dynamic dispatch, and SGLang's
`eplb_algorithms` module with moe-place's hook (`install_rebalance_hook`). Stood in: the EP group coordinator (an
`all_reduce` over the gloo group: SGLang's own needs its distributed set-up), the CUDA test in the top-k
(`topk._is_cuda` set for the call: SGLang takes the lp path only on CUDA), the window the EPLB manager would
hand the rule (the counts each rank routed, summed), and the idle rank's `TopK` (SGLang's constructor needs a
server's published config: the object gets the fields `empty_topk_output` reads; SGLang's method runs its solve,
then stops at SGLang's TP group, which a CPU run has not built). The model gate runs with
`get_parallel().attn_dp_enabled` set both ways (every rank: the flags' adoption is a collective).

Checks (PASS/FAIL each; exit 1 if any fails): the rule's split choice at the engine's policy call turns the
layers on, adopted alike on every rank; every rank computes the same shares; each rank sends each slot within
one dispatch of its part of the share, and per expert the ranks' rows are the counts; the last rank, with no
tokens on one batch, joins the all-reduce; vLLM records the slots chosen into its `expert_load_view` (padded
tokens left out); SGLang's gate refuses a model outside its list under attention DP only; a raise inside the
split on rank 0 gives the engine's own choice there with one warning while the other ranks split. It also prints
and records the busiest rank's rows per batch and layer under the split, under the engine's own choice, and the
lower bound of any split (`moe_place.split.split_lower_bound`).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import socket
import sys
import time
import types
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path
from unittest import mock

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from records import add_record_options, missed_targets, refuse_overwrite, write_record  # noqa: E402

RESULTS = BENCH / "results"
LAYERS, EXPERTS, SLOTS, TOP_K, RANKS = 2, 8, 12, 2, 2
HOT = [3, 3, 3, 3, 6, 6, 0.1, 0.1]     # expert popularity: 4 and 5 hottest, 0-3 replicated
TOKENS = 600                           # tokens per rank and batch
BATCHES = 3
ENV = {"MOE_PLACE_SPLIT": "per-batch", "MOE_PLACE_MAX_MOVED_SLOTS": "0", "MOE_PLACE_VLLM_POLICY": "default"}


def batch(rank: int, step: int, tokens: int = TOKENS):
    """int32 `[tokens, TOP_K]`: rank `rank`'s top-k ids in batch `step` (distinct experts per token)."""
    import numpy as np
    import torch

    rng = np.random.default_rng([rank, step])
    weights = np.asarray(HOT) / sum(HOT)
    rows = [rng.choice(EXPERTS, TOP_K, replace=False, p=weights) for _ in range(tokens)]
    ids = np.stack(rows) if rows else np.zeros((0, TOP_K), dtype=np.int64)
    return torch.from_numpy(ids.reshape(tokens, TOP_K).astype(np.int32))


def logits_for(ids):
    """Router logits whose top-k are `ids`, in order."""
    import torch

    logits = torch.zeros((len(ids), EXPERTS))
    logits.scatter_(1, ids.long(), torch.arange(TOP_K, 0, -1, dtype=torch.float).expand(len(ids), -1) + 1)
    return logits


class Coordinator:
    """The group coordinator both engines' EPLB code asks for, over the gloo world group."""

    def __init__(self):
        import torch.distributed as dist

        self.device_group = self.cpu_group = dist.group.WORLD
        self.rank_in_group, self.world_size = dist.get_rank(), dist.get_world_size()

    def all_reduce(self, tensor):
        import torch.distributed as dist

        dist.all_reduce(tensor, group=self.device_group)
        return tensor


class Warnings(logging.Handler):
    """moe-place's warning lines of this process."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _start(rank: int, size: int, port: int) -> Warnings:
    os.environ.update(ENV)
    import torch.distributed as dist

    from moe_place.online import splitting
    # these checks drive the engines' plumbing at an 8-step cadence on 2 tiny layers, where the choice's CPU
    # budget (0.2% of the layers' time until the next call) affords no layer: lifted here; bench_split prices it
    splitting.CHOICE_CPU_SHARE = 1e6

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=60))
    handler = Warnings()
    logging.getLogger("moe_place.engines").addHandler(handler)
    return handler


def _spy(report: dict):
    """Record every split's shares (`batch_split.split_of`) in `report["shares"]`; returns the real function."""
    from moe_place.engines import batch_split

    real = batch_split.split_of

    def split_of(counts, row, num_ranks):
        shares = real(counts, row, num_ranks)
        report.setdefault("shares", []).append(shares.tolist())
        return shares

    batch_split.split_of = split_of
    return real


# ---------------------------------------------------------------------- vLLM
def vllm_rank(rank: int, size: int, port: int, queue) -> None:
    warned = _start(rank, size, port)
    import numpy as np
    import torch
    import torch.distributed as dist
    from vllm.config import ParallelConfig
    from vllm.config.parallel import EPLBConfig
    from vllm.distributed import parallel_state
    from vllm.distributed.eplb import eplb_state
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
    from vllm.model_executor.models.interfaces import MixtureOfExperts

    from inengine import standins
    from moe_place.engines import batch_split
    from moe_place.engines import vllm as adapter
    from moe_place.engines.batch_split import FLAGS

    def plain_top_k(self, hidden_states, router_logits, *_, **__):
        weights, ids = torch.softmax(router_logits.float(), dim=-1).topk(self.top_k, dim=-1)
        return weights.to(hidden_states.dtype), ids.to(torch.int32)

    # vLLM's BaseRouter with a plain top-k as its routing (vLLM's fused top-k needs its custom ops); the routing
    # method type is read by vLLM's kernels' set-up only
    Router = type("Router", (BaseRouter,), {"_compute_routing": plain_top_k, "routing_method_type": None})

    class Layer:
        def __init__(self):
            shape = standins.get_model("Qwen3-30B-A3B")
            self.weights = standins.expert_weight_tensors(shape, SLOTS // size)
            self.eplb_state = eplb_state.EplbLayerState()
            self.router = Router(TOP_K, EXPERTS, eplb_state=self.eplb_state)

        def get_expert_weights(self):
            return self.weights

        def set_eplb_state(self, moe_layer_idx, expert_load_view, logical_to_physical_map, logical_replica_count):
            self.eplb_state.set_layer_state(moe_layer_idx, expert_load_view, logical_to_physical_map,
                                            logical_replica_count)

    coordinator = Coordinator()
    report = {"rank": rank}
    with ExitStack() as stack:
        for owner, name, value in ((eplb_state, "get_ep_group", lambda: coordinator),
                                   (eplb_state, "get_eplb_group", lambda: coordinator),
                                   (parallel_state, "get_ep_group", lambda: coordinator),
                                   (eplb_state, "get_node_count", lambda: 1),
                                   (eplb_state, "create_eplb_communicator", lambda **_: types.SimpleNamespace()),
                                   (eplb_state, "rearrange_expert_weights_inplace", lambda *a, **k: None),
                                   (torch, "Event", standins.NoDeviceEvent), (eplb_state, "PIN_MEMORY", False)):
            stack.enter_context(mock.patch.object(owner, name, value))
        handle = adapter.install()
        stack.callback(adapter.uninstall, handle)
        config = ParallelConfig(enable_expert_parallel=True, eplb_config=EPLBConfig(
            window_size=8, step_interval=8, use_async=False, communicator="torch_gloo"))
        state = eplb_state.EplbState(config, torch.device("cpu"))
        model = type("CheckMoE", (MixtureOfExperts,), {})()
        model.num_moe_layers, model.num_expert_groups = LAYERS, 1
        model.num_logical_experts = model.num_routed_experts = EXPERTS
        model.num_redundant_experts, model.num_physical_experts = SLOTS - EXPERTS, SLOTS
        model.num_local_physical_experts, model.num_shared_experts = SLOTS // size, 0
        model.moe_layers = [Layer() for _ in range(LAYERS)]
        state.add_model(model, types.SimpleNamespace(model="Qwen3-30B-A3B", hf_text_config=standins.hf_config_of(
            standins.get_model("Qwen3-30B-A3B")), compute_hash=lambda: "check-split"))
        model_state = next(iter(state.model_states.values()))
        report["start_map"] = model_state.physical_to_logical_map.tolist()
        # steps before the first rearrangement (vLLM's counter starts a quarter interval before it): the load
        # vLLM's CUDA kernel would record for its own choice (on a CPU its mapping records nothing)
        steps = 0
        while not any(FLAGS.is_on((LAYERS, EXPERTS), layer) for layer in range(LAYERS)) and steps < 8:
            model_state.num_unpadded_tokens_tensors[0].fill_(TOKENS * 10)
            for layer, moe in enumerate(model.moe_layers):
                ids = batch(rank, 100 + steps, TOKENS * 10)
                standins.eplb_map_to_physical_and_record(
                    ids, moe.eplb_state.expert_load_view, moe.eplb_state.logical_to_physical_map,
                    moe.eplb_state.logical_replica_count, moe.eplb_state.should_record_tensor)
            state.step()
            steps += 1
        report["steps_to_flags"] = steps
        report["flags"] = [FLAGS.is_on((LAYERS, EXPERTS), layer) for layer in range(LAYERS)]
        report["map"] = model_state.physical_to_logical_map.tolist()
        real_split_of = _spy(report)
        report["slots"], report["recorded"], report["batches"] = [], [], []
        for step in range(BATCHES):
            ids = batch(rank, step) if not (step == 1 and rank == size - 1) else batch(rank, step, 0)
            unpadded = max(len(ids) - 7, 0)
            model_state.expert_load_pass.zero_()
            model_state.num_unpadded_tokens_tensors[0].fill_(unpadded)
            slots = [moe.router.select_experts(torch.zeros(len(ids), 4), logits_for(ids))[1]
                     for moe in model.moe_layers]
            report["batches"].append(ids.tolist())
            report["slots"].append([s.tolist() for s in slots])
            report["recorded"].append(model_state.expert_load_pass.tolist())
            report["unpadded"] = unpadded
        # a raise inside rank 0's split: vLLM's own mapping there (on a CPU: the ids as they are), one warning
        if rank == 0:
            batch_split.split_of = lambda *a: (_ for _ in ()).throw(RuntimeError("rank 0's solve broke"))
        ids = batch(rank, 50)
        report["fallback"] = [[moe.router.select_experts(torch.zeros(len(ids), 4), logits_for(ids))[1].tolist()
                               for moe in model.moe_layers] for _ in range(2)]
        report["fallback_ids"] = ids.tolist()
        batch_split.split_of = real_split_of
        report["warnings"] = warned.lines
        report["rank_in_vllm_group"] = int(state_group_rank(eplb_state))
        report["np"] = np.__version__
    dist.destroy_process_group()
    queue.put(report)


def state_group_rank(eplb_state) -> int:
    return eplb_state.get_ep_group().device_group.rank()


# ---------------------------------------------------------------------- SGLang
def sglang_rank(rank: int, size: int, port: int, queue) -> None:
    warned = _start(rank, size, port)
    import numpy as np
    import torch
    import torch.distributed as dist
    from sglang.srt.eplb import eplb_algorithms, expert_location, expert_location_dispatch, lplb_solver
    from sglang.srt.layers.moe import topk as topk_module
    from sglang.srt.model_executor.model_runner_components import moe_ep_setup
    from sglang.srt.runtime_context import get_parallel

    from inengine import standins
    from moe_place.engines import batch_split, sglang as adapter, sglang_split
    from moe_place.engines.batch_split import FLAGS

    coordinator = Coordinator()
    report = {"rank": rank}
    split = sglang_split.SglangSplit()
    sglang_split.install_setup(split, moe_ep_setup)
    sglang_split.install_dispatch(split, expert_location_dispatch)
    phy2log = torch.tensor([list(range(EXPERTS)) + [0, 1, 2, 3]] * LAYERS)
    log2phy, count = standins.compute_logical_maps(phy2log, EXPERTS, SLOTS)
    metadata = expert_location.ExpertLocationMetadata(
        physical_to_logical_map=phy2log, physical_to_logical_map_cpu=phy2log, logical_to_all_physical_map=log2phy,
        logical_to_all_physical_map_cpu=log2phy, logical_to_all_physical_map_num_valid=count, ep_size=size,
        logical_to_rank_dispatch_physical_map=None)
    expert_location.set_global_expert_location_metadata(metadata, allow_overwrite=True)
    try:
        get_parallel().override_permanently(moe_ep_group=coordinator)
        report["ep_group_in_sglang"] = True
    except Exception as exc:  # noqa: BLE001 - SGLang refuses a field: stand in the accessor SGLang's setup reads
        report["ep_group_in_sglang"] = f"{type(exc).__name__}: {exc}"
        moe_ep_setup.get_parallel = lambda: types.SimpleNamespace(moe_ep_group=coordinator)
    # the rule's call, as SGLang's EPLB manager makes it: every rank, the same all-reduced per-pass window
    window = torch.stack([torch.bincount(batch(r, 100 + p, TOKENS * 10).reshape(-1).long(), minlength=EXPERTS)
                          for p in range(8) for r in range(size)]).reshape(8, size, EXPERTS).sum(1)
    window = window[:, None, :].expand(8, LAYERS, EXPERTS).contiguous()
    hook = adapter.PaybackRebalance(current_map=lambda: phy2log, interval=lambda: 8, migration=lambda: "stall",
                                    engine_model=lambda *a: None)
    handle = adapter.install_rebalance_hook(hook)
    answer = eplb_algorithms.rebalance_experts(window, SLOTS, SLOTS // size, None, 1,
                                               eplb_algorithms.EplbAlgorithm.deepseek)
    report["map"] = answer[0].tolist()
    report["offered"] = FLAGS.pending[(LAYERS, EXPERTS)].tolist()
    config = types.SimpleNamespace(hf_config=types.SimpleNamespace(architectures=["DeepseekV3ForCausalLM"]))
    moe_ep_setup.init_lplb_solvers(model_config=config)      # SGLang's, after an update: the flags adopted
    solvers = [lplb_solver.get_global_lplb_solver(layer) for layer in range(LAYERS)]
    report["solver_class"] = [type(s).__mro__[1].__name__ for s in solvers]
    report["flags"] = [bool(s.on) for s in solvers]
    real_split_of = _spy(report)
    report["slots"], report["batches"] = [], []
    with mock.patch.object(topk_module, "_is_cuda", True):
        for step in range(BATCHES):
            empty = step == 1 and rank == size - 1
            ids = batch(rank, step, 0 if empty else TOKENS)
            out = []
            for layer in range(LAYERS):
                if empty:   # SGLang's TopK.empty_topk_output: the rank joins the all-reduce through solve
                    report["empty_call"] = empty_topk_output(topk_module, lplb_solver, layer, report)
                    out.append([])
                    continue
                info = expert_location_dispatch.ExpertLocationDispatchInfo(
                    ep_dispatch_algorithm="lp", partial_logical_to_rank_dispatch_physical_map=None,
                    partial_logical_to_all_physical_map=log2phy[layer],
                    partial_logical_to_all_physical_map_num_valid=count[layer], num_physical_experts=SLOTS)
                weights = torch.full(ids.shape, 1.0 / TOP_K)
                topk_ids, _, _ = topk_module._post_process_topk_ids(
                    ids.clone(), weights, topk_module.TopKConfig(top_k=TOP_K), logits_for(ids), layer,
                    num_token_non_padded=None, expert_location_dispatch_info=info)
                out.append(topk_ids.tolist())
            report["batches"].append(ids.tolist())
            report["slots"].append(out)
        if rank == 0:
            batch_split.split_of = lambda *a: (_ for _ in ()).throw(RuntimeError("rank 0's solve broke"))
        ids = batch(rank, 50)
        info = expert_location_dispatch.ExpertLocationDispatchInfo("lp", None, log2phy[0], count[0], SLOTS)
        report["fallback"] = [topk_module._post_process_topk_ids(
            ids.clone(), torch.full(ids.shape, 0.5), topk_module.TopKConfig(top_k=TOP_K), logits_for(ids), 0,
            num_token_non_padded=None, expert_location_dispatch_info=info)[0].tolist() for _ in range(2)]
        report["fallback_ids"] = ids.tolist()
        batch_split.split_of = real_split_of
    report["gate"] = model_gate(moe_ep_setup, get_parallel)
    report["warnings"] = warned.lines
    report["np"] = np.__version__
    adapter.uninstall_rebalance_hook(handle)
    sglang_split.uninstall_split(split)
    dist.destroy_process_group()
    queue.put(report)


def empty_topk_output(topk_module, lplb_solver, layer: int, report: dict) -> str:
    """What an idle rank's MoE layer calls (SGLang's `TopK.empty_topk_output`); where SGLang's own cannot be built
    on a CPU, the solver's `solve` on an empty batch, which is what it calls. Returns which ran."""
    import torch

    before = len(report.get("shares", []))
    try:   # TopK's constructor reads SGLang's published model config (a server's): set the fields the method reads
        topk = topk_module.TopK.__new__(topk_module.TopK)
        torch.nn.Module.__init__(topk)
        for name, value in {"layer_id": layer, "is_draft": False, "topk_config": topk_module.TopKConfig(top_k=TOP_K)}.items():
            setattr(topk, name, value)
        topk.empty_topk_output(torch.device("cpu"))
        return "SGLang's TopK.empty_topk_output"
    except Exception as exc:  # noqa: BLE001 - a CPU without SGLang's distributed set-up
        if len(report.get("shares", [])) == before:   # solve did not run before the failure: call it
            lplb_solver.get_global_lplb_solver(layer).solve(torch.empty((0, TOP_K), dtype=torch.int32))
            return f"solve(empty) (TopK.empty_topk_output failed first: {type(exc).__name__}: {exc})"
        return f"SGLang's TopK.empty_topk_output up to its solve ({type(exc).__name__} after it)"


def model_gate(moe_ep_setup, get_parallel) -> dict:
    """SGLang's model gate as the split keeps it: a model outside SGLang's list, with and without attention DP
    (`get_parallel().attn_dp_enabled`); every rank runs it (the flags' adoption is a collective)."""
    import types as _types

    config = _types.SimpleNamespace(hf_config=_types.SimpleNamespace(architectures=["Qwen3MoeForCausalLM"]))
    out = {}
    for dp in (False, True):
        try:
            get_parallel().override_permanently(attn_dp_enabled=dp)
        except Exception as exc:  # noqa: BLE001 - SGLang does not take the field: the case is not run
            out[f"attn_dp={dp}"] = f"not run ({type(exc).__name__}: {exc})"
            continue
        try:
            moe_ep_setup.init_lplb_solvers(model_config=config)
            out[f"attn_dp={dp}"] = "accepted"
        except NotImplementedError as exc:
            out[f"attn_dp={dp}"] = f"refused ({str(exc).split('.')[0]})"
    return out


# ---------------------------------------------------------------------- the parent
def run_ranks(target, size: int, timeout_s: float) -> list[dict]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=target, args=(rank, size, port, queue)) for rank in range(size)]
    for process in processes:
        process.start()
    reports = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(reports) < size:
            try:
                reports.append(queue.get(timeout=1.0))
            except Exception:  # noqa: BLE001 - queue.Empty: is every rank still alive?
                failed = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    raise RuntimeError(f"a rank failed (exit codes {[p.exitcode for p in processes]}) or the "
                                       f"ranks took more than {timeout_s:.0f} s") from None
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    return sorted(reports, key=lambda r: r["rank"])


def judge(engine: str, reports: list[dict]) -> list[tuple[bool, str]]:
    """The checks of the module note, on the ranks' reports."""
    import numpy as np

    from moe_place.split import split_shares

    size = len(reports)
    phy2log = np.asarray(reports[0]["map"][0], dtype=np.int64)
    lines = []
    flags = [r["flags"] for r in reports]
    lines.append((all(f == [True] * LAYERS for f in flags), f"the rule's split choice at {engine}'s policy call: "
                  f"every layer on, adopted alike on every rank ({flags})"))
    shares_ok, part_ok, counts_ok, deviation = True, True, True, 0
    for step in range(BATCHES):
        batches = [np.asarray(r["batches"][step], dtype=np.int64).reshape(-1, TOP_K) for r in reports]
        counts = np.bincount(np.concatenate(batches).ravel(), minlength=EXPERTS)
        expected = split_shares(phy2log, counts, size)
        for layer in range(LAYERS):
            index = step * LAYERS + layer
            shares_ok &= all(len(r.get("shares", [])) > index and r["shares"][index] == expected.tolist()
                             for r in reports)
            sent = np.zeros(SLOTS, dtype=np.int64)
            for r, ids in zip(reports, batches):
                slots = np.asarray(r["slots"][step][layer], dtype=np.int64).reshape(-1)
                mine = np.bincount(slots, minlength=SLOTS)
                own = np.bincount(ids.ravel(), minlength=EXPERTS)
                part_ok &= bool((np.abs(mine - own[phy2log] * expected / np.maximum(counts[phy2log], 1)) < 1).all())
                part_ok &= bool((phy2log[slots] == ids.reshape(-1)).all())
                sent += mine
            counts_ok &= bool(np.array_equal(np.bincount(phy2log, weights=sent, minlength=EXPERTS), counts))
            deviation = max(deviation, int(np.abs(sent - expected).max()))
    lines.append((shares_ok, "every rank computed the same shares, the split of the all-reduced counts "
                             f"(moe_place.split.split_shares), on {BATCHES} batches x {LAYERS} layers"))
    lines.append((part_ok and counts_ok, "each rank sent each slot within one dispatch of its part of the share, a "
                  f"replica of the right expert; per expert the ranks' rows are the counts (largest gap between a "
                  f"slot's rows and its share, over the ranks: {deviation})"))
    empty = reports[-1]["batches"][1]
    lines.append((len(empty) == 0 and len(reports[-1].get("shares", [])) >= 2 * LAYERS,
                  f"rank {size - 1} with no tokens on batch 1 joined the all-reduce (all {size} ranks finished)"))
    if engine == "vllm":
        unpadded = reports[0]["unpadded"]
        recorded = all(np.array_equal(np.asarray(r["recorded"][-1][layer]), np.bincount(
            np.asarray(r["slots"][-1][layer], dtype=np.int64)[:unpadded].reshape(-1), minlength=SLOTS))
            for r in reports for layer in range(LAYERS))
        lines.append((recorded, "vLLM's expert_load_view holds the slots chosen, one per dispatch of the first "
                                f"num_unpadded_tokens ({unpadded}) tokens"))
    own = reports[0]
    ids = np.asarray(own["fallback_ids"])
    if engine == "vllm":   # vLLM's own mapping on a CPU: the ids unchanged
        engines_own = all(np.array_equal(np.asarray(f[layer]), ids) for f in own["fallback"] for layer in range(LAYERS))
    else:                  # SGLang's dynamic dispatch: a replica of the right expert
        engines_own = all((phy2log[np.asarray(f)] == ids).all() for f in own["fallback"])
    if engine == "sglang":
        gate = own["gate"]
        if all(not v.startswith("not run") for v in gate.values()):
            lines.append((gate["attn_dp=False"] == "accepted" and gate["attn_dp=True"].startswith("refused"),
                          f"SGLang's model gate for Qwen3MoeForCausalLM (outside its lp list): {gate}"))
        lines.append(("empty_topk_output" in reports[-1]["empty_call"] or "solve(empty)" in reports[-1]["empty_call"],
                      f"the idle rank's call: {reports[-1]['empty_call']}"))
    warned = [w for w in own["warnings"] if "rank 0's solve broke" in w]
    others = all(len(r.get("shares", [])) > len(own.get("shares", [])) for r in reports[1:])
    lines.append((engines_own and len(warned) == 1 and others,
                  f"a raise inside rank 0's split: {engine}'s own choice there, twice, with {len(warned)} warning "
                  f"({warned[0] if warned else 'none'}); the other ranks split both batches"))
    return lines


def busiest(engine: str, reports: list[dict]) -> dict:
    """Rows of the busiest rank per batch and layer: moe-place's split (what the ranks sent), the engine's own
    choice (vLLM: its hash, `inengine.standins.eplb_map_to_physical_and_record`, per rank; SGLang's dynamic dispatch:
    its expectation, the even split), and the lower bound of any split (`moe_place.split.split_lower_bound`)."""
    import numpy as np
    import torch

    from inengine import standins
    from moe_place.split import even_shares, split_lower_bound

    size = len(reports)
    phy2log = np.asarray(reports[0]["map"][0], dtype=np.int64)
    log2phy, count = standins.compute_logical_maps(torch.from_numpy(phy2log)[None], EXPERTS, SLOTS)
    out = {"split": [], "engine": [], "bound": []}
    for step in range(BATCHES):
        batches = [np.asarray(r["batches"][step], dtype=np.int64).reshape(-1, TOP_K) for r in reports]
        counts = np.bincount(np.concatenate(batches).ravel(), minlength=EXPERTS)
        for layer in range(LAYERS):
            sent = sum(np.bincount(np.asarray(r["slots"][step][layer], dtype=np.int64).reshape(-1), minlength=SLOTS)
                       for r in reports)
            out["split"].append(int(sent.reshape(size, -1).sum(1).max()))
            if engine == "vllm":
                own = np.zeros(SLOTS, dtype=np.int64)
                for ids in batches:
                    slots = standins.eplb_map_to_physical_and_record(
                        torch.from_numpy(ids.astype(np.int32)), torch.zeros(SLOTS, dtype=torch.int32), log2phy[0],
                        count[0], torch.tensor(False))
                    own += np.bincount(slots.numpy().reshape(-1), minlength=SLOTS)
            else:
                own = even_shares(phy2log[None], counts[None])[0]
            out["engine"].append(float(own.reshape(size, -1).sum(1).max()))
            out["bound"].append(float(split_lower_bound(phy2log, counts, size)[0]))
    return out


def checkout() -> dict:
    """The commit this ran at, and whether moe-place's or this script's files had changes not in it."""
    from inengine import harness

    return harness.checkout("bench/check_split_engines.py", "bench/inengine/standins.py")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--engine", choices=("vllm", "sglang"), help="the engine whose code runs (required)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the ranks (default 600)")
    add_record_options(parser, committed=("bench/results/split_engines_vllm.json",
                                          "bench/results/split_engines_sglang.json"))
    args = parser.parse_args(argv)
    refuse_overwrite(parser, args)
    if args.engine is None:
        parser.error("--engine: expected vllm or sglang")
    try:
        engine_module = __import__(args.engine)
    except ImportError:
        print(f"check_split_engines: {args.engine} is not importable in this Python ({sys.executable}): run it "
              "with the engine's Python and the overlay (see --help)", file=sys.stderr)
        return 2
    started = time.perf_counter()
    reports = run_ranks(vllm_rank if args.engine == "vllm" else sglang_rank, RANKS, args.timeout)
    wall = time.perf_counter() - started
    lines = judge(args.engine, reports)
    for passed, line in lines:
        print(f"{'PASS' if passed else 'FAIL'}  {line}")
    rows = busiest(args.engine, reports)
    own = "vLLM's hash" if args.engine == "vllm" else "SGLang's dynamic dispatch (expected: even)"
    print(f"busiest rank's rows per batch and layer: split {rows['split']}, {own} {rows['engine']}, lower bound "
          f"{[round(b, 1) for b in rows['bound']]}")
    docstring = __doc__.split("\n\n")
    record = {
        "command": ["bench/check_split_engines.py", "--engine", args.engine],
        "engine": args.engine, "version": engine_module.__version__, "python": sys.executable,
        **checkout(),
        "ranks": RANKS, "wall_s": round(wall, 1),
        "ran_in_the_engine": next(p for p in docstring if p.startswith({"vllm": "vLLM", "sglang": "SGLang"}[args.engine])),
        "checks": [{"passed": bool(passed), "check": line} for passed, line in lines],
        "flags": [r["flags"] for r in reports], "map": reports[0]["map"],
        "warnings": {r["rank"]: r["warnings"] for r in reports},
        "busiest_rank_rows": rows,
        "extra": {k: v for k, v in reports[0].items() if k in ("steps_to_flags", "offered", "solver_class",
                                                                "ep_group_in_sglang", "rank_in_vllm_group", "gate")},
    }
    if "empty_call" in reports[-1]:
        record["extra"]["empty_call"] = reports[-1]["empty_call"]
    if args.output_json:
        write_record(args.output_json, record)
        print(f"wrote {args.output_json}")
    return missed_targets("check_split_engines", [line for passed, line in lines if not passed])


if __name__ == "__main__":
    sys.exit(main())
