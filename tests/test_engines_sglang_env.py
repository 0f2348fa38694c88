"""SGLang with no user code: `MOE_PLACE_SGLANG=1` in the environment, the rule in every SGLang process.

SGLang 0.5.23 starts its schedulers with multiprocessing's spawn method and builds its `EPLBManager`
there. These tests spawn a process the same way, against the stand-in SGLang module layout written to
disk (`bench/inengine/standins.py` `write_sglang_tree`), and look for the rule there: with the variable
and not without. They need moe-place installed (`pip install -e .`, as CI does): the `.pth` file that
starts the hook lives in site-packages.
"""

import multiprocessing
import site
import sys
import sysconfig
from pathlib import Path

import pytest

from bench_modules import load

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
PTH = "moe_place_sglang.pth"


def _site_dirs() -> list[Path]:
    dirs = {sysconfig.get_paths()["purelib"], *getattr(site, "getsitepackages", lambda: [])()}
    return [Path(d) for d in dirs]


def test_the_installed_environment_has_the_pth_at_the_top_of_site_packages():
    found = [d / PTH for d in _site_dirs() if (d / PTH).exists()]
    assert found, f"{PTH} is not in {_site_dirs()}: reinstall moe-place (pip install -e .)"
    assert found[0].read_text() == (ROOT / PTH).read_text()
    line = found[0].read_text().strip()
    assert "\n" not in line and line.startswith("import ")   # site.py runs such a line at every start


def _scheduler(tree: str, queue) -> None:
    """What a spawned SGLang scheduler does, in order: SGLang's EPLB manager module at import, a manager
    built (with --enable-eplb), then a rebalance through `eplb_algorithms.rebalance_experts`."""
    at_start = sorted(name for name in sys.modules if name.startswith("moe_place"))
    sys.path.insert(0, tree)
    import torch

    from sglang.srt.eplb import eplb_manager, expert_location

    layers, experts, gpus, physical = 2, 16, 4, 20
    model = type("Model", (), {"routed_experts_weights_of_layer": {
        layer: [torch.empty(physical // gpus, 6, 1024, dtype=torch.bfloat16, device="meta")] for layer in range(layers)}})()
    config = type("ModelConfig", (), {"model_path": "spawned/test-model", "hf_config": None})()
    eplb_manager.EPLBManager(model_config=config, get_model=lambda: model)
    adapter_at_manager = "moe_place.engines.sglang" in sys.modules
    from sglang.srt.eplb import eplb_algorithms

    expert_location.metadata = type("Metadata", (), {
        "physical_to_logical_map_cpu": torch.arange(physical).repeat(layers, 1) % experts})()
    counts = torch.randint(0, 50, (8, layers, experts), generator=torch.Generator().manual_seed(0))
    phy2log, _, _ = eplb_algorithms.rebalance_experts(counts, physical, physical // gpus, None, 1,
                                                      eplb_algorithms.EplbAlgorithm.deepseek)
    hook = eplb_algorithms.rebalance_experts
    sessions = getattr(hook, "sessions", {})
    queue.put({"at_start": at_start, "adapter_at_manager": adapter_at_manager,
               "rule": type(hook).__name__, "sessions": len(sessions),
               "expert_bytes": [s.engine.expert_bytes for s in sessions.values() if s.engine is not None],
               "adapter_loaded": "moe_place.engines.sglang" in sys.modules, "shape": list(phy2log.shape)})


def _spawn(tmp_path, monkeypatch, value: str | None) -> dict:
    tree = tmp_path / "tree"
    load("inengine.standins").write_sglang_tree(tree)
    if value is None:
        monkeypatch.delenv("MOE_PLACE_SGLANG", raising=False)
    else:
        monkeypatch.setenv("MOE_PLACE_SGLANG", value)
    context = multiprocessing.get_context("spawn")   # as SGLang's engine.py sets it
    queue = context.Queue()
    process = context.Process(target=_scheduler, args=(str(tree), queue))
    process.start()
    try:
        report = queue.get(timeout=120)
    finally:
        process.join(timeout=60)
    assert process.exitcode == 0
    return report


def test_a_spawned_scheduler_runs_the_rule_with_the_variable(tmp_path, monkeypatch):
    report = _spawn(tmp_path, monkeypatch, "1")
    # at start only the hook's own small modules (the guard: standard library only); the adapter when SGLang
    # builds its EPLB manager
    assert report["at_start"] == ["moe_place", "moe_place.engines", "moe_place.engines.guard",
                                  "moe_place.engines.sglang_managers", "moe_place.engines.sglang_startup"]
    assert report["adapter_at_manager"] and report["rule"] == "PaybackRebalance"
    assert report["sessions"] == 1 and report["shape"] == [2, 20]
    assert report["expert_bytes"] == [6 * 1024 * 2]   # the engine's tensors, not a preset's


@pytest.mark.parametrize("value", [None, "0"])
def test_a_spawned_scheduler_keeps_sglangs_algorithm_without_it(tmp_path, monkeypatch, value):
    report = _spawn(tmp_path, monkeypatch, value)
    assert report["at_start"] == []   # the .pth line imported nothing
    assert report["rule"] == "function" and not report["adapter_loaded"] and report["shape"] == [2, 20]


def test_another_value_is_one_line_and_sglangs_algorithm(capsys):
    from moe_place.engines import sglang_startup

    assert sglang_startup.register({"MOE_PLACE_SGLANG": "yes"}) is False
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "MOE_PLACE_SGLANG" in err and "'yes'" in err
    assert sglang_startup.register({}) is False and sglang_startup.register({"MOE_PLACE_SGLANG": "0"}) is False
