"""Bad scenarios: one clear error line on stderr, exit code 2, no traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_place.cli.main import main
from moe_place.cost.hardware import builtin_catalog, load_catalog
from moe_place.cost.topology import parse_topology_spec
from moe_place.errors import InputError

SCENARIOS = Path(__file__).resolve().parents[1] / "bench" / "scenarios"
BASE = (SCENARIOS / "c6_hot.toml").read_text()


def run_error(capsys, tmp_path, text: str, suffix: str = ".toml", command: str = "predict") -> str:
    path = tmp_path / f"scenario{suffix}"
    path.write_text(text)
    capsys.readouterr()
    assert main([command, str(path)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"moe-place {command}: error: ") and "Traceback" not in captured.err
    assert captured.out == ""
    return lines[0]


def test_negative_bandwidth(capsys, tmp_path):
    text = BASE.replace('spec = "2 nodes x 8 H100, NVLink 450 GB/s,', 'gpu = "H100"\nnodes = 2\nnic_gbit_per_s = -400\n#')
    assert "nic_gbit_per_s" in run_error(capsys, tmp_path, text)


def test_negative_bandwidth_in_spec_string(capsys, tmp_path):
    text = BASE.replace("200 GB/s between nodes", "-200 GB/s between nodes")
    line = run_error(capsys, tmp_path, text)
    assert "bandwidth between servers" in line and "-200000000000" in line


def test_gpu_missing_from_topology(capsys, tmp_path):
    text = BASE.replace("groups = [8, 9, 10, 11]", "groups = [8, 9, 10, 16]")
    line = run_error(capsys, tmp_path, text)
    assert "workload.groups" in line and "[0, 16)" in line and "got 16" in line


def test_rows_not_summing_to_dispatch_total(capsys, tmp_path):
    text = BASE.replace("tokens = 1024", "tokens = 1000")
    line = run_error(capsys, tmp_path, text)
    assert "tokens" in line and "8000" in line and "8192" in line


def test_rows_per_expert_must_match_dispatch_columns(capsys, tmp_path):
    text = BASE.replace('weights = "none"', 'weights = "once"\nrows_per_expert = [[5120], [1024], [1024], [1000]]')
    line = run_error(capsys, tmp_path, text)
    assert "rows_per_expert[11]" in line and "1024" in line


def test_replica_that_does_not_fit(capsys, tmp_path):
    text = (SCENARIOS / "c9_payback.toml").read_text().replace("free_mib = 64", "free_mib = 35")
    for command in ("predict", "payback"):
        assert "replica does not fit: gpu1 needs 36 MiB" in run_error(capsys, tmp_path, text, command=command)


def test_unknown_part_lists_known_ones(capsys, tmp_path):
    line = run_error(capsys, tmp_path, BASE.replace("8 H100", "8 H900"))
    assert "'H900'" in line and "H100-SXM" in line and "B200" in line


def test_unknown_model_and_section(capsys, tmp_path):
    assert "Mixtral-8x7B" in run_error(capsys, tmp_path, BASE.replace("Qwen3-235B-A22B", "Llama-MoE"))
    assert "workloads" in run_error(capsys, tmp_path, BASE.replace("[workload]", "[workloads]"))


def test_bad_files(capsys, tmp_path):
    assert "valid TOML" in run_error(capsys, tmp_path, "name = [")
    assert "valid JSON" in run_error(capsys, tmp_path, "{", suffix=".json")
    assert "ending in .toml or .json" in run_error(capsys, tmp_path, "x", suffix=".yaml")
    capsys.readouterr()
    assert main(["predict", str(tmp_path / "missing.toml")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_json_scenario_works_like_toml(capsys, tmp_path):
    data = {"model": {"preset": "Qwen3-235B-A22B"}, "topology": {"spec": "1 node x 8 H100"},
            "workload": {"tokens": 8, "weights": "none", "rows_per_expert": [[64]] + [[0]] * 7}}
    path = tmp_path / "s.json"
    path.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["predict", str(path), "--format", "json"]) == 0
    assert round(json.loads(capsys.readouterr().out)["compute"]["time_s"] * 1e6, 1) == 4.9


def test_user_parts_file(tmp_path):
    parts = tmp_path / "parts.toml"
    parts.write_text('[gpu."MI300X"]\nbf16_tflops = 1307.4\nhbm_gb_per_s = 5300\nmemory_gb = 192\n'
                     'nvlink_gb_per_s = 448\npcie_gb_per_s = 64\naliases = ["mi300"]\n')
    catalog = load_catalog(parts)
    assert catalog.gpu("mi300").flops_per_s == pytest.approx(653.7e12)
    assert catalog.gpu("H100").name == "H100-SXM"  # built-ins stay
    topo = parse_topology_spec("2 nodes x 4 MI300X, 400 Gbit/s NIC per GPU", catalog)
    assert topo.num_gpus == 8 and topo.path_bandwidth_bytes_per_s(0, 4) == 50e9
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"gpu": {"X": {"bf16_tflops": -1, "hbm_gb_per_s": 1, "memory_gb": 1,
                                             "pcie_gb_per_s": 1}}}))
    with pytest.raises(InputError, match="bf16_tflops"):
        load_catalog(bad)


def test_topology_spec_errors():
    with pytest.raises(InputError, match="NIC bandwidth"):
        parse_topology_spec("2 nodes x 8 H100")  # two servers need NICs
    with pytest.raises(InputError, match="clause"):
        parse_topology_spec("1 node x 8 H100, fast links")
    with pytest.raises(InputError, match="one of"):
        builtin_catalog().cpu("H100")  # a GPU is not a CPU


def test_schema_and_missing_scenario(capsys):
    capsys.readouterr()
    assert main(["predict", "--schema"]) == 0
    assert "[workload]" in capsys.readouterr().out
    assert main(["predict"]) == 2
    assert "SCENARIO" in capsys.readouterr().err
