"""vLLM adapter, the patching: a reversible way to register moe-place's policy with vLLM.

The policy itself (what it decides, its interfaces) is `moe_place.engines.vllm_policy`. vLLM has no
out-of-tree policy registry: policies live in the dict `EPLB_POLICIES` and the config's `policy`
field only accepts the names of the `EPLBPolicyOption` literal. `install()` patches both, in place
and reversibly (`uninstall(handle)` or the `registered()` context), and wraps `EplbState.add_model`
so that what vLLM registers for each model reaches the policy (`record_vllm_model`):

    from moe_place.engines.vllm import install
    install()                        # policy "default" now runs moe-place (works with use_async)
    install(name="moe_place")        # a new name; vLLM 0.33 accepts it only with use_async off
                                     # ("Async EPLB is only supported with the default policy")

vLLM starts worker processes that must patch too: put the call in every process through vLLM's
plugin entry point group `vllm.general_plugins` (`register_plugin`, enabled by setting
`MOE_PLACE_VLLM_POLICY=default`). vLLM and pydantic are imported lazily.

Start-up checks: `install` reads the rule's settings (`moe_place.engines.config.load_engine_config`) and
`MOE_PLACE_SPLIT` at once, so a bad `MOE_PLACE_*` value stops vLLM in its plugin loading, before it serves
(vLLM does not catch a plugin's exception); a model or cadence that disagrees with vLLM's stops it in
`add_model`. What the wrapped `add_model` reads of vLLM (the expert weights) is a probe: where it fails, or
vLLM registers no expert weight tensors, one warning, and the model counts as unknown (the rule prices copies
with the configured model). With `MOE_PLACE_SPLIT=per-batch`, `add_model` also installs the per-batch split
into vLLM's router (`moe_place.engines.vllm_split`).
"""

from __future__ import annotations

import functools
import os
import typing
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

from moe_place.engines.batch_split import FLAGS, check_split_setting
from moe_place.engines.config import EngineModel, config_dims, expert_bytes_of, load_engine_config
from moe_place.engines.guard import Guard
from moe_place.engines.vllm_policy import (ENGINE_MODELS, STATIC_PLAN_ENV, VllmModel, PolicyCore, importable,
                                           make_policy, policy_module)
from moe_place.engines.vllm_split import VllmSplit, install_split, uninstall_split
from moe_place.errors import InputError
from moe_place.online.policy import warm_up

PLUGIN_ENV = "MOE_PLACE_VLLM_POLICY"
# Where vLLM keeps its config literal and its EPLB state (module paths moved between releases).
OPTION_MODULES = ("vllm.config.parallel", "vllm.config", "vllm.distributed.eplb.policy",
                  "vllm.backends.distributed.eplb.policy")
STATE_MODULES = ("vllm.distributed.eplb.eplb_state", "vllm.backends.distributed.eplb.eplb_state")


# ---------------------------------------------------------------------- registration
_MISSING = object()


@dataclass
class Registration:
    """What `install` changed, so that `uninstall` can put it back exactly."""

    name: str
    policy: type
    policies: dict
    previous_policy: Any
    option_patches: list[tuple[Any, str, Any]] = field(default_factory=list)
    rebuilt: list[Any] = field(default_factory=list)
    recorded: list[tuple[int, int]] = field(default_factory=list)   # ENGINE_MODELS keys its add_model wrote
    active: bool = True
    guard: Guard = field(default_factory=lambda: Guard("vLLM"))     # the add_model probe's warnings
    split: VllmSplit | None = None   # the per-batch split (MOE_PLACE_SPLIT=per-batch), installed at add_model


def install(policy: type | None = None, name: str = "default", policies: dict | None = None) -> Registration:
    """Register `policy` (default: `make_policy()`) with vLLM under `name`; returns the handle.

    name "default" replaces vLLM's built-in policy in `EPLB_POLICIES` (nothing else changes, and
    vLLM's async mode, validated only for "default", keeps working). Any other name is added to
    `EPLB_POLICIES` and to the `EPLBPolicyOption` literal the config checks, so
    `--eplb-config '{"policy": NAME}'` is accepted, but only with `use_async` off: vLLM 0.33
    refuses async EPLB with any policy but "default". `policies`: the registry dict to patch
    (tests; default: vLLM's). The dict is changed in place: modules that imported it see it.
    The rule's settings and `MOE_PLACE_SPLIT` are read here: a bad value is an InputError now, not in a
    rebalance.
    """
    load_engine_config()
    split = check_split_setting(True, PLUGIN_ENV)
    module = None
    if policies is None:
        module = policy_module()
        if module is None:
            raise InputError("vllm", "an importable vLLM with EPLB policies (vllm.distributed.eplb.policy)",
                             "not importable")
        policies = module.EPLB_POLICIES
    policy = policy or make_policy()
    warm_up()   # the rule's one-time costs now, not in vLLM's first (timed) rebalance
    handle = Registration(name=name, policy=policy, policies=policies,
                          previous_policy=policies.get(name, _MISSING), split=VllmSplit() if split else None)
    policies[name] = policy
    if name != "default" and module is not None:
        _widen_policy_option(name, handle)
    if module is not None:
        _watch_add_model(handle)
    return handle


def _watch_add_model(handle: Registration) -> None:
    """Wrap `EplbState.add_model` so that it records what vLLM registers for each model (`ENGINE_MODELS`)
    and, when the policy is ours, checks the config against it (an InputError stops the server at start)."""
    for module in importable(STATE_MODULES):
        state = getattr(module, "EplbState", None)
        original = getattr(state, "add_model", None)
        if original is None or getattr(original, "moe_place_wraps", None) is not None:
            continue

        @functools.wraps(original)
        def add_model(self, model, model_config, *args, _original=original, **kwargs):
            result = _original(self, model, model_config, *args, **kwargs)
            key = record_vllm_model(self, model, model_config, kwargs.get("model_name", args[0] if args else None),
                                    guard=handle.guard)
            if key is not None:
                handle.recorded.append(key)
            if handle.split is not None and _is_ours(getattr(self, "policy", None)):
                handle.guard.call("vllm.add_model", lambda: _split_model(handle.split, model), lambda: None)
            return result

        add_model.moe_place_wraps = original
        add_model.moe_place_entry = "vllm.add_model"
        handle.option_patches.append((state, "add_model", original))
        state.add_model = add_model


def vllm_engine_model(model, model_config, model_name: str | None = None) -> EngineModel | None:
    """What vLLM serves: the model's name, one expert's bytes (the tensors of `model.expert_weights[0]`,
    `[local experts, ...]` each), its MoE layers and experts; None where vLLM registers no expert weight
    tensors (or none with bytes)."""
    hf_config = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    name = model_name or getattr(model_config, "model", None) or "an unnamed model"
    weights = list(getattr(model, "expert_weights", None) or [])
    expert_bytes = expert_bytes_of(weights[0]) if weights else 0
    if expert_bytes <= 0:
        return None
    return EngineModel(str(name), expert_bytes, int(model.num_moe_layers), int(model.num_logical_experts),
                       **config_dims(hf_config), source="the expert weights vLLM registers with EplbState")


def record_vllm_model(state, model, model_config, model_name: str | None = None,
                      guard: Guard | None = None) -> tuple[int, int] | None:
    """Record what `EplbState.add_model` registered (`ENGINE_MODELS`, keyed by MoE layers and experts): the
    model (`vllm_engine_model`) and the state's `step_interval` / `window_size` / `use_async`; checked against
    the config when the state's policy is ours (an InputError: vLLM does not start). Returns the key.

    guard: where the probe of vLLM's model fails (or finds no expert weights), one warning and the model
    counts as unknown (None: the probe's exception propagates, as outside an engine)."""
    def probe():
        engine = vllm_engine_model(model, model_config, model_name)
        if engine is None and guard is not None:
            guard.warn("vllm.add_model", "vLLM registers no expert weight tensors for this model")
        return engine, (int(model.num_moe_layers), int(model.num_logical_experts))

    engine, key = probe() if guard is None else guard.call("vllm.add_model", probe, lambda: (None, None))
    eplb = getattr(getattr(state, "parallel_config", None), "eplb_config", None)
    use_async = getattr(eplb, "use_async", None)
    seen = VllmModel(engine, getattr(eplb, "step_interval", None), getattr(eplb, "window_size", None),
                     None if use_async is None else bool(use_async))
    if key is not None:
        ENGINE_MODELS[key] = seen
    policy = getattr(state, "policy", None)
    if _is_ours(policy) and not (policy.static_plan or os.environ.get(STATIC_PLAN_ENV)):
        config = policy.engine_config()
        if engine is not None:
            config.expert_shape(engine)
        config.cadence(seen.step_interval, seen.window_size)
        config.resolved_migration(None if seen.use_async is None else "async" if seen.use_async else "stall")
    return key


def _is_ours(policy) -> bool:
    return isinstance(policy, type) and issubclass(policy, PolicyCore)


def _split_model(split: VllmSplit, model) -> None:
    """Install the per-batch split into vLLM's router (once) and learn the model's layers."""
    install_split(split)
    FLAGS.clear(split.tag_layers(model))


def uninstall(handle: Registration) -> None:
    """Undo `install`: the registry and the config literal are as they were before."""
    if not handle.active:
        return
    if handle.previous_policy is _MISSING:
        handle.policies.pop(handle.name, None)
    else:
        handle.policies[handle.name] = handle.previous_policy
    for owner, attr, old in reversed(handle.option_patches):
        setattr(owner, attr, old)
    for key in handle.recorded:
        ENGINE_MODELS.pop(key, None)
    if handle.split is not None:
        uninstall_split(handle.split)
    for cls in handle.rebuilt:
        _rebuild_pydantic(cls)
    handle.active = False


@contextmanager
def registered(policy: type | None = None, name: str = "default", policies: dict | None = None) -> Iterator[Registration]:
    """`install` for the duration of a `with` block."""
    handle = install(policy, name, policies)
    try:
        yield handle
    finally:
        uninstall(handle)


def register_plugin() -> None:
    """Entry point for vLLM's `vllm.general_plugins` group: installs when `MOE_PLACE_VLLM_POLICY` is set.

    Loaded by vLLM in every process it starts (possibly more than once: installing twice is a no-op).
    A bad `MOE_PLACE_*` value raises here (vLLM stops before serving), `MOE_PLACE_SPLIT=per-batch` without
    the policy's variable too.
    """
    name = os.environ.get(PLUGIN_ENV)
    if not name:
        check_split_setting(False, PLUGIN_ENV)
        return
    module = policy_module()
    if module is None:
        return
    current = module.EPLB_POLICIES.get(name)
    if isinstance(current, type) and issubclass(current, PolicyCore):
        return
    install(name=name)


def _widen_policy_option(name: str, handle: Registration) -> None:
    """Add `name` to every `EPLBPolicyOption` literal, and to the type of `EPLBConfig.policy`.

    vLLM's `EPLBConfig` is a pydantic dataclass: its validator is built from the dataclass
    fields' types, so the field's type is widened and the validator rebuilt; nothing else of the
    class is touched (its `__annotations__` and pydantic's own field records are left as they are).
    """
    widened = None
    for module in importable(OPTION_MODULES):
        option = getattr(module, "EPLBPolicyOption", None)
        if option is not None:
            args = typing.get_args(option)
            if name not in args:
                widened = typing.Literal[args + (name,)]  # type: ignore[valid-type]
                handle.option_patches.append((module, "EPLBPolicyOption", option))
                module.EPLBPolicyOption = widened
        config = getattr(module, "EPLBConfig", None)
        dc_fields = getattr(config, "__dataclass_fields__", None)
        if widened is not None and dc_fields and "policy" in dc_fields and config not in handle.rebuilt:
            handle.option_patches.append((dc_fields["policy"], "type", dc_fields["policy"].type))
            dc_fields["policy"].type = widened
            if _rebuild_pydantic(config):
                handle.rebuilt.append(config)
    if widened is None:
        warnings.warn("moe-place: vLLM's EPLBPolicyOption literal was not found; the config may reject "
                      f"policy {name!r}: install(name='default') avoids the check", stacklevel=3)


def _rebuild_pydantic(cls) -> bool:
    """Rebuild a pydantic dataclass's validator after its annotations changed (False if not pydantic)."""
    if not hasattr(cls, "__pydantic_fields__"):
        return False
    try:
        from pydantic.dataclasses import rebuild_dataclass  # lazy: pydantic comes with vLLM, not with us
    except ImportError:
        return False
    rebuild_dataclass(cls, force=True)
    return True


# make_policy: the policy `install` takes, from vllm_policy
__all__ = ["OPTION_MODULES", "PLUGIN_ENV", "Registration", "STATE_MODULES", "install", "make_policy",
           "record_vllm_model", "register_plugin", "registered", "uninstall", "vllm_engine_model"]
