"""Triton kernels of one MoE layer and their plain-torch references (one op per module).

    align         sort dispatches by expert; padded (one expert per BLOCK_M tile) and contiguous layouts
    grouped_gemm  expert MLP: gate+up fused with SiLU*mul, then down; BF16 or FP8, fp32 accumulation
    dispatch      row gather into expert order; replica choice (split policy) and per-rank send plans
    combine       scatter back and top-k weighted sum
    split         the per-batch split: whole rows per replica from the batch's counts, each rank's dispatches to slots
    alltoall      multi-rank dispatch/combine over torch.distributed all_to_all_single (gloo, NCCL)
    aot           compile the kernels for sm_90 without a GPU (instruction selection, smem, spills)

On a machine without a GPU set `TRITON_INTERPRET=1` before importing a kernel module; the kernels
then upcast to fp32 before arithmetic (`upcast`), because the interpreter's bf16 arithmetic is wrong.
"""

# the package's modules
__all__ = ["align", "alltoall", "aot", "combine", "dispatch", "grouped_gemm", "report", "split"]
