"""The GPU validation script end to end in dry-run mode (CPU interpreter), and `moe-place report` errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moe_place.cli.main import main
from moe_place.cost.gemm import padded_rows

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """Run `bench/gpu_check.sh --dry-run` once; return (results folder, parsed JSON, markdown)."""
    out = tmp_path_factory.mktemp("results")
    env = {**os.environ, "RESULTS": str(out), "PYTHON": sys.executable, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (json_path,) = out.glob("cpu_dry_run_*.json")
    return out, json.loads(json_path.read_text()), json_path.with_suffix(".md").read_text(), proc.stdout


@pytest.mark.slow  # the GPU script's dry run in the Triton interpreter: ~15 s
def test_dry_run_records_environment_and_kernel_checks(dry_run):
    _, result, _, stdout = dry_run
    assert result["kind"] == "moe-place-microbench"
    assert result["env"]["timing"].startswith("CPU timings")  # CPU numbers are labelled as such
    assert {"torch", "triton", "gpu_part"} <= set(result["env"])
    assert set(result["sections"]) == {"padding", "gemm", "skew", "payback", "dispatch", "split"}
    assert result["checks"] and all(c["ok"] for c in result["checks"])
    assert "### Padding staircase" in stdout and "### Replica payback" in stdout


@pytest.mark.slow  # the GPU script's dry run in the Triton interpreter: ~15 s
def test_dry_run_padding_counts_follow_the_formula(dry_run):
    _, result, _, _ = dry_run
    rows = result["sections"]["padding"]["rows"]
    assert {r["block_m"] for r in rows} == set(result["sizes"]["block_ms"])
    for r in rows:
        expected = r["experts"] * -(-r["rows_per_expert"] // r["block_m"]) * r["block_m"]
        assert r["padded_rows_kernel"] == expected == padded_rows([r["rows_per_expert"]] * r["experts"], r["block_m"])
        assert r["padding_ratio"] == pytest.approx(expected / (r["experts"] * r["rows_per_expert"]))
        assert r["executed_tflops"] >= r["useful_tflops"] > 0
        assert r["ratio"] == pytest.approx(r["measured_s"] / r["predicted_s"])


@pytest.mark.slow  # the GPU script's dry run in the Triton interpreter: ~15 s
def test_dry_run_skew_payback_and_dispatch_are_consistent(dry_run):
    _, result, _, _ = dry_run
    skew = result["sections"]["skew"]
    loads = {c["load"] for c in skew["cases"]}
    assert {"uniform", "zipf", "hot_expert"} <= loads and any(name.startswith("qwen3_") for name in loads)
    for case in skew["cases"]:
        assert sum(case["rows_per_gpu"]) == skew["total_rows"]  # equal total rows in every case
        assert len(case["measured_per_gpu_s"]) == skew["gpus"]
        assert case["busiest_measured_s"] == max(case["measured_per_gpu_s"])
    uniform = next(c for c in skew["cases"] if c["load"] == "uniform")
    assert uniform["skew_measured"] == 1.0 and uniform["skew_predicted"] == 1.0
    hot = next(c for c in skew["cases"] if c["load"] == "hot_expert" and c["placement"] == "contiguous")
    assert max(hot["rows_per_gpu"]) > skew["total_rows"] / skew["gpus"]

    pay = result["sections"]["payback"]
    r = result["sizes"]["payback_rows"]
    assert pay["rows_before"] == [r] * 8 and pay["rows_after"] == [r] + [r // 2] * 7
    assert pay["expert_bytes"] == 3 * pay["hidden"] * pay["intermediate"] * 2
    if pay["saving_measured_s"] > 0:
        assert pay["n_min_measured"] == int(np.floor(pay["copy_measured_s"] / pay["saving_measured_s"])) + 1

    disp = result["sections"]["dispatch"]
    a = np.array(disp["traffic_rows"])
    assert a.sum() == disp["tokens"] * disp["top_k"] and disp["traffic_matches_model"]
    for rank, row in enumerate(disp["per_rank"]):
        assert row["send_bytes"] == a[rank].sum() * disp["row_bytes"]
        assert row["recv_bytes_off_rank"] == (a[:, rank].sum() - a[rank, rank]) * disp["row_bytes"]


@pytest.mark.slow  # the GPU script's dry run in the Triton interpreter: ~15 s
def test_dry_run_split_cases_are_checked_and_balanced(dry_run):
    _, result, _, _ = dry_run
    split = result["sections"]["split"]
    sizes = result["sizes"]
    assert len(split["cases"]) == len(sizes["split_gpus"]) * len(sizes["split_redundant_per_gpu"]) \
        * len(sizes["split_tokens"])
    assert sum(1 for c in result["checks"] if c["what"].startswith("split ")) == len(split["cases"])
    for case in split["cases"]:
        assert case["slots"] % case["gpus"] == 0 and case["redundant"] >= case["gpus"]
        assert case["busiest_kernel"] <= case["busiest_even"]
        assert case["busiest_lp"] is None or case["busiest_lp"] <= case["busiest_kernel"] <= case["busiest_numpy"] + 1
        assert case["goal_met"] is None                    # CPU timings: no verdict on the GPU goal
        assert all(case[f"{name}_s"] > 0 and case[f"{name}_baseline_s"] > 0 for name in ("count", "solve", "map", "layer"))
        assert case["solve_more_sweeps_s"] > 0 and case["busiest_kernel_more_sweeps"] <= case["busiest_even"]
    assert split["lplb_cited_s"] == 100e-6 and "LPLB" in split["lplb_source"]


@pytest.mark.slow  # the GPU script's dry run in the Triton interpreter: ~15 s
def test_dry_run_report_markdown_and_plots(dry_run):
    out, _, markdown, _ = dry_run
    for heading in ("Padding staircase", "Grouped GEMM vs dense", "Skew at equal total rows", "Replica payback",
                    "Dispatch/combine per rank", "Per-batch split kernels"):
        assert heading in markdown
    pngs = sorted(p.name.rsplit("_", 1)[-1] for p in out.glob("*.png"))
    assert {"padding.png", "skew.png", "payback.png", "measured.png"} <= set(pngs)
    for png in out.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({png.name})" in markdown


def test_report_rejects_a_file_that_is_not_a_result(tmp_path, capsys):
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps({"kind": "analysis"}))
    assert main(["report", str(bad), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "microbenchmark result" in err[0]
    assert main(["report", str(tmp_path / "missing.json")]) == 2
    (tmp_path / "broken.json").write_text("{")
    assert main(["report", str(tmp_path / "broken.json")]) == 2


@pytest.mark.slow  # the GPU script's dry run in the Triton interpreter: ~15 s
def test_bench_cli_forwards_to_microbench(tmp_path, capsys):
    out = tmp_path / "dispatch.json"
    assert main(["bench", "dispatch", "--dry-run", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert list(result["sections"]) == ["dispatch"]
    assert result["sections"]["dispatch"]["traffic_matches_model"] is True
    assert "Dispatch/combine per rank" in capsys.readouterr().out  # the report's rendering


def test_bench_predictions_reproduce_spec_c9():
    """The benchmark's predicted column uses the cost model as row C9 does: same numbers at C9's sizes."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("microbench_c9", ROOT / "bench" / "microbench.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    from moe_place.cost.hardware import builtin_catalog

    ctx = bench.Context(device=None, sizes=bench.Sizes.full(), timer=None, gpu_part=builtin_catalog().gpu("H100 SXM"),
                        on_gpu=False)
    before = bench.predict_s(ctx, [128] * 8, 4096, 1536, 64, catalog=True)
    after = bench.predict_s(ctx, [128] + [64] * 7, 4096, 1536, 64, catalog=True)
    assert before * 1e3 == pytest.approx(0.5496, abs=5e-5) and after * 1e3 == pytest.approx(0.3092, abs=5e-5)
    assert (before - after) * 1e3 == pytest.approx(0.24046821, rel=1e-6)
    model = bench.payback_model(ctx.gpu_part, before - after, 3 * 4096 * 1536 * 2, None, 5e-6)
    assert model.copy_time_s * 1e3 == pytest.approx(0.62220256, rel=1e-6) and model.n_min == 3


def test_committed_gpu_result_renders(tmp_path, capsys):
    """The H200 run in bench/results stays readable by `moe-place report` (predicted beside measured)."""
    (path,) = sorted((ROOT / "bench" / "results").glob("NVIDIA_H200_*Z.json"))
    result = json.loads(path.read_text())
    assert result["env"]["timing"] == "gpu" and result["env"]["compute_capability"] == "9.0"
    assert main(["report", str(path), "--out", str(tmp_path), "--no-plots"]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "NVIDIA H200" in text and "formula 5 ms" in text and "L2 ms" in text
    for row in result["sections"]["padding"]["rows"]:  # the measurement lies above the L2 (lower) bound
        assert row["measured_s"] > row["predicted_l2_s"]
