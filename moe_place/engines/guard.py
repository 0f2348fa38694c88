"""Never take a server down: every moe-place function an engine calls answers with the engine's own result
when moe-place fails.

The engines call moe-place from inside their serving loop (vLLM's EPLB step, its async worker and its
router; SGLang's scheduler, its EPLB manager and its top-k). An exception there is the engine's exception:
SGLang's scheduler process dies, and the server with it. So each such function is wrapped once
(`Guard.call` around its body): an exception inside it (the rule, the load estimate, the
probes of the engine's state, the per-batch split) logs one warning with the reason and returns what the
engine's own code returns for that call (`ENTRY_POINTS`: each entry and its fallback). A reason is said
once per process and entry (not once per call: a server would flood its log), at most `MAX_REASONS` reasons
per entry. Configuration errors are not caught here: the adapters read and check the `MOE_PLACE_*` settings
where they install (`moe_place.engines.vllm.register_plugin`, `moe_place.engines.sglang.install_rebalance_hook`,
the SGLang start-up hook), before the engine serves, and an error there stops the server at start with one
line.

A function the adapters install into an engine carries `moe_place_entry` (its entry's name; the policy
classes and the hook object call their own guard): tests/test_engines_guard.py lists what the adapters install
into the engines, checks that every piece names an entry and that every entry falls back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, TypeVar

__all__ = ["Guard", "ensure_handler"]

LOG = logging.getLogger("moe_place.engines")
MAX_REASONS = 8   # distinct reasons logged per entry; then one line says the rest are not

T = TypeVar("T")

# The functions the engines call, and what answers when one fails (the engine's own code for that call).
ENTRY_POINTS = {
    "vllm.policy": "vLLM's default EPLB policy (DefaultEplbPolicy) answers the call",
    "vllm.add_model": "the model is recorded as unknown (the rule prices copies with the configured model)",
    "vllm.router": "vLLM's own replica choice (eplb_map_to_physical_and_record) maps the layer's tokens",
    "vllm.commit": "the layer's split keeps its flag (vLLM's own commit has run)",
    "sglang.rebalance": "SGLang's own rebalance_experts answers the call",
    "sglang.manager": "SGLang's EPLBManager is built as SGLang builds it (not recorded)",
    "sglang.lplb_solve": "SGLang's dynamic dispatch (a uniform replica per dispatch) maps the layer's tokens",
    "sglang.lplb_dispatch": "SGLang's dynamic dispatch (a uniform replica per dispatch) maps the layer's tokens",
    "sglang.lplb_init": "every layer's split stays off (SGLang's dynamic dispatch)",
}


def ensure_handler() -> None:
    """Show moe-place's INFO and WARNING lines: to stderr when nothing is set up to show them (vLLM
    configures only its own loggers)."""
    if not LOG.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        LOG.addHandler(handler)
    if LOG.getEffectiveLevel() > logging.INFO:
        LOG.setLevel(logging.INFO)


@dataclass
class Guard:
    """The reasons one adapter has logged (each once) and how many calls fell back, per entry.

    engine: the engine's name, for the log line.
    """

    engine: str
    said: dict = field(default_factory=dict)          # entry -> set of reasons logged
    fallbacks: dict = field(default_factory=dict)     # entry -> calls answered by the engine's own code

    def call(self, entry: str, run: Callable[[], T], fallback: Callable[[], T] | None) -> T:
        """`run()`, or, when it raises an `Exception`, one warning (once per reason) and `fallback()`. fallback
        None: there is no engine to answer (moe-place called outside one), and the exception propagates."""
        if entry not in ENTRY_POINTS:
            raise KeyError(f"not an entry point: {entry}")
        try:
            return run()
        except Exception as exc:  # noqa: BLE001 - the point: no exception of ours reaches the engine
            if fallback is None:
                raise
            self.fallbacks[entry] = self.fallbacks.get(entry, 0) + 1
            self.warn(entry, f"{type(exc).__name__}: {exc}")
            return fallback()

    def warn(self, entry: str, reason: str) -> None:
        """Log `reason` for `entry` once (at most `MAX_REASONS` reasons per entry, then one line saying so)."""
        said = self.said.setdefault(entry, set())
        if reason in said or len(said) > MAX_REASONS:
            return
        said.add(reason)
        ensure_handler()
        if len(said) > MAX_REASONS:
            LOG.warning("moe-place: %s %s: more reasons than %d; not logging them (%s)", self.engine, entry,
                        MAX_REASONS, ENTRY_POINTS[entry])
            return
        LOG.warning("moe-place: %s %s failed (%s); %s", self.engine, entry, reason, ENTRY_POINTS[entry])
