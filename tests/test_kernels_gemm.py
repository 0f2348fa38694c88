"""Align + grouped GEMM: Triton kernels (interpreter on CPU) vs plain-torch/numpy references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_place.cost.gemm import padded_rows
from moe_place.errors import InputError
from moe_place.kernels.align import align, align_numpy, layout_from_rows
from moe_place.kernels.grouped_gemm import (expert_mlp, expert_mlp_torch, fp8_supported, grouped_gemm,
                                            quantize_fp8)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, INTER = 64, 128  # tiny sizes: one K-step per program in the interpreter


def in_nan_buffer(t: torch.Tensor, pad: int = 8) -> torch.Tensor:
    """A copy of `t` living inside a bigger NaN-filled buffer (offset and padded strides)."""
    big = torch.full([n + 2 * pad for n in t.shape], float("nan"), dtype=torch.float32, device=t.device).to(t.dtype)
    view = big[tuple(slice(pad, pad + n) for n in t.shape)]
    view.copy_(t)
    return view


def routing(tokens: int, top_k: int, num_experts: int, seed: int, skew: str = "uniform") -> torch.Tensor:
    """int64 [tokens, k] distinct expert ids per token."""
    gen = torch.Generator().manual_seed(seed)
    if skew == "one_expert":
        return torch.full((tokens, top_k), 3, dtype=torch.int64)
    scores = torch.rand(tokens, num_experts, generator=gen)
    if skew == "empty":  # experts 1 and 5 never chosen
        scores[:, [1, 5]] = -1.0
    return scores.topk(top_k, dim=1).indices


def weights(num_experts: int, seed: int, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * INTER, HIDDEN, generator=gen) / HIDDEN ** 0.5
    w2 = torch.randn(num_experts, HIDDEN, INTER, generator=gen) / INTER ** 0.5
    return w13.to(dtype).to(DEVICE), w2.to(dtype).to(DEVICE)


# ------------------------------------------------------------------------------------------ align
@pytest.mark.parametrize("tokens,top_k,block_m,pad_empty", [(255, 1, 16, False), (37, 8, 32, True), (1, 2, 64, False)])
def test_align_matches_numpy_reference(tokens, top_k, block_m, pad_empty):
    ids = routing(tokens, top_k, 16, seed=tokens, skew="empty")
    layout = align(ids, 16, block_m, pad_empty)
    ref = align_numpy(ids.numpy(), 16, block_m, pad_empty)
    for name, expected in ref.items():
        np.testing.assert_array_equal(getattr(layout, name).cpu().numpy(), expected, err_msg=name)
    # every pair appears once; inverse_rows undoes the sort
    assert sorted(layout.sorted_pair_ids.tolist()) == list(range(tokens * top_k))
    inv = layout.inverse_rows()
    assert torch.equal(layout.sorted_pair_ids[inv], torch.arange(tokens * top_k))
    assert layout.num_padded_rows == int(layout.padded_offsets[-1])


def test_align_c8_padding_counts():
    """row C8: rows [32,16,8,4,2,1,1,0], BLOCK_M=32 -> 64 valid, 224 padded (3.5x), 256 if all padded (4x)."""
    rows = [32, 16, 8, 4, 2, 1, 1, 0]
    plain = layout_from_rows(rows, 32)
    every = layout_from_rows(rows, 32, pad_empty=True)
    assert plain.num_pairs == 64
    assert plain.num_padded_rows == 224 and plain.num_padded_rows / plain.num_pairs == 3.5
    assert every.num_padded_rows == 256
    assert int((plain.padded_row_ids >= 0).sum()) == 64  # padding rows are exactly the -1 rows


def test_padded_rows_equal_cost_model():
    """The kernel's own layout executes as many rows as the cost model's padding formula says."""
    rng = np.random.default_rng(5)
    cases = [np.array([32, 16, 8, 4, 2, 1, 1, 0])] + [rng.integers(0, 300, size=16) for _ in range(5)]
    for rows in cases:
        for block_m in (16, 32, 64, 128):
            for pad_empty in (False, True):
                layout = layout_from_rows(rows, block_m, pad_empty=pad_empty)
                predicted = padded_rows(rows, block_m, pad_empty=pad_empty)
                assert layout.num_padded_rows == int(np.sum(predicted)), (rows, block_m, pad_empty)


def test_align_rejects_bad_ids():
    with pytest.raises(InputError, match="expert ids in"):
        align(torch.tensor([[0, 9]]), 8, 16)
    with pytest.raises(InputError, match="2-D"):
        align(torch.tensor([0, 1]), 8, 16)


# ------------------------------------------------------------------------------------------ GEMM
CASES = [  # tokens, top_k, experts, routing skew, BLOCK_M
    (255, 1, 8, "uniform", 32),
    (371, 2, 8, "empty", 64),
    (1023, 1, 4, "one_expert", 128),
    (47, 8, 16, "empty", 16),
]


@pytest.mark.parametrize("tokens,top_k,num_experts,skew,block_m", CASES)
@pytest.mark.parametrize("padded", [True, False])
def test_expert_mlp_matches_torch(tokens, top_k, num_experts, skew, block_m, padded):
    ids = routing(tokens, top_k, num_experts, seed=tokens + top_k, skew=skew).to(DEVICE)
    layout = align(ids, num_experts, block_m)
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(layout.num_pairs, HIDDEN, generator=gen)).to(torch.bfloat16).to(DEVICE)
    w13, w2 = weights(num_experts, seed=2)
    tri = expert_mlp(in_nan_buffer(x), in_nan_buffer(w13), in_nan_buffer(w2), layout, padded=padded,
                     block_n=128, block_k=64)
    ref = expert_mlp_torch(x, w13, w2, layout.rows_per_expert)
    assert tri.shape == (tokens * top_k, HIDDEN) and tri.dtype == torch.bfloat16
    assert not torch.isnan(tri).any(), "a padding row or an out-of-range element was read"
    torch.testing.assert_close(tri.float(), ref, atol=3e-2, rtol=3e-2)


def test_one_expert_equals_dense_ffn():
    """Degenerate case: every row on one expert is the dense MLP of that expert's weights."""
    x = torch.randn(255, HIDDEN).to(torch.bfloat16).to(DEVICE)
    w13, w2 = weights(1, seed=3)
    layout = align(torch.zeros(255, 1, dtype=torch.int64, device=DEVICE), 1, 64)
    gate, up = (x.float() @ w13[0].float().T).chunk(2, dim=1)
    dense = (torch.nn.functional.silu(gate) * up).to(torch.bfloat16).float() @ w2[0].float().T
    torch.testing.assert_close(expert_mlp(x, w13, w2, layout, block_n=128).float(), dense, atol=3e-2, rtol=3e-2)


def test_fp32_gemm_exact_and_empty_batch():
    """A plain grouped GEMM in fp32 (exact in the interpreter; TF32 on a GPU) and a batch with no rows."""
    ids = routing(100, 2, 8, seed=9, skew="empty").to(DEVICE)
    layout = align(ids, 8, 32, pad_empty=True)
    a = torch.randn(layout.num_pairs, 72, device=DEVICE)  # K=72: a partial last K-step
    w = torch.randn(8, 80, 72, device=DEVICE)  # N=80: a partial last N-tile
    out = grouped_gemm(in_nan_buffer(a), in_nan_buffer(w), layout, block_n=64, block_k=32)
    ref = torch.cat([a[s:e] @ w[x].T for x, (s, e) in
                     enumerate(zip(layout.offsets[:-1].tolist(), layout.offsets[1:].tolist()))])
    tol = 1e-5 if DEVICE == "cpu" else 2e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    empty = align(torch.zeros(0, 2, dtype=torch.int64, device=DEVICE), 8, 32)
    assert grouped_gemm(torch.zeros(0, 72, device=DEVICE), w, empty).shape == (0, 80)


def test_fp8_expert_mlp_matches_dequantized_reference():
    if not fp8_supported(DEVICE):
        pytest.skip("fp8 needs compute capability >= 8.9")
    ids = routing(129, 2, 4, seed=11).to(DEVICE)
    layout = align(ids, 4, 32)
    x = torch.randn(layout.num_pairs, HIDDEN, device=DEVICE)
    w13, w2 = weights(4, seed=4, dtype=torch.float32)
    x8, xs = quantize_fp8(x)
    w13_8, w13s = quantize_fp8(w13, dim=0)
    w2_8, w2s = quantize_fp8(w2, dim=0)
    tri = expert_mlp(x8, w13_8, w2_8, layout, x_scale=xs, w13_scale=w13s, w2_scale=w2s, block_n=128)
    ref = expert_mlp_torch(x8, w13_8, w2_8, layout.rows_per_expert, x_scale=xs, w13_scale=w13s, w2_scale=w2s)
    # the down GEMM re-quantises the intermediate to e4m3 (3 mantissa bits): ~6% per element
    torch.testing.assert_close(tri.float(), ref, atol=0.1 * float(ref.abs().max()), rtol=0.1)


def test_gemm_rejects_bad_shapes():
    layout = align(torch.zeros(4, 1, dtype=torch.int64), 2, 16)
    with pytest.raises(InputError, match="K = 32"):
        grouped_gemm(torch.zeros(4, 16), torch.zeros(2, 8, 32), layout)
    with pytest.raises(InputError, match="4 rows"):
        grouped_gemm(torch.zeros(5, 32), torch.zeros(2, 8, 32), layout)
    with pytest.raises(InputError, match="power of two"):
        grouped_gemm(torch.zeros(4, 32), torch.zeros(2, 8, 32), layout, block_n=24)


@pytest.mark.gpu
def test_expert_mlp_large_bf16_on_gpu():
    """Real sizes on a GPU (tensor cores, no upcast): Qwen3-30B-A3B expert shape."""
    ids = routing(4096, 8, 128, seed=0).cuda()
    layout = align(ids, 128, 64)
    x = torch.randn(layout.num_pairs, 2048, device="cuda").bfloat16()
    w13 = (torch.randn(128, 1536, 2048, device="cuda") / 45).bfloat16()
    w2 = (torch.randn(128, 2048, 768, device="cuda") / 28).bfloat16()
    tri = expert_mlp(x, w13, w2, layout, block_n=128, block_k=64)
    ref = expert_mlp_torch(x, w13, w2, layout.rows_per_expert)
    torch.testing.assert_close(tri.float(), ref, atol=5e-2, rtol=5e-2)
