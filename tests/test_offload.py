"""Offloaded serving: the tiered cost model, the resident-set planner (brute force on tiny cases),
the engines' rules and exports (a stand-in of kt-kernel's selection), and the CLI's bad input."""

import itertools
import json
import math
import re

import numpy as np
import pytest

from moe_place.cost.models import ExpertShape, get_model
from moe_place.cost.offload import (OffloadRates, expected_compute_s, expected_costs, expected_tiered_s,
                                    full_gpu_layer_s, prefill_threshold_tokens, tiered_times)
from moe_place.engines import llama_cpp, sglang_kt
from moe_place.errors import InputError
from moe_place.solvers.offload import OffloadProblem, layer_tables, plan_offload, whole_layer_plan

BUNDLED = "traces/data/qwen3-30b-a3b_prefill_topk.npz"
QWEN = get_model("Qwen3-30B-A3B")
RATES = OffloadRates(21.3e12, 220e9, 494.7e12, 1675e9, 64e9, 5e-6)


# ---------------------------------------------------------------------- cost model
@pytest.mark.parametrize("tokens", [1, 3, 8, 40, 150])
def test_expected_compute_is_the_binomial_expectation(tokens):
    share = np.array([0.0, 0.003, 0.05, 0.31, 0.9, 1.0])
    got = expected_compute_s(share, tokens, RATES.cpu_flops_per_s, RATES.dram_bytes_per_s, QWEN)
    a, w = 2 * QWEN.params_per_expert / RATES.cpu_flops_per_s, QWEN.expert_bytes / RATES.dram_bytes_per_s
    for q, value in zip(share, got):
        want = sum(math.comb(tokens, m) * q**m * (1 - q) ** (tokens - m) * max(a * m, w) for m in range(1, tokens + 1))
        assert value == pytest.approx(want, rel=1e-9, abs=1e-15)


def test_tiered_times_by_hand():
    model = ExpertShape("toy", hidden=4, intermediate=2, num_experts=3, top_k=2, num_moe_layers=1)
    rates = OffloadRates(cpu_flops_per_s=48.0, dram_bytes_per_s=12.0, gpu_flops_per_s=480.0, hbm_bytes_per_s=96.0,
                         link_bytes_per_s=8.0, alpha_s=0.5)
    # P_e = 24, W_e = 48 B, row 8 B; rows [3, 0, 1], expert 0 on the GPU, tokens 2
    times = tiered_times(np.array([3.0, 0.0, 1.0]), np.array([True, False, False]), 2, model, rates)
    cpu = 2 * 0.5 + 2 * 2 * 8 / 8 + max(2 * 1 * 24 / 48, 48 / 12)          # transfer + expert 2 (expert 1 idle)
    gpu = max(2 * 3 * 24 / 480, 48 / 96)
    assert float(times.cpu_s) == pytest.approx(cpu) and float(times.gpu_s) == pytest.approx(gpu)
    assert float(times.layer_s) == pytest.approx(max(cpu, gpu))
    everything = tiered_times(np.array([3.0, 0.0, 1.0]), np.ones(3, bool), 2, model, rates)
    assert float(everything.cpu_s) == 0.0                                   # nothing left on the CPU: no transfer
    full = full_gpu_layer_s(np.array([3.0, 0.0, 1.0]), np.array([True, False, False]), model, rates)
    assert float(full) == pytest.approx(2 * (0.5 + 48 / 8) + 2 * 48 / 96 + gpu + max(2 * 24 / 480, 48 / 96))


def test_prefill_threshold_is_the_first_batch_where_the_gpu_pass_wins():
    rng = np.random.default_rng(1)
    share = rng.dirichlet(np.ones(128), size=4) * 8
    resident = np.zeros((4, 128), bool)
    resident[:, :16] = True
    threshold = prefill_threshold_tokens(share, resident, QWEN, RATES)

    def full_minus_tiered(n):
        costs = expected_costs(share, n, QWEN, RATES)
        full = (~resident).sum() * (RATES.alpha_s + QWEN.expert_bytes / RATES.link_bytes_per_s) \
            + resident.sum() * 2 * QWEN.expert_bytes / RATES.hbm_bytes_per_s + costs.gpu_s.sum()
        return full - expected_tiered_s(costs, resident).layer_s.sum()

    assert threshold is not None and threshold > 1
    assert full_minus_tiered(threshold) < 0 <= full_minus_tiered(threshold - 1)
    for n in (threshold * 2, threshold * 8):                                # stays ahead past the crossover
        assert full_minus_tiered(n) < 0


# ---------------------------------------------------------------------- planner vs brute force
def _random_problem(rng, layers, experts, capacity, gpu_scale):
    scenarios = 2
    cpu = rng.uniform(0, 1, (scenarios, layers, experts)) * (rng.random((scenarios, layers, experts)) < 0.8)
    gpu = rng.uniform(0, gpu_scale, (scenarios, layers, experts))
    return OffloadProblem(tuple(range(layers)), ("a", "b"), (8, 32), rng.uniform(0.2, 2, scenarios), cpu, gpu,
                          rng.uniform(0, 0.5, scenarios), capacity)


def _brute_force(problem):
    """Optimum over every resident set of every layer and every split of the capacity."""
    e = problem.num_experts
    best_per_count = []
    for l in range(problem.num_layers):
        best = [math.inf] * (e + 1)
        for bits in itertools.product([False, True], repeat=e):
            mask = np.zeros((problem.num_layers, e), bool)
            mask[l] = bits
            cpu, gpu = problem.sides_s(mask)
            value = float(problem.weights @ np.maximum(cpu[:, l], gpu[:, l]))
            best[sum(bits)] = min(best[sum(bits)], value)
        best_per_count.append(best)
    return min(sum(best_per_count[l][k] for l, k in enumerate(split))
               for split in itertools.product(range(e + 1), repeat=problem.num_layers)
               if sum(split) <= problem.capacity)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("gpu_scale", [0.05, 1.5])   # the CPU side binds / the GPU side binds too
def test_plan_matches_brute_force_on_tiny_cases(seed, gpu_scale):
    rng = np.random.default_rng([seed, int(gpu_scale * 100)])
    layers, experts = int(rng.integers(1, 4)), int(rng.integers(2, 6))
    problem = _random_problem(rng, layers, experts, int(rng.integers(1, layers * experts + 1)), gpu_scale)
    optimum = _brute_force(problem)
    plan = plan_offload(problem, time_limit_s=20)
    assert plan.lower_bound_s <= optimum * (1 + 1e-9) + 1e-12
    assert plan.value_s == pytest.approx(problem.objective_s(plan.resident))
    assert plan.num_resident <= problem.capacity
    assert plan.value_s == pytest.approx(optimum, rel=1e-9, abs=1e-9)     # CP-SAT closes what the order leaves
    assert plan.status == "optimal"


def test_when_the_cpu_side_binds_the_order_is_optimal_without_cp_sat():
    rng = np.random.default_rng(5)
    problem = _random_problem(rng, 3, 5, 7, gpu_scale=1e-4)
    tables = layer_tables(problem)
    assert np.allclose(tables.value, tables.bound)                         # every count certified by step 2
    plan = plan_offload(problem, time_limit_s=0)
    assert plan.exact_layers == () and plan.status == "optimal"
    assert plan.value_s == pytest.approx(_brute_force(problem))


def test_whole_layer_plan_is_the_best_set_of_whole_layers():
    rng = np.random.default_rng(3)
    problem = _random_problem(rng, 5, 3, 15, gpu_scale=0.3)
    for gpu_layers in range(6):
        mask = whole_layer_plan(problem, gpu_layers)
        assert (mask.all(axis=1) | ~mask.any(axis=1)).all() and mask.all(axis=1).sum() == gpu_layers
        best = min(problem.objective_s(np.repeat(np.isin(np.arange(5), chosen)[:, None], 3, axis=1))
                   for chosen in itertools.combinations(range(5), gpu_layers))
        assert problem.objective_s(mask) == pytest.approx(best)


def test_problem_rejects_bad_input():
    rng = np.random.default_rng(0)
    good = _random_problem(rng, 2, 3, 2, 0.1)
    with pytest.raises(InputError, match="GPU capacity"):
        OffloadProblem(good.layer_ids, good.scenario_names, good.scenario_tokens, good.weights, good.cpu_s,
                       good.gpu_s, good.transfer_s, 0)
    with pytest.raises(InputError, match="cpu_s"):
        OffloadProblem(good.layer_ids, good.scenario_names, good.scenario_tokens, good.weights, -good.cpu_s,
                       good.gpu_s, good.transfer_s, 2)
    with pytest.raises(InputError, match="distinct experts per token"):
        OffloadProblem.from_counts(np.array([[5, 1]]), 4, [("d", 8, 1.0)], QWEN, RATES, 1)


# ---------------------------------------------------------------------- sglang-kt
def ref_generate_gpu_experts_masks(activation_freq, num_gpu_experts):
    """Stand-in of kt-kernel 0.7.2's `generate_gpu_experts_masks` (`kt_kernel/experts_base.py`), same
    signature and steps: clamp the count, one `torch.topk(largest=True, sorted=False)` over the flattened
    `[num_layers, num_experts]` frequencies, a bool mask of that shape on the CPU."""
    import torch

    layers, experts = activation_freq.shape
    k = max(min(num_gpu_experts, layers * experts), 0)
    if k == 0:
        return torch.zeros(layers, experts, dtype=torch.bool)
    _, top = torch.topk(activation_freq.view(-1).to("cpu"), k=k, largest=True, sorted=False)
    mask = torch.zeros(layers * experts, dtype=torch.bool)
    mask[top] = True
    return mask.view(layers, experts)


@pytest.mark.parametrize("seed", range(12))
def test_stats_make_sglang_kt_frequency_pick_the_planned_set(seed, tmp_path):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(seed)
    layers, experts = int(rng.integers(1, 50)), int(rng.integers(2, 257))
    total = int(rng.integers(1, layers * experts + 1))
    resident = np.zeros(layers * experts, bool)
    resident[rng.permutation(layers * experts)[:total]] = True
    resident = resident.reshape(layers, experts)
    counts = rng.integers(0, [3, 1000, 10**12][seed % 3], (layers, experts))   # ties, or counts float32 cannot hold
    dense = seed % 3                                                            # dense layers before the MoE ones
    stats = sglang_kt.planned_stats(resident, counts, tuple(range(dense, dense + layers)))
    assert stats.shape == (1, dense + layers, experts) and stats.dtype == np.int32 and not stats[0, :dense].any()
    path = tmp_path / "stats.pt"
    sglang_kt.write_stats(path, stats)
    loaded = torch.load(path, map_location="cpu", weights_only=True)["logical_count"]   # as sglang-kt reads it
    ratio = sglang_kt.gpu_experts_ratio(total, dense + layers, experts) if dense == 0 else \
        sglang_kt.gpu_experts_ratio(total, layers, experts)
    k = int(layers * experts * float(ratio))
    assert k == total
    chosen = sglang_kt.frequency_selection(loaded.numpy(), k, ref_generate_gpu_experts_masks)
    assert (chosen[dense:] == resident).all()
    assert chosen[dense:][resident].size == total


def test_strategy_masks_follow_sglang_kt():
    counts = np.arange(3 * 8)[::-1].reshape(3, 8)
    uniform = sglang_kt.strategy_mask("uniform", counts, 10)
    assert uniform.sum(axis=1).tolist() == [4, 3, 3] and uniform[0, :4].all() and not uniform[0, 4:].any()
    front = sglang_kt.strategy_mask("front-loading", counts, 10)
    assert front.sum(axis=1).tolist() == [8, 2, 0] and front[1, :2].all()
    freq = sglang_kt.strategy_mask("frequency", counts, 10)
    assert freq.reshape(-1)[:10].all() and freq.sum() == 10                    # the 10 largest counts
    assert sglang_kt.strategy_mask("random", counts, 10).sum() == 10
    with pytest.raises(InputError, match="strategy"):
        sglang_kt.strategy_mask("hottest", counts, 10)


def test_flags_give_the_planned_total():
    flags = sglang_kt.launch_flags(96, 48, 128, "s.pt")
    assert flags[flags.index("--kt-num-gpu-experts") + 1] == "2"
    flags = sglang_kt.launch_flags(910, 48, 128, "s.pt", prefill_threshold=4096)
    ratio = float(flags[flags.index("--kt-gpu-experts-ratio") + 1])
    assert int(48 * 128 * ratio) == 910 and flags[-1] == "4096"
    for total in range(1, 48 * 128 + 1):
        assert int(48 * 128 * float(sglang_kt.gpu_experts_ratio(total, 48, 128))) == total


# ---------------------------------------------------------------------- llama.cpp
def test_llama_cpp_patterns_match_the_layers_they_name():
    ids = (3, 4, 5, 10, 11, 12)                       # a model whose first 3 blocks are dense
    assert llama_cpp.n_cpu_moe_for(ids, 2) == 11 and llama_cpp.n_cpu_moe_for(ids, 0) == 13
    mask = llama_cpp.n_cpu_moe_mask(ids, 4, 11)
    assert mask.all(axis=1).tolist() == [False, False, False, False, True, True]
    assert llama_cpp.launch_flags(mask, ids) == ["-ngl", "999", "--n-cpu-moe", "11"]
    mask = np.zeros((6, 4), bool)
    mask[[1, 4]] = True                                 # blocks 4 and 11 on the GPU
    flags = llama_cpp.launch_flags(mask, ids)
    pattern, buffer = flags[flags.index("-ot") + 1].rsplit("=", 1)
    assert buffer == "CPU"
    for block in range(14):
        for tensor in ("ffn_up_exps", "ffn_gate_exps", "ffn_down_exps", "ffn_gate_up_exps", "ffn_up_chexps"):
            on_cpu = re.search(pattern, f"blk.{block}.{tensor}.weight") is not None
            assert on_cpu == (block in (3, 5, 10, 12)), (block, tensor)
        assert re.search(pattern, f"blk.{block}.attn_q.weight") is None
    split = np.zeros((6, 4), bool)
    split[0, 0] = True
    with pytest.raises(InputError, match="whole layers"):
        llama_cpp.launch_flags(split, ids)


# ---------------------------------------------------------------------- the command
def test_cli_on_the_bundled_trace(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    stats, plan = tmp_path / "stats.pt", tmp_path / "plan.json"
    code, err, out = _main(capsys, BUNDLED, "--gpu-memory", "12GiB", "--kv-reserve", "4GiB", "--batches", "24",
                           "--format", "json", "--stats-out", str(stats), "--out", str(plan), "--time-limit", "2")
    assert code == 0, err
    report = json.loads(out)
    capacity = (12 * 2**30 - 4 * 2**30) // QWEN.expert_bytes
    assert report["memory"]["capacity_experts"] == capacity
    assert report["plan"]["resident_experts"] <= capacity and report["plan"]["status"] == "optimal"
    held = report["held_out"]
    assert [f["judged_step"] for f in held["folds"]] == [0, 1, 2]
    for fold in held["folds"]:                          # the plan is never worse than uniform, the default
        assert fold["total_s"]["moe-place"] < fold["total_s"]["sglang-kt uniform"]
    written = json.loads(plan.read_text())
    resident = np.zeros((48, 128), bool)
    for layer, experts in written["resident_experts"].items():
        resident[int(layer), experts] = True
    logical = torch.load(stats, weights_only=True)["logical_count"].numpy()
    flags = report["sglang_kt"]["flags"]
    total = int(48 * 128 * float(flags[flags.index("--kt-gpu-experts-ratio") + 1]))
    assert (sglang_kt.frequency_selection(logical, total, ref_generate_gpu_experts_masks) == resident).all()


def _main(capsys, *args):
    """`moe-place offload ARGS` in this process (faster than a subprocess): (exit code, stderr, stdout)."""
    from moe_place.cli.main import main

    try:
        code = main(["offload", *args])
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.err, captured.out


@pytest.mark.parametrize("args, message", [
    (["--gpu-memory", "8MiB"], "--gpu-memory: expected room for at least one 9 MiB expert"),
    (["--gpu-memory", "12GiB", "--cpu", "EPYC-9999"], "cpu part: expected one of"),
    (["--gpu-memory", "12GiB", "--model", "Llama-4"], "model preset: expected one of"),
    (["--gpu-memory", "12GiB", "--model", "OLMoE-1B-7B"], "--model: expected a preset with the trace's 128 experts"),
    (["--gpu-memory", "12GiB", "--kv-reserve", "12GiB"], "--kv-reserve: expected less than --gpu-memory"),
    (["--gpu-memory", "twelve"], "argument --gpu-memory: expected bytes like"),
    (["--gpu-memory", "12GiB", "--stats-out", "stats.json"], "--stats-out stats.json: expected a file name ending in .pt"),
    (["--gpu-memory", "12GiB", "--batch-sizes", "8,0"], "argument --batch-sizes: expected a positive integer"),
    (["--gpu-memory", "12GiB", "--batches", "100000"], "--batches: expected at most 65,536"),
])
def test_cli_bad_input_is_one_line_and_exit_2(args, message, tmp_path, monkeypatch, capsys):
    bundled = str(__import__("pathlib").Path(BUNDLED).resolve())
    monkeypatch.chdir(tmp_path)
    code, err, _ = _main(capsys, bundled, *args, "--no-held-out")
    assert code == 2, err
    assert err.count("\n") == 1 and message in err, err
    assert not list(tmp_path.iterdir())                  # nothing written


def test_batch_limit_agrees_with_the_library():
    from moe_place.cli.offload import MAX_BATCHES
    from moe_place.engines import offload_compare

    assert MAX_BATCHES == offload_compare.MAX_BATCHES


def test_cli_model_without_preset(tmp_path, capsys):
    trace = tmp_path / "t.npz"
    np.savez(trace, format_version=1, num_experts=8, top_k=2, model="my-own-moe",
             counts=np.array([[[60, 56, 12, 12, 2, 1, 1, 0]]]))
    code, err, _ = _main(capsys, str(trace), "--gpu-memory", "1GiB")
    assert code == 2 and err.count("\n") == 1
    assert "--model: expected a preset" in err and "'my-own-moe' names none" in err


def test_cli_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys, tmp_path):
    import moe_place.engines.offload_compare as compare

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(compare, "compare_held_out", interrupted)
    out = tmp_path / "plan.json"
    code, err, _ = _main(capsys, BUNDLED, "--gpu-memory", "12GiB", "--out", str(out))
    assert code == 130 and err == "moe-place offload: interrupted\n"
    assert not out.exists()


# ---------------------------------------------------------------------- online
def _small_run(persistence=40.0, steps=120, prefill_every=20):
    from moe_place.online.offload import serving_run
    from moe_place.traces.synthetic import drifting_hot_spots

    return serving_run(drifting_hot_spots(4, 32, 4, 0.5, persistence), steps, 4, decode_tokens=16,
                       prefill_tokens=4096, prefill_every=prefill_every, seed=3)


def test_online_policies_keep_each_layers_count_and_static_never_copies():
    from moe_place.online.offload import POLICIES, replay_offload, warm_up_plan

    model = ExpertShape("toy", 2048, 768, 32, 4, 4)
    run = _small_run()
    assert run.top_k == 4
    mix = [("decode", 16, 0.95), ("prefill", 4096, 0.05)]
    start = warm_up_plan(run, 20, mix, model, RATES, 24)
    assert start.sum() <= 24
    outcomes = {p: replay_offload(run, p, start, model, RATES, mix, threshold=2048) for p in POLICIES}
    static = outcomes["static"]
    assert static.copy_s.sum() == 0 and static.link_copies == static.gpu_copies == 0
    assert static.full_gpu_passes == (run.tokens >= 2048).sum() == 6
    dynamic = outcomes["sglang-kt dynamic"]
    assert dynamic.link_copies == 0 and dynamic.gpu_copies > 0          # copies only from the full layer
    # each step's time is the model's: the static run re-priced step by step
    step = 7
    again = tiered_times(run.counts[step].astype(float), start, run.tokens[step], model, RATES).layer_s.sum()
    assert static.step_s[step] == pytest.approx(again)


def test_payback_swaps_only_what_pays_back():
    from moe_place.online.offload import PaybackSettings, replay_offload

    model = ExpertShape("toy", 2048, 768, 32, 4, 4)
    run = _small_run(persistence=1e9, steps=200, prefill_every=1000)     # hot spots that never move, no prefill
    mix = [("decode", 16, 1.0)]
    start = np.zeros((4, 32), bool)
    start[:, :6] = True                                                 # a poor start: the hot experts are elsewhere
    free = OffloadRates(21.3e12, 220e9, 494.7e12, 1675e9, 1e15, 0.0)    # copies cost next to nothing
    swapped = replay_offload(run, "payback", start, model, free, mix, settings=PaybackSettings(check_every=8))
    static = replay_offload(run, "static", start, model, free, mix)
    assert swapped.link_copies > 0 and swapped.total_s < static.total_s
    dear = OffloadRates(21.3e12, 220e9, 494.7e12, 1675e9, 1e3, 0.0)     # a copy would take hours
    never = replay_offload(run, "payback", start, model, dear, mix, settings=PaybackSettings(check_every=8))
    static_dear = replay_offload(run, "static", start, model, dear, mix)
    assert never.link_copies == 0 and never.total_s == pytest.approx(static_dear.total_s)


def test_dynamic_update_takes_the_batchs_most_frequent_experts():
    from moe_place.online.offload import ServingRun, replay_offload

    model = ExpertShape("toy", 2048, 768, 6, 2, 1)
    counts = np.array([[[0, 1, 9, 0, 7, 3]], [[5, 5, 0, 0, 0, 0]]])
    run = ServingRun(counts, np.array([11, 5]))
    start = np.array([[True, True, False, False, False, False]])
    outcome = replay_offload(run, "sglang-kt dynamic", start, model, RATES, [("d", 5, 1.0)], threshold=10)
    assert outcome.full_gpu_passes == 1 and outcome.gpu_copies == 2      # experts 2 and 4 came in
    after = tiered_times(counts[1].astype(float), np.array([[False, False, True, False, True, False]]), 5, model,
                         RATES).layer_s.sum()
    assert outcome.step_s[1] == pytest.approx(after)
