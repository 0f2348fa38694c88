"""Placement: validation, derived maps, loads under the even split."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_place.errors import InputError
from moe_place.placement import Placement


def test_vllm_glossary_example_shapes():
    # 256 logical + 32 redundant = 288 physical experts on 32 GPUs: 9 slots each.
    p = Placement.contiguous(num_layers=2, num_experts=256, num_gpus=32, num_nodes=4, num_redundant=32)
    assert p.num_physical == 288 and p.slots_per_gpu == 9 and p.gpus_per_node == 8
    assert p.logcnt.shape == (2, 256) and p.logcnt.sum(axis=1).tolist() == [288, 288]
    assert p.logcnt[0, :32].tolist() == [2] * 32 and p.logcnt[0, 32:].max() == 1
    assert p.log2phy.shape == (2, 256, 2)
    assert p.log2phy[0, 0].tolist() == [0, 256] and p.log2phy[0, 100].tolist() == [100, -1]


def test_log2phy_inverts_phy2log():
    phy2log = np.array([[0, 1, 2, 0, 3, 1], [3, 2, 1, 0, 2, 3]])
    p = Placement(phy2log, num_experts=4, num_gpus=3)
    for layer in range(2):
        for expert in range(4):
            slots = [s for s in p.log2phy[layer, expert] if s >= 0]
            assert slots == sorted(np.flatnonzero(phy2log[layer] == expert).tolist())
            assert len(slots) == p.logcnt[layer, expert]


def test_gpu_loads_even_split_by_hand():
    # GPU0 holds experts 0,1; GPU1 holds 0,2. Expert 0 (load 10) is split 5/5.
    p = Placement(np.array([[0, 1, 0, 2]]), num_experts=3, num_gpus=2)
    loads = np.array([[10.0, 3.0, 4.0]])
    assert p.gpu_loads(loads).tolist() == [[8.0, 9.0]]
    assert p.slot_loads(loads).tolist() == [[5.0, 3.0, 5.0, 4.0]]


@pytest.mark.parametrize(
    "phy2log, experts, gpus, nodes, field",
    [
        ([[0, 1, 2]], 4, 1, 1, "phy2log"),            # fewer slots than experts
        ([[0, 1, 2, 2]], 4, 1, 1, "phy2log[0]"),      # expert 3 has no slot
        ([[0, 1, 2, 4]], 4, 1, 1, "phy2log"),         # id out of range
        ([[0, 1, 2, 3]], 4, 3, 1, "num_gpus"),        # 4 slots on 3 GPUs
        ([[0, 1, 2, 3]], 4, 2, 3, "num_nodes"),       # 2 GPUs on 3 nodes
        ([[0, 0, 1, 2, 3, 3]], 4, 2, 1, "phy2log[0]"),  # two replicas of expert 0 on GPU 0
        ([0, 1, 2, 3], 4, 1, 1, "phy2log"),           # 1-D
    ],
)
def test_bad_placements_name_the_field(phy2log, experts, gpus, nodes, field):
    with pytest.raises(InputError) as err:
        Placement(np.array(phy2log), experts, gpus, nodes)
    assert str(err.value).startswith(field + ":")


def test_colocated_replicas_allowed_only_when_asked():
    phy2log = np.array([[0, 0, 1, 2, 3, 3]])
    p = Placement(phy2log, 4, 2, allow_colocated=True)
    assert p.logcnt.tolist() == [[2, 1, 1, 2]]


def test_moved_slots():
    old = Placement(np.array([[0, 1, 2, 3]]), 4, 2)
    new = Placement(np.array([[0, 2, 1, 3]]), 4, 2)
    assert new.moved_slots(old).tolist() == [[False, True, True, False]]


def test_arrays_are_read_only():
    p = Placement.contiguous(1, 4, 2)
    with pytest.raises(ValueError):
        p.phy2log[0, 0] = 1


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.integers(0, 6), st.integers(0, 2**32 - 1))
def test_random_valid_placements_conserve_load(experts, gpus, extra, seed):
    rng = np.random.default_rng(seed)
    slots = gpus * max(1, -(-(experts + extra) // gpus))
    if slots > experts * gpus:  # cannot avoid two replicas of one expert on one GPU
        return
    # deal each expert once, then fill the rest with experts a GPU does not hold yet
    per_gpu = [[] for _ in range(gpus)]
    order = list(range(experts)) + list(rng.integers(0, experts, size=slots - experts))
    for e in order:
        free = [g for g in range(gpus) if len(per_gpu[g]) < slots // gpus and e not in per_gpu[g]]
        if not free:
            return
        per_gpu[free[0]].append(int(e))
    p = Placement(np.array([sum(per_gpu, [])]), experts, gpus)
    loads = rng.integers(0, 100, size=(1, experts)).astype(float)
    assert np.isclose(p.gpu_loads(loads).sum(), loads.sum())


def _keep_by_slot_order(new: np.ndarray, old: np.ndarray, slots: int) -> np.ndarray:
    """keep_unchanged_slots as its docstring says, one GPU and one old slot at a time (the reference)."""
    out = np.empty_like(new)
    for r, (fresh, before) in enumerate(zip(new.reshape(-1, slots), old.reshape(-1, slots))):
        left, row = list(fresh), [-1] * slots
        for i, expert in enumerate(before):
            if expert in left:
                row[i] = expert
                left.remove(expert)
        for i in range(slots):
            if row[i] < 0:
                row[i] = left.pop(0)
        out.reshape(-1, slots)[r] = row
    return out


def _greedy_reference(score: np.ndarray) -> list[int]:
    """max_overlap_matching's rule on one matrix, entry by entry: the largest free positive entry,
    row-major on ties; then unmatched columns take the free rows in order."""
    n, row_of, free = len(score), [-1] * len(score), score.astype(float).copy()
    while (free > 0).any():
        i, j = divmod(int(np.argmax(free)), n)
        row_of[j] = i
        free[i, :] = 0
        free[:, j] = 0
    rows = [i for i in range(n) if i not in row_of]
    return [row if row >= 0 else rows.pop(0) for row in row_of]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.integers(1, 3), st.integers(0, 10_000), st.booleans())
def test_keep_unchanged_slots_and_matching_against_references(slots, gpus, layers, seed, repeats):
    """The vectorised slot keeping (with co-located copies numbered) and both batch paths of the greedy
    matching (a walk for few matrices, numpy rounds for many) agree with one-at-a-time references."""
    from moe_place.placement import _greedy_by_rounds, _greedy_by_walk, keep_unchanged_slots, max_overlap_matching
    rng = np.random.default_rng(seed)
    experts = max(1, (slots * gpus) // 2 if repeats else slots * gpus)
    new = rng.integers(0, experts, size=(layers, slots * gpus))
    old = rng.integers(0, experts, size=(layers, slots * gpus))
    assert np.array_equal(keep_unchanged_slots(new, old, slots), _keep_by_slot_order(new, old, slots))
    scores = rng.integers(0, 3, size=(20, gpus, gpus)).astype(float)
    expected = np.array([_greedy_reference(m) for m in scores])
    assert np.array_equal(max_overlap_matching(scores), expected)          # 20 matrices: numpy rounds
    assert np.array_equal(max_overlap_matching(scores[:3]), expected[:3])  # 3: the walk
    assert np.array_equal(_greedy_by_walk(scores), _greedy_by_rounds(scores))


def test_placement_owns_its_map():
    """An engine updates its map tensor in place: a Placement made from it (or from a numpy view of
    it) must not change with it, and must not make the engine's array read-only."""
    torch = pytest.importorskip("torch")
    engine_map = torch.arange(8).reshape(2, 4) % 4
    placement = Placement(engine_map.numpy(), 4, 2)
    engine_map[0].copy_(torch.tensor([3, 2, 1, 0]))       # the engine applies its next map
    assert placement.phy2log[0].tolist() == [0, 1, 2, 3]
    rows = np.tile(np.arange(4), (2, 1))
    Placement(rows, 4, 2)
    assert rows.flags.writeable
