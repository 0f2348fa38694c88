"""SGLang with no user code: `MOE_PLACE_SGLANG=1` puts moe-place's rule into every SGLang process.

SGLang 0.5.23 starts its schedulers with the `spawn` start method (`srt/entrypoints/engine.py`) and
builds its `EPLBManager` inside them (`srt/model_executor/model_runner.py`), so a hook installed in
the launching process never reaches them. The wheel installs `moe_place_sglang.pth` at the top of
site-packages; Python runs its one line at the start of every process of that environment, spawned
ones included. Without the variable that line is one dictionary lookup: nothing is imported. With
`MOE_PLACE_SGLANG=1` it calls `register()`, which only adds an import hook (a `sys.meta_path`
finder). Then, when SGLang imports
- `sglang.srt.eplb.eplb_manager` (each scheduler, at start): `EPLBManager.__init__` is wrapped, so
  each manager SGLang builds (with `--enable-eplb` only) is recorded (`sglang_managers.MANAGERS`: its class, model
  config and model getter: where the rule reads the expert size) and imports SGLang's EPLB algorithms at
  once, so the rule is set up and warmed up at start, not in the first rebalance;
- `sglang.srt.eplb.eplb_algorithms`: `moe_place.engines.sglang.install_rebalance_hook()` runs on it (it checks
  the `MOE_PLACE_*` settings: a bad one stops the scheduler at its start);
- with `MOE_PLACE_SPLIT=per-batch`, SGLang's `lp` path as its modules load (`moe_place.engines.sglang_split`):
  `...model_runner_components.moe_ep_setup` (the solver, before SGLang's model runner imports
  `init_lplb_solvers`) and `sglang.srt.eplb.expert_location_dispatch` (the dispatch).
Only then is the rest of moe-place imported. `MOE_PLACE_SGLANG=0` or unset: SGLang's own algorithm.
This module imports nothing of SGLang, and of moe-place only `sglang_managers` (and its guard: standard
library only), at import time.
"""

from __future__ import annotations

import importlib.abc
import os
import sys

from moe_place.engines.sglang_managers import (ALGORITHMS_MODULE, DISPATCH_MODULE, MANAGER_MODULE, SETUP_MODULE,
                                               watch_managers)

__all__ = ["register"]

ENV = "MOE_PLACE_SGLANG"


def register(environ=None) -> bool:
    """Watch SGLang's EPLB imports in this process when `MOE_PLACE_SGLANG` is "1" (True if watching).

    Another value than "1", "0" or empty: one line on stderr, and SGLang's own algorithm stays."""
    value = (os.environ if environ is None else environ).get(ENV, "")
    if value in ("", "0"):
        return False
    if value != "1":
        print(f"moe-place: {ENV}: expected 1 (moe-place's rule) or 0, got {value!r}; SGLang's own EPLB algorithm "
              "stays", file=sys.stderr)
        return False
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    for name, on_import in WATCHED.items():   # already imported (register called late): act now
        if name in sys.modules:
            on_import(sys.modules[name])
    return True


def _on_manager_module(module) -> None:
    watch_managers(module, import_algorithms=True)


def _on_algorithms_module(module) -> None:
    # late on purpose: the adapter (numpy, the rule) loads only when SGLang loads its EPLB algorithms
    from moe_place.engines.sglang import PaybackRebalance, install_rebalance_hook

    if not isinstance(module.rebalance_experts, PaybackRebalance):
        install_rebalance_hook()


def _on_setup_module(module) -> None:
    # late on purpose, as above; MOE_PLACE_SPLIT set to a bad value raises here, as SGLang's runner starts
    from moe_place.engines.batch_split import split_enabled
    from moe_place.engines.sglang_split import SglangSplit, install_setup

    if split_enabled():
        install_setup(SglangSplit(), module)


def _on_dispatch_module(module) -> None:
    from moe_place.engines.batch_split import split_enabled
    from moe_place.engines.sglang_split import SglangSplit, install_dispatch

    if split_enabled():
        install_dispatch(SglangSplit(), module)


WATCHED = {MANAGER_MODULE: _on_manager_module, ALGORITHMS_MODULE: _on_algorithms_module,
           SETUP_MODULE: _on_setup_module, DISPATCH_MODULE: _on_dispatch_module}


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the watched modules with the other finders and hands their loader a second step."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in WATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader, WATCHED[fullname])
        return spec


class _Loader(importlib.abc.Loader):
    """The module's own loader, then `after(module)`; everything else is the own loader's."""

    def __init__(self, loader, after):
        self._loader, self._after = loader, after

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._after(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)
