"""The CPU half of formula 8 on this machine: one expert MLP in torch on the CPU, predicted vs measured.

Formula 8 prices an expert that runs on the CPU at `max(2*m*P_e/C_C, W_e/B_D)` on `m` rows (plus the
rows' transfers, which a CPU-only run does not have). Measured here:

- the expert: gate and up fused (`x @ w13.T`, `[m, h] x [h, 2I]`), SiLU(gate) * up, down
  (`[m, I] x [I, h]`), in the weights' dtype (FP32, and BF16 where torch runs it), like a CPU MoE
  kernel; the experts are taken in turn from a bank larger than the last-level cache, so each call
  reads its weights from DRAM, as serving does (a layer's experts differ from call to call);
- calibrated in the same run, interleaved with the expert calls (before each row count):
  `C_C` per dtype from a square matmul `x @ w.T` (`--calib-n`, the experts' layout, the weight in
  cache) and `B_D` from summing one expert's bytes at a time of a large FP32 bank (a streaming
  read from DRAM, `--calib-mib`), the best rate of the run; every time is the least of `--reps` calls (this machine is shared);
- predicted: formula 8's `max(2*m*P_e/C_C, W_e/B_D)` with those two rates, `P_e = 3*h*I`.
Rows where measured and predicted differ by more than 25% are flagged.

    python bench/bench_cpu_expert.py [--model Qwen3-30B-A3B] [--rows 1,2,4,...,2048] [--dtypes fp32,bf16]
        [--threads 1] [--output-json FILE] [--parts-out cpu.toml]

`--parts-out` writes the calibrated CPU as a hardware part (`moe-place offload --parts cpu.toml
--cpu this-machine --cpu-kernel torch-bf16`), so the planner can price this machine's CPU.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

from moe_place.cost.models import get_model
from moe_place.io import write_atomic

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from microbench import Timer  # noqa: E402  (bench/microbench.py: the one timing helper; one call per timing)
from records import add_record_options, machine, refuse_overwrite, write_record  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_ROWS = tuple(2**i for i in range(12))      # 1 .. 2048
FLAG_RATIO = 0.25                                  # |measured / predicted - 1| above this is flagged


def expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert on `x [m, h]`: w13 `[2I, h]` (gate rows, then up rows), w2 `[h, I]`, in x's dtype."""
    gate_up = x @ w13.T
    inter = w2.shape[1]
    return (torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ w2.T


def fastest(timer: Timer, fn, reps: int) -> float:
    """Least seconds of `reps` single timed calls: on a machine shared with other work the least
    disturbed call is the best estimate of what the hardware does (the median drifts with the load)."""
    return min(timer(fn, reps=1) for _ in range(reps))


def calibration(dtype: torch.dtype, n: int, read_mib: int, chunk_bytes: int):
    """Calls whose time gives `C_C` and `B_D`: an `n x n x n` matmul in `dtype` in the experts' layout
    `x @ w.T` (weights `[out, in]`, as `torch.nn.functional.linear`; torch's BF16 CPU path is 10x
    slower for `a @ b` on an AVX2 machine than for `a @ b.T`, so the layout must be the experts'
    own; `w` stays in cache), and summing the next `chunk_bytes` of a `read_mib` MiB FP32 bank at
    each call (a streaming read of one expert's size from DRAM, timed like an expert call: on a
    shared machine a long read averages over the others' memory traffic, a short one need not)."""
    a, w = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    per_chunk = max(1, chunk_bytes // 4)
    chunks = max(2, read_mib * 2**20 // 4 // per_chunk)
    bank = torch.ones(chunks, per_chunk, dtype=torch.float32)
    turn = [0]

    def read():
        bank[turn[0] % chunks].sum()
        turn[0] += 1

    a @ w.T, read()  # warm-up
    return (lambda: a @ w.T, 2 * n**3), (read, per_chunk * 4)


def expert_call(dtype: torch.dtype, hidden: int, inter: int, bank_mib: int):
    """`call(x)`: one expert on x, the next expert of a bank of `bank_mib` MiB at every call."""
    element = torch.tensor([], dtype=dtype).element_size()
    count = max(2, -(-bank_mib * 2**20 // (3 * hidden * inter * element)))
    bank = [(torch.randn(2 * inter, hidden).to(dtype) * 0.02, torch.randn(hidden, inter).to(dtype) * 0.02)
            for _ in range(count)]
    turn = [0]

    def call(x):
        w13, w2 = bank[turn[0] % count]
        turn[0] += 1
        expert_mlp(x, w13, w2)

    return call


def measure(timer: Timer, dtype: torch.dtype, hidden: int, inter: int, rows: tuple[int, ...], args) -> dict:
    """Per row count the least time of one expert call, with the calibration calls interleaved (before
    each row count), so that the rates and the expert see the same machine; `C_C` and `B_D` are the
    best rates of all calibration calls of the run."""
    element = torch.tensor([], dtype=dtype).element_size()
    (matmul, flop), (read, nbytes) = calibration(dtype, args.calib_n, args.calib_mib, 3 * hidden * inter * element)
    call = expert_call(dtype, hidden, inter, args.bank_mib)
    flops, bandwidth, seconds = 0.0, 0.0, []
    for m in rows:
        flops = max(flops, flop / fastest(timer, matmul, args.reps))
        bandwidth = max(bandwidth, nbytes / fastest(timer, read, args.reps))
        x = torch.randn(m, hidden).to(dtype)
        call(x)  # warm-up
        seconds.append(fastest(timer, lambda: call(x), args.reps))
    return {"flops_per_s": flops, "dram_bytes_per_s": bandwidth, "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="Qwen3-30B-A3B", help="expert shape preset (default Qwen3-30B-A3B)")
    parser.add_argument("--rows", default=",".join(map(str, DEFAULT_ROWS)), help="row counts (default 1..2048)")
    parser.add_argument("--dtypes", default="fp32,bf16", help="fp32, bf16 (default both)")
    parser.add_argument("--reps", type=int, default=5, help="timed calls per row count (the least; default 5)")
    parser.add_argument("--bank-mib", type=int, default=768,
                        help="weights cycled through, MiB: above the last-level cache (default 768)")
    parser.add_argument("--calib-n", type=int, default=1024, help="square matmul size for C_C (default 1024)")
    parser.add_argument("--calib-mib", type=int, default=1024, help="FP32 bank summed one expert at a time for B_D, MiB (default 1024)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared machine, OpenMP threads wait for one another "
                             "whenever another process holds a core, and the times stop meaning anything)")
    add_record_options(parser)
    parser.add_argument("--parts-out", help="write the calibrated CPU as a hardware part file (TOML)")
    args = parser.parse_args(argv)
    refuse_overwrite(parser, args)
    rows = tuple(int(r) for r in args.rows.split(","))
    dtypes = [d.strip() for d in args.dtypes.split(",")]
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown or min(rows) < 1 or args.reps < 1:
        print(f"bench_cpu_expert: expected --dtypes among {list(DTYPES)}, rows >= 1, reps >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(max(1, args.threads))
    model = get_model(args.model)
    hidden, inter = model.hidden, model.intermediate
    params = 3 * hidden * inter
    timer = Timer(torch.device("cpu"), 1)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    result = {"machine": {**machine(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                          "load_average_1min": load},
              "model": model.name, "hidden": hidden, "intermediate": inter, "params_per_expert": params,
              "bank_mib": args.bank_mib, "reps": args.reps, "dtypes": {}}
    print(f"one {model.name} expert ({hidden} x {inter}, P_e = {params:,}) on the CPU, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, load average {load:.1f}; least of {args.reps} calls each")
    print(f"{'dtype':>5} {'rows':>5} {'measured ms':>12} {'predicted ms':>13} {'meas/pred':>10}  bound")
    bandwidths = []
    for name in dtypes:
        dtype = DTYPES[name]
        try:
            run = measure(timer, dtype, hidden, inter, rows, args)
        except RuntimeError as exc:  # a dtype this torch build cannot multiply on the CPU
            print(f"{name:>5}  not supported: {exc}")
            continue
        flops, bandwidth = run["flops_per_s"], run["dram_bytes_per_s"]
        bandwidths.append(bandwidth)
        weight_bytes = params * torch.tensor([], dtype=dtype).element_size()
        entries = []
        for m, seconds in zip(rows, run["seconds"]):
            compute, memory = 2 * m * params / flops, weight_bytes / bandwidth
            predicted = max(compute, memory)
            ratio = seconds / predicted
            flag = abs(ratio - 1) > FLAG_RATIO
            entries.append({"rows": m, "measured_s": seconds, "predicted_s": predicted, "ratio": ratio,
                            "bound": "compute" if compute >= memory else "memory", "flagged": flag})
            print(f"{name:>5} {m:>5} {seconds * 1e3:>12.3f} {predicted * 1e3:>13.3f} {ratio:>10.2f}  "
                  f"{entries[-1]['bound']}{'  <-- > 25%' if flag else ''}")
        result["dtypes"][name] = {"flops_per_s": flops, "dram_bytes_per_s": bandwidth, "expert_bytes": weight_bytes,
                                  "rows": entries}
        print(f"{name:>5} calibrated C_C = {flops / 1e9:.1f} GFLOP/s ({args.calib_n}^3 matmul x @ w.T), "
              f"B_D = {bandwidth / 1e9:.1f} GB/s (sums of {weight_bytes / 2**20:g} MiB); knee at "
              f"{weight_bytes / bandwidth * flops / (2 * params):.1f} rows")
    if args.output_json:
        write_record(args.output_json, result)
        print(f"wrote {args.output_json}", file=sys.stderr)
    if args.parts_out and result["dtypes"]:
        kernels = ", ".join(f'"torch-{k}" = {v["flops_per_s"] / 1e12:.6g}' for k, v in result["dtypes"].items())
        write_atomic(args.parts_out, f'# measured by bench/bench_cpu_expert.py\n[cpu."this-machine"]\n'
                                     f"tflops = {{ {kernels} }}\nlocal_gb_per_s = {max(bandwidths) / 1e9:.6g}\n")
        print(f"wrote {args.parts_out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    sys.exit(main())
