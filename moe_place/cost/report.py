"""Human-readable tables of a `predict` report (the JSON form is the report itself).

For people: numbers rounded to 5-6 significant digits, each with its unit; a key ending in `_s`
(seconds in the JSON) is shown without the suffix, its value in ms or us (`compute.time 0.39069 ms`).
"""

from __future__ import annotations

import math

__all__ = ["format_report"]


def _value(key: str, value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or isinstance(value, str):
        return str(value)
    if isinstance(value, int) and not key.endswith("_s"):
        return f"{value:,}"
    if not isinstance(value, float):
        return str(value)
    if math.isinf(value):
        return "inf"
    if key.endswith("bytes_per_s"):
        return f"{value / 1e9:,.6g} GB/s"
    if key.endswith("flops_per_s"):
        return f"{value / 1e12:,.6g} TFLOP/s"
    if key.endswith("_per_s"):
        return f"{value:,.6g} /s"
    if key.endswith("_s"):
        return f"{value * 1e3:.5g} ms" if abs(value) >= 1e-4 else f"{value * 1e6:.5g} us"
    if key.endswith("bytes"):
        return f"{value:,.0f} B ({value / 2**20:,.6g} MiB)" if value >= 2**20 else f"{value:,.6g} B"
    if key.endswith("flops"):
        return f"{value / 1e9:,.6g} GFLOP"
    return f"{value:.6g}"


_UNITS = ("_s", "bytes", "flops", "_mib", "_gib")


def _unit_key(path: list[str]) -> str:
    """The innermost key with a unit suffix (keys like '16' or 'dispatch' inherit their parent's)."""
    for key in reversed(path):
        if key.endswith(_UNITS):
            return key
    return path[-1]


def _label(path: list[str]) -> str:
    """The dotted key path as shown: `_s` dropped (the value carries ms or us)."""
    return ".".join(key[:-2] if key.endswith("_s") and not key.endswith("_per_s") else key for key in path)


def format_report(report: dict) -> str:
    """One line per quantity: `section.key  value unit`."""
    lines: list[str] = []

    def walk(node, path: list[str]) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, path + [str(k)])
        elif isinstance(node, list) and node and all(isinstance(x, dict) for x in node):
            for i, item in enumerate(node):
                walk(item, path + [f"[{item.get('name', i)}]"])
        elif isinstance(node, list):
            key = _unit_key(path)
            shown = [_value(key, float(x)) if isinstance(x, float) or (isinstance(x, int) and key.endswith("_s"))
                     else _value(key, x) for x in node]
            lines.append(f"{_label(path):<58} {', '.join(shown)}")
        else:
            lines.append(f"{_label(path):<58} {_value(_unit_key(path), node)}")

    walk(report, [])
    return "\n".join(lines) + "\n"
