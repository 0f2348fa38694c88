"""Grouped GEMM for the expert MLP: `y = (silu(x @ W_gate^T) * (x @ W_up^T)) @ W_down^T` per expert.

Idea
----
The rows `x` are the dispatches in expert order (see `align.ExpertLayout`). The GEMM is split in
M-tiles of BLOCK_M rows that each belong to one expert, and N-tiles of BLOCK_N output columns;
one program computes one (M-tile, N-tile) block, looping over K in steps of BLOCK_K with fp32
accumulation (Triton tutorial 03's blocked matmul, with the expert id picking the weight matrix).

Two addressing modes (same tiles, same executed work):
    padded      (`padded=True`) the rows of tile `t` come from `layout.padded_row_ids`, -1 rows are
                padding (vLLM `fused_moe` + `moe_align_block_size`);
    contiguous  (`padded=False`) tile `t` covers rows `[tile_row_start, tile_row_end)` of `x`,
                masked at the expert boundary (SGLang/DeepGEMM offsets style).

Two kernels make the MLP:
    1. gate+up fused: the weight `w13 [E, 2I, h]` holds gate rows `0..I-1` and up rows `I..2I-1`;
       a program accumulates both tiles and stores `silu(gate) * up` (`[rows, I]`);
    2. down: `w2 [E, h, I]`, stores `[rows, h]`.
Weights follow `nn.Linear` (`[out, in]`) and vLLM's `w13`/`w2` naming.

Inputs are BF16 (or FP8 e4m3 with a per-tensor activation scale and per-expert weight scales,
where the GPU has FP8 tensor cores: compute capability >= 8.9). Accumulation is fp32.
`UPCAST` converts tiles to fp32 before `tl.dot`: needed in the Triton interpreter, whose bf16
arithmetic is wrong; leave it off on a GPU so the tensor cores run bf16/fp8.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from moe_place.errors import InputError
from moe_place.kernels.align import ExpertLayout

__all__ = ["default_num_warps", "expert_mlp", "expert_mlp_torch", "fp8_supported", "grouped_gemm", "interpreting",
           "mlp_flops", "quantize_fp8"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


# ---------------------------------------------------------------------------------------- kernel
@triton.jit
def _grouped_gemm_kernel(
    # pointers: a [rows, K], b [E, N_b, K], c [rows, N]; scales (fp8 only): a_scale [1], b_scale [E]
    a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr,
    # the tile schedule from ExpertLayout
    tile_expert_ptr, tile_row_start_ptr, tile_row_end_ptr, padded_row_ids_ptr,
    # sizes: N output columns, K reduction
    N, K,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    num_tiles,
    # tile shape; GROUP_M M-tiles are walked together over every N-tile, so neighbouring programs
    # share activation rows and weight columns in L2 (tutorial 03's grouped ordering)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    # variants
    GATHER_ROWS: tl.constexpr,  # padded layout: row ids per tile from padded_row_ids (-1 = padding)
    GATE_UP: tl.constexpr,      # b holds [gate; up] (N_b = 2N): store silu(a@gate^T) * (a@up^T)
    HAS_SCALE: tl.constexpr,    # fp8 inputs: multiply the accumulators by a_scale * b_scale[expert]
    UPCAST: tl.constexpr,       # interpreter: do the arithmetic in fp32
):
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    programs_per_group = GROUP_M * num_pid_n
    first_m = (pid // programs_per_group) * GROUP_M
    group_m = tl.minimum(num_tiles - first_m, GROUP_M)
    pid_m = first_m + (pid % programs_per_group) % group_m
    pid_n = (pid % programs_per_group) // group_m
    expert = tl.load(tile_expert_ptr + pid_m).to(tl.int64)

    # rows of this tile (all from one expert) and whether each is real or padding
    lanes = tl.arange(0, BLOCK_M)
    if GATHER_ROWS:
        rows = tl.load(padded_row_ids_ptr + pid_m * BLOCK_M + lanes)
        row_mask = rows >= 0
    else:
        rows = tl.load(tile_row_start_ptr + pid_m) + lanes
        row_mask = rows < tl.load(tile_row_end_ptr + pid_m)
    rows = tl.where(row_mask, rows, 0).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        if GATE_UP:
            b_up = tl.load(b_ptrs + N * stride_bn, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if UPCAST:
                b_up = b_up.to(tl.float32)
            acc_up = tl.dot(a, b_up, acc_up)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if HAS_SCALE:
        scale = tl.load(a_scale_ptr) * tl.load(b_scale_ptr + expert)
        acc = acc * scale
        acc_up = acc_up * scale
    if GATE_UP:
        acc = acc * tl.sigmoid(acc) * acc_up  # silu(gate) * up

    c_ptrs = c_ptr + rows[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


# ---------------------------------------------------------------------------------------- wrappers
def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def fp8_supported(device: torch.device | str) -> bool:
    """FP8 e4m3 tensor cores: CUDA compute capability >= 8.9 (Ada, Hopper); the interpreter emulates it."""
    device = torch.device(device)
    if device.type != "cuda":
        return interpreting()
    return torch.cuda.get_device_capability(device) >= (8, 9)


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, layout: ExpertLayout, *, gate_up: bool = False,
                 padded: bool = True, block_n: int = 64, block_k: int = 64, out_dtype: torch.dtype | None = None,
                 a_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
                 upcast: bool | None = None, group_m: int = 8, num_warps: int | None = None,
                 num_stages: int = 3) -> torch.Tensor:
    """One grouped GEMM: row `r` of expert `e` gives `a[r] @ w[e]^T` (or silu*mul with `gate_up`).

    a: `[num_pairs, K]` rows in expert order (any row stride), bf16/fp16/fp32 or fp8 e4m3.
    w: `[E, N_w, K]`; with `gate_up`, `N_w = 2*N` (gate rows then up rows).
    layout: from `align` (its block_m is BLOCK_M).
    a_scale: fp32 `[1]`, w_scale: fp32 `[E]`, both required for fp8 inputs (dequantisation scales).
    group_m: M-tiles walked together (L2 reuse); num_warps: default from `default_num_warps`.
    Returns `[num_pairs, N]` in `out_dtype` (default: a's dtype, bf16 for fp8 inputs).
    """
    num_experts, n_w, k_dim = _check_gemm(a, w, layout, gate_up, block_n, block_k)
    n_out = n_w // 2 if gate_up else n_w
    is_fp8 = a.dtype == FP8_DTYPE
    if is_fp8:
        if not fp8_supported(a.device):
            raise InputError("a", "bf16 inputs on this GPU (fp8 needs compute capability >= 8.9)", a.dtype)
        if a_scale is None or w_scale is None or w_scale.numel() != num_experts:
            raise InputError("a_scale/w_scale", f"fp8 scales: a_scale [1] and w_scale [{num_experts}]")
    if upcast is None:
        upcast = interpreting()
    out_dtype = out_dtype or (torch.bfloat16 if is_fp8 else a.dtype)
    out = torch.empty((layout.num_pairs, n_out), dtype=out_dtype, device=a.device)
    if layout.num_tiles == 0 or n_out == 0:
        return out
    dummy = out  # never read when HAS_SCALE is False
    grid = (layout.num_tiles * triton.cdiv(n_out, block_n),)
    if num_warps is None:
        num_warps = default_num_warps(layout.block_m, block_n, gate_up)
    _grouped_gemm_kernel[grid](
        a, w, out, a_scale if is_fp8 else dummy, w_scale if is_fp8 else dummy,
        layout.tile_expert, layout.tile_row_start, layout.tile_row_end, layout.padded_row_ids,
        n_out, k_dim,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        layout.num_tiles,
        BLOCK_M=layout.block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        GATHER_ROWS=padded, GATE_UP=gate_up, HAS_SCALE=is_fp8, UPCAST=upcast,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def default_num_warps(block_m: int, block_n: int, gate_up: bool) -> int:
    """Warps per program: about 64 fp32 accumulator registers per thread, 4..16 warps.

    Compiled for sm_90 (`moe_place.kernels.aot`), BLOCK_N=128: gate+up at BLOCK_M=64 needs 8 warps and
    at BLOCK_M=128 16 warps to stay under 255 registers per thread without spilling.
    """
    accumulators = block_m * block_n * (2 if gate_up else 1)
    return int(min(16, max(4, triton.next_power_of_2(accumulators // (64 * 32)))))


def expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, layout: ExpertLayout, *,
               padded: bool = True, block_n: int = 64, block_k: int = 64, upcast: bool | None = None,
               x_scale: torch.Tensor | None = None, w13_scale: torch.Tensor | None = None,
               w2_scale: torch.Tensor | None = None, group_m: int = 8, num_warps: int | None = None,
               num_stages: int = 3) -> torch.Tensor:
    """The expert MLP on rows in expert order: gate+up fused with SiLU*mul, then down.

    x: `[num_pairs, h]`; w13: `[E, 2I, h]`; w2: `[E, h, I]`. Returns `[num_pairs, h]` (bf16 for fp8).
    For fp8, x/w13/w2 are e4m3 with scales x_scale `[1]`, w13_scale `[E]`, w2_scale `[E]`; the
    intermediate is computed in bf16 and re-quantised per tensor for the down GEMM.
    """
    if w13.ndim != 3 or w2.ndim != 3 or w2.shape[0] != w13.shape[0] or w13.shape[1] != 2 * w2.shape[2] \
            or w2.shape[1] != w13.shape[2]:
        raise InputError("w13/w2", "w13 [E, 2I, h] and w2 [E, h, I]",
                         f"{tuple(w13.shape)} and {tuple(w2.shape)}")
    common = dict(padded=padded, block_n=block_n, block_k=block_k, upcast=upcast, group_m=group_m,
                  num_warps=num_warps, num_stages=num_stages)
    act = grouped_gemm(x, w13, layout, gate_up=True, a_scale=x_scale, w_scale=w13_scale, **common)
    if x.dtype == FP8_DTYPE:
        act, act_scale = quantize_fp8(act)
        return grouped_gemm(act, w2, layout, a_scale=act_scale, w_scale=w2_scale, **common)
    return grouped_gemm(act, w2, layout, **common)


def quantize_fp8(t: torch.Tensor, dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor (or, with `dim=0`, per-leading-index) e4m3 quantisation: `t ~= q * scale`."""
    t32 = t.float()
    if dim is None:
        amax = t32.abs().amax().reshape(1)
    else:
        amax = t32.abs().reshape(t.shape[0], -1).amax(dim=1)
    scale = torch.clamp(amax, min=1e-12) / FP8_MAX
    shape = (-1,) + (1,) * (t.ndim - 1) if dim is not None else (1,) * t.ndim
    q = (t32 / scale.reshape(shape)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.to(torch.float32)


# ---------------------------------------------------------------------------------------- reference
def expert_mlp_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, rows_per_expert,
                     act_dtype: torch.dtype | None = None, x_scale=None, w13_scale=None, w2_scale=None) -> torch.Tensor:
    """Plain-torch reference: loop over experts, fp32 math, intermediate rounded to `act_dtype`.

    x: `[num_pairs, h]` rows in expert order; rows_per_expert: `[E]` counts (contiguous order).
    act_dtype: dtype the kernel stores the SiLU*mul intermediate in (default: x's dtype; bf16 for fp8).
    Returns fp32 `[num_pairs, h]`.
    """
    rows = [int(r) for r in torch.as_tensor(rows_per_expert).tolist()]
    is_fp8 = x.dtype == FP8_DTYPE
    act_dtype = act_dtype or (torch.bfloat16 if is_fp8 else x.dtype)
    n_inter = w2.shape[2]
    out = torch.empty((x.shape[0], w2.shape[1]), dtype=torch.float32, device=x.device)
    start = 0
    for expert, n in enumerate(rows):
        xe = x[start:start + n].float() * (x_scale.float() if is_fp8 else 1.0)
        w13e = w13[expert].float() * (w13_scale[expert].float() if is_fp8 else 1.0)
        w2e = w2[expert].float() * (w2_scale[expert].float() if is_fp8 else 1.0)
        gate_up = xe @ w13e.T
        act = (torch.nn.functional.silu(gate_up[:, :n_inter]) * gate_up[:, n_inter:]).to(act_dtype).float()
        out[start:start + n] = act @ w2e.T
        start += n
    return out


def mlp_flops(rows: int, hidden: int, intermediate: int) -> int:
    """FLOPs of the expert MLP on `rows` rows: `2*rows*(2I*h + h*I) = 6*rows*h*I`."""
    return 6 * rows * hidden * intermediate


def _check_gemm(a: torch.Tensor, w: torch.Tensor, layout: ExpertLayout, gate_up: bool, block_n: int,
                block_k: int) -> tuple[int, int, int]:
    if a.ndim != 2:
        raise InputError("a", "a 2-D tensor [rows, K]", f"shape {tuple(a.shape)}")
    if w.ndim != 3:
        raise InputError("w", "a 3-D tensor [experts, N, K]", f"shape {tuple(w.shape)}")
    num_experts, n_w, k_dim = w.shape
    if a.shape[1] != k_dim:
        raise InputError("a", f"K = {k_dim} columns (w's last dimension)", a.shape[1])
    if a.shape[0] != layout.num_pairs:
        raise InputError("a", f"{layout.num_pairs} rows (the layout's dispatches)", a.shape[0])
    if num_experts != layout.num_experts:
        raise InputError("w", f"{layout.num_experts} experts (the layout's)", num_experts)
    if gate_up and n_w % 2:
        raise InputError("w", "an even number of rows [gate; up] with gate_up", n_w)
    if a.device != w.device or a.device != layout.tile_expert.device:
        raise InputError("a/w/layout", "tensors on one device", f"{a.device}, {w.device}, {layout.tile_expert.device}")
    if a.dtype != w.dtype:
        raise InputError("w", f"the dtype of a ({a.dtype})", w.dtype)
    for name, value in (("block_m", layout.block_m), ("block_n", block_n), ("block_k", block_k)):
        if value < 16 or value & (value - 1):
            raise InputError(name, "a power of two >= 16", value)
    if a.device.type != "cuda" and not interpreting():
        raise InputError("device", "a CUDA tensor, or TRITON_INTERPRET=1 for the CPU interpreter", a.device)
    return num_experts, n_w, k_dim
