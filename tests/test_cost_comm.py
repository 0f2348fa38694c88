"""The layer-time model (moe_place.cost.comm) against per-token brute force, the engines' replica
rules, formula 3 on the graph and row C6."""

import numpy as np
import pytest

from moe_place.analysis.dispatch import token_sources
from moe_place.cost.cluster import cluster_cost, cluster_topology
from moe_place.cost.comm import CommModel, compute_only_s, layer_cost, step_cost
from moe_place.cost.replicas import (TOKEN_CHOICES, SlotTable, choose_replicas, local_positions, vllm_replica_index,
                                     water_fill)
from moe_place.cost.gemm import WEIGHT_MODES, gpu_expert_work, gpu_times_s
from moe_place.cost.hardware import builtin_catalog
from moe_place.cost.models import ExpertShape, get_model
from moe_place.cost.replicas import vllm_hash_fractions
from moe_place.cost.topology import parse_topology_spec, with_link_overrides
from moe_place.cost.traffic import phase_lower_bound, phase_time_s
from moe_place.errors import InputError

SMALL = ExpertShape("small", 256, 128, 16, 4, 1)


def random_case(rng, gpus, nodes, experts, redundant, k, tokens):
    """(phy2log [P] with no two replicas of one expert on a GPU, ids [tokens, k] distinct per token)."""
    physical = experts + redundant
    slots = physical // gpus
    while True:
        extra = rng.choice(experts, redundant, replace=True)
        row = rng.permutation(np.concatenate([np.arange(experts), extra]))
        per_gpu = np.sort(row.reshape(gpus, slots), axis=1)
        if not (per_gpu[:, 1:] == per_gpu[:, :-1]).any():
            break
    ids = np.stack([rng.choice(experts, k, replace=False) for _ in range(tokens)])
    return row, ids


def brute_traffic(slots, home, slots_per_gpu, gpus_per_node, num_gpus, style):
    """rows [G, G], distinct nodes per token: one token at a time, sets and loops."""
    rows = np.zeros((num_gpus, num_gpus))
    visited = 0
    for t in range(slots.shape[0]):
        gpus = {int(p) // slots_per_gpu for p in slots[t]}
        nodes = {g // gpus_per_node for g in gpus}
        visited += len(nodes)
        h = int(home[t])
        if style == "all-to-all":
            for g in gpus:
                if g != h:
                    rows[h, g] += 1
            continue
        for n in nodes:
            if n != h // gpus_per_node:
                rows[h, n * gpus_per_node + h % gpus_per_node] += 1
        for g in gpus:
            forwarder = (g // gpus_per_node) * gpus_per_node + h % gpus_per_node
            if g != forwarder:
                rows[forwarder, g] += 1
    return rows, visited


def formula_3(topology, volume, full: bool) -> float:
    """Phase time: every term of formula 3 (`full`, networkx max flows: slow), or `phase_time_s`."""
    return phase_lower_bound(topology, volume).time_s if full else phase_time_s(topology, volume)


@pytest.mark.parametrize("seed", range(12))
def test_every_figure_matches_a_per_token_brute_force(seed):
    rng = np.random.default_rng(seed)
    nodes = int(rng.choice([1, 2, 3]))
    gpn = int(rng.choice([1, 2, 3]))
    gpus = nodes * gpn
    slots = int(rng.integers(1, 4))
    experts = int(rng.integers(max(2, slots, gpus * slots // 2), gpus * slots + 1))  # S <= E: no co-location
    physical = gpus * slots
    k = int(rng.integers(1, min(4, experts) + 1))
    row, ids = random_case(rng, gpus, nodes, experts, physical - experts, k, int(rng.integers(5, 40)))
    topo = parse_topology_spec(f"{nodes} nodes x {gpn} H100, 400 Gbit/s NIC per GPU")
    table = SlotTable(row, gpus, nodes, experts)
    for style in ("deepep", "all-to-all"):
        for rule in TOKEN_CHOICES:
            for layout in ("blocks", "round-robin"):
                model = CommModel(topo, SMALL, dispatch=style, replica_choice=rule, token_home=layout, weights="once",
                                  dispatch_bytes_per_row=1000.0, combine_bytes_per_row=700.0, seed=seed)
                home = token_sources(ids.shape[0], gpus, layout)
                step = step_cost(model, ids, home, table, seed=3)
                chosen = choose_replicas(ids, home, table, rule, seed=3)
                assert (row[chosen] == ids).all()  # every pair goes to a slot of its own expert
                rows, visited = brute_traffic(chosen, home, slots, gpn, gpus, style)
                traffic = step.traffic
                assert np.array_equal(traffic.rows, rows)
                assert traffic.visited_nodes == visited
                cross = (np.arange(gpus)[:, None] // gpn) != (np.arange(gpus)[None, :] // gpn)
                assert traffic.rdma_rows == rows[cross].sum() and traffic.nvlink_rows == rows[~cross].sum()
                assert np.array_equal(traffic.nic_send_rows, np.where(cross, rows, 0).sum(axis=1))
                assert np.array_equal(traffic.nic_recv_rows, np.where(cross, rows, 0).sum(axis=0))
                assert np.array_equal(traffic.rows_per_slot, np.bincount(chosen.ravel(), minlength=row.size))
                # times: formula 3 on the graph (the term-by-term reference once per style; phase_time_s,
                # equal to it by test_phase_time_equals_the_full_formula_3, for the other rules) and formula 1
                full = (rule, layout) == ("vllm", "blocks")
                assert step.dispatch_s == pytest.approx(formula_3(topo, rows * 1000.0, full), rel=1e-12)
                assert step.combine_s == pytest.approx(formula_3(topo, rows.T * 700.0, full), rel=1e-12)
                per_slot = traffic.rows_per_slot.reshape(gpus, slots)
                busiest = max(gpu_expert_work(r, SMALL.hidden, SMALL.intermediate, SMALL.dtype_bytes,
                                              topo.gpu.flops_per_s, topo.gpu.memory_bytes_per_s, weights="once").time_s
                              for r in per_slot)
                assert step.compute_s == pytest.approx(busiest, rel=1e-12)


def test_layer_cost_sums_the_steps_and_means_the_nodes():
    rng = np.random.default_rng(7)
    row, ids = random_case(rng, 4, 2, 8, 0, 3, 30)
    other = np.stack([rng.choice(8, 3, replace=False) for _ in range(11)])
    topo = parse_topology_spec("2 nodes x 2 H100, 400 Gbit/s NIC per GPU")
    model = CommModel(topo, SMALL, dispatch_bytes_per_row=100.0)
    table = SlotTable(row, 4, 2, 8)
    cost = layer_cost(model, [ids, other], table)
    parts = [step_cost(model, x, token_sources(x.shape[0], 4, "blocks"), table) for x in (ids, other)]
    assert cost.tokens == 41
    assert cost.distinct_nodes_per_token == pytest.approx(sum(p.traffic.visited_nodes for p in parts) / 41)
    assert cost.rdma_bytes == pytest.approx(100.0 * sum(p.traffic.rdma_rows for p in parts))
    assert cost.layer_time_s == pytest.approx(sum(p.dispatch_s + p.compute_s + p.combine_s for p in parts))
    assert cost.node_recv_bytes.sum() == pytest.approx(cost.rdma_bytes)
    assert cost.to_dict()["layer_time_s"] == cost.layer_time_s


def test_vllm_rule_is_the_knuth_hash_of_the_token_index_in_slot_order():
    # vLLM 0.33: every expert of a token with index t in its rank's batch goes to replica
    # ((t * 2654435769) mod 2^32) mod replicas; expert 0 on slots 1 and 2, expert 1 on slots 0 and 3
    table = SlotTable(np.array([1, 0, 0, 1]), 4, 1, 2)
    ids = np.array([[0, 1], [1, 0], [0, 1], [0, 1]])
    home = np.array([0, 0, 3, 0])                       # local positions 0, 1, 0, 2
    assert local_positions(home, 4).tolist() == [0, 1, 0, 2]
    assert [(t * 2654435769) % 2**32 % 2 for t in (0, 1, 2)] == [0, 1, 0]
    slots = choose_replicas(ids, home, table, "vllm")
    assert slots.tolist() == [[1, 0], [3, 2], [1, 0], [1, 0]]


@pytest.mark.parametrize("replicas", [2, 3, 5, 8])
def test_the_token_level_vllm_rule_and_the_count_level_one_agree(replicas):
    # one rule, two views: the token-level choice (cost/comm) and its shares on counts (cost/replicas)
    tokens = 1000
    index = vllm_replica_index(np.arange(tokens), np.full(tokens, replicas))
    assert np.allclose(np.bincount(index, minlength=replicas) / tokens, vllm_hash_fractions(tokens, replicas))


def test_sglang_static_prefers_own_gpu_then_own_node_then_draws_fairly():
    # 2 nodes x 2 GPUs, 2 slots each; expert 0 on GPU 0 and GPU 3, expert 1 on GPU 1 only
    row = np.array([0, 2, 1, 3, 4, 5, 6, 0])
    table = SlotTable(row, 4, 2, 7)
    ids = np.array([[0], [0], [0], [0]])
    home = np.array([0, 1, 2, 3])
    slots = choose_replicas(ids, home, table, "sglang-static", seed=1)
    assert slots[:, 0].tolist() == [0, 0, 7, 7]  # own GPU (0, 3), else own node (1 -> GPU 0, 2 -> GPU 3)
    # nobody near: 8 ranks, 3 replicas of expert 0 off their nodes -> every replica drawn 2 or 3 times
    row = np.concatenate([np.array([0, 1, 0, 2, 0, 3]), np.arange(4, 14)])
    table = SlotTable(row, 8, 4, 14)  # expert 0 on GPUs 0, 1, 2 (nodes 0, 0, 1)
    chosen = choose_replicas(np.zeros((8, 1), dtype=int), np.arange(8), table, "sglang-static", seed=5)[:, 0]
    assert chosen[:2].tolist() == [0, 2] and chosen[2:4].tolist() == [4, 4]  # same GPU / same node
    assert sorted(np.bincount(chosen[4:], minlength=5)[[0, 2, 4]].tolist()) == [1, 1, 2]


def test_node_aware_uses_home_then_visited_nodes_then_least_loaded():
    # 2 nodes x 1 GPU x 3 slots: node 0 holds experts 0, 1, 2; node 1 holds 1, 3, 4
    table = SlotTable(np.array([0, 1, 2, 1, 3, 4]), 2, 2, 5)
    slots = choose_replicas(np.array([[1, 0], [3, 1]]), np.array([1, 0]), table, "node-aware")
    assert slots.tolist() == [[3, 0], [4, 1]]   # expert 1 from the home GPU whichever other node is visited
    # 3 nodes x 1 GPU x 2 slots: node 0 {0, 1}, node 1 {2, 3}, node 2 {2, 4}; every token lives on node 0
    table = SlotTable(np.array([0, 1, 2, 3, 2, 4]), 3, 3, 5)
    ids = np.array([[4, 2], [3, 2], [3, 1], [2, 0]])
    slots = choose_replicas(ids, np.zeros(4, dtype=int), table, "node-aware")
    # expert 2 where the token goes anyway (node 2, node 1); the last token visits no node with it: the
    # least-loaded replica (GPU 2 holds 2 rows by then, GPU 1 holds 3)
    assert slots.tolist() == [[5, 4], [3, 2], [3, 1], [4, 0]]


def test_water_fill_is_the_one_at_a_time_greedy():
    rng = np.random.default_rng(0)
    for _ in range(200):
        levels = rng.integers(0, 9, rng.integers(1, 6))
        amount = int(rng.integers(0, 20))
        greedy = levels.copy()
        for _ in range(amount):
            greedy[int(np.argmin(greedy))] += 1
        assert (levels + water_fill(levels, amount)).tolist() == greedy.tolist()


@pytest.mark.parametrize("spec", ["2 nodes x 4 H100, NVLink 450 GB/s, 400 Gbit/s NIC per GPU",
                                  "3 nodes x 2 A100, 100 Gbit/s NIC per GPU, 20 GB/s between nodes",
                                  "1 node x 4 A100-40GB-PCIe",
                                  "2 nodes x 2 H100, no NVLink, 200 Gbit/s NIC per GPU, PCIe 10 GB/s"])
def test_phase_time_equals_the_full_formula_3(spec):
    rng = np.random.default_rng(len(spec))
    topo = parse_topology_spec(spec)
    variants = [topo]
    if topo.num_servers > 1:
        variants.append(with_link_overrides(topo, [{"from": "leaf0", "to": "spine", "gb_per_s": 3},
                                                   {"from": "nic1", "to": "leaf0", "gb_per_s": 1}]))
    for t in variants:
        for _ in range(15):
            g = t.num_gpus
            volume = rng.random((g, g)) * 1e6 * (rng.random((g, g)) < rng.random())
            assert phase_time_s(t, volume) == pytest.approx(phase_lower_bound(t, volume).time_s, rel=1e-12, abs=0)


@pytest.mark.parametrize("weights", WEIGHT_MODES)
def test_vectorised_gpu_times_match_gpu_expert_work(weights):
    rng = np.random.default_rng(1)
    gpu = builtin_catalog().gpu("H100")
    rows = rng.integers(0, 300, (5, 4)).astype(float)
    rows[1] = 0.0
    block = 64 if weights == "tiles" else None
    for block_m in ({None, block} if weights != "tiles" else {64}):
        fast = gpu_times_s(rows, 2048, 768, 2.0, gpu.flops_per_s, gpu.memory_bytes_per_s, weights=weights,
                           block_m=block_m, profile=gpu.gemm_profile())
        slow = [gpu_expert_work(r, 2048, 768, 2.0, gpu.flops_per_s, gpu.memory_bytes_per_s, weights=weights,
                                block_m=block_m, profile=gpu.gemm_profile()).time_s for r in rows]
        assert fast == pytest.approx(slow, rel=1e-12)


@pytest.mark.parametrize("between, expected_ms", [(200, (0.336, 0.156, 0.336, 0.827)),
                                                  (50, (1.342, 0.156, 1.342, 2.841))])
def test_spec_c6_through_the_layer_time_model(between, expected_ms):
    """C6: 4 GPUs of server A send 1024 tokens x 8 rows of 8 KiB to 4 expert GPUs of server B. Here each
    token picks one expert on each of GPUs 8-11 (one row per destination GPU, 16 KiB: the same bytes)
    and an expert twice as wide (the same FLOPs per GPU); all-to-all dispatch, no weight reads."""
    topo = parse_topology_spec(f"2 nodes x 8 H100, NVLink 450 GB/s, 400 Gbit/s NIC per GPU, {between} GB/s between "
                               f"nodes")
    wide = ExpertShape("C6", 4096, 2 * 1536, 16, 4, 1)                        # 2 P_e = 2 * 6*4096*1536 FLOP
    model = CommModel(topo, wide, dispatch="all-to-all", weights="none", dispatch_bytes_per_row=16384.0,
                      combine_bytes_per_row=16384.0)
    table = SlotTable(np.arange(16), 16, 2, 16)                               # expert g on GPU g
    ids = np.tile(np.arange(8, 12), (1024, 1))
    home = np.arange(1024) // 256                                            # GPUs 0-3 hold the tokens
    step = step_cost(model, ids, home, table)
    got = (step.dispatch_s, step.compute_s, step.combine_s, step.dispatch_s + step.compute_s + step.combine_s)
    assert [round(x * 1e3, 3) for x in got] == list(expected_ms)


def test_compute_only_for_count_level_loads_splits_replicas_evenly():
    topo = cluster_topology(4, 2)
    model = CommModel(topo, SMALL, weights="none")
    row = np.array([0, 1, 2, 3, 0, 4, 5, 6])   # expert 0 twice (GPUs 0 and 2)
    loads = np.array([[80.0, 10, 10, 10, 10, 10, 10]])
    per_gpu = [80 / 2 + 10, 20, 80 / 2 + 10, 20]
    expected = max(per_gpu) * SMALL.flops_per_row() / topo.gpu.flops_per_s
    assert compute_only_s(model, loads, row, 4) == pytest.approx(expected)


def test_the_default_cluster_is_h100_nodes_with_nvlink_and_a_nic_per_gpu():
    topo = cluster_topology(32, 4)
    assert (topo.num_servers, topo.gpus_per_server) == (4, 8)
    caps = {d["kind"]: d["capacity"] for _, _, d in topo.graph.edges(data=True)}
    assert caps["nvlink"] == 450e9 and caps["nic"] == 50e9 and "H100" in topo.gpu.name
    # the one builder behind the replay's cost model and the layer-time model: the same cluster
    assert sorted(cluster_cost(32, 4).topology.graph.edges(data=True)) == sorted(topo.graph.edges(data=True))
    with pytest.raises(InputError, match="--nodes"):
        cluster_topology(32, 3)


def test_bad_model_options_name_themselves():
    topo = cluster_topology(4, 2)
    with pytest.raises(InputError, match="dispatch"):
        CommModel(topo, SMALL, dispatch="ring")
    with pytest.raises(InputError, match="replica choice"):
        CommModel(topo, SMALL, replica_choice="closest")
    with pytest.raises(InputError, match="block_m"):
        CommModel(topo, SMALL, weights="tiles")
    with pytest.raises(InputError, match="topology"):
        layer_cost(CommModel(topo, SMALL), [np.zeros((2, 1), dtype=int)], SlotTable(np.arange(8), 8, 2, 8))
    with pytest.raises(InputError, match="token home"):
        token_sources(4, 2, "random")


def test_qwen_preset_row_bytes_and_flops():
    qwen = get_model("Qwen3-30B-A3B")
    model = CommModel(cluster_topology(8, 2), qwen)
    assert model.dispatch_row_bytes == 2048 * 2 and model.describe()["replica_choice"] == "sglang-static"
