"""`moe-place plan --objective time`: plan for the predicted layer time (dispatch + compute +
combine, `moe_place.solvers.comm`) and write the plan file. Imported by `plan`'s `run()`."""

from __future__ import annotations

import argparse
import sys

from moe_place.cli.output import model_header, print_report
from moe_place.cli.shared import time_model_from_args
from moe_place.cost.comm import layer_cost
from moe_place.cost.replicas import SlotTable
from moe_place.errors import InputError
from moe_place.io import file_sha256
from moe_place.planfile import PlanFile, write_plan
from moe_place.solvers.comm import plan_time
from moe_place.solvers.evaluate import layer_figures


def plan_for_time(args: argparse.Namespace, problem, trace, options: dict) -> int:
    """`--objective time`: plan for the predicted layer time (moe_place.solvers.comm) and write the plan."""
    why = "(the default for a token-level trace on several nodes; --objective balance plans without it)"
    if not trace.is_token_level:
        raise InputError("--objective time", "a token-level trace (per-token expert ids): the traffic needs them; "
                         "this trace holds counts only")
    if args.current is not None:
        raise InputError("--objective time", f"no --current plan: migration-aware re-plans balance load only {why}")
    if args.expert_memory_budget is not None:
        raise InputError("--objective time", f"--redundant R, not --expert-memory-budget {why}")
    if args.solver not in ("auto", "fast"):
        raise InputError("--solver", f"auto or fast with --objective time (its balance-only reference plan is fast's) "
                         f"{why}", args.solver)
    model = time_model_from_args(args, problem.num_gpus, problem.num_nodes, trace.meta.model, required=True,
                                 seed=args.seed)
    steps = list(trace.topk_ids)
    guarded = args.time_guard is not None
    result = plan_time(problem, steps, model, args.time_limit, progress=not args.no_progress,
                       decision="guard" if guarded else "expected",
                       **({"min_saving": args.time_guard} if guarded else {}))
    for note in result.notes:
        print(f"plan: note: {note}", file=sys.stderr)
    rows = []
    for i, layer in enumerate(result.layers):
        figures = layer_figures(layer.phy2log, problem.layer_loads(i), problem.num_gpus, args.split,
                                problem.window_objective, problem.quantile, problem.layer_id(i))
        table = SlotTable(result.balance.phy2log[i], problem.num_gpus, problem.num_nodes, problem.num_experts)
        balance_s = layer_cost(model, [s[:, i, :] for s in steps], table, problem.layer_id(i)).layer_time_s
        rows.append({**figures.to_dict(), "status": "heuristic", "choice": layer.choice,
                     "predicted_time_s": layer.predicted_s, "balance_predicted_time_s": balance_s,
                     "time_lower_bound_s": layer.lower_bound_s, "held_out_s": layer.held_out_s,
                     "balance_held_out_s": layer.balance_held_out_s,
                     "held_out_comm_gains": list(layer.comm_gains), "held_out_layer_gains": list(layer.layer_gains),
                     "held_out_traffic_savings": list(layer.traffic_savings),
                     "held_out_compute_savings": list(layer.compute_savings),
                     "expected_saving": layer.expected_saving,
                     "replicas": layer.replica_status})
    predicted = sum(r["predicted_time_s"] for r in rows)
    report = {"objective": "time", "solver": "time", "status": "heuristic", "wall_s": round(result.wall_s, 6),
              "split": args.split, "layers": rows,
              "time": {"model": model.describe(), "strength": result.strength, "cv_held_out_s": result.cv,
                       "layers_grouped": sum(r["choice"] == "grouped" for r in rows),
                       "decision": result.decision, "min_saving": result.min_saving,
                       "pooled": {part: pool.to_dict() for part, pool in result.pooled.items()},
                       "predicted_layer_time_s": predicted,
                       "balance_predicted_layer_time_s": sum(r["balance_predicted_time_s"] for r in rows),
                       "lower_bound_s": sum(r["time_lower_bound_s"] for r in rows),
                       "notes": list(result.notes)}}
    options.update({"topology": model.topology.describe(), "dispatch": model.dispatch,
                    "replica_choice": model.replica_choice, "token_home": model.token_home,
                    "model": model.model.name, "weights": model.weights, "block_m": model.block_m})
    inputs = {"trace": str(args.trace), "trace_sha256": file_sha256(args.trace),
              "options": {**options, "solver": args.solver, "current": None, "max_moved_slots": None,
                          "move_cost": args.move_cost},
              "seed": args.seed}
    write_plan(args.out, PlanFile(result.placement, problem.layer_ids, report, inputs))
    print(f"wrote plan {args.out}", file=sys.stderr)
    print_report(report, args.format, header=f"plan {args.trace}: {problem.num_layers} layers, {problem.num_experts} "
                 f"experts, P = {problem.num_physical} on {problem.num_gpus} GPUs / {problem.num_nodes} nodes, "
                 "objective time\nmodel: " + model_header(model.topology.gpu, model.replica_choice, weights=model.weights,
                                                   block_m=model.block_m, dispatch=model.dispatch))
    return 0
