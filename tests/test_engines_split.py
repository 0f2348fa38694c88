"""The per-batch split inside the engines (`MOE_PLACE_SPLIT=per-batch`), on the stand-ins of vLLM's router and
SGLang's `lp` path (`bench/inengine/standins.py`), one process and 3 gloo ranks.

The oracle is `moe_place.split` (the spec): the shares are `split_shares` of the batch's global counts, the slots
`map_tokens` of them. The engines' own choices are the stand-ins' (vLLM's token-index hash with its load
recording, SGLang's dynamic dispatch).
"""

import logging
import multiprocessing
import socket
from datetime import timedelta

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from moe_place.engines import batch_split, sglang_split, vllm as vllm_adapter  # noqa: E402
from moe_place.engines.batch_split import FLAGS  # noqa: E402
from moe_place.engines.sglang_managers import DISPATCH_MODULE, SETUP_MODULE  # noqa: E402
from moe_place.errors import InputError  # noqa: E402
from moe_place.split import map_tokens, split_shares  # noqa: E402
from bench_modules import load  # noqa: E402 - tests/, beside this file

LAYERS, EXPERTS, GPUS, REDUNDANT, TOP_K = 2, 8, 2, 4, 2
# two layers, 8 experts, 12 slots on 2 GPUs: experts 0-3 twice (slots 8-11 hold 0-3 on GPU 1)
PHY2LOG = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7, 3, 2, 1, 0]])

standins = load("inengine.standins")


def _batch(rank: int, tokens: int = 40, seed: int = 0) -> torch.Tensor:
    """int32 `[tokens, TOP_K]`: a skewed batch (experts 0 and 1 hot), distinct experts per token."""
    rng = np.random.default_rng([seed, rank])
    weights = np.array([8, 6, 1, 1, 1, 1, 1, 1], dtype=float)
    ids = np.stack([rng.choice(EXPERTS, TOP_K, replace=False, p=weights / weights.sum()) for _ in range(tokens)])
    return torch.from_numpy(ids.reshape(tokens, TOP_K).astype(np.int32))


# ---------------------------------------------------------------------- vLLM
def _vllm(monkeypatch, group=None):
    """A context: vLLM's stand-in with moe-place's policy and the split installed; yields (tree, model state,
    policy class, handle)."""
    monkeypatch.setenv("MOE_PLACE_VLLM_POLICY", "default")
    monkeypatch.setenv(batch_split.SPLIT_ENV, "per-batch")
    return _VllmRun(group)


class _VllmRun:
    def __init__(self, group):
        self.group = group

    def __enter__(self):
        self._forward = standins.standin_vllm_forward(self.group)
        self.tree = self._forward.__enter__()
        self.handle = vllm_adapter.install()
        self.state = standins.EplbModelState(PHY2LOG, EXPERTS, TOP_K, REDUNDANT)
        self.engine = standins.StandinVllmEplb(self.tree["vllm.distributed.eplb.policy"].EPLB_POLICIES, LAYERS,
                                               EXPERTS, REDUNDANT, GPUS, 1, 1, forward=self.state)
        return self

    def __exit__(self, *exc):
        vllm_adapter.uninstall(self.handle)
        FLAGS.clear((LAYERS, EXPERTS))
        self._forward.__exit__(*exc)

    def commit(self, flags, per_layer: bool = False):
        """Offer `flags` (the rule's choice) and commit the map in use, as vLLM does after a rearrangement."""
        FLAGS.offer((LAYERS, EXPERTS), flags)
        module = self.tree["vllm.distributed.eplb.eplb_state"]
        if per_layer:   # as vLLM calls them: the maps (and the layer) by keyword
            for layer in range(LAYERS):
                module._commit_eplb_maps_for_layer(self.state, new_physical_to_logical_map=PHY2LOG[layer].clone(),
                                                   layer=layer)
        else:
            module._commit_eplb_maps(self.state, new_physical_to_logical_map=PHY2LOG.clone())

    def route(self, layer: int, ids: torch.Tensor, unpadded: int | None = None) -> torch.Tensor:
        """The layer's router on a batch whose top-k is `ids` (logits that rank them first), as vLLM's forward."""
        self.state.num_unpadded_tokens_tensors[0].fill_(len(ids) if unpadded is None else unpadded)
        logits = torch.zeros((len(ids), EXPERTS))
        logits.scatter_(1, ids.long(), torch.arange(TOP_K, 0, -1, dtype=torch.float).expand(len(ids), -1) + 1)
        return self.state.model.moe_layers[layer].router.select_experts(torch.zeros(len(ids), 4), logits)[1]


def _vllm_hash(layer: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots, recorded load [P]): vLLM's own mapping of `ids` on layer `layer`, on fresh copies of the maps."""
    log2phy, count = standins.compute_logical_maps(PHY2LOG, EXPERTS, REDUNDANT + 1)
    view = torch.zeros(PHY2LOG.shape[1], dtype=torch.int32)
    slots = standins.eplb_map_to_physical_and_record(ids, view, log2phy[layer], count[layer], torch.tensor(True),
                                                     torch.tensor(len(ids)))
    return slots, view


def test_split_on_a_layer_sends_exactly_the_shares_and_records_what_it_chose(monkeypatch):
    ids = _batch(0)
    with _vllm(monkeypatch) as run:
        assert torch.equal(run.route(0, ids), _vllm_hash(0, ids)[0])   # no policy call yet: vLLM's own choice
        run.state.expert_load_pass.zero_()
        run.commit([True, False])
        slots = run.route(0, ids)
        counts = np.bincount(ids.numpy().ravel(), minlength=EXPERTS)
        shares = split_shares(PHY2LOG[0].numpy(), counts, GPUS)
        expected = map_tokens(ids.numpy(), np.zeros(len(ids), dtype=np.int64), PHY2LOG[0].numpy(), shares, 1)
        assert np.array_equal(slots.numpy(), expected) and slots.dtype == ids.dtype
        sent = np.bincount(slots.numpy().ravel(), minlength=PHY2LOG.shape[1])
        assert np.array_equal(sent, shares)   # one rank: it sends the shares exactly
        assert np.array_equal(run.state.expert_load_pass[0].numpy(), sent)   # recorded: the slots it chose
        busiest = sent.reshape(GPUS, -1).sum(axis=1).max()
        assert busiest < np.bincount(_vllm_hash(0, ids)[0].numpy().ravel(), minlength=12).reshape(GPUS, -1).sum(1).max()
        # layer 1's flag is off: vLLM's own mapping and recording
        run.state.expert_load_pass.zero_()
        assert torch.equal(run.route(1, ids), _vllm_hash(1, ids)[0])
        assert torch.equal(run.state.expert_load_pass[1], _vllm_hash(1, ids)[1])


def test_the_split_records_like_vllm_padding_and_the_record_flag(monkeypatch):
    ids = _batch(0)
    with _vllm(monkeypatch) as run:
        run.commit([True, True], per_layer=True)   # async mode's commits, one layer at a time
        slots = run.route(0, ids, unpadded=len(ids) - 5)
        kept = np.bincount(slots[:-5].numpy().ravel(), minlength=PHY2LOG.shape[1])
        assert np.array_equal(run.state.expert_load_pass[0].numpy(), kept)   # padded tokens not recorded
        run.state.expert_load_pass.zero_()
        run.state.should_record_tensor.fill_(False)
        run.route(1, ids)
        assert int(run.state.expert_load_pass.sum()) == 0


def test_a_raise_inside_the_split_falls_back_to_vllms_choice_with_one_warning(monkeypatch, caplog):
    ids = _batch(0)
    caplog.set_level(logging.WARNING, logger="moe_place.engines")

    def broken(*_):
        raise ValueError("a broken solve")

    with _vllm(monkeypatch) as run:
        run.commit([True, True])
        monkeypatch.setattr(batch_split, "split_of", broken)
        for _ in range(3):
            run.state.expert_load_pass.zero_()
            slots = run.route(0, ids)
            expected, recorded = _vllm_hash(0, ids)
            assert torch.equal(slots, expected) and torch.equal(run.state.expert_load_pass[0], recorded)
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(warned) == 1 and "a broken solve" in warned[0] and "vllm.router" in warned[0], warned
        monkeypatch.undo()   # the next call splits again
        monkeypatch.setenv(batch_split.SPLIT_ENV, "per-batch")
        counts = np.bincount(ids.numpy().ravel(), minlength=EXPERTS)
        sent = np.bincount(run.route(0, ids).numpy().ravel(), minlength=12)
        assert np.array_equal(sent, split_shares(PHY2LOG[0].numpy(), counts, GPUS))


def test_the_policy_call_offers_the_rules_split_choice(monkeypatch):
    # the rule's SplitChoice at vLLM's call, on a map it may not change (no moves allowed): GPU 0 holds the hot
    # experts 4 and 5 besides a replica of each of 0-3, so vLLM's even split of 0-3 overloads it. On large
    # batches the split saves more than its all-reduce and solve: on; on batches 10 times smaller it does not.
    # The flags reach the router only at the commit.
    monkeypatch.setenv("MOE_PLACE_MAX_MOVED_SLOTS", "0")
    per_step = torch.tensor([3000, 3000, 3000, 3000, 6000, 6000, 100, 100], dtype=torch.float)
    for scale, expected in ((1.0, [True, True]), (0.1, [False, False])):
        with _vllm(monkeypatch) as run:
            policy = run.tree["vllm.distributed.eplb.policy"].EPLB_POLICIES["default"]
            window = (per_step * scale * 750).repeat(LAYERS, 1)   # vLLM's first call: a quarter interval's steps
            new = policy.rebalance_experts(window, PHY2LOG.shape[1], 1, 1, GPUS, PHY2LOG.clone())
            assert torch.equal(new, PHY2LOG)
            assert FLAGS.pending[(LAYERS, EXPERTS)].tolist() == expected
            assert not FLAGS.is_on((LAYERS, EXPERTS), 0)
            run.tree["vllm.distributed.eplb.eplb_state"]._commit_eplb_maps(run.state, new_physical_to_logical_map=new)
            assert [FLAGS.is_on((LAYERS, EXPERTS), layer) for layer in range(LAYERS)] == expected


def test_without_the_variable_the_policy_offers_nothing(monkeypatch):
    monkeypatch.setenv("MOE_PLACE_MAX_MOVED_SLOTS", "0")
    with _vllm(monkeypatch) as run:
        monkeypatch.setenv(batch_split.SPLIT_ENV, "even")
        policy = run.tree["vllm.distributed.eplb.policy"].EPLB_POLICIES["default"]
        window = torch.tensor([3000, 3000, 3000, 3000, 6000, 6000, 100, 100], dtype=torch.float).repeat(LAYERS, 1)
        policy.rebalance_experts(window * 750, PHY2LOG.shape[1], 1, 1, GPUS, PHY2LOG.clone())
        assert (LAYERS, EXPERTS) not in FLAGS.pending
        assert all(session.rule.split is None for session in policy._sessions.values())


def test_the_split_variable_is_checked_at_start(monkeypatch):
    monkeypatch.setenv(batch_split.SPLIT_ENV, "sometimes")
    with pytest.raises(InputError, match="MOE_PLACE_SPLIT"):
        batch_split.split_enabled()
    monkeypatch.delenv("MOE_PLACE_VLLM_POLICY", raising=False)
    monkeypatch.setenv(batch_split.SPLIT_ENV, "per-batch")
    with pytest.raises(InputError, match="MOE_PLACE_VLLM_POLICY"):
        vllm_adapter.register_plugin()   # the split needs the rule; vLLM stops in its plugin loading
    monkeypatch.setenv(batch_split.SPLIT_ENV, "even")
    assert vllm_adapter.register_plugin() is None


# ---------------------------------------------------------------------- SGLang
class _CountingGroup(standins.GroupCoordinator):
    """One rank; counts the all-reduces."""

    calls = 0

    def all_reduce(self, tensor):
        type(self).calls += 1
        return tensor


def _sglang(monkeypatch, group=None, attn_dp: bool = False):
    monkeypatch.setenv(batch_split.SPLIT_ENV, "per-batch")
    return _SglangRun(group or standins.GroupCoordinator(), attn_dp)


class _SglangRun:
    def __init__(self, group, attn_dp):
        self.group, self.attn_dp = group, attn_dp

    def __enter__(self):
        self._context = standins.standin_sglang_lp(self.group, self.attn_dp)
        self.tree = self._context.__enter__()
        self.split = sglang_split.SglangSplit()
        sglang_split.install_setup(self.split, self.tree[SETUP_MODULE])
        sglang_split.install_dispatch(self.split, self.tree[DISPATCH_MODULE])
        self.metadata = standins.ExpertLocationMetadata.of(PHY2LOG, EXPERTS, max(self.group.world_size, GPUS))
        self.tree["sglang.srt.eplb.lplb_solver"].get_resources().expert_location_metadata = self.metadata
        return self

    def __exit__(self, *exc):
        sglang_split.uninstall_split(self.split)
        FLAGS.clear((LAYERS, EXPERTS))
        self._context.__exit__(*exc)

    def init(self, flags, architecture: str = "DeepseekV3ForCausalLM"):
        """SGLang's `init_lplb_solvers` after an update, with the rule's choice `flags` offered."""
        FLAGS.offer((LAYERS, EXPERTS), flags)
        config = standins.types.SimpleNamespace(hf_config=standins.types.SimpleNamespace(architectures=[architecture]))
        self.tree[SETUP_MODULE].init_lplb_solvers(model_config=config)

    def topk(self, layer: int, ids):
        info = standins.ExpertLocationDispatchInfo.of(self.metadata, layer)
        return standins.sglang_topk(self.tree, layer, ids, info)

    def solver(self, layer: int):
        return self.tree["sglang.srt.eplb.lplb_solver"].get_global_lplb_solver(layer)


def test_sglang_lp_path_sends_the_shares_and_answers_in_sglangs_terms(monkeypatch):
    ids = _batch(0)
    with _sglang(monkeypatch, _CountingGroup()) as run:
        run.init([True, False])
        before = _CountingGroup.calls
        slots = run.topk(0, ids)
        assert _CountingGroup.calls == before + 1   # the counts' one all-reduce
        counts = np.bincount(ids.numpy().ravel(), minlength=EXPERTS)
        shares = split_shares(PHY2LOG[0].numpy(), counts, GPUS)
        assert np.array_equal(np.bincount(slots.numpy().ravel(), minlength=12), shares)
        prob = run.solver(0).solve(ids)   # log2phy_prob: shares over counts, SGLang's meaning
        log2phy = run.metadata.logical_to_all_physical_map[0].numpy()
        for expert in range(EXPERTS):
            valid = log2phy[expert] >= 0
            assert np.allclose(prob[expert].numpy()[valid] * counts[expert], shares[log2phy[expert][valid]])
        # layer 1 is off: no all-reduce, SGLang's dynamic dispatch (a replica of the right expert)
        before = _CountingGroup.calls
        slots = run.topk(1, ids)
        assert _CountingGroup.calls == before
        assert np.array_equal(PHY2LOG[1].numpy()[slots.numpy()], ids.numpy())


def test_sglang_an_empty_rank_joins_and_a_raise_falls_back_to_dynamic_once(monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="moe_place.engines")
    with _sglang(monkeypatch, _CountingGroup()) as run:
        run.init([True, True])
        before = _CountingGroup.calls
        empty = torch.empty((0, TOP_K), dtype=torch.int32)
        assert run.topk(0, empty).shape == (0, TOP_K) and _CountingGroup.calls == before + 1
        monkeypatch.setattr(batch_split, "split_of", lambda *_: 1 / 0)
        ids = _batch(1)
        for _ in range(2):
            slots = run.topk(0, ids)
            assert np.array_equal(PHY2LOG[0].numpy()[slots.numpy()], ids.numpy())   # dynamic: right experts
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(warned) == 1 and "ZeroDivisionError" in warned[0] and "dynamic dispatch" in warned[0]


def test_sglang_models_gate_is_kept_under_attention_dp_and_lifted_without(monkeypatch):
    with _sglang(monkeypatch, attn_dp=True) as run:
        with pytest.raises(NotImplementedError, match="Qwen3MoeForCausalLM"):
            run.init([True, True], architecture="Qwen3MoeForCausalLM")
    with _sglang(monkeypatch, attn_dp=False) as run:
        run.init([True, True], architecture="Qwen3MoeForCausalLM")
        assert isinstance(run.solver(0), sglang_split.SplitLPSolver) and run.solver(0).on


# ---------------------------------------------------------------------- gloo ranks
RANKS = 3


def _rank(rank: int, port: int, queue) -> None:
    """One EP rank: vLLM's router and SGLang's lp path on the stand-ins over a gloo group (rank 2 has no tokens;
    rank 1 proposes layer 1 off; rank 0's split raises on the second batch)."""
    import os

    import torch.distributed as dist

    os.environ["MOE_PLACE_VLLM_POLICY"] = "default"
    os.environ[batch_split.SPLIT_ENV] = "per-batch"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS,
                            timeout=timedelta(seconds=60))
    group = standins.GroupCoordinator.world()
    ids = _batch(rank) if rank != 2 else torch.empty((0, TOP_K), dtype=torch.int32)
    flags = [True, rank != 1]
    report = {"rank": rank}
    shares_seen = []
    real_split_of = batch_split.split_of

    def spy(counts, row, num_ranks):
        shares = real_split_of(counts, row, num_ranks)
        shares_seen.append(shares.tolist())
        return shares

    batch_split.split_of = spy
    try:
        run = _VllmRun(group).__enter__()
        run.commit(flags)
        report["vllm_flags"] = [FLAGS.is_on((LAYERS, EXPERTS), layer) for layer in range(LAYERS)]
        report["vllm_slots"] = [run.route(layer, ids).tolist() for layer in range(LAYERS)]
        report["vllm_recorded"] = run.state.expert_load_pass.tolist()
        if rank == 0:
            batch_split.split_of = lambda *_: (_ for _ in ()).throw(RuntimeError("rank 0's solve broke"))
        report["vllm_fallback"] = run.route(0, ids).tolist()
        batch_split.split_of = spy
        report["vllm_shares"] = shares_seen[:]
        run.__exit__(None, None, None)
        shares_seen.clear()
        lp = _SglangRun(group, False).__enter__()
        lp.init(flags)
        report["sglang_flags"] = [lp.solver(layer).on for layer in range(LAYERS)]
        report["sglang_slots"] = [lp.topk(layer, ids).tolist() for layer in range(LAYERS)]
        report["sglang_prob"] = lp.solver(0).solve(ids).tolist()
        report["sglang_shares"] = shares_seen[:]
        lp.__exit__(None, None, None)
    finally:
        dist.destroy_process_group()
    queue.put(report)


def test_gloo_ranks_get_identical_shares_send_their_part_and_never_hang():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=_rank, args=(rank, port, queue)) for rank in range(RANKS)]
    for process in processes:
        process.start()
    try:
        reports = sorted((queue.get(timeout=240) for _ in processes), key=lambda r: r["rank"])
    finally:
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    assert all(process.exitcode == 0 for process in processes)
    batches = [_batch(rank).numpy() for rank in range(2)]
    counts = np.bincount(np.concatenate(batches).ravel(), minlength=EXPERTS)
    shares = split_shares(PHY2LOG[0].numpy(), counts, RANKS)   # the 12 slots as 3 ranks of 4
    for engine in ("vllm", "sglang"):
        # the flags: layer 1 off everywhere (rank 1 said no), layer 0 on everywhere
        assert all(r[f"{engine}_flags"] == [True, False] for r in reports)
        # every rank computed the same shares (the global counts' split); rank 2, with no tokens, took part
        assert all(r[f"{engine}_shares"][0] == shares.tolist() for r in reports), \
            (shares.tolist(), [r[f"{engine}_shares"] for r in reports])
        # what the ranks send: each rank within one dispatch of its proportional part of every slot's share
        # (`moe_place.split.map_tokens`' rule: no rank knows the others' counts, only the global ones), so the
        # sum per slot is within one dispatch per sending rank of the share, and per expert it is the count
        expert = PHY2LOG[0].numpy()
        sent = np.zeros(12, dtype=np.int64)
        for r, batch in zip(reports, batches + [np.zeros((0, TOP_K), dtype=np.int64)]):
            mine = np.bincount(np.asarray(r[f"{engine}_slots"][0], dtype=np.int64).ravel(), minlength=12)
            own = np.bincount(batch.ravel(), minlength=EXPERTS)
            assert (np.abs(mine - own[expert] * shares / counts[expert]) < 1).all(), (r["rank"], mine)
            sent += mine
        assert np.array_equal(np.bincount(expert, weights=sent, minlength=EXPERTS), counts)
        assert (np.abs(sent - shares) <= 2).all()
    # vLLM records what each rank chose; rank 0's broken solve took vLLM's own choice (the others split again)
    for r in reports[:2]:
        assert np.array_equal(np.asarray(r["vllm_recorded"][0]),
                              np.bincount(np.asarray(r["vllm_slots"][0]).ravel(), minlength=12))
    assert reports[0]["vllm_fallback"] == _vllm_hash(0, _batch(0))[0].tolist()
    assert reports[1]["vllm_fallback"] == reports[1]["vllm_slots"][0]
    assert all(np.allclose(r["sglang_prob"], reports[0]["sglang_prob"]) for r in reports)
