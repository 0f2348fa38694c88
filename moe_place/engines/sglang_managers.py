"""The EPLB managers SGLang builds in this process, and the names of SGLang's EPLB modules.

A module of its own, importing nothing of moe-place but the guard (standard library only), so that both the
environment hook (`sglang_startup`, which runs in every process) and the adapter (`sglang`) can use it without
importing each other.
"""

from __future__ import annotations

import functools
import importlib

from moe_place.engines.guard import Guard

__all__ = ["watch_managers"]

ALGORITHMS_MODULE = "sglang.srt.eplb.eplb_algorithms"
MANAGER_MODULE = "sglang.srt.eplb.eplb_manager"
SETUP_MODULE = "sglang.srt.model_executor.model_runner_components.moe_ep_setup"   # the lp path's solvers
DISPATCH_MODULE = "sglang.srt.eplb.expert_location_dispatch"                      # ... and its dispatch
MANAGERS: list[tuple[type, object, object]] = []   # (class, model_config, get_model) of each EPLBManager built, newest last
KEEP_MANAGERS = 8
GUARD = Guard("SGLang")   # the manager wrapper's: its recording never stops SGLang's manager


def watch_managers(module, import_algorithms: bool = False) -> bool:
    """Wrap `module.EPLBManager.__init__` to record each manager (`MANAGERS`) and, with `import_algorithms`,
    import SGLang's EPLB algorithms right after (where the hook installs: a configuration error it raises stops
    the scheduler at its start, on purpose); False if already wrapped."""
    manager = getattr(module, "EPLBManager", None)
    init = getattr(manager, "__init__", None)
    if init is None or getattr(init, "moe_place_wraps", None) is not None:
        return False

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        GUARD.call("sglang.manager", lambda: _record(self, kwargs), lambda: None)
        if import_algorithms:
            importlib.import_module(ALGORITHMS_MODULE)   # the hook is installed (and warmed up) at start

    __init__.moe_place_wraps = init
    __init__.moe_place_entry = "sglang.manager"
    manager.__init__ = __init__
    return True


def _record(manager, kwargs: dict) -> None:
    MANAGERS.append((type(manager), kwargs.get("model_config"), kwargs.get("get_model")))
    del MANAGERS[:-KEEP_MANAGERS]
