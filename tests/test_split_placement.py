"""Placement for the per-batch split (moe_place.solvers.split_placement): the relaxed split against the LP, the
search against a brute force on a tiny layer, valid and repeatable plans never worse than their start, the CLI
path (`plan --split per-batch`, recorded for `evaluate`) and the sizing path (`--redundant auto`)."""

import itertools
import json

import numpy as np
import pytest

from moe_place.cli.main import main
from moe_place.errors import InputError
from moe_place.online.replay import parse_synthetic
from moe_place.placement import Placement, has_colocation
from moe_place.planfile import read_plan
from moe_place.problem import PlacementProblem
from moe_place.solvers import solve
from moe_place.solvers.deepseek import eplb_rebalance
from moe_place.solvers.evaluate import optimal_split
from moe_place.solvers.sizing import ReplicaMemory, busiest_over_mean, size_redundancy
from moe_place.solvers.split_placement import (MIN_PIECES, plan_for_split, planning_pieces, planning_sample,
                                               relaxed_split_loads, separate_replicas, split_busiest,
                                               split_busiest_over_mean, widened_steps)
from moe_place.split import gpu_rows, split_shares
from moe_place.traces.load import load_trace

BUNDLED = "traces/data/qwen3-30b-a3b_prefill_topk.npz"


# ---------------------------------------------------------------------- the relaxed split
def test_the_relaxed_split_of_a_hand_worked_layer():
    # GPU 0 holds experts 0 and 2, GPU 1 experts 1 and 2: expert 2's 8 rows all go to GPU 1 (10 and 10)
    loads = relaxed_split_loads(np.array([[0, 2, 1, 2]]), np.array([[10, 2, 8]]), 2)
    assert loads.tolist() == [[10.0, 10.0]]
    # two replicas of expert 0 on GPU 0 count as one place: GPU 0 takes 30 * x, GPU 1 the rest and 9 more
    loads = relaxed_split_loads(np.array([[0, 0, 1, 0, 2, 3]]), np.array([[30, 2, 3, 4]]), 2)
    assert loads.sum() == pytest.approx(39.0) and loads.max() == pytest.approx(19.5)


def test_the_relaxed_split_meets_the_lp_on_real_layers():
    steps = load_trace(BUNDLED).step_counts()
    plans = eplb_rebalance(steps[0].astype(np.float64), 128 + 32, 1, 1, 16)   # co-located replicas included
    loads = relaxed_split_loads(plans[:12], steps[1, :12], 16, sweeps=40)
    assert loads.sum(axis=1) == pytest.approx(steps[1, :12].sum(axis=1))
    for layer in range(12):
        best = optimal_split(plans[layer], steps[1, layer], 16)[0]
        # an achievable split: never below the LP's optimum, and close to it after enough sweeps
        assert best - 1e-6 <= loads[layer].max() <= 1.002 * best, layer


def test_sampling_and_widening():
    assert planning_sample(np.zeros((5, 1, 2)), 24).tolist() == [0, 1, 2, 3, 4]
    assert planning_sample(np.zeros((100, 1, 2)), 4).tolist() == [0, 33, 66, 99]
    steps = np.array([[[4.0, 0.0]], [[0.0, 4.0]], [[2.0, 2.0]]])
    assert widened_steps(steps, 2.0)[:, 0].tolist() == [[6.0, 0.0], [0.0, 6.0], [2.0, 2.0]]  # -2 clipped to 0
    assert widened_steps(steps[:1], 2.0).tolist() == steps[:1].tolist()                    # one step: itself


def test_a_short_token_trace_is_planned_on_runs_of_tokens(tmp_path):
    trace = load_trace(BUNDLED).select_layer_ids([0, 1])
    pieces, how = planning_pieces(trace)
    assert len(pieces) == 3 * -(-MIN_PIECES // 3) and "runs of consecutive tokens" in how
    # each run is scaled to its step's tokens: the runs of a step sum to about 3x the step's counts
    assert pieces[:3].sum(axis=0) == pytest.approx(3 * trace.step_counts()[0], abs=3)
    counts = trace.step_counts()
    path = tmp_path / "c.npz"
    np.savez(path, format_version=1, num_experts=128, top_k=8, counts=counts)
    assert np.array_equal(planning_pieces(load_trace(path))[0], counts)   # counts: the steps as they are


def test_split_busiest_over_mean_is_the_even_figure_without_replicas():
    rng = np.random.default_rng(4)
    loads = rng.integers(0, 60, (3, 2, 8))
    plan = np.stack([rng.permutation(8), rng.permutation(8)])
    assert split_busiest_over_mean(plan, loads, 4) == pytest.approx(busiest_over_mean(plan, loads, 4))


# ---------------------------------------------------------------------- the search
def _tiny_optimum(counts, num_gpus, slots):
    """{map: busiest GPU rows under split_shares} for every map of one redundant slot (brute force)."""
    experts = len(counts)
    values = {}
    for extra in range(experts):
        for perm in set(itertools.permutations([*range(experts), extra])):
            row = np.array(perm)
            if not has_colocation(row, num_gpus):
                values[perm] = int(gpu_rows(split_shares(row, counts, num_gpus), num_gpus).max())
    assert len(values) > 100 and all(len(m) == num_gpus * slots for m in values)
    return values


def test_the_search_reaches_the_brute_force_optimum_of_a_tiny_layer():
    counts = np.array([12, 2, 4, 6, 8])               # 3 GPUs x 2 slots, one redundant: the best is 11 rows
    values = _tiny_optimum(counts, 3, 2)
    best, worst = min(values.values()), max(values.values())
    assert (best, worst) == (11, 20)
    starts = sorted(m for m, v in values.items() if v == worst)[:12]
    results = []
    for start in starts:
        plan = plan_for_split(np.array(start)[None, None], counts[None, None], 3, seed=0)
        row = plan.phy2log[0]
        assert tuple(row) in values                    # a valid map: every expert, no expert twice on a GPU
        assert plan.busiest[0] == values[tuple(row)] >= best
        assert plan.start_busiest[0] == worst
        results.append(plan.busiest[0])
    assert min(results) == best and np.mean(results) <= best + 0.5  # a local search: mostly the optimum


def _drift(seed, layers=2, steps=140):
    counts, _ = parse_synthetic(f"drift:steps={steps},layers={layers},experts=64,top_k=4,tokens=1024,seed={seed}")
    return counts


def test_plans_are_valid_repeat_and_never_worse_than_their_start():
    counts = _drift(7)
    train = counts[:60]
    total = train.sum(axis=0).astype(np.float64)
    eplb = eplb_rebalance(total, 64 + 16, 1, 1, 16)
    fast = solve(PlacementProblem(total, 16, 80), "fast").placement.phy2log
    plan = plan_for_split(np.stack([fast, eplb]), train, 16, seed=3)
    Placement(plan.phy2log, 64, 16)                   # valid: every expert, equal slots, no co-location
    assert np.array_equal(plan_for_split(np.stack([fast, eplb]), train, 16, seed=3).phy2log, plan.phy2log)
    starts = np.stack([fast, eplb])[plan.start, np.arange(2)]
    # judged independently on the steps it was made on: never busier than its start, and here less busy
    before, after = split_busiest(starts, train, 16), split_busiest(plan.phy2log, train, 16)
    assert np.array_equal(before, plan.start_busiest) and np.array_equal(after, plan.busiest)
    assert (after <= before).all() and after.sum() < 0.99 * before.sum()
    assert plan.gain == pytest.approx(after.sum() / before.sum() - 1) and (plan.moves > 0).all()


def test_colocated_starts_are_pulled_apart_unless_allowed():
    steps = load_trace(BUNDLED).step_counts()[:, :2]
    eplb = eplb_rebalance(steps.sum(axis=0).astype(np.float64), 128 + 32, 1, 1, 16)
    assert has_colocation(eplb[0], 16) or has_colocation(eplb[1], 16)
    apart = separate_replicas(eplb, steps.mean(axis=0), 16)
    Placement(apart, 128, 16)                          # no expert twice on a GPU any more
    for before, after in zip(eplb, apart):             # the same replica counts, few slots changed
        assert np.array_equal(np.bincount(before, minlength=128), np.bincount(after, minlength=128))
        assert 0 < (before != after).sum() <= 12 or not has_colocation(before, 16)
    plan = plan_for_split(eplb, steps, 16, rounds=2)
    Placement(plan.phy2log, 128, 16)
    kept = plan_for_split(eplb, steps, 16, allow_colocated=True, rounds=0)
    assert np.array_equal(kept.phy2log, eplb)          # allowed: the start as it is (no rounds, no move)
    # three replicas of expert 0 on 2 GPUs cannot be pulled apart: no start left for that layer
    with pytest.raises(InputError, match="starts"):
        plan_for_split(np.array([[0, 0, 0, 1]]), np.ones((2, 1, 2)), 2)


def test_separating_a_hand_worked_pair():
    # GPU 0 holds expert 0 twice; of the slots on GPU 1 (experts 1, 2, 3) expert 2's piece (5) is nearest 0's (6)
    row = separate_replicas(np.array([[0, 0, 4, 1, 2, 3]]), np.array([[12.0, 1.0, 5.0, 9.0, 2.0]]), 2)
    assert row.tolist() == [[0, 2, 4, 1, 0, 3]]


@pytest.mark.parametrize("kwargs, where", [({"rounds": -1}, "rounds"), ({"candidates": 0}, "candidates"),
                                           ({"max_steps": True}, "max_steps")])
def test_bad_arguments_name_themselves(kwargs, where):
    with pytest.raises(InputError, match=where):
        plan_for_split(np.arange(8)[None], np.ones((2, 1, 8)), 4, **kwargs)
    with pytest.raises(InputError, match="starts"):
        plan_for_split(np.arange(8)[None], np.ones((2, 2, 8)), 4)


# ---------------------------------------------------------------------- the CLI and the sizing
@pytest.fixture
def drift_trace(tmp_path):
    path = tmp_path / "drift.npz"
    counts = _drift(11, layers=2, steps=30)
    np.savez(path, format_version=1, num_experts=64, top_k=4, counts=counts)
    return path, counts


def test_plan_split_per_batch_is_recorded_for_evaluate(drift_trace, tmp_path, capsys):
    path, counts = drift_trace
    out = tmp_path / "p.json"
    assert main(["plan", str(path), "--gpus", "8", "--redundant", "8", "--split", "per-batch", "--out", str(out),
                 "--format", "json", "--no-progress"]) == 0
    text, err = capsys.readouterr()
    report = json.loads(text)
    plan = read_plan(out)
    assert plan.inputs["options"]["split"] == "per-batch" and report["split"] == "per-batch"
    section = report["split_placement"]
    assert section["planning_steps"] == 30 and section["starts"] == ["auto", "eplb"]
    assert "placed for the per-batch split on 30 steps" in err
    # the report's loads: the mean over the steps of each step's busiest GPU under split_shares
    busiest = split_busiest(plan.placement.phy2log, counts, 8)
    assert [row["max_gpu_load"] for row in report["layers"]] == pytest.approx(busiest)
    assert section["mean_busiest"] == pytest.approx(busiest, abs=1e-4)
    # evaluate takes the split from the plan
    assert main(["evaluate", str(out), str(path), "--format", "json", "--no-progress"]) == 0
    judged = json.loads(capsys.readouterr()[0])
    assert judged["split"] == "per-batch" and judged["options_from_plan"]["split"] == "per-batch"
    # and the same plan again: deterministic
    again = tmp_path / "q.json"
    assert main(["plan", str(path), "--gpus", "8", "--redundant", "8", "--split", "per-batch", "--out", str(again),
                 "--no-progress"]) == 0
    assert np.array_equal(read_plan(again).placement.phy2log, plan.placement.phy2log)


@pytest.mark.parametrize("argv, what", [(["--groups", "4"], "--groups"), (["--objective", "time"], "--objective"),
                                        (["--expert-memory-budget", "1000", "--expert-bytes", "10"],
                                         "--expert-memory-budget")])
def test_plan_split_per_batch_refuses_what_it_cannot_keep(drift_trace, tmp_path, capsys, argv, what):
    path, _ = drift_trace
    out = tmp_path / "p.json"
    redundant = [] if "--expert-memory-budget" in argv else ["--redundant", "8"]
    code = main(["plan", str(path), "--gpus", "8", *redundant, "--split", "per-batch", *argv, "--out", str(out),
                 "--no-progress"])
    err = capsys.readouterr()[1]
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--split per-batch" in err and what in err, err
    assert not out.exists()


def test_compare_keeps_per_batch_out_of_its_choices(drift_trace, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", str(drift_trace[0]), "--gpus", "8", "--split", "per-batch"])
    assert exit_info.value.code == 2 and "--split" in capsys.readouterr().err


def test_sizing_judges_with_the_split_and_plans_for_it():
    counts = _drift(12, layers=1, steps=6).astype(np.float64)
    memory = ReplicaMemory(expert_bytes=2**20, moe_layers=1)
    sizing = size_redundancy(counts, 8, memory, max_redundant=16, split="per-batch")
    assert sizing.split == "per-batch" and sizing.to_dict()["split"] == "per-batch"
    assert "per-batch split" in sizing.table()
    assert [row.redundant for row in sizing.rows] == [0, 8, 16]
    even = size_redundancy(counts, 8, memory, max_redundant=16)
    for row, plain in zip(sizing.rows, even.rows):
        figures = []
        for fold in (range(0, 2), range(2, 4), range(4, 6)):
            train = np.delete(counts, list(fold), axis=0)
            total = train.sum(axis=0)
            starts = np.stack([solve(PlacementProblem(total[None], 8, 64 + row.redundant), "fast").placement.phy2log,
                               eplb_rebalance(total, 64 + row.redundant, 1, 1, 8)])
            plan = plan_for_split(starts, train, 8).phy2log
            figures.append(split_busiest_over_mean(plan, counts[fold.start:fold.stop], 8).mean())
        assert row.fold_held_out == pytest.approx(figures)
        if row.redundant:  # replicas the split can use: less busy than the even split's plans held out
            assert row.held_out < plain.held_out
    with pytest.raises(InputError, match="split"):
        size_redundancy(counts, 8, memory, max_redundant=8, split="optimal")


def test_plan_redundant_auto_with_the_split(drift_trace, tmp_path, capsys):
    path, _ = drift_trace
    out = tmp_path / "p.json"
    assert main(["plan", str(path), "--gpus", "8", "--redundant", "auto", "--max-redundant", "16", "--expert-bytes",
                 "1048576", "--split", "per-batch", "--out", str(out), "--format", "json", "--no-progress"]) == 0
    report = json.loads(capsys.readouterr()[0])
    assert report["sizing"]["split"] == "per-batch" and "split_placement" in report
    assert read_plan(out).placement.num_physical == 64 + report["sizing"]["recommended_redundant"]
