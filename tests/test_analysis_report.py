"""The analyzer's combined report and its JSON form on small traces built here."""

import json

import numpy as np
import pytest

from moe_place.analysis.report import analysis_to_json, analyze_trace, default_window_steps
from moe_place.errors import InputError
from moe_place.traces.model import Trace, TraceMeta


def count_trace(counts, top_k=2, layer_ids=None):
    counts = np.asarray(counts)
    meta = TraceMeta(num_experts=counts.shape[2], top_k=top_k,
                     layer_ids=tuple(layer_ids if layer_ids is not None else range(counts.shape[1])), model="toy")
    return Trace(meta, counts=counts)


def test_single_step_with_an_idle_layer_gives_strict_json():
    counts = np.zeros((1, 2, 8), dtype=np.int64)
    counts[0, 0] = [8, 4, 2, 2, 0, 0, 0, 0]  # 16 dispatches = 8 tokens x top-2; layer 1 is dense (all zero)
    report = analysis_to_json(analyze_trace(count_trace(counts, layer_ids=[3, 5]), ep_sizes=[2, 4]))
    json.dumps(report, allow_nan=False)  # NaN became null
    first, idle = report["layers"]
    assert (first["layer"], idle["layer"]) == (3, 5)
    assert first["max_over_mean"] == 4.0 and idle["max_over_mean"] == 1.0
    assert first["zero_load_experts"] == 4 and idle["zero_load_experts"] == 8
    assert first["persistence"]["mean_hot_overlap"] is None  # one window: no transition
    assert report["tokens"] == 8 and report["windows"] == 1
    assert first["active_experts"] == [4] and idle["active_experts"] == [0]
    ep2, ep4 = report["ep"]
    assert ep2["gpu_rows"][0] == [16, 0] and ep4["gpu_rows"][0] == [12, 4, 0, 0]
    assert ep2["gpu_max_over_mean"] == [2.0, 1.0] and ep4["gpu_max_over_mean"] == [3.0, 1.0]
    assert ep2["out_of_sample"] is None and ep4["worst_layer"] == 3


def test_windows_default_to_at_most_16():
    assert default_window_steps(3) == 1 and default_window_steps(16) == 1
    assert default_window_steps(17) == 2 and default_window_steps(1000) == 63
    rng = np.random.default_rng(0)
    trace = count_trace(rng.integers(0, 20, size=(40, 1, 8)))
    analysis = analyze_trace(trace, ep_sizes=[4])
    assert analysis.window_steps == 3 and analysis.persistence.num_windows == 13
    assert analysis.out_of_sample[0].contiguous.shape == (12, 1)


def test_ep_sizes_are_checked():
    with pytest.raises(InputError):
        analyze_trace(count_trace(np.ones((2, 1, 8), dtype=np.int64)), ep_sizes=[3])
