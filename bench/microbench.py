"""Microbenchmarks: grouped GEMM padding, EP skew, replica payback, dispatch/combine; predicted vs measured.

Every row puts the cost model's prediction (`moe_place.cost`) beside a measurement of the same
work, and their ratio (measured / predicted). Two predictions are given:

    predicted_catalog_s   datasheet peaks x efficiency (0.5) of the GPU part (the model as users run it);
    predicted_s           the same formulas with the rates measured in this run (dense BF16 matmul
                          FLOP/s, device-to-device copy bandwidth): it tests the model's *shape*
                          (padding, tiles, skew, payback) apart from its peak figures.

On a GPU the measured path is the Triton kernel (`moe_place.kernels`). On a CPU (`--dry-run`, or no
GPU) the kernels run once in the Triton interpreter to check them against the torch reference at
tiny sizes, and the timings are of the torch reference path, labelled "CPU timings": they check
shapes, padded-row counts and bytes, not GPU speed.

Usage:
    python bench/microbench.py all --output-json bench/results/run.json          # on a GPU (~3 min)
    python bench/microbench.py all --dry-run --output-json /tmp/dry.json         # CPU, seconds
    python bench/microbench.py padding --block-m 16,32,64,128 --gpu H200
Sections: calibrate (always), padding, gemm, skew, payback, dispatch, split (the per-batch split's kernels: no
prediction, a speed goal against a copy of the same bytes).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import numpy as np

from moe_place.kernels.report import SECTIONS, render_markdown  # the one list of sections and one rendering

sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import add_record_options, missed_targets, refuse_overwrite, write_record  # noqa: E402


# ---------------------------------------------------------------------------------------- sizes
@dataclass(frozen=True)
class Sizes:
    """Problem sizes of one run; `full()` for a Hopper GPU, `dry()` for the CPU interpreter."""

    hidden: int                 # padding/skew/dispatch expert shape (Qwen3-30B-A3B: 2048 x 768)
    intermediate: int
    padding_experts: int
    padding_rows: tuple[int, ...]
    block_ms: tuple[int, ...]
    gemm_hidden: int            # gemm/payback expert shape (Qwen3-235B-A22B: 4096 x 1536, 36 MiB)
    gemm_intermediate: int
    gemm_rows: tuple[int, ...]
    skew_experts: int
    skew_gpus: int
    skew_total_rows: int
    payback_rows: int           # rows of each hot expert (C9: 128 tokens x top-8 over 8 hot experts)
    payback_block_m: int        # C9: 64, so a hot expert's rows halve from two M-tiles to one
    dispatch_tokens: int        # tokens of the Qwen3 trace step (0 = all)
    calib_matmul: int
    calib_copy_bytes: int
    block_n: int = 128
    block_k: int = 64
    reps: int = 10
    # the per-batch split (issue 45): E experts top-k, EP sizes, redundant slots per GPU, global tokens per step
    split_experts: int = 256
    split_top_k: int = 8
    split_gpus: tuple[int, ...] = (8, 16, 32, 64, 144)
    split_redundant_per_gpu: tuple[int, ...] = (1, 2)
    split_tokens: tuple[int, ...] = (512, 4096, 16384)
    split_more_sweeps: int = 16   # the solve also timed with this many sweeps (the default is 8): time vs balance

    @classmethod
    def full(cls) -> "Sizes":
        return cls(hidden=2048, intermediate=768, padding_experts=8,
                   padding_rows=(1, 8, 16, 17, 32, 33, 64, 65, 128, 129, 256, 512, 1024, 2048, 4096),
                   block_ms=(16, 32, 64, 128), gemm_hidden=4096, gemm_intermediate=1536,
                   gemm_rows=(64, 128, 256, 512, 1024, 2048, 4096), skew_experts=128, skew_gpus=8,
                   skew_total_rows=65536, payback_rows=128, payback_block_m=64, dispatch_tokens=0, calib_matmul=8192,
                   calib_copy_bytes=1 << 30)

    @classmethod
    def dry(cls) -> "Sizes":
        return cls(hidden=64, intermediate=128, padding_experts=4, padding_rows=(1, 17, 33),
                   block_ms=(16, 32), gemm_hidden=64, gemm_intermediate=128, gemm_rows=(16, 64),
                   skew_experts=16, skew_gpus=4, skew_total_rows=256, payback_rows=64, payback_block_m=32, dispatch_tokens=64,
                   calib_matmul=256, calib_copy_bytes=1 << 22, block_k=64, reps=2, split_experts=37, split_top_k=4,
                   split_gpus=(3, 8), split_redundant_per_gpu=(1,), split_tokens=(96,))


# ---------------------------------------------------------------------------------------- timing
class Timer:
    """The one timing helper: median seconds of `fn` over `reps` runs after a warm-up.

    On a GPU each run is timed with CUDA events after flushing L2 (a 256 MiB write), so weights
    come from HBM as the model assumes, in two ways:

        graph   `fn` captured once in a CUDA graph and replayed: the GPU time of its kernels, what a
                serving engine that replays graphs pays (the model predicts this);
        eager   `fn` called from Python: adds the host's launch overhead (Triton's launcher is tens
                of microseconds per kernel), which a small kernel cannot hide.

    `__call__` returns the graph time (the eager time where `fn` cannot be captured) and keeps the
    eager time in `last_eager_s`. On a CPU, `time.perf_counter` of plain calls.
    """

    def __init__(self, device, reps: int):
        import torch

        self.torch, self.device, self.reps = torch, device, reps
        self.cuda = device.type == "cuda"
        self.flush = torch.empty(256 << 20, dtype=torch.int8, device=device) if self.cuda else None
        self.last_eager_s: float | None = None
        self.last_graph_s: float | None = None

    def __call__(self, fn, reps: int | None = None, graph: bool = True) -> float:
        """Median seconds of `fn`; `graph=False` times plain calls only (copies: a device-to-device copy
        captured in a graph becomes a memcpy node, which ran at 1.38 TB/s against 2.12 TB/s for the
        eager copy kernel on an H200, and engines issue weight copies eagerly)."""
        reps = reps or self.reps
        if not self.cuda:
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            self.last_eager_s, self.last_graph_s = float(np.median(times)), None
            return self.last_eager_s
        torch = self.torch
        fn()  # warm-up (and Triton compile)
        torch.cuda.synchronize()
        self.last_eager_s = self._events(fn, reps)
        captured = self._capture(fn) if graph else None
        self.last_graph_s = self._events(captured.replay, reps) if captured is not None else None
        return self.last_graph_s if self.last_graph_s is not None else self.last_eager_s

    def _events(self, fn, reps: int) -> float:
        torch = self.torch
        times = []
        for _ in range(reps):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return float(np.median(times))

    def _capture(self, fn):
        """`fn` in a CUDA graph, or None where it cannot be captured (a host sync inside it)."""
        torch = self.torch
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side):
                fn()  # warm-up on the capture stream (allocator pools)
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph):
                fn()
        except RuntimeError as exc:
            print(f"microbench: CUDA graph capture failed ({exc.__class__.__name__}: {str(exc)[:80]}); eager timing",
                  file=sys.stderr)
            torch.cuda.synchronize()
            return None
        torch.cuda.synchronize()
        return graph


# ---------------------------------------------------------------------------------------- context
@dataclass
class Context:
    """What every section needs: device, sizes, timer, the GPU part, measured rates."""

    device: object
    sizes: Sizes
    timer: Timer
    gpu_part: object
    on_gpu: bool
    flops_per_s: float = 0.0        # measured dense BF16 matmul
    copy_bytes_per_s: float = 0.0   # measured device-to-device copy (read + write)
    alpha_s: float = 0.0            # measured cost of a tiny copy (launch overhead)
    checks: list = field(default_factory=list)

    @property
    def timing(self) -> str:
        return "gpu" if self.on_gpu else "CPU timings (torch reference path)"


def environment(ctx: Context) -> dict:
    """GPU name, SM count, clocks (nvidia-smi), versions: recorded with every result."""
    import torch
    import triton

    env = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "cuda": torch.version.cuda, "platform": platform.platform(), "cpu_count": os.cpu_count(),
           "device": str(ctx.device), "timing": ctx.timing,
           "triton_interpret": os.environ.get("TRITON_INTERPRET", "0"), "gpu_part": ctx.gpu_part.name}
    if ctx.on_gpu:
        props = torch.cuda.get_device_properties(ctx.device)
        env.update(gpu_name=props.name, sm_count=props.multi_processor_count,
                   gpu_memory_bytes=props.total_memory, compute_capability=f"{props.major}.{props.minor}")
        env["nvidia_smi"] = _nvidia_smi()
    return env


def _nvidia_smi() -> dict:
    query = "name,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.limit,driver_version,temperature.gpu"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=True).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return {}
    return dict(zip(query.split(","), (v.strip() for v in out.split(","))))


def calibrate(ctx: Context) -> dict:
    """Measured rates the calibrated predictions use: dense BF16 matmul FLOP/s, copy bytes/s, alpha."""
    torch = ctx.timer.torch
    n = ctx.sizes.calib_matmul
    dtype = torch.bfloat16 if ctx.on_gpu else torch.float32
    a = torch.randn(n, n, device=ctx.device, dtype=dtype)
    b = torch.randn(n, n, device=ctx.device, dtype=dtype)
    t_mm = ctx.timer(lambda: torch.matmul(a, b))
    src = torch.empty(ctx.sizes.calib_copy_bytes, dtype=torch.uint8, device=ctx.device)
    dst = torch.empty_like(src)
    t_copy = ctx.timer(lambda: dst.copy_(src), graph=False)
    tiny_src = torch.empty(4096, dtype=torch.uint8, device=ctx.device)
    tiny_dst = torch.empty_like(tiny_src)
    ctx.alpha_s = ctx.timer(lambda: tiny_dst.copy_(tiny_src), graph=False)
    ctx.flops_per_s = 2 * n ** 3 / t_mm
    # a copy reads and writes every byte: HBM traffic is 2x the size; the copy *rate* is size/time
    ctx.copy_bytes_per_s = src.numel() / t_copy
    hbm_bytes_per_s = 2 * src.numel() / t_copy
    del a, b, src, dst
    return {"matmul_n": n, "matmul_dtype": str(dtype), "matmul_s": t_mm, "dense_flops_per_s": ctx.flops_per_s,
            "copy_bytes": ctx.sizes.calib_copy_bytes, "copy_s": t_copy, "copy_bytes_per_s": ctx.copy_bytes_per_s,
            "hbm_bytes_per_s": hbm_bytes_per_s, "alpha_s": ctx.alpha_s,
            "catalog_flops_per_s": ctx.gpu_part.flops_per_s, "catalog_hbm_bytes_per_s": ctx.gpu_part.memory_bytes_per_s}


# ---------------------------------------------------------------------------------------- expert work
class ExpertBank:
    """Random BF16 weights for `experts` experts of one shape, reused by every run of that shape."""

    def __init__(self, ctx: Context, experts: int, hidden: int, intermediate: int, seed: int = 0):
        torch = ctx.timer.torch
        gen = torch.Generator(device=ctx.device).manual_seed(seed)
        dtype = torch.bfloat16
        self.hidden, self.intermediate = hidden, intermediate
        self.w13 = (torch.randn(experts, 2 * intermediate, hidden, device=ctx.device, generator=gen)
                    / hidden ** 0.5).to(dtype)
        self.w2 = (torch.randn(experts, hidden, intermediate, device=ctx.device, generator=gen)
                   / intermediate ** 0.5).to(dtype)


def run_expert_work(ctx: Context, bank: ExpertBank, rows_per_expert, block_m: int, check: bool = False,
                    padded: bool = True) -> dict:
    """Time the grouped expert MLP on `rows_per_expert` rows; count padded rows from the kernel's layout.

    On a GPU: the Triton kernel. On a CPU: the torch reference is timed; with `check` the Triton
    kernel also runs once in the interpreter and must match the reference.
    """
    torch = ctx.timer.torch
    from moe_place.kernels.align import layout_from_rows
    from moe_place.kernels.grouped_gemm import expert_mlp, expert_mlp_torch

    rows = np.asarray(rows_per_expert, dtype=np.int64)
    experts = len(rows)
    layout = layout_from_rows(rows, block_m, device=ctx.device)
    w13, w2 = bank.w13[:experts], bank.w2[:experts]
    x = torch.randn(layout.num_pairs, bank.hidden, device=ctx.device).to(torch.bfloat16)

    def kernel():
        return expert_mlp(x, w13, w2, layout, padded=padded, block_n=ctx.sizes.block_n, block_k=ctx.sizes.block_k)

    def reference():
        return expert_mlp_torch(x, w13, w2, layout.rows_per_expert)

    if check:
        got, want = kernel().float(), reference()
        err = float((got - want).abs().max()) if got.numel() else 0.0
        scale = float(want.abs().max()) if want.numel() else 1.0
        ok = err <= 0.05 * max(scale, 1.0)
        ctx.checks.append({"what": f"expert_mlp rows={rows.tolist()[:4]}... block_m={block_m}", "max_abs_err": err,
                           "ref_max_abs": scale, "ok": ok})
        if not ok:
            raise AssertionError(f"grouped GEMM differs from the torch reference: max error {err} (scale {scale})")
    measured = ctx.timer(kernel if ctx.on_gpu else reference)
    return {"measured_s": measured, "measured_eager_s": ctx.timer.last_eager_s, "valid_rows": int(rows.sum()), "kernel_padded_rows": layout.num_padded_rows,
            "tiles": layout.num_tiles}


def predict_s(ctx: Context, rows_per_expert, hidden: int, intermediate: int, block_m: int, catalog: bool = False,
              weights: str = "tiles") -> float:
    """The cost model's time for one GPU's grouped GEMM (formula 1 with formulas 4 and 5).

    weights="tiles": formula 5, no L2 reuse (the upper end); "l2": re-reads served from L2 (the lower end).
    """
    from moe_place.cost.gemm import expert_time_s

    flops = ctx.gpu_part.flops_per_s if catalog else ctx.flops_per_s
    hbm = ctx.gpu_part.memory_bytes_per_s if catalog else 2 * ctx.copy_bytes_per_s
    return expert_time_s(np.asarray(rows_per_expert), hidden, intermediate, 2, flops, hbm, weights=weights,
                         block_m=block_m, block_n=ctx.sizes.block_n)


def _ratio(measured: float, predicted: float) -> float | None:
    return measured / predicted if predicted > 0 else None


# ---------------------------------------------------------------------------------------- sections
def section_padding(ctx: Context) -> dict:
    """Padding staircase: E experts with r rows each, BLOCK_M swept; useful vs executed TFLOP/s."""
    from moe_place.cost.gemm import padded_rows
    from moe_place.kernels.grouped_gemm import mlp_flops

    s = ctx.sizes
    bank = ExpertBank(ctx, s.padding_experts, s.hidden, s.intermediate)
    rows_out = []
    for block_m in s.block_ms:
        for i, r in enumerate(s.padding_rows):
            rows = [r] * s.padding_experts
            m = run_expert_work(ctx, bank, rows, block_m, check=(i == 0 or not ctx.on_gpu and r == s.padding_rows[-1]))
            predicted_padded = padded_rows(rows, block_m)
            assert m["kernel_padded_rows"] == predicted_padded, "kernel layout and cost model disagree on padding"
            pred, pred_cat = (predict_s(ctx, rows, s.hidden, s.intermediate, block_m, catalog=c) for c in (False, True))
            pred_l2, pred_l2_cat = (predict_s(ctx, rows, s.hidden, s.intermediate, block_m, catalog=c, weights="l2")
                                    for c in (False, True))
            useful = mlp_flops(m["valid_rows"], s.hidden, s.intermediate)
            executed = mlp_flops(m["kernel_padded_rows"], s.hidden, s.intermediate)
            rows_out.append({"block_m": block_m, "rows_per_expert": r, "experts": s.padding_experts,
                             "valid_rows": m["valid_rows"], "padded_rows_kernel": m["kernel_padded_rows"],
                             "padded_rows_predicted": predicted_padded,
                             "padding_ratio": m["kernel_padded_rows"] / m["valid_rows"],
                             "useful_tflops": useful / m["measured_s"] / 1e12,
                             "executed_tflops": executed / m["measured_s"] / 1e12,
                             "measured_s": m["measured_s"], "measured_eager_s": m["measured_eager_s"],
                             "predicted_s": pred, "predicted_catalog_s": pred_cat,
                             "predicted_l2_s": pred_l2, "predicted_l2_catalog_s": pred_l2_cat,
                             "ratio": _ratio(m["measured_s"], pred), "ratio_l2": _ratio(m["measured_s"], pred_l2)})
    return {"hidden": s.hidden, "intermediate": s.intermediate, "block_n": s.block_n, "block_k": s.block_k,
            "rows": rows_out}


def section_gemm(ctx: Context) -> dict:
    """Grouped GEMM vs dense torch.matmul (same rows, one expert's weights) in BF16."""
    torch = ctx.timer.torch
    from moe_place.kernels.grouped_gemm import fp8_supported, mlp_flops

    s = ctx.sizes
    experts = 8
    bank = ExpertBank(ctx, experts, s.gemm_hidden, s.gemm_intermediate, seed=1)
    out = []
    for i, r in enumerate(s.gemm_rows):
        rows = [r] * experts
        block_m = 64 if r < 256 else 128
        m = run_expert_work(ctx, bank, rows, block_m, check=(i == 0))
        x = torch.randn(r * experts, s.gemm_hidden, device=ctx.device).to(torch.bfloat16)
        w13, w2 = bank.w13[0], bank.w2[0]
        if not ctx.on_gpu:
            x, w13, w2 = x.float(), w13.float(), w2.float()

        def dense():
            gate_up = torch.matmul(x, w13.T)
            act = torch.nn.functional.silu(gate_up[:, :s.gemm_intermediate]) * gate_up[:, s.gemm_intermediate:]
            return torch.matmul(act, w2.T)

        t_dense = ctx.timer(dense)
        t_dense_eager = ctx.timer.last_eager_s
        flops = mlp_flops(m["valid_rows"], s.gemm_hidden, s.gemm_intermediate)
        pred = predict_s(ctx, rows, s.gemm_hidden, s.gemm_intermediate, block_m)
        pred_l2 = predict_s(ctx, rows, s.gemm_hidden, s.gemm_intermediate, block_m, weights="l2")
        pred_l2_cat = predict_s(ctx, rows, s.gemm_hidden, s.gemm_intermediate, block_m, catalog=True, weights="l2")
        row = {"rows_per_expert": r, "experts": experts, "block_m": block_m, "grouped_s": m["measured_s"],
               "dense_s": t_dense, "dense_eager_s": t_dense_eager, "grouped_eager_s": m["measured_eager_s"], "grouped_tflops": flops / m["measured_s"] / 1e12,
               "dense_tflops": flops / t_dense / 1e12, "grouped_over_dense": t_dense / m["measured_s"],
               "measured_s": m["measured_s"], "predicted_s": pred, "ratio": _ratio(m["measured_s"], pred),
               "predicted_l2_s": pred_l2, "predicted_l2_catalog_s": pred_l2_cat,
               "ratio_l2": _ratio(m["measured_s"], pred_l2)}
        if fp8_supported(ctx.device) and (ctx.on_gpu or i == 0):  # on a CPU: once, in the interpreter
            t_fp8 = _time_fp8(ctx, bank, rows, block_m)
            row.update(fp8_grouped_s=t_fp8, fp8_grouped_tflops=flops / t_fp8 / 1e12)
        out.append(row)
    return {"hidden": s.gemm_hidden, "intermediate": s.gemm_intermediate, "block_n": s.block_n,
            "block_k": s.block_k, "rows": out}


def _time_fp8(ctx: Context, bank: ExpertBank, rows, block_m: int) -> float:
    """The same grouped MLP with FP8 e4m3 inputs (per-tensor activation, per-expert weight scales)."""
    torch = ctx.timer.torch
    from moe_place.kernels.align import layout_from_rows
    from moe_place.kernels.grouped_gemm import expert_mlp, quantize_fp8

    layout = layout_from_rows(rows, block_m, device=ctx.device)
    experts = len(rows)
    x8, xs = quantize_fp8(torch.randn(layout.num_pairs, bank.hidden, device=ctx.device))
    w13, w13s = quantize_fp8(bank.w13[:experts], dim=0)
    w2, w2s = quantize_fp8(bank.w2[:experts], dim=0)
    return ctx.timer(lambda: expert_mlp(x8, w13, w2, layout, x_scale=xs, w13_scale=w13s, w2_scale=w2s,
                                        block_n=ctx.sizes.block_n, block_k=ctx.sizes.block_k))


def skew_loads(ctx: Context) -> dict[str, np.ndarray]:
    """Loads per logical expert with the same total: uniform, Zipf(1.0), one hot expert, real Qwen3 layers."""
    s = ctx.sizes
    total, experts = s.skew_total_rows, s.skew_experts
    rng = np.random.default_rng(0)
    zipf = 1.0 / np.arange(1, experts + 1)
    hot = np.full(experts, 0.75 / (experts - 1))
    hot[0] = 0.25
    loads = {"uniform": np.full(experts, 1.0 / experts), "zipf": rng.permutation(zipf / zipf.sum()), "hot_expert": hot}
    from moe_place.traces.bundled import bundled_path
    from moe_place.traces.load import load_trace

    trace = load_trace(bundled_path("qwen3-30b-a3b_prefill_topk.npz"))
    counts = trace.step_counts()[0]  # [layers, 128] of the first recording
    skew = counts.max(axis=1) / counts.mean(axis=1)
    for name, layer in (("qwen3_most_skewed_layer", int(np.argmax(skew))), ("qwen3_median_layer", int(np.argsort(skew)[len(skew) // 2]))):
        share = counts[layer].astype(np.float64)
        if experts != share.size:  # dry run: fold the 128 experts onto fewer
            share = share.reshape(experts, -1).sum(axis=1)
        loads[f"{name}_{layer}"] = share / share.sum()
    return {name: _integer_rows(p, total) for name, p in loads.items()}


def _integer_rows(share: np.ndarray, total: int) -> np.ndarray:
    """Largest-remainder rounding of `share * total` to integers summing to `total`."""
    raw = share * total
    rows = np.floor(raw).astype(np.int64)
    rows[np.argsort(-(raw - rows), kind="stable")[:total - rows.sum()]] += 1
    return rows


def slot_rows(load: np.ndarray, phy2log: np.ndarray) -> np.ndarray:
    """int64 `[P]`: rows of each slot when an expert's rows are dealt round-robin over its replicas."""
    out = np.zeros(phy2log.size, dtype=np.int64)
    for expert in range(load.size):
        slots = np.flatnonzero(phy2log == expert)
        share, extra = divmod(int(load[expert]), slots.size)
        out[slots] = share
        out[slots[:extra]] += 1
    return out


def section_skew(ctx: Context) -> dict:
    """Busiest-rank time vs balanced at equal total rows; EP ranks emulated one after another."""
    from moe_place.analysis.replicate_hottest import replicate_hottest
    from moe_place.cost.gemm import layer_time
    from moe_place.placement import Placement

    s = ctx.sizes
    experts, gpus = s.skew_experts, s.skew_gpus
    per_gpu = experts // gpus
    block_m = 64
    bank = ExpertBank(ctx, per_gpu + 1, s.hidden, s.intermediate, seed=2)
    cases = []
    loads = skew_loads(ctx)
    for name, load in loads.items():
        placements = {"contiguous": Placement.contiguous(1, experts, gpus)}
        if name.startswith("qwen3") or name == "hot_expert":
            placements["replicate_hottest+1"] = replicate_hottest(load[None, :].astype(np.float64), gpus, 1)
        for pname, placement in placements.items():
            slots = slot_rows(load, placement.phy2log[0]).reshape(gpus, -1)
            measured = [run_expert_work(ctx, bank, slots[g], block_m, check=(g == 0 and not cases))["measured_s"]
                        for g in range(gpus)]
            predicted, predicted_l2 = (
                layer_time([slots[g] for g in range(gpus)], s.hidden, s.intermediate, 2, ctx.flops_per_s,
                           2 * ctx.copy_bytes_per_s, weights=mode, block_m=block_m, block_n=s.block_n).times_s
                for mode in ("tiles", "l2"))
            cases.append({"load": name, "placement": pname, "rows_per_gpu": slots.sum(axis=1).tolist(),
                          "slot_rows": slots.tolist(),  # each rank's rows per local expert (formula 11's checks)
                          "measured_per_gpu_s": measured, "predicted_per_gpu_s": predicted.tolist(),
                          "busiest_measured_s": max(measured), "busiest_predicted_s": float(predicted.max()),
                          "predicted_l2_per_gpu_s": predicted_l2.tolist(),
                          "busiest_predicted_l2_s": float(predicted_l2.max()),
                          "mean_measured_s": float(np.mean(measured))})
    balanced = next(c for c in cases if c["load"] == "uniform")
    for c in cases:
        c["skew_measured"] = c["busiest_measured_s"] / balanced["busiest_measured_s"]
        c["skew_predicted"] = c["busiest_predicted_s"] / balanced["busiest_predicted_s"]
        c["skew_predicted_l2"] = c["busiest_predicted_l2_s"] / balanced["busiest_predicted_l2_s"]
        c["ratio_l2"] = c["skew_measured"] / c["skew_predicted_l2"]
        c["ratio"] = c["skew_measured"] / c["skew_predicted"]
        c["busiest_ratio"] = _ratio(c["busiest_measured_s"], c["busiest_predicted_s"])
    return {"experts": experts, "gpus": gpus, "total_rows": s.skew_total_rows, "block_m": block_m,
            "hidden": s.hidden, "intermediate": s.intermediate, "cases": cases}


def payback_model(gpu_part, saving_per_batch_s: float, expert_bytes: int, copy_bytes_per_s: float | None,
                  alpha_s: float):
    """`moe_place.cost.payback` for C9's move: one expert copied from GPU 0 to each of GPUs 1..7, serially,
    over one HGX node whose GPU-to-GPU bandwidth is `copy_bytes_per_s` (None: the part's NVLink)."""
    from moe_place.cost.migration import Copy
    from moe_place.cost.payback import payback
    from moe_place.cost.topology import build_cluster

    topology = build_cluster(gpu_part, 1, 8, nvlink_bytes_per_s=copy_bytes_per_s)
    copies = [Copy(0, g, float(expert_bytes)) for g in range(1, 8)]
    return payback(topology, copies, saving_per_batch_s, alpha_s=alpha_s)


def section_payback(ctx: Context) -> dict:
    """row C9 shape: 8 hot experts on GPU 0; replicate 7 to GPUs 1..7 so GPU 0 keeps 128 + 7x64 rows."""
    torch = ctx.timer.torch

    s = ctx.sizes
    hidden, inter, block_m = s.gemm_hidden, s.gemm_intermediate, s.payback_block_m
    bank = ExpertBank(ctx, 8, hidden, inter, seed=3)
    r = s.payback_rows
    before, after = [r] * 8, [r] + [r // 2] * 7
    t_before = run_expert_work(ctx, bank, before, block_m, check=True)["measured_s"]
    t_after = run_expert_work(ctx, bank, after, block_m)["measured_s"]
    dt_measured = t_before - t_after
    dt_predicted = predict_s(ctx, before, hidden, inter, block_m) - predict_s(ctx, after, hidden, inter, block_m)
    dt_catalog = (predict_s(ctx, before, hidden, inter, block_m, catalog=True)
                  - predict_s(ctx, after, hidden, inter, block_m, catalog=True))
    dt_l2 = (predict_s(ctx, before, hidden, inter, block_m, weights="l2")
             - predict_s(ctx, after, hidden, inter, block_m, weights="l2"))
    # copies: 7 experts' weights (w13 + w2 of one expert), one after another, device to device
    expert_bytes = (bank.w13[0].numel() + bank.w2[0].numel()) * bank.w13.element_size()
    dst13, dst2 = torch.empty_like(bank.w13[:7]), torch.empty_like(bank.w2[:7])

    def copy_seven():
        for e in range(7):
            dst13[e].copy_(bank.w13[e + 1])
            dst2[e].copy_(bank.w2[e + 1])

    t_copy = ctx.timer(copy_seven, graph=False)
    t_copy_eager = ctx.timer.last_eager_s
    copy_bw = 7 * expert_bytes / t_copy
    # the model with the rates calibrated in this run: copy bandwidth of a 1 GiB copy, alpha of a tiny
    # copy per launch (two launches per expert: w13 and w2)
    model = payback_model(ctx.gpu_part, dt_predicted, expert_bytes, ctx.copy_bytes_per_s, 2 * ctx.alpha_s)
    model_measured_dt = (payback_model(ctx.gpu_part, dt_measured, expert_bytes, ctx.copy_bytes_per_s, 2 * ctx.alpha_s)
                         if dt_measured > 0 else None)
    nvlink = payback_model(ctx.gpu_part, dt_catalog, expert_bytes, None, 5e-6)
    n_min_measured = int(np.floor(t_copy / dt_measured)) + 1 if dt_measured > 0 else None
    n = np.arange(0, 65)
    return {"hidden": hidden, "intermediate": inter, "block_m": block_m, "block_n": s.block_n,
            "rows_before": before, "rows_after": after, "expert_bytes": expert_bytes,
            "t_before_s": t_before, "t_after_s": t_after, "saving_predicted_l2_s": dt_l2,
            "t_before_predicted_s": predict_s(ctx, before, hidden, inter, block_m),
            "t_after_predicted_s": predict_s(ctx, after, hidden, inter, block_m),
            "t_before_predicted_l2_s": predict_s(ctx, before, hidden, inter, block_m, weights="l2"),
            "t_after_predicted_l2_s": predict_s(ctx, after, hidden, inter, block_m, weights="l2"),
            "saving_measured_s": dt_measured, "saving_predicted_s": dt_predicted, "saving_catalog_s": dt_catalog,
            "saving_ratio": _ratio(dt_measured, dt_predicted),
            "copy_measured_s": t_copy, "copy_eager_s": t_copy_eager, "copy_bytes_per_s": copy_bw, "copy_predicted_s": model.copy_time_s,
            "copy_ratio": _ratio(t_copy, model.copy_time_s), "copy_model_bytes_per_s": ctx.copy_bytes_per_s,
            "copy_path": "device-to-device on one GPU (stands in for the NVLink copy)",
            "n_min_measured": n_min_measured, "n_min_predicted": model.n_min,
            "n_min_model_with_measured_saving": model_measured_dt.n_min if model_measured_dt else None,
            "nvlink_catalog": {"copy_s": nvlink.copy_time_s, "saving_s": dt_catalog, "n_min": nvlink.n_min},
            "curve": {"batches": n.tolist(), "measured_net_s": (n * dt_measured - t_copy).tolist(),
                      "predicted_net_s": model.net_gain_s(n).tolist(),
                      "nvlink_catalog_net_s": nvlink.net_gain_s(n).tolist()}}


def section_dispatch(ctx: Context) -> dict:
    """Dispatch/combine per rank for a Qwen3 layer on EP ranks: bytes (checked) and local pack/combine time.

    The all-to-all itself needs several GPUs; here each rank's send buffer is packed and its combine
    run on this device, one rank after another. Bytes come from the kernels' send plans and are
    compared with `moe_place.analysis.dispatch.dispatch_matrix` (the traffic matrix `a`); the
    transfer time is the model's formula 3 on an NVLink node (a prediction, not measured here).
    """
    torch = ctx.timer.torch
    from moe_place.analysis.dispatch import dispatch_matrix, token_sources
    from moe_place.cost.topology import build_cluster
    from moe_place.cost.traffic import phase_lower_bound
    from moe_place.kernels.combine import combine, combine_torch
    from moe_place.kernels.dispatch import gather_rows, gather_rows_torch, send_plan, split_tokens
    from moe_place.placement import Placement
    from moe_place.traces.bundled import bundled_path
    from moe_place.traces.load import load_trace

    s = ctx.sizes
    gpus, hidden = 8, s.hidden
    trace = load_trace(bundled_path("qwen3-30b-a3b_prefill_topk.npz"))
    ids_all = trace.topk_ids[0]
    counts = trace.step_counts()[0]
    layer = int(np.argmax(counts.max(axis=1) / counts.mean(axis=1)))
    ids = ids_all[: s.dispatch_tokens or None, layer, :].astype(np.int64)
    tokens, top_k = ids.shape
    placement = Placement.contiguous(1, 128, gpus)
    phy2log = torch.from_numpy(np.array(placement.phy2log[0])).to(ctx.device)
    bounds = split_tokens(tokens, gpus)
    a_model = dispatch_matrix(ids, token_sources(tokens, gpus, "blocks"), placement, 0, gpus)
    dtype = torch.bfloat16
    row_bytes = hidden * 2
    x_all = torch.randn(tokens, hidden, device=ctx.device).to(dtype)
    weights_all = torch.softmax(torch.randn(tokens, top_k, device=ctx.device), dim=1)
    # timed without the index range checks (a host sync each); the plans are checked once below
    gather = partial(gather_rows, check_index=False) if ctx.on_gpu else gather_rows_torch
    merge = partial(combine, check_index=False) if ctx.on_gpu else combine_torch
    per_rank, a_kernel = [], np.zeros((gpus, gpus), dtype=np.int64)
    for rank in range(gpus):
        lo, hi = int(bounds[rank]), int(bounds[rank + 1])
        ids_r = torch.from_numpy(ids[lo:hi]).to(ctx.device)
        plan = send_plan(ids_r, phy2log, gpus, rank, "even")
        a_kernel[rank] = plan.send_counts.cpu().numpy()
        x, w = x_all[lo:hi], weights_all[lo:hi].contiguous()
        token_of_row = plan.token_of_row
        if rank == 0:  # the Triton kernels against the torch references (interpreter on a CPU)
            sent = gather_rows(x, token_of_row)
            ok = bool(torch.equal(sent, gather_rows_torch(x, token_of_row)))
            err = float((combine(sent, plan.row_of_pair, w).float()
                         - combine_torch(sent, plan.row_of_pair, w).float()).abs().max())
            ok = ok and err < 3e-2 * max(1.0, float(sent.float().abs().max()))
            ctx.checks.append({"what": "gather_rows/combine vs torch (rank 0)", "max_abs_err": err, "ok": ok})
            if not ok:
                raise AssertionError(f"dispatch/combine kernels differ from the torch reference (error {err})")
        t_pack = ctx.timer(lambda: gather(x, token_of_row))
        t_pack_eager = ctx.timer.last_eager_s
        sent = gather(x, token_of_row)
        t_combine = ctx.timer(lambda: merge(sent, plan.row_of_pair, w))
        t_combine_eager = ctx.timer.last_eager_s
        rows_sent = int(plan.send_counts.sum())
        # local HBM model: pack reads and writes every sent row; combine reads k rows, writes 1 per token;
        # plus alpha, the fixed cost of one small device operation (formula 7's per-transfer term)
        pack_bytes = 2 * rows_sent * row_bytes
        combine_bytes = (rows_sent + (hi - lo)) * row_bytes
        per_rank.append({"rank": rank, "tokens": hi - lo, "send_rows": a_kernel[rank].tolist(),
                         "send_bytes": int(a_kernel[rank].sum()) * row_bytes,
                         "send_bytes_off_rank": int(a_kernel[rank].sum() - a_kernel[rank, rank]) * row_bytes,
                         "recv_bytes_off_rank": 0,
                         "send_bytes_model": float(a_model[rank].sum()) * row_bytes,
                         "pack_measured_s": t_pack, "pack_eager_s": t_pack_eager,
                         "combine_eager_s": t_combine_eager,
                         "pack_predicted_s": ctx.alpha_s + pack_bytes / (2 * ctx.copy_bytes_per_s),
                         "combine_measured_s": t_combine,
                         "combine_predicted_s": ctx.alpha_s + combine_bytes / (2 * ctx.copy_bytes_per_s)})
    for rank, row in enumerate(per_rank):
        row["recv_bytes_off_rank"] = int(a_kernel[:, rank].sum() - a_kernel[rank, rank]) * row_bytes
        row["pack_ratio"] = _ratio(row["pack_measured_s"], row["pack_predicted_s"])
        row["combine_ratio"] = _ratio(row["combine_measured_s"], row["combine_predicted_s"])
    bytes_match = bool(np.array_equal(a_kernel, a_model))
    volume = a_kernel.astype(np.float64) * row_bytes
    np.fill_diagonal(volume, 0.0)
    bound = phase_lower_bound(build_cluster(ctx.gpu_part, 1, gpus), volume)
    return {"layer": layer, "tokens": tokens, "top_k": top_k, "gpus": gpus, "row_bytes": row_bytes,
            "placement": "contiguous", "split_policy": "even", "traffic_rows": a_kernel.tolist(),
            "traffic_matches_model": bytes_match, "dispatch_transfer_predicted_s": bound.time_s,
            "transfer_note": "NVLink all-to-all time is the model's formula 3 (needs 8 GPUs to measure)",
            "per_rank": per_rank}


SPLIT_GOAL_S = 10e-6     # issue 45: the per-batch split per layer on an H200, a tenth of LPLB's
LPLB_CITED_S = 100e-6    # cited, not measured: DeepSeek's LPLB, about 100 us per layer and batch
LPLB_SOURCE = "DeepSeek's LPLB (github.com/deepseek-ai/LPLB: an interior-point LP on one SM)"


def split_layer(experts: int, gpus: int, redundant_per_gpu: int, tokens: int, top_k: int, seed: int) -> dict:
    """One layer and batch of the split benchmark, in numpy: experts of log-normal popularity, an EPLB map planned
    on an 8192-token interval, then a batch of `tokens` whose popularity drifted (x log-normal(0, 0.3) per expert).
    Redundant slots: `redundant_per_gpu * gpus`, rounded up so that every GPU holds as many slots."""
    from moe_place.solvers.deepseek import eplb_rebalance

    rng = np.random.default_rng(seed)
    popularity = rng.lognormal(0.0, 1.0, experts)

    def routed(weights, count):      # top-k distinct experts per token, drawn by popularity (Gumbel top-k)
        keys = np.log(weights)[None, :] + rng.gumbel(size=(count, experts))
        return np.argpartition(-keys, top_k - 1, axis=1)[:, :top_k].astype(np.int32)

    physical = -(-(experts + redundant_per_gpu * gpus) // gpus) * gpus
    interval = np.bincount(routed(popularity, 8192).ravel(), minlength=experts)
    phy2log = eplb_rebalance(interval[None].astype(np.float64), physical, 1, 1, gpus)[0]
    ids = routed(popularity * rng.lognormal(0.0, 0.3, experts), tokens)
    return {"phy2log": phy2log, "topk_ids": ids, "counts": np.bincount(ids.ravel(), minlength=experts)}


def section_split(ctx: Context) -> dict:
    """The per-batch split's kernels (issue 45) per layer: count (rank 0's dispatches per expert, the all-reduce's
    input), solve (whole rows per slot from the batch's global counts), map (rank 0's dispatches to slots), and the
    three in one graph (the all-reduce between them needs the EP group: not timed). Baselines: the same launches as
    torch elementwise kernels that read the bytes each kernel reads and write as many. Checked on every case: the
    kernels against the torch references and numpy's map_tokens; the busiest GPU against the even split, numpy's
    split_shares and the exact LP (when OR-Tools is installed). On a CPU the timings are of the torch references."""
    torch = ctx.timer.torch
    from moe_place.kernels.dispatch import split_tokens
    from moe_place.kernels.split import (SWEEPS, UNITS, SplitTable, count_dispatches, count_dispatches_torch,
                                         map_tokens, map_tokens_torch, split_solve, split_solve_torch)
    from moe_place.split import even_shares, gpu_rows, split_shares
    from moe_place.split import map_tokens as map_tokens_numpy

    s = ctx.sizes
    cases = []
    for gpus in s.split_gpus:
        for per_gpu in s.split_redundant_per_gpu:
            for tokens in s.split_tokens:
                case = split_layer(s.split_experts, gpus, per_gpu, tokens, s.split_top_k, seed=gpus * 100 + per_gpu)
                phy2log, counts = case["phy2log"], case["counts"]
                mine = case["topk_ids"][:int(split_tokens(tokens, gpus)[1])]          # rank 0's tokens
                table = SplitTable.from_map(phy2log, gpus, s.split_experts, device=ctx.device)
                global_counts = torch.tensor(counts, dtype=torch.int32, device=ctx.device)
                ids = torch.tensor(mine, dtype=torch.int32, device=ctx.device)
                # the kernels once (the interpreter on a CPU) against the references
                shares = split_solve(table, global_counts)
                local = count_dispatches(ids, s.split_experts)
                slots = map_tokens(ids, 0, gpus, table, shares, local)
                shares_np = shares.cpu().numpy()
                want = map_tokens_numpy(mine, np.zeros(len(mine), dtype=np.int64), phy2log, shares_np, gpus)
                ok = (torch.equal(shares, split_solve_torch(table, global_counts))
                      and np.array_equal(local.counts.cpu().numpy(), np.bincount(mine.ravel(), minlength=s.split_experts))
                      and np.array_equal(slots.cpu().numpy(), want))
                ctx.checks.append({"what": f"split solve/count/map vs torch and numpy (EP{gpus}, {phy2log.size} slots, "
                                           f"{tokens} tokens)", "ok": ok})
                if not ok:
                    raise AssertionError(f"split kernels differ from their references at EP{gpus}, {tokens} tokens")
                row = {"gpus": gpus, "slots": int(phy2log.size), "redundant": int(phy2log.size) - s.split_experts,
                       "tokens": tokens, "tokens_per_rank": len(mine),
                       "classes": int(table.num_classes[0]), "class_tile": list(table.class_slot.shape[1:]),
                       "max_replicas": int(table.logcnt.max()),
                       "busiest_even": int(gpu_rows(even_shares(phy2log[None], counts[None])[0], gpus).max()),
                       "busiest_kernel": int(gpu_rows(shares_np, gpus).max()),
                       "busiest_numpy": int(gpu_rows(split_shares(phy2log, counts, gpus), gpus).max()),
                       "busiest_lp": _split_lp(phy2log, counts, gpus)}
                row.update(_time_split(ctx, table, global_counts, ids, shares, slots, local, gpus, {
                    "kernels": (split_solve, count_dispatches, map_tokens),
                    "references": (split_solve_torch, count_dispatches_torch, map_tokens_torch)}))
                # more sweeps: the solve's time and the busiest GPU it reaches (the kernel once against the reference)
                more = split_solve(table, global_counts, sweeps=s.split_more_sweeps)
                if not torch.equal(more, split_solve_torch(table, global_counts, sweeps=s.split_more_sweeps)):
                    raise AssertionError(f"split solve with {s.split_more_sweeps} sweeps differs from its reference")
                out = torch.empty_like(more)
                row["busiest_kernel_more_sweeps"] = int(gpu_rows(more.cpu().numpy(), gpus).max())
                row["solve_more_sweeps_s"] = ctx.timer(
                    (lambda: split_solve(table, global_counts, sweeps=s.split_more_sweeps, out=out, check_counts=False))
                    if ctx.on_gpu else (lambda: split_solve_torch(table, global_counts, sweeps=s.split_more_sweeps)))
                cases.append(row)
    return {"experts": s.split_experts, "top_k": s.split_top_k, "sweeps": SWEEPS,
            "more_sweeps": s.split_more_sweeps, "units": UNITS,
            "goal_per_layer_s": SPLIT_GOAL_S, "lplb_cited_s": LPLB_CITED_S, "lplb_source": LPLB_SOURCE,
            "rank": 0, "cases": cases}


def _split_lp(phy2log: np.ndarray, counts: np.ndarray, gpus: int) -> int | None:
    """The exact LP's busiest GPU rounded up (`solvers.evaluate.optimal_split`), None without OR-Tools."""
    import importlib.util

    from moe_place.solvers.evaluate import optimal_split

    if importlib.util.find_spec("ortools") is None:
        return None
    return int(np.ceil(optimal_split(phy2log, counts, gpus)[0] - 1e-6))


def _time_split(ctx: Context, table, counts, ids, shares, slots, local, gpus: int, functions: dict) -> dict:
    """Graph (and eager) times of count, solve, map and the three together, and of their copy baselines."""
    torch = ctx.timer.torch
    experts = table.num_experts
    split_solve, count_dispatches, map_tokens = functions["kernels"]
    solve_ref, count_ref, map_ref = functions["references"]
    shares_out, slots_out = torch.empty_like(shares), torch.empty_like(slots)
    if ctx.on_gpu:  # the hot path: no range checks (host syncs), outputs in place
        def solve():
            split_solve(table, counts, out=shares_out, check_counts=False)

        def count():
            return count_dispatches(ids, experts, check_ids=False)

        def mapping(counted=local):
            map_tokens(ids, 0, gpus, table, shares_out, counted, out=slots_out, check=False)
    else:
        def solve():
            solve_ref(table, counts)

        def count():
            return count_ref(ids, experts)

        def mapping(counted=None):
            map_ref(ids, 0, gpus, table.phy2log[0], shares)

    def layer():
        counted = count()
        solve()
        mapping(counted if ctx.on_gpu else None)

    table_bytes = sum(t[0].numel() * t.element_size() for t in (
        table.phy2log, table.replicated, table.class_expert, table.class_slot, table.class_gpu, table.class_lead,
        table.class_mult, table.class_nth, table.class_inverse))
    read = {"solve": counts.numel() * 4 + table_bytes,
            "count": ids.numel() * 4 + local.block_start.numel() * 4,
            "map": ids.numel() * 4 + local.block_start.numel() * 4 + (experts + shares.numel()) * 4
            + (table.log2phy[0].numel() + table.logcnt[0].numel()) * 4}
    copies = {name: (torch.zeros(max(1, -(-n // 4)), dtype=torch.int32, device=ctx.device),
                     torch.empty(max(1, -(-n // 4)), dtype=torch.int32, device=ctx.device)) for name, n in read.items()}

    def baseline(name):
        src, dst = copies[name]
        torch.neg(src, out=dst)

    out = {f"{name}_bytes": n for name, n in read.items()}
    for name, fn, floor in (("count", count, lambda: baseline("count")), ("solve", solve, lambda: baseline("solve")),
                            ("map", mapping, lambda: baseline("map")),
                            ("layer", layer, lambda: [baseline(n) for n in ("count", "solve", "map")])):
        out[f"{name}_s"] = ctx.timer(fn)
        out[f"{name}_eager_s"] = ctx.timer.last_eager_s
        out[f"{name}_baseline_s"] = ctx.timer(floor)
    out["goal_met"] = out["layer_s"] <= SPLIT_GOAL_S if ctx.on_gpu else None
    return out


# ---------------------------------------------------------------------------------------- tables
def print_tables(result: dict, out=sys.stdout) -> None:
    """The result as `moe-place report` renders it (markdown tables, no plots): one rendering for both."""
    print(render_markdown(result, Path("microbench"), {}), file=out)


# ---------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="microbench", description=__doc__.split("\n\n")[0])
    parser.add_argument("section", nargs="?", default="all", choices=("all",) + SECTIONS)
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU interpreter (checks, not speed)")
    parser.add_argument("--gpu", default=None, help="catalog part for predictions (default: detected, else 'H100 SXM')")
    parser.add_argument("--block-m", default=None, help="BLOCK_M values of the padding sweep, e.g. 16,32,64,128")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per measurement")
    add_record_options(parser)
    return parser


def run(args) -> dict:
    if args.dry_run or not _cuda_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    import torch

    from moe_place.cost.hardware import builtin_catalog

    on_gpu = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda" if on_gpu else "cpu")
    sizes = Sizes.full() if on_gpu else Sizes.dry()
    if args.block_m:
        sizes = Sizes(**{**asdict(sizes), "block_ms": tuple(int(v) for v in args.block_m.split(","))})
    if args.reps:
        sizes = Sizes(**{**asdict(sizes), "reps": args.reps})
    part_name = args.gpu or (_detect_part(torch.cuda.get_device_name(device)) if on_gpu else "H100 SXM")
    part = builtin_catalog().gpu(part_name)
    torch.manual_seed(0)
    ctx = Context(device, sizes, Timer(device, sizes.reps), part, on_gpu)
    started = time.time()
    result = {"kind": "moe-place-microbench", "version": 1, "env": environment(ctx), "sizes": asdict(sizes),
              "calibration": calibrate(ctx), "sections": {}}
    chosen = SECTIONS if args.section == "all" else (args.section,)
    result["skipped"] = {}
    for name in chosen:
        t0 = time.time()
        try:
            result["sections"][name] = globals()[f"section_{name}"](ctx)
        except ImportError as exc:  # e.g. networkx missing on a bare GPU machine: keep the other sections
            result["skipped"][name] = f"missing module: {exc}"
            print(f"microbench: section {name} skipped: {exc}", file=sys.stderr)
            continue
        result["sections"][name]["wall_s"] = time.time() - t0
    result["checks"] = ctx.checks
    result["wall_s"] = time.time() - started
    return result


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _detect_part(device_name: str) -> str:
    name = device_name.upper()
    for key, part in (("H200", "H200"), ("H100", "H100 SXM"), ("H800", "H800"), ("H20", "H20"), ("B200", "B200"),
                      ("A100-SXM4-40GB", "A100 40GB PCIe"), ("A100", "A100 80GB SXM")):
        if key in name:
            return part
    return "H100 SXM"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    refuse_overwrite(parser, args)
    if args.reps is not None and args.reps < 1:
        print("microbench: error: --reps: expected an integer >= 1", file=sys.stderr)
        return 2
    result = run(args)
    print_tables(result)
    if args.output_json:
        write_record(args.output_json, result)
        print(f"wrote {args.output_json}", file=sys.stderr)
    # a kernel that disagrees with its torch reference: the timings above are of a wrong result
    failed = [check["what"] for check in result["checks"] if not check.get("ok", True)]
    return missed_targets("microbench", [f"kernel check against torch failed: {what}" for what in failed])


if __name__ == "__main__":
    sys.exit(main())
