"""One decide: on a recorded trace, each engine's adapter makes the decisions the replay's controller makes.

The trace is the bundled Qwen3-30B-A3B recording (real routing), its tokens in recording order, played `REPEATS`
times (a server seeing the same prompts again; long enough for the rule to pay for moves), cut into steps of
`STEP_TOKENS`. The replay (`replay --controller ours`, `RuleController`) runs it at each engine's cadence (vLLM's
sync mode, which commits a map at once, so no window spans two maps); the engine side calls what the engine
calls, vLLM 0.33's policy (`vllm_policy.make_policy`: the summed window and the map in use) and SGLang 0.5.23's
`rebalance_experts` hook (`sglang.PaybackRebalance`: the recorder's per-pass counts), each with the map the
previous call returned. Every call's map must be the replay's, and the rule moves slots on this trace.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from moe_place.cost.cluster import cluster_cost  # noqa: E402
from moe_place.engines import sglang as sglang_adapter  # noqa: E402
from moe_place.engines import vllm_policy  # noqa: E402
from moe_place.engines.config import EngineConfig  # noqa: E402
from moe_place.online.controller import EngineCadence, initial_map, make_controller  # noqa: E402
from moe_place.online.policy import RebalanceRule  # noqa: E402
from moe_place.online.replay import replay  # noqa: E402
from moe_place.traces.bundled import bundled_path  # noqa: E402
from moe_place.traces.load import load_trace  # noqa: E402
from test_engines_vllm import no_vllm  # noqa: E402,F401  (the fixture: no vLLM, no MOE_PLACE_* settings)

MODEL, GPUS, REDUNDANT = "Qwen3-30B-A3B", 8, 8
LAYERS = [0, 16, 32, 47]
REPEATS = 4
STEP_TOKENS = 32
INTERVAL, WINDOW = 128, 64


def recorded_steps() -> np.ndarray:
    """int64 `[steps, layers, E]`: the recording's tokens, in order, REPEATS times, counted per step of STEP_TOKENS
    tokens."""
    trace = load_trace(bundled_path("qwen3-30b-a3b_prefill_topk.npz"))
    ids = np.tile(np.concatenate(trace.topk_ids)[:, LAYERS, :], (REPEATS, 1, 1))
    steps = len(ids) // STEP_TOKENS
    ids = ids[:steps * STEP_TOKENS].reshape(steps, STEP_TOKENS, len(LAYERS), -1)
    experts = trace.num_experts
    flat = ids.transpose(0, 2, 1, 3).reshape(steps, len(LAYERS), -1)
    return np.stack([[np.bincount(row, minlength=experts) for row in step] for step in flat]).astype(np.int64)


def replay_maps(engine: str, steps: np.ndarray) -> dict[int, np.ndarray]:
    """The map the replay's controller leaves after each step it calls the rule (its decision, or the map kept)."""
    layers, experts = steps.shape[1:]
    # vLLM's sync mode (whole maps at once); SGLang's recorder holds the interval's passes
    cadence = EngineCadence.of(engine, INTERVAL, WINDOW if engine == "vllm" else None, use_async=False)
    cost = cluster_cost(GPUS, 1, "H100", MODEL, migration=cadence.migration, copy_schedule=cadence.copy_schedule)
    rule = RebalanceRule(cost, layers, experts, num_groups=1 if engine == "vllm" else None)  # what each engine passes
    ours = make_controller("ours", cadence, layers, experts, rule=rule)
    decide, emitted = ours.decide, {}

    def record(step, current):
        decision = decide(step, current)
        if ours.called:
            emitted[step] = current.phy2log if decision is None else decision.placement.phy2log
        return decision

    ours.decide = record
    start = initial_map(layers, experts, experts + REDUNDANT, GPUS)
    replay(steps.astype(float), ours, cost, start, layer_per_step=cadence.layer_per_step, drain_steps=0)
    return emitted


def test_vllms_policy_makes_the_replays_decisions_on_the_recorded_trace(no_vllm):
    steps = recorded_steps()
    layers, experts = steps.shape[1:]
    physical = experts + REDUNDANT
    emitted = replay_maps("vllm", steps)
    config = EngineConfig(model=MODEL, migration="stall", step_interval=INTERVAL, window_steps=WINDOW)
    policy = vllm_policy.make_policy(returns="phy2log", config=config)
    current = torch.from_numpy(initial_map(layers, experts, physical, GPUS).phy2log.copy())
    moved = 0
    for step in sorted(emitted):
        window = steps[max(0, step + 1 - WINDOW):step + 1].sum(axis=0)
        new = policy.rebalance_experts(torch.from_numpy(window), physical, 1, 1, GPUS, current)
        np.testing.assert_array_equal(new.numpy(), emitted[step], err_msg=f"the call after step {step}")
        moved += int((new != current).sum())
        current = new
    assert len(emitted) >= 5 and moved > 0   # calls that decide something: the rule moved slots on this trace


def test_sglangs_hook_makes_the_replays_decisions_on_the_recorded_trace(no_vllm):
    steps = recorded_steps()
    layers, experts = steps.shape[1:]
    physical = experts + REDUNDANT
    emitted = replay_maps("sglang", steps)
    in_use = {"map": initial_map(layers, experts, physical, GPUS).phy2log.copy()}
    hook = sglang_adapter.PaybackRebalance(EngineConfig(model=MODEL, step_interval=INTERVAL, migration="stall"),
                                           current_map=lambda: torch.from_numpy(in_use["map"].copy()))
    moved = 0
    for step in sorted(emitted):
        buffer = steps[max(0, step + 1 - INTERVAL):step + 1]     # the recorder's last passes, per pass
        phy2log, _, _ = hook(torch.from_numpy(buffer), physical, physical // GPUS, None, 1, None)
        np.testing.assert_array_equal(phy2log.numpy(), emitted[step], err_msg=f"the call after step {step}")
        moved += int((phy2log.numpy() != in_use["map"]).sum())
        in_use["map"] = phy2log.numpy()
    assert len(emitted) >= 4 and moved > 0
