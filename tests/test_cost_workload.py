"""Workloads from a trace + plan, topology specs, presets and the catalog."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moe_place.analysis.dispatch import dispatch_matrix, token_sources
from moe_place.cli.main import main
from moe_place.cost.hardware import builtin_catalog
from moe_place.cost.models import PRESETS, get_model
from moe_place.cost.topology import build_cluster, parse_topology_spec
from moe_place.placement import Placement
from moe_place.planfile import PlanFile, read_plan, write_plan
from moe_place.traces.bundled import bundled_path
from moe_place.traces.load import load_trace

SCENARIOS = Path(__file__).resolve().parents[1] / "bench" / "scenarios"


def run_json(capsys, path) -> dict:
    capsys.readouterr()
    code = main(["predict", str(path), "--format", "json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def test_trace_and_plan_workload(capsys):
    report = run_json(capsys, SCENARIOS / "trace_qwen3_30b_ep8.toml")
    placement = read_plan(SCENARIOS / "plan_qwen3_30b_ep8.json").placement
    trace = load_trace(bundled_path("qwen3-30b-a3b_prefill_topk.npz"))
    counts = np.zeros((placement.num_layers, 128))
    counts[0] = trace.step_counts()[0, 0]
    expected_rows = placement.gpu_loads(counts)[0]
    assert np.allclose(report["compute"]["rows_per_gpu"], expected_rows)
    assert report["compute"]["valid_rows"] == trace.topk_ids[0].shape[0] * 8
    # bytes that leave a GPU: every dispatch whose replica is not on the token's own GPU
    ids = trace.topk_ids[0][:, 0, :]
    a = dispatch_matrix(ids, token_sources(ids.shape[0], 8), placement, 0, num_sources=8)
    remote_rows = a.sum() - np.trace(a)
    assert report["dispatch"]["total_bytes"] == pytest.approx(remote_rows * 2048 * 2)
    assert report["combine"]["total_bytes"] == pytest.approx(remote_rows * 2048 * 2)
    assert report["compute"]["busiest_gpu"] == int(np.argmax(report["compute"]["per_gpu_s"]))


def test_count_level_trace_spreads_tokens_over_sources(capsys, tmp_path):
    placement = Placement.contiguous(3, 8, 8)
    plan = tmp_path / "plan.json"
    write_plan(plan, PlanFile(placement, (0, 1, 2)))
    trace_path = bundled_path("mixtral-8x7b_expert_counts_L0_L7_L15.npz")
    scenario = tmp_path / "s.toml"
    scenario.write_text(f'[model]\npreset = "Mixtral-8x7B"\n[topology]\nspec = "2 nodes x 4 H100, 400 Gbit/s NIC"\n'
                        f'[workload]\ntrace = "{trace_path}"\nplan = "{plan}"\nlayer = 1\nweights = "once"\n')
    report = run_json(capsys, scenario)
    counts = load_trace(trace_path).step_counts()[0, 1]
    assert np.allclose(report["compute"]["rows_per_gpu"], counts)  # one expert per GPU
    # tokens spread evenly over 8 sources: 7/8 of every expert's rows come from other GPUs
    assert report["dispatch"]["total_bytes"] == pytest.approx(counts.sum() * 7 / 8 * 4096 * 2)


def test_plan_with_more_gpus_than_topology(capsys, tmp_path):
    placement = Placement.contiguous(1, 128, 16)
    plan = tmp_path / "plan.json"
    write_plan(plan, PlanFile(placement, (0,)))
    scenario = tmp_path / "s.toml"
    scenario.write_text(f'[model]\npreset = "Qwen3-30B-A3B"\n[topology]\nspec = "1 node x 8 H100"\n[workload]\n'
                        f'trace = "{bundled_path("qwen3-30b-a3b_prefill_topk.npz")}"\nplan = "{plan}"\n')
    capsys.readouterr()
    assert main(["predict", str(scenario)]) == 2
    assert "at most the topology's 8 GPUs" in capsys.readouterr().err


def test_topology_spec_variants():
    topo = parse_topology_spec("2 nodes x 8 H800, 400 Gbit/s NIC per GPU")
    assert topo.path_bandwidth_bytes_per_s(0, 1) == 200e9  # H800 NVLink from the catalog
    assert topo.cut_capacity_bytes_per_s(topo.server_nodes(0)) == 8 * 50e9  # default uplink = sum of NICs
    pcie_only = parse_topology_spec("1 node x 4 A100-40GB-PCIe, host PCIe 25 GB/s")
    assert pcie_only.path_kind(0, 1) == "pcie" and pcie_only.path_bandwidth_bytes_per_s(0, 1) == 25e9
    no_nvlink = parse_topology_spec("8 H100, no NVLink")
    assert no_nvlink.path_kind(0, 7) == "pcie"


def test_topology_file(tmp_path):
    path = tmp_path / "topo.toml"
    path.write_text('[topology]\ngpu = "B200"\nnodes = 4\ngpus_per_node = 8\nnic_gbit_per_s = 800\n'
                    'inter_node_gb_per_s = 400\n')
    from moe_place.cost.files import read_table_file
    from moe_place.cost.topology import topology_from_table

    topo = topology_from_table(read_table_file(path)["topology"])
    assert topo.num_gpus == 32 and topo.path_bandwidth_bytes_per_s(0, 1) == 900e9
    assert topo.path_bandwidth_bytes_per_s(0, 31) == 100e9
    assert topo.max_flow_bytes_per_s(list(range(8)), list(range(8, 32))) == 400e9  # the server's uplink


def test_presets_expert_bytes():
    assert get_model("qwen3-235b-a22b").expert_bytes == 36 * 2**20
    assert get_model("Qwen3-235B-A22B").params_per_expert == 18_874_368
    assert get_model("qwen3_235b_a22b").expert_bytes * get_model("qwen3_235b_a22b").num_experts == 4.5 * 2**30
    assert get_model("DeepSeek-R1").expert_bytes == 42 * 2**20  # FP8
    assert get_model("Mixtral-8x7B").expert_bytes == 336 * 2**20
    assert get_model("OLMoE-1B-7B").expert_bytes == 12 * 2**20
    assert get_model("Qwen3-30B-A3B").row_bytes == 4096
    assert get_model("Kimi-K2").expert_bytes == 42 * 2**20  # FP8, DeepSeek-V3's expert shape
    assert len(PRESETS) == 7


def test_catalog_figures():
    cat = builtin_catalog()
    assert cat.gpu("H100").flops_per_s == pytest.approx(494.7e12)
    assert cat.gpu("H100 SXM").memory_bytes_per_s == pytest.approx(1675e9)
    assert cat.gpu("A100-40GB-PCIe").flops_per_s == pytest.approx(156e12)
    cpu = cat.cpu("8452Y")
    assert cpu.flops_per_s("amx") == 21.3e12 and cpu.memory_bytes_per_s("remote") == 125e9
    assert cat.nic("ConnectX-7").bytes_per_s == 50e9
    assert {"H100-SXM", "H200", "H800", "A100-80GB-SXM", "A100-40GB-PCIe", "H20", "B200"} <= set(cat.names)


def test_replay_layer_times_and_the_copies_of_a_move():
    from moe_place.cost.cluster import ReplayCost
    from moe_place.cost.migration import Copy, plan_copies

    model = get_model("Qwen3-235B-A22B")
    gpu = builtin_catalog().gpu("H100")
    cost = ReplayCost(model, build_cluster(gpu, 1, 16), block_m=64, block_n=128, weights="tiles")  # C9: formula 5
    load = np.zeros((1, 128))
    load[0, :8] = 128  # the 8 hot experts of C9, all on GPU 0 under the contiguous layout
    base = Placement.contiguous(1, 128, 16)
    assert cost.layer_times_s(base, load)[0] == pytest.approx(920_649_728 / 1675e9)  # C9 "before"
    # 16 redundant slots: experts 0..6 get a second replica on GPU 14, expert 7 on GPU 15
    spread = Placement.contiguous(1, 128, 16, num_redundant=16)
    t_spread = cost.layer_times_s(spread, load)[0]
    assert t_spread == pytest.approx((8 * model.expert_bytes + 512 * 309_248) / 1675e9)  # GPU 0: 8 x 64 rows

    topo = parse_topology_spec("2 nodes x 2 H100, 400 Gbit/s NIC per GPU")
    old = Placement(np.array([[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]]), 8, 4, 2)
    new = Placement(np.array([[0, 1, 2, 3, 4, 0, 6, 7, 5, 1, 2, 3]]), 8, 4, 2)
    w = float(model.expert_bytes)
    # slot 5 (GPU 1) gets expert 0 from GPU 0 over NVLink (not from GPU 2 across servers);
    # slot 8 (GPU 2) gets expert 5 from GPU 1
    assert plan_copies(old, new, topo, w) == [Copy(0, 1, w, 0, 5, 0), Copy(1, 2, w, 0, 8, 5)]
    assert plan_copies(old, old, topo, w) == []


def test_pool_stability_section(capsys, tmp_path):
    text = (SCENARIOS / "c6_hot.toml").read_text() + "\n[pool]\nrate_batches_per_s = 1000\n"
    path = tmp_path / "pool.toml"
    path.write_text(text)
    report = run_json(capsys, path)
    pool = report["pool"]
    # dispatch and combine use opposite directions of the hot GPU's NIC: one batch's 40 MiB per direction
    assert pool["binding"] in ("link leaf1->nic8", "link nic8->leaf1")
    assert pool["max_rate_batches_per_s"] == pytest.approx(1 / report["dispatch"]["time_s"])
    assert pool["stable"] is True
    path.write_text(text.replace("rate_batches_per_s = 1000", "rate_batches_per_s = 1200"))
    assert run_json(capsys, path)["pool"]["stable"] is False


def test_one_degraded_direction_slows_only_its_phase(capsys, tmp_path):
    text = (SCENARIOS / "c6_hot.toml").read_text().replace(
        "200 GB/s between nodes\"", "200 GB/s between nodes\"\nlinks = [{from = \"nic8\", to = \"leaf1\", gb_per_s = 25}]")
    path = tmp_path / "degraded.toml"
    path.write_text(text)
    report = run_json(capsys, path)
    assert round(report["dispatch"]["time_s"] * 1e3, 3) == 0.839  # leaf1 -> nic8 still 50 GB/s
    assert report["combine"]["time_s"] == pytest.approx(40 * 2**20 / 25e9)  # GPU 8 sends its 40 MiB at 25 GB/s
    assert "link nic8->leaf1" in report["combine"]["binding"]
    path.write_text(text.replace('from = "nic8"', 'from = "nic99"'))
    capsys.readouterr()
    assert main(["predict", str(path)]) == 2
    assert "links[0]" in capsys.readouterr().err


def test_a_plan_file_that_is_not_a_plan_is_one_line_exit_2(capsys, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"phy2log": Placement.contiguous(1, 128, 8).phy2log.tolist(), "num_gpus": 8}))
    scenario = tmp_path / "s.toml"
    scenario.write_text(f'[model]\npreset = "Qwen3-30B-A3B"\n[topology]\nspec = "1 node x 8 H100"\n[workload]\n'
                        f'trace = "{bundled_path("qwen3-30b-a3b_prefill_topk.npz")}"\nplan = "{plan}"\n')
    capsys.readouterr()
    assert main(["predict", str(scenario)]) == 2
    err = capsys.readouterr().err
    assert str(plan) in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("style", ["deepep", "all-to-all"])
def test_trace_workload_with_the_layer_time_models_traffic(capsys, tmp_path, style):
    from moe_place.cost.comm import CommModel, step_cost
    from moe_place.cost.replicas import SlotTable
    from moe_place.cost.models import get_model
    from moe_place.cost.topology import parse_topology_spec

    trace_path = bundled_path("qwen3-30b-a3b_prefill_topk.npz")
    placement = Placement.contiguous(2, 128, 8, 2, 8)           # 2 nodes x 4 GPUs, 8 redundant slots
    plan = tmp_path / "plan.json"
    write_plan(plan, PlanFile(placement, (0, 1)))
    spec = "2 nodes x 4 H100, NVLink 450 GB/s, 400 Gbit/s NIC per GPU"
    scenario = tmp_path / "s.toml"
    scenario.write_text(f'[model]\npreset = "Qwen3-30B-A3B"\n[topology]\nspec = "{spec}"\n[workload]\n'
                        f'trace = "{trace_path}"\nplan = "{plan}"\nlayer = 1\nweights = "once"\ntraffic = "{style}"\n'
                        f'replica_choice = "vllm"\n')
    report = run_json(capsys, scenario)
    ids = load_trace(trace_path).topk_ids[0][:, 1, :]
    model = CommModel(parse_topology_spec(spec), get_model("Qwen3-30B-A3B"), dispatch=style, replica_choice="vllm",
                      weights="once")
    expected = step_cost(model, ids, token_sources(ids.shape[0], 8), SlotTable(placement.phy2log[1], 8, 2, 128))
    assert report["dispatch"]["time_s"] == pytest.approx(expected.dispatch_s)
    assert report["combine"]["time_s"] == pytest.approx(expected.combine_s)
    assert report["compute"]["time_s"] == pytest.approx(expected.compute_s)
    assert report["dispatch"]["total_bytes"] == pytest.approx(expected.traffic.rows.sum() * 4096)


def test_trace_workload_traffic_needs_token_ids(capsys, tmp_path):
    placement = Placement.contiguous(3, 8, 8)
    plan = tmp_path / "plan.json"
    write_plan(plan, PlanFile(placement, (0, 1, 2)))
    scenario = tmp_path / "s.toml"
    scenario.write_text(f'[model]\npreset = "Mixtral-8x7B"\n[topology]\nspec = "2 nodes x 4 H100, 400 Gbit/s NIC"\n'
                        f'[workload]\ntrace = "{bundled_path("mixtral-8x7b_expert_counts_L0_L7_L15.npz")}"\n'
                        f'plan = "{plan}"\ntraffic = "deepep"\n')
    assert main(["predict", str(scenario)]) == 2
    assert "traffic: expected a token-level trace" in capsys.readouterr().err
