"""`moe-place analyze TRACE`: per-layer expert skew and what it does to GPUs at each EP size.

Beside the balancedness figures the EP sweep gives TensorRT-LLM's imbalance ratio by rank
(`moe_place.analysis.imbalance`: (max - mean) / mean per step, averaged over steps and layers, as its
`report_load_statistics.py` prints it), and a line gives it by slot (expert); the JSON has them as
`trtllm_imbalance_by_rank` in each `ep` entry and `trtllm_imbalance_by_slot` at the top.
"""

from __future__ import annotations

import argparse
import json

from moe_place.cli.options import (add_out_argument, add_progress_option, add_trace_options, format_option, int_list,
                                   layer_selection, png_file, positive_int, report_file, trace_load_options)
from moe_place.cli.output import emit, plural, report_format, wrote
from moe_place.errors import InputError
from moe_place.io import write_atomic

HELP = "per-layer expert-load skew of a routing trace and the busiest/mean GPU at each EP size"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", metavar="TRACE", help="routing trace file (.npz, SGLang/vLLM dump, CSV/JSON counts)")
    add_trace_options(parser)
    parser.add_argument("--ep", type=int_list, metavar="G1,G2,...",
                        help="EP sizes to sweep, each dividing the expert count (default: 8,16,32,... that divide it)")
    parser.add_argument("--layers", type=layer_selection, metavar="IDS",
                        help="model layer ids to analyze, e.g. 0-3,10 (default: all)")
    parser.add_argument("--top-n", type=positive_int, metavar="N",
                        help="size of the hot set for top-N share and persistence (default: top_k)")
    parser.add_argument("--window", type=positive_int, metavar="STEPS",
                        help="steps summed per window for persistence and out-of-sample loss "
                             "(default 1, or enough for at most 16 windows)")
    format_option(parser)
    parser.add_argument("--plot", type=png_file, metavar="FILE.png", help="also write a PNG: load heatmap and EP-sweep curve (default: none)")
    add_out_argument(parser, report_file, "FILE", "write the table/JSON to FILE", aliases=("--output",),
                     default_text="stdout")
    add_progress_option(parser)  # the long part of a large trace: streaming its tokens


def run(args: argparse.Namespace) -> int:
    from moe_place.analysis.ep_sweep import check_ep_sizes
    from moe_place.analysis.imbalance import contiguous_imbalance
    from moe_place.analysis.plot import render_png
    from moe_place.analysis.report import analysis_to_json, analyze_trace
    from moe_place.traces.load import load_trace

    trace = load_trace(args.trace, **trace_load_options(args))
    if args.layers is not None:
        trace = trace.select_layer_ids(args.layers)
    ep_sizes = check_ep_sizes(args.ep, trace.num_experts) if args.ep is not None else None
    if args.top_n is not None and args.top_n > trace.num_experts:
        raise InputError("--top-n", f"at most num_experts={trace.num_experts}", args.top_n)
    if args.window is not None and args.window > trace.num_steps:
        raise InputError("--window", f"at most the {trace.num_steps} steps of the trace", args.window)
    fmt, label = report_format(args.format, args.out)
    analysis = analyze_trace(trace, ep_sizes, args.top_n, args.window)
    report = analysis_to_json(analysis)
    steps = trace.step_counts()
    for point in report["ep"]:
        point["trtllm_imbalance_by_rank"] = contiguous_imbalance(steps, point["ep_size"]).to_dict()["by_rank"]
    report["trtllm_imbalance_by_slot"] = contiguous_imbalance(steps, 1).to_dict()["by_slot"]  # one slot per expert
    text = json.dumps(report, indent=1, allow_nan=False) + "\n" if fmt == "json" else format_table(report)
    if args.plot:
        write_atomic(args.plot, render_png(analysis))
        wrote("plot", args.plot)
    emit(text, args.out, label)
    return 0


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def format_table(report: dict) -> str:
    """The human-readable form of an `analysis_to_json` report: per-layer table, then the EP sweep."""
    n = report["top_n"]
    lines = [
        f"{report['model']}  ({report['source']})",
        f"{plural(report['num_layers'], 'layer')}, {report['num_experts']} experts, top-{report['top_k']}, "
        f"{report['tokens']:,} tokens, {plural(report['steps'], 'step')} "
        f"({plural(report['windows'], 'window')} of {plural(report['window_steps'], 'step')})",
        "",
    ]
    eps = report["ep"]
    prefix = (f"{'layer':>5} {'max/mean':>8} {'CV':>5} {'zero':>4} {'top' + str(n) + ' share':>10} {'hot kept':>8} "
              f"{'hot run':>7} {'pair lift':>9}  ")
    head = prefix + " ".join(f"{'EP' + str(e['ep_size']):>6}" for e in eps)
    lines += [" " * len(prefix) + "busiest/mean GPU (contiguous)", head, "-" * len(head)]
    for pos, layer in enumerate(report["layers"]):
        pers = layer["persistence"]
        lines.append(
            f"{layer['layer']:>5} {_fmt(layer['max_over_mean']):>8} {_fmt(layer['cv']):>5} "
            f"{layer['zero_load_experts']:>4} {_fmt(layer['top_n_share'], '.1%'):>10} "
            f"{_fmt(pers['mean_hot_overlap'], '.0%'):>8} {_fmt(pers['mean_run_windows']):>7} "
            f"{_fmt(layer['top_pair'] and layer['top_pair']['lift'], '.1f'):>9}  "
            + " ".join(f"{_fmt(e['gpu_max_over_mean'][pos]):>6}" for e in eps))
    lines += ["",
              f"hot kept: share of the top-{n} experts still top-{n} in the next window; "
              f"hot run: mean windows an expert stays top-{n}",
              "pair lift: how much more often than independent picks one token takes the layer's most "
              "frequent expert pair"]
    lines += _pair_sample_note(report)
    lines += ["", "EP sweep: busiest/mean GPU rows, mean and worst over layers",
              "  summed loads, contiguous placement | per window, mean over layers and transitions:",
              "  contiguous, and +1 replica/GPU of the hottest experts planned on the same or the previous window"]
    head = (f"{'EP':>5} {'experts/GPU':>11} {'mean':>6} {'worst':>6} {'(layer)':>7} {'vLLM bal':>8} "
            f"{'SGLang bal':>10} {'TRT imb':>7} | {'contig':>6} {'same':>6} {'previous':>8}")
    lines += ["  vLLM bal: the balancedness vLLM logs: mean GPU load summed over layers / busiest GPU load summed",
              "  SGLang bal: SGLang's mean / busiest GPU load of each layer, averaged over layers (1 = even)",
              "  TRT imb: TensorRT-LLM's imbalance, (max - mean) / mean GPU load per step, averaged over steps and layers",
              f"    (0 = even); the same per expert (no replicas): {_fmt(report['trtllm_imbalance_by_slot'], '.3f')}"]
    lines += [head, "-" * len(head)]
    for e in eps:
        shift = e["out_of_sample"] or {}
        keys = ("contiguous", "planned_on_same", "planned_on_previous")
        window = [_fmt(_mean(shift[key])) if shift else "-" for key in keys]
        lines.append(
            f"{e['ep_size']:>5} {e['experts_per_gpu']:>11} {_fmt(e['mean_gpu_max_over_mean']):>6} "
            f"{_fmt(e['worst_gpu_max_over_mean']):>6} {e['worst_layer']:>7} {_fmt(e['vllm_balancedness'], '.3f'):>8} "
            f"{_fmt(_mean(e['sglang_balancedness']), '.3f'):>10} {_fmt(e['trtllm_imbalance_by_rank'], '.3f'):>7} | "
            f"{window[0]:>6} {window[1]:>6} {window[2]:>8}")
    return "\n".join(lines) + "\n"


def _pair_sample_note(report: dict) -> list[str]:
    """The line saying that pair lifts were estimated on a token sample, and their standard errors."""
    sample = report.get("pair_sample")
    errors = [layer["top_pair"]["lift_stderr"] for layer in report["layers"] if layer["top_pair"]]
    if sample is None or not errors:
        return []
    return [f"  estimated on a random sample: pair chosen on {sample['chosen_on_tokens']:,} tokens, its lift "
            f"counted on {sample['estimated_on_tokens']:,} others (of {report['tokens']:,}); standard error "
            f"{min(errors):.2f} to {max(errors):.2f} by layer"]


def _mean(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None
