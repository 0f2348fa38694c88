"""Plan quality on the bundled real Qwen3-30B-A3B trace: ours vs DeepSeek EPLB.

For EP 8/16/32/64 with 0, G and E (=128) redundant experts, per layer:
- in sample: plan on the three recorded batches summed, busiest GPU / best certified lower bound
  (the bounds of moe_place.solvers.bounds, and CP-SAT's when `--auto-time` runs `auto`);
- out of sample: plan on one recorded batch, evaluate on each other batch (busiest GPU / that
  batch's bound, and balancedness mean/max), all 3 x 2 ordered pairs.
Also whether `fast` is ever worse than `eplb` in sample (EPLB plans with two replicas of one
expert on a GPU are counted as they are; they are not valid plans for us).

    python bench/bench_plan_quality.py [--ep 8,16,32,64] [--auto-time S] [--output-json FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from moe_place.problem import PlacementProblem
from moe_place.solvers import solve
from moe_place.solvers.bounds import lower_bounds
from moe_place.solvers.evaluate import even_gpu_loads
from moe_place.traces.bundled import bundled_path
from moe_place.traces.load import load_trace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import add_record_options, refuse_overwrite, write_record  # noqa: E402  (bench/ is not a package)


def timed(fn, *args, **kwargs):
    """(result, seconds) of one call: the benchmark's only timing helper."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def busiest(phy2log: np.ndarray, loads: np.ndarray, gpus: int) -> np.ndarray:
    """float64 `[layers]`: even-split busiest GPU of a plan `[layers, P]` on loads `[layers, E]`."""
    return np.array([even_gpu_loads(phy2log[i], loads[i], gpus).max() for i in range(loads.shape[0])])


def run_config(steps: np.ndarray, gpus: int, redundant: int, solvers: list[str], auto_time: float | None) -> dict:
    experts = steps.shape[2]
    physical = experts + redundant
    total = steps.sum(axis=0).astype(np.float64)
    bound = lower_bounds(total, gpus, physical)
    row: dict = {"ep": gpus, "redundant": redundant, "slots_per_gpu": physical // gpus}
    plans = {}
    for name in solvers:
        limit = auto_time if name == "auto" else None
        solution, wall = timed(solve, PlacementProblem(total, gpus, physical), name, limit)
        plans[name] = solution.placement.phy2log
        certified = np.array([s.lower_bound for s in solution.layers])
        bound = np.maximum(bound, certified)  # every solver's bound is valid: keep the best
        row[f"{name}_wall_s"] = wall
    for name in solvers:
        ratio = busiest(plans[name], total, gpus) / bound
        row[f"{name}_in_mean"] = float(ratio.mean())
        row[f"{name}_in_worst"] = float(ratio.max())
    if "fast" in solvers and "eplb" in solvers:
        diff = busiest(plans["fast"], total, gpus) - busiest(plans["eplb"], total, gpus)
        row["fast_worse_than_eplb_layers"] = int((diff > 1e-9 * busiest(plans["eplb"], total, gpus)).sum())
    # out of sample: plan on batch a, judge on batch b
    for name in [s for s in solvers if s != "auto"]:
        ratios, balance = [], []
        for a in range(steps.shape[0]):
            train = steps[a].astype(np.float64)
            plan = solve(PlacementProblem(train, gpus, physical), name).placement.phy2log
            for b in range(steps.shape[0]):
                if b == a:
                    continue
                test = steps[b].astype(np.float64)
                top = busiest(plan, test, gpus)
                ratios.append(top / lower_bounds(test, gpus, physical))
                balance.append(test.sum(axis=1) / gpus / top)
        row[f"{name}_out_mean"] = float(np.mean(ratios))
        row[f"{name}_out_worst"] = float(np.max(ratios))
        row[f"{name}_out_balancedness"] = float(np.mean(balance))
    return row


def table(rows: list[dict], solvers: list[str]) -> str:
    head = f"{'config':<10}" + "".join(f" {s + ' in mean/worst':>22}" for s in solvers)
    head += "".join(f" {s + ' out mean/bal':>20}" for s in solvers if s != "auto") + f" {'fast>eplb':>9}"
    lines = [head]
    for r in rows:
        line = f"EP{r['ep']}+{r['redundant']:<5}"
        line += "".join(f" {r[s + '_in_mean']:>11.4f}/{r[s + '_in_worst']:<10.4f}" for s in solvers)
        line += "".join(f" {r[s + '_out_mean']:>10.3f}/{r[s + '_out_balancedness']:<9.3f}"
                        for s in solvers if s != "auto")
        line += f" {r.get('fast_worse_than_eplb_layers', '-'):>9}"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", default="8,16,32,64", help="EP sizes (default 8,16,32,64)")
    parser.add_argument("--redundant", default="0,G,E",
                        help="redundant experts per config: integers, G (= EP size) or E (= experts); default 0,G,E")
    parser.add_argument("--auto-time", type=float, default=None,
                        help="also run `auto` with this total time limit per configuration (CP-SAT bounds)")
    add_record_options(parser)
    args = parser.parse_args(argv)
    refuse_overwrite(parser, args)
    trace = load_trace(bundled_path("qwen3-30b-a3b_prefill_topk.npz"))
    steps = trace.step_counts()
    experts = trace.num_experts
    solvers = ["eplb", "fast"] + (["auto"] if args.auto_time else [])
    rows = []
    for gpus in [int(x) for x in args.ep.split(",")]:
        choices = []
        for token in args.redundant.split(","):
            value = gpus if token == "G" else experts if token == "E" else int(token)
            if value not in choices:
                choices.append(value)
        for redundant in choices:
            row, wall = timed(run_config, steps, gpus, redundant, solvers, args.auto_time)
            rows.append(row)
            print(f"EP{gpus}+{redundant}: {wall:.1f} s", file=sys.stderr)
    print("busiest GPU / best certified lower bound (1.0 = proved optimal); out = plan on one recorded batch, "
          "judge on another")
    print(table(rows, solvers))
    if args.output_json:
        write_record(args.output_json, {"trace": trace.meta.model, "layers": trace.num_layers, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
