"""Reading `torch.save` files (SGLang dumps, vLLM windows) into plain Python and numpy.

torch is optional: it is imported only here, only when a `.pt` file is read, and loads with
`weights_only=True` (no arbitrary code from the file). Tensors become numpy arrays.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moe_place.errors import InputError
from moe_place.traces.npz import error_reason


def load_torch_file(path: Path) -> Any:
    """The object saved in `path`, with every tensor (also inside dicts/lists) turned into numpy."""
    try:
        import torch
    except ImportError:
        raise InputError(str(path), "torch installed to read .pt files (pip install torch)", "no torch") from None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types (RuntimeError, UnpicklingError, EOFError...)
        raise InputError(str(path), "a readable torch.save file", error_reason(exc)) from None
    return _to_numpy(obj, torch)


def _to_numpy(obj: Any, torch) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy()
    if isinstance(obj, dict):
        return {k: _to_numpy(v, torch) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_numpy(v, torch) for v in obj)
    return obj
