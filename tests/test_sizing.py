"""Redundancy sizing (`moe_place.solvers.sizing`, `plan --redundant auto`): the recommendation rule on
constructed curves, the KV bytes per token of the presets against hand-computed values, the held-out
figures against an independent evaluation, and the CLI path with its errors."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_place.cli.main import main
from moe_place.cost.models import KVCacheShape, get_model
from moe_place.errors import InputError
from moe_place.planfile import read_plan
from moe_place.problem import PlacementProblem
from moe_place.solvers import solve
from moe_place.solvers.evaluate import evaluate_placement
from moe_place.solvers.sizing import (MAX_CANDIDATES, ReplicaMemory, busiest_over_mean, candidate_redundancies,
                                      fold_slices, lower_hull, recommend, size_redundancy)

BUNDLED = "traces/data/qwen3-30b-a3b_prefill_topk.npz"


# ---------------------------------------------------------------------- the recommendation rule
def test_the_knee_is_where_a_gib_stops_buying_the_price():
    gib = [0.0, 1.0, 2.0, 3.0, 4.0]
    held = [2.0, 1.8, 1.7, 1.69, 1.685]  # gains per GiB: 10%, 5.6%, 0.59%, 0.30%
    r, reason, hull = recommend([0, 8, 16, 24, 32], gib, held, 0.01)
    assert r == 16 and hull == [0, 1, 2, 3, 4]
    assert "the next, to R = 24, lowers it by only 0.59%" in reason
    assert recommend([0, 8, 16, 24, 32], gib, held, 0.005)[0] == 24
    r, reason, _ = recommend([0, 8, 16, 24, 32], gib, held, 0.002)
    assert r == 32 and reason.startswith("the largest candidate")
    assert recommend([0, 8, 16, 24, 32], gib, held, 0.2)[0] == 0  # a price nothing pays: no replicas


def test_a_noisy_candidate_above_the_hull_is_passed_over():
    # R = 8 is worse than R = 0 (noise of few held-out steps); R = 16 still pays 5% per GiB from R = 0
    r, reason, hull = recommend([0, 8, 16, 24], [0.0, 1.0, 2.0, 3.0], [2.0, 2.05, 1.8, 1.79], 0.01)
    assert hull == [0, 2, 3] and r == 16 and "the next, to R = 24" in reason


def test_no_step_pays_and_a_rising_curve_keep_the_cheapest():
    r, reason, _ = recommend([0, 8, 16], [0.0, 1.0, 2.0], [2.0, 1.995, 1.99], 0.01)
    assert r == 0 and reason.startswith("no step pays 1.00% per GiB per GPU")
    r, reason, _ = recommend([0, 8, 16], [0.0, 1.0, 2.0], [2.0, 2.1, 2.2], 0.01)
    assert r == 0 and "does not lower it" in reason
    assert recommend([5], [0.3], [1.7])[:2] == (5, "the only candidate")


def test_the_recommendation_does_not_depend_on_how_far_the_candidates_go():
    gib = list(np.arange(12) * 0.5)
    held = [1.0 + 1.0 / (1.0 + x) for x in gib]  # convex, flattening: the knee is inside the range
    full = recommend(list(range(0, 96, 8)), gib, held, 0.05)[0]
    for stop in range(full // 8 + 2, 12):
        assert recommend(list(range(0, 8 * stop, 8)), gib[:stop], held[:stop], 0.05)[0] == full
    assert 0 < full < 88


def test_recommend_rejects_what_it_cannot_rank():
    with pytest.raises(InputError):
        recommend([], [], [])
    with pytest.raises(InputError):
        recommend([0, 8], [1.0, 1.0], [2.0, 1.0])  # memory must grow with R
    with pytest.raises(InputError):
        recommend([0, 8], [0.0, 1.0], [2.0, 1.0], -0.1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=12))
def test_lower_hull_against_brute_force(ys):
    x = [float(i) for i in range(len(ys))]
    y = [float(v) for v in ys]
    hull = lower_hull(x, y)
    for i in range(len(x)):
        # a vertex iff no chord between a point on each side passes on or below it
        below = any(y[a] + (y[b] - y[a]) * (x[i] - x[a]) / (x[b] - x[a]) <= y[i]
                    for a in range(i) for b in range(i + 1, len(x)))
        assert (i in hull) == (i in (0, len(x) - 1) or not below)


# ---------------------------------------------------------------------- candidates, folds, figures
def test_candidates_keep_p_divisible_and_stay_in_range():
    assert candidate_redundancies(128, 8) == list(range(0, 257, 8))
    assert candidate_redundancies(128, 64) == [0, 64, 128, 192, 256]
    odd = candidate_redundancies(128, 3)
    assert odd[0] == 1 and all((128 + r) % 3 == 0 for r in odd) and len(odd) <= MAX_CANDIDATES and odd[-1] <= 256
    assert candidate_redundancies(8, 2) == [0, 2, 4, 6, 8]  # at most one copy of each expert per GPU: E(G-1) = 8
    assert candidate_redundancies(128, 8, max_redundant=20) == [0, 8, 16]
    with pytest.raises(InputError, match="--max-redundant"):
        candidate_redundancies(128, 3, max_redundant=0)


def test_folds_leave_one_step_out_up_to_three():
    assert fold_slices(3) == [range(0, 1), range(1, 2), range(2, 3)]
    assert fold_slices(2) == [range(0, 1), range(1, 2)]
    assert fold_slices(7) == [range(0, 2), range(2, 5), range(5, 7)]
    with pytest.raises(InputError):
        fold_slices(1)


def test_busiest_over_mean_by_hand():
    # one layer, 4 experts on 2 GPUs (2 slots each): GPU 0 holds experts 0 and 1, GPU 1 holds 2 and 3
    step = np.array([[[6.0, 2.0, 1.0, 1.0]]])
    assert busiest_over_mean(np.array([[0, 1, 2, 3]]), step, 2)[0] == pytest.approx(8.0 / 5.0)
    # two layers are summed before the ratio; layer 1: GPU 0 holds experts 0, 2 (3), GPU 1 experts 1, 3 (7)
    two = np.array([[[6.0, 2.0, 1.0, 1.0], [1.0, 4.0, 2.0, 3.0]]])
    assert busiest_over_mean(np.array([[0, 1, 2, 3], [0, 2, 1, 3]]), two, 2)[0] == pytest.approx((8.0 + 7.0) / (5.0 + 5.0))
    assert busiest_over_mean(np.array([[0, 1, 2, 3]]), np.zeros((1, 1, 4)), 2)[0] == 1.0  # an idle step


def test_held_out_figures_match_an_independent_evaluation():
    rng = np.random.default_rng(3)
    loads = rng.integers(0, 200, (3, 2, 16)).astype(float) * rng.uniform(0.2, 3.0, 16)
    memory = ReplicaMemory(expert_bytes=2**20, moe_layers=2)
    sizing = size_redundancy(loads, 4, memory, max_redundant=8)
    assert [row.redundant for row in sizing.rows] == [0, 4, 8]
    for row in sizing.rows:
        figures = []
        for k in range(3):
            train = np.delete(loads, k, axis=0).sum(axis=0)
            plan = solve(PlacementProblem(train[None], 4, 16 + row.redundant), "fast").placement
            layers = evaluate_placement(plan, loads[k])
            figures.append(sum(r.max_gpu_load for r in layers) / sum(r.mean_gpu_load for r in layers))
        assert row.fold_held_out == pytest.approx(figures)
        assert row.held_out == pytest.approx(np.mean(figures))
        assert row.replica_bytes_per_gpu == row.redundant * 2 * 2**20 // 4 and row.kv_tokens_per_gpu is None
    assert size_redundancy(loads, 4, memory, max_redundant=8).to_dict() == sizing.to_dict()  # deterministic


def test_a_memory_cap_drops_the_dearer_candidates():
    loads = np.random.default_rng(1).integers(1, 50, (2, 1, 8)).astype(float)
    memory = ReplicaMemory(expert_bytes=1000, moe_layers=1, kv_bytes_per_token=100)
    sizing = size_redundancy(loads, 2, memory, max_replica_bytes=2000)
    assert [r.redundant for r in sizing.rows] == [0, 2, 4]
    assert [r.kv_tokens_per_gpu for r in sizing.rows] == [0, 10, 20]  # 1000 * R / 2 bytes, 100 bytes a token
    with pytest.raises(InputError, match="--max-replica-bytes"):
        size_redundancy(loads, 3, memory, max_replica_bytes=100)  # R = 1 is the least 3 GPUs allow: 333 bytes


def test_progress_off_a_terminal_counts_plans_or_the_split_searches(monkeypatch, capsys):
    monkeypatch.setattr("moe_place.progress.INTERVAL_S", 0.0)  # a line at every unit, not every 5 s of the clock
    loads = np.random.default_rng(1).integers(1, 50, (3, 2, 8)).astype(float)
    memory = ReplicaMemory(expert_bytes=1000, moe_layers=2)
    even = size_redundancy(loads, 2, memory, max_redundant=2, progress=True)
    lines = capsys.readouterr().err.splitlines()  # capsys' stderr is no terminal: plain lines
    assert lines[-1] == "size redundancy (6 plans): 6/6 plans (100%) after 0 s, done"
    split = size_redundancy(loads, 2, memory, max_redundant=2, progress=True, split="per-batch")
    lines = capsys.readouterr().err.splitlines()
    total = 6 * 2 * 40  # plans x layers x the search's rounds (split_placement.ROUNDS)
    assert lines[-1] == (f"size redundancy (6 plans): {total}/{total} layer rounds of the split's search (100%) "
                         "after 0 s, done")
    assert size_redundancy(loads, 2, memory, max_redundant=2).to_dict() == even.to_dict()  # progress changes nothing
    assert capsys.readouterr().err == ""
    assert split.split == "per-batch"


# ---------------------------------------------------------------------- KV bytes per token
def test_kv_bytes_per_token_by_hand():
    # Qwen3-30B-A3B config.json: 48 layers, 4 KV heads of 128; K and V, BF16
    assert get_model("Qwen3-30B-A3B").kv_bytes_per_token == 48 * 2 * 4 * 128 * 2 == 98_304
    # DeepSeek-V3: 61 layers (dense ones too) of MLA's latent, kv_lora_rank 512 + qk_rope_head_dim 64, BF16
    assert get_model("DeepSeek-R1").kv_bytes_per_token == 61 * (512 + 64) * 2 == 70_272
    assert get_model("Kimi-K2").kv_bytes_per_token == 70_272 and get_model("Kimi-K2").num_experts == 384
    assert get_model("Qwen3-235B-A22B").kv_bytes_per_token == 94 * 2 * 4 * 128 * 2
    assert KVCacheShape.grouped_query(32, 8, 128, dtype_bytes=1.0).bytes_per_token == 65_536  # an FP8 cache
    with pytest.raises(InputError):
        KVCacheShape(0, 10)


# ---------------------------------------------------------------------- CLI
def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_redundant_auto_writes_the_recommended_plan(tmp_path, capsys):
    out, png = tmp_path / "p.json", tmp_path / "s.png"
    code, text, err = _run(capsys, "plan", BUNDLED, "--layers", "0-3", "--gpus", "8", "--redundant", "auto",
                           "--max-redundant", "64", "--out", out, "--plot", png, "--format", "json", "--no-progress")
    assert code == 0, err
    report = json.loads(text)
    sizing = report["sizing"]
    plan = read_plan(out)
    assert plan.placement.num_physical == 128 + sizing["recommended_redundant"]
    assert json.loads(out.read_text())["report"]["sizing"] == sizing
    rows = sizing["candidates"]
    assert [r["redundant"] for r in rows] == list(range(0, 65, 8))
    assert all(r["kv_tokens_per_gpu"] == r["replica_bytes_per_gpu"] // 98_304 for r in rows)
    assert rows[1]["replica_bytes_per_gpu"] == 8 * 48 * get_model("Qwen3-30B-A3B").expert_bytes // 8
    assert sizing["folds"].startswith("3 held-out folds of 3 steps (leave one step out)")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"sized R = {sizing['recommended_redundant']}" in err


def test_plan_redundant_auto_table_and_one_step_token_trace(tmp_path, capsys):
    ids = np.random.default_rng(0).integers(0, 16, (400, 2, 2))
    ids[:, :, 1] = (ids[:, :, 0] + 1 + ids[:, :, 1] % 15) % 16  # two distinct experts per token
    trace = tmp_path / "one.npz"
    np.savez(trace, format_version=1, num_experts=16, top_k=2, topk_ids=ids)
    code, text, err = _run(capsys, "plan", trace, "--gpus", "4", "--redundant", "auto", "--expert-bytes", "1048576",
                           "--out", tmp_path / "p.json", "--no-progress")
    assert code == 0, err
    assert "two halves of tokens" in text and "recommended R =" in text and "<- recommended" in text
    assert "bytes/token unknown" in text  # no preset: memory from --expert-bytes, no KV tokens
    # the table's rows are what they say, the marked row is the recommended R, and the plan written has it
    rows = [line.split() for line in text.splitlines() if line.split() and line.split()[0].isdigit()
            and len(line.split()) >= 8]
    assert [int(r[0]) for r in rows] == sorted(int(r[0]) for r in rows) and int(rows[0][0]) == 0
    for r in rows:
        redundant, physical, per_gpu, gib = int(r[0]), int(r[1]), int(r[2]), float(r[6])
        assert physical == 16 + redundant and per_gpu == physical // 4
        assert gib == round(redundant / 4 * 2 * 2**20 / 2**30, 2)   # R/G replicas x 2 layers x 1 MiB per GPU
    marked = [int(r[0]) for r in rows if "<-" in r]
    recommended = int(text.split("recommended R = ")[1].split(":")[0])
    assert marked == [recommended]
    assert json.loads((tmp_path / "p.json").read_text())["num_physical_experts"] == 16 + recommended


@pytest.mark.parametrize("argv, where", [
    (["--redundant", "auto"], "--model"),                                       # the trace's model names no preset
    (["--redundant", "4", "--min-gain-per-gib", "0.02"], "--min-gain-per-gib"),  # sizing options need auto
    (["--redundant", "auto", "--model", "Qwen3-30B-A3B"], "--model"),            # 8 experts, not 128
    (["--redundant", "auto", "--expert-bytes", "100", "--objective", "time"], "--redundant auto"),
    (["--redundant", "auto", "--expert-bytes", "100", "--groups", "3"], "--groups"),
])
def test_plan_redundant_auto_bad_input_is_one_line(tmp_path, capsys, argv, where):
    trace = tmp_path / "t.npz"
    np.savez(trace, format_version=1, num_experts=8, top_k=2,
             counts=np.array([[[600, 560, 120, 120, 20, 10, 10, 10]], [[200, 200, 200, 200, 200, 200, 200, 200]]]))
    out = tmp_path / "p.json"
    code, _, err = _run(capsys, "plan", trace, "--gpus", "4", *argv, "--out", out, "--no-progress")
    assert code == 2 and len(err.strip().splitlines()) == 1 and where in err, err
    assert not out.exists()


def test_one_step_of_counts_cannot_be_sized(tmp_path, capsys):
    trace = tmp_path / "t.npz"
    np.savez(trace, format_version=1, num_experts=8, top_k=1, counts=np.array([[[600, 560, 120, 120, 20, 10, 10, 10]]]))
    code, _, err = _run(capsys, "plan", trace, "--gpus", "4", "--redundant", "auto", "--expert-bytes", "100",
                        "--out", tmp_path / "p.json", "--no-progress")
    assert code == 2 and "one step of counts" in err and len(err.strip().splitlines()) == 1


def test_compare_does_not_take_auto(tmp_path, capsys):
    trace = tmp_path / "t.npz"
    np.savez(trace, format_version=1, num_experts=8, top_k=1, counts=np.array([[[6, 5, 1, 1, 2, 1, 1, 1]]]))
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", str(trace), "--gpus", "4", "--redundant", "auto"])
    assert exit_info.value.code == 2
    assert "--redundant" in capsys.readouterr().err
