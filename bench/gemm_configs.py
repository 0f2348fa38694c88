"""Diagnosis (GPU only): grouped-GEMM time and TFLOP/s over kernel launch settings, vs dense torch.matmul.

Times `moe_place.kernels.grouped_gemm.expert_mlp` (CUDA-graph replay, L2 flushed, median of 10) on
8 experts of Qwen3-235B-A22B's shape (h=4096, I=1536) for a few (BLOCK_M, BLOCK_N, BLOCK_K,
num_warps, num_stages, GROUP_M) settings, to tell how much of the gap to cuBLAS is launch settings.

    python bench/gemm_configs.py --rows 2048 --output-json bench/results/gemm_configs.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from moe_place.kernels.align import layout_from_rows
from moe_place.kernels.grouped_gemm import expert_mlp, mlp_flops

sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import add_record_options, refuse_overwrite, write_record  # noqa: E402  (bench/ is not a package)

CONFIGS = [  # block_m, block_n, block_k, num_warps (None: default), num_stages, group_m
    (128, 128, 64, None, 3, 8),
    (128, 128, 64, None, 4, 8),
    (128, 128, 64, 8, 3, 8),
    (128, 64, 64, 8, 4, 8),
    (128, 256, 64, 8, 3, 8),
    (64, 128, 64, None, 4, 8),
    (128, 128, 128, 8, 3, 8),
    (128, 128, 64, None, 3, 1),
]


def time_graph(fn, flush: torch.Tensor, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2048, help="rows per expert (default 2048)")
    add_record_options(parser)
    args = parser.parse_args(argv)
    refuse_overwrite(parser, args)
    if not torch.cuda.is_available():
        print("gemm_configs: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev, experts, hidden, inter = torch.device("cuda"), 8, 4096, 1536
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = (torch.randn(experts, 2 * inter, hidden, device=dev, generator=gen) / hidden ** 0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, device=dev, generator=gen) / inter ** 0.5).bfloat16()
    flush = torch.empty(256 << 20, dtype=torch.int8, device=dev)
    flops = mlp_flops(args.rows * experts, hidden, inter)
    x = torch.randn(args.rows * experts, hidden, device=dev).bfloat16()
    a, b = torch.randn(8192, 8192, device=dev).bfloat16(), torch.randn(8192, 8192, device=dev).bfloat16()
    dense = 2 * 8192 ** 3 / time_graph(lambda: a @ b, flush)
    rows = []
    for block_m, block_n, block_k, warps, stages, group_m in CONFIGS:
        layout = layout_from_rows([args.rows] * experts, block_m, device=dev)
        try:
            t = time_graph(lambda: expert_mlp(x, w13, w2, layout, block_n=block_n, block_k=block_k, num_warps=warps,
                                              num_stages=stages, group_m=group_m), flush)
        except Exception as exc:  # a setting that does not compile (shared memory): keep the others
            print(f"{block_m}x{block_n}x{block_k} w{warps} s{stages} g{group_m}: {type(exc).__name__}", file=sys.stderr)
            continue
        row = {"block_m": block_m, "block_n": block_n, "block_k": block_k, "num_warps": warps, "num_stages": stages,
               "group_m": group_m, "ms": t * 1e3, "tflops": flops / t / 1e12, "of_dense_8192": flops / t / dense}
        rows.append(row)
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    print(f"dense 8192^3 bf16: {dense / 1e12:.0f} TFLOP/s")
    if args.output_json:
        write_record(args.output_json, {"rows_per_expert": args.rows, "experts": experts, "hidden": hidden,
                                        "intermediate": inter, "dense_flops_per_s": dense, "configs": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
