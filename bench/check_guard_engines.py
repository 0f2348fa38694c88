"""Check in the real engines' code that moe-place's adapters never take a server down (`moe_place.engines.guard`).

Run it with an engine's Python and the overlay of this checkout (`bench/engine_overlay.sh`):

    bash bench/engine_overlay.sh /work/engine-venvs/vllm/bin/python /tmp/overlay-vllm
    PYTHONPATH=/tmp/overlay-vllm /work/engine-venvs/vllm/bin/python bench/check_guard_engines.py --engine vllm \
        --out bench/results/guard_engines_vllm.json --force
    bash bench/engine_overlay.sh /work/engine-venvs/sglang/bin/python /tmp/overlay-sglang
    PYTHONPATH=/tmp/overlay-sglang /work/engine-venvs/sglang/bin/python bench/check_guard_engines.py --engine sglang \
        --out bench/results/guard_engines_sglang.json --force

Each prints its checks; `--out` writes the record (bench/results/guard_engines_{engine}.json). The checks are those
of tests/test_engines_guard.py (which runs them on the stand-ins, bench/inengine/standins.py), here in the engines'
own rebalance code as bench/inengine/harness.py drives it on a CPU (`run_engine`: what runs in the engine's code and
what is stood in is said in its module note). One process; the size: 2 MoE layers, 32 experts on 40 slots, 8 GPUs
on one node, 512 tokens x top-4 per forward pass, a skewed load that changes once (`inengine.harness.skewed_workload`,
seed 0), the engine calling its policy every 200 passes (vLLM: window 100 steps, async; SGLang: buffer 200, all
layers at once), 3 calls. The `MOE_PLACE_*` settings are cleared first: the checks run moe-place's defaults.

vLLM 0.33.0 (`--engine vllm`), in vLLM's code: `EplbState` (`add_model`, `step`, the async worker's
`transfer_run_periodically` calling the policy, the commit one layer per step), `MixtureOfExperts.set_eplb_state`
(which registers the model's expert weights), the policy registry with moe-place's `install()`. Checks: (1) moe-place's
rule raising at every call (`RebalanceRule.decide` raises RuntimeError) runs every map vLLM's default policy runs on
the same load (`run_engine(..., "default", ...)`), step by step, with one warning naming the reason; (2) the rule
raising at its second call only: that call is answered by vLLM's `DefaultEplbPolicy` (its answer is what vLLM ran),
the next by the rule again, one warning; (3) a model whose layers register no expert weight tensors (each layer's
`get_expert_weights()` empty, or tensors of no bytes) starts, with one warning from `add_model`, and the rule answers
every call (priced with the default model). Tried and not drivable: a model whose `expert_weights` holds no layer at
all, or whose reading raises: vLLM's own `add_model` indexes `model.expert_weights[0]` and raises there, with or
without moe-place (the record says what vLLM raised, with each policy).

SGLang 0.5.23 (`--engine sglang`), in SGLang's code: `EPLBManager` (its generator, `rebalance`,
`_compute_update_layer_ids_chunks`), `ExpertLocationMetadata.init_trivial` / `init_by_eplb`,
`eplb_algorithms.rebalance_experts` with moe-place's hook (`install_rebalance_hook`), `ExpertLocationUpdater.update`,
`ElasticEPStateManager` and its `elasticity_aware` algorithm. Checks: (1) and (2) as for vLLM, SGLang's own
`rebalance_experts` answering; (3) a model that registers no expert weight tensors (`routed_experts_weights_of_layer`
empty, or each layer's list empty): the rebalances complete, no warning, no call handed back, the rule answers every
call (priced with the default model; with no layers SGLang updates no layer, so the map stays); (4) elastic EP with
one rank of four left (`ElasticEPStateManager`'s `active_ranks`, the one SGLang's `rebalance_experts` reads): SGLang's
real `rebalance_experts` with `EplbAlgorithm.elasticity_aware` and the hook installed answers what SGLang's own
algorithm answers (the hook hands the call back), every slot on the one rank left, no warning.

Each check prints PASS or FAIL with a one-line detail; exit 1 if any fails.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import traceback
from contextlib import ExitStack, contextmanager
from pathlib import Path
from unittest import mock

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from records import add_record_options, missed_targets, refuse_overwrite, write_record  # noqa: E402

CADENCE = dict(step_interval=200, window=100)
STATIONARY_CALLS, CHANGED_CALLS, SEED = 2, 1, 0
REASON = "moe-place guard check: the rule broke"
ELASTIC_GPUS, ELASTIC_EXPERTS, ELASTIC_LAYERS = 4, 16, 2


def size():
    from inengine.harness import Size

    return Size("guard-1x8-e32", 32, 8, 8, 1, 2, None, 512, 4, "Qwen3-30B-A3B")


class Lines(logging.Handler):
    """The records of moe-place's loggers ("moe_place" and below) while it is attached."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    @property
    def warnings(self) -> list[str]:
        return [f"{r.name}: {r.getMessage()}" for r in self.records if r.levelno >= logging.WARNING]

    def info(self, text: str) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == logging.INFO and text in r.getMessage()]


@contextmanager
def captured():
    """A `Lines` handler on the "moe_place" logger (INFO and up) for the block."""
    logger = logging.getLogger("moe_place")
    handler = Lines()
    level = logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


class Steps:
    """The forward pass the harness is serving (`on_step` is called after each one), for a rule that breaks at
    its n-th engine call: SGLang's runs call the policy again from a copy of its state (`SGLANG_CPU_REPEATS`), so
    the calls are told apart by the pass they run in."""

    def __init__(self):
        self.now = 0

    def on_step(self, step: int) -> None:
        self.now = step + 1


@contextmanager
def broken_rule(break_at=None):
    """`RebalanceRule.decide` raising RuntimeError(REASON): at every call (`break_at` None), or only at the engine's
    call of index `break_at` (0-based; `break_at` is `(Steps, index)`). The rule's run at install (`warm_up`, before
    the engine serves) is left alone: it is no engine's call. Yields a dict: `passes` (the passes the rule was called
    in, in order), `answered` (passes where it returned)."""
    from moe_place.online.policy import RebalanceRule, warm_up

    real = RebalanceRule.decide
    seen = {"passes": [], "answered": []}

    def decide(self, *args, **kwargs):
        if sys._getframe(1).f_code is warm_up.__code__:   # the install-time warm-up, not an engine's call
            return real(self, *args, **kwargs)
        step = None if break_at is None else break_at[0].now
        if step is not None and step not in seen["passes"]:
            seen["passes"].append(step)
        if break_at is None or seen["passes"].index(step) == break_at[1]:
            raise RuntimeError(REASON)
        out = real(self, *args, **kwargs)
        if step not in seen["answered"]:
            seen["answered"].append(step)
        return out

    with mock.patch.object(RebalanceRule, "decide", decide):
        yield seen


@contextmanager
def handles(harness):
    """The handles moe-place's install functions return inside `run_engine` (the policy class, the hook)."""
    got = {}

    def vllm_install(*args, **kwargs):
        got["vllm"] = harness_install(*args, **kwargs)
        return got["vllm"]

    def sglang_install(*args, **kwargs):
        got["sglang"] = harness_hook(*args, **kwargs)
        return got["sglang"]

    harness_install, harness_hook = harness.install, harness.install_rebalance_hook
    with mock.patch.object(harness, "install", vllm_install), \
            mock.patch.object(harness, "install_rebalance_hook", sglang_install):
        yield got


def same_run(run, other) -> tuple[bool, str]:
    """Whether two runs ran the same maps at every step, and the counts."""
    import numpy as np

    same = (len(run.maps) == len(other.maps) and all(np.array_equal(a, b) for a, b in zip(run.maps, other.maps))
            and np.array_equal(run.map_of_step, other.map_of_step))
    return bool(same), f"{len(run.maps)} maps / {len(run.calls)} calls vs {len(other.maps)} / {len(other.calls)}"


def one_warning(lines: Lines, *words: str) -> tuple[bool, str]:
    warned = lines.warnings
    ok = len(warned) == 1 and warned[0].startswith("moe_place.engines: ") and all(w in warned[0] for w in words)
    return ok, f"{len(warned)} warning{'s' if len(warned) != 1 else ''}" + (f" ({warned[0]})" if warned else "")


# ---------------------------------------------------------------------- the checks of both engines
def survived(what: str, check, *args, many: bool = False, **kwargs):
    """`check(*args, **kwargs)`; where an exception escapes the engine's code (a server taken down), one FAIL line
    naming it (a list of one with `many`)."""
    try:
        return check(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the point of the check: this is a server down
        line = (False, f"{what}: an exception reached the engine's caller (the server would go down): "
                       f"{type(exc).__name__}: {exc}")
        return [line] if many else line


def check_raise_every_call(engine: str, harness, workload, default_run, record: dict) -> tuple[bool, str]:
    """(1): the rule raising at every call -> the default policy's maps, step by step, and one warning."""
    with captured() as lines, broken_rule():
        broken = harness.run_engine(engine, "moe-place", size(), workload.counts, CADENCE)
    with captured():
        working = harness.run_engine(engine, "moe-place", size(), workload.counts, CADENCE)
    same, counts = same_run(broken, default_run)
    differs = not same_run(working, default_run)[0]
    warned, said = one_warning(lines, REASON, f"{'vllm.policy' if engine == 'vllm' else 'sglang.rebalance'} failed")
    record["raise_every_call"] = {"warnings": lines.warnings, "calls": len(broken.calls),
                                  "maps": len(broken.maps), "default_maps": len(default_run.maps),
                                  "working_rule_maps": len(working.maps), "working_rule_differs_from_default": differs}
    own = "vLLM's DefaultEplbPolicy" if engine == "vllm" else "SGLang's own rebalance_experts"
    passed = same and warned and len(broken.calls) > 0 and len(default_run.maps) > 1
    return passed, (f"the rule raising at every call ({len(broken.calls)} calls): every map {engine} ran, step by "
                    f"step, is the one it ran with {own} as the policy, on the same load ({counts}; "
                    f"{len(default_run.maps) - 1} map changes; the working rule's run "
                    f"{'differs' if differs else 'does not differ'}); {said}")


def check_raise_once(engine: str, harness, workload, record: dict) -> tuple[bool, str]:
    """(2): the rule raising at its second call only -> that call is the engine's own answer, the next the rule's."""
    import numpy as np

    steps = Steps()
    own_calls = []
    with ExitStack() as stack:
        lines = stack.enter_context(captured())
        got = stack.enter_context(handles(harness))
        seen = stack.enter_context(broken_rule((steps, 1)))
        if engine == "vllm":
            from vllm.distributed.eplb import policy as policy_module

            base = policy_module.DefaultEplbPolicy

            def spy(cls, *args, **kwargs):
                out = base.rebalance_experts(*args, **kwargs)
                own_calls.append((steps.now, np.array(harness._numpy(out), dtype=np.int64)))
                return out

            stack.enter_context(mock.patch.object(policy_module, "DefaultEplbPolicy",
                                                  type("SpiedDefaultEplbPolicy", (base,),
                                                       {"rebalance_experts": classmethod(spy)})))
        else:
            from sglang.srt.eplb import eplb_algorithms

            real = eplb_algorithms.rebalance_experts

            def spy(*args, **kwargs):   # SGLang's own function, which the hook keeps as its fallback
                out = real(*args, **kwargs)
                own_calls.append((steps.now, np.array(harness._numpy(out[0]), dtype=np.int64)))
                return out

            stack.enter_context(mock.patch.object(eplb_algorithms, "rebalance_experts", spy))
        run = harness.run_engine(engine, "moe-place", size(), workload.counts, CADENCE, on_step=steps.on_step)
    calls = run.calls
    broken_pass = seen["passes"][1] if len(seen["passes"]) > 1 else None
    own_passes = sorted({p for p, _ in own_calls})
    answers_own = (len(calls) >= 3 and own_passes == [broken_pass] and calls[1].step == broken_pass
                   and all(np.array_equal(a, calls[1].after) for _, a in own_calls))
    later = [c.step for c in calls[2:]]
    rule_later = bool(later) and all(step in seen["answered"] for step in later)
    if engine == "vllm":
        policy = got["vllm"].policy
        sessions = list(policy._sessions.values())
        session_calls = sessions[0].calls if len(sessions) == 1 else None
        fallbacks = policy._guard.fallbacks.get("vllm.policy", 0)
    else:
        hook = got["sglang"].hook
        sessions = list(hook.sessions.values())
        session_calls = sessions[0].calls if len(sessions) == 1 else None
        fallbacks = hook.guard.fallbacks.get("sglang.rebalance", 0)
    applied = bool(np.array_equal(run.maps[run.map_of_step[-1]], calls[-1].after)) if calls else False
    warned, said = one_warning(lines, REASON)
    record["raise_once"] = {"calls_at": [c.step for c in calls], "broken_pass": broken_pass,
                            "own_algorithm_called_at": [p for p, _ in own_calls], "rule_answered_at": seen["answered"],
                            "session_calls": session_calls, "guard_fallbacks": fallbacks,
                            "warnings": lines.warnings}
    own = "vLLM's DefaultEplbPolicy" if engine == "vllm" else "SGLang's own rebalance_experts"
    expected_session = len(calls) - 1
    passed = answers_own and rule_later and session_calls == expected_session and warned and applied
    return passed, (f"the rule raising at its 2nd call only (calls after passes {[c.step for c in calls]}): that call "
                    f"was answered by {own} (called after pass(es) {own_passes}, its answer the map {engine} got), the "
                    f"rule answered the calls after it ({later}); the rule's session counts {session_calls} answered "
                    f"calls of {len(calls)}; the last map is the last call's: {applied}; {said}")


# ---------------------------------------------------------------------- vLLM
def vllm_checks(harness, workload, default_run, record: dict) -> list[tuple[bool, str]]:
    from inengine import standins
    import torch

    lines = [survived("the rule raising at every call", check_raise_every_call, "vllm", harness, workload,
                      default_run, record),
             survived("the rule raising at its 2nd call only", check_raise_once, "vllm", harness, workload, record)]
    record["no_expert_weights"] = {}
    for variant, tensors in (("each layer registers an empty list", lambda shape, local: []),
                             ("each layer's tensors hold no bytes", lambda shape, local: [
                                 torch.empty(local, 0, dtype=torch.bfloat16, device="meta")])):
        with ExitStack() as stack:
            captured_lines = stack.enter_context(captured())
            got = stack.enter_context(handles(harness))
            stack.enter_context(mock.patch.object(standins, "expert_weight_tensors", tensors))
            error = None
            try:
                run = harness.run_engine("vllm", "moe-place", size(), workload.counts, CADENCE)
            except Exception as exc:  # noqa: BLE001 - a failure here is the finding: reported, not raised
                error, run = f"{type(exc).__name__}: {exc}", None
        if run is None:
            lines.append((False, f"a model whose layers register no expert weights ({variant}): vLLM did not run: "
                                 f"{error}"))
            record["no_expert_weights"][variant] = {"error": error}
            continue
        policy = got["vllm"].policy
        sessions = list(policy._sessions.values())
        session_calls = sessions[0].calls if len(sessions) == 1 else None
        fallbacks = policy._guard.fallbacks.get("vllm.policy", 0)
        active = captured_lines.info("rebalance rule active")
        warned, said = one_warning(captured_lines, "vllm.add_model", "no expert weight tensors")
        unknown = len(active) == 1 and "model unknown" in active[0]
        record["no_expert_weights"][variant] = {"warnings": captured_lines.warnings, "calls": len(run.calls),
                                                "session_calls": session_calls, "guard_fallbacks": fallbacks,
                                                "maps": len(run.maps), "rule_active": active}
        passed = warned and len(run.calls) > 0 and session_calls == len(run.calls) and fallbacks == 0 and unknown
        lines.append((passed, f"a model whose layers register no expert weights ({variant}): vLLM's add_model "
                              f"started it, {said}; the rule answered {session_calls} of {len(run.calls)} calls "
                              f"(none fell back: {fallbacks == 0}), {'model unknown' if unknown else 'NOT unknown'} "
                              f"in its first line, {len(run.maps) - 1} map changes"))
    record["not_driven"] = vllm_not_drivable(harness, workload)
    return lines


def vllm_not_drivable(harness, workload) -> dict:
    """A model whose `expert_weights` holds no layer, or whose reading raises: what vLLM's own `add_model` does with
    each policy (model: the harness's, its `set_eplb_state` (vLLM's) run, then `expert_weights` replaced)."""
    from vllm.model_executor.models.interfaces import MixtureOfExperts

    class Raising(list):
        def __getitem__(self, index):
            raise ZeroDivisionError("reading the expert weights raised")

        def __iter__(self):
            raise ZeroDivisionError("reading the expert weights raised")

    real = MixtureOfExperts.set_eplb_state
    out = {}
    for variant, value in (("expert_weights holds no layer", list), ("reading expert_weights raises", Raising)):
        def set_eplb_state(self, *args, _value=value, **kwargs):
            real(self, *args, **kwargs)
            self.expert_weights = _value()

        out[variant] = {}
        for policy in ("default", "moe-place"):
            with captured() as lines, mock.patch.object(MixtureOfExperts, "set_eplb_state", set_eplb_state):
                try:
                    harness.run_engine("vllm", policy, size(), workload.counts[:1], CADENCE)
                    out[variant][policy] = {"ran": True, "warnings": lines.warnings}
                except Exception as exc:  # noqa: BLE001 - what vLLM raises is the finding
                    frames = traceback.extract_tb(exc.__traceback__)
                    last = max(i for i, f in enumerate(frames) if "site-packages/vllm/" in f.filename)
                    frame = frames[last]
                    out[variant][policy] = {"ran": False, "error": f"{type(exc).__name__}: {exc}",
                                            "raised_in": f"{frame.filename.split('site-packages/')[-1]}:"
                                                         f"{frame.lineno} ({frame.line})",
                                            "moe_place_below_it": any("moe_place" in f.filename
                                                                      for f in frames[last + 1:]),
                                            "warnings": lines.warnings}
    return out


# ---------------------------------------------------------------------- SGLang
def sglang_checks(harness, workload, default_run, record: dict) -> list[tuple[bool, str]]:
    lines = [survived("the rule raising at every call", check_raise_every_call, "sglang", harness, workload,
                      default_run, record),
             survived("the rule raising at its 2nd call only", check_raise_once, "sglang", harness, workload, record)]
    lines += survived("a model with no expert weight tensors", sglang_no_weights, harness, workload, default_run,
                      record, many=True)
    lines += survived("elastic EP with one rank left", sglang_elastic, record, many=True)
    return lines


def sglang_no_weights(harness, workload, default_run, record: dict) -> list[tuple[bool, str]]:
    """(3): SGLang's EPLBManager over a model whose `routed_experts_weights_of_layer` is empty / holds empty lists."""
    from sglang.srt.eplb import eplb_manager

    lines = []
    record["no_expert_weights"] = {}
    layers = size().layers
    for variant, weights in (("no layers", lambda: {}), ("empty layers", lambda: {layer: [] for layer in
                                                                                   range(layers)})):
        base = eplb_manager.EPLBManager

        def __init__(self, *args, _base=base, _weights=weights, **kwargs):
            kwargs["get_model"]().routed_experts_weights_of_layer = _weights()   # the model the harness built
            _base.__init__(self, *args, **kwargs)

        manager = type("EPLBManager", (base,), {"__init__": __init__})
        with ExitStack() as stack:
            captured_lines = stack.enter_context(captured())
            got = stack.enter_context(handles(harness))
            stack.enter_context(mock.patch.object(eplb_manager, "EPLBManager", manager))
            error = None
            try:
                run = harness.run_engine("sglang", "moe-place", size(), workload.counts, CADENCE)
            except Exception as exc:  # noqa: BLE001 - a failure here is the finding: the scheduler would die
                error, run = f"{type(exc).__name__}: {exc}", None
        if run is None:
            lines.append((False, f"a model with no expert weight tensors ({variant}): SGLang's rebalance raised "
                                 f"(the scheduler would die): {error}"))
            record["no_expert_weights"][variant] = {"error": error}
            continue
        hook = got["sglang"].hook
        sessions = list(hook.sessions.values())
        session_calls = sessions[0].calls if len(sessions) == 1 else None
        active = captured_lines.info("rebalance rule active")
        unknown = len(active) == 1 and "model unknown" in active[0]
        changes = len(run.maps) - 1
        record["no_expert_weights"][variant] = {"warnings": captured_lines.warnings, "calls": len(run.calls),
                                                "session_calls": session_calls, "handed_back": hook.handed_back,
                                                "maps": len(run.maps), "rule_active": active,
                                                "steps": len(run.map_of_step)}
        passed = (not captured_lines.warnings and len(run.calls) == len(default_run.calls) > 0
                  and session_calls == len(run.calls) and hook.handed_back == 0 and unknown
                  and len(run.map_of_step) == len(workload.counts))
        where = "SGLang updates no layer: the map stays" if variant == "no layers" else "SGLang updates every layer"
        lines.append((passed, f"a model with no expert weight tensors ({variant}): all {len(run.map_of_step)} passes "
                              f"served, {len(run.calls)} rebalances completed, the rule answered {session_calls} "
                              f"(handed back {hook.handed_back}), {'model unknown' if unknown else 'NOT unknown'} in "
                              f"its first line, {len(captured_lines.warnings)} warnings; {changes} map changes "
                              f"({where})"))
    return lines


def sglang_elastic(record: dict) -> list[tuple[bool, str]]:
    """(4): SGLang's real `rebalance_experts` with `elasticity_aware`, the hook installed, one rank of four up."""
    import numpy as np
    import torch
    from sglang.srt.elastic_ep.elastic_ep import ElasticEPStateManager
    from sglang.srt.eplb import eplb_algorithms

    from moe_place.engines import sglang as adapter

    rng = np.random.default_rng(SEED)
    counts = torch.from_numpy(rng.poisson(30 * np.linspace(4, 1, ELASTIC_EXPERTS),
                                          size=(20, ELASTIC_LAYERS, ELASTIC_EXPERTS)).astype(np.int64))
    physical = ELASTIC_GPUS * ELASTIC_EXPERTS    # room for every expert on the one rank left
    local = physical // ELASTIC_GPUS
    lines = []
    record["elastic"] = {}
    for active in ([0, 0, 0, 1], [1, 0, 0, 0]):
        state = ElasticEPStateManager._build_state(ep_size=ELASTIC_GPUS, device=torch.device("cpu"))
        state.active_ranks.copy_(torch.tensor(active, dtype=torch.int32))
        own = eplb_algorithms.rebalance_experts
        with captured() as captured_lines, mock.patch.object(ElasticEPStateManager, "_instance", state):
            handle = adapter.install_rebalance_hook()
            try:
                seen_by_hook = adapter.sglang_active_ranks()
                answer = eplb_algorithms.rebalance_experts(counts, physical, local, None, 1,
                                                           eplb_algorithms.EplbAlgorithm.elasticity_aware)
                handed_back = handle.hook.handed_back
            finally:
                adapter.uninstall_rebalance_hook(handle)
            expected = own(counts, physical, local, None, 1, eplb_algorithms.EplbAlgorithm.elasticity_aware)
        same = all(torch.equal(a, b) for a, b in zip(answer, expected))
        slots = answer[1][answer[1] >= 0]
        rank = active.index(1)
        on_rank = bool(((slots // local) == rank).all()) and len(slots) > 0
        record["elastic"][str(active)] = {"handed_back": handed_back, "warnings": captured_lines.warnings,
                                          "ranks_of_slots": sorted({int(s) for s in (slots // local).tolist()}),
                                          "hook_saw_active_ranks": None if seen_by_hook is None
                                          else seen_by_hook.tolist()}
        passed = same and handed_back == 1 and on_rank and not captured_lines.warnings
        lines.append((passed, f"elastic EP, active_ranks {active} (ElasticEPStateManager, as SGLang's "
                              f"rebalance_experts reads it): with the hook, SGLang's rebalance_experts("
                              f"elasticity_aware) {'equals' if same else 'DIFFERS from'} SGLang's own algorithm's "
                              f"answer (handed back {handed_back}), {len(slots)} slots in use over "
                              f"{ELASTIC_LAYERS} layers, all on rank {rank}: {on_rank}; "
                              f"{len(captured_lines.warnings)} warnings"))
    return lines


# ---------------------------------------------------------------------- the record
def warnings_seen(details: dict, prefix: str = "") -> dict:
    """`{check path: moe-place's warning lines}` of every "warnings" list in `details` (nested by variant)."""
    out = {}
    for key, value in details.items():
        if key == "warnings" and isinstance(value, list):
            out[prefix or "-"] = value
        elif isinstance(value, dict):
            out.update(warnings_seen(value, f"{prefix}/{key}" if prefix else key))
    return out


def checkout() -> dict:
    """The commit this ran at, and whether moe-place's or this script's files had changes not in it."""
    from inengine import harness

    return harness.checkout("bench/check_guard_engines.py", "bench/inengine/harness.py", "bench/inengine/standins.py")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--engine", choices=("vllm", "sglang"), help="the engine whose code runs (required)")
    add_record_options(parser, committed=("bench/results/guard_engines_vllm.json",
                                          "bench/results/guard_engines_sglang.json"))
    args = parser.parse_args(argv)
    refuse_overwrite(parser, args)
    if args.engine is None:
        parser.error("--engine: expected vllm or sglang")
    try:
        engine_module = __import__(args.engine)
    except ImportError:
        print(f"check_guard_engines: {args.engine} is not importable in this Python ({sys.executable}): run it "
              "with the engine's Python and the overlay (see --help)", file=sys.stderr)
        return 2
    cleared = sorted(name for name in os.environ if name.startswith("MOE_PLACE_"))
    for name in cleared:
        del os.environ[name]
    from inengine import harness

    started = time.perf_counter()
    workload = harness.skewed_workload(size(), args.engine, CADENCE["step_interval"], STATIONARY_CALLS,
                                       CHANGED_CALLS, seed=SEED)
    with captured():
        default_run = harness.run_engine(args.engine, "default", size(), workload.counts, CADENCE)
    record_extra: dict = {}
    checks = (vllm_checks if args.engine == "vllm" else sglang_checks)(harness, workload, default_run, record_extra)
    wall = time.perf_counter() - started
    for passed, line in checks:
        print(f"{'PASS' if passed else 'FAIL'}  {line}")
    not_run = []
    for variant, by_policy in record_extra.get("not_driven", {}).items():
        said = "; ".join(f"{policy}: " + ("ran" if r["ran"] else f"{r['error']} at {r['raised_in']}"
                                          + (", moe-place's code below it" if r["moe_place_below_it"] else ""))
                         for policy, r in by_policy.items())
        if any(r["ran"] for r in by_policy.values()):
            not_run.append(f"NOTE  a model whose {variant} ran in vLLM with some policy, not checked here ({said})")
        else:
            not_run.append(f"NOT RUN  a model whose {variant}: vLLM's own add_model does not start it, with either "
                           f"policy ({said})")
        print(not_run[-1])
    paragraphs = __doc__.split("\n\n")
    s = size()
    record = {
        "command": ["bench/check_guard_engines.py", "--engine", args.engine],
        "engine": args.engine, "version": engine_module.__version__, "python": sys.executable,
        **checkout(),
        "wall_s": round(wall, 1),
        "ran_in_the_engine": next(p for p in paragraphs if p.startswith({"vllm": "vLLM", "sglang": "SGLang"}[
            args.engine])),
        "size": {"experts": s.experts, "slots": s.physical, "gpus": s.gpus, "nodes": s.nodes, "layers": s.layers,
                 "tokens": s.tokens, "top_k": s.top_k, "model": s.model},
        "cadence": CADENCE, "workload": workload.description, "moe_place_settings_cleared": cleared,
        "checks": [{"passed": bool(passed), "check": line} for passed, line in checks],
        "not_run": not_run,   # tried in the engine's code and not drivable there (the module note says why)
        "warnings": warnings_seen(record_extra),
        "details": record_extra,
    }
    if args.output_json:
        write_record(args.output_json, record)
        print(f"wrote {args.output_json}")
    return missed_targets("check_guard_engines", [line for passed, line in checks if not passed])


if __name__ == "__main__":
    sys.exit(main())
