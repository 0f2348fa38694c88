"""TensorRT-LLM's imbalance ratio beside balancedness in `analyze` and `evaluate` (`moe_place.analysis.imbalance`).

The reference is `examples/wide_ep/ep_load_balancer/report_load_statistics.py` (NVIDIA/TensorRT-LLM at f00d21a,
its projection of a map at aa71b35): per layer, for each iteration `max / mean - 1` over the ranks (or slots),
averaged over the iterations; the "average" row is the mean over layers. The loops below restate that
formula element by element, apart from the vectorised code under test.
"""

import json
from pathlib import Path

import numpy as np
import pytest

from moe_place.analysis.imbalance import contiguous_imbalance, imbalance_ratio, placement_imbalance
from moe_place.cli.main import main
from moe_place.placement import Placement
from moe_place.traces.load import load_trace

BUNDLED = Path(__file__).resolve().parents[1] / "traces" / "data" / "qwen3-30b-a3b_prefill_topk.npz"


def _report_load_statistics(counts: np.ndarray, phy2log: np.ndarray, ep_size: int) -> tuple[float, float]:
    """(by rank, by slot) as the script computes them, one layer and one iteration at a time."""
    by_rank, by_slot = [], []
    for layer in range(counts.shape[1]):
        replicas = np.bincount(phy2log[layer], minlength=counts.shape[2])
        rank_ratios, slot_ratios = [], []
        for it in range(counts.shape[0]):
            slots = (counts[it, layer] / replicas)[phy2log[layer]]
            ranks = slots.reshape(ep_size, -1).sum(axis=1)
            rank_ratios.append(ranks.max() / ranks.mean() - 1)
            slot_ratios.append(slots.max() / slots.mean() - 1)
        by_rank.append(np.mean(rank_ratios))
        by_slot.append(np.mean(slot_ratios))
    return float(np.mean(by_rank)), float(np.mean(by_slot))


def test_worked_by_hand():
    loads = np.array([[[4.0, 0, 0, 0]], [[1.0, 1, 1, 1]]])       # 2 iterations, 1 layer, 4 units
    assert imbalance_ratio(loads).tolist() == [1.5]               # (3 + 0) / 2
    idle = np.concatenate([loads[:1], np.zeros((1, 1, 4)), loads[1:]])
    assert imbalance_ratio(idle).tolist() == [1.5]                # an idle iteration has no ratio: left out
    assert np.isnan(imbalance_ratio(np.zeros((2, 1, 4)))).all()
    counts = np.array([[[4, 2, 1, 1]]])
    result = contiguous_imbalance(counts, 2)                      # ranks 6, 2: mean 4
    assert (result.by_rank.tolist(), result.by_slot.tolist()) == ([0.5], [1.0])
    replicated = placement_imbalance(Placement(np.array([[0, 1, 2, 0, 3, 1]]), 4, 2), counts)
    # experts 0 and 1 have two replicas: slots 2, 1, 1 | 2, 1, 1 -> ranks 4 | 4; slots: max 2, mean 8/6
    assert replicated.by_rank.tolist() == [0.0] and replicated.by_slot[0] == pytest.approx(0.5)


def test_analyze_reports_the_scripts_figures_per_ep_size(capsys):
    trace = load_trace(BUNDLED)
    assert main(["analyze", str(BUNDLED), "--ep", "8,32", "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    contiguous = np.tile(np.arange(128), (48, 1))
    for point in report["ep"]:
        by_rank, by_slot = _report_load_statistics(trace.step_counts(), contiguous, point["ep_size"])
        assert point["trtllm_imbalance_by_rank"] == pytest.approx(by_rank, abs=1e-6)
    assert report["trtllm_imbalance_by_slot"] == pytest.approx(by_slot, abs=1e-6)
    assert main(["analyze", str(BUNDLED), "--ep", "32"]) == 0
    table = capsys.readouterr().out
    row = [line for line in table.splitlines() if line.lstrip().startswith("32 ")][-1]  # the EP sweep's row
    assert f"{report['ep'][1]['trtllm_imbalance_by_rank']:.3f}" in row and "TRT imb" in table


def test_evaluate_reports_them_for_the_plan_on_the_judged_steps(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert main(["plan", str(BUNDLED), "--gpus", "16", "--redundant", "16", "--steps", "0,1", "--out", str(plan),
                 "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["evaluate", str(plan), str(BUNDLED), "--steps", "2", "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    phy2log = np.array(json.loads(plan.read_text())["phy2log"])
    by_rank, by_slot = _report_load_statistics(load_trace(BUNDLED).step_counts()[2:], phy2log, 16)
    assert report["trtllm_imbalance"]["by_rank"] == pytest.approx(by_rank, abs=1e-6)
    assert report["trtllm_imbalance"]["by_slot"] == pytest.approx(by_slot, abs=1e-6)
    assert len(report["trtllm_imbalance"]["by_rank_layers"]) == 48
    assert main(["evaluate", str(plan), str(BUNDLED), "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert f"by rank {by_rank:.4f}, by slot {by_slot:.4f}" in out and "mean balancedness" in out
