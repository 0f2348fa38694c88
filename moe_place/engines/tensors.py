"""The torch edge of the adapters and the drop-in: loads in as numpy, maps out as the engines' tensors.

Engines hand their balancer a load tensor (any dtype, any device) and take back CPU int64 maps:
`phy2log [layers, P]`, `log2phy [layers, E, width]` (-1 padded) and `logcnt [layers, E]`. Everything
between works on numpy arrays. torch is imported lazily: numpy loads in give numpy maps out, and need
no torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moe_place.errors import InputError, ParameterError
from moe_place.placement import Placement

__all__ = ["is_torch_tensor", "maps_as_result", "placement_tensors", "to_numpy", "torch_descending_order",
           "weight_to_numpy"]


def is_torch_tensor(value: Any) -> bool:
    """True for a torch tensor (what has `.detach()`), told without importing torch."""
    return hasattr(value, "detach")


def to_numpy(value: Any, dtype: type | None = None, copy: bool = False) -> np.ndarray:
    """A host numpy array of a torch tensor (any device) or an array-like, as `dtype` when given (`copy`: never a
    view of the engine's memory): the one conversion at the engines' edge."""
    if is_torch_tensor(value):
        value = value.detach().to("cpu").numpy()
    return np.array(value, dtype=dtype) if copy else np.asarray(value, dtype=dtype)


def weight_to_numpy(weight: Any, dtype: type = np.float64) -> np.ndarray:
    """`[layers, E]` of `dtype` from a torch tensor (any dtype/device) or an array-like.

    ParameterError unless a non-empty 2-D array of finite loads >= 0. A tensor is converted by
    torch (`.float()` for float32, as DeepSeek's original converts, `.double()` otherwise).
    """
    if is_torch_tensor(weight):  # torch converts (bfloat16 has no numpy dtype)
        weight = to_numpy(weight.float() if dtype == np.float32 else weight.double())
    try:
        loads = np.asarray(weight, dtype=dtype)
    except (TypeError, ValueError):
        raise ParameterError("weight", "a numeric array [layers, num_logical_experts]", type(weight).__name__) from None
    if loads.ndim != 2 or 0 in loads.shape:
        raise ParameterError("weight", "a non-empty 2-D array [layers, num_logical_experts]", f"shape {loads.shape}")
    if not np.isfinite(loads).all() or (loads < 0).any():
        raise ParameterError("weight", "finite loads >= 0", "NaN, inf or a negative load")
    return loads


def placement_tensors(placement: Placement, log2phy_width: int | None = None, as_numpy: bool = False):
    """`(phy2log, log2phy, logcnt)` as CPU torch int64 tensors (`as_numpy`: writable numpy int64 arrays).

    log2phy_width: pad `log2phy` with -1 to this many columns (vLLM's default policy uses
    `num_redundant + 1`); None keeps `max(logcnt)` as DeepSeek EPLB does.
    """
    log2phy = np.asarray(placement.log2phy)
    if log2phy_width is not None:
        if log2phy_width < log2phy.shape[-1]:
            raise InputError("log2phy_width", f"at least max(logcnt)={log2phy.shape[-1]}", log2phy_width)
        pad = np.full(log2phy.shape[:-1] + (log2phy_width - log2phy.shape[-1],), -1, dtype=np.int64)
        log2phy = np.concatenate([log2phy, pad], axis=-1)
    return maps_as_result((placement.phy2log, log2phy, placement.logcnt), as_numpy)


def maps_as_result(maps, as_numpy: bool) -> tuple:
    """The maps as writable int64 copies: numpy arrays, or CPU torch tensors."""
    arrays = tuple(np.array(m, dtype=np.int64) for m in maps)
    if as_numpy:
        return arrays
    import torch  # lazy: torch only for the returned tensors

    return tuple(torch.from_numpy(a) for a in arrays)


def torch_descending_order(values: np.ndarray) -> np.ndarray:
    """int64 `[rows, n]`: torch's default descending sort of float32 `values [rows, n]`, the sort
    DeepSeek's `eplb.py` packs with (not stable above 16 elements: its tie order is torch's)."""
    import torch  # lazy: only the solver="eplb" path of the drop-in sorts with torch

    tensor = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    return tensor.sort(-1, descending=True).indices.numpy()
