"""Offloaded serving: the tiered cost model, the resident-set planner (brute force on tiny cases),
the engines' rules and exports (a stand-in of kt-kernel's selection), and the CLI's bad input."""

import itertools
import json
import math
import re
import shlex

import numpy as np
import pytest

from moe_place.cost.models import ExpertShape, get_model
from moe_place.cost.offload import (OffloadRates, expected_compute_s, expected_costs, expected_tiered_s,
                                    full_gpu_layer_s, prefill_threshold_tokens, tiered_times)
from moe_place.engines import llama_cpp, sglang_kt
from moe_place.solvers import offload_rules
from moe_place.errors import InputError
from moe_place.solvers.offload import (ALL_FIT, THINNED, OffloadProblem, count_order, held_out_curves, mask_of,
                                      mean_objective_s, plan_held_out, plan_offload, whole_layer_plan)

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


# ---------------------------------------------------------------------- the planning problem
def _random_problem(rng, layers, experts, gpu_scale, batches=5):
    """Batches of random rows (some experts idle), two scenarios, a toy model whose GPU side binds
    more or less (`gpu_scale` multiplies the GPU's time)."""
    model = ExpertShape("toy", hidden=64, intermediate=32, num_experts=experts, top_k=1, num_moe_layers=layers)
    rates = OffloadRates(cpu_flops_per_s=2e9, dram_bytes_per_s=4e9, gpu_flops_per_s=2e10 / gpu_scale,
                         hbm_bytes_per_s=4e10 / gpu_scale, link_bytes_per_s=1e10, alpha_s=1e-7)
    rows = rng.integers(0, 40, (batches, layers, experts)) * (rng.random((batches, layers, experts)) < 0.7)
    return OffloadProblem.from_rows(rows, rng.integers(1, 60, batches), np.arange(batches) % 2,
                                    [("a", float(rng.uniform(0.2, 2))), ("b", 1.0)], model, rates), rows, model, rates


@pytest.mark.parametrize("seed", range(6))
def test_problem_prices_each_batch_with_the_cost_model(seed):
    rng = np.random.default_rng(seed)
    problem, rows, model, rates = _random_problem(rng, 3, 5, gpu_scale=1.0)
    for _ in range(4):
        resident = rng.random((3, 5)) < 0.5
        cpu, gpu = problem.sides_s(resident)
        tokens = np.zeros(problem.num_batches)   # transfer priced from the batch's tokens: compare without it
        times = tiered_times(rows, resident[None], tokens[:, None], model, rates)
        some_cpu = ~resident.all(axis=1)
        assert np.allclose(cpu, times.cpu_s - 2 * rates.alpha_s * some_cpu + problem.transfer_s[:, None] * some_cpu,
                           rtol=1e-6)
        assert np.allclose(gpu, times.gpu_s, rtol=1e-6)
        steps = np.maximum(cpu, gpu).sum(axis=1)
        want = sum(w * steps[problem.batch_scenario == s].mean() for s, w in enumerate(problem.scenario_weights))
        assert problem.objective_s(resident) == pytest.approx(want)   # the max per batch, then the mean


def test_the_max_is_taken_per_batch():
    """Two batches, one CPU-heavy and one GPU-heavy: the mean of the maxima, not the max of the means."""
    cpu = np.array([[[4.0, 0.0]], [[0.0, 0.0]]])
    gpu = np.array([[[0.0, 0.0]], [[0.0, 4.0]]])
    problem = OffloadProblem((0,), ("d",), np.array([1.0]), np.array([0, 0]), cpu, gpu, np.zeros(2))
    resident = np.array([[False, True]])
    assert problem.objective_s(resident) == pytest.approx(4.0)        # (max(4, 0) + max(0, 4)) / 2
    assert max(cpu[:, 0, 0].mean(), gpu[:, 0, 1].mean()) == 2.0        # what the fluid model would say


def _all_sets(problem, layer):
    e = problem.num_experts
    for bits in itertools.product([False, True], repeat=e):
        mask = np.zeros((problem.num_layers, e), bool)
        mask[layer] = bits
        yield sum(bits), mask, float(problem.layer_values_s(mask)[layer])


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("gpu_scale", [0.02, 3.0])   # the CPU side binds / the GPU side binds too
def test_prefix_values_and_bounds_against_every_set(seed, gpu_scale):
    rng = np.random.default_rng([seed, int(gpu_scale * 100)])
    layers, experts = 2, int(rng.integers(2, 6))
    problem, _, _, _ = _random_problem(rng, layers, experts, gpu_scale)
    order = np.stack([rng.permutation(experts) for _ in range(layers)])
    prefix = problem.prefix_values_s(order)
    bounds = problem.layer_bounds_s()
    for l in range(layers):
        best = [math.inf] * (experts + 1)
        for k, _, value in _all_sets(problem, l):
            best[k] = min(best[k], value)
        for k in range(experts + 1):
            mask = mask_of(order, np.where(np.arange(layers) == l, k, 0))
            assert prefix[l, k] == pytest.approx(float(problem.layer_values_s(mask)[l]))
            assert bounds[l, k] <= best[k] * (1 + 1e-9) + 1e-15          # a valid lower bound for every set of k


@pytest.mark.parametrize("seed", range(6))
def test_plan_offload_is_the_best_split_of_its_order(seed):
    """The knapsack over layers is exact for the order's prefixes: every split of the capacity checked."""
    rng = np.random.default_rng(seed)
    layers, experts = int(rng.integers(1, 4)), int(rng.integers(2, 5))
    problem, _, _, _ = _random_problem(rng, layers, experts, gpu_scale=float(rng.choice([0.02, 3.0])))
    capacity = int(rng.integers(1, layers * experts + 1))
    order = np.argsort(-np.tensordot(problem.weights, problem.cpu_s.astype(float), axes=1), axis=1, kind="stable")
    plan = plan_offload(problem, capacity)
    best = min(problem.objective_s(mask_of(order, split)) for split in itertools.product(range(experts + 1),
                                                                                           repeat=layers)
               if sum(split) <= capacity)
    assert plan.num_resident <= capacity
    assert plan.value_s == pytest.approx(problem.objective_s(plan.resident)) == pytest.approx(best)
    assert plan.lower_bound_s <= plan.value_s * (1 + 1e-9)


def test_where_the_cpu_side_binds_the_order_is_optimal_and_the_bound_met():
    rng = np.random.default_rng(5)
    problem, _, _, _ = _random_problem(rng, 3, 4, gpu_scale=1e-4, batches=1)
    plan = plan_offload(problem, 7)
    optimum = min(problem.objective_s(np.array(bits).reshape(3, 4))
                  for bits in itertools.product([False, True], repeat=12) if sum(bits) <= 7)
    assert plan.value_s == pytest.approx(optimum) and plan.gap < 1e-9


def test_whole_layer_plan_is_the_best_set_of_whole_layers():
    rng = np.random.default_rng(3)
    problem, _, _, _ = _random_problem(rng, 5, 3, gpu_scale=1.0)
    for gpu_layers in range(6):
        mask = whole_layer_plan([problem], gpu_layers)
        assert (mask.all(axis=1) | ~mask.any(axis=1)).all() and mask.all(axis=1).sum() == gpu_layers
        best = min(problem.objective_s(np.repeat(np.isin(np.arange(5), chosen)[:, None], 3, axis=1))
                   for chosen in itertools.combinations(range(5), gpu_layers))
        assert problem.objective_s(mask) == pytest.approx(best)


# ---------------------------------------------------------------------- the held-out plan
def _planning_data(seed, layers=3, experts=6, steps=3, gpu_scale=3.0):
    rng = np.random.default_rng(seed)
    parts, counts = [], []
    for _ in range(steps):
        problem, rows, _, _ = _random_problem(rng, layers, experts, gpu_scale)
        parts.append(problem)
        counts.append(rows.sum(axis=0))
    return parts, counts


def _frequency(counts, capacity):
    return offload_rules.strategy_mask("frequency", sum(counts), capacity)


def test_held_out_curves_leave_each_step_out():
    parts, counts = _planning_data(1)
    curves = held_out_curves(parts, counts)
    want = np.mean([parts[i].prefix_values_s(count_order(sum(c for j, c in enumerate(counts) if j != i)))
                    for i in range(3)], axis=0)
    assert np.allclose(curves.value_s, want) and curves.left_out == 3
    assert (curves.order == count_order(sum(counts))).all()
    alone = held_out_curves(parts[:1], counts[:1])                         # one step: priced on itself
    assert np.allclose(alone.value_s, parts[0].prefix_values_s(count_order(counts[0]))) and alone.left_out == 0


@pytest.mark.parametrize("seed", range(10))
def test_held_out_plan_thins_frequency_and_beats_every_candidate(seed):
    parts, counts = _planning_data(seed, gpu_scale=float([0.05, 3.0, 20.0][seed % 3]))
    curves = held_out_curves(parts, counts)
    rng = np.random.default_rng(seed)
    for capacity in (1, 5, 11, 17):
        anchor = _frequency(counts, capacity)
        rules = {s: offload_rules.strategy_mask(s, sum(counts), capacity) for s in offload_rules.STRATEGIES}
        rules["arbitrary"] = np.zeros((3, 6), bool)
        rules["arbitrary"].flat[rng.permutation(18)[:capacity]] = True
        plan = plan_held_out(parts, curves, anchor, rules, capacity)
        assert plan.num_resident <= capacity and plan.lower_bound_s <= plan.value_s * (1 + 1e-9)
        for name, mask in rules.items():                                    # never worse on the planning data
            assert plan.value_s <= mean_objective_s(parts, mask) * (1 + 1e-12), name
        # the thinned set: per layer the best prefix of the count order no longer than frequency's
        top = anchor.sum(axis=1)
        kept = [min(range(top[l] + 1), key=lambda k: (curves.value_s[l, k], -k)) for l in range(3)]
        thinned = mask_of(curves.order, kept)
        assert plan.candidates_s[THINNED] == pytest.approx(mean_objective_s(parts, thinned))
        if plan.source == THINNED:
            assert (plan.resident == thinned).all()


def test_held_out_plan_when_everything_fits_and_on_ties():
    parts, counts = _planning_data(4)
    curves = held_out_curves(parts, counts)
    plan = plan_held_out(parts, curves, _frequency(counts, 18), {}, 18)
    assert plan.resident.all() and plan.source == ALL_FIT                 # no search: every expert on the GPU
    anchor = _frequency(counts, 9)
    same = plan_held_out(parts, curves, anchor, {"copy": anchor.copy()}, 9)
    assert same.source in (THINNED, "copy")
    if (same.resident == anchor).all():
        assert same.source == THINNED                                     # a tie keeps the thinned set
    with pytest.raises(InputError, match="anchor"):
        plan_held_out(parts, curves, ~anchor, {}, 9)


def test_frequency_rule_is_a_prefix_of_the_count_order_with_ties():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 3, (6, 10))                                   # many ties, also across layers
    for total in range(0, 61, 7):
        mask = offload_rules.strategy_mask("frequency", counts, total)
        assert (mask_of(count_order(counts), mask.sum(axis=1)) == mask).all()


def test_problem_rejects_bad_input():
    cpu = np.ones((2, 1, 3))
    with pytest.raises(InputError, match="cpu_s"):
        OffloadProblem((0,), ("d",), np.ones(1), np.zeros(2), -cpu, cpu, np.zeros(2))
    with pytest.raises(InputError, match="batch_scenario"):
        OffloadProblem((0,), ("d",), np.ones(1), np.array([0, 1]), cpu, cpu, np.zeros(2))
    with pytest.raises(InputError, match="GPU capacity"):
        plan_offload(OffloadProblem((0,), ("d",), np.ones(1), np.zeros(2), cpu, cpu, np.zeros(2)), 0)


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


def frequency_selection(logical_count, total):
    """What sglang-kt's `frequency` rule selects from a stats tensor `[buffer, layers, E]`: it sums dim 0 as
    float32 and calls kt-kernel's `generate_gpu_experts_masks(activation_freq, total)`; bool `[layers, E]`."""
    import torch

    return ref_generate_gpu_experts_masks(torch.from_numpy(logical_count).sum(dim=0).float(), int(total)).numpy()


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
    chosen = frequency_selection(loaded.numpy(), k)
    assert (chosen[dense:] == resident).all()
    assert chosen[dense:][resident].size == total


def test_strategy_masks_follow_sglang_kt():
    counts = np.arange(3 * 8)[::-1].reshape(3, 8)
    uniform = offload_rules.strategy_mask("uniform", counts, 10)
    assert uniform.sum(axis=1).tolist() == [4, 3, 3] and uniform[0, :4].all() and not uniform[0, 4:].any()
    front = offload_rules.strategy_mask("front-loading", counts, 10)
    assert front.sum(axis=1).tolist() == [8, 2, 0] and front[1, :2].all()
    freq = offload_rules.strategy_mask("frequency", counts, 10)
    assert freq.reshape(-1)[:10].all() and freq.sum() == 10                    # the 10 largest counts
    assert offload_rules.strategy_mask("random", counts, 10).sum() == 10
    with pytest.raises(InputError, match="strategy"):
        offload_rules.strategy_mask("hottest", counts, 10)


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
    assert offload_rules.n_cpu_moe_for(ids, 2) == 11 and offload_rules.n_cpu_moe_for(ids, 0) == 13
    mask = offload_rules.n_cpu_moe_mask(ids, 4, 11)
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
                           "--format", "json", "--stats-out", str(stats), "--out", str(plan))
    assert code == 0, err
    report = json.loads(out)
    capacity = (12 * 2**30 - 4 * 2**30) // QWEN.expert_bytes
    assert report["memory"]["capacity_experts"] == capacity
    assert report["plan"]["resident_experts"] <= capacity
    for name, value in report["plan"]["candidates_s"].items():        # never worse than a rule on the planning data
        assert report["plan"]["value_s"] <= value * (1 + 1e-12), name
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
    assert (frequency_selection(logical, total) == resident).all()


def test_cli_plans_are_the_same_every_run_and_all_fit_means_all(capsys, monkeypatch):
    """No wall clock decides a plan: a clock that jumps an hour per reading changes nothing."""
    import time

    plans = {}
    for run in range(2):
        if run:
            ticks = iter(range(0, 10**9, 3600))
            monkeypatch.setattr(time, "perf_counter", lambda: float(next(ticks)))
            monkeypatch.setattr(time, "monotonic", lambda: float(next(ticks)))
        for memory in ("12GiB", "48GiB", "58GiB"):
            code, err, out = _main(capsys, BUNDLED, "--gpu-memory", memory, "--batches", "16", "--no-held-out",
                                   "--format", "json")
            assert code == 0, err
            plans[run, memory] = json.loads(out)["plan"]["experts_per_layer"], json.loads(out)["plan"]["value_s"]
    for memory in ("12GiB", "48GiB", "58GiB"):
        assert plans[0, memory] == plans[1, memory]
    assert plans[0, "58GiB"][0] == [128] * 48                           # 58 GiB holds all 6,144 experts of 9 MiB


def test_cli_flag_lines_paste_into_a_shell(tmp_path, capsys):
    pytest.importorskip("torch")
    stats = tmp_path / "my stats" / "kt stats.pt"
    stats.parent.mkdir()
    code, err, out = _main(capsys, BUNDLED, "--gpu-memory", "30GiB", "--batches", "8", "--no-held-out",
                           "--stats-out", str(stats))
    assert code == 0, err
    lines = {line.split(":", 1)[0]: line for line in out.splitlines()}
    kt = shlex.split(lines["sglang-kt"].split(": ", 1)[1])
    assert kt[kt.index("--init-expert-location") + 1] == str(stats)     # one word, the path with its spaces
    llama = lines[next(k for k in lines if k.startswith("llama.cpp"))]
    words = shlex.split(llama.split("): ", 1)[1].split("  (predicted")[0])
    assert words[:2] == ["-ngl", "999"]
    pattern = words[words.index("-ot") + 1]                            # 26 whole layers: not the first ones
    assert pattern.startswith("blk\\.(") and pattern.endswith(llama_cpp.EXPERT_TENSORS + "=CPU")
    assert re.search(pattern.rsplit("=", 1)[0], f"blk.{pattern[6:].split('|')[0]}.ffn_up_exps.weight")


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
    (["--gpu-memory", "0"], "--gpu-memory: expected a size > 0"),
    (["--gpu-memory", "-4GiB"], "argument --gpu-memory: expected a size >= 0 like 12GiB, got '-4GiB'"),
    (["--gpu-memory", "12GiB", "--kv-reserve", "-1GiB"], "argument --kv-reserve: expected a size >= 0"),
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
    from moe_place.solvers import offload_compare

    assert MAX_BATCHES == offload_compare.MAX_BATCHES


def test_cli_model_without_preset(tmp_path, capsys):
    trace = tmp_path / "t.npz"
    np.savez(trace, format_version=1, num_experts=8, top_k=2, model="my-own-moe",
             counts=np.array([[[60, 56, 12, 12, 2, 1, 1, 0]]]))
    code, err, _ = _main(capsys, str(trace), "--gpu-memory", "1GiB")
    assert code == 2 and err.count("\n") == 1
    assert "--model: expected a preset" in err and "'my-own-moe' names none" in err


def test_cli_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys, tmp_path):
    import moe_place.solvers.offload_compare as compare

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


# ---------------------------------------------------------------------- the docs show the committed records
def test_docs_sweep_tables_are_what_the_record_prints():
    """docs/results/offload.md shows the sweep's tables and target lines as `--table-from` prints them."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "bench/bench_offload_sweep.py", "--table-from",
                           "bench/results/offload_sweep.json"], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    page = (root / "docs" / "results" / "offload.md").read_text()
    tables, targets = done.stdout.strip().rsplit("\n\n", 1)  # the two tables, then the target lines
    assert tables in page
    assert all(f"\n- {line}\n" in page for line in targets.splitlines()), targets
