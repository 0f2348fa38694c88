"""Scale: a DeepSeek-V3-shaped model (58 MoE layers x 256 experts + 32 redundant, top-8) planned end to end.

Loads: `r1`: `moe_place.traces.synthetic.deepseek_r1_like` (skew calibrated to the published
DeepSeek-R1 figures), summed over its steps; `random`: uniform random loads (seeded). For EP32
(9 slots per GPU) and EP144 (2 slots), each row times the public entry point a user calls:
- `eplb`: DeepSeek EPLB on the whole model at once (the project's faithful reimplementation);
- `drop-in 0.1 s`: `moe_place.eplb.rebalance_experts(weight, 288, 1, 1, G, time_limit_s=0.1)`,
  end to end (torch tensor in and out), the anytime plan (`solvers.quick`); median and worst of
  `--repeats` calls, and the ratio to EPLB's time measured in the same run;
- `fast`: `solve(..., "fast")` without a limit (deterministic), `--jobs` processes;
- `auto`: fast, then CP-SAT on the layers with a gap, total budget `--auto-time`.
Reported: wall seconds and the gap to the best certified lower bound (mean and worst layer).
With 2 slots per GPU (EP144) the bound includes bound 4 (`bounds.pairing_lp_bound`, an LP over
replica counts, ~0.05 s a layer); the row `best vs b1-3` shows the best plan against bounds 1-3
alone. `own gap`: the gap each run reports itself (what `moe-place plan` prints).
The process is pinned to one core (`--cores 1`, the default) for the timings.

    python bench/bench_scale.py [--ep 32,144] [--loads r1,random] [--jobs 1] [--auto-time 10] [--output-json FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from moe_place.eplb import rebalance_experts
from moe_place.problem import PlacementProblem
from moe_place.solvers import solve
from moe_place.solvers.bounds import lower_bounds, pairing_lp_bound
from moe_place.solvers.deepseek import eplb_rebalance
from moe_place.solvers.evaluate import even_gpu_loads
from moe_place.traces.synthetic import deepseek_r1_like

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from records import add_record_options, refuse_overwrite, write_record  # noqa: E402  (bench/ is not a package)

NUM_PHYSICAL = 288  # 256 logical + 32 redundant


def timed(fn, *args, **kwargs):
    """(result, seconds) of one call: the benchmark's only timing helper."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def figures(phy2log: np.ndarray, loads: np.ndarray, gpus: int, bound: np.ndarray) -> dict:
    top = np.array([even_gpu_loads(phy2log[i], loads[i], gpus).max() for i in range(loads.shape[0])])
    gap = (top - bound) / top
    return {"gap_mean": float(gap.mean()), "gap_worst": float(gap.max()),
            "max_over_bound_mean": float((top / bound).mean()), "layers_gap_le_1pct": int((gap <= 0.01).sum())}


def own_gap(solution) -> dict:
    """The gap each layer's solution reports itself (what `moe-place plan` prints)."""
    top = np.array([s.objective for s in solution.layers])
    own = (top - np.array([s.lower_bound for s in solution.layers])) / top
    return {"reported_gap_mean": float(own.mean()), "reported_gap_worst": float(own.max())}


def busiest(phy2log: np.ndarray, loads: np.ndarray, gpus: int) -> np.ndarray:
    """float64 `[layers]`: the busiest GPU's load of each layer (even split)."""
    return np.array([even_gpu_loads(phy2log[i], loads[i], gpus).max() for i in range(loads.shape[0])])


def pairing_bounds(loads: np.ndarray, gpus: int, lower: np.ndarray, upper: np.ndarray) -> np.ndarray:
    """float64 `[layers]`: `bounds.pairing_lp_bound` of every layer (2 slots per GPU only)."""
    return np.array([pairing_lp_bound(loads[i], gpus, NUM_PHYSICAL, lower[i], upper[i]) for i in range(len(lower))])


def drop_in_rows(loads: np.ndarray, gpus: int, repeats: int) -> tuple[np.ndarray, list[float], list[float]]:
    """(phy2log of the drop-in, its wall times, EPLB's wall times measured alternately in the same run)."""
    try:
        import torch  # optional here: the drop-in takes a torch tensor as engines pass it
        weight = torch.from_numpy(loads)
    except ImportError:  # pragma: no cover
        weight = loads
    rebalance_experts(weight, NUM_PHYSICAL, 1, 1, gpus, time_limit_s=0.1)  # warm-up (imports)
    ours, base = [], []
    for _ in range(repeats):
        out, wall = timed(rebalance_experts, weight, NUM_PHYSICAL, 1, 1, gpus, time_limit_s=0.1)
        ours.append(wall)
        _, wall = timed(eplb_rebalance, loads, NUM_PHYSICAL, 1, 1, gpus)
        base.append(wall)
    return np.asarray(out[0]), ours, base


def run_ep(loads: np.ndarray, gpus: int, jobs: int, auto_time: float | None, repeats: int, label: str,
           pairing: bool = True) -> list[dict]:
    problem = PlacementProblem(loads, gpus, NUM_PHYSICAL)
    bound = lower_bounds(loads, gpus, NUM_PHYSICAL)
    bounds_1_3 = bound.copy()
    rows = []
    phy2log, wall = timed(eplb_rebalance, loads, NUM_PHYSICAL, 1, 1, gpus)
    rows.append({"loads": label, "ep": gpus, "method": "eplb", "wall_s": wall, "jobs": 1})
    plans = {"eplb": phy2log}
    drop_in, ours, base = drop_in_rows(loads, gpus, repeats)
    plans["drop-in 0.1 s"] = drop_in
    rows.append({"loads": label, "ep": gpus, "method": "drop-in 0.1 s", "wall_s": float(np.median(ours)),
                 "wall_worst_s": float(max(ours)), "eplb_wall_s": float(np.median(base)),
                 "over_eplb": float(np.median(ours) / np.median(base)), "jobs": 1, "time_limit_s": 0.1})
    runs = [("fast", "fast", None, jobs)]
    if auto_time:
        runs.append(("auto", "auto", auto_time, jobs))
    results = {}
    for name, solver, limit, workers in runs:
        solution, wall = timed(solve, problem, solver, limit, workers)
        certified = np.array([s.lower_bound for s in solution.layers])
        bound = np.maximum(bound, certified)
        results[name] = (solution, wall, limit, workers)
        plans[name] = solution.placement.phy2log
    if pairing and NUM_PHYSICAL == 2 * gpus:  # bound 4: certified, ~0.05 s a layer
        upper = np.minimum.reduce([busiest(p, loads, gpus) for p in plans.values()])
        improved, wall = timed(pairing_bounds, loads, gpus, bound, upper)
        bound = np.maximum(bound, improved)
        rows.append({"loads": label, "ep": gpus, "method": "best vs b1-3", "wall_s": wall, "jobs": 1,
                     "gap_mean": float(((upper - bounds_1_3) / upper).mean()),
                     "gap_worst": float(((upper - bounds_1_3) / upper).max()),
                     "max_over_bound_mean": float((upper / bounds_1_3).mean()),
                     "layers_gap_le_1pct": int(((upper - bounds_1_3) / upper <= 0.01).sum()),
                     "note": "best plan vs bounds 1-3 (the previous certified bound); wall_s: bound 4"})
    for name, (solution, wall, limit, workers) in results.items():
        rows.append({"loads": label, "ep": gpus, "method": name, "wall_s": wall, "jobs": workers,
                     "time_limit_s": limit, **own_gap(solution)})
    for row in rows:  # every plan against the final best bound
        if row["method"] in plans:
            row.update(figures(plans[row["method"]], loads, gpus, bound))
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'loads':<7} {'EP':>4} {'method':<14} {'jobs':>4} {'wall_s':>8} {'gap mean':>9} {'gap worst':>10} "
             f"{'max/bound':>10} {'layers<=1%':>10}  notes"]
    for r in rows:
        note = ""
        if "over_eplb" in r:
            note = f"worst {r['wall_worst_s']:.3f} s; eplb {r['eplb_wall_s']:.3f} s in the same run: {r['over_eplb']:.1f}x"
        elif "reported_gap_mean" in r:
            note = f"own gap {r['reported_gap_mean']:.2%}/{r['reported_gap_worst']:.2%}"
        lines.append(f"{r['loads']:<7} {r['ep']:>4} {r['method']:<14} {r['jobs']:>4} {r['wall_s']:>8.3f} "
                     f"{r['gap_mean']:>9.2%} {r['gap_worst']:>10.2%} {r['max_over_bound_mean']:>10.4f} "
                     f"{r['layers_gap_le_1pct']:>7}/58  {note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", default="32,144", help="EP sizes dividing 288 (default 32,144)")
    parser.add_argument("--loads", default="r1,random", help="load sets: r1 (synthetic DeepSeek-R1-like), random")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes for fast/auto (default 1)")
    parser.add_argument("--cores", type=int, default=1, help="pin the process to this many cores (default 1; 0: no pin)")
    parser.add_argument("--repeats", type=int, default=9, help="timed calls of the drop-in (default 9)")
    parser.add_argument("--auto-time", type=float, default=10.0, help="budget of the auto run (0: skip; default 10)")
    parser.add_argument("--steps", type=int, default=32, help="steps of the synthetic trace (default 32)")
    parser.add_argument("--no-pairing-bound", action="store_true",
                        help="skip bound 4 (the pairing LP bound for 2 slots per GPU, ~0.05 s a layer)")
    add_record_options(parser)
    args = parser.parse_args(argv)
    refuse_overwrite(parser, args)
    if args.cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:args.cores])
    sets = {"r1": lambda: deepseek_r1_like(num_steps=args.steps).total_counts().astype(np.float64),
            "random": lambda: np.random.default_rng(0).random((58, 256))}
    rows = []
    for label in args.loads.split(","):
        if label not in sets:
            parser.error(f"--loads: expected names among {', '.join(sets)}, got {label!r}")
        loads = sets[label]()
        for gpus in [int(x) for x in args.ep.split(",")]:
            rows.extend(run_ep(loads, gpus, args.jobs, args.auto_time or None, args.repeats, label,
                               not args.no_pairing_bound))
            print(f"{label} EP{gpus} done", file=sys.stderr)
    print(f"58 layers x 256 experts, P = {NUM_PHYSICAL}; gap = (busiest - best certified bound) / busiest; "
          f"pinned to {args.cores or 'all'} core(s)")
    print(table(rows))
    if args.output_json:
        write_record(args.output_json, {"num_physical": NUM_PHYSICAL, "cores": args.cores, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
