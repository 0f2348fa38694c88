"""SGLang `--init-expert-location` export: the file holds exactly what SGLang's loader accepts."""

import json

import numpy as np
import pytest

from moe_place.engines.sglang import MAP_KEY, init_expert_location, write_init_expert_location
from moe_place.errors import InputError
from moe_place.placement import Placement


def _plan(layers=3, experts=8, gpus=4, redundant=4, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(layers):
        # every expert once, plus `redundant` extra replicas on GPUs that do not hold them yet
        base = rng.permutation(experts).reshape(gpus, -1).tolist()
        extra = rng.permutation(experts)
        for g in range(gpus):
            for e in extra:
                if len(base[g]) < (experts + redundant) // gpus and e not in base[g]:
                    base[g].append(int(e))
        rows.append(np.concatenate(base))
    return Placement(np.stack(rows), experts, gpus)


def test_plan_rows_land_on_their_model_layers_and_dense_layers_get_the_trivial_row():
    plan = _plan(layers=3)
    loc = init_expert_location(plan, layer_ids=(3, 4, 5), dense_layer_ids=(0, 1, 2))
    m = loc.physical_to_logical_map
    assert m.shape == (6, plan.num_physical)
    np.testing.assert_array_equal(m[3:], plan.phy2log)
    trivial = np.arange(plan.num_physical) % plan.num_experts
    for layer in (0, 1, 2):
        np.testing.assert_array_equal(m[layer], trivial)
    assert loc.unplanned_moe_layers == ()
    # every row is a valid map: each logical expert at least once, slots divisible by the EP size
    assert all(set(row) == set(range(plan.num_experts)) for row in m.tolist())
    assert m.shape[1] % plan.num_gpus == 0


def test_moe_only_plan_rows_are_assigned_to_moe_layers_in_order():
    plan = _plan(layers=3)
    loc = init_expert_location(plan, dense_layer_ids=(0,))  # plan ids 0..2 collide with dense layer 0
    assert loc.physical_to_logical_map.shape[0] == 4
    np.testing.assert_array_equal(loc.physical_to_logical_map[1:], plan.phy2log)
    assert loc.planned_layers == (1, 2, 3)


def test_layers_missing_from_the_plan_are_reported():
    plan = _plan(layers=2)
    loc = init_expert_location(plan, layer_ids=(0, 7), num_model_layers=10)
    assert loc.physical_to_logical_map.shape == (10, plan.num_physical)
    assert loc.unplanned_moe_layers == (1, 2, 3, 4, 5, 6, 8, 9)
    with pytest.raises(InputError, match="num_model_layers"):
        init_expert_location(plan, layer_ids=(0, 7), num_model_layers=5)
    with pytest.raises(InputError, match="dense"):
        init_expert_location(plan, layer_ids=(0, 7), dense_layer_ids=(7,), num_model_layers=10)


@pytest.mark.parametrize("suffix", [".json", ".pt"])
def test_file_holds_only_the_map_key_and_round_trips(tmp_path, suffix):
    plan = _plan()
    loc = init_expert_location(plan)
    out = tmp_path / f"loc{suffix}"
    write_init_expert_location(out, loc)
    # SGLang passes the dict's entries as keyword arguments to its mapping constructor
    if suffix == ".json":
        data = json.loads(out.read_text())
    else:
        import torch

        data = torch.load(out, weights_only=True)
        assert data[MAP_KEY].dtype == torch.int64
    assert set(data) == {MAP_KEY}
    np.testing.assert_array_equal(np.asarray(data[MAP_KEY]), plan.phy2log)
    assert not list(tmp_path.glob(".*.tmp"))  # atomic write leaves no temporary behind


def test_bad_suffix_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match=".json or .pt"):
        write_init_expert_location(tmp_path / "x.txt", init_expert_location(_plan()))


# ---------------------------------------------------------------------- online: the payback rebalance hook
def test_rebalance_hook_balances_from_trivial_keeps_the_map_on_noise_and_follows_a_new_hot_expert(monkeypatch):
    """Against stand-ins named like SGLang 0.5.23's (`sglang/srt/eplb/eplb_algorithms/__init__.py`:
    `rebalance_experts(tokens_per_expert, num_physical_experts, num_local_physical_experts, num_groups,
    num_nodes, algorithm)`, called by `expert_location.py` `ExpertLocationMetadata.init_by_eplb` with the
    recorder's per-pass counts `[passes, layers, E]`; the start map `init_trivial` is `p % E`)."""
    import sys
    import types

    torch = pytest.importorskip("torch")
    from moe_place.engines import sglang as adapter
    from moe_place.engines.config import EngineConfig
    from moe_place.solvers.deepseek import eplb_rebalance

    original = object()
    algorithms = types.ModuleType(adapter.ALGORITHMS_MODULE)
    algorithms.rebalance_experts = original
    for name in ("sglang", "sglang.srt", "sglang.srt.eplb"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, adapter.ALGORITHMS_MODULE, algorithms)
    rng = np.random.default_rng(0)
    layers, experts, gpus, physical, passes = 3, 64, 8, 72, 200
    w = rng.zipf(1.3, size=(layers, experts)).clip(max=50).astype(float)
    share = w / w.sum(axis=1, keepdims=True)

    def window(share, seed):  # per-pass multinomial counts, 4096 tokens x top-8 per pass
        draw = np.random.default_rng(seed)
        return torch.from_numpy(np.stack([[draw.multinomial(4096 * 8, p) for p in share] for _ in range(passes)]))

    in_use = {"map": np.tile(np.arange(physical) % experts, (layers, 1))}   # SGLang's trivial start
    hook = adapter.PaybackRebalance(EngineConfig(model="Qwen3-30B-A3B", step_interval=1000, migration="stall"),
                                    current_map=lambda: torch.from_numpy(in_use["map"].copy()))
    handle = adapter.install_rebalance_hook(hook)
    assert algorithms.rebalance_experts is hook

    def call(counts):
        phy2log, log2phy, logcnt = algorithms.rebalance_experts(counts, physical, physical // gpus, None, 1, None)
        assert logcnt.shape == (layers, experts) and phy2log.dtype == torch.int64
        in_use["map"] = phy2log.numpy()
        return in_use["map"]

    def busiest_over_mean(rows, load):
        gpu = Placement(rows, experts, gpus, allow_colocated=True).gpu_loads(load)
        return gpu.max(axis=1) / gpu.mean(axis=1)

    first = call(window(share, 1))
    eplb = eplb_rebalance(window(share, 1).numpy().sum(axis=0).astype(float), physical, 1, 1, gpus)
    assert (busiest_over_mean(first, share) <= busiest_over_mean(eplb, share) + 0.01).all()
    for seed in (2, 3):  # the same load, new samples: SGLang copies nothing
        assert np.array_equal(call(window(share, seed)), first)
    hot = share.copy()
    cold = int(np.argmin(share[0]))
    hot[:, cold] = 5 / experts
    hot /= hot.sum(axis=1, keepdims=True)
    moved = call(window(hot, 4))
    assert (moved != first).sum() > 0
    assert busiest_over_mean(moved, hot).sum() < busiest_over_mean(first, hot).sum()
    adapter.uninstall_rebalance_hook(handle)
    adapter.uninstall_rebalance_hook(handle)
    assert algorithms.rebalance_experts is original
