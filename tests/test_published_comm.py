"""The committed check against DeepEP's published figures (bench/results/published_comm.json) stays true: a fresh
computation gives the record's model figures, every row cites its source, and the published numbers are the
ones the sources print (docs/calibration.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench_modules import load

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "bench" / "results" / "published_comm.json"
check = load("check_published_comm")


@pytest.fixture(scope="module")
def record() -> dict:
    return json.loads(RECORD.read_text())


@pytest.fixture(scope="module")
def fresh(record) -> dict:
    return check.compute(record["settings"]["seed"])


def test_the_record_is_what_the_model_computes_now(record, fresh):
    # the model's prediction unchanged: a change to formula 3, the topology or the routing shows here
    assert len(record["rows"]) == len(fresh["rows"]) == 2 * sum(len(t) for t in (
        check.NORMAL, check.LOW_LATENCY, check.LOW_LATENCY_RDMA))
    for old, new in zip(record["rows"], fresh["rows"]):
        assert {k: old[k] for k in ("table", "ep", "phase", "deepep_rows_rank0")} == \
               {k: new[k] for k in ("table", "ep", "phase", "deepep_rows_rank0")}
        for key in ("model_s", "published_s", "model_over_published", "model_rows_rank0"):
            assert new[key] == pytest.approx(old[key], rel=1e-9), (old["table"], old["ep"], old["phase"], key)
    for old, new in zip(record["latency_fits"], fresh["latency_fits"]):
        assert new["latency_s"] == pytest.approx(old["latency_s"], rel=1e-9)
    assert [a["model_s"] for a in fresh["allreduce"]] == pytest.approx([a["model_s"] for a in record["allreduce"]])


def test_every_row_cites_its_source_with_a_commit(record):
    for row in record["rows"]:
        for source in (row["source"], row["bytes_source"]):
            assert source["repo"] == "deepseek-ai/DeepEP" and source["path"] and source["section"]
            assert len(source["commit"]) == 40 and int(source["commit"], 16) >= 0
    for entry in record["allreduce"]:
        assert "tuning.cc" in entry["source"]["model"] and entry["source"]["published"]
        assert entry["published_s"] is None     # no trustworthy publication found: said, not invented
    assert record["commit"] and record["date"] and record["machine"]


def test_the_published_numbers_are_the_sources_own(record):
    # DeepEP docs/legacy.md at dd758ca (normal: GB/s; low-latency: us and GB/s); README.md at ebfe47e (pure RDMA)
    normal = {(r["ep"], r["phase"]): r["published_gb_per_s"] for r in record["rows"] if r["table"] == "normal"}
    assert normal == {(8, "dispatch"): 153, (8, "combine"): 158, (16, "dispatch"): 43, (16, "combine"): 43,
                      (32, "dispatch"): 58, (32, "combine"): 57, (64, "dispatch"): 51, (64, "combine"): 50}
    low = {(r["ep"], r["phase"]): round(r["published_s"] * 1e6) for r in record["rows"] if r["table"] == "low-latency"}
    assert [low[ep, "dispatch"] for ep in (8, 16, 32, 64, 128, 256)] == [77, 118, 155, 173, 192, 194]
    assert [low[ep, "combine"] for ep in (8, 16, 32, 64, 128, 256)] == [114, 195, 273, 314, 369, 360]


def test_the_low_latency_bandwidths_are_the_published_times_of_deepep_bytes(record):
    # a reading check: DeepEP's bandwidth is its selections' bytes over its time, so the two published
    # columns agree within their rounding when the rows are counted as DeepEP counts them
    for row in record["rows"]:
        if row["table"] != "normal":
            implied = row["deepep_bytes_rank0"] / row["published_s"] / 1e9
            assert implied == pytest.approx(row["published_gb_per_s"], rel=0.06), (row["table"], row["ep"])


def test_formula_3_stays_a_lower_bound_of_every_published_time(record):
    assert all(0 < row["model_over_published"] < 1 for row in record["rows"])
