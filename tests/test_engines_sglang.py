"""SGLang `--init-expert-location` export: the file holds exactly what SGLang's loader accepts."""

import json

import numpy as np
import pytest

from moe_place.engines.sglang import (MAP_KEY, init_expert_location, read_init_expert_location,
                                      write_init_expert_location)
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
    np.testing.assert_array_equal(read_init_expert_location(out), plan.phy2log)
    assert not list(tmp_path.glob(".*.tmp"))  # atomic write leaves no temporary behind


def test_bad_suffix_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match=".json or .pt"):
        write_init_expert_location(tmp_path / "x.txt", init_expert_location(_plan()))


# ---------------------------------------------------------------------- online: the payback rebalance hook
def test_rebalance_hook_keeps_the_map_on_noise_and_moves_within_the_cap(monkeypatch):
    """Against stand-ins named like SGLang's (`sglang/srt/eplb/eplb_algorithms/__init__.py` @
    7d81985a32df17c1bb184fdd5ac7560482b58119: `rebalance_experts(tokens_per_expert, num_physical_experts,
    num_local_physical_experts, num_groups, num_nodes, algorithm)`, called by `expert_location.py` @
    6270b01498692d05d29267efe96d0eb7d9824545 `init_by_eplb` with per-pass counts `[passes, layers, E]`)."""
    import sys
    import types

    torch = pytest.importorskip("torch")
    from moe_place.engines import sglang as adapter
    from moe_place.engines.config import EngineConfig
    from moe_place.eplb import plan_placement

    original = object()
    algorithms = types.ModuleType(adapter.ALGORITHMS_MODULE)
    algorithms.rebalance_experts = original
    for name in ("sglang", "sglang.srt", "sglang.srt.eplb"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, adapter.ALGORITHMS_MODULE, algorithms)
    rng = np.random.default_rng(0)
    layers, experts, gpus, physical = 3, 64, 8, 72
    w = rng.zipf(1.3, size=(layers, experts)).clip(max=50).astype(float)
    per_pass = w / w.sum(axis=1, keepdims=True) * 4096 * 8
    old = np.array(plan_placement(per_pass, physical, None, 1, gpus).phy2log)
    hook = adapter.PaybackRebalance(EngineConfig(model="Qwen3-30B-A3B", step_interval=1000),
                                    current_map=lambda: torch.from_numpy(old))
    handle = adapter.install_rebalance_hook(hook)
    assert algorithms.rebalance_experts is hook
    # the plan for load w: the map the controller settles on for w (a plan for the busiest load
    # alone can still gain on the cost model's padded tile time, so the controller refines it first)
    for _ in range(20):
        settled = algorithms.rebalance_experts(torch.from_numpy(np.stack([per_pass] * 100)), physical, 8, None, 1,
                                               None)[0].numpy()
        if np.array_equal(settled, old):
            break
        old = settled
    else:
        raise AssertionError("the controller kept moving on a constant load")
    noisy = np.stack([per_pass * (1 + 0.01 * rng.standard_normal(per_pass.shape)) for _ in range(100)])
    phy2log, log2phy, logcnt = algorithms.rebalance_experts(torch.from_numpy(noisy), physical, 8, None, 1, None)
    assert np.array_equal(phy2log.numpy(), old)  # SGLang copies nothing
    hot = noisy.copy()
    hot[:, :, int(np.argmin(per_pass[0]))] = 5 * per_pass.mean()
    phy2log, _, logcnt = algorithms.rebalance_experts(torch.from_numpy(hot), physical, 8, None, 1, None)
    changed = (phy2log.numpy() != old).sum(axis=1)
    assert changed.sum() > 0 and (changed <= 2).all()
    assert logcnt.shape == (layers, experts) and phy2log.dtype == torch.int64
    adapter.uninstall_rebalance_hook(handle)
    adapter.uninstall_rebalance_hook(handle)
    assert algorithms.rebalance_experts is original
