"""vLLM adapter: the policy's interface (both released signatures) and the reversible registration.

vLLM is not a test dependency: the registration is tested against a stand-in module tree with
the same names vLLM uses (`vllm.distributed.eplb.policy.EPLB_POLICIES`, `AbstractEplbPolicy`,
`vllm.config.parallel.EPLBPolicyOption`, `EPLBConfig.policy`); when the real vLLM is importable
the last test runs against it too.
"""

import abc
import sys
import types
import typing
from dataclasses import dataclass

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from moe_place.engines import vllm as adapter  # noqa: E402
from moe_place.engines import config as adapter_config  # noqa: E402
from moe_place.engines import vllm_policy  # noqa: E402
from moe_place.placement import Placement, keep_unchanged_slots  # noqa: E402
from moe_place.planfile import PlanFile, write_plan  # noqa: E402
from moe_place.solvers.deepseek import eplb_rebalance  # noqa: E402


def _fake_vllm(monkeypatch, returns_tuple: bool):
    """Install stand-in modules named like vLLM's; returns (policy module, parallel config module)."""
    annotation = "tuple[torch.Tensor, torch.Tensor, torch.Tensor]" if returns_tuple else "torch.Tensor"

    class AbstractEplbPolicy(abc.ABC):
        @classmethod
        @abc.abstractmethod
        def rebalance_experts(cls, weight, num_replicas, num_groups, num_nodes, num_ranks,
                              old_global_expert_indices=None):
            raise NotImplementedError

    AbstractEplbPolicy.rebalance_experts.__func__.__annotations__["return"] = annotation

    class DefaultEplbPolicy(AbstractEplbPolicy):
        @classmethod
        def rebalance_experts(cls, *args, **kwargs):
            raise AssertionError("the built-in policy should not run")

    policy = types.ModuleType("vllm.distributed.eplb.policy")
    policy.AbstractEplbPolicy = AbstractEplbPolicy
    policy.EPLB_POLICIES = {"default": DefaultEplbPolicy}
    parallel = types.ModuleType("vllm.config.parallel")
    parallel.EPLBPolicyOption = typing.Literal["default"]

    @dataclass
    class EPLBConfig:
        window_size: int = 1000
        policy: parallel.EPLBPolicyOption = "default"

    parallel.EPLBConfig = EPLBConfig
    for name in ("vllm", "vllm.distributed", "vllm.distributed.eplb", "vllm.config"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.distributed.eplb.policy", policy)
    monkeypatch.setitem(sys.modules, "vllm.config.parallel", parallel)
    return policy, parallel


def _rule_answer(weight: torch.Tensor, old: torch.Tensor, gpus: int) -> np.ndarray:
    """What moe-place's rule answers a first vLLM 0.33 call with, worked out without the adapter: the rule of the
    default settings (`EngineConfig()`, vLLM's default cadence), on the summed window of a quarter interval."""
    layers, experts = weight.shape
    rule = vllm_policy.EngineConfig().rule(gpus, 1, layers, experts)
    current = Placement(old.numpy(), experts, gpus, allow_colocated=True)
    answer = rule.decide(rule.create_state(), weight.numpy().astype(np.float64), current, 3000, 750)
    return (current if answer.decision is None else answer.decision.placement).phy2log


def test_install_default_replaces_the_built_in_policy_in_place_and_uninstall_restores_it(monkeypatch):
    for var in ("MOE_PLACE_CONFIG",) + tuple(adapter_config.ENV_VARIABLES.values()):
        monkeypatch.delenv(var, raising=False)
    policy_mod, parallel = _fake_vllm(monkeypatch, returns_tuple=False)
    registry = policy_mod.EPLB_POLICIES
    original = registry["default"]
    handle = adapter.install()
    assert policy_mod.EPLB_POLICIES is registry  # same dict: modules that imported it see the change
    assert issubclass(registry["default"], vllm_policy.MoePlaceEplbPolicy)
    assert issubclass(registry["default"], policy_mod.AbstractEplbPolicy)
    assert typing.get_args(parallel.EPLBPolicyOption) == ("default",)  # nothing else touched
    # what vLLM calls under "default" is moe-place's rule now (the built-in raises when called)
    weight, old = _weight(seed=3) * 1000, torch.from_numpy(np.tile(np.arange(24) % 16, (3, 1)))   # 750 steps of it
    answer = registry["default"].rebalance_experts(weight, 24, 1, 1, 4, old)
    expected = _rule_answer(weight, old, 4)
    assert (expected != old.numpy()).any()   # the rule moves something on this window
    np.testing.assert_array_equal(answer.numpy(), expected)
    adapter.uninstall(handle)
    assert registry == {"default": original}
    with pytest.raises(AssertionError, match="built-in policy"):   # vLLM's own policy answers again
        registry["default"].rebalance_experts(weight, 24, 1, 1, 4, old)
    adapter.uninstall(handle)  # a second uninstall is a no-op
    assert registry == {"default": original}


def test_install_under_a_new_name_widens_the_policy_option_and_is_reversible(monkeypatch):
    for var in ("MOE_PLACE_CONFIG",) + tuple(adapter_config.ENV_VARIABLES.values()):
        monkeypatch.delenv(var, raising=False)
    policy_mod, parallel = _fake_vllm(monkeypatch, returns_tuple=False)
    before_option = parallel.EPLBPolicyOption
    before_field = parallel.EPLBConfig.__dataclass_fields__["policy"].type
    weight, old = _weight(seed=3) * 1000, torch.from_numpy(np.tile(np.arange(24) % 16, (3, 1)))   # 750 steps of it
    with adapter.registered(name="moe_place") as handle:
        assert set(policy_mod.EPLB_POLICIES) == {"default", "moe_place"}
        # the new name answers with the rule; "default" is still vLLM's own (which raises when called here)
        np.testing.assert_array_equal(policy_mod.EPLB_POLICIES["moe_place"].rebalance_experts(weight, 24, 1, 1, 4,
                                                                                              old).numpy(),
                                      _rule_answer(weight, old, 4))
        with pytest.raises(AssertionError, match="built-in policy"):
            policy_mod.EPLB_POLICIES["default"].rebalance_experts(weight, 24, 1, 1, 4, old)
        # what vLLM's policy package asserts at import: registry keys == the literal's values
        assert set(policy_mod.EPLB_POLICIES) == set(typing.get_args(parallel.EPLBPolicyOption))
        assert "moe_place" in typing.get_args(parallel.EPLBConfig.__dataclass_fields__["policy"].type)
        assert parallel.EPLBConfig.__annotations__["policy"] is before_option  # only what validation reads
        assert handle.active
    assert set(policy_mod.EPLB_POLICIES) == {"default"}
    assert parallel.EPLBPolicyOption is before_option
    assert parallel.EPLBConfig.__annotations__["policy"] is before_option
    assert parallel.EPLBConfig.__dataclass_fields__["policy"].type is before_field


def test_install_without_vllm_is_an_input_error(monkeypatch):
    monkeypatch.setattr(vllm_policy, "POLICY_MODULES", ("moe_place_no_such_module",))
    with pytest.raises(vllm_policy.InputError, match="vllm"):
        adapter.install()
    registry = {"default": object}
    with adapter.registered(name="x", policies=registry):  # an explicit registry needs no vLLM
        assert issubclass(registry["x"], vllm_policy.MoePlaceEplbPolicy)
    assert set(registry) == {"default"}


def test_plugin_entry_point_installs_only_when_asked_and_only_once(monkeypatch):
    policy_mod, _ = _fake_vllm(monkeypatch, returns_tuple=False)
    original = policy_mod.EPLB_POLICIES["default"]
    monkeypatch.delenv(adapter.PLUGIN_ENV, raising=False)
    adapter.register_plugin()
    assert policy_mod.EPLB_POLICIES["default"] is original
    monkeypatch.setenv(adapter.PLUGIN_ENV, "default")
    adapter.register_plugin()
    installed = policy_mod.EPLB_POLICIES["default"]
    assert issubclass(installed, vllm_policy.MoePlaceEplbPolicy)
    adapter.register_plugin()  # vLLM may load plugins several times per process
    assert policy_mod.EPLB_POLICIES["default"] is installed


@pytest.mark.parametrize("returns_tuple", [True, False])
def test_return_style_is_read_off_the_installed_abstract_policy(monkeypatch, returns_tuple):
    _fake_vllm(monkeypatch, returns_tuple)
    monkeypatch.delenv(vllm_policy.RETURNS_ENV, raising=False)
    assert vllm_policy.return_style("auto") == ("tuple" if returns_tuple else "phy2log")
    monkeypatch.setenv(vllm_policy.RETURNS_ENV, "tuple")
    assert vllm_policy.return_style("auto") == "tuple"


def test_style_of_reads_evaluated_and_string_annotations():
    def old(cls, weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def new(cls, weight) -> torch.Tensor: ...

    def typed(cls, weight) -> typing.Tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...  # noqa: UP006

    assert [vllm_policy.style_of(f) for f in (old, new, typed)] == ["tuple", "phy2log", "tuple"]


def test_return_style_without_vllm_defaults_to_the_tuple(monkeypatch):
    monkeypatch.setattr(vllm_policy, "POLICY_MODULES", ("moe_place_no_such_module",))
    monkeypatch.delenv(vllm_policy.RETURNS_ENV, raising=False)
    assert vllm_policy.return_style("auto") == "tuple"
    with pytest.raises(vllm_policy.InputError):
        vllm_policy.make_policy(returns="both")


def test_current_placement_rejects_unusable_old_maps():
    old = torch.tensor([[0, 1, 2, 3, 0, 1]])
    assert vllm_policy.current_placement(old, 4, 2, (1, 6)).phy2log.tolist() == [[0, 1, 2, 3, 0, 1]]
    assert vllm_policy.current_placement(None, 4, 2, (1, 6)) is None
    assert vllm_policy.current_placement(torch.tensor([[0, 1, 2, 3, -1, -1]]), 4, 2, (1, 6)) is None  # ranks changing
    assert vllm_policy.current_placement(old, 4, 2, (1, 8)) is None  # slot count changed
    assert vllm_policy.current_placement(torch.tensor([[0, 0, 2, 3, 0, 3]]), 4, 2, (1, 6)) is None  # expert 1 missing


# ---------------------------------------------------------------------- the policy itself (solver-backed)
def _weight(layers=3, experts=16, seed=0):
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.zipf(1.5, size=(layers, experts)).clip(max=10_000).astype(np.int64))


def _check_maps(phy2log, log2phy, logcnt, layers, experts, replicas):
    assert phy2log.shape == (layers, replicas) and phy2log.dtype == torch.int64 and phy2log.device.type == "cpu"
    assert log2phy.shape == (layers, experts, replicas - experts + 1) and log2phy.dtype == torch.int64
    assert logcnt.shape == (layers, experts) and logcnt.dtype == torch.int64
    p, l2p, cnt = phy2log.numpy(), log2phy.numpy(), logcnt.numpy()
    for layer in range(layers):
        np.testing.assert_array_equal(np.bincount(p[layer], minlength=experts), cnt[layer])
        for e in range(experts):
            slots = l2p[layer, e]
            valid = slots[slots >= 0]
            assert len(valid) == cnt[layer, e] and (slots[len(valid):] == -1).all()  # -1 padding at the end
            assert (p[layer, valid] == e).all()


@pytest.mark.parametrize("style", ["tuple", "phy2log"])
def test_policy_returns_the_maps_vllm_expects(monkeypatch, style):
    monkeypatch.setattr(vllm_policy, "POLICY_MODULES", ("moe_place_no_such_module",))
    policy = vllm_policy.make_policy(returns=style)
    weight = _weight()
    out = policy.rebalance_experts(weight.to(torch.float32), 24, 1, 1, 4)
    if style == "phy2log":
        assert isinstance(out, torch.Tensor)
        placement = Placement(out.numpy(), 16, 4)
        out = vllm_policy.placement_tensors(placement, log2phy_width=24 - 16 + 1)
    _check_maps(*out, layers=3, experts=16, replicas=24)


def test_make_policy_refuses_settings_it_does_not_have():
    # "mode" went with the "replan" mode (a fresh plan at every call, which no benchmark measured): the rule
    # is the policy's only decision, and a setting it does not read is an error naming it
    with pytest.raises(vllm_policy.InputError, match="mode") as refused:
        vllm_policy.make_policy(mode="replan")
    assert "max_moved_slots" in str(refused.value)   # the error lists the settings there are
    with pytest.raises(vllm_policy.InputError, match="fresh_margin, move_cost_weight"):
        vllm_policy.make_policy(move_cost_weight=1.0, fresh_margin=0.1)


def test_keep_unchanged_slots_only_reorders_inside_each_gpu():
    rng = np.random.default_rng(0)
    for _ in range(20):
        old = np.concatenate([rng.permutation(8)[:3] for _ in range(4)])
        new = np.concatenate([rng.permutation(8)[:3] for _ in range(4)])
        out = keep_unchanged_slots(new, old, 3)
        for g in range(4):
            block = slice(3 * g, 3 * g + 3)
            assert sorted(out[block]) == sorted(new[block])  # same experts on every GPU
            kept = set(old[block]) & set(new[block])
            assert all(out[i] == old[i] for i in range(3 * g, 3 * g + 3) if old[i] in kept)


def test_static_plan_file_is_returned_at_every_rebalance(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_policy, "POLICY_MODULES", ("moe_place_no_such_module",))
    plan = Placement(np.array([[0, 1, 2, 3, 0, 2], [3, 2, 1, 0, 1, 3]]), 4, 2)
    path = tmp_path / "static.json"
    write_plan(path, PlanFile(plan, (0, 1)).without_report())
    monkeypatch.setenv(vllm_policy.STATIC_PLAN_ENV, str(path))
    policy = vllm_policy.make_policy(returns="tuple")
    phy2log, log2phy, logcnt = policy.rebalance_experts(torch.ones(2, 4), 6, 1, 1, 2)
    np.testing.assert_array_equal(phy2log.numpy(), plan.phy2log)
    _check_maps(phy2log, log2phy, logcnt, layers=2, experts=4, replicas=6)
    with pytest.raises(vllm_policy.InputError, match="3 layers"):
        policy.rebalance_experts(torch.ones(3, 4), 6, 1, 1, 2)
    with pytest.raises(vllm_policy.InputError, match="3 EP ranks"):
        policy.rebalance_experts(torch.ones(2, 4), 6, 1, 1, 3)


def test_against_the_real_vllm_policy_class():
    policy_pkg = pytest.importorskip("vllm.distributed.eplb.policy")
    abstract = policy_pkg.AbstractEplbPolicy
    policy = vllm_policy.make_policy()
    assert issubclass(policy, abstract)
    out = policy.rebalance_experts(_weight().float(), 24, 1, 1, 4)
    phy2log = out[0] if isinstance(out, tuple) else out
    assert phy2log.shape == (3, 24) and phy2log.dtype == torch.int64
    assert vllm_policy.return_style() == vllm_policy.style_of(abstract.rebalance_experts)
    registry = policy_pkg.EPLB_POLICIES
    before = dict(registry)
    with adapter.registered():
        assert issubclass(registry["default"], vllm_policy.MoePlaceEplbPolicy)
    assert registry == before


# ---------------------------------------------------------------------- the rebalance rule inside the policy
GPUS, EXPERTS, REPLICAS, LAYERS = 8, 64, 72, 4
STEP_TOKENS = 4096 * 8  # dispatches per step (4096 tokens, top-8)


def _step_loads(seed=0):
    """Per-step loads `[layers, E]` of a skewed model, about STEP_TOKENS dispatches per layer."""
    rng = np.random.default_rng(seed)
    w = rng.zipf(1.3, size=(LAYERS, EXPERTS)).clip(max=50).astype(float)
    return w / w.sum(axis=1, keepdims=True) * STEP_TOKENS


def _window(per_step, steps, seed):
    """A summed window of `steps` multinomial steps of `per_step` loads (what vLLM 0.33 passes)."""
    rng = np.random.default_rng(seed)
    share = per_step / per_step.sum(axis=1, keepdims=True)
    return torch.from_numpy(np.stack([rng.multinomial(int(STEP_TOKENS) * steps, p) for p in share]))


def _linear():
    """vLLM's start map: slot p < E holds expert p, redundant slot E + i holds expert i."""
    return torch.from_numpy(np.tile(np.arange(REPLICAS) % EXPERTS, (LAYERS, 1)))


@pytest.fixture
def no_vllm(monkeypatch):
    monkeypatch.setattr(vllm_policy, "POLICY_MODULES", ("moe_place_no_such_module",))
    for var in ("MOE_PLACE_CONFIG", "MOE_PLACE_MIGRATION", "MOE_PLACE_MAX_MOVED_SLOTS", "MOE_PLACE_MODEL",
                "MOE_PLACE_STEP_INTERVAL", "MOE_PLACE_WINDOW_STEPS", vllm_policy.STATIC_PLAN_ENV):
        monkeypatch.delenv(var, raising=False)


def _busiest_over_mean(phy2log, load):
    gpu = Placement(phy2log.numpy(), EXPERTS, GPUS, allow_colocated=True).gpu_loads(load)
    return gpu.max(axis=1) / gpu.mean(axis=1)


def test_policy_balances_from_the_linear_map_keeps_it_on_noise_and_follows_a_new_hot_expert(no_vllm):
    config = vllm_policy.EngineConfig(model="Qwen3-30B-A3B")
    policy = vllm_policy.make_policy(returns="phy2log", config=config)
    per_step = _step_loads()
    first = policy.rebalance_experts(_window(per_step, 750, 0), REPLICAS, 1, 1, GPUS, _linear())
    # as balanced as vLLM's default (EPLB) on the same window, within 1% on every layer
    eplb = torch.from_numpy(eplb_rebalance(_window(per_step, 750, 0).numpy().astype(float), REPLICAS, 1, 1, GPUS))
    assert (_busiest_over_mean(first, per_step) <= _busiest_over_mean(eplb, per_step) + 0.01).all()
    for seed in (1, 2):  # the same load, new samples: nothing moves
        same = policy.rebalance_experts(_window(per_step, 1000, seed), REPLICAS, 1, 1, GPUS, first)
        assert torch.equal(same, first)
    hot = per_step.copy()
    cold = int(np.argmin(per_step[0]))
    hot[:, cold] = 5 * hot.mean(axis=1)  # a new hot expert at 5x the mean
    moved = policy.rebalance_experts(_window(hot, 1000, 3), REPLICAS, 1, 1, GPUS, first)
    assert (moved != first).sum() > 0
    assert (Placement(moved.numpy(), EXPERTS, GPUS, allow_colocated=True).logcnt[:, cold] >= 2).all()
    assert _busiest_over_mean(moved, hot).sum() < _busiest_over_mean(first, hot).sum()


def test_policy_makes_the_replay_controllers_decision(no_vllm):
    # the same history through `replay --controller ours` at vLLM's cadence and through the policy
    from moe_place.cost.cluster import cluster_cost
    from moe_place.online.controller import EngineCadence, initial_map, make_controller
    from moe_place.online.policy import RebalanceRule
    from moe_place.online.replay import replay

    config = vllm_policy.EngineConfig(model="Qwen3-30B-A3B", migration="stall", step_interval=64, window_steps=32)
    policy = vllm_policy.make_policy(returns="phy2log", config=config)
    rng = np.random.default_rng(3)
    base = _step_loads(seed=3)
    steps = np.stack([[rng.multinomial(int(STEP_TOKENS), p / p.sum()) for p in base] for _ in range(208)])
    steps[100:, :, 7] += int(2 * base.mean())  # expert 7 turns hot
    cost = cluster_cost(GPUS, 1, "H100", "Qwen3-30B-A3B", migration="stall")
    cadence = EngineCadence.of("vllm", 64, 32)
    start = initial_map(LAYERS, EXPERTS, REPLICAS, GPUS)
    emitted = {}
    ours = make_controller("ours", cadence, LAYERS, EXPERTS, rule=RebalanceRule(cost, LAYERS, EXPERTS))
    decide = ours.decide

    def record(step, current):
        decision = decide(step, current)
        emitted[step] = current.phy2log if decision is None else decision.placement.phy2log
        return decision

    ours.decide = record
    replay(steps.astype(float), ours, cost, start, layer_per_step=True, drain_steps=0)
    current = torch.from_numpy(np.array(start.phy2log))
    calls = [s for s in range(len(steps)) if cadence.calls_at(s)]
    assert calls == [15, 79, 143, 207]
    for step in calls:
        window = steps[max(0, step + 1 - 32):step + 1].sum(axis=0)
        current = policy.rebalance_experts(torch.from_numpy(window), REPLICAS, 1, 1, GPUS, current)
        np.testing.assert_array_equal(current.numpy(), emitted[step])


# ---------------------------------------------------------------------- vLLM's next policy interface
def _fake_vllm_next(monkeypatch, transitional: bool):
    """Stand-ins shaped like vLLM main's policy package (written here, not copied).

    Shapes as read in vLLM: `vllm/distributed/eplb/policy/abstract.py` of the out-of-tree hooks
    work (PR #49700: `EplbTopology(num_groups, num_nodes, num_ranks)`, frozen
    `EplbRebalanceContext(load_window_cpu [samples, layers, experts], physical_to_logical_map_cpu
    [layers, physical], topology, num_replicas, cpu_group)`, frozen `EplbPlan(physical_to_logical_map)`,
    `EplbPolicyState`, and `AbstractEplbPolicy` with `create_state(num_moe_layers)`, the planning
    method and `on_layer_committed(policy_state, plan, layer_idx)`); `transitional`: the planning
    method is the abstract `plan_rebalance(self, context, policy_state)` beside the legacy classmethod,
    else it is the abstract instance method `rebalance_experts(self, context, policy_state)`. The
    package lives at `vllm.backends.distributed.eplb.policy` (vllm-project/vllm
    `vllm/backends/distributed/eplb/eplb_state.py` @ a8f1d79812aa51e1036eba41286879eb09bd1635) with a
    shim at the old path delegating attributes (`vllm/distributed/eplb/policy/__init__.py` @
    055e47c28003156421365af985d676fc921cb075).
    """

    @dataclass(frozen=True)
    class EplbTopology:
        num_groups: int
        num_nodes: int
        num_ranks: int

    @dataclass(frozen=True)
    class EplbRebalanceContext:
        load_window_cpu: torch.Tensor
        physical_to_logical_map_cpu: torch.Tensor
        topology: EplbTopology
        num_replicas: int
        cpu_group: object

    @dataclass(frozen=True)
    class EplbPlan:
        physical_to_logical_map: torch.Tensor

    class EplbPolicyState:
        pass

    if transitional:
        class AbstractEplbPolicy(abc.ABC):
            def create_state(self, num_moe_layers):
                return EplbPolicyState()

            @abc.abstractmethod
            def plan_rebalance(self, context, policy_state):
                raise NotImplementedError

            def on_layer_committed(self, policy_state, plan, layer_idx):
                return None

            @classmethod
            def rebalance_experts(cls, weight, num_replicas, num_groups, num_nodes, num_ranks,
                                  old_global_expert_indices=None) -> torch.Tensor:
                raise NotImplementedError
    else:
        class AbstractEplbPolicy(abc.ABC):
            def create_state(self, num_moe_layers):
                return EplbPolicyState()

            @abc.abstractmethod
            def rebalance_experts(self, context, policy_state):
                raise NotImplementedError

            def on_layer_committed(self, policy_state, plan, layer_idx):
                return None

    real = types.ModuleType("vllm.backends.distributed.eplb.policy")
    for cls in (EplbTopology, EplbRebalanceContext, EplbPlan, EplbPolicyState, AbstractEplbPolicy):
        setattr(real, cls.__name__, cls)
    real.EPLB_POLICIES = {"default": AbstractEplbPolicy}
    shim = types.ModuleType("vllm.distributed.eplb.policy")
    shim.__getattr__ = lambda name: getattr(real, name)
    for name in ("vllm", "vllm.distributed", "vllm.distributed.eplb", "vllm.backends", "vllm.backends.distributed",
                 "vllm.backends.distributed.eplb"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.backends.distributed.eplb.policy", real)
    monkeypatch.setitem(sys.modules, "vllm.distributed.eplb.policy", shim)
    for var in ("MOE_PLACE_CONFIG", "MOE_PLACE_MIGRATION", "MOE_PLACE_MAX_MOVED_SLOTS", "MOE_PLACE_MODEL",
                vllm_policy.STATIC_PLAN_ENV):
        monkeypatch.delenv(var, raising=False)
    return real


@pytest.mark.parametrize("transitional", [False, True])
def test_next_interface_is_detected_and_keeps_state_only_through_commits(monkeypatch, transitional):
    from moe_place.solvers.engine_call import plan_placement

    vllm = _fake_vllm_next(monkeypatch, transitional)
    assert vllm_policy.interface_of(vllm.AbstractEplbPolicy) == ("plan_rebalance" if transitional else "context")
    config = vllm_policy.EngineConfig(model="Qwen3-30B-A3B")
    cls = vllm_policy.make_policy(config=config)
    assert issubclass(cls, vllm.AbstractEplbPolicy)
    policy = cls()  # vLLM instantiates the registered class
    state = policy.create_state(LAYERS)
    assert isinstance(state, vllm.EplbPolicyState)
    per_step = _step_loads()
    old = torch.from_numpy(np.array(plan_placement(per_step, REPLICAS, None, 1, GPUS).phy2log))
    hot = per_step.copy()
    hot[:, int(np.argmin(per_step[0]))] = 5 * per_step.mean(axis=1)
    window = torch.from_numpy(np.stack([hot] * 100))  # [samples, layers, experts], oldest first
    context = vllm.EplbRebalanceContext(window, old, vllm.EplbTopology(1, 1, GPUS), REPLICAS, None)
    plan_method = policy.plan_rebalance if transitional else policy.rebalance_experts
    plan = plan_method(context, state)
    assert isinstance(plan, vllm.EplbPlan)
    new = plan.physical_to_logical_map
    assert new.shape == (LAYERS, REPLICAS) and new.dtype == torch.int64
    assert (new != old).sum() > 0
    assert state.moe_place.sessions == {}  # planning treats the state as read-only
    for layer in range(LAYERS):
        policy.on_layer_committed(state, plan, layer)
    assert len(state.moe_place.sessions) == 1  # the controller's history advanced with the commit
    if transitional:  # the legacy classmethod still answers, as the abstract fallback calls it
        assert cls.rebalance_experts(torch.from_numpy(hot * 1000), REPLICAS, 1, 1, GPUS, old).shape == new.shape


def test_install_under_a_new_name_validates_with_a_pydantic_config(monkeypatch):
    # vLLM's EPLBConfig is a pydantic dataclass: the new name must pass its validation, and not after uninstall
    pydantic = pytest.importorskip("pydantic")
    policy_mod, parallel = _fake_vllm(monkeypatch, returns_tuple=False)

    @pydantic.dataclasses.dataclass
    class EPLBConfig:
        window_size: int = 1000
        policy: parallel.EPLBPolicyOption = "default"

    parallel.EPLBConfig = EPLBConfig
    with pytest.raises(pydantic.ValidationError):
        EPLBConfig(policy="moe_place")
    with adapter.registered(name="moe_place"):
        assert EPLBConfig(policy="moe_place").policy == "moe_place"
    with pytest.raises(pydantic.ValidationError):
        EPLBConfig(policy="moe_place")
