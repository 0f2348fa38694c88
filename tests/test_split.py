"""The per-batch split (moe_place.split): exact against an LP and a brute force, whole rows, the bound, the
mapping of tokens to replicas, and `evaluate --split per-batch`."""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_place.errors import InputError
from moe_place.solvers.deepseek import eplb_rebalance
from moe_place.solvers.evaluate import optimal_split
from moe_place.split import (even_shares, gpu_rows, map_tokens, rank_phase, round_shares,
                             split_lower_bound, split_shares)
from moe_place.traces.load import load_trace

TRACE = "traces/data/qwen3-30b-a3b_prefill_topk.npz"


def expert_sums(phy2log, shares, experts):
    return np.bincount(np.asarray(phy2log), weights=np.asarray(shares, dtype=np.float64), minlength=experts)


def test_a_hand_worked_layer():
    # 2 GPUs x 2 slots: GPU 0 holds experts 0 and 2, GPU 1 experts 1 and 2; expert 2 is replicated.
    # Counts 10, 2, 8: even gives GPU 0 10 + 4 = 14 and GPU 1 2 + 4 = 6; the best split puts 0 of expert 2's
    # rows on GPU 0 and 8 on GPU 1 (GPU loads 10 and 10).
    phy2log = np.array([0, 2, 1, 2])
    counts = np.array([10, 2, 8])
    assert gpu_rows(even_shares(phy2log[None], counts[None])[0], 2).tolist() == [14, 6]
    shares = split_shares(phy2log, counts, 2)
    assert shares.tolist() == [10, 0, 2, 8]
    assert split_lower_bound(phy2log, counts, 2, order_by=gpu_rows(shares, 2)[None])[0] == 10.0


def test_whole_rows_meet_the_integer_optimum_where_the_lp_is_fractional():
    # one expert of 7 rows over 2 empty GPUs: the LP gives 3.5 each; in whole rows the best is 4
    shares = split_shares(np.array([0, 0]), np.array([7]), 2)
    assert sorted(shares.tolist()) == [3, 4]


def brute_force_busiest(phy2log, counts, num_gpus):
    """The least busiest GPU over every whole-row split (tiny cases only)."""
    slots = len(phy2log) // num_gpus
    per_expert = [np.flatnonzero(phy2log == e) for e in range(len(counts))]

    def splits(e):
        places = per_expert[e]
        if len(places) == 1:
            yield [(places[0], counts[e])]
            return
        for first in range(counts[e] + 1):
            for rest in _compositions(counts[e] - first, len(places) - 1):
                yield list(zip(places, [first, *rest]))

    best = math.inf
    choices = [list(splits(e)) for e in range(len(counts))]

    def walk(e, load):
        nonlocal best
        if e == len(counts):
            best = min(best, max(load))
            return
        for option in choices[e]:
            new = list(load)
            for slot, rows in option:
                new[slot // slots] += rows
            if max(new) < best:
                walk(e + 1, new)

    walk(0, [0] * num_gpus)
    return best


def _compositions(total, parts):
    if parts == 1:
        yield [total]
        return
    for head in range(total + 1):
        for tail in _compositions(total - head, parts - 1):
            yield [head, *tail]


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_the_split_is_the_whole_row_optimum_on_tiny_layers(data):
    gpus = data.draw(st.integers(2, 3))
    slots = data.draw(st.integers(1, 3))
    experts = data.draw(st.integers(1, gpus * slots))
    physical = gpus * slots
    rest = data.draw(st.lists(st.integers(0, experts - 1), min_size=physical - experts, max_size=physical - experts))
    phy2log = np.array(data.draw(st.permutations(list(range(experts)) + rest)))
    counts = np.array(data.draw(st.lists(st.integers(0, 6), min_size=experts, max_size=experts)))
    shares = split_shares(phy2log, counts, gpus)
    assert (shares >= 0).all() and shares.dtype == np.int64
    assert np.array_equal(expert_sums(phy2log, shares, experts), counts)
    assert gpu_rows(shares, gpus).max() == brute_force_busiest(phy2log, counts, gpus)


def _real_layers(gpus, redundant, judge_step):
    trace = load_trace(TRACE)
    steps = trace.step_counts()
    plans = eplb_rebalance(steps[0].astype(np.float64), trace.num_experts + redundant, 1, 1, gpus)
    return plans, steps[judge_step]


@pytest.mark.parametrize("gpus, redundant", [(32, 32), (16, 32), (64, 64)])
def test_within_half_a_percent_of_the_exact_split_on_every_real_layer(gpus, redundant):
    plans, counts = _real_layers(gpus, redundant, judge_step=1)
    shares = split_shares(plans, counts, gpus)
    for layer in range(len(plans)):
        best, exact = optimal_split(plans[layer], counts[layer], gpus)
        busiest = gpu_rows(shares[layer], gpus).max()
        assert math.ceil(best - 1e-6) <= busiest <= 1.005 * math.ceil(best - 1e-6), layer
        assert np.array_equal(expert_sums(plans[layer], shares[layer], len(counts[layer])), counts[layer])
        assert split_lower_bound(plans[layer], counts[layer], gpus)[0] <= best + 1e-6


def test_the_split_never_leaves_a_gpu_busier_than_the_even_split():
    plans, counts = _real_layers(32, 32, judge_step=2)
    even = gpu_rows(even_shares(plans, counts), 32).max(axis=1)
    split = gpu_rows(split_shares(plans, counts, 32), 32).max(axis=1)
    assert (split <= even).all() and (split < even).mean() > 0.5


def test_rows_of_a_batch_are_solved_on_their_own_and_repeat():
    plans, counts = _real_layers(32, 32, judge_step=1)
    together = split_shares(plans, counts, 32)
    for layer in (0, 7, 47):
        assert np.array_equal(split_shares(plans[layer], counts[layer], 32), together[layer])
    assert np.array_equal(split_shares(plans, counts, 32), together)


def test_co_located_replicas_share_their_gpu():
    # EPLB may put two replicas of one expert on one GPU: expert 0 twice on GPU 0, once on GPU 1
    phy2log = np.array([0, 0, 1, 0, 2, 3])
    counts = np.array([30, 2, 3, 4])
    shares = split_shares(phy2log, counts, 2)
    assert np.array_equal(expert_sums(phy2log, shares, 4), counts)
    assert gpu_rows(shares, 2).tolist() == [20, 19]


def test_without_replicated_experts_the_split_is_the_map():
    phy2log = np.arange(8)
    counts = np.arange(8) * 3
    assert np.array_equal(split_shares(phy2log, counts, 4), counts)


def test_round_shares_keeps_the_lp_split_within_a_row():
    plans, counts = _real_layers(32, 32, judge_step=1)
    best, exact = optimal_split(plans[3], counts[3], 32)
    whole = round_shares(plans[3], counts[3], exact, 32)
    assert np.array_equal(expert_sums(plans[3], whole, len(counts[3])), counts[3])
    assert gpu_rows(whole, 32).max() <= math.ceil(best - 1e-6) + 1


@pytest.mark.parametrize("phy2log, counts, field", [
    (np.array([0, 1]), np.array([1.5, 2.0]), "counts"),
    (np.array([0, 1]), np.array([np.nan, 2.0]), "counts"),
    (np.array([0, 1]), np.array([-1, 2]), "counts"),
    (np.array([0, 2]), np.array([1, 2]), "phy2log"),
    (np.array([0, 1, 1]), np.array([1, 2]), "num_gpus"),
])
def test_bad_input_names_the_field(phy2log, counts, field):
    with pytest.raises(InputError) as error:
        split_shares(phy2log, counts, 2)
    assert error.value.where == field


# ---------------------------------------------------------------------- tokens to replicas
def test_each_rank_sends_each_replica_its_share_within_one_row():
    trace = load_trace(TRACE)
    ids = trace.topk_ids[1][:, 5, :].astype(np.int64)
    plans, counts = _real_layers(32, 32, judge_step=1)
    shares = split_shares(plans[5], counts[5], 32)
    home = np.arange(len(ids)) * 32 // len(ids)
    slots = map_tokens(ids, home, plans[5], shares, 32)
    assert np.array_equal(plans[5][slots], ids)
    for rank in range(32):
        mine = home == rank
        own = np.bincount(ids[mine].ravel(), minlength=128)
        proportional = own[plans[5]] * shares / np.maximum(counts[5][plans[5]], 1)
        assert (np.abs(np.bincount(slots[mine].ravel(), minlength=len(shares)) - proportional) < 1 + 1e-9).all(), rank
    assert np.abs(np.bincount(slots.ravel(), minlength=len(shares)) - shares).max() <= 4


def test_one_dispatch_per_rank_spreads_over_the_replicas_by_rank():
    # decode: each of 8 ranks sends one token to expert 0, which has 2 replicas with shares 6 and 2;
    # vLLM's hash sends every rank's token 0 to replica 0
    phy2log = np.array([0, 1, 0, 2])
    shares = np.array([6, 0, 2, 0])
    slots = map_tokens(np.zeros((8, 1), dtype=np.int64), np.arange(8), phy2log, shares, 8)
    assert sorted(np.bincount(slots.ravel(), minlength=4).tolist()) == [0, 0, 2, 6]


def test_phases_are_spaced_by_rank_and_turned_by_expert():
    phases = rank_phase(np.arange(4), np.zeros(4, dtype=np.int64), 4)
    assert phases.tolist() == [8192, 24576, 40960, 57344]
    assert rank_phase(np.array([0]), np.array([1]), 4)[0] == (8192 + 40503) % 65536


def test_map_tokens_refuses_shares_that_do_not_cover_the_batch():
    with pytest.raises(InputError):
        map_tokens(np.array([[1]]), np.array([0]), np.array([0, 1]), np.array([3, 0]), 1)


# ---------------------------------------------------------------------- the command
def test_evaluate_per_batch_keeps_its_fields_and_the_time_follows_the_split(tmp_path):
    from moe_place.cli.main import main

    plan = tmp_path / "plan.json"
    assert main(["plan", TRACE, "--gpus", "32", "--redundant", "32", "--steps", "0", "--solver", "eplb",
                 "--layers", "0-3", "--out", str(plan)]) == 0
    import contextlib
    import io

    def evaluate(split, *extra):
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            assert main(["evaluate", str(plan), TRACE, "--steps", "1", "--split", split, "--format", "json",
                         "--no-progress", *extra]) == 0
        return json.loads(buffer.getvalue())

    figures = {split: evaluate(split) for split in ("even", "per-batch", "optimal")}
    free = evaluate("per-batch", "--split-allreduce-us", "0", "--split-solve-us", "0")
    for split in ("per-batch", "optimal"):
        rows = figures[split]["layers"]
        assert all("max_gpu_load" in row and "layer_time_s" in row for row in rows)
        assert sum(r["max_gpu_load"] for r in rows) < sum(r["max_gpu_load"] for r in figures["even"]["layers"])
        # each layer pays the all-reduce (NCCL's model: 32 GPUs on one node, ring 3.6 + 62 x 0.47 us) and the
        # 10 us solve once for its one step, in its layer time
        overhead = figures[split]["time_model"]["split_overhead_s"]
        assert overhead == pytest.approx((3.6 + 62 * 0.47 + 10) * 1e-6)
        for row in rows:
            assert row["split_s"] == pytest.approx(overhead)
            assert row["layer_time_s"] == pytest.approx(row["dispatch_s"] + row["compute_s"] + row["combine_s"]
                                                        + row["split_s"])
    # what the split itself buys, without its overhead: a shorter layer than the engine's replica choice gives
    assert free["layer_time_s"] < figures["even"]["layer_time_s"] < figures["per-batch"]["layer_time_s"]
    assert sum(r["compute_s"] for r in free["layers"]) < sum(r["compute_s"] for r in figures["even"]["layers"])
    fast = [r["max_gpu_load"] for r in figures["per-batch"]["layers"]]
    exact = [r["max_gpu_load"] for r in figures["optimal"]["layers"]]
    assert all(math.ceil(e - 1e-6) <= f <= 1.005 * math.ceil(e - 1e-6) for f, e in zip(fast, exact))
