"""How rows reach replicas on counts (moe_place.cost.replicas), the split's overhead, the per-layer split choice
(moe_place.online.splitting) and `replay --split per-batch`."""

import json
from pathlib import Path
import math

import numpy as np
import pytest

from moe_place.cost.replicas import SlotTable, choose_replicas, static_rank_table
from moe_place.cost.replicas import (allreduce_latency_s, slot_rows, split_overhead_s, vllm_hash_fractions)
from moe_place.errors import InputError
from moe_place.cost.cluster import cluster_cost
from moe_place.online.splitting import (CHOICE_CPU_SHARE, CHOICE_SWEEPS, PRICE_S_PER_SLOT, REFRESH_STEPS,
                                       SCREEN_S_PER_SLOT, SplitChoice)
from moe_place.placement import Placement


def test_nccl_latency_model_by_hand():
    # one node of 8: ring LL 3.6 + 14 x 0.47 = 10.18 us (tree 4.4 + 2 x 7 x 0.52 = 11.68)
    assert allreduce_latency_s(8, 1) == pytest.approx(10.18e-6)
    # 4 nodes of 8: tree LL 4.4 + 2 (7 x 0.52 x 1.8 + 2 x 5.0) = 37.504 us (ring 3.6 + 56 x 0.846 + 6 x 2.7 = 67.2)
    assert allreduce_latency_s(32, 4) == pytest.approx(37.504e-6)
    assert allreduce_latency_s(1, 1) == 0.0
    assert split_overhead_s(8, 1, 5e-6) == pytest.approx(15.18e-6)
    with pytest.raises(InputError):
        allreduce_latency_s(6, 4)
    with pytest.raises(InputError):
        split_overhead_s(8, 1, -1.0)


def test_vllm_hash_fractions_follow_the_knuth_hash():
    # t * 2654435769 is odd times t: residues mod 2 alternate, so two replicas share evenly
    assert vllm_hash_fractions(16, 2).tolist() == [0.5, 0.5]
    # one token per rank: index 0 always hashes to 0, so replica 0 takes everything
    assert vllm_hash_fractions(1, 3).tolist() == [1.0, 0.0, 0.0]
    residues = [(t * 2654435769 & 0xFFFFFFFF) % 3 for t in range(16)]
    assert vllm_hash_fractions(16, 3).tolist() == [residues.count(i) / 16 for i in range(3)]


def test_slot_rows_keep_every_dispatch():
    rng = np.random.default_rng(3)
    rows = np.array([[0, 1, 2, 0, 3, 0, 1, 2]])
    counts = rng.integers(0, 100, size=(1, 4))
    for choice in ("even", "vllm", "sglang-static", "sglang-dynamic", "per-batch"):
        got = slot_rows(rows, counts, 2, choice, top_k=2)
        assert np.bincount(rows[0], weights=got[0], minlength=4) == pytest.approx(counts[0]), choice
    with pytest.raises(InputError):
        slot_rows(rows, counts, 2, "round-robin")


def test_sglang_static_prefers_the_node_only_when_that_narrows():
    # one node of 2 GPUs: expert 0 on slots 0, 3 (GPU 0) and 5 (GPU 1). GPU 0 has its own replica (slot 0, the
    # first); GPU 1 has slot 5. Expert 1 on slots 1 (GPU 0) and 6 (GPU 1): each GPU its own.
    table = SlotTable(np.array([0, 1, 2, 0, 3, 0, 1, 2]), 2, 1, 4)
    static = static_rank_table(table, 0)
    assert static[:, 0].tolist() == [0, 5] and static[:, 1].tolist() == [1, 6]
    # two nodes of one GPU each, expert 0 only on node 0's slots: node 1 has none near, so a fair draw over all
    far = SlotTable(np.array([0, 1, 0, 2, 3, 1]), 2, 2, 4)
    assert static_rank_table(far, 0)[1, 0] in (0, 2)
    # on one node every replica is on the rank's node: SGLang then draws fairly, not the lowest slot
    one = SlotTable(np.array([0, 1, 2, 3, 4, 0, 5, 6, 7, 0, 8, 9]), 4, 1, 10)   # expert 0 on GPUs 0, 1 and 3
    drawn = [static_rank_table(SlotTable(one.phy2log, 4, 1, 10), seed)[2, 0] for seed in range(20)]
    assert set(drawn) <= {0, 5, 9} and len(set(drawn)) > 1                     # GPU 2 holds none: drawn
    ids = np.zeros((4, 1), dtype=np.int64)
    chosen = choose_replicas(ids, np.arange(4), one, "sglang-static").ravel().tolist()
    assert chosen[0] == 0 and chosen[1] == 5 and chosen[3] == 9


def _placement():
    rng = np.random.default_rng(0)
    rows = np.stack([rng.permutation(np.concatenate([np.arange(64), rng.choice(64, 16, replace=False)]))
                     for _ in range(2)])
    return Placement(rows, 64, 8, allow_colocated=True)


def test_the_split_choice_turns_on_where_the_saving_beats_the_overhead():
    placement = _placement()
    rng = np.random.default_rng(1)
    popularity = rng.dirichlet(np.full(64, 0.3), size=2)
    window = np.stack([rng.multinomial(65536 * 8, p) for p in popularity]).astype(float)   # large batches
    cheap = SplitChoice(cluster_cost(8, 1, "H100", "Qwen3-30B-A3B", replica_choice="sglang-static",
                                     split_solve_s=0.0, split_allreduce_s=0.0))
    cheap_state = cheap.decide(None, window * 10, 10, placement)
    assert cheap_state.on.all() and (cheap_state.saving_s > 0).all()
    dear = SplitChoice(cluster_cost(8, 1, "H100", "Qwen3-30B-A3B", replica_choice="sglang-static",
                                    split_allreduce_s=1.0))
    dear_state = dear.decide(None, window * 10, 10, placement)
    assert not dear_state.on.any()
    # settled by the ceiling without a split solved: the most the split could save, at least what it saved
    assert (dear_state.saving_s >= 0.9 * cheap_state.saving_s).all()
    # no redundant experts: nothing to split, never on
    bare = Placement(np.tile(np.arange(64), (2, 1)), 64, 8)
    bare_state = cheap.decide(cheap_state, window, 1, bare)
    assert not bare_state.on.any() and bare_state.saving_s == pytest.approx(0.0)


def test_the_split_choice_uses_the_engines_per_step_window():
    placement = _placement()
    rng = np.random.default_rng(2)
    steps = rng.multinomial(4096 * 8, np.full(64, 1 / 64), size=(40, 2)).astype(float)
    choice = SplitChoice(cluster_cost(8, 1, "H100", "Qwen3-30B-A3B", replica_choice="even",
                                      split_solve_s=0.0, split_allreduce_s=0.0), samples=5)
    state = choice.decide(None, steps, 40, placement)
    expected = []
    for layer in range(2):
        rows = np.broadcast_to(placement.phy2log[layer], (5, 80))
        engine, engine_comm, _ = choice.cost.served_times_s(rows, steps[-5:, layer], split=False)
        split, split_comm, _ = choice.cost.served_times_s(rows, steps[-5:, layer], split=True,
                                                          max_sweeps=CHOICE_SWEEPS)
        expected.append((engine + engine_comm - split - split_comm).mean())
    np.testing.assert_allclose(state.saving_s, expected)


def test_the_split_choice_costs_next_to_nothing_where_the_split_cannot_pay(monkeypatch):
    placement = _placement()
    rng = np.random.default_rng(3)
    window = rng.multinomial(512 * 8 * 10, np.full(64, 1 / 64), size=2).astype(float)   # decode-sized batches
    choice = SplitChoice(cluster_cost(8, 1, "H100", "Qwen3-30B-A3B", replica_choice="sglang-static",
                                      split_allreduce_s=1.0))
    state = choice.decide(None, window, 10, placement, step=10)
    assert not state.on.any()   # off by far more than half the overhead
    priced = []
    monkeypatch.setattr(SplitChoice, "_ceiling_s", lambda *a: priced.append(1) or pytest.fail("priced again"))
    moved = placement.phy2log.copy()
    moved[:, [0, 1]] = moved[:, [1, 0]]                       # the rule moved slots: the layers stay off, unpriced
    state = choice.decide(state, window, 10, Placement(moved, 64, 8, allow_colocated=True), step=20)
    assert not state.on.any()
    bare = Placement(np.tile(np.arange(64), (2, 1)), 64, 8)   # no replicated expert: off without pricing
    state = choice.decide(state, window, 10, bare, step=30)
    assert not state.on.any() and not priced
    old = choice.decide(state, window, 10, bare, step=30 + 5000)   # old: still nothing to price
    assert not old.on.any() and not priced
    # priced again: layers that gain a replicated expert, and layers whose batches grow by more than half
    monkeypatch.undo()
    calls = []
    real = SplitChoice._ceiling_s
    monkeypatch.setattr(SplitChoice, "_ceiling_s", lambda self, *a: calls.append(len(a[0])) or real(self, *a))
    state = choice.decide(state, window, 10, placement, step=40)
    assert calls == [2] and not state.on.any()
    calls.clear()
    assert choice.decide(state, window * 1.4, 10, placement, step=50).calls == state.calls + 1
    assert calls == []
    grown = window.copy()
    grown[1] *= 1.6
    choice.decide(state, grown, 10, placement, step=40 + 1000)   # the choice is old: the grown layer only
    assert calls == [1]


def test_the_split_choice_prices_no_more_than_the_call_can_afford():
    placement = _placement()
    rng = np.random.default_rng(1)
    window = np.stack([rng.multinomial(65536 * 8, p) for p in rng.dirichlet(np.full(64, 0.3), size=2)]) * 10.0
    choice = SplitChoice(cluster_cost(8, 1, "H100", "Qwen3-30B-A3B", replica_choice="sglang-static",
                                      split_solve_s=0.0, split_allreduce_s=0.0))
    free = choice.decide(None, window, 10, placement, step=0)   # no cap: both layers priced, both on
    assert free.on.all() and free.price_s == pytest.approx(2 * (SCREEN_S_PER_SLOT + 4 * PRICE_S_PER_SLOT) * 80)
    step_s = float(choice.cost.rows_times_s(placement.phy2log, window / 10, 8).sum())   # what the call weighs
    one = 2 * SCREEN_S_PER_SLOT * 80 + 4 * PRICE_S_PER_SLOT * 80   # the screen of both, one layer priced
    interval = int(np.ceil(one / (CHOICE_CPU_SHARE * step_s))) + 1
    capped = choice.decide(None, window, 10, placement, step=0, interval_steps=interval)
    assert capped.on.tolist() == [True, False] and capped.price_s == pytest.approx(one)
    assert capped.price_s <= CHOICE_CPU_SHARE * interval * step_s * 1.05   # within the budget (screen estimate)
    # the layer left waiting keeps its choice (not looked at again while its row stands) ...
    same = choice.decide(capped, window, 10, placement, step=interval, interval_steps=interval)
    assert same.on.tolist() == [True, False] and same.price_s == 0.0
    # ... until the choices fall old: then the layers take their turn, the one left waiting first
    later = choice.decide(same, window, 10, placement, step=REFRESH_STEPS, interval_steps=interval)
    assert later.on.all() and later.price_s == pytest.approx(one)


def test_replay_split_json_and_its_guard(capsys):
    from moe_place.cli.main import main
    import contextlib
    import io

    def run(*extra, trace="drift:steps=400,layers=2,experts=32,tokens=512,seed=4", interval="50"):
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            code = main(["replay", "--synthetic", trace, "--gpus", "8", "--engine", "sglang", "--step-interval",
                         interval, "--format", "json", "--no-progress", "--no-per-step", *extra])
        assert code == 0
        return json.loads(buffer.getvalue())

    plain = run("--replica-choice", "engine")
    split = run("--split", "per-batch")
    assert split["split"] == "per-batch" and split["replica_choice"] == "sglang-static"
    assert split["total_time_s"] == pytest.approx(split["total_expert_time_s"] + split["total_comm_time_s"]
                                                  + split["total_migration_time_s"] + split["total_policy_time_s"])
    assert split["split_overhead_s"] == pytest.approx(20.18e-6)
    # decode-sized batches: the choice keeps the split off where it costs more than it saves
    model = lambda doc: doc["total_expert_time_s"] + doc["total_migration_time_s"]   # noqa: E731 (CPU time: noisy)
    assert split["split_layer_steps"] == 0 and model(split) <= 1.005 * model(plain)
    # a free split on prefill-sized batches, at a cadence whose serving time affords pricing the choice
    large = dict(trace="drift:steps=700,layers=2,experts=32,tokens=65536,seed=4", interval="300")
    plain = run("--replica-choice", "engine", **large)
    free = run("--split", "per-batch", "--split-solve-us", "0", "--split-allreduce-us", "0", **large)
    assert free["split_layer_steps"] > 0 and free["total_expert_time_s"] < plain["total_expert_time_s"]
    assert math.isfinite(free["mean_balancedness"]) and free["mean_balancedness"] > plain["mean_balancedness"]
    capsys.readouterr()
    assert main(["replay", "--synthetic", "drift:steps=400,layers=2,experts=32,seed=4", "--gpus", "8", "--step-interval",
                 "50", "--controller", "engine-default", "--split", "per-batch", "--no-progress"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "--split per-batch" in error[0] and "--controller ours" in error[0]


def test_the_split_choice_prices_what_the_record_measured():
    """The choice's committed prices are at least the most that bench/bench_split.py's `choice_price` measured per
    slot (so a priced replay does not charge it less than it costs there), and within 2x of it."""
    record = json.loads((Path(__file__).resolve().parents[1] / "bench/results/split.json").read_text())
    most = record["choice_price"]["most"]
    assert most["screen_s_per_slot"] <= SCREEN_S_PER_SLOT <= 2 * most["screen_s_per_slot"]
    assert most["price_s_per_slot"] <= PRICE_S_PER_SLOT <= 2 * most["price_s_per_slot"]
