"""The calibrated grouped-GEMM time (formula 11): its fitted terms, read from a `bench/gpu_check.sh` record.

Formula 11 (docs/MODEL.md) prices one GPU's grouped expert GEMM as

    T = t0 + max(F / C + W_t / B_t, W_c / B_h)        (0 for a GPU without rows)

with `F` the FLOPs of the padded rows (formula 4), `W_t` formula 5's bytes (weights re-read per
M-tile, activations per N-tile: what the SMs read, most of it from L2), `W_c` the compulsory HBM
bytes (each touched expert's weights once, each row's activations once: `weights="l2"`). The
terms of a `GemmProfile`:

- `fixed_s` (t0): the time a grouped GEMM takes whatever its size (two kernels' start, ramp and drain);
- `flops_per_s` (C) and `tile_bytes_per_s` (B_t): the costs of the FLOPs and of the tile traffic,
  which add up (the kernel does not hide its loads behind its math). Read them as costs per FLOP
  and per byte: C comes out above the datasheet peak because the tile term carries most of the time;
- `hbm_bytes_per_s` (B_h): HBM read+write rate of the record's 1 GiB device copy (its calibration),
  not fitted.

`fit_profile` fits t0, C and B_t by least squares on the relative error over the fit set: the
record's padding sweep (`sections.padding`: 8 experts of one shape, BLOCK_M 16-128) at
`FIT_MIN_ROWS` rows per expert or more. Everything else in the record (the GEMM section's other
shape, FP8, the payback rows, the skew section's uneven rows, the decode rows under `FIT_MIN_ROWS`)
is left to check it (`bench/gemm_fit.py` prints both sets).

`H200_FIT` is that fit of the committed H200 record (`H200_RECORD`); a part without a record of its
own gets it scaled by its rates (`reference_profile`): C and B_t with the part's FLOP/s (the L2 is
on the die, as the tensor cores are), B_h with its HBM bandwidth, t0 unchanged. Only the H200 is
checked against a measurement; the scaling is an assumption.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from moe_place.cost.gemm import calibrated_terms_s
from moe_place.errors import InputError
from moe_place.io import read_input_text

__all__ = ["GemmPoint", "GemmProfile", "fit_profile", "profile_from_record", "read_record", "record_points",
           "skew_points"]

RECORD_KIND = "moe-place-microbench"   # the "kind" of a bench/microbench.py (gpu_check.sh) result
FIT_MIN_ROWS = 64                      # rows per expert from which padding rows are fitted (below: decode rows, checks)
H200_RECORD = "bench/results/NVIDIA_H200_20261130T210929Z.json"
H200_EFFECTIVE_FLOPS = 494.7e12        # the catalog H200's FLOP/s and HBM bytes/s at efficiency 0.5, the rates
H200_EFFECTIVE_HBM = 2400e9            # `reference_profile` scales H200_FIT by (a test checks them against it)


@dataclass(frozen=True)
class GemmProfile:
    """The terms of formula 11 for one GPU (seconds, FLOP/s, bytes/s) and where they come from."""

    fixed_s: float
    flops_per_s: float
    tile_bytes_per_s: float
    hbm_bytes_per_s: float
    source: str
    fit_points: int = 0
    RATES = ("flops_per_s", "tile_bytes_per_s", "hbm_bytes_per_s")   # C, B_t, B_h (a class constant, not a field)

    def __post_init__(self) -> None:
        assert self.fixed_s >= 0 and math.isfinite(self.fixed_s)
        for rate in (getattr(self, key) for key in self.RATES):
            assert rate > 0 and math.isfinite(rate)

    def scaled(self, flops_factor: float, memory_factor: float, source: str) -> "GemmProfile":
        """C and B_t times `flops_factor`, B_h times `memory_factor`, t0 kept."""
        return GemmProfile(self.fixed_s, self.flops_per_s * flops_factor, self.tile_bytes_per_s * flops_factor,
                           self.hbm_bytes_per_s * memory_factor, source, self.fit_points)

    def describe(self) -> dict:
        """JSON-ready: the terms and their source."""
        return {"formula": "11", **{key: getattr(self, key) for key in ("fixed_s", *self.RATES, "source")}}


# `fit_profile` of H200_RECORD (tests/test_gemm_profile.py refits the committed record and compares)
H200_FIT = GemmProfile(fixed_s=2.688946788411875e-05, flops_per_s=1.3894738874389545e+15,
                       tile_bytes_per_s=1.4832891104324738e+13, hbm_bytes_per_s=4.253049052108433e+12,
                       source=f"fit of {H200_RECORD}", fit_points=36)


@lru_cache(maxsize=64)  # called for every expert-time evaluation; the profile of a part never changes
def reference_profile(name: str, flops_per_s: float, memory_bytes_per_s: float) -> GemmProfile:
    """`H200_FIT` scaled to a part with these effective rates (peak x efficiency; see the module docstring)."""
    flops_factor, memory_factor = flops_per_s / H200_EFFECTIVE_FLOPS, memory_bytes_per_s / H200_EFFECTIVE_HBM
    if flops_factor == 1 and memory_factor == 1:
        return H200_FIT
    return H200_FIT.scaled(flops_factor, memory_factor,
                           f"{H200_FIT.source}, scaled to {name} (FLOP/s x{flops_factor:.3g}, "
                           f"HBM x{memory_factor:.3g})")


# ------------------------------------------------------------------------------ the record's points
@dataclass(frozen=True)
class GemmPoint:
    """One measured grouped GEMM of a record: rows `[experts]` of one shape, and the time measured."""

    where: str
    hidden: int
    intermediate: int
    rows: tuple[int, ...]
    block_m: int
    block_n: int
    dtype_bytes: float
    measured_s: float

    def terms(self, profile: GemmProfile) -> dict[str, float]:
        """Formula 11's terms (`moe_place.cost.gemm.calibrated_terms_s`) of this point under `profile`."""
        return {key: float(value) for key, value in calibrated_terms_s(
            np.asarray(self.rows, dtype=np.float64), self.hidden, self.intermediate, self.dtype_bytes, profile,
            block_m=self.block_m, block_n=self.block_n).items()}

    def predicted_s(self, profile: GemmProfile) -> float:
        return self.terms(profile)["time_s"]


def _number(table: dict, key: str, where: str, positive: bool = True) -> float:
    value = table.get(key) if isinstance(table, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or (value <= 0 if positive else value < 0):
        raise InputError(f"{where}.{key}", "a number > 0" if positive else "a number >= 0",
                         "missing" if value is None else repr(value))
    return float(value)


def _integer(table: dict, key: str, where: str) -> int:
    value = table.get(key) if isinstance(table, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{where}.{key}", "an integer >= 1", "missing" if value is None else repr(value))
    return value


def _table(data: dict, key: str, where: str, expected: str) -> dict:
    value = data.get(key)
    if not isinstance(value, dict):
        raise InputError(f"{where}.{key}" if where else key, expected,
                         "missing" if value is None else type(value).__name__)
    return value


def read_record(path: str | Path) -> dict:
    """A `bench/gpu_check.sh` result (`bench/microbench.py`'s JSON), checked for what a fit reads: one
    InputError naming the first field that is missing or wrong."""
    path = Path(path)
    text = read_input_text(path, "a gpu_check result (bench/results/*.json)")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(str(path), "a gpu_check result in JSON", f"unreadable JSON ({exc.msg} at line "
                         f"{exc.lineno})") from None
    if not isinstance(data, dict) or data.get("kind") != RECORD_KIND:
        got = repr(data.get("kind")) if isinstance(data, dict) else type(data).__name__
        raise InputError(f"{path}: kind", f"\"{RECORD_KIND}\" (a result of bench/gpu_check.sh)", got)
    env = _table(data, "env", f"{path}:", "the machine the record was made on")
    if env.get("timing") != "gpu":
        raise InputError(f"{path}: env.timing", "\"gpu\" (a run timed on a GPU; a --dry-run times the CPU "
                         "reference)", repr(env.get("timing")))
    if not isinstance(env.get("gpu_part"), str) or not env["gpu_part"]:
        raise InputError(f"{path}: env.gpu_part", "the catalog part the GPU is", repr(env.get("gpu_part")))
    _number(_table(data, "calibration", f"{path}:", "the run's calibration"), "hbm_bytes_per_s",
            f"{path}: calibration")
    sections = _table(data, "sections", f"{path}:", "the microbenchmark's sections")
    _table(sections, "padding", f"{path}: sections", "the grouped-GEMM sweep (bench/microbench.py padding)")
    record_points(data, path)  # every row the fit or the checks read
    return data


def record_points(data: dict, path: str | Path = "record") -> dict[str, list[GemmPoint]]:
    """The record's grouped GEMMs by group: `fit` (padding rows of at least FIT_MIN_ROWS rows per
    expert), `decode` (padding rows under it), `gemm` and `fp8` (the GEMM section, BF16 and FP8:
    another shape), `payback` (its before and after rows), `skew` (every rank of the skew section,
    uneven rows, where the record keeps each rank's rows per expert: `slot_rows`, in records written
    since formula 11). Sections the record lacks give no points."""
    sections = data["sections"]
    groups: dict[str, list[GemmPoint]] = {"fit": [], "decode": [], "gemm": [], "fp8": [], "payback": [],
                                          "skew": []}
    pad = sections["padding"]
    here = f"{path}: sections.padding"
    hidden, inter, block_n = (_integer(pad, key, here) for key in ("hidden", "intermediate", "block_n"))
    rows = pad.get("rows")
    if not isinstance(rows, list) or not rows:
        raise InputError(f"{here}.rows", "the sweep's rows (a non-empty list)", "missing" if rows is None else
                         repr(rows)[:40])
    for i, row in enumerate(rows):
        at = f"{here}.rows[{i}]"
        if not isinstance(row, dict):
            raise InputError(at, "an object with block_m, rows_per_expert, experts, measured_s", type(row).__name__)
        per_expert = _integer(row, "rows_per_expert", at)
        point = GemmPoint(at, hidden, inter, (per_expert,) * _integer(row, "experts", at), _integer(row, "block_m", at),
                          block_n, 2.0, _number(row, "measured_s", at))
        groups["fit" if per_expert >= FIT_MIN_ROWS else "decode"].append(point)
    if len(groups["fit"]) < 3:
        raise InputError(f"{here}.rows", f"at least 3 rows of >= {FIT_MIN_ROWS} rows per expert (three terms are "
                         "fitted)", len(groups["fit"]))
    if "gemm" in sections:
        gemm = _table(sections, "gemm", f"{path}: sections", "the GEMM section")
        here = f"{path}: sections.gemm"
        shape = [_integer(gemm, key, here) for key in ("hidden", "intermediate", "block_n")]
        for i, row in enumerate(gemm.get("rows") or []):
            at = f"{here}.rows[{i}]"
            rows_of = (_integer(row, "rows_per_expert", at),) * _integer(row, "experts", at)
            block_m = _integer(row, "block_m", at)
            groups["gemm"].append(GemmPoint(at, shape[0], shape[1], rows_of, block_m, shape[2], 2.0,
                                            _number(row, "measured_s", at)))
            if row.get("fp8_grouped_s") is not None:
                groups["fp8"].append(GemmPoint(f"{at}.fp8_grouped_s", shape[0], shape[1], rows_of, block_m, shape[2],
                                               1.0, _number(row, "fp8_grouped_s", at)))
    if "payback" in sections:
        pay = _table(sections, "payback", f"{path}: sections", "the payback section")
        here = f"{path}: sections.payback"
        shape = [_integer(pay, key, here) for key in ("hidden", "intermediate", "block_m", "block_n")]
        for side in ("before", "after"):
            rows_of = pay.get(f"rows_{side}")
            if not isinstance(rows_of, list) or not all(isinstance(r, int) and r >= 0 for r in rows_of):
                raise InputError(f"{here}.rows_{side}", "a list of rows per expert", repr(rows_of)[:40])
            groups["payback"].append(GemmPoint(f"{here}.t_{side}_s", shape[0], shape[1], tuple(rows_of), shape[2],
                                               shape[3], 2.0, _number(pay, f"t_{side}_s", here)))
    if "skew" in sections:
        groups["skew"] = skew_points(sections["skew"], block_n, path)
    return groups


def skew_points(skew: dict, block_n: int, path: str | Path = "record",
                slot_rows: list | None = None) -> list[GemmPoint]:
    """A point per rank and case of the skew section: `slot_rows[case][rank]` (default: each case's own
    `slot_rows`; a case without them gives no points), timed in `measured_per_gpu_s`."""
    here = f"{path}: sections.skew"
    shape = [_integer(skew, key, here) for key in ("hidden", "intermediate", "block_m")]
    out = []
    for i, case in enumerate(skew.get("cases") or []):
        at = f"{here}.cases[{i}]"
        ranks = case.get("slot_rows") if slot_rows is None else slot_rows[i]
        times = case.get("measured_per_gpu_s")
        if ranks is None:
            continue
        if not isinstance(times, list) or len(times) != len(ranks):
            raise InputError(f"{at}.measured_per_gpu_s", f"a time per rank ({len(ranks)})", repr(times)[:40])
        for g, (rows, seconds) in enumerate(zip(ranks, times)):
            if not isinstance(seconds, (int, float)) or not seconds > 0:
                raise InputError(f"{at}.measured_per_gpu_s[{g}]", "a time in seconds > 0", repr(seconds))
            out.append(GemmPoint(f"{at} rank {g}", shape[0], shape[1], tuple(int(r) for r in rows), shape[2],
                                 block_n, 2.0, float(seconds)))
    return out


def fit_profile(points: list[GemmPoint], hbm_bytes_per_s: float, source: str) -> GemmProfile:
    """t0, C and B_t of formula 11 fitted to `points` (least squares on the relative error), B_h given.

    The model is linear in (t0, 1/C, 1/B_t) on each side of its max: a point whose compulsory term
    binds (`W_c / B_h` above `F/C + W_t/B_t`) depends on t0 only. Start with every point on the
    FLOP-and-tile side, solve, move each point to the side that binds under the solution, solve
    again, until no point changes side (a few rounds; at most one per point).
    """
    unit = GemmProfile(0.0, 1.0, 1.0, hbm_bytes_per_s, "unit")
    work = [p.terms(unit) for p in points]   # with unit rates the terms are FLOPs and bytes
    measured = np.array([p.measured_s for p in points])
    flops, tiles = np.array([w["flops"] for w in work]), np.array([w["tile_bytes"] for w in work])
    compulsory_s = np.array([w["memory_s"] for w in work])
    bound = np.zeros(len(points), dtype=bool)
    for _ in range(len(points) + 1):
        # T ~ t0 + F * a + W_t * b (or t0 + W_c / B_h where bound), each equation divided by the measured T
        design = np.column_stack([np.ones(len(points)), np.where(bound, 0.0, flops), np.where(bound, 0.0, tiles)])
        target = measured - np.where(bound, compulsory_s, 0.0)
        coef = np.linalg.lstsq(design / measured[:, None], target / measured, rcond=None)[0]
        if not (coef[0] >= 0 and coef[1] > 0 and coef[2] > 0):
            raise InputError(f"{source}: sections.padding.rows", "times that grow with FLOPs and tile bytes (a "
                             "positive fit of formula 11)", f"t0 {coef[0]:.3g} s, s/FLOP {coef[1]:.3g}, "
                             f"s/byte {coef[2]:.3g}")
        now_bound = compulsory_s > flops * coef[1] + tiles * coef[2]
        if (now_bound == bound).all():
            break
        bound = now_bound
    return GemmProfile(float(coef[0]), float(1 / coef[1]), float(1 / coef[2]), hbm_bytes_per_s, source, len(points))


def profile_from_record(path: str | Path) -> tuple[str, GemmProfile]:
    """(the record's catalog part, its formula-11 profile) of a `bench/gpu_check.sh` result file."""
    data = read_record(path)
    points = record_points(data, path)
    profile = fit_profile(points["fit"], float(data["calibration"]["hbm_bytes_per_s"]), f"fit of {path}")
    return data["env"]["gpu_part"], profile
