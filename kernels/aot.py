"""Compile the kernels for a GPU architecture without a GPU, to check they lower to real GPU code.

Idea
----
The Triton interpreter checks what a kernel computes, not whether it compiles: a `tl.dot` shape the
tensor cores reject, shared memory over the limit or a type error in a constexpr branch only shows
on a GPU. `triton.compile` with an explicit `GPUTarget` runs the whole pipeline (TTIR, TTGIR, PTX,
and `ptxas` bundled with the triton wheel) on a CPU-only machine. Arguments get the specialisations
the JIT gives them at a real launch (unit strides become constants; pointers, sizes and strides
divisible by 16), so the software pipelining (cp.async) and wgmma selection match a GPU run.

Run it in a process *without* `TRITON_INTERPRET=1` (the interpreter patches `triton.language`):

    python -m moe_place.kernels.aot --arch 90          # H100/H200
    python -m moe_place.kernels.aot --arch 90 --quick  # a few configurations
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass

from moe_place.split import GOLDEN_PHASE, PHASE_UNITS, POLISH_SWEEPS

__all__ = ["CompiledKernel", "compile_all", "grouped_gemm_configs", "main", "split_configs"]

HOPPER_SMEM_BYTES = 227 * 1024  # usable shared memory per block on sm_90


@dataclass(frozen=True)
class CompiledKernel:
    """What the compiler made of one configuration."""

    kernel: str
    config: dict
    shared_bytes: int
    wgmma: int        # wgmma.mma_async instructions (Hopper tensor cores, warp-group MMA)
    mma_sync: int     # mma.sync instructions (Ampere-style tensor-core MMA)
    cp_async: int     # cp.async instructions (software-pipelined global->shared loads)
    registers: int    # per thread (cuobjdump -res-usage); -1 when cuobjdump is missing
    spill_bytes: int  # local memory per thread: > 0 means registers spilled


def _compile(fn, pointer_types: dict, ints: list[str], constants: dict, arch: int, num_warps: int, num_stages: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    index = {name: (fn.arg_names.index(name),) for name in fn.arg_names}
    signature = {name: "constexpr" for name in fn.arg_names}
    signature.update(pointer_types)
    signature.update({name: "i32" for name in ints})
    attrs = {index[name]: [["tt.divisibility", 16]] for name in list(pointer_types) + ints}
    source = ASTSource(fn, signature, constexprs={index[k]: v for k, v in constants.items()}, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def _summary(name: str, config: dict, compiled) -> CompiledKernel:
    ptx = compiled.asm["ptx"]
    registers, spills = _resource_usage(compiled.asm["cubin"])
    return CompiledKernel(name, config, int(compiled.metadata.shared), ptx.count("wgmma.mma_async"),
                          ptx.count("mma.sync"), ptx.count("cp.async.cg") + ptx.count("cp.async.ca"), registers, spills)


def _resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers per thread, local-memory bytes per thread) from the triton wheel's cuobjdump."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return -1, -1
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        text = subprocess.run([str(tool), "-res-usage", str(path)], capture_output=True, text=True, timeout=60).stdout
    regs, local = re.search(r"REG:(\d+)", text), re.search(r"LOCAL:(\d+)", text)
    return (int(regs.group(1)) if regs else -1), (int(local.group(1)) if local else -1)


def grouped_gemm_configs(quick: bool) -> list[dict]:
    """(dtype, BLOCK_M, GATHER_ROWS, GATE_UP) combinations the benchmarks launch; `quick`: three of them
    (smallest tile on mma.sync, wgmma tiles in bf16 and fp8, both addressing modes, both GEMMs)."""
    if quick:
        combos = [("bf16", 64, True, True), ("bf16", 16, False, False), ("fp8e4nv", 128, True, True)]
    else:
        combos = [(d, m, g, u) for d in ("bf16", "fp8e4nv") for m in (16, 32, 64, 128) for g in (True, False)
                  for u in (True, False)]
    return [{"dtype": d, "BLOCK_M": m, "BLOCK_N": 128, "BLOCK_K": 64, "GATHER_ROWS": g, "GATE_UP": u}
            for d, m, g, u in combos]


def split_configs(quick: bool) -> list[dict]:
    """Class tiles of the per-batch split's solve (`moe_place.kernels.split`) that the benchmark launches: EP144 with
    two redundant slots per GPU (the largest, 8 warps); the full run adds EP8 with one (the smallest)."""
    largest = {"BC": 8, "BK": 64, "BM": 16, "BG": 256, "BS": 4, "num_warps": 8}
    return [largest] if quick else [{"BC": 4, "BK": 4, "BM": 4, "BG": 8, "BS": 64, "num_warps": 4}, largest]


def compile_all(arch: int = 90, quick: bool = False) -> list[CompiledKernel]:
    """Compile the grouped GEMM, gather, combine and split kernels for `sm_{arch}`."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter patches triton.language and cannot compile")
    # the kernel modules are imported only now, on purpose: importing them with TRITON_INTERPRET set
    # would bind the interpreter's patched triton.language, which cannot compile
    from moe_place.kernels.combine import _combine_kernel
    from moe_place.kernels.dispatch import _gather_rows_kernel
    from moe_place.kernels.grouped_gemm import _grouped_gemm_kernel, default_num_warps
    from moe_place.kernels.split import UNITS, _count_kernel, _map_kernel, _scan_kernel, _split_solve_kernel

    results = []
    for cfg in grouped_gemm_configs(quick):
        dtype = cfg["dtype"]
        pointers = {"a_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "c_ptr": "*bf16", "a_scale_ptr": "*fp32",
                    "b_scale_ptr": "*fp32", "tile_expert_ptr": "*i64", "tile_row_start_ptr": "*i64",
                    "tile_row_end_ptr": "*i64", "padded_row_ids_ptr": "*i64"}
        ints = ["N", "K", "stride_am", "stride_be", "stride_bn", "stride_cm", "num_tiles"]
        constants = {"stride_ak": 1, "stride_bk": 1, "stride_cn": 1, "HAS_SCALE": dtype != "bf16", "UPCAST": False,
                     "GROUP_M": 8, **{k: v for k, v in cfg.items() if k != "dtype"}}
        num_warps = default_num_warps(cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["GATE_UP"])
        compiled = _compile(_grouped_gemm_kernel, pointers, ints, constants, arch, num_warps, 3)
        results.append(_summary("grouped_gemm", {**cfg, "num_warps": num_warps, "num_stages": 3}, compiled))
    gather = _compile(_gather_rows_kernel, {"src_ptr": "*bf16", "dst_ptr": "*bf16", "index_ptr": "*i64"},
                      ["num_rows", "H", "stride_src", "stride_dst"], {"BLOCK_R": 8, "BLOCK_H": 1024}, arch, 4, 1)
    results.append(_summary("gather_rows", {"BLOCK_R": 8, "BLOCK_H": 1024}, gather))
    merge = _compile(_combine_kernel, {"y_ptr": "*bf16", "out_ptr": "*bf16", "row_of_pair_ptr": "*i64",
                                       "weight_ptr": "*fp32"},
                     ["num_tokens", "H", "stride_y", "stride_out", "stride_wt"],
                     {"TOP_K": 8, "BLOCK_T": 8, "BLOCK_H": 1024}, arch, 4, 1)
    results.append(_summary("combine", {"TOP_K": 8, "BLOCK_T": 8, "BLOCK_H": 1024}, merge))
    tables = ["counts_ptr", "shares_ptr", "phy2log_ptr", "replicated_ptr", "num_classes_ptr", "expert_ptr", "slot_ptr",
              "gpu_ptr", "lead_ptr", "mult_ptr", "nth_ptr", "inverse_ptr"]
    for cfg in split_configs(quick):
        tiles = {k: v for k, v in cfg.items() if k != "num_warps"}
        solve = _compile(_split_solve_kernel, {name: "*i32" for name in tables},
                         ["layer0", "C", "P", "S", "G", "sweeps", "stride_counts", "stride_shares"],
                         {"UNITS": UNITS, "POLISH": POLISH_SWEEPS, **tiles}, arch, cfg["num_warps"], 1)
        results.append(_summary("split_solve", cfg, solve))
    count = _compile(_count_kernel, {"ids_ptr": "*i32", "block_counts_ptr": "*i32"},
                     ["num_dispatches", "top_k", "stride_t", "stride_j", "E"], {"BLOCK": 128, "BE": 256}, arch, 4, 1)
    results.append(_summary("split_count", {"BLOCK": 128, "BE": 256}, count))
    scan = _compile(_scan_kernel, {"block_counts_ptr": "*i32", "block_start_ptr": "*i32", "counts_ptr": "*i32"},
                    ["num_blocks", "E"], {"BLOCK_B": 32, "BLOCK_E": 32}, arch, 4, 1)
    results.append(_summary("split_scan", {"BLOCK_B": 32, "BLOCK_E": 32}, scan))
    mapping = _compile(_map_kernel, {name: "*i32" for name in ["ids_ptr", "slots_ptr", "block_start_ptr", "counts_ptr",
                                                              "shares_ptr", "log2phy_ptr", "logcnt_ptr"]},
                       ["num_dispatches", "top_k", "stride_t", "stride_j", "stride_out_t", "stride_out_j", "E", "W",
                        "phase0"], {"PHASE_UNITS": PHASE_UNITS, "GOLDEN": GOLDEN_PHASE, "BLOCK": 128, "BW": 16}, arch, 4, 1)
    results.append(_summary("split_map", {"BLOCK": 128, "BW": 16}, mapping))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_place.kernels.aot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10 (90 = Hopper)")
    parser.add_argument("--quick", action="store_true", help="a few configurations only")
    parser.add_argument("--format", choices=("table", "json"), default="table")
    args = parser.parse_args(argv)
    results = compile_all(args.arch, args.quick)
    if args.format == "json":
        print(json.dumps([asdict(r) for r in results], indent=1))
    else:
        print(f"{'kernel':<13} {'config':<62} {'smem KiB':>8} {'wgmma':>6} {'mma':>5} {'cp.async':>8} {'regs':>4} {'spill':>5}")
        for r in results:
            cfg = " ".join(f"{k}={v}" for k, v in r.config.items() if k not in ("BLOCK_N", "BLOCK_K", "num_stages"))
            print(f"{r.kernel:<13} {cfg:<62} {r.shared_bytes / 1024:>8.1f} {r.wgmma:>6} {r.mma_sync:>5} {r.cp_async:>8} "
                  f"{r.registers:>4} {r.spill_bytes:>5}")
    over = [r for r in results if args.arch == 90 and r.shared_bytes > HOPPER_SMEM_BYTES]
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
