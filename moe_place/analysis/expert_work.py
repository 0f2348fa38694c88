"""Work of a layer's experts: matrix FLOPs and weight bytes read (docs/MODEL.md, Notation and C1).

An expert on `m` rows does `F_e(m) = 2*m*P_e` FLOPs and reads its `W_e` bytes of weights at
least once if `m > 0`. The same dispatches cost the same FLOPs however they are spread, but
the weights read depend on how many experts they touch. The time model is in `moe_place.cost`.
"""

from __future__ import annotations

import numpy as np

from moe_place.errors import InputError


def _rows(rows_per_expert: np.ndarray) -> np.ndarray:
    rows = np.asarray(rows_per_expert, dtype=np.float64)
    if (rows < 0).any() or not np.isfinite(rows).all():
        raise InputError("rows_per_expert", "finite row counts >= 0")
    return rows


def expert_flops(rows_per_expert: np.ndarray, params_per_expert: float) -> np.ndarray | float:
    """FLOPs `sum_e 2*m_e*P_e` over the last axis of `rows_per_expert [..., E]`."""
    total = 2.0 * _rows(rows_per_expert).sum(axis=-1) * params_per_expert
    return float(total) if np.ndim(total) == 0 else total


def weight_bytes_read(rows_per_expert: np.ndarray, expert_bytes: float) -> np.ndarray | float:
    """Bytes of weights read at least once: `W_e` per expert with rows, over the last axis of `[..., E]`."""
    total = (_rows(rows_per_expert) > 0).sum(axis=-1) * float(expert_bytes)
    return float(total) if np.ndim(total) == 0 else total
