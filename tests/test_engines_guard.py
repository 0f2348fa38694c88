"""Never take a server down (`moe_place.engines.guard`): every moe-place function an engine calls answers with the
engine's own result when moe-place fails, says why once, and leaves the rule's session able to answer the next
call; a bad setting still stops the engine at start, with one line. On the stand-ins (`bench/inengine/standins.py`).
"""

import logging
import sys
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from moe_place.engines import batch_split, guard, sglang, sglang_managers, sglang_split, sglang_startup  # noqa: E402
from moe_place.engines import vllm as vllm_adapter  # noqa: E402
from moe_place.engines.batch_split import FLAGS  # noqa: E402
from moe_place.errors import InputError  # noqa: E402
from moe_place.online.policy import RebalanceRule  # noqa: E402
from bench_modules import load  # noqa: E402 - tests/, beside this file

standins = load("inengine.standins")
LAYERS, EXPERTS, GPUS, REDUNDANT = 2, 16, 4, 8
PHYSICAL = EXPERTS + REDUNDANT


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "moe_place.engines" and r.levelname == "WARNING"]


def _counts(seed: int = 0) -> torch.Tensor:
    """int64 `[passes, layers, E]`: a skewed window."""
    rng = np.random.default_rng(seed)
    weights = np.linspace(4, 1, EXPERTS)
    return torch.from_numpy(rng.poisson(30 * weights, size=(20, LAYERS, EXPERTS)).astype(np.int64))


def _broken_rule(monkeypatch):
    def decide(self, *args, **kwargs):
        raise RuntimeError("the rule broke")

    monkeypatch.setattr(RebalanceRule, "decide", decide)


# ---------------------------------------------------------------------- the entry points
def _installed(monkeypatch):
    """Everything the adapters put into the engines' code, installed into the stand-ins: (name, callable) pairs,
    with the contexts to close."""
    monkeypatch.setenv(batch_split.SPLIT_ENV, "per-batch")
    monkeypatch.setenv("MOE_PLACE_VLLM_POLICY", "default")
    stack = []
    forward = standins.standin_vllm_forward()
    tree = forward.__enter__()
    stack.append(forward)
    handle = vllm_adapter.install()
    state = standins.EplbModelState(torch.arange(PHYSICAL).repeat(LAYERS, 1) % EXPERTS, EXPERTS, 2, REDUNDANT)
    standins.StandinVllmEplb(tree["vllm.distributed.eplb.policy"].EPLB_POLICIES, LAYERS, EXPERTS, REDUNDANT, GPUS,
                             1, 1, forward=state)
    pieces = [(f"{owner.__name__}.{name}", getattr(owner, name)) for owner, name, _ in
              handle.option_patches + handle.split.patches]
    policy = tree["vllm.distributed.eplb.policy"].EPLB_POLICIES["default"]
    pieces += [("EPLB_POLICIES['default'].rebalance_experts", policy.rebalance_experts)]
    sglang_modules = standins.standin_sglang_modules()
    algorithms, _ = sglang_modules.__enter__()
    stack.append(sglang_modules)
    hook = sglang.install_rebalance_hook()
    pieces += [("eplb_algorithms.rebalance_experts", algorithms.rebalance_experts),
               ("EPLBManager.__init__", sys.modules[sglang_managers.MANAGER_MODULE].EPLBManager.__init__)]
    lp = standins.standin_sglang_lp()
    lp_tree = lp.__enter__()
    stack.append(lp)
    split = sglang_split.SglangSplit()
    sglang_split.install_setup(split, lp_tree[sglang_managers.SETUP_MODULE])
    sglang_split.install_dispatch(split, lp_tree[sglang_managers.DISPATCH_MODULE])
    pieces += [(f"{owner.__name__}.{name}", getattr(owner, name)) for owner, name, _ in split.patches]

    def close():
        sglang_split.uninstall_split(split)
        sglang.uninstall_rebalance_hook(hook)
        vllm_adapter.uninstall(handle)
        for context in reversed(stack):
            context.__exit__(None, None, None)

    return pieces, close


def test_every_function_the_adapters_put_into_an_engine_is_guarded(monkeypatch):
    pieces, close = _installed(monkeypatch)
    try:
        entries = {}
        for name, piece in pieces:
            if isinstance(piece, type):   # the split's solver class: its methods guard themselves
                assert issubclass(piece, sglang_split.SplitLPSolver), name
                entries[name] = "sglang.lplb_solve"
            elif isinstance(piece, sglang.PaybackRebalance):
                entries[name] = "sglang.rebalance"
            elif getattr(piece, "__self__", None) is not None and hasattr(piece.__self__, "_guard"):
                entries[name] = "vllm.policy"   # the policy class's methods call its guard
            else:
                entries[name] = getattr(piece, "moe_place_entry", None)
        assert all(entry in guard.ENTRY_POINTS for entry in entries.values()), entries
        # the pieces reach every entry point the guard names, so each has a fallback test below
        assert set(entries.values()) == set(guard.ENTRY_POINTS), (set(guard.ENTRY_POINTS) - set(entries.values()))
    finally:
        close()
    # a function with no entry is refused by the guard itself
    with pytest.raises(KeyError):
        guard.Guard("x").call("no.such.entry", lambda: 1, lambda: 2)


def test_a_reason_is_said_once_and_at_most_max_reasons_per_entry(caplog):
    caplog.set_level(logging.WARNING, logger="moe_place.engines")
    keeper = guard.Guard("vLLM")
    for call in range(3 * guard.MAX_REASONS):
        def broken(call=call):
            raise ValueError(f"reason {call % (2 * guard.MAX_REASONS)}")

        assert keeper.call("vllm.router", broken, lambda: "engine's") == "engine's"
    warned = _warnings(caplog)
    assert len(warned) == guard.MAX_REASONS + 1 and "more reasons than" in warned[-1]
    assert keeper.fallbacks["vllm.router"] == 3 * guard.MAX_REASONS
    with pytest.raises(ValueError):   # no engine to fall back to: the exception is the caller's
        keeper.call("vllm.router", lambda: int("x"), None)


# ---------------------------------------------------------------------- vLLM
def test_vllm_a_raise_in_the_rule_answers_with_vllms_default_policy_and_the_next_call_works(monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="moe_place.engines")
    with standins.standin_vllm_modules() as policies:
        handle = vllm_adapter.install()
        try:
            ours = policies["default"]
            weight = _counts().sum(dim=0)
            old = torch.arange(PHYSICAL).repeat(LAYERS, 1) % EXPERTS
            good = ours.rebalance_experts(weight, PHYSICAL, 1, 1, GPUS, old)   # a first call: a session exists
            sessions = dict(ours._sessions)
            with monkeypatch.context() as patch:
                _broken_rule(patch)
                answers = [ours.rebalance_experts(weight, PHYSICAL, 1, 1, GPUS, old) for _ in range(3)]
            default = standins.DefaultEplbPolicy.rebalance_experts(weight, PHYSICAL, 1, 1, GPUS, old)
            assert all(torch.equal(answer, default) for answer in answers)
            warned = _warnings(caplog)
            assert len(warned) == 1 and "the rule broke" in warned[0] and "DefaultEplbPolicy" in warned[0]
            assert ours._sessions == sessions   # the failed calls left the rule's sessions as they were
            after = ours.rebalance_experts(weight, PHYSICAL, 1, 1, GPUS, good)
            assert after.shape == good.shape and list(ours._sessions.values())[0].calls == 2
        finally:
            vllm_adapter.uninstall(handle)


@pytest.mark.parametrize("weights", ["none", "empty layer", "raises"])
def test_vllm_a_model_without_expert_weights_starts_and_the_rule_answers(weights, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="moe_place.engines")
    with standins.standin_vllm_modules() as policies:
        handle = vllm_adapter.install()
        try:
            model = types.SimpleNamespace(num_moe_layers=LAYERS, num_logical_experts=EXPERTS,
                                          num_routed_experts=EXPERTS, num_redundant_experts=REDUNDANT,
                                          num_physical_experts=PHYSICAL, moe_layers=[])
            if weights == "none":
                model.expert_weights = []
            elif weights == "empty layer":
                model.expert_weights = [[] for _ in range(LAYERS)]
            else:
                model.expert_weights = map(lambda layer: 1 / 0, range(LAYERS))   # reading them raises
            engine = standins.StandinVllmEplb(policies, LAYERS, EXPERTS, REDUNDANT, GPUS, 1, 1, step_interval=40,
                                              window_size=20)
            sys.modules["vllm.distributed.eplb.eplb_state"].EplbState.add_model(engine, model, types.SimpleNamespace(
                model="m", hf_text_config=None))
            warned = _warnings(caplog)
            assert len(warned) == 1 and "vllm.add_model" in warned[0], warned
            weight = _counts().sum(dim=0)
            old = torch.arange(PHYSICAL).repeat(LAYERS, 1) % EXPERTS
            answer = policies["default"].rebalance_experts(weight, PHYSICAL, 1, 1, GPUS, old)
            assert answer.shape == (LAYERS, PHYSICAL) and len(_warnings(caplog)) == 1   # the rule answered
        finally:
            vllm_adapter.uninstall(handle)


def test_vllm_a_raise_at_the_commit_keeps_vllms_commit_and_the_flags(monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="moe_place.engines")
    monkeypatch.setenv(batch_split.SPLIT_ENV, "per-batch")
    monkeypatch.setenv("MOE_PLACE_VLLM_POLICY", "default")
    phy2log = torch.arange(PHYSICAL).repeat(LAYERS, 1) % EXPERTS
    with standins.standin_vllm_forward() as tree:
        handle = vllm_adapter.install()
        try:
            state = standins.EplbModelState(phy2log, EXPERTS, 2, REDUNDANT)
            standins.StandinVllmEplb(tree["vllm.distributed.eplb.policy"].EPLB_POLICIES, LAYERS, EXPERTS, REDUNDANT,
                                     GPUS, 1, 1, forward=state)
            FLAGS.offer((LAYERS, EXPERTS), [True, True])
            monkeypatch.setattr(FLAGS, "adopt", lambda *a: 1 / 0)
            new = phy2log.flip(1).contiguous()
            tree["vllm.distributed.eplb.eplb_state"]._commit_eplb_maps(state, new_physical_to_logical_map=new)
            assert torch.equal(state.physical_to_logical_map, new)   # vLLM's own commit ran
            assert not FLAGS.is_on((LAYERS, EXPERTS), 0)
            assert len(_warnings(caplog)) == 1 and "vllm.commit" in _warnings(caplog)[0]
        finally:
            vllm_adapter.uninstall(handle)
            FLAGS.clear((LAYERS, EXPERTS))


@pytest.mark.parametrize("var, value", [("MOE_PLACE_MIN_GAIN", "lots"), ("MOE_PLACE_ESTIMATE", "guess"),
                                        (batch_split.SPLIT_ENV, "always")])
def test_vllm_a_bad_setting_stops_the_plugin_at_start_with_one_line(var, value, monkeypatch):
    monkeypatch.setenv("MOE_PLACE_VLLM_POLICY", "default")
    monkeypatch.setenv(var, value)
    with standins.standin_vllm_modules():
        with pytest.raises(InputError) as error:
            vllm_adapter.register_plugin()
    assert var.removeprefix("MOE_PLACE_").lower() in str(error.value).lower() and "\n" not in str(error.value)


# ---------------------------------------------------------------------- SGLang
def _sglang_engine(modules, **kwargs):
    return standins.StandinSglangEplb(modules, LAYERS, EXPERTS, REDUNDANT, GPUS, 1, None, num_iterations=20,
                                      **kwargs)


def test_sglang_a_raise_in_the_rule_answers_with_sglangs_own_and_the_next_call_works(monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="moe_place.engines")
    with standins.standin_sglang_modules(num_iterations=20) as modules:
        own = modules[0].rebalance_experts
        handle = sglang.install_rebalance_hook()
        try:
            engine = _sglang_engine(modules)
            counts = _counts()
            for _ in range(21):
                engine.on_forward_pass(torch.full((LAYERS, PHYSICAL), 3))
            assert engine.calls == 1 and len(handle.hook.sessions) == 1
            sessions = dict(handle.hook.sessions)
            with monkeypatch.context() as patch:
                _broken_rule(patch)
                for _ in range(2):
                    answer = modules[0].rebalance_experts(counts, PHYSICAL, PHYSICAL // GPUS, None, 1,
                                                          standins.EplbAlgorithm.deepseek)
                    expected = own(counts, PHYSICAL, PHYSICAL // GPUS, None, 1, standins.EplbAlgorithm.deepseek)
                    assert all(torch.equal(a, b) for a, b in zip(answer, expected))
            warned = _warnings(caplog)
            assert len(warned) == 1 and "the rule broke" in warned[0] and "SGLang's own" in warned[0]
            assert handle.hook.sessions == sessions
            modules[0].rebalance_experts(counts, PHYSICAL, PHYSICAL // GPUS, None, 1, standins.EplbAlgorithm.deepseek)
            assert list(handle.hook.sessions.values())[0].calls == 2   # the next call: the rule again
        finally:
            sglang.uninstall_rebalance_hook(handle)


@pytest.mark.parametrize("weights", ["no layers", "empty layers"])
def test_sglang_a_model_without_expert_weights_does_not_stop_the_rebalance(weights, caplog):
    # SGLang 0.5.23's EPLBManager path with a model that registers no expert weight tensors: before, the hook
    # raised InputError (dtype_bytes 0.0) inside SGLang's rebalance and the scheduler died
    caplog.set_level(logging.INFO, logger="moe_place.engines")
    with standins.standin_sglang_modules(num_iterations=20) as modules:
        handle = sglang.install_rebalance_hook()
        try:
            engine = _sglang_engine(modules)
            model = engine.manager.get_model()
            model.routed_experts_weights_of_layer = {} if weights == "no layers" else {0: [], 1: []}
            for _ in range(41):
                engine.on_forward_pass(torch.full((LAYERS, PHYSICAL), 3))
            assert engine.calls == 2 and handle.hook.handed_back == 0 and not _warnings(caplog)
            lines = [r.getMessage() for r in caplog.records if "rule active" in r.getMessage()]
            assert len(lines) == 1 and "model unknown" in lines[0]   # priced with the configured/default model
        finally:
            sglang.uninstall_rebalance_hook(handle)


@pytest.mark.parametrize("active", [[0, 0, 0, 1], [1, 0, 0, 0]])
def test_sglang_elastic_with_one_rank_left_is_sglangs_own_answer(active, caplog):
    # one rank of four left, with room for every expert (16 slots a rank): SGLang's own elastic algorithm answers
    caplog.set_level(logging.WARNING, logger="moe_place.engines")
    physical = GPUS * EXPERTS
    with standins.standin_sglang_modules(num_iterations=20) as modules:
        own = modules[0].rebalance_experts
        handle = sglang.install_rebalance_hook()
        try:
            standins.StandinSglangEplb(modules, LAYERS, EXPERTS, physical - EXPERTS, GPUS, 1, None, num_iterations=20,
                                       active_ranks=torch.tensor(active, dtype=torch.int32))
            counts = _counts()
            answer = modules[0].rebalance_experts(counts, physical, EXPERTS, None, 1,
                                                  standins.EplbAlgorithm.elasticity_aware)
            expected = own(counts, physical, EXPERTS, None, 1, standins.EplbAlgorithm.elasticity_aware)
            assert all(torch.equal(a, b) for a, b in zip(answer, expected)) and handle.hook.handed_back == 1
            slots = answer[1][answer[1] >= 0]
            assert ((slots // EXPERTS) == active.index(1)).all()   # every token goes to the one rank left
            assert not _warnings(caplog)
        finally:
            sglang.uninstall_rebalance_hook(handle)


def test_sglang_the_managers_recording_never_stops_sglangs_manager(monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="moe_place.engines")

    class Full(list):
        def append(self, item):
            raise MemoryError("no room")

    with standins.standin_sglang_modules() as modules:
        handle = sglang.install_rebalance_hook()
        try:
            monkeypatch.setattr(sglang_managers, "MANAGERS", Full())
            manager = sys.modules[sglang_managers.MANAGER_MODULE].EPLBManager(model_config="c", get_model=lambda: None)
            assert manager.model_config == "c"
            assert len(_warnings(caplog)) == 1 and "sglang.manager" in _warnings(caplog)[0]
        finally:
            sglang.uninstall_rebalance_hook(handle)


@pytest.mark.parametrize("var, value", [("MOE_PLACE_NOISE_MARGIN", "-1"), ("MOE_PLACE_HARDWARE", "abacus"),
                                        ("MOE_PLACE_STEP_INTERVAL", "300"), (batch_split.SPLIT_ENV, "often")])
def test_sglang_a_bad_setting_stops_the_scheduler_at_start_with_one_line(var, value, monkeypatch):
    # install_rebalance_hook runs as the scheduler builds its EPLB manager (sglang_startup): before serving
    monkeypatch.setenv(var, value)
    with standins.standin_sglang_modules(num_iterations=200):
        with pytest.raises(InputError) as error:
            sglang.install_rebalance_hook()
    assert "\n" not in str(error.value)


def test_sglang_the_split_needs_the_lp_dispatch_and_fails_at_start_otherwise(monkeypatch):
    monkeypatch.setenv(batch_split.SPLIT_ENV, "per-batch")
    with standins.standin_sglang_modules(num_iterations=200):
        runtime = sys.modules["sglang.srt.runtime_context"]
        runtime.get_exec().moe.ep_dispatch_algorithm = "static"
        with pytest.raises(InputError, match="--ep-dispatch-algorithm lp"):
            sglang.install_rebalance_hook()
        runtime.get_exec().moe.ep_dispatch_algorithm = "lp"
        sglang.uninstall_rebalance_hook(sglang.install_rebalance_hook())


def test_sglang_the_startup_hook_installs_the_split_only_with_the_variable(monkeypatch):
    with standins.standin_sglang_lp() as tree:
        setup = tree[sglang_managers.SETUP_MODULE]
        own = setup.init_lplb_solvers
        monkeypatch.delenv(batch_split.SPLIT_ENV, raising=False)
        sglang_startup.WATCHED[sglang_managers.SETUP_MODULE](setup)
        assert setup.init_lplb_solvers is own
        monkeypatch.setenv(batch_split.SPLIT_ENV, "per-batch")
        sglang_startup.WATCHED[sglang_managers.SETUP_MODULE](setup)
        sglang_startup.WATCHED[sglang_managers.DISPATCH_MODULE](tree[sglang_managers.DISPATCH_MODULE])
        assert setup.init_lplb_solvers.moe_place_entry == "sglang.lplb_init"
        assert issubclass(setup.LPLBSolver, sglang_split.SplitLPSolver)
        monkeypatch.setenv(batch_split.SPLIT_ENV, "bad")
        with pytest.raises(InputError, match="MOE_PLACE_SPLIT"):
            sglang_startup.WATCHED[sglang_managers.SETUP_MODULE](setup)


def test_sglang_a_raise_while_adopting_the_flags_leaves_every_layer_off(monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="moe_place.engines")
    phy2log = torch.arange(PHYSICAL).repeat(LAYERS, 1) % EXPERTS
    with standins.standin_sglang_lp() as tree:
        split = sglang_split.install_setup(sglang_split.SglangSplit(), tree[sglang_managers.SETUP_MODULE])
        tree["sglang.srt.eplb.lplb_solver"].get_resources().expert_location_metadata = \
            standins.ExpertLocationMetadata.of(phy2log, EXPERTS, GPUS)
        FLAGS.offer((LAYERS, EXPERTS), [True, True])
        monkeypatch.setattr(FLAGS, "adopt", lambda *a: 1 / 0)
        config = types.SimpleNamespace(hf_config=types.SimpleNamespace(architectures=["DeepseekV3ForCausalLM"]))
        tree[sglang_managers.SETUP_MODULE].init_lplb_solvers(model_config=config)
        solvers = tree["sglang.srt.eplb.lplb_solver"].get_resources().lplb_solvers
        assert len(solvers) == LAYERS and not any(s.on for s in solvers.values())
        assert len(_warnings(caplog)) == 1 and "sglang.lplb_init" in _warnings(caplog)[0]
        sglang_split.uninstall_split(split)
        FLAGS.clear((LAYERS, EXPERTS))
