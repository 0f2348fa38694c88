"""Does planning on windows pay out of sample? Summed-load plans vs window-objective plans, judged per held-out step.

The question behind `plan --windows W --window-objective mean|max`: a plan that minimises the
mean (or max) of per-window busiest loads over the training part of a trace should hold up
better on the steps that follow than a plan made on the summed loads. Measured here with the
user's entry point (`moe_place.solvers.solve`, the function `moe-place plan` calls):

- `sum`: `solve(problem on the summed training loads, "fast")`, what `plan` does without windows;
- `windows-mean`, `windows-max`: `solve(problem on W training windows, "cpsat", --time-limit)`,
  which starts from the summed-load plan and improves the window objective with CP-SAT.
Judged on every held-out step: busiest / mean GPU rows (1 = balanced), averaged over steps and
layers; also the training objective each method reached (to show the optimiser did its job).

Data: the bundled real Qwen3-30B-A3B trace (three recorded batches, leave one batch out: plan
on the two others as two windows) and the seeded drifting domain-mixture generator of `moe-place
replay` (plan on the first half as W windows, judge the second half step by step).

    python bench/bench_windows.py [--time-limit 20] [--output-json FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from moe_place.online.replay import parse_synthetic
from moe_place.placement import even_split_gpu_loads
from moe_place.problem import PlacementProblem
from moe_place.solvers import solve
from moe_place.traces.bundled import bundled_path
from moe_place.traces.load import load_trace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import add_record_options, refuse_overwrite, write_record  # noqa: E402  (bench/ is not a package)

METHODS = ("sum", "windows-mean", "windows-max")


def held_out_ratio(phy2log: np.ndarray, steps: np.ndarray, gpus: int) -> float:
    """Mean over held-out steps and layers of busiest / mean GPU rows. steps: `[S, layers, E]`."""
    values = []
    for step in steps:
        gpu = even_split_gpu_loads(phy2log, step.astype(np.float64), gpus)       # [layers, G]
        mean = gpu.mean(axis=1)
        values.append(np.where(mean > 0, gpu.max(axis=1) / np.where(mean > 0, mean, 1.0), 1.0))
    return float(np.mean(values))


def plan(train_windows: np.ndarray, gpus: int, physical: int, method: str, time_limit: float) -> tuple[np.ndarray, float]:
    """(phy2log `[layers, P]`, training objective normalised by the mean GPU load) of one method."""
    if method == "sum":
        problem = PlacementProblem(train_windows.sum(axis=0, keepdims=True), gpus, physical)
        solution = solve(problem, "fast")
    else:
        problem = PlacementProblem(train_windows, gpus, physical, window_objective=method.split("-")[1])
        solution = solve(problem, "cpsat", time_limit)
    # busiest / mean GPU rows of the plan on each training window, whichever way it was made
    busiest = np.array([[even_split_gpu_loads(solution.placement.phy2log[i:i + 1], w[i:i + 1], gpus).max()
                         for w in train_windows] for i in range(train_windows.shape[1])])   # [layers, W]
    mean_gpu = train_windows.sum(axis=2).T / gpus                                          # [layers, W]
    return solution.placement.phy2log, float((busiest / np.maximum(mean_gpu, 1e-12)).mean())


def run_case(name: str, train: np.ndarray, test: np.ndarray, gpus: int, redundant: int, time_limit: float) -> list[dict]:
    experts = train.shape[2]
    physical = experts + redundant
    rows = []
    for method in METHODS:
        start = time.perf_counter()
        phy2log, train_objective = plan(train, gpus, physical, method, time_limit)
        rows.append({"case": name, "ep": gpus, "redundant": redundant, "method": method,
                     "train_windows": int(train.shape[0]), "test_steps": int(test.shape[0]),
                     "train_mean_busiest_over_mean": train_objective,
                     "held_out_busiest_over_mean": held_out_ratio(phy2log, test, gpus),
                     "wall_s": time.perf_counter() - start})
        print(f"{name} EP{gpus}+{redundant} {method}: held-out {rows[-1]['held_out_busiest_over_mean']:.4f}",
              file=sys.stderr)
    return rows


def cases(args) -> list[tuple[str, np.ndarray, np.ndarray, int, int]]:
    out = []
    trace = load_trace(bundled_path("qwen3-30b-a3b_prefill_topk.npz"))
    steps = trace.step_counts().astype(np.float64)          # [3, 48, 128]
    layers = list(range(0, steps.shape[1], steps.shape[1] // args.layers))[:args.layers]
    steps = steps[:, layers]
    for held in range(steps.shape[0]):
        train = np.delete(steps, held, axis=0)
        out.append((f"qwen3 hold out batch {held}", train, steps[held:held + 1], 8, 8))
    for seed in range(args.seeds):
        counts, _ = parse_synthetic(f"drift:steps={2 * args.drift_steps},layers={args.layers},experts=64,seed={seed}")
        counts = counts.astype(np.float64)
        train = counts[:args.drift_steps].reshape(args.windows, -1, *counts.shape[1:]).sum(axis=1)
        out.append((f"drift seed {seed}", train, counts[args.drift_steps:], 8, 8))
    return out


def table(rows: list[dict]) -> str:
    lines = [f"{'case':<24} {'EP':>6} {'method':<13} {'train obj':>10} {'held-out':>9} {'wall_s':>7}"]
    for r in rows:
        lines.append(f"{r['case']:<24} {r['ep']:>3}+{r['redundant']:<2} {r['method']:<13} "
                     f"{r['train_mean_busiest_over_mean']:>10.4f} {r['held_out_busiest_over_mean']:>9.4f} {r['wall_s']:>7.1f}")
    summary = {m: np.mean([r["held_out_busiest_over_mean"] for r in rows if r["method"] == m]) for m in METHODS}
    lines.append("mean held-out busiest/mean GPU rows: " + ", ".join(f"{m} {v:.4f}" for m, v in summary.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=20.0, help="seconds per window-objective plan (default 20)")
    parser.add_argument("--layers", type=int, default=8, help="layers planned per case (default 8)")
    parser.add_argument("--windows", type=int, default=10, help="training windows of the drifting trace (default 10)")
    parser.add_argument("--drift-steps", type=int, default=200, help="training steps of the drifting trace (default 200)")
    parser.add_argument("--seeds", type=int, default=2, help="seeds of the drifting trace (default 2)")
    add_record_options(parser)
    args = parser.parse_args(argv)
    refuse_overwrite(parser, args)
    if args.drift_steps % args.windows:
        parser.error("--drift-steps must be a multiple of --windows")
    rows = []
    for name, train, test, gpus, redundant in cases(args):
        rows.extend(run_case(name, train, test, gpus, redundant, args.time_limit))
    print(table(rows))
    if args.output_json:
        write_record(args.output_json, {"time_limit_s": args.time_limit, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
