"""Conformance rows of docs/MODEL.md (C3, C6-C13): each scenario file in bench/scenarios runs through the CLI and
prints the numbers to the digits docs/MODEL.md gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_place.cli.main import main

SCENARIOS = Path(__file__).resolve().parents[1] / "bench" / "scenarios"


def predict(capsys, name: str, command: str = "predict") -> dict:
    capsys.readouterr()
    code = main([command, str(SCENARIOS / name), "--format", "json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def ms(seconds: float, digits: int) -> float:
    return round(seconds * 1e3, digits)


def test_c3_busiest_gpu_compute(capsys):
    uniform = predict(capsys, "c3_uniform.toml")["compute"]
    hot = predict(capsys, "c3_concentrated.toml")["compute"]
    assert round(uniform["time_s"] * 1e6, 1) == 4.9
    assert round(hot["time_s"] * 1e6, 1) == 39.1
    assert uniform["bound"] == hot["bound"] == "compute"
    assert hot["busiest_gpu"] == 0 and hot["expert_skew"] == 8.0
    assert round(hot["busiest_flops"] / 1e9, 2) == 19.33  # C1: the same 19.33 GFLOP


# dispatch / busiest compute / combine / sum with barriers (ms), row C6
C6 = {
    "c6_balanced.toml": (0.336, 0.156, 0.336, 0.827),
    "c6_hot.toml": (0.839, 0.391, 0.839, 2.068),
    "c6_one_link.toml": (1.342, 0.156, 1.342, 2.841),
    "c6_hot_fp8.toml": (0.419, 0.391, 0.839, 1.649),
    "c6_hot_nvlink.toml": (0.093, 0.391, 0.093, 0.577),
}


@pytest.mark.parametrize("name", sorted(C6))
def test_c6_dispatch_compute_combine(capsys, name):
    report = predict(capsys, name)
    got = (ms(report["dispatch"]["time_s"], 3), ms(report["compute"]["time_s"], 3),
           ms(report["combine"]["time_s"], 3), ms(report["barrier_total_s"], 3))
    assert got == C6[name]


def test_c6_binding_resources(capsys):
    hot = predict(capsys, "c6_hot.toml")
    assert {"receiver gpu8", "link leaf1->nic8"} <= set(hot["dispatch"]["binding"])
    assert "cut server0 out" not in hot["dispatch"]["binding"]  # 40 MiB on one NIC, not the 200 GB/s cut
    one_link = predict(capsys, "c6_one_link.toml")
    assert "cut server0 out" in one_link["dispatch"]["binding"]
    assert one_link["dispatch"]["worst_by_kind"]["cut"]["capacity_bytes_per_s"] == 50e9
    nvlink = predict(capsys, "c6_hot_nvlink.toml")
    assert nvlink["binds"] == "compute" and hot["binds"] in ("dispatch", "combine")


def test_c7_pipeline_and_breakeven(capsys):
    p = predict(capsys, "c7_pipeline.toml")["pipeline"]
    assert ms(p["pipelined_s"], 3) == 0.581
    assert ms(p["saving_s"], 3) == 0.246
    assert round(p["breakeven_slowdown"]["dispatch+combine"] - 1, 2) == 0.49  # "49% slower"
    assert round(p["breakeven_slowdown"]["compute"], 1) == 3.1


def test_c8_padding(capsys):
    pad = predict(capsys, "c8_padding.toml")["padding"]
    assert pad["valid_rows"] == 64
    assert pad["padded_rows"] == 224 and pad["padded_rows"] / 64 == 3.5
    assert pad["padded_rows_pad_empty"] == 256 and pad["padded_rows_batched"] == 256


def test_c9_payback(capsys):
    report = predict(capsys, "c9_payback.toml")
    assert report["compute"]["busiest_memory_bytes"] == 920_649_728
    p = report["payback"]
    assert round(p["before_s"] * 1e3, 4) == 0.5496 and round(p["after_s"] * 1e3, 4) == 0.3092
    assert p["saving_memory_bytes"] == 402_784_256
    assert round(p["saving_per_batch_s"] * 1e3, 8) == 0.24046821
    nvlink, nic = p["cases"]
    assert round(nvlink["copy_time_s"] * 1e3, 8) == 0.62220256 and nvlink["n_min"] == 3
    assert round(nic["copy_time_s"] * 1e3, 8) == 5.31982304 and nic["n_min"] == 23
    assert nvlink["path"] == ["nvlink"] and nic["path_bandwidth_bytes_per_s"] == 50e9
    assert (round(nvlink["net_gain_s"]["16"] * 1e3, 2), round(nic["net_gain_s"]["16"] * 1e3, 2)) == (3.23, -1.47)
    assert (round(nvlink["net_gain_s"]["64"] * 1e3, 2), round(nic["net_gain_s"]["64"] * 1e3, 2)) == (14.77, 10.07)


def test_c9_payback_command_and_plot(capsys, tmp_path):
    png = tmp_path / "payback.png"
    capsys.readouterr()
    assert main(["payback", str(SCENARIOS / "c9_payback.toml"), "--format", "json", "--plot", str(png)]) == 0
    report = json.loads(capsys.readouterr().out)
    curve = report["curve"]["net_gain_s"]["NVLink (same HGX)"]
    assert len(curve) == 65 and curve[2] < 0 < curve[3]  # N_min = 3 on the curve too
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_c9_no_room_is_infeasible(capsys):
    capsys.readouterr()
    assert main(["predict", str(SCENARIOS / "c9_no_room.toml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "replica does not fit" in err[0] and "32 MiB free" in err[0]


def test_c10_cpu_or_gpu(capsys):
    k = predict(capsys, "c10_offload.toml")["offload"]["kernels"]
    assert ms(k["avx512"]["cpu_s"]["1"], 2) == 1.46 and ms(k["avx512"]["gpu_s"]["1"], 1) == 12.5
    assert ms(k["avx512"]["cpu_s"]["128"], 1) == 22.2
    assert ms(k["amx"]["cpu_s"]["128"], 2) == 2.57 and ms(k["amx"]["gpu_s"]["128"], 1) == 12.5
    assert k["avx512"]["gpu_faster_from_rows"] == 72 and k["amx"]["gpu_faster_from_rows"] == 689


def test_c11_c12_capacity(capsys):
    c = predict(capsys, "c11_c12_capacity.toml")["capacity"]
    assert c["replicas"]["94"]["mib"] == 3384 and round(c["replicas"]["94"]["gib"], 2) == 3.30
    assert c["replicas"]["8"]["mib"] == 288
    assert c["resident"]["32"]["per_layer_gib"] == 1.125 and c["resident"]["32"]["gib"] == 105.75
    assert c["resident"]["32"]["fits"] is False  # 80 GB = 74.5 GiB
    assert round(c["resident"]["16"]["gib"], 1) == 52.9 and c["resident"]["16"]["fits"] is True


def test_c13_nic_message_rate(capsys):
    nic = predict(capsys, "c13_nic.toml")["nic"]
    assert round(nic["crossover_bytes"] / 1e3, 2) == 0.93
    assert nic["messages"]["8192"] == nic["messages"]["4096"] == "bandwidth"
    assert nic["messages"]["512"] == "message-rate"


def test_table_format_prints_units(capsys):
    capsys.readouterr()
    assert main(["predict", str(SCENARIOS / "c6_hot.toml")]) == 0
    out = capsys.readouterr().out
    assert "dispatch.time " in out and "0.83886 ms" in out and "binds" in out and "GB/s" in out
    assert "time_s" not in out  # shown in ms: the key loses its `_s`
    assert "capacity_bytes_per_s" in out  # a rate keeps its name
    assert not any(len(token.split(".")[-1]) > 6 for token in out.split() if token.replace(".", "").isdigit())


def test_c9_payback_from_command_line_flags(capsys):
    capsys.readouterr()
    assert main(["payback", "--topology", "2 nodes x 8 H100, 400 Gbit/s NIC per GPU", "--saving-ms", "0.24046821",
                 "--alpha-us", "5", "--case", "NVLink=0:1,0:2,0:3,0:4,0:5,0:6,0:7",
                 "--case", "NIC=8:1,8:2,8:3,8:4,8:5,8:6,8:7", "--free-mib", "64", "--format", "json"]) == 0
    nvlink, nic = json.loads(capsys.readouterr().out)["payback"]["cases"]
    assert (round(nvlink["copy_time_s"] * 1e3, 8), nvlink["n_min"]) == (0.62220256, 3)
    assert (round(nic["copy_time_s"] * 1e3, 8), nic["n_min"]) == (5.31982304, 23)
    assert main(["payback", "--topology", "8 H100", "--saving-ms", "1", "--case", "x=0:1", "--free-mib", "35"]) == 2
    assert "replica does not fit" in capsys.readouterr().err
    assert main(["payback", "--saving-ms", "1"]) == 2
    assert "--topology" in capsys.readouterr().err
