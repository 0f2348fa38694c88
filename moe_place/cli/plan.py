"""`moe-place plan TRACE --gpus G --out PLAN.json`: replicate and place experts, write a plan file."""

from __future__ import annotations

import argparse
import sys

from moe_place.cli.options import (SOLVER_CHOICES, add_out_argument, add_progress_option, add_sizing_arguments,
                                   add_steps_option, add_time_model_arguments, add_trace_options, jobs, json_file,
                                   layer_selection, non_negative_float, non_negative_int, positive_byte_size,
                                   positive_float, positive_int, redundant_count, share_below_one)
from moe_place.cli.output import print_report, wrote
from moe_place.cores import usable_cores
from moe_place.cost.units import GIB_BYTES, MIB_BYTES
from moe_place.errors import InputError
from moe_place.glossary import GROUPING_STRENGTH, explain

HELP = "plan expert replicas and their GPUs from a trace (solvers: auto, fast, eplb, cpsat, trtllm) and write a plan file"

def add_problem_arguments(parser: argparse.ArgumentParser, redundant_auto: bool = False,
                          split_planning: bool = False) -> None:
    """Options shared by `plan` and `compare`: the trace and the machine (`redundant_auto`: `--redundant`
    also takes `auto`; `split_planning`: `--split` also takes `per-batch`, which plans for that split)."""
    parser.add_argument("trace", metavar="TRACE", help="routing trace file (.npz, SGLang/vLLM dump, CSV/JSON counts)")
    add_trace_options(parser)
    parser.add_argument("--gpus", type=positive_int, required=True, metavar="G", help="EP size over all nodes")
    parser.add_argument("--nodes", type=positive_int, default=1, metavar="N", help="nodes (divides G; default 1)")
    parser.add_argument("--groups", type=positive_int, metavar="K",
                        help="expert groups, for EPLB's hierarchical policy (default: global policy)")
    slots = parser.add_mutually_exclusive_group()
    slots.add_argument("--redundant", type=redundant_count if redundant_auto else non_negative_int, metavar="R",
                       help="redundant experts per layer: P = E + R physical experts, P divisible by G (default 0)"
                            + ("; auto: size R on held-out steps of the trace, print the sizing table and plan the "
                               "recommended R (moe_place.solvers.sizing)" if redundant_auto else ""))
    slots.add_argument("--expert-memory-budget", type=positive_byte_size, metavar="BYTES",
                       help="per-GPU bytes for the expert weights of all planned layers, e.g. 40GiB or 1.4GiB, "
                            "instead of --redundant (needs --expert-bytes; default: none)")
    parser.add_argument("--expert-bytes", type=positive_byte_size, metavar="B",
                        help="bytes of one expert's weights, e.g. 9MiB, with --expert-memory-budget, or with "
                             "--redundant auto to price the replicas (default: none; auto: the model preset's)")
    parser.add_argument("--time-limit", type=positive_float, metavar="S",
                        help="wall-clock seconds for the whole plan, kept: the anytime plan of every layer, then "
                             "fast, then (auto, cpsat) CP-SAT on deterministic time from fast's plan, never worse "
                             "than it; the same inputs give the same plan unless the limit runs out (a note on "
                             "stderr says so); default: no limit (auto is then fast only)")
    parser.add_argument("--split", choices=("even", "local", "optimal") + (("per-batch",) if split_planning else ()),
                        default="even",
                        help="token split among replicas in the report (the solvers plan on even)"
                             + ("; per-batch plans for the per-batch split (each batch's rows "
                                                "split among the replicas so that the busiest GPU is least): the "
                                                "solver's plan or EPLB's, whichever the split makes less busy, "
                                                "refined by a local search on the trace's steps "
                                                "(moe_place.solvers.split_placement), reported with that split; "
                                                "the plan records it and evaluate uses it"
                                                if split_planning else "") + " (default even)")
    parser.add_argument("--allow-colocated", action="store_true",
                        help="let a GPU hold two replicas of one expert, as DeepSeek EPLB may (EPLB's plan is then "
                             "a candidate on every layer, so no solver does worse than eplb; default: forbidden)")
    parser.add_argument("--layers", type=layer_selection, metavar="IDS", help="model layer ids to plan (default all)")
    add_steps_option(parser, "plan on")
    parser.add_argument("--jobs", type=jobs, default=1, metavar="J",
                        help=f"worker processes, at most the usable cores ({usable_cores()} here; default 1)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed for randomised choices (default 0)")
    parser.add_argument("--format", choices=("table", "json"), default="table", help="output format (default table)")
    add_progress_option(parser)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_problem_arguments(parser, redundant_auto=True, split_planning=True)
    parser.add_argument("--objective", choices=("balance", "time"),
                        help="balance: the busiest GPU's rows (the solvers); time: the predicted MoE layer time, "
                             "dispatch + compute + combine, with nodes grouped by co-activation as far as held-out "
                             "windows of the trace say it pays (moe_place.solvers.comm); default: time for a "
                             "token-level trace on --nodes > 1 (not with --redundant auto or --split per-batch), else "
                             "balance")
    add_time_model_arguments(parser)
    parser.add_argument("--time-guard", type=share_below_one, metavar="BAR",
                        help="with --objective time: group a layer only where its dispatch + combine save more than "
                             "BAR (a share of the balance-only layer time, e.g. 0.05) on every held-out window of the "
                             "trace, instead of where the expected saving over all layers is positive (the default); "
                             "keeps parts of the model near the balance-only plan at the cost of most of the "
                             "whole-model gain (docs/multinode.md)")
    parser.add_argument("--solver", default="auto", metavar="NAME",
                        help=f"one of {', '.join(SOLVER_CHOICES)} (default auto: fast, then CP-SAT where --time-limit "
                             "leaves room)")
    parser.add_argument("--current", metavar="PLAN",
                        help="plan in use now: re-plan with migration in view (default: plan from scratch)")
    parser.add_argument("--max-moved-slots", type=non_negative_int, metavar="K",
                        help="with --current: at most K slots change per layer (default: no cap)")
    parser.add_argument("--move-cost", type=non_negative_float, default=0.0, metavar="LOAD",
                        help="with --current: load units a moved slot must save (default 0)")
    add_out_argument(parser, json_file, "PLAN.json", "plan file to write (JSON)", required=True)
    add_sizing_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from moe_place.cli.plan_split import place_for_split, split_report_rows
    from moe_place.cli.plan_time import plan_for_time
    from moe_place.cli.shared import build_problem, report_rows
    from moe_place.cli.sizing import check_sizing_options, size_for_plan
    from moe_place.io import file_sha256
    from moe_place.placement import Placement
    from moe_place.planfile import BudgetLayers, PlanFile, read_plan, write_plan
    from moe_place.solvers import solve, solver_names
    from moe_place.solvers.budget import allocate_budget
    from moe_place.solvers.evaluate import layer_figures

    if args.solver != "auto" and args.solver not in solver_names():
        raise InputError("--solver", f"one of auto, {', '.join(solver_names())}", args.solver)
    if args.current is None and (args.max_moved_slots is not None or args.move_cost):
        raise InputError("--max-moved-slots/--move-cost", "--current PLAN as well")
    if args.move_cost < 0:
        raise InputError("--move-cost", "a value >= 0", args.move_cost)
    check_sizing_options(args)
    if args.split == "per-batch":
        check_split_planning(args)
    current_plan = read_plan(args.current) if args.current is not None else None
    sizing = trace = None
    if args.redundant == "auto":  # size R on held-out steps (moe_place.solvers.sizing), then plan that R
        args, sizing, trace = size_for_plan(args)
    problem, trace, options = build_problem(args, current_plan, trace)
    objective = args.objective or ("time" if trace.is_token_level and args.nodes > 1 and sizing is None
                                   and args.split != "per-batch" else "balance")
    options["objective"] = objective
    if args.time_guard is not None and objective != "time":
        raise InputError("--time-guard", "--objective time (the guard decides which layers the time plan groups)")
    if objective == "time":
        options["topology_spec"] = args.topology  # the --topology given (None: the default), for evaluate
        code = plan_for_time(args, problem, trace, options)
        if args.format == "table":
            print(f"status: {explain(['heuristic'])}; grouping strength: {GROUPING_STRENGTH}")
        return code
    current = problem.current
    solution = solve(problem, args.solver, args.time_limit, args.jobs, progress=not args.no_progress)
    for note in solution.notes + ((solution.cpsat_summary,) if solution.cpsat_summary else ()):
        print(f"plan: note: {note}", file=sys.stderr)
    placement, wall_s, split_section = solution.placement, solution.wall_s, None
    if args.split == "per-batch":
        placement, split_section, seconds = place_for_split(problem, solution, trace, args)
        wall_s += seconds
        rows = split_report_rows(placement, problem, trace)
    else:
        rows = report_rows(problem, solution, args.split)
    report = {"objective": "balance", "solver": args.solver, "status": solution.status,
              "wall_s": round(wall_s, 6), "split": args.split, "layers": rows}
    if split_section is not None:
        report["split_placement"] = split_section
    if current is not None:
        report["moved_slots"] = int(solution.placement.moved_slots(current).sum())
        gaps = [layer_figures(current.phy2log[i], problem.layer_loads(i), problem.num_gpus, args.split,
                              problem.window_objective, problem.quantile, problem.layer_id(i),
                              lower_bound=row["lower_bound"]).gap for i, row in enumerate(rows)]  # as the new plan's
        report["current_plan"] = current_figures(gaps, problem.num_layers * problem.num_physical)
    if sizing is not None:
        report["sizing"] = sizing.to_dict()
    budget_layers, budget = None, None
    if args.expert_memory_budget is not None:
        budget = allocate_budget(problem.planning_loads(), problem.num_gpus, args.expert_bytes,
                                 args.expert_memory_budget)
        report["budget"] = {k: v for k, v in budget.to_dict().items() if k != "phy2log"}  # the plans: `budget`
        budget_layers = BudgetLayers(tuple(Placement(row[None], problem.num_experts, problem.num_gpus, problem.num_nodes)
                                           for row in budget.phy2log), budget.expert_bytes, budget.gpu_budget_bytes)
        print(f"budget mode: per-layer slots per GPU {_slot_summary(budget.slots_per_gpu)} instead of "
              f"{budget.even_slots_per_gpu} on every layer: summed busiest-GPU load {budget.total_max_load:.1f} vs "
              f"{budget.even_total_max_load:.1f} ({budget.gain:.1%} less); per-layer plans in the plan's budget section",
              file=sys.stderr)
        print(f"budget mode: memory: {budget_memory(budget)}", file=sys.stderr)
    inputs = {"trace": str(args.trace), "trace_sha256": file_sha256(args.trace),
              "options": {**options, "solver": args.solver, "current": args.current,
                          "max_moved_slots": args.max_moved_slots, "move_cost": args.move_cost},
              "seed": args.seed}
    write_plan(args.out, PlanFile(placement, problem.layer_ids, report, inputs, budget_layers))
    wrote("plan", args.out)
    header = (f"plan {args.trace}: {problem.num_layers} layers, {problem.num_experts} experts, P = "
              f"{problem.num_physical} on {problem.num_gpus} GPUs ({problem.slots_per_gpu} slots each), solver "
              f"{args.solver}, split {args.split}"
              + (" (placed for it; loads: mean over the steps of each step's busiest GPU)"
                 if args.split == "per-batch" else ""))
    if budget is not None:  # the table is the evenly slotted plan engines run; the budget plan comes after it
        header = (f"plan {args.trace}: {problem.num_layers} layers, {problem.num_experts} experts on "
                  f"{problem.num_gpus} GPUs, budget mode ({args.expert_memory_budget:,} bytes of experts per GPU). "
                  f"Engines need one slot count on every layer and run the even plan below, P = "
                  f"{problem.num_physical} ({problem.slots_per_gpu} slots each), solver {args.solver}, split "
                  f"{args.split}; the budget plan follows it")
    print_report(report, args.format, header=header)
    if args.format == "table":
        print(f"status: {explain(row['status'] for row in rows)}; gap = (busiest - bound) / busiest")
    if current is not None:
        print(f"plan: {current_line(report, args)}", file=sys.stderr)
    if budget is not None and args.format == "table":
        print_budget_table(budget, problem.layer_ids)
    if sizing is not None and args.format == "table":
        sys.stdout.write("\n" + sizing.table())
    return 0


def check_split_planning(args: argparse.Namespace) -> None:
    """`--split per-batch` plans one flat plan from scratch for balance; InputError naming what it cannot do."""
    for used, what in ((args.current is not None, f"--current {args.current}"),
                       (args.groups is not None, f"--groups {args.groups}"),
                       (args.expert_memory_budget is not None, "--expert-memory-budget"),
                       (args.objective == "time", "--objective time")):
        if used:
            raise InputError("--split per-batch", "a plan from scratch for balance, without --current, --groups, "
                             "--expert-memory-budget or --objective time (the split's local search keeps none of "
                             "their constraints)", what)


def current_figures(gaps: list[float], total_slots: int) -> dict:
    """The report's `current_plan`: the plan in use (`--current`) judged as the new plan's rows are (same loads,
    split and lower bounds), its per-layer gaps, their mean and worst, and the slots of all layers."""
    return {"gap": [round(g, 6) for g in gaps], "mean_gap": round(sum(gaps) / len(gaps), 6),
            "worst_gap": round(max(gaps), 6), "total_slots": total_slots}


def current_line(report: dict, args: argparse.Namespace) -> str:
    """`--current`: the slots moved and the old plan's gap beside the new plan's."""
    old, gaps = report["current_plan"], [row["gap"] for row in report["layers"]]
    cap = f", at most {args.max_moved_slots} per layer" if args.max_moved_slots is not None else ""
    return (f"re-planned from {args.current}: {report['moved_slots']:,} of {old['total_slots']:,} slots moved{cap}; "
            f"gap (the busiest GPU above the lower bound) mean {old['mean_gap']:.2%} -> {sum(gaps) / len(gaps):.2%}, "
            f"worst {old['worst_gap']:.2%} -> {max(gaps):.2%} (plan in use -> new plan)")


def budget_memory(budget) -> str:
    """Budget mode: the expert memory per GPU of the budget plan against the even spread (the uniform R)."""
    freed = budget.freed_bytes
    verdict = (f"frees {_bytes(freed)} per GPU" if freed > 0 else
               f"uses {_bytes(-freed)} more per GPU" if freed < 0 else "uses the same memory per GPU")
    return (f"the budget plan's experts take {_bytes(budget.used_bytes)} per GPU, the uniform R = "
            f"{budget.even_redundant} ({budget.even_slots_per_gpu} slots per GPU on every layer) "
            f"{_bytes(budget.even_used_bytes)}: it {verdict} (budget {_bytes(budget.gpu_budget_bytes)})")


def _bytes(count: int) -> str:
    for unit, size in (("GiB", GIB_BYTES), ("MiB", MIB_BYTES)):
        if count >= size:
            return f"{count / size:,.2f} {unit}"
    return f"{count:,} bytes"


def print_budget_table(budget, layer_ids) -> None:
    """The per-layer plans of budget mode (the plan file's `budget` section) beside the even spread."""
    lines = [f"budget plan (the plan's budget section): slots per GPU chosen per layer, {budget.gain:.1%} less summed "
             "busiest-GPU load than the even spread",
             f"{'layer':>6} {'slots/GPU':>9} {'max_gpu_load':>14} {'even: slots':>11} {'max_gpu_load':>14}"]
    for layer, slots, load, even in zip(layer_ids, budget.slots_per_gpu, budget.max_load, budget.even_max_load):
        lines.append(f"{layer:>6} {slots:>9} {load:>14.2f} {budget.even_slots_per_gpu:>11} {even:>14.2f}")
    lines.append(f"sum of busiest-GPU loads {budget.total_max_load:.1f} (even spread {budget.even_total_max_load:.1f})")
    sys.stdout.write("\n".join(lines) + "\n")


def _slot_summary(slots: tuple[int, ...]) -> str:
    counts = {value: slots.count(value) for value in sorted(set(slots))}
    return ", ".join(f"{n} layers at {value}" for value, n in counts.items())
