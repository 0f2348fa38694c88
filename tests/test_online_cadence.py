"""The load estimate, vLLM's layer walk in the replay, and the cadence sweep (`moe-place cadence`)."""

from __future__ import annotations

import json
import shlex

import numpy as np
import pytest

from moe_place.cli.main import main
from moe_place.cost.cluster import cluster_cost
from moe_place.engines.config import load_engine_config
from moe_place.engines.launch import engine_settings
from moe_place.errors import InputError
from moe_place.online.cadence import cadences, sweep
from moe_place.online.controller import EngineCadence, initial_map, make_controller
from moe_place.online.estimate import BLAS_ONE_THREAD_WORK, LoadEstimate
from moe_place.online.policy import RebalanceRule
from moe_place.online.replay import hindsight_next_reference, replay
from moe_place.online.switch import MapSwitch
from moe_place.placement import Placement

LAYERS, EXPERTS, GPUS = 3, 16, 4


def _steps(shares: np.ndarray, n: int, tokens: int, rng: np.random.Generator) -> np.ndarray:
    """float `[n, layers, E]`: each step `tokens` draws per layer from `shares [layers, E]`."""
    return np.stack([[rng.multinomial(tokens, row) for row in shares] for _ in range(n)]).astype(np.float64)


def _shares(rng: np.random.Generator) -> np.ndarray:
    return rng.dirichlet(np.full(EXPERTS, 0.5), size=LAYERS)


# ---------------------------------------------------------------------- the estimate
class _Folding:
    """A load estimate and its state between windows, held as the rule holds them."""

    def __init__(self, layers: int, experts: int):
        self.estimate = LoadEstimate(layers, experts)
        self.state, self.draw = self.estimate.create_state(), None

    def update(self, *args, **kwargs) -> np.ndarray:
        lam, self.state, self.draw = self.estimate.update(self.state, *args, **kwargs)
        return lam


def test_a_stationary_load_chooses_a_long_memory_and_the_estimate_settles():
    rng = np.random.default_rng(0)
    shares = _shares(rng)
    estimate = _Folding(LAYERS, EXPERTS)
    for _ in range(12):
        lam = estimate.update(_steps(shares, 50, 400, rng), 50, 50)
    assert (estimate.state.chosen >= 50).all()               # at least an interval of memory, every layer
    truth = shares * 400
    window_error = np.abs(_steps(shares, 50, 400, rng).mean(axis=0) - truth).mean()
    assert np.abs(lam - truth).mean() < 0.6 * window_error   # better than one window's mean


def test_each_memory_is_the_weighted_mean_of_every_step_seen_also_when_folded_in_slices():
    # 2 layers x 1,500 experts: the blocks' matrix products run in column slices (one BLAS thread each);
    # every candidate must still be sum_t 2^(-age_t / h) x_t / sum_t 2^(-age_t / h) over both windows, to
    # float32's precision (the products' type) relative to the layer's mean load
    rng = np.random.default_rng(3)
    layers, experts = 2, 1500
    shares = rng.dirichlet(np.full(experts, 0.5), size=layers)
    windows = [np.stack([[rng.multinomial(20000, row) for row in shares] for _ in range(n)]).astype(np.float64)
               for n in (300, 700)]
    estimate = _Folding(layers, experts)
    estimate.update(windows[0], 300, 300)
    estimate.update(windows[1], 700, 700)
    assert len(estimate.state.half_lives) * (700 // 32) * layers * experts > BLAS_ONE_THREAD_WORK   # sliced
    steps = np.concatenate(windows)
    ages = np.arange(len(steps) - 1, -1, -1, dtype=np.float64)
    for c, h in enumerate(estimate.state.half_lives):
        weights = 2.0 ** (-ages / h)
        direct = np.tensordot(weights, steps, axes=(0, 0)) / weights.sum()
        np.testing.assert_allclose(estimate.state.num[c] / estimate.state.den[c][:, None], direct, rtol=1e-6,
                                   atol=1e-6 * direct.mean())


def test_a_layer_that_keeps_its_memory_decays_it_over_its_own_new_steps_when_another_starts_again():
    # a window of 100 steps every 20 (each overlaps the last by 80): layer 0 starts again (its load changed)
    # and takes the whole window; layer 1 keeps its memory and takes its 20 new steps, which must weigh
    # them as the steps after the first window, not as the last 20 of 100 (its memory aged 20 steps, not 100)
    rng = np.random.default_rng(4)
    shares = rng.dirichlet(np.full(EXPERTS, 0.5), size=2)
    first, second = (np.stack([[rng.multinomial(400, row) for row in shares] for _ in range(100)]).astype(np.float64)
                     for _ in range(2))
    estimate = _Folding(2, EXPERTS)
    estimate.update(first, 100, 100)
    estimate.update(second, 100, 20, reset=np.array([True, False]))
    kept = np.concatenate([first, second[-20:]])[:, 1]           # layer 1: every step it has seen, in order
    ages = np.arange(len(kept) - 1, -1, -1, dtype=np.float64)
    restarted_ages = np.arange(99, -1, -1, dtype=np.float64)
    for c, h in enumerate(estimate.state.half_lives):
        weights = 2.0 ** (-ages / h)
        np.testing.assert_allclose(estimate.state.num[c, 1] / estimate.state.den[c, 1],
                                   weights @ kept / weights.sum(), rtol=1e-6, atol=1e-6 * kept.mean())
        weights = 2.0 ** (-restarted_ages / h)
        np.testing.assert_allclose(estimate.state.num[c, 0] / estimate.state.den[c, 0],
                                   weights @ second[:, 0] / weights.sum(), rtol=1e-6, atol=1e-6 * second.mean())


def test_a_sudden_change_is_followed_at_the_first_call_after_it():
    """With the reset the rule asks for on a layer whose load changed, the estimate is the new window's."""
    rng = np.random.default_rng(1)
    before, after = _shares(rng), _shares(rng)
    estimate = _Folding(LAYERS, EXPERTS)
    for _ in range(10):
        estimate.update(_steps(before, 50, 400, rng), 50, 50)
    assert (estimate.state.chosen >= 50).all()
    # the rule's test finds every layer changed: their memory starts again from the new window
    lam = estimate.update(_steps(after, 50, 400, rng), 50, 50, reset=np.ones(LAYERS, dtype=bool))
    assert np.abs(lam - after * 400).sum() < 0.25 * np.abs(lam - before * 400).sum()


def test_a_fast_drift_chooses_a_memory_shorter_than_the_window():
    rng = np.random.default_rng(2)
    shares = _shares(rng)
    estimate = _Folding(LAYERS, EXPERTS)
    for _ in range(8):   # the popularity walks a long way within each window: recent steps say most
        window = []
        for _ in range(64):
            shares = shares * np.exp(rng.normal(0, 0.15, shares.shape))
            shares /= shares.sum(axis=1, keepdims=True)
            window.append([rng.multinomial(4000, row) for row in shares])
        estimate.update(np.array(window, dtype=np.float64), 64, 64)
    assert (estimate.state.chosen < 64).all()


def test_a_summed_window_is_its_own_estimate():
    rng = np.random.default_rng(3)
    estimate = _Folding(LAYERS, EXPERTS)
    for _ in range(5):
        window = _steps(_shares(rng), 20, 100, rng).sum(axis=0)
        np.testing.assert_allclose(estimate.update(window, 20, 20), window / 20)
        assert (estimate.state.chosen == np.inf).all()


def test_a_resampled_estimate_has_the_noise_of_every_step_it_weighs():
    """A long memory is less noisy than one window; its resamples spread about as far as estimates made
    from independent histories of the same load, not as little as the last window's redraws alone."""
    rng = np.random.default_rng(4)
    shares = _shares(rng)
    runs = []
    for _ in range(6):
        estimate = _Folding(LAYERS, EXPERTS)
        for _ in range(10):
            lam = estimate.update(_steps(shares, 40, 300, rng), 40, 40)
        runs.append((estimate, lam))
    between = np.std([lam for _, lam in runs], axis=0).mean()            # independent histories
    estimate, lam = runs[0]
    draws = [estimate.draw.resample(np.arange(LAYERS), np.random.default_rng(k)) for k in range(12)]
    spread = np.std(draws, axis=0).mean() / np.sqrt(2)                      # the draws carry sqrt(2)
    assert 0.4 * between < spread < 2.5 * between


def test_bad_windows_are_input_errors():
    estimate = _Folding(LAYERS, EXPERTS)
    with pytest.raises(InputError, match="load window"):
        estimate.update(np.ones((4, LAYERS, EXPERTS + 1)), 4, 4)
    with pytest.raises(InputError, match="load window"):
        estimate.update(np.ones((LAYERS, EXPERTS)), 0, 4)


# ---------------------------------------------------------------------- vLLM's layer walk
def _rows(*rows):
    return Placement(np.array(rows), 4, 2)


def test_a_walk_commits_one_layer_per_step_and_the_next_call_waits_for_it():
    old = _rows([0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3])
    new = _rows([0, 2, 1, 3], [0, 1, 2, 3], [3, 1, 2, 0])
    switch = MapSwitch(old, drain_steps=1)
    assert switch.schedule_layers(new, decided_at_step=10, layer_copy_steps=np.ones(3, dtype=int)) == 14
    assert switch.map_for_step(11) is old
    assert np.array_equal(switch.map_for_step(12).phy2log, [[0, 2, 1, 3], [0, 1, 2, 3], [0, 1, 2, 3]])
    assert switch.busy_at(12)
    assert np.array_equal(switch.map_for_step(13).phy2log[2], [0, 1, 2, 3])   # layer 1 was unchanged
    assert not switch.busy_at(13)            # the last layer takes effect with the next batch
    assert switch.map_for_step(14) is new and not switch.busy
    with pytest.raises(InputError, match="layer_copy_steps"):
        switch.schedule_layers(old, 15, np.array([1, 0, 1]))


def test_vllm_async_calls_wait_for_the_walk_as_in_vllm():
    """vLLM 0.33, measured in its own EplbState (use_async, 5 MoE layers, step_interval 3): the policy was
    called after forward passes 0, 5, 10, ...: a call that falls due during the walk comes right after it."""
    rng = np.random.default_rng(5)
    counts = _steps(_shares(np.random.default_rng(6)).repeat(2, axis=0)[:5], 40, 50_000, rng)  # copies < a step
    cost = cluster_cost(GPUS, 1, "H100", "Qwen3-30B-A3B", migration="async", copy_schedule="parallel")
    cadence = EngineCadence.of("vllm", 3, 3)
    default = make_controller("engine-default", cadence, 5, EXPERTS)
    result = replay(counts, default, cost, initial_map(5, EXPERTS, EXPERTS + GPUS, GPUS), drain_steps=1,
                    layer_per_step=True, policy_in_worker=True)
    assert np.flatnonzero(result.called_at).tolist() == list(range(0, 40, 5))
    assert result.total_policy_time_s == 0 < result.total_policy_cpu_s     # the worker thread's, not serving's


def test_sglang_pays_its_policy_time():
    rng = np.random.default_rng(7)
    counts = _steps(_shares(rng), 60, 200, rng)
    cost = cluster_cost(GPUS, 1, "H100", "Qwen3-30B-A3B")
    cadence = EngineCadence.of("sglang", 20)
    rule = RebalanceRule(cost, LAYERS, EXPERTS)
    result = replay(counts, make_controller("ours", cadence, LAYERS, EXPERTS, rule=rule), cost,
                    initial_map(LAYERS, EXPERTS, EXPERTS + GPUS, GPUS), policy_in_worker=cadence.policy_in_worker)
    assert np.flatnonzero(result.called_at).tolist() == [20, 40]     # after 21 passes, then every 20
    assert result.total_policy_time_s == result.total_policy_cpu_s > 0


# ---------------------------------------------------------------------- the sweep
def _drift(steps=400, seed=8):
    rng = np.random.default_rng(seed)
    shares, out = _shares(rng), []
    for _ in range(steps):
        shares = shares * np.exp(rng.normal(0, 0.05, shares.shape))
        shares /= shares.sum(axis=1, keepdims=True)
        out.append([rng.multinomial(2000, row) for row in shares])
    return np.array(out, dtype=np.float64)


def test_the_sweep_compares_each_policy_at_its_best_cadence():
    counts = _drift()
    start = initial_map(LAYERS, EXPERTS, EXPERTS + GPUS, GPUS)
    cost_of = lambda c: cluster_cost(GPUS, 1, "H100", "Qwen3-30B-A3B", migration=c.migration,  # noqa: E731
                                     copy_schedule=c.copy_schedule)
    result = sweep(counts, cost_of, start, "sglang", intervals=(10, 50, 200))
    assert result.intervals() == [10, 50, 200] and result.default_interval == 0   # SGLang's 1000 is too long
    for policy in ("default", "moe-place"):
        best = result.best(policy)
        assert best.total_s == min(result.run(policy, i).total_s for i in result.intervals())
    assert result.best_ratio == pytest.approx(result.best("moe-place").total_s / result.best("default").total_s)
    # the reference knows the coming load and moves for free: no worse than the default at its cadence
    assert all(result.hindsight[i] <= result.run("default", i).total_s for i in result.intervals())
    doc = json.loads(json.dumps(result.to_json()))
    assert doc["best"]["moe-place"]["step_interval"] == result.best("moe-place").step_interval
    fixed = hindsight_next_reference(counts, cost_of(EngineCadence.of("sglang", 50)), start, 50,
                                     EngineCadence.of("sglang", 50).first_call)
    assert fixed.total_time_s == pytest.approx(result.hindsight[50])


def test_cadences_run_from_ten_steps_to_the_engines_default():
    assert [c.step_interval for c in cadences("vllm")] == [10, 20, 50, 100, 200, 500, 1000, 3000]
    assert cadences("vllm")[-1].window_size == 1000     # the engine's own window at its own interval
    assert [c.step_interval for c in cadences("sglang", steps=600)] == [10, 20, 50, 100, 200, 500]
    assert all(not c.policy_in_worker and c.migration == "stall" for c in cadences("vllm", use_async=False))


def test_engine_settings_are_lines_a_shell_takes():
    vllm = engine_settings("vllm", 20, 20, 32, model="DeepSeek-V3")
    words = shlex.split(" ".join(line.rstrip("\\") for line in vllm))
    config = json.loads(words[words.index("--eplb-config") + 1])
    assert config == {"step_interval": 20, "window_size": 20, "num_redundant_experts": 32, "use_async": True}
    assert "MOE_PLACE_STEP_INTERVAL=20" in words and "MOE_PLACE_MODEL=DeepSeek-V3" in words
    sglang = " ".join(engine_settings("sglang", 50, 50, 8))
    assert "--eplb-rebalance-num-iterations 50" in sglang and "MOE_PLACE_SGLANG=1" in sglang
    assert "MOE_PLACE_ESTIMATE" not in sglang and "MOE_PLACE_MIN_GAIN" not in sglang   # the rule's defaults


def test_engine_settings_carry_the_rule_settings_the_sweep_ran():
    """What `moe-place cadence` tuned (its rule options) reaches the engine: the printed variables, read as
    the adapters read them, build the rule the sweep ran."""
    rule = dict(num_groups=8, min_gain=0.01, noise_margin=1.5, estimate="window", max_moved_slots=16,
                max_bytes=64 * 2**20)
    for engine in ("vllm", "sglang"):
        words = shlex.split(" ".join(line.rstrip("\\") for line in engine_settings(engine, 100, 100, 32, rule=rule)))
        env = dict(w.split("=", 1) for w in words if w.startswith("MOE_PLACE_"))
        built = load_engine_config(env).rule(32, 4, 2, 256, num_groups=8)
        assert {k: getattr(built, k) for k in rule} == rule


# ---------------------------------------------------------------------- `moe-place cadence`
SPEC = "drift:steps=1200,layers=2,experts=16,tokens=512,seed=3"   # SGLang calls first after 1001 passes


def test_cadence_command_prints_both_bests_and_the_settings(capsys, tmp_path):
    out = tmp_path / "cadence.json"
    assert main(["cadence", "--synthetic", SPEC, "--engine", "sglang", "--gpus", "4", "--intervals", "20,100",
                 "--no-progress", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "best " in text and "hindsight" in text and "--eplb-rebalance-num-iterations" in text
    doc = json.loads(out.read_text())
    assert {r["step_interval"] for r in doc["runs"]} == {20, 100, 1000}    # SGLang's own 1000 always
    assert "at the default's own cadence (1000)" in text
    assert doc["settings"] and doc["best"]["default"]["policy"] == "default"


def test_cadence_command_settings_name_the_rule_options_it_ran(capsys):
    options = ["--gpus", "4", "--intervals", "20", "--estimate", "window", "--min-gain", "0.01", "--no-hindsight",
               "--no-progress", "--format", "json"]
    assert main(["cadence", "--synthetic", SPEC, "--engine", "vllm", *options]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["advice"] == "moe-place"                  # the rule wins here: its line carries its options
    settings = " ".join(doc["settings"])
    assert "MOE_PLACE_ESTIMATE=window" in settings and "MOE_PLACE_MIN_GAIN=0.01" in settings
    assert main(["cadence", "--synthetic", SPEC, "--engine", "sglang", *options]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["advice"] == "default"                    # it loses here: the engine's own line, none of ours
    assert "MOE_PLACE" not in " ".join(doc["settings"]) and "--eplb-rebalance-num-iterations 20" in doc["settings"][0]


def test_cadence_command_refuses_what_it_cannot_run(capsys):
    assert main(["cadence", "--synthetic", SPEC, "--engine", "sglang", "--sync"]) == 2
    assert "--sync" in capsys.readouterr().err
    assert main(["cadence", "--synthetic", "drift:steps=5,layers=2,experts=16", "--gpus", "4", "--engine",
                 "sglang"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--synthetic drift:steps=6000" in err
