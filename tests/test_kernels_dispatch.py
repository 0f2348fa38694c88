"""Dispatch (row gather, replica choice) and combine kernels vs references; the local MoE layer end to end."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch

from moe_place.errors import InputError
from moe_place.kernels.align import align
from moe_place.kernels.combine import combine, combine_torch
from moe_place.kernels.dispatch import (choose_slots, dispatch, dispatch_torch, gather_rows, send_plan,
                                        split_tokens)
from moe_place.kernels.grouped_gemm import expert_mlp, expert_mlp_torch
from moe_place.placement import Placement

from test_kernels_gemm import DEVICE, in_nan_buffer, routing


def reference_slots(topk_ids: np.ndarray, phy2log: np.ndarray, num_gpus: int, source: int, policy: str) -> np.ndarray:
    """Plain-python split policy: the j-th pair of expert e from `source` takes replica (j + source) % logcnt."""
    slots_per_gpu = len(phy2log) // num_gpus
    replicas = defaultdict(list)
    for slot, expert in enumerate(phy2log):
        replicas[int(expert)].append(slot)
    seen = defaultdict(int)
    out = np.empty_like(topk_ids)
    for t in range(topk_ids.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            local = [s for s in replicas[e] if s // slots_per_gpu == source]
            if policy == "local" and local:
                out[t, j] = local[0]
            else:
                out[t, j] = replicas[e][(seen[e] + source) % len(replicas[e])]
            seen[e] += 1
    return out


@pytest.mark.parametrize("tokens,top_k", [(255, 1), (371, 8), (1023, 2)])
def test_dispatch_exact_for_integers(tokens, top_k):
    ids = routing(tokens, top_k, 16, seed=tokens, skew="empty").to(DEVICE)
    layout = align(ids, 16, 32)
    x = torch.randint(-2**30, 2**30, (tokens, 48), dtype=torch.int32, device=DEVICE)
    out = dispatch(in_nan_buffer(x), layout)  # int32: the "NaN" padding becomes garbage ints
    assert torch.equal(out, dispatch_torch(x, layout))
    # rows of expert e are exactly the tokens that chose e, in token order
    e = int(torch.argmax(layout.rows_per_expert))
    start, end = layout.offsets[e].item(), layout.offsets[e + 1].item()
    tokens_of_e = torch.nonzero((ids == e).any(dim=1)).flatten()
    assert torch.equal(out[start:end], x[tokens_of_e])


def test_gather_rows_inside_nan_buffer():
    src = torch.randn(300, 80, device=DEVICE)
    index = torch.randint(0, 300, (511,), device=DEVICE)
    out = gather_rows(in_nan_buffer(src), index, block_r=64, block_h=64)
    assert torch.equal(out, src[index])
    with pytest.raises(InputError, match="row ids in"):
        gather_rows(src, torch.tensor([300], device=DEVICE))


def test_hot_path_skips_only_the_index_check():
    """check_index=False gives the same rows (no host sync, so a CUDA graph can capture it)."""
    src = torch.randn(300, 80, device=DEVICE)
    index = torch.randint(0, 300, (257,), device=DEVICE)
    assert torch.equal(gather_rows(src, index, check_index=False), src[index])
    weights = torch.softmax(torch.randn(257 // 1, 1, device=DEVICE), dim=1)
    rows = torch.arange(257, device=DEVICE)
    y = gather_rows(src, index, check_index=False)
    assert torch.equal(combine(y, rows, weights, check_index=False), combine(y, rows, weights))
    with pytest.raises(InputError, match="rows of y"):
        combine(y, rows + 1, weights)


@pytest.mark.parametrize("tokens,top_k", [(255, 1), (371, 8), (1023, 8)])
def test_combine_matches_torch(tokens, top_k):
    ids = routing(tokens, top_k, 16, seed=tokens).to(DEVICE)
    layout = align(ids, 16, 32)
    y = torch.randn(layout.num_pairs, 64, device=DEVICE).bfloat16()
    weights = torch.softmax(torch.randn(tokens, top_k, device=DEVICE), dim=1)
    tri = combine(in_nan_buffer(y), layout.inverse_rows(), weights)
    ref = combine_torch(y, layout.inverse_rows(), weights)
    assert not torch.isnan(tri).any()
    torch.testing.assert_close(tri.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_combine_exact_for_integer_values():
    tokens, top_k = 371, 8
    ids = routing(tokens, top_k, 16, seed=3).to(DEVICE)
    layout = align(ids, 16, 64)
    x = torch.randint(-1000, 1000, (tokens, 32), device=DEVICE).float()
    # dispatch then combine with weights 1 and 2^-3 brings back exactly x * (k - 1 + 1/8)
    weights = torch.ones(tokens, top_k, device=DEVICE)
    weights[:, 0] = 0.125
    out = combine(dispatch(x, layout), layout.inverse_rows(), weights)
    assert torch.equal(out, x * (top_k - 1 + 0.125))


@pytest.mark.parametrize("tokens,top_k", [(255, 1), (67, 8)])
def test_local_moe_layer_matches_per_token_reference(tokens, top_k):
    """dispatch -> grouped GEMM -> combine equals, per token, the weighted sum of its experts' MLPs."""
    experts, hidden, inter = 16, 64, 128
    ids = routing(tokens, top_k, experts, seed=top_k, skew="empty").to(DEVICE)
    weights = torch.softmax(torch.randn(tokens, top_k, device=DEVICE), dim=1)
    x = torch.randn(tokens, hidden, device=DEVICE).bfloat16()
    w13 = (torch.randn(experts, 2 * inter, hidden, device=DEVICE) / 8).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, device=DEVICE) / 11).bfloat16()
    layout = align(ids, experts, 64)
    y = expert_mlp(dispatch(x, layout), w13, w2, layout, block_n=128, block_k=64)
    out = combine(y, layout.inverse_rows(), weights).float()
    ref = torch.zeros(tokens, hidden, device=DEVICE)
    for j in range(top_k):
        for e in range(experts):
            sel = ids[:, j] == e
            one = torch.tensor([int(sel.sum())])
            ref[sel] += weights[sel, j, None] * expert_mlp_torch(x[sel], w13[e:e + 1], w2[e:e + 1], one)
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("policy", ["even", "local"])
def test_choose_slots_matches_reference_policy(policy):
    num_gpus, experts = 4, 16
    rng = np.random.default_rng(1)
    phy2log = np.concatenate([np.arange(experts), rng.choice(experts, 4, replace=False)])
    phy2log = rng.permutation(phy2log).reshape(num_gpus, -1)
    # re-draw until no GPU holds two replicas of one expert (Placement validates that)
    while any(len(set(row)) < len(row) for row in phy2log):
        phy2log = rng.permutation(phy2log.reshape(-1)).reshape(num_gpus, -1)
    phy2log = phy2log.reshape(-1)
    Placement(phy2log[None, :], experts, num_gpus)
    ids = routing(371, 4, experts, seed=7)
    bounds = split_tokens(371, num_gpus)
    traffic = np.zeros((num_gpus, num_gpus), dtype=np.int64)
    for src in range(num_gpus):
        part = ids[bounds[src]:bounds[src + 1]]
        got = choose_slots(part, torch.from_numpy(phy2log), num_gpus, src, policy).numpy()
        want = reference_slots(part.numpy(), phy2log, num_gpus, src, policy)
        np.testing.assert_array_equal(got, want)
        assert (phy2log[got] == part.numpy()).all()  # a replica of the chosen expert, never another expert
        plan = send_plan(part, torch.from_numpy(phy2log), num_gpus, src, policy)
        traffic[src] = plan.send_counts.numpy()
        assert (np.diff(plan.slot_of_row.numpy()) >= 0).all()  # send buffer grouped by rank, then slot
    assert traffic.sum() == 371 * 4
    if policy == "local":
        # every expert with a replica on the source rank is served there: more local rows than `even`
        even = sum(send_plan(ids[bounds[s]:bounds[s + 1]], torch.from_numpy(phy2log), num_gpus, s).send_counts[s]
                   for s in range(num_gpus))
        assert np.trace(traffic) >= int(even)


def test_choose_slots_rejects_bad_policy():
    with pytest.raises(InputError, match="split policy"):
        choose_slots(torch.zeros(2, 1, dtype=torch.int64), torch.arange(4), 2, 0, "random")
