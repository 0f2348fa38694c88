"""The throughput benchmark runs end to end on a tiny trace (a smoke test, no timing asserted)."""

import importlib.util
import json
from pathlib import Path

import numpy as np


def _bench():
    path = Path(__file__).resolve().parents[1] / "bench" / "bench_trace_throughput.py"
    spec = importlib.util.spec_from_file_location("bench_trace_throughput", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_writes_table_and_json(tmp_path, capsys):
    bench = _bench()
    out = tmp_path / "b.json"
    assert bench.main(["--tokens", "3000", "--layers", "3", "--experts", "32", "--top-k", "4", "--repeats", "1",
                       "--threads", "2", "--chunk-tokens", "500", "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    methods = [row["method"] for row in report["results"]]
    assert methods == ["baseline", "base-int16", "chunked", "stream", "stream-1t", "memory", "sorted"]
    assert report["threads"] == 2
    assert report["decisions"] == 3000 * 3 * 4 and report["results"][0]["ratio_vs_baseline"] == 1.0
    assert "x baseline" in capsys.readouterr().out


def test_bench_ids_are_distinct_per_token():
    ids = _bench().make_ids(500, 2, 16, 5, seed=1)
    ordered = np.sort(ids, axis=2)
    assert (ordered[:, :, 1:] != ordered[:, :, :-1]).all() and ids.max() < 16
