"""Dispatch matrix `a[i][j]`: rows sent from source GPU `i` (where a token lives) to GPU `j`.

`m[j] = sum_i a[i][j]` are the rows GPU `j` computes (docs/MODEL.md, Notation). With replicas, a
dispatch to expert `e` is split evenly over `e`'s replicas (the `even` split policy).
"""

from __future__ import annotations

import numpy as np

from moe_place.errors import InputError
from moe_place.placement import Placement

__all__ = ["dispatch_matrix", "expert_to_gpu_share", "token_sources"]

TOKEN_LAYOUTS = ("blocks", "round-robin")


def token_sources(num_tokens: int, num_sources: int, layout: str = "blocks") -> np.ndarray:
    """int64 `[tokens]`: the source GPU of each token.

    layout: `blocks` gives each source a contiguous block of tokens (sizes differ by at most one,
    as data-parallel attention splits a batch); `round-robin` gives token `t` to source `t % num_sources`.
    """
    if num_tokens < 0 or num_sources < 1:
        raise InputError("token_sources", "num_tokens >= 0 and num_sources >= 1", (num_tokens, num_sources))
    if layout == "round-robin":
        return np.arange(num_tokens, dtype=np.int64) % num_sources
    if layout == "blocks":
        return (np.arange(num_tokens, dtype=np.int64) * num_sources) // max(num_tokens, 1)
    raise InputError("token home", f"one of {', '.join(TOKEN_LAYOUTS)}", layout)


def expert_to_gpu_share(placement: Placement, layer: int) -> np.ndarray:
    """float64 `[E, G]`: share of expert `e`'s dispatches that GPU `g` computes (even split)."""
    gpu_of_slot = placement.gpu_of_slot()
    share = np.zeros((placement.num_experts, placement.num_gpus))
    np.add.at(share, (placement.phy2log[layer], gpu_of_slot), 1.0)
    return share / placement.logcnt[layer][:, None]


def dispatch_matrix(topk_ids: np.ndarray, source: np.ndarray, placement: Placement, layer: int = 0,
                    num_sources: int | None = None) -> np.ndarray:
    """float64 `[sources, G]`: `a[i][j]` for one layer.

    topk_ids: int `[tokens, k]` expert ids of that layer; source: int `[tokens]` source GPU of
    each token (see `token_sources`); placement: its row `layer` is used.
    num_sources: rows of `a`; default `source.max() + 1`.
    """
    ids = np.asarray(topk_ids)
    source = np.asarray(source)
    if ids.ndim != 2:
        raise InputError("topk_ids", "a 2-D array [tokens, k] of one layer", f"shape {ids.shape}")
    if source.shape != ids.shape[:1]:
        raise InputError("source", f"one source GPU per token ({ids.shape[0]})", f"shape {source.shape}")
    if not 0 <= layer < placement.num_layers:
        raise InputError("layer", f"a layer in [0, {placement.num_layers})", layer)
    experts = placement.num_experts
    if ids.size and (ids.min() < 0 or ids.max() >= experts):
        raise InputError("topk_ids", f"expert ids in [0, {experts})")
    sources = int(num_sources if num_sources is not None else (source.max() + 1 if source.size else 1))
    if source.size and (source.min() < 0 or source.max() >= sources):
        raise InputError("source", f"source GPUs in [0, {sources})")
    # per_source[i, e]: dispatches from source i to expert e
    flat = np.repeat(source.astype(np.int64), ids.shape[1]) * experts + ids.astype(np.int64).ravel()
    per_source = np.bincount(flat, minlength=sources * experts).reshape(sources, experts)
    return per_source @ expert_to_gpu_share(placement, layer)
