"""Each formula of the cost model against an independent brute force or simulation."""

from __future__ import annotations

import math

import networkx as nx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_place.cost import gemm, offload, pipeline
from moe_place.cost.hardware import builtin_catalog
from moe_place.cost.models import get_model
from moe_place.cost.migration import Copy, copy_time_s
from moe_place.cost.payback import n_min, payback
from moe_place.cost.topology import build_cluster, gpu_node
from moe_place.cost.traffic import phase_lower_bound, phase_volumes_bytes

rows_lists = st.lists(st.integers(0, 300), min_size=1, max_size=12)


# ---------------------------------------------------------------------- padding (formula 4)
@settings(derandomize=True)
@given(rows_lists, st.sampled_from([1, 16, 32, 64, 128]))
def test_padding_equals_row_by_row_count(rows, block_m):
    counted = counted_all = 0
    for m in rows:  # fill tiles one row at a time
        used = 0
        while used < m:
            counted += block_m
            counted_all += block_m
            used += block_m
        if m == 0:
            counted_all += block_m
    assert gemm.padded_rows(rows, block_m) == counted
    assert gemm.padded_rows(rows, block_m, pad_empty=True) == counted_all
    assert gemm.padded_rows_batched(rows, block_m) >= gemm.padded_rows(rows, block_m)
    if max(rows) > 0:
        assert gemm.padded_rows_batched(rows, block_m) >= gemm.padded_rows(rows, block_m, pad_empty=True)


# ---------------------------------------------------------------------- tile traffic (formula 5)
def simulated_tile_bytes(rows, h, inter, b, block_m, block_n):
    """Walk every (M-tile, N-tile) of the gate+up GEMM and the down GEMM and count HBM traffic."""
    total = 0
    for m in rows:
        for start in range(0, m, block_m):
            tile_rows = min(block_m, m - start)
            for n0 in range(0, 2 * inter, block_n):  # gate+up: weights [h, 2I], each N-tile reads its columns
                cols = min(block_n, 2 * inter - n0)
                total += h * cols * b + tile_rows * h * b + tile_rows * cols * b
            for n0 in range(0, h, block_n):  # down: weights [I, h]
                cols = min(block_n, h - n0)
                total += inter * cols * b + tile_rows * inter * b + tile_rows * cols * b
    return total


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 200), min_size=1, max_size=5), st.sampled_from([16, 32, 64]),
       st.sampled_from([32, 64, 128]), st.sampled_from([(256, 128), (512, 96), (384, 192)]))
def test_tile_traffic_matches_tile_walk(rows, block_m, block_n, shape):
    h, inter = shape
    tiles = gemm.expert_work_arrays(rows, h, inter, 2, weights="tiles", block_m=block_m, block_n=block_n)[2]
    assert tiles == simulated_tile_bytes(rows, h, inter, 2, block_m, block_n)


def test_tile_row_bytes_seed_value():
    assert gemm.tile_row_bytes(4096, 1536, 2, 128) == 309_248


@settings(derandomize=True)
@given(st.lists(rows_lists, min_size=1, max_size=6))
def test_layer_waits_for_busiest_gpu(rows_per_gpu):
    layer = gemm.layer_time(rows_per_gpu, 512, 256, 2, 1e12, 1e11, weights="once")
    each = [gemm.expert_time_s(r, 512, 256, 2, 1e12, 1e11, weights="once") for r in rows_per_gpu]
    assert layer.time_s == max(each) >= layer.times_s.mean() * (1 - 1e-12)
    assert layer.busiest_gpu == int(np.argmax(each))


# ---------------------------------------------------------------------- traffic bound (formula 3)
def fluid_schedule_s(topology, volume):
    """Max-min fair sharing of every directed link by the flows routed over it, until all finish."""
    flows = []
    for i, j in zip(*np.nonzero(volume)):
        if i != j:
            flows.append([float(volume[i, j]), topology.route(int(i), int(j))])
    cap = {e: d["capacity"] for *e2, d in topology.graph.edges(data=True) for e in [tuple(e2)]}
    now = 0.0
    while flows:
        rates = [None] * len(flows)
        remaining_cap = dict(cap)
        active = set(range(len(flows)))
        while active:  # progressive filling
            share = {}
            for e, c in remaining_cap.items():
                users = [f for f in active if e in flows[f][1]]
                if users:
                    share[e] = c / len(users)
            e_min = min(share, key=share.get)
            rate = share[e_min]
            for f in [f for f in active if e_min in flows[f][1]]:
                rates[f] = rate
                active.discard(f)
                for e in flows[f][1]:
                    remaining_cap[e] -= rate
        dt = min(f[0] / r for f, r in zip(flows, rates))
        now += dt
        for f, r in zip(flows, rates):
            f[0] -= r * dt
        flows = [f for f in flows if f[0] > 1e-6]
    return now


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.integers(1, 3), st.integers(1, 3), st.booleans(), st.integers(0, 2**31 - 1))
def test_bound_never_exceeds_simulated_schedule(servers, per_server, nvlink, seed):
    rng = np.random.default_rng(seed)
    gpu = builtin_catalog().gpu("H100")
    topo = build_cluster(gpu, servers, per_server, nvlink_bytes_per_s=float(rng.choice([0, 450e9])) if nvlink else 0.0,
                         nic_bytes_per_s=50e9, inter_server_bytes_per_s=float(rng.choice([25e9, 50e9, 400e9])))
    g = topo.num_gpus
    a = rng.integers(0, 50, size=(g, g)) * (rng.random((g, g)) < 0.6)
    v_d, v_c = phase_volumes_bytes(a, 8192, 4096)
    for volume in (v_d, v_c):
        bound = phase_lower_bound(topo, volume).time_s
        simulated = fluid_schedule_s(topo, volume)
        assert bound <= simulated * (1 + 1e-9)


def test_bound_is_tight_for_c6_balanced():
    topo = build_cluster(builtin_catalog().gpu("H100"), 2, 8, nic_bytes_per_s=50e9, inter_server_bytes_per_s=200e9)
    a = np.zeros((16, 16))
    a[:4, 8:12] = 512
    volume, _ = phase_volumes_bytes(a, 8192, 8192)
    assert math.isclose(phase_lower_bound(topo, volume).time_s, fluid_schedule_s(topo, volume), rel_tol=1e-9)


def test_cut_capacity_from_graph_matches_networkx_min_cut():
    topo = build_cluster(builtin_catalog().gpu("H100"), 2, 4, nic_bytes_per_s=50e9, inter_server_bytes_per_s=120e9)
    flow = nx.DiGraph(topo.graph)
    cut_value, (reachable, _) = nx.minimum_cut(flow, "leaf0", "leaf1")
    assert cut_value == 120e9
    assert topo.cut_capacity_bytes_per_s(frozenset(reachable)) == cut_value  # the cut networkx found
    assert topo.cut_capacity_bytes_per_s(topo.server_nodes(0)) == 120e9
    # a GPU sending to GPUs of the other server is limited by its NIC, whatever the other GPUs do
    assert topo.max_flow_bytes_per_s([0], [4, 5, 6, 7]) == 50e9
    assert topo.path_bandwidth_bytes_per_s(0, 1) == 450e9 and topo.path_kind(0, 5) == "pcie+nic+uplink"
    assert topo.path_bandwidth_bytes_per_s(3, 3) == math.inf
    assert gpu_node(3) in topo.server_nodes(0)


# ---------------------------------------------------------------------- pipeline (formula 6)
def simulate_pipeline_s(micro_batch_stage_times_s, micro_batches):
    """Event simulation: each stage is one resource serving micro-batches in order; micro-batch j enters
    stage s when stage s-1 finished it and stage s finished micro-batch j-1."""
    finish = [0.0] * len(micro_batch_stage_times_s)
    for _ in range(micro_batches):
        ready = 0.0
        for s, t in enumerate(micro_batch_stage_times_s):
            finish[s] = ready = max(ready, finish[s]) + float(t)
    return finish[-1]


@settings(derandomize=True)
@given(st.lists(st.floats(0.0, 5.0), min_size=1, max_size=5), st.integers(1, 8))
def test_pipeline_formula_matches_event_simulation(stages, q):
    assert math.isclose(pipeline.pipeline_time_s(stages, q), simulate_pipeline_s(stages, q),
                        rel_tol=1e-9, abs_tol=1e-12)


@settings(derandomize=True)
@given(st.lists(st.floats(0.01, 5.0), min_size=2, max_size=5), st.integers(2, 6), st.data())
def test_breakeven_slowdown_brings_pipeline_back_to_serial(stages, q, data):
    slowed = data.draw(st.lists(st.integers(0, len(stages) - 1), min_size=1, unique=True))
    x = pipeline.breakeven_slowdown(stages, q, slowed)
    assert x >= 1 - 1e-9
    scaled = [t * x if i in slowed else t for i, t in enumerate(stages)]
    assert math.isclose(simulate_pipeline_s(np.array(scaled) / q, q), sum(stages), rel_tol=1e-9)


# ---------------------------------------------------------------------- payback (formula 7)
@settings(derandomize=True)
@given(st.floats(1e-4, 10.0), st.floats(1e-4, 1.0))
def test_n_min_is_first_batch_that_pays(copy, saving):
    n = n_min(copy, saving)
    assert n * saving > copy and (n - 1) * saving <= copy


def test_parallel_copies_not_slower_than_serial_and_same_gpu_is_free():
    topo = build_cluster(builtin_catalog().gpu("H100"), 2, 8, nic_bytes_per_s=50e9)
    w = get_model("Qwen3-235B-A22B").expert_bytes
    fan_out = [Copy(0, d, w) for d in range(1, 8)]
    spread = [Copy(s, s + 8, w) for s in range(8)]
    for copies in (fan_out, spread):
        assert copy_time_s(topo, copies, 5e-6, "parallel") <= copy_time_s(topo, copies, 5e-6, "serial")
    # seven copies from one GPU share its NVLink port: parallel = one transfer of 7 W_e plus one alpha
    assert math.isclose(copy_time_s(topo, fan_out, 5e-6, "parallel"), 7 * w / 450e9 + 5e-6)
    # eight copies over eight different NICs run side by side
    assert math.isclose(copy_time_s(topo, spread, 0.0, "parallel"), w / 50e9)
    assert copy_time_s(topo, [Copy(3, 3, w)], 5e-6) == 0.0
    result = payback(topo, fan_out, 2.4e-4, alpha_s=5e-6, free_bytes_per_gpu=32 * 2**20)
    assert not result.feasible and result.n_min is None and len(result.problems) == 7


# ---------------------------------------------------------------------- offload (formula 8)
def test_crossover_matches_linear_scan():
    model = get_model("Qwen3-235B-A22B")
    for cpu_flops in (1.8e12, 5e12, 21.3e12):
        rates = offload.OffloadRates(cpu_flops, 220e9, 156e12, 777.5e9, 25e9, 5e-6)
        m = 1
        while not offload.gpu_time_s(m, model, rates) < offload.cpu_time_s(m, model, rates):
            m += 1
        assert offload.crossover_rows(model, rates) == m


def test_pool_stability():
    pool = offload.pool_stability(100.0, [1e12, 2e9], [494.7e12, 50e9], ["gpu0", "link"])
    assert not pool.stable and pool.binding == "link" and math.isclose(pool.max_rate_batches_per_s, 25.0)
    assert offload.pool_stability(24.0, [1e12, 2e9], [494.7e12, 50e9]).stable


def _traffic_by_tiles(rows, hidden, inter, b, block_m, block_n, reuse):
    """Independent count, tile by tile: every (M-tile, N-tile) program of gate+up then down loads its
    weight panel and its activation rows; with `reuse` only the first load of each panel/row reaches HBM."""
    seen, total = set(), 0
    for expert, m in enumerate(rows):
        for tile in range(-(-m // block_m)):
            tile_rows = range(tile * block_m, min(m, (tile + 1) * block_m))
            for gemm_name, n_cols, k_dim in (("gate_up", 2 * inter, hidden), ("down", hidden, inter)):
                for n_tile in range(-(-n_cols // block_n)):
                    width = min(block_n, n_cols - n_tile * block_n)
                    key = (expert, gemm_name, "w", n_tile)
                    if not reuse or key not in seen:
                        total += width * k_dim * b
                        seen.add(key)
                    for r in tile_rows:
                        key = (expert, gemm_name, "x", r)
                        if not reuse or key not in seen:
                            total += k_dim * b
                            seen.add(key)
            total += len(tile_rows) * (2 * inter + hidden) * b  # outputs written once (formula 5's last terms)
    return total


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 70), min_size=1, max_size=5), st.sampled_from([16, 32, 64]),
       st.sampled_from([(64, 32), (96, 48), (128, 64)]))
def test_l2_and_formula5_traffic_match_a_tile_by_tile_count(rows, block_m, shape):
    hidden, inter = shape
    tiles = gemm.expert_work_arrays(rows, hidden, inter, 2, weights="tiles", block_m=block_m, block_n=32)[2]
    l2 = gemm.expert_work_arrays(rows, hidden, inter, 2, weights="l2")[2]
    assert tiles == _traffic_by_tiles(rows, hidden, inter, 2, block_m, 32, reuse=False)
    assert l2 == _traffic_by_tiles(rows, hidden, inter, 2, block_m, 32, reuse=True)
    assert l2 <= tiles
    t_l2 = gemm.expert_time_s(rows, hidden, inter, 2, 1e12, 1e11, weights="l2", block_m=block_m)
    t_tiles = gemm.expert_time_s(rows, hidden, inter, 2, 1e12, 1e11, weights="tiles", block_m=block_m, block_n=32)
    assert t_l2 <= t_tiles
