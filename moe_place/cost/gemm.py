"""Expert GEMM time on one GPU: padding (formula 4), tile-level traffic (formula 5) and
`max(F/C, W/B)` (formula 1), or the calibrated time of formula 11 (`weights="calibrated"`, the
default of the replay, the rebalance rule, `evaluate` and the scenario files); the busiest GPU sets
the layer time.

Public names the kernels code compares measurements against (stable):

    padded_rows(rows_per_expert, block_m, pad_empty=False) -> int
    expert_time_s(rows_per_expert, hidden, intermediate, dtype_bytes, flops_per_s, memory_bytes_per_s,
                  *, weights="tiles", block_m=None, block_n=128, matrices=3, pad_empty=False) -> float
    expert_times_s(rows [..., experts], ...same...) -> float64 [...]    (vectorised; the one definition)

`rows_per_expert` is an int array `[experts]` of the valid rows (token dispatches) each local expert
computes in one grouped GEMM. `weights="calibrated"` takes a `profile` (`moe_place.cost.gemm_profile.
GemmProfile`: the fitted terms of formula 11) instead of the two rates.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_place.errors import InputError

__all__ = ["GpuExpertWork", "LayerTime", "calibrated_terms_s", "check_rows", "expert_time_s", "expert_times_s",
           "expert_work_arrays", "gpu_expert_work", "gpu_times_s", "layer_time", "padded_rows", "padded_rows_batched",
           "tile_row_bytes"]

WEIGHT_MODES = ("none", "once", "tiles", "l2", "calibrated")
DEFAULT_WEIGHTS = "calibrated"  # formula 11: within 15% of the H200 record at 512-4,096 rows per expert
DEFAULT_BLOCK_M = 64            # the tile height formula 11 assumes when a caller names none
BYTE_MODES = WEIGHT_MODES[:4]   # the modes that count bytes for `max(F/C, W/B)` (formula 1)


def check_rows(rows_per_expert, where: str = "rows_per_expert") -> np.ndarray:
    """float64 `[experts]`: rows >= 0 (an even split over replicas may give fractional expected rows)."""
    rows = np.asarray(rows_per_expert)
    if rows.ndim != 1:
        raise InputError(where, "a 1-D list of rows per expert", f"shape {rows.shape}")
    if rows.size and rows.dtype.kind not in "iuf":
        raise InputError(where, "numbers of rows", f"dtype {rows.dtype}")
    rows = rows.astype(np.float64)
    if not np.isfinite(rows).all() or (rows < 0).any():
        raise InputError(where, "finite rows >= 0", rows[~np.isfinite(rows) | (rows < 0)][0])
    return rows


def _positive_int(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise InputError(where, "an integer >= 1", value)
    return int(value)


def _ceil_div(a, b):
    return -(-a // b)


def padded_rows(rows_per_expert, block_m: int, pad_empty: bool = False) -> int:
    """Rows a grouped GEMM computes when each expert's rows are padded up to a multiple of `block_m`.

    pad_empty=False: an expert with no rows takes no tile (vLLM/SGLang `moe_align_block_size`).
    pad_empty=True: every expert takes at least one tile, even an empty one.
    C8: rows [32,16,8,4,2,1,1,0], block_m=32 -> 224 (pad non-empty) and 256 (pad all).
    """
    rows = check_rows(rows_per_expert)
    block_m = _positive_int(block_m, "block_m")
    tiles = np.ceil(rows / block_m)
    if pad_empty:
        tiles = np.maximum(tiles, 1)
    return int(tiles.sum() * block_m)


def padded_rows_batched(rows_per_expert, block_m: int) -> int:
    """Rows of a batched GEMM of shape `[experts, max_rows]`: every expert padded to the largest one."""
    rows = check_rows(rows_per_expert)
    block_m = _positive_int(block_m, "block_m")
    if rows.size == 0:
        return 0
    return int(rows.size * np.ceil(rows.max() / block_m) * block_m)


def tile_row_bytes(hidden: int, intermediate: int, dtype_bytes: float, block_n: int) -> float:
    """Bytes moved per valid row (formula 5): activations re-read once per N-tile, outputs written once.

    `(2I/BLOCK_N)*h*b + (h/BLOCK_N)*I*b + 2I*b + h*b`, with the N-tile counts rounded up.
    h=4096, I=1536, b=2, BLOCK_N=128 -> 309,248 bytes.
    """
    hidden, intermediate = _positive_int(hidden, "hidden"), _positive_int(intermediate, "intermediate")
    block_n = _positive_int(block_n, "block_n")
    gate_up_tiles = _ceil_div(2 * intermediate, block_n)
    down_tiles = _ceil_div(hidden, block_n)
    return (gate_up_tiles * hidden + down_tiles * intermediate + 2 * intermediate + hidden) * dtype_bytes


@dataclass(frozen=True)
class GpuExpertWork:
    """One GPU's expert work for one layer and its time `fixed_s + max(compute_s + tile_s, memory_s)`.

    Formula 1 (`max(F/C, W/B)`): `tile_s = fixed_s = 0`. Formula 11 (`weights="calibrated"`):
    `compute_s = F/C`, `tile_s` the formula-5 bytes (`tile_bytes`) over the profile's tile rate,
    `memory_s` the compulsory HBM bytes (`memory_bytes`) over its HBM rate, `fixed_s` its fixed time
    (0 for a GPU without rows).
    """

    valid_rows: float
    computed_rows: float
    flops: float
    memory_bytes: float
    compute_s: float
    memory_s: float
    tile_bytes: float = 0.0
    tile_s: float = 0.0
    fixed_s: float = 0.0

    def __post_init__(self) -> None:
        assert self.computed_rows >= self.valid_rows >= 0
        assert self.flops >= 0 and self.memory_bytes >= 0 and self.tile_bytes >= 0
        assert self.tile_s >= 0 and self.fixed_s >= 0

    @property
    def time_s(self) -> float:
        return self.fixed_s + max(self.compute_s + self.tile_s, self.memory_s)

    @property
    def bound(self) -> str:
        """Which resource binds: `compute` (with formula 11: FLOPs plus tile traffic) or `memory`
        (`idle` when there is no work)."""
        if self.time_s == 0:
            return "idle"
        return "compute" if self.compute_s + self.tile_s >= self.memory_s else "memory"


def expert_work_arrays(rows, hidden: int, intermediate: int, dtype_bytes: float, *, weights: str = "tiles",
                       block_m: int | None = None, block_n: int = 128, matrices: int = 3, pad_empty: bool = False,
                       flops_per_row: float | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(computed_rows, flops, memory_bytes)`, each float64 `[...]`, of grouped GEMMs with rows `[..., experts]`.

    The one definition of an expert GEMM's work, vectorised over any leading axes (GPUs, layers,
    steps). rows: valid rows (dispatches) of each local expert, >= 0 (not checked here: callers
    check user input with `check_rows`). weights: `none` counts compute only (row C3, C6); `once`
    reads each touched expert's weights once (formula 1); `tiles` uses formula 5 and needs `block_m`
    (no cache reuse: an upper bound on HBM bytes); `l2` is formula 5 with the re-reads served from
    L2 (the compulsory traffic, a lower bound). FLOPs are `flops_per_row` (default `2*P_e`, `P_e =
    matrices*h*I`) per computed row: padded rows when `block_m` is given (formula 4), valid rows
    otherwise; an expert with no rows takes no tile unless `pad_empty`.
    """
    if weights not in BYTE_MODES:
        raise InputError("weights", f"one of {BYTE_MODES}", repr(weights))
    rows = np.asarray(rows, dtype=np.float64)
    params = matrices * hidden * intermediate
    per_row = 2.0 * params if flops_per_row is None else float(flops_per_row)
    if block_m is not None:
        block_m = _positive_int(block_m, "block_m")
        tiles = np.ceil(rows / block_m)
        computed = (np.maximum(tiles, 1) if pad_empty else tiles).sum(axis=-1) * block_m
    else:
        computed = rows.sum(axis=-1)
    touched = np.count_nonzero(rows, axis=-1).astype(np.float64)
    if weights == "none":
        memory = np.zeros_like(computed)
    elif weights == "once":
        memory = touched * (params * dtype_bytes)
    elif weights == "l2":
        memory = rows.sum(axis=-1) * ((2 * hidden + 3 * intermediate) * dtype_bytes) \
            + touched * (3 * hidden * intermediate * dtype_bytes)
    else:
        if block_m is None:
            raise InputError("block_m", "a tile height when weights = 'tiles'", "nothing")
        memory = np.ceil(rows / block_m).sum(axis=-1) * (3 * hidden * intermediate * dtype_bytes) \
            + rows.sum(axis=-1) * tile_row_bytes(hidden, intermediate, dtype_bytes, block_n)
    return computed, per_row * computed, memory


def calibrated_terms_s(rows, hidden: int, intermediate: int, dtype_bytes: float, profile, *,
                       block_m: int | None = None, block_n: int = 128, matrices: int = 3, pad_empty: bool = False,
                       flops_per_row: float | None = None) -> dict[str, np.ndarray]:
    """The terms of formula 11 for grouped GEMMs with rows `[..., experts]`, each float64 `[...]`.

    `T = t0 + max(F/C + W_t/B_t, W_c/B_h)` for a GPU with any rows, 0 for one without: `F` the FLOPs
    of the padded rows (formula 4), `W_t` formula 5's bytes (`weights="tiles"`: re-reads per tile,
    which the SMs read at the tile rate `B_t`, most of them from L2), `W_c` the compulsory HBM bytes
    (`weights="l2"`) at `B_h`; `t0`, `C`, `B_t`, `B_h` are the profile's `fixed_s`, `flops_per_s`,
    `tile_bytes_per_s`, `hbm_bytes_per_s`. Keys: flops, tile_bytes, hbm_bytes, computed_rows (arrays)
    and compute_s, tile_s, memory_s, fixed_s, time_s (seconds). block_m: default `DEFAULT_BLOCK_M`.
    """
    # the FLOPs and bytes of `expert_work_arrays` with weights "tiles" and "l2" (tests compare them),
    # in one pass: the replay and the rebalance rule call this on every GPU of every layer
    block_m = _positive_int(DEFAULT_BLOCK_M if block_m is None else block_m, "block_m")
    rows = np.asarray(rows, dtype=np.float64)
    per_row = 2.0 * matrices * hidden * intermediate if flops_per_row is None else float(flops_per_row)
    expert_bytes = 3 * hidden * intermediate * dtype_bytes  # gate+up, down (formula 5 and the L2 model)
    tiles = np.ceil(rows / block_m)
    m_tiles = tiles.sum(axis=-1)
    computed = (np.maximum(tiles, 1).sum(axis=-1) if pad_empty else m_tiles) * block_m
    valid = rows.sum(axis=-1)
    flops = per_row * computed
    tile_bytes = m_tiles * expert_bytes + valid * tile_row_bytes(hidden, intermediate, dtype_bytes, block_n)
    hbm_bytes = valid * ((2 * hidden + 3 * intermediate) * dtype_bytes) \
        + np.count_nonzero(rows, axis=-1) * expert_bytes
    terms = {"computed_rows": computed, "flops": flops, "tile_bytes": tile_bytes, "hbm_bytes": hbm_bytes,
             "compute_s": flops / profile.flops_per_s, "tile_s": tile_bytes / profile.tile_bytes_per_s,
             "memory_s": hbm_bytes / profile.hbm_bytes_per_s, "fixed_s": np.where(valid > 0, profile.fixed_s, 0.0)}
    terms["time_s"] = terms["fixed_s"] + np.maximum(terms["compute_s"] + terms["tile_s"], terms["memory_s"])
    return terms


def _need_profile(profile) -> None:
    if profile is None:
        raise InputError("profile", "the GPU's grouped-GEMM terms (GpuSpec.gemm_profile()) with weights = "
                         "'calibrated'", "nothing")


def expert_times_s(rows, hidden: int, intermediate: int, dtype_bytes: float, flops_per_s: float,
                   memory_bytes_per_s: float, *, profile=None, **options) -> np.ndarray:
    """float64 `[...]`: the expert time of grouped GEMMs with rows `[..., experts]`: `max(F/C, W/B)`
    (formula 1) with the two rates, or with `weights="calibrated"` formula 11 with `profile`'s terms.

    Options as in `expert_work_arrays`; e.g. every GPU of every layer at once, rows `[layers, G, S]`.
    """
    if options.get("weights") == "calibrated":
        _need_profile(profile)
        options.pop("weights")
        return calibrated_terms_s(rows, hidden, intermediate, dtype_bytes, profile, **options)["time_s"]
    if not flops_per_s > 0 or not memory_bytes_per_s > 0:
        raise InputError("GPU rates", "FLOP/s and bytes/s > 0", f"{flops_per_s}, {memory_bytes_per_s}")
    _, flops, memory = expert_work_arrays(rows, hidden, intermediate, dtype_bytes, **options)
    return np.maximum(flops / flops_per_s, memory / memory_bytes_per_s)


def gpu_expert_work(rows_per_expert, hidden: int, intermediate: int, dtype_bytes: float, flops_per_s: float,
                    memory_bytes_per_s: float, *, weights: str = "tiles", block_m: int | None = None,
                    block_n: int = 128, matrices: int = 3, pad_empty: bool = False,
                    flops_per_row: float | None = None, profile=None) -> GpuExpertWork:
    """FLOPs, bytes and time of one GPU's grouped expert GEMM (`expert_work_arrays` on rows `[experts]`;
    with `weights="calibrated"`, `calibrated_terms_s` with `profile`)."""
    rows = check_rows(rows_per_expert)
    if weights == "calibrated":
        _need_profile(profile)
        t = {key: float(value) for key, value in calibrated_terms_s(
            rows, hidden, intermediate, dtype_bytes, profile, block_m=block_m, block_n=block_n, matrices=matrices,
            pad_empty=pad_empty, flops_per_row=flops_per_row).items()}
        return GpuExpertWork(float(rows.sum()), t["computed_rows"], t["flops"], t["hbm_bytes"], t["compute_s"],
                             t["memory_s"], tile_bytes=t["tile_bytes"], tile_s=t["tile_s"], fixed_s=t["fixed_s"])
    if not flops_per_s > 0 or not memory_bytes_per_s > 0:
        raise InputError("GPU rates", "FLOP/s and bytes/s > 0", f"{flops_per_s}, {memory_bytes_per_s}")
    computed, flops, memory = (float(a) for a in expert_work_arrays(
        rows, hidden, intermediate, dtype_bytes, weights=weights, block_m=block_m, block_n=block_n,
        matrices=matrices, pad_empty=pad_empty, flops_per_row=flops_per_row))
    return GpuExpertWork(float(rows.sum()), computed, flops, memory, flops / flops_per_s, memory / memory_bytes_per_s)


def gpu_times_s(rows_by_gpu: np.ndarray, hidden: int, intermediate: int, dtype_bytes: float, flops_per_s: float,
                memory_bytes_per_s: float, *, weights: str = "once", block_m: int | None = None, block_n: int = 128,
                matrices: int = 3, flops_per_row: float | None = None, profile=None) -> np.ndarray:
    """float64 `[..., G]`: `gpu_expert_work(rows).time_s` of every GPU at once (no empty-expert padding).

    rows_by_gpu: float `[..., G, S]`, the valid rows of each of a GPU's `S` local experts (slots).
    The same formulas as `gpu_expert_work` (tests compare them), vectorised for the planners.
    """
    rows = np.asarray(rows_by_gpu, dtype=np.float64)
    if weights not in WEIGHT_MODES:
        raise InputError("weights", f"one of {WEIGHT_MODES}", repr(weights))
    if weights == "calibrated":
        _need_profile(profile)
        return calibrated_terms_s(rows, hidden, intermediate, dtype_bytes, profile, block_m=block_m,
                                  block_n=block_n, matrices=matrices, flops_per_row=flops_per_row)["time_s"]
    if weights == "tiles" and block_m is None:
        raise InputError("block_m", "a tile height when weights = 'tiles'", "nothing")
    params = matrices * hidden * intermediate
    per_row = 2.0 * params if flops_per_row is None else float(flops_per_row)
    if block_m is not None:
        block_m = _positive_int(block_m, "block_m")
        computed = (np.ceil(rows / block_m) * block_m).sum(axis=-1)
    else:
        computed = rows.sum(axis=-1)
    touched = np.count_nonzero(rows, axis=-1)
    gated_bytes = 3 * hidden * intermediate * dtype_bytes  # formula 5 and the L2 model are for gate+up, down
    if weights == "none":
        memory = np.zeros_like(computed)
    elif weights == "once":
        memory = touched * params * dtype_bytes
    elif weights == "l2":
        memory = rows.sum(axis=-1) * (2 * hidden + 3 * intermediate) * dtype_bytes + touched * gated_bytes
    else:
        m_tiles = np.ceil(rows / block_m).sum(axis=-1)
        memory = m_tiles * gated_bytes + rows.sum(axis=-1) * tile_row_bytes(hidden, intermediate, dtype_bytes,
                                                                            block_n)
    return np.maximum(per_row * computed / flops_per_s, memory / memory_bytes_per_s)


def expert_time_s(rows_per_expert, hidden: int, intermediate: int, dtype_bytes: float, flops_per_s: float,
                  memory_bytes_per_s: float, *, weights: str = "tiles", block_m: int | None = None,
                  block_n: int = 128, matrices: int = 3, pad_empty: bool = False, profile=None) -> float:
    """Seconds of one GPU's expert work (`expert_times_s` on rows `[experts]`)."""
    rows = check_rows(rows_per_expert)
    return float(expert_times_s(rows, hidden, intermediate, dtype_bytes, flops_per_s, memory_bytes_per_s,
                                weights=weights, block_m=block_m, block_n=block_n, matrices=matrices,
                                pad_empty=pad_empty, profile=profile))


@dataclass(frozen=True)
class LayerTime:
    """Per-GPU expert work of one layer; the layer waits for the busiest GPU (the max, not the mean)."""

    per_gpu: tuple[GpuExpertWork, ...]

    @property
    def times_s(self) -> np.ndarray:
        return np.array([w.time_s for w in self.per_gpu])

    @property
    def busiest_gpu(self) -> int:
        return int(np.argmax(self.times_s))

    @property
    def time_s(self) -> float:
        return float(self.times_s.max()) if self.per_gpu else 0.0


def layer_time(rows_per_gpu: list, hidden: int, intermediate: int, dtype_bytes: float, flops_per_s: float,
               memory_bytes_per_s: float, **options) -> LayerTime:
    """`rows_per_gpu[g]` is GPU g's rows per local expert; options as in `gpu_expert_work`."""
    return LayerTime(tuple(gpu_expert_work(rows, hidden, intermediate, dtype_bytes, flops_per_s, memory_bytes_per_s,
                                           **options) for rows in rows_per_gpu))
