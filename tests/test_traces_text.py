"""CSV and JSON count traces."""

import json

import numpy as np
import pytest

from moe_place.errors import InputError
from moe_place.traces import Trace, TraceMeta, load_trace
from moe_place.traces.text import save_csv, save_json


def _trace():
    counts = np.array([[[3, 0, 1, 2], [1, 1, 2, 2]], [[0, 4, 2, 0], [2, 2, 1, 1]]])
    return Trace(TraceMeta(num_experts=4, top_k=2, layer_ids=(1, 5), model="m", step_names=("a", "b")), counts=counts)


def test_csv_schema(tmp_path):
    path = tmp_path / "c.csv"
    path.write_text("# num_experts: 6\n# top_k: 2\n# model: tiny\nlayer,step,expert,count\n"
                    "3,warm,0,4\n3,warm,5,2\n0,warm,1,6\n0,hot,2,2\n3,hot,2,2\n\n")
    trace = load_trace(path)
    assert trace.meta.layer_ids == (0, 3) and trace.step_names == ("warm", "hot")
    assert (trace.num_experts, trace.top_k, trace.meta.model) == (6, 2, "tiny")
    assert trace.counts[0].tolist() == [[0, 6, 0, 0, 0, 0], [4, 0, 0, 0, 0, 2]]
    assert trace.counts[1].tolist() == [[0, 0, 2, 0, 0, 0], [0, 0, 2, 0, 0, 0]]


@pytest.mark.parametrize("save", [save_csv, save_json])
def test_round_trip(tmp_path, save):
    trace = _trace()
    path = tmp_path / ("t.csv" if save is save_csv else "t.json")
    save(trace, path)
    back = load_trace(path)
    np.testing.assert_array_equal(back.counts, trace.counts)
    assert back.meta.layer_ids == (1, 5) and back.step_names == ("a", "b") and back.top_k == 2


def test_json_minimal_needs_top_k_from_the_user(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"counts": [[[6, 2, 0, 4]], [[1, 1, 1, 0]]]}))
    with pytest.raises(InputError, match="top_k: expected the router's top-k.*--top-k"):
        load_trace(path)  # totals 12 and 3 fit top-3 and top-1 alike: never guessed
    trace = load_trace(path, top_k=3)
    assert trace.num_experts == 4 and trace.top_k == 3 and trace.meta.layer_ids == (0,)
    with pytest.raises(InputError, match=r"counts\[step 1, layer 0\]: expected a total that is a multiple of top_k = 2"):
        load_trace(path, top_k=2)  # the second step's 3 dispatches cannot come from top-2 tokens: 12 passes, 3 fails


@pytest.mark.parametrize(("text", "match"), [
    ("step,layer,expert\n0,0,0\n", "header"),
    ("step,layer,expert,count\n0,0,0,x\n", "line 2: count"),
    ("step,layer,expert,count\n0,0,0,-1\n", "line 2: count"),
    ("step,layer,expert,count\n0,0,0,1\n0,0,0,2\n", "one row per"),
    ("# num_experts: 2\nstep,layer,expert,count\n0,0,3,1\n", "expert ids in"),
    ("step,layer,expert,count\n", "non-empty"),
    ("step,layer,expert,count\n0,0\n", "fields"),
])
def test_csv_errors(tmp_path, text, match):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(InputError, match=match) as err:
        load_trace(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize(("obj", "match"), [
    ({"counts": [[[1, 2], [3]]]}, "counts"),
    ({"counts": [[["a", "b"]]]}, "counts"),
    ({"counts": [[[1.0, float("nan")]]]}, "finite"),
    ({"counts": [[[1, -2]]]}, "counts >= 0"),
    ({"counts": [[[1, 2]]], "num_experts": 3}, "num_experts"),
    ({"counts": [[[1, 2]]], "top_k": 0}, "top_k"),
    ({"counts": [[[1, 2]]], "layer_ids": [0, 1]}, "layer_ids"),
    ({"counts": []}, "counts"),
    ({"counts": [[[0, 0]]]}, "non-empty"),
    ([1, 2], "JSON object"),
])
def test_json_errors(tmp_path, obj, match):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(obj))
    with pytest.raises(InputError, match=match):
        load_trace(path)
