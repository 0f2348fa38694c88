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
    assert bench.main(["--tokens", "9000", "--layers", "3", "--experts", "32", "--top-k", "4", "--repeats", "1",
                       "--threads", "2", "--chunk-tokens", "500", "--steps", "4", "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    methods = [row["method"] for row in report["results"]]
    assert methods == ["analyze", "analyze-1t", "analyze-no-crc", "baseline", "base-int16", "chunked", "stream",
                       "stream-1t", "memory", "sorted"]
    assert report["threads"] == 2 and report["steps"] == 4 and not report["streamed"]
    baseline = report["results"][3]
    assert report["decisions"] == 9000 * 3 * 4 and baseline["ratio_vs_baseline"] == 1.0
    assert report["pair_sample"] == {"chosen_on_tokens": 2048, "estimated_on_tokens": 6144}  # 9000 > 8192 tokens
    text = capsys.readouterr().out
    assert "x baseline" in text and "read whole" in text


def test_bench_ids_are_distinct_per_token():
    ids = _bench().make_ids(500, 2, 16, 5, seed=1)
    ordered = np.sort(ids, axis=2)
    assert (ordered[:, :, 1:] != ordered[:, :, :-1]).all() and ids.max() < 16
