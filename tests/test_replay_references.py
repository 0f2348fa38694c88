"""The replay's step callback, its plot and progress line, and the replay bench's hot-spot lifetimes."""

import numpy as np

from moe_place.cost.cluster import cluster_cost
from moe_place.online.controller import StaticController
from moe_place.online.replay import initial_placement, replay

LAYERS, EXPERTS, GPUS = 2, 8, 4
PHYSICAL = EXPERTS + GPUS


def _cost():
    return cluster_cost(GPUS, 1, "H100", "Qwen3-30B-A3B")


def _two_regimes(steps_each=12, seed=0):
    """Counts `[2 * steps_each, layers, E]`: one hot expert per layer, then another one."""
    rng = np.random.default_rng(seed)
    base = rng.integers(50, 60, (LAYERS, EXPERTS)).astype(np.int64)
    first, second = base.copy(), base.copy()
    first[:, 1] += 900
    second[:, 6] += 900
    return np.concatenate([np.repeat(first[None], steps_each, 0), np.repeat(second[None], steps_each, 0)])


def test_on_step_sees_every_step_in_order():
    counts = _two_regimes(steps_each=5)
    start = initial_placement(counts, GPUS, PHYSICAL)
    seen = []
    replay(counts, StaticController(), _cost(), start, on_step=seen.append)
    assert seen == list(range(len(counts)))


def test_cli_replay_plot_and_progress(tmp_path, capsys, monkeypatch):
    import sys

    from moe_place.cli.main import main

    png = tmp_path / "replay.png"
    argv = ["replay", "--synthetic", "drift:steps=120,layers=2,experts=16,tokens=256,seed=0", "--gpus", "4",
            "--controller", "ours", "--window", "40", "--step-interval", "40"]
    assert main(argv + ["--plot", str(png)]) == 0
    err = capsys.readouterr().err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "\r" not in err  # stderr is not a terminal here: no progress bar in a log
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert main(argv) == 0
    assert capsys.readouterr().err.rstrip().endswith("replay ours [" + "#" * 30 + "] 120/120 steps")
    assert main(argv + ["--no-progress"]) == 0
    assert capsys.readouterr().err == ""


def test_bench_hot_spot_lifetimes_on_a_known_trace():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "bench_replay.py"
    spec = importlib.util.spec_from_file_location("bench_replay_hot", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    counts = np.full((300, 1, 4), 10)
    counts[100:140, 0, 0] = 1000  # one expert hot for 40 steps
    # hot while any of the 16 steps in the smoothing window is hot: 40 + 16 - 1 windows, one run
    assert bench.hot_spot_steps(counts) == {"runs": 1, "median": 55.0, "mean": 55.0, "p90": 55.0}
    assert bench.hot_spot_steps(np.full((50, 2, 4), 10)) == {"runs": 0}
