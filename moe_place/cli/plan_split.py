"""`plan --split per-batch`: place the replicas for the per-batch split (moe_place.solvers.split_placement).

`plan` imports this module inside `run()` (it loads the library).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from moe_place.placement import Placement, has_colocation
from moe_place.progress import ProgressBar
from moe_place.solvers.deepseek import eplb_rebalance
from moe_place.solvers.evaluate import evaluate_placement
from moe_place.solvers.split_placement import ROUNDS, plan_for_split, planning_pieces


def place_for_split(problem, solution, trace, args: argparse.Namespace):
    """(the Placement for the per-batch split, the report's `split_placement` section, seconds): the solver's
    plan and EPLB's refined on the trace's steps (`moe_place.solvers.split_placement.plan_for_split`)."""
    started = time.monotonic()
    eplb = eplb_rebalance(problem.planning_loads(), problem.num_physical, 1, 1, problem.num_gpus)
    pieces, how = planning_pieces(trace)
    bar = ProgressBar(problem.num_layers * ROUNDS, "plan per-batch split search", "layer rounds",
                      enabled=not args.no_progress)
    planned = plan_for_split(np.stack([solution.placement.phy2log, eplb]), pieces, problem.num_gpus,
                             allow_colocated=problem.allow_colocated, seed=problem.seed, advance=bar.advance)
    bar.close()
    colocated = any(has_colocation(row, problem.num_gpus) for row in planned.phy2log)
    placement = Placement(planned.phy2log, problem.num_experts, problem.num_gpus, problem.num_nodes,
                          allow_colocated=colocated)
    starts = np.bincount(planned.start, minlength=2)
    print(f"plan: placed for the per-batch split on {how}: mean busiest GPU rows per step, summed over layers, "
          f"{planned.start_busiest.sum():,.1f} -> {planned.busiest.sum():,.1f} ({planned.gain:+.2%}) against the "
          f"starts ({args.solver}'s plan on {starts[0]} layers, EPLB's on {starts[1]}); "
          f"{int((planned.moves > 0).sum())} layers changed", file=sys.stderr)
    return placement, {**planned.to_dict(), "pieces": how, "starts": [args.solver, "eplb"]}, time.monotonic() - started


def split_report_rows(placement, problem, trace) -> list[dict]:
    """Per-layer report rows of a plan under the per-batch split, each of the trace's steps a window and the
    windows' busiest GPUs averaged (what the split's placement plans for, and what `evaluate PLAN TRACE
    --windows STEPS --window-objective mean` reports)."""
    steps = trace.step_counts()
    reports = evaluate_placement(placement, steps, "per-batch", objective="mean", layer_ids=problem.layer_ids,
                                 step_loads=steps, window_of_step=np.arange(len(steps)))
    return [{**r.to_dict(), "status": "heuristic"} for r in reports]
