"""Units, spelled out once: GB and Gbit are decimal, GiB and MiB are binary (docs/MODEL.md).

Bandwidths and FLOP rates are decimal (`450 GB/s` = 450e9 bytes/s); memory capacities of
expert weights are binary (`36 MiB` = 37,748,736 bytes). `80 GB` of HBM is 80e9 bytes, about
74.5 GiB. Every quantity elsewhere in `moe_place.cost` carries its unit in its name.
"""

from __future__ import annotations

__all__ = ["gb_per_s", "gbit_per_s"]

MIB_BYTES = 1024**2
GIB_BYTES = 1024**3
GB_BYTES = 1e9
TFLOPS = 1e12

BYTES_PER_DTYPE = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "mxfp4": 4.25 / 8}


def gb_per_s(value: float) -> float:
    """`value` GB/s as bytes/s (decimal)."""
    return float(value) * GB_BYTES


def gbit_per_s(value: float) -> float:
    """`value` Gbit/s as bytes/s (400 Gbit/s -> 50e9 bytes/s)."""
    return float(value) * 1e9 / 8

