"""`--top-k` and `--keep-dense-layers` reach the loader in every command that reads a trace."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from moe_place.cli.main import main  # noqa: E402

LAYERS, DENSE, LOGICAL = 4, 1, 8


@pytest.fixture
def stat_dump(tmp_path):
    """An SGLang `stat`-mode dump (count only, no top_k): layer 0 dense (all zero), 6 steps."""
    rng = np.random.default_rng(0)
    counts = np.zeros((6, LAYERS, LOGICAL), dtype=np.int32)
    for step in range(6):
        for layer in range(DENSE, LAYERS):
            for _ in range(40):  # 40 tokens, 2 distinct experts each
                counts[step, layer, rng.choice(LOGICAL, 2, replace=False)] += 1
    path = tmp_path / "expert_distribution_recorder_1.0.pt"
    torch.save({"rank": 0, "logical_count": torch.from_numpy(counts), "average_utilization_rate_over_window": None},
               path)
    return path


def test_replay_takes_trace_options(stat_dump, capsys):
    argv = ["replay", str(stat_dump), "--gpus", "2", "--controller", "static", "--format", "json", "--no-per-step"]
    assert main(argv + ["--top-k", "2"]) == 0
    dropped = json.loads(capsys.readouterr().out)
    assert main(argv + ["--top-k", "2", "--keep-dense-layers"]) == 0
    kept = json.loads(capsys.readouterr().out)
    assert dropped["layers"] == LAYERS - DENSE and kept["layers"] == LAYERS


def test_evaluate_takes_trace_options(stat_dump, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert main(["plan", str(stat_dump), "--gpus", "2", "--top-k", "2", "--out", str(plan)]) == 0
    capsys.readouterr()
    argv = ["evaluate", str(plan), str(stat_dump), "--format", "json", "--top-k", "2"]
    assert main(argv) == 0
    dropped = json.loads(capsys.readouterr().out)
    # the kept dense layer is not one of the plan's layers: the same layers are judged
    assert main(argv + ["--keep-dense-layers"]) == 0
    assert json.loads(capsys.readouterr().out) == dropped
