"""Reading `torch.save` files (SGLang dumps, vLLM windows) into plain Python and numpy.

torch is optional: it is imported only here, only when a `.pt` file is read, and loads with
`weights_only=True` (no arbitrary code from the file). Tensors become numpy arrays.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

from moe_place.errors import InputError
from moe_place.traces.npz_member import error_reason

__all__ = ["load_torch_file"]


def load_torch_file(path: Path) -> Any:
    """The object saved in `path`, with every tensor (also inside dicts/lists) turned into numpy."""
    try:
        import torch
    except ImportError:
        raise InputError(str(path), "torch installed to read .pt files (pip install torch)", "no torch") from None
    try:
        with warnings.catch_warnings():  # torch warns of pickle protocols in a file it then refuses anyway
            warnings.simplefilter("ignore")
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types (RuntimeError, UnpicklingError, EOFError...)
        refused = _weights_only_refusal(str(exc))
        if refused is not None:
            raise InputError(str(path), "a torch.save file of tensors, dicts, lists and numbers (an SGLang dump or a "
                             "vLLM window; read with weights_only=True)", refused) from None
        raise InputError(str(path), "a readable torch.save file", error_reason(exc)) from None
    return _to_numpy(obj, torch)


def _weights_only_refusal(message: str) -> str | None:
    """What a `weights_only=True` load refused, from torch's message (several paragraphs), or None
    when the message is not such a refusal."""
    if "Weights only load failed" not in message:
        return None
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", message)
    if found:
        return f"a file that also holds the Python object {found.group(1)}"
    found = re.search(r"Unsupported operand (\d+)", message)
    if found:
        return f"a pickle torch does not load with weights_only=True (pickle operation {found.group(1)})"
    return "a file torch does not load with weights_only=True"


def _to_numpy(obj: Any, torch) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy()
    if isinstance(obj, dict):
        return {k: _to_numpy(v, torch) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_numpy(v, torch) for v in obj)
    return obj
