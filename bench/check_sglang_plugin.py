"""Check moe-place's SGLang plugin against a real SGLang (0.5.23): the environment hook in spawned processes,
and the elastic case handed back to SGLang's own algorithm.

Run it with the Python of an environment where SGLang is installed and moe-place is installed too (the
`.pth` file the hook starts from lives in site-packages: PYTHONPATH overlays do not run `.pth` files). To
leave the SGLang environment as it is, layer a scratch environment over it:

    python3 -m venv /tmp/sgl-layer     # the same base Python as SGLang's environment
    echo /path/to/sglang-venv/lib/python3.11/site-packages > /tmp/sgl-layer/lib/python3.11/site-packages/zz_sglang.pth
    /tmp/sgl-layer/bin/pip install --no-deps .        # moe-place, with its moe_place_sglang.pth
    /tmp/sgl-layer/bin/python bench/check_sglang_plugin.py

Checks (each printed PASS/FAIL; exit status 1 if any fails):
1. a process spawned with multiprocessing's spawn method (as SGLang's `srt/entrypoints/engine.py` starts its
   schedulers) with `MOE_PLACE_SGLANG=1` imports SGLang's real `sglang.srt.eplb.eplb_manager`, builds an
   `EPLBManager` (the hook installs there) and finds `eplb_algorithms.rebalance_experts` to be moe-place's
   `PaybackRebalance`; without the variable, and with it set to 0, SGLang's own function, and no moe-place
   module imported at start;
2. SGLang's `elasticity_aware` algorithm with a rank down (`ElasticEPStateManager` reporting it inactive):
   the hook hands the call to SGLang's own `rebalance_experts`, the answer is SGLang's, and no slot of the
   inactive rank is in `log2phy` (SGLang sends no token there); with every rank up the rule answers.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import types


def _scheduler(queue) -> None:
    at_start = sorted(name for name in sys.modules if name.startswith("moe_place"))
    from sglang.srt.eplb import eplb_manager

    manager = eplb_manager.EPLBManager.__new__(eplb_manager.EPLBManager)   # __init__ needs a running server:
    try:                                                                     # the wrapper runs before it fails
        eplb_manager.EPLBManager.__init__(manager, model_config=None, get_model=lambda: None,
                                          get_expert_location_updater=None, get_expert_backup_client=None,
                                          get_weight_updater=None)
    except Exception:  # noqa: BLE001 - no server context in this process
        pass
    from sglang.srt.eplb import eplb_algorithms

    queue.put({"at_start": at_start, "rule": type(eplb_algorithms.rebalance_experts).__name__,
               "wrapped": getattr(eplb_manager.EPLBManager.__init__, "moe_place_wraps", None) is not None,
               "adapter": "moe_place.engines.sglang" in sys.modules})


def spawned(value: str | None) -> dict:
    if value is None:
        os.environ.pop("MOE_PLACE_SGLANG", None)
    else:
        os.environ["MOE_PLACE_SGLANG"] = value
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_scheduler, args=(queue,))
    process.start()
    report = queue.get(timeout=600)
    process.join(timeout=120)
    report["exitcode"] = process.exitcode
    return report


def elastic() -> dict:
    import numpy as np
    import torch
    from sglang.srt.elastic_ep import elastic_ep
    from sglang.srt.eplb import eplb_algorithms

    from moe_place.engines import sglang as adapter
    from moe_place.engines.config import EngineConfig

    own = eplb_algorithms.rebalance_experts
    layers, experts, gpus, per_gpu = 2, 16, 4, 6
    physical = gpus * per_gpu
    tokens = torch.from_numpy(np.random.default_rng(0).integers(0, 500, size=(20, layers, experts)))
    trivial = torch.arange(physical).repeat(layers, 1) % experts
    hook = adapter.PaybackRebalance(EngineConfig(), current_map=lambda: trivial, interval=lambda: 20,
                                    migration=lambda: "stall", engine_model=lambda *a: None)
    handle = adapter.install_rebalance_hook(hook)
    saved = elastic_ep.ElasticEPStateManager._instance
    out = {}
    try:
        for name, active in (("down", [1, 1, 0, 1]), ("up", [1, 1, 1, 1])):
            elastic_ep.ElasticEPStateManager._instance = types.SimpleNamespace(
                active_ranks=torch.tensor(active, dtype=torch.int32))
            before = hook.handed_back
            got = eplb_algorithms.rebalance_experts(tokens, physical, per_gpu, None, 1,
                                                    eplb_algorithms.EplbAlgorithm.elasticity_aware)
            sglangs = own(tokens, physical, per_gpu, None, 1, eplb_algorithms.EplbAlgorithm.elasticity_aware)
            slots = got[1][got[1] >= 0].tolist()
            down = {s for r, a in enumerate(active) if not a for s in range(r * per_gpu, (r + 1) * per_gpu)}
            out[name] = {"handed_back": hook.handed_back - before, "same_as_sglang": all(
                torch.equal(a, b) for a, b in zip(got, sglangs)), "on_inactive": sorted(set(slots) & down)}
    finally:
        elastic_ep.ElasticEPStateManager._instance = saved
        adapter.uninstall_rebalance_hook(handle)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.parse_args(argv)
    try:
        import sglang
    except ImportError:
        print(f"check_sglang_plugin: SGLang is not importable in this Python ({sys.executable}): run it with the "
              "Python of an environment that has SGLang and moe-place (see --help)", file=sys.stderr)
        return 2
    print(f"SGLang {sglang.__version__} from {os.path.dirname(sglang.__file__)}; Python {sys.executable}")
    lines = []
    on = spawned("1")
    lines.append((on["exitcode"] == 0 and on["rule"] == "PaybackRebalance" and on["wrapped"],
                  f"MOE_PLACE_SGLANG=1, spawned process: rebalance_experts is {on['rule']}, EPLBManager wrapped "
                  f"{on['wrapped']}, moe-place modules at start {on['at_start']}"))
    for value in (None, "0"):
        off = spawned(value)
        lines.append((off["exitcode"] == 0 and off["rule"] == "function" and not off["at_start"]
                      and not off["adapter"], f"MOE_PLACE_SGLANG={value or '(unset)'}, spawned process: "
                      f"rebalance_experts is SGLang's {off['rule']}, moe-place modules at start {off['at_start']}, "
                      f"adapter imported {off['adapter']}"))
    os.environ.pop("MOE_PLACE_SGLANG", None)
    result = elastic()
    down, up = result["down"], result["up"]
    lines.append((down["handed_back"] == 1 and down["same_as_sglang"] and not down["on_inactive"],
                  f"elasticity_aware, rank 2 down: handed back to SGLang {down['handed_back']}x, answer is SGLang's "
                  f"{down['same_as_sglang']}, log2phy slots on the inactive rank {down['on_inactive'] or 'none'}"))
    lines.append((up["handed_back"] == 0, f"elasticity_aware, every rank up: the rule answered (handed back "
                                          f"{up['handed_back']}x)"))
    for passed, line in lines:
        print(f"{'PASS' if passed else 'FAIL'}  {line}")
    # imported here, not at the top: a spawned child re-runs this module's top, and must start without moe_place
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from records import missed_targets

    return missed_targets("check_sglang_plugin", [line for passed, line in lines if not passed])


if __name__ == "__main__":
    sys.exit(main())
