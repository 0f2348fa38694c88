"""`moe-place compare TRACE --gpus G --solvers eplb,fast,cpsat`: the same problem, several solvers."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moe_place.cli.options import add_out_argument, add_time_model_arguments, json_file, png_file
from moe_place.cli.output import model_header, wrote
from moe_place.cli.options import SOLVER_CHOICES
from moe_place.cli.plan import add_problem_arguments
from moe_place.errors import InputError
from moe_place.io import write_atomic, write_json_atomic
from moe_place.plotting import new_figure, png_bytes

HELP = "plan one trace with several solvers and compare busiest-GPU load, bound, gap and time per layer"


def _names(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not n for n in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected distinct comma-separated solver names, got {text!r}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_problem_arguments(parser)
    parser.add_argument("--solvers", type=_names, default=["eplb", "fast"], metavar="A,B,...",
                        help=f"solvers to compare, any of {', '.join(SOLVER_CHOICES)}; --time-limit is each "
                             "solver's budget (default eplb,fast)")
    parser.add_argument("--plot", type=png_file, metavar="FILE.png", help="also write a PNG: busiest load / bound per layer (default: none)")
    add_out_argument(parser, json_file, "FILE.json", "also write the JSON to FILE", aliases=("--output-json",))
    add_time_model_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from moe_place.cli.shared import build_problem, report_rows, time_figures, time_model_from_args
    from moe_place.solvers import solve, solver_names

    for name in args.solvers:
        if name != "auto" and name not in solver_names():
            raise InputError("--solvers", f"names among auto, {', '.join(solver_names())}", name)
    problem, trace, options = build_problem(args)
    # the predicted layer time of each solver's plan on the trace, under the one model `plan` and `evaluate` use
    model = time_model_from_args(args, problem.num_gpus, problem.num_nodes, trace.meta.model, required=False) \
        if trace.is_token_level else None
    results, solutions = {}, {}
    for name in args.solvers:
        solution = solve(problem, name, args.time_limit, args.jobs, progress=not args.no_progress)
        for note in solution.notes + ((solution.cpsat_summary,) if solution.cpsat_summary else ()):
            print(f"compare: note: {name}: {note}", file=sys.stderr)
        rows = report_rows(problem, solution, args.split)
        solutions[name] = solution
        results[name] = {"wall_s": round(solution.wall_s, 6), "status": solution.status,
                         "colocated": bool(solution.placement.allow_colocated), "layers": rows}
        if model is not None:
            _, top = time_figures(solution.placement, trace, model, progress=not args.no_progress)
            results[name]["layer_time_s"] = top["layer_time_s"]
        print(f"compare: {name} done in {solution.wall_s:.2f} s", file=sys.stderr)
    # the best bound any solver certified, per layer: all are valid, so the largest is too
    best_bound = [max(results[n]["layers"][i]["lower_bound"] for n in args.solvers)
                  for i in range(problem.num_layers)]
    summary = {}
    for name in args.solvers:
        ratios = [row["max_gpu_load"] / b if b > 0 else 1.0 for row, b in zip(results[name]["layers"], best_bound)]
        balance = [row["balancedness"] for row in results[name]["layers"]]
        summary[name] = {"mean_max_over_bound": sum(ratios) / len(ratios), "worst_max_over_bound": max(ratios),
                         "mean_balancedness": sum(balance) / len(balance), "wall_s": results[name]["wall_s"],
                         "status": results[name]["status"], "colocated": results[name]["colocated"],
                         "layer_time_s": results[name].get("layer_time_s")}
    document = {"trace": str(args.trace), "options": options, "layer_ids": list(problem.layer_ids),
                "time_model": None if model is None else model.describe(),
                "best_lower_bound": best_bound, "summary": summary, "solvers": results}
    if args.out:
        write_json_atomic(args.out, document)
        wrote("json", args.out)
    if args.plot:
        title = (f"compare {Path(args.trace).name}: {problem.num_layers} layers, {problem.num_experts} experts, "
                 f"P = {problem.num_physical} on {problem.num_gpus} GPUs, split {args.split}\n"
                 f"busiest GPU over the best lower bound any solver certified (1: proven optimal)")
        write_atomic(args.plot, png_bytes(plot_figure(title, problem.layer_ids, results, best_bound), dpi=100))
        wrote("plot", args.plot)
    if args.format == "json":
        sys.stdout.write(json.dumps(document, indent=1) + "\n")
        return 0
    timed = model is not None
    lines = [f"compare {args.trace}: {problem.num_layers} layers, {problem.num_experts} experts, "
             f"P = {problem.num_physical} on {problem.num_gpus} GPUs, split {args.split}"]
    if timed:
        lines.append("model: " + model_header(model.topology.gpu, model.replica_choice, weights=model.weights,
                                              block_m=model.block_m, dispatch=model.dispatch)
                     + "; layer ms: predicted, summed over the layers and the trace's steps")
    lines.append(f"{'solver':<8} {'mean max/bound':>15} {'worst max/bound':>16} {'balancedness':>13}"
                 + (f" {'layer ms':>9}" if timed else "") + f" {'wall_s':>8}  status")
    for name, row in summary.items():
        note = " (co-located replicas)" if row["colocated"] else ""
        lines.append(f"{name:<8} {row['mean_max_over_bound']:>15.4f} {row['worst_max_over_bound']:>16.4f} "
                     f"{row['mean_balancedness']:>13.4f}" + (f" {row['layer_time_s'] * 1e3:>9.4f}" if timed else "")
                     + f" {row['wall_s']:>8.2f}  {row['status']}{note}")
    lines += _losses_to_eplb(results, solutions)
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def _losses_to_eplb(results: dict, solutions: dict) -> list[str]:
    """Lines saying on how many layers a solver's busiest GPU is above eplb's, and why.

    Without --allow-colocated our solvers never put two replicas of one expert on one GPU; EPLB
    may, and on such a layer it can reach a lower busiest load than any plan without co-location
    (every solver has EPLB's plan among its candidates where it co-locates nothing).
    """
    if "eplb" not in results:
        return []
    base = results["eplb"]["layers"]
    lines = []
    for name, result in results.items():
        if name == "eplb":
            continue
        worse = [i for i, (row, ref) in enumerate(zip(result["layers"], base))
                 if row["max_gpu_load"] > ref["max_gpu_load"] * (1 + 1e-9)]
        if not worse:
            continue
        colocated = sum(bool(solutions["eplb"].layers[i].detail.get("colocated")) for i in worse)
        lines.append(f"{name} is above eplb on {len(worse)} layer(s); on {colocated} of them eplb co-locates "
                     f"replicas, which {name} does only with --allow-colocated")
    return lines


# one look per solver, in --solvers order: the lines differ in marker, dash and width, so one that
# lies on another (fast and cpsat often agree on every layer) still shows
STYLES = (("o", "-", 7.0), ("s", "--", 5.5), ("^", ":", 4.5), ("D", "-.", 3.5), ("v", (0, (5, 1, 1, 1)), 3.0),
          ("x", (0, (1, 3)), 3.0))


def plot_figure(title: str, layer_ids, results: dict, best_bound: list[float]):
    """The `--plot` figure: busiest GPU over the best certified lower bound, per layer and solver; a
    solver whose line equals an earlier one's on every layer says so in the legend."""
    fig = new_figure((9, 4))
    ax = fig.subplots()
    drawn: dict[str, list[float]] = {}
    for i, (name, result) in enumerate(results.items()):
        ratios = [row["max_gpu_load"] / b if b > 0 else 1.0 for row, b in zip(result["layers"], best_bound)]
        same = [other for other, values in drawn.items() if values == ratios]
        label = f"{name} (the same as {same[0]} on every layer)" if same else name
        marker, dash, size = STYLES[i % len(STYLES)]
        ax.plot(list(layer_ids), ratios, marker=marker, linestyle=dash, markersize=size, markerfacecolor="none",
                linewidth=2.2 - 0.4 * min(i, 3), label=label)
        drawn[name] = ratios
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("layer")
    ax.set_ylabel("busiest GPU / best lower bound")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
