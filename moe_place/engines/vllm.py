"""vLLM adapter: an EPLB policy backed by moe-place, and a reversible way to register it.

vLLM (`vllm/distributed/eplb/`) calls its policy's classmethod

    rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_ranks[, old_global_expert_indices])

with `weight` the logical load window `[layers, E]` (summed over `window_size` steps) every
`step_interval` steps. Released versions differ in what it returns:
- "tuple": `(phy2log [layers, P], log2phy [layers, E, R+1], logcnt [layers, E])` (older
  releases; `log2phy` padded with -1 to `num_redundant + 1` columns as the default policy does);
- "phy2log": only `phy2log [layers, P]` (recent main, which also passes the current map as
  `old_global_expert_indices [layers, P]`).
`MoePlaceEplbPolicy.returns` ("auto", "tuple", "phy2log"; env `MOE_PLACE_VLLM_RETURNS`) picks
the style; "auto" reads it off the installed vLLM's `AbstractEplbPolicy` (tuple if vLLM is absent).

When the current map is given, the re-plan is migration-aware: experts that keep their place keep
their slot, so vLLM copies only the slots that really change. With `MOE_PLACE_STATIC_PLAN=FILE`
(a file from `moe-place export --engine vllm`, or a `plan` file) the policy returns that fixed
placement at every rebalance: vLLM moves to it once and never again (static placement).

vLLM has no out-of-tree policy registry: policies live in the dict `EPLB_POLICIES` and the
config's `policy` field only accepts the names of the `EPLBPolicyOption` literal. `install()`
patches both, in place and reversibly (`uninstall(handle)` or the `registered()` context):

    from moe_place.engines.vllm import install
    install()                        # policy "default" now runs moe-place (works with use_async)
    install(name="moe_place")        # or: a new name, --eplb-config '{"policy": "moe_place"}'

vLLM starts worker processes that must patch too: put the call in every process through vLLM's
plugin entry point group `vllm.general_plugins` (`register_plugin`, enabled by setting
`MOE_PLACE_VLLM_POLICY=default` or `=moe_place`). torch and vLLM are imported lazily.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import typing
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterator

import numpy as np

from moe_place.eplb import placement_tensors, plan_placement, weight_to_numpy
from moe_place.errors import InputError
from moe_place.placement import Placement

POLICY_NAME = "moe_place"
RETURN_STYLES = ("auto", "tuple", "phy2log")
RETURNS_ENV = "MOE_PLACE_VLLM_RETURNS"
STATIC_PLAN_ENV = "MOE_PLACE_STATIC_PLAN"
PLUGIN_ENV = "MOE_PLACE_VLLM_POLICY"
EXPORT_FORMAT = "moe-place-vllm-placement"

# Where vLLM keeps its policy registry and its config literal (module paths moved between releases).
POLICY_MODULES = ("vllm.distributed.eplb.policy", "vllm.backends.distributed.eplb.policy")
OPTION_MODULES = ("vllm.config.parallel", "vllm.config", "vllm.distributed.eplb.policy",
                  "vllm.backends.distributed.eplb.policy")


# ---------------------------------------------------------------------- the policy
class MoePlaceEplbPolicy:
    """An EPLB policy with vLLM's interface; configure by subclassing (`make_policy`) or env vars.

    Class attributes:
        returns: "auto" | "tuple" | "phy2log" (see the module note).
        solver / time_limit_s: moe-place solver (None: `MOE_PLACE_SOLVER`, default "fast").
        max_moved_slots: cap on slots whose expert changes per layer and rebalance (None: no cap).
        move_cost_weight: load units charged per moved slot (0: moves are free to the solver).
        static_plan: path of a fixed placement (None: `MOE_PLACE_STATIC_PLAN`, unset: plan online).
        fresh_margin: with the current map, a layer takes a fresh plan only when it is this much
            better (relative busiest-GPU load) than the migration-aware one.
    """

    returns: ClassVar[str] = "auto"
    solver: ClassVar[str | None] = None
    time_limit_s: ClassVar[float | None] = None
    max_moved_slots: ClassVar[int | None] = None
    move_cost_weight: ClassVar[float] = 0.0
    static_plan: ClassVar[str | None] = None
    fresh_margin: ClassVar[float] = 0.02

    @classmethod
    def rebalance_experts(cls, weight, num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int,
                          old_global_expert_indices=None):
        """Plan `num_replicas` slots per layer for `weight [layers, E]` on `num_ranks` GPUs.

        old_global_expert_indices: int `[layers, num_replicas]`, the map in use (optional); slots
            holding -1 (ranks being added or removed) make it unusable and it is ignored.
        Returns `phy2log` or `(phy2log, log2phy, logcnt)` (CPU int64 tensors), per `returns`.
        """
        loads = weight_to_numpy(weight)
        num_layers, num_experts = loads.shape
        static = cls.static_plan or os.environ.get(STATIC_PLAN_ENV)
        if static:
            phy2log, planned_gpus = read_static_map(static, with_gpus=True)
            if phy2log.shape != (num_layers, num_replicas):
                raise InputError(static, f"a placement of {num_layers} layers x {num_replicas} slots",
                                 f"{phy2log.shape[0]} x {phy2log.shape[1]}")
            if planned_gpus != num_ranks:
                raise InputError(static, f"a placement for {num_ranks} EP ranks", f"one for {planned_gpus}")
            placement = Placement(phy2log, num_experts, num_ranks, allow_colocated=True)
        else:
            current = current_placement(old_global_expert_indices, num_experts, num_ranks, (num_layers, num_replicas))
            placement = cls.plan(loads, num_replicas, num_groups, num_nodes, num_ranks, current)
        phy2log, log2phy, logcnt = placement_tensors(placement, log2phy_width=num_replicas - num_experts + 1)
        if return_style(cls.returns) == "phy2log":
            return phy2log
        return phy2log, log2phy, logcnt

    @classmethod
    def plan(cls, loads: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int,
             current: Placement | None) -> Placement:
        """A fresh plan, or with `current` the cheaper of two per layer.

        With the map in use, each layer gets the migration-aware plan (the solver starts from the
        current map and moves few slots) unless a fresh plan is more than `fresh_margin` better;
        then the fresh plan is taken with its slots aligned to the current map
        (`keep_unchanged_slots`), so experts that stay on their GPU keep their slot and are not
        copied. With `max_moved_slots` set, only the migration-aware plan is allowed.
        """
        settings = dict(solver=cls.solver, time_limit_s=cls.time_limit_s)
        fresh = None
        if current is None or cls.max_moved_slots is None:
            fresh = plan_placement(loads, num_replicas, num_groups, num_nodes, num_ranks, **settings)
        if current is None:
            return fresh
        aware = plan_placement(loads, num_replicas, num_groups, num_nodes, num_ranks, current=current,
                               max_moved_slots=cls.max_moved_slots, move_cost_weight=cls.move_cost_weight, **settings)
        if fresh is None:
            return aware
        rows = np.array(aware.phy2log)
        busiest_aware = aware.gpu_loads(loads).max(axis=1)
        busiest_fresh = fresh.gpu_loads(loads).max(axis=1)
        for layer in np.flatnonzero(busiest_fresh * (1 + cls.fresh_margin) < busiest_aware):
            rows[layer] = keep_unchanged_slots(fresh.phy2log[layer], current.phy2log[layer], current.slots_per_gpu)
        return Placement(rows, current.num_logical_experts, num_ranks, aware.num_nodes,
                         allow_colocated=aware.allow_colocated or fresh.allow_colocated)


def keep_unchanged_slots(new_row: np.ndarray, old_row: np.ndarray, slots_per_gpu: int) -> np.ndarray:
    """int64 `[P]`: `new_row` with each GPU's slots reordered so experts already there keep their slot.

    Only the order inside each GPU changes (the GPU of every replica, hence every load, is as in
    `new_row`); slots whose expert is unchanged need no copy.
    """
    new = np.asarray(new_row, dtype=np.int64).reshape(-1, slots_per_gpu)
    old = np.asarray(old_row, dtype=np.int64).reshape(-1, slots_per_gpu)
    out = np.full_like(new, -1)
    for g in range(new.shape[0]):
        remaining = list(new[g])
        for i, expert in enumerate(old[g]):
            if expert in remaining:
                out[g, i] = expert
                remaining.remove(expert)
        free = np.flatnonzero(out[g] < 0)
        out[g, free] = remaining
    return out.ravel()


def make_policy(name: str = "MoePlaceEplbPolicy", **settings: Any) -> type:
    """A policy class with `settings` (the class attributes of `MoePlaceEplbPolicy`).

    When vLLM is importable the class also derives from its `AbstractEplbPolicy`, so
    `issubclass(cls, AbstractEplbPolicy)` holds for code that checks.
    """
    known = ("returns", "solver", "time_limit_s", "max_moved_slots", "move_cost_weight", "static_plan", "fresh_margin")
    unknown = set(settings) - set(known)
    if unknown:
        raise InputError("make_policy", f"settings among {', '.join(known)}", ", ".join(sorted(unknown)))
    if "returns" in settings and settings["returns"] not in RETURN_STYLES:
        raise InputError("returns", f"one of {', '.join(RETURN_STYLES)}", settings["returns"])
    bases: tuple[type, ...] = (MoePlaceEplbPolicy,)
    abstract = vllm_abstract_policy()
    if abstract is not None:
        bases += (abstract,)
    return type(name, bases, dict(settings))


def current_placement(old, num_experts: int, num_gpus: int, shape: tuple[int, int]) -> Placement | None:
    """The map vLLM runs now as a Placement, or None when absent or unusable (wrong shape, -1 slots)."""
    if old is None:
        return None
    if hasattr(old, "detach"):
        old = old.detach().to("cpu").numpy()
    old = np.asarray(old)
    if old.shape != shape or old.size == 0 or old.min() < 0 or old.max() >= num_experts:
        return None
    try:
        # vLLM's own default policy may put two replicas of one expert on one GPU
        return Placement(old.astype(np.int64), num_experts, num_gpus, allow_colocated=True)
    except InputError:
        return None


def return_style(configured: str = "auto") -> str:
    """"tuple" or "phy2log": the env var, else `configured`, else what the installed vLLM expects."""
    style = os.environ.get(RETURNS_ENV) or configured
    if style not in RETURN_STYLES:
        raise InputError(RETURNS_ENV, f"one of {', '.join(RETURN_STYLES)}", style)
    if style != "auto":
        return style
    abstract = vllm_abstract_policy()
    return "tuple" if abstract is None else style_of(abstract.rebalance_experts)


def style_of(method) -> str:
    """"tuple" when `method`'s return annotation is a tuple, else "phy2log"."""
    annotation = inspect.signature(method).return_annotation
    if isinstance(annotation, str):
        return "tuple" if annotation.replace(" ", "").lower().startswith(("tuple", "typing.tuple")) else "phy2log"
    return "tuple" if typing.get_origin(annotation) is tuple or annotation is tuple else "phy2log"


def vllm_abstract_policy() -> type | None:
    """vLLM's `AbstractEplbPolicy`, or None when vLLM is not importable."""
    module = policy_module()
    return None if module is None else getattr(module, "AbstractEplbPolicy", None)


def policy_module():
    """The vLLM module that holds `EPLB_POLICIES`, or None."""
    for name in POLICY_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "EPLB_POLICIES"):
            return module
    return None


# ---------------------------------------------------------------------- static placement files
def read_static_map(path: str | Path, with_gpus: bool = False):
    """int64 `[layers, P]` from a `moe-place export --engine vllm` file or a `plan` file.

    with_gpus: also return the number of GPUs the placement was made for.
    """
    path = Path(path)
    if not path.exists():
        raise InputError(str(path), "an existing placement file", "no such file")
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise InputError(str(path), "a JSON placement file", f"invalid JSON ({exc.msg})") from None
        if isinstance(data, dict) and data.get("format") == EXPORT_FORMAT:
            phy2log = _int_matrix(data.get("phy2log"), f"{path}: phy2log")
            gpus = data.get("num_gpus")
            if not isinstance(gpus, int) or gpus < 1 or phy2log.shape[1] % gpus:
                raise InputError(f"{path}: num_gpus", f"a divisor of the {phy2log.shape[1]} slots", gpus)
            return (phy2log, gpus) if with_gpus else phy2log
    from moe_place.engines.export import read_plan_placement

    placement = read_plan_placement(path)[0]
    phy2log = np.asarray(placement.phy2log, dtype=np.int64)
    return (phy2log, placement.num_gpus) if with_gpus else phy2log


def _int_matrix(value: Any, where: str) -> np.ndarray:
    arr = np.asarray(value) if value is not None else np.zeros((0,))
    if arr.ndim != 2 or arr.size == 0 or arr.dtype.kind not in "iu":
        raise InputError(where, "a non-empty 2-D list of integer expert ids", f"shape {arr.shape}")
    return arr.astype(np.int64)


def export_document(placement: Placement, layer_ids: tuple[int, ...] = ()) -> dict:
    """The JSON document `moe-place export --engine vllm` writes (read back by `read_static_map`)."""
    phy2log, log2phy, logcnt = (np.asarray(a) for a in _numpy_maps(placement))
    return {
        "format": EXPORT_FORMAT,
        "format_version": 1,
        "usage": (f"{STATIC_PLAN_ENV}=THIS_FILE with the moe-place policy installed "
                  "(moe_place.engines.vllm.install) makes vLLM's EPLB move to this placement at its "
                  "first rebalance and keep it."),
        "num_layers": placement.num_layers,
        "num_logical_experts": placement.num_logical_experts,
        "num_physical_experts": placement.num_physical_experts,
        "num_redundant_experts": placement.num_physical_experts - placement.num_logical_experts,
        "num_gpus": placement.num_gpus,
        "num_nodes": placement.num_nodes,
        "layer_ids": list(layer_ids) or list(range(placement.num_layers)),
        "phy2log": phy2log.tolist(),
        "log2phy": log2phy.tolist(),
        "logcnt": logcnt.tolist(),
    }


def _numpy_maps(placement: Placement) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(phy2log, log2phy padded to R+1 columns as vLLM allocates it, logcnt)` as numpy."""
    width = placement.num_physical_experts - placement.num_logical_experts + 1
    log2phy = np.full(placement.log2phy.shape[:2] + (width,), -1, dtype=np.int64)
    log2phy[..., : placement.log2phy.shape[-1]] = placement.log2phy
    return placement.phy2log, log2phy, placement.logcnt


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
    active: bool = True


def install(policy: type | None = None, name: str = "default", policies: dict | None = None) -> Registration:
    """Register `policy` (default: `make_policy()`) with vLLM under `name`; returns the handle.

    name "default" replaces vLLM's built-in policy in `EPLB_POLICIES` (nothing else changes, and
    vLLM's async mode, validated only for "default", keeps working). Any other name is added to
    `EPLB_POLICIES` and to the `EPLBPolicyOption` literal the config checks, so
    `--eplb-config '{"policy": NAME}'` is accepted. `policies`: the registry dict to patch
    (tests; default: vLLM's). The dict is changed in place: modules that imported it see it.
    """
    module = None
    if policies is None:
        module = policy_module()
        if module is None:
            raise InputError("vllm", "an importable vLLM with EPLB policies (vllm.distributed.eplb.policy)",
                             "not importable")
        policies = module.EPLB_POLICIES
    policy = policy or make_policy()
    handle = Registration(name=name, policy=policy, policies=policies,
                          previous_policy=policies.get(name, _MISSING))
    policies[name] = policy
    if name != "default" and module is not None:
        _widen_policy_option(name, handle)
    return handle


def uninstall(handle: Registration) -> None:
    """Undo `install`: the registry and the config literal are as they were before."""
    if not handle.active:
        return
    if handle.previous_policy is _MISSING:
        handle.policies.pop(handle.name, None)
    else:
        handle.policies[handle.name] = handle.previous_policy
    for owner, attr, old in reversed(handle.option_patches):
        if isinstance(owner, dict):
            owner[attr] = old
        else:
            setattr(owner, attr, old)
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
    """
    name = os.environ.get(PLUGIN_ENV)
    module = policy_module()
    if not name or module is None:
        return
    current = module.EPLB_POLICIES.get(name)
    if isinstance(current, type) and issubclass(current, MoePlaceEplbPolicy):
        return
    install(name=name)


def _widen_policy_option(name: str, handle: Registration) -> None:
    """Add `name` to every `EPLBPolicyOption` literal and to `EPLBConfig.policy`'s annotation."""
    widened = None
    for module_name in OPTION_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        option = getattr(module, "EPLBPolicyOption", None)
        if option is not None:
            args = typing.get_args(option)
            if name not in args:
                widened = typing.Literal[args + (name,)]  # type: ignore[valid-type]
                handle.option_patches.append((module, "EPLBPolicyOption", option))
                module.EPLBPolicyOption = widened
        config = getattr(module, "EPLBConfig", None)
        if config is not None and widened is not None and config not in handle.rebuilt:
            annotations = config.__dict__.get("__annotations__", {})
            if "policy" in annotations:
                handle.option_patches.append((annotations, "policy", annotations["policy"]))
                annotations["policy"] = widened
            fields = getattr(config, "__pydantic_fields__", None)
            if fields and "policy" in fields:
                handle.option_patches.append((fields["policy"], "annotation", fields["policy"].annotation))
                fields["policy"].annotation = widened
            dc_fields = getattr(config, "__dataclass_fields__", None)
            if dc_fields and "policy" in dc_fields:
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
        from pydantic.dataclasses import rebuild_dataclass
    except ImportError:
        return False
    rebuild_dataclass(cls, force=True)
    return True
