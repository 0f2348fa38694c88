"""Property test of `align` against its plain-numpy reference (hypothesis; pure index bookkeeping)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_place.kernels.align import align, align_numpy


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.integers(1, 40), st.integers(1, 4), st.integers(1, 9), st.sampled_from([1, 3, 16, 32]), st.booleans(),
       st.integers(0, 2**31 - 1))
def test_align_property_matches_numpy(tokens, top_k, num_experts, block_m, pad_empty, seed):
    top_k = min(top_k, num_experts)
    ids = torch.rand(tokens, num_experts, generator=torch.Generator().manual_seed(seed)).topk(top_k, dim=1).indices
    layout = align(ids, num_experts, block_m, pad_empty)
    for name, expected in align_numpy(ids.numpy(), num_experts, block_m, pad_empty).items():
        np.testing.assert_array_equal(getattr(layout, name).numpy(), expected, err_msg=name)
    assert ((layout.tile_row_end - layout.tile_row_start) <= block_m).all()
    assert torch.equal(layout.tile_expert, torch.sort(layout.tile_expert).values)  # experts in order
