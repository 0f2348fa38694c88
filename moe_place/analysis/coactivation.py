"""Co-activation: which experts a token picks together (token-level traces only).

Experts picked together by many tokens receive their rows from the same tokens; placing them on
one GPU keeps a token's dispatches together, spreading them shares the load of one hot input.
"""

from __future__ import annotations

import numpy as np

from moe_place.errors import InputError

#: Pairs counted per bincount call (8 MiB of int64 ids), so memory does not grow with the trace.
CHUNK_PAIRS = 1 << 20


def coactivation(topk_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """int64 `[layers, E, E]`: `C[l, a, b]` = tokens whose layer-`l` top-k holds both `a` and `b`.

    topk_ids: int `[tokens, layers, k]` with distinct ids per token. `C` is symmetric; its
    diagonal `C[l, a, a]` is the load of expert `a` (tokens that picked it).
    """
    ids = np.asarray(topk_ids)
    if ids.ndim != 3:
        raise InputError("topk_ids", "a 3-D array [tokens, layers, k]", f"shape {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= num_experts):
        raise InputError("topk_ids", f"expert ids in [0, {num_experts})")
    tokens, layers, k = ids.shape
    out = np.zeros((layers, num_experts * num_experts), dtype=np.int64)
    chunk = max(1, CHUNK_PAIRS // max(k * k, 1))  # bounded memory: chunk * k * k pairs at a time
    for start in range(0, tokens, chunk):
        for layer in range(layers):
            picked = ids[start:start + chunk, layer, :].astype(np.int64)
            pairs = picked[:, :, None] * num_experts + picked[:, None, :]  # [tokens, k, k], a*E + b
            out[layer] += np.bincount(pairs.ravel(), minlength=num_experts * num_experts)
    return out.reshape(layers, num_experts, num_experts)


def expected_uniform_pairs(num_tokens: int, num_experts: int, top_k: int) -> float:
    """Tokens expected to pick a given pair `a != b` when each picks `k` distinct experts uniformly."""
    if num_experts < 2:
        return 0.0
    return num_tokens * top_k * (top_k - 1) / (num_experts * (num_experts - 1))
