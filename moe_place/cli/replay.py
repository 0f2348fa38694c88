"""`moe-place replay TRACE --controller static|periodic-eplb|ours`: replay a multi-step trace
through an online controller and the cost model (expert-layer time + migration time)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moe_place.cli.options import (add_out_argument, add_trace_options, json_file, layer_selection, non_negative_int,
                                   png_file, positive_float, positive_int, share_below_one, trace_load_options)
from moe_place.cli.output import wrote
from moe_place.cost.hardware import BUILTIN_PARTS
from moe_place.cost.models import PRESETS, infer_model_name
from moe_place.errors import InputError
from moe_place.interrupts import raise_if_interrupted
from moe_place.io import write_atomic, write_json_atomic
from moe_place.progress import ProgressBar

HELP = "replay a multi-step trace through a re-planning controller and the cost model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", nargs="?", metavar="TRACE", help="a trace file (any format load_trace reads)")
    parser.add_argument("--synthetic", metavar="SPEC",
                        help="replay the drifting domain-mixture generator instead, e.g. 'drift:steps=6000,seed=0' "
                             "(keys: steps, layers, experts, top_k, tokens, domains, drift, skew, shared, "
                             "concentration, hot, seed, preset=deepseek-r1; at most 1,000,000 steps and 2**28 "
                             "steps x layers x experts; default: replay TRACE)")
    parser.add_argument("--controller", choices=("static", "periodic-eplb", "ours"), default="ours",
                        help="static: planned once; periodic-eplb: vLLM's cadence; ours: the payback controller "
                             "(default ours)")
    add_trace_options(parser)
    cluster = parser.add_argument_group("cluster (named as for `plan`)")
    cluster.add_argument("--gpus", type=positive_int, default=8, help="EP size G (default 8)")
    cluster.add_argument("--nodes", type=positive_int, default=1, help="servers (default 1)")
    cluster.add_argument("--redundant", type=non_negative_int, default=None,
                         help="redundant slots per layer (default: one per GPU)")
    cluster.add_argument("--hardware", default="H100-SXM",
                         help=f"GPU part: one of {', '.join(BUILTIN_PARTS['gpu'])}, or an alias such as H100 "
                              "(default H100-SXM)")
    cluster.add_argument("--model", default=None,
                         help=f"expert shape preset for time and copy size: one of {', '.join(PRESETS)} "
                              "(default: from the trace, else Qwen3-30B-A3B)")
    cluster.add_argument("--nic-gbit", type=positive_float, default=400.0, help="NIC per GPU, Gbit/s (default 400)")
    cluster.add_argument("--copy-schedule", choices=("serial", "parallel"), default="serial",
                         help="copies one after another (formula 7, default) or all at once")
    cluster.add_argument("--migration", choices=("stall", "async"), default="stall",
                         help="serving stops for the copies (default stall), or they run beside it, sharing the links "
                              "with dispatch/combine, and the map switches once they are done")
    cluster.add_argument("--layers", type=layer_selection, default=None,
                         help="trace layer positions, e.g. 0-3 (default: all)")
    ctl = parser.add_argument_group("controllers")
    ctl.add_argument("--window", type=positive_int, default=None,
                     help="steps of the start-up plan and of periodic-eplb's window, at most the trace's steps "
                          "(default 1000, or all steps of a shorter trace)")
    ctl.add_argument("--step-interval", type=positive_int, default=3000, help="periodic-eplb: steps between re-plans (default 3000)")
    ctl.add_argument("--check-every", type=positive_int, default=16, help="ours: steps between checks (default 16)")
    ctl.add_argument("--horizon", type=positive_int, default=None,
                     help="ours: steps the predictor looks back, at most the trace's steps (default 32)")
    ctl.add_argument("--predictor", choices=("last", "ema", "scenarios"), default="last",
                     help="ours: how the next steps' load is predicted from the last ones (default last)")
    ctl.add_argument("--hysteresis", type=positive_float, default=1.0,
                     help="ours: a move must pay back within 1/H of the hot spots' expected life (default 1)")
    ctl.add_argument("--min-saving", type=share_below_one, default=0.005,
                     help="ours: ignore a layer whose predicted saving is below this share of its time, in [0, 1) "
                          "(default 0.005: 0.5%%)")
    ctl.add_argument("--max-moved-slots", type=non_negative_int, default=2,
                     help="ours: slot changes per layer and rebalance at most; budgets 1, 2, 4, ... up to it are "
                          "tried and each layer takes the one with the largest net gain that pays back (default 2)")
    ctl.add_argument("--max-mib", type=positive_float, default=None, help="ours: MiB copied per rebalance at most (default: no cap)")
    ctl.add_argument("--drain-steps", type=non_negative_int, default=1,
                     help="batches in flight that finish on the old map before a switch (default 1)")
    parser.add_argument("--format", choices=("table", "json"), default="table", help="output format (default table)")
    parser.add_argument("--no-per-step", action="store_true", help="json: leave out the per-step list")
    add_out_argument(parser, json_file, "FILE.json", "also write the JSON result to FILE")
    parser.add_argument("--plot", type=png_file, metavar="FILE.png",
                        help="also write a PNG: per-step balancedness and cumulative time (default: none)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from moe_place.online.controller import make_controller
    from moe_place.online.costing import cluster_cost
    from moe_place.online.plot import render_replay_png
    from moe_place.online.replay import initial_placement, parse_synthetic, replay
    from moe_place.online.window import Predictor
    from moe_place.traces.load import load_trace

    if (args.trace is None) == (args.synthetic is None):
        raise InputError("replay", "a TRACE file or --synthetic SPEC (exactly one)")
    if args.synthetic:
        counts, source = parse_synthetic(args.synthetic)
        model_hint = ""
    else:
        trace = load_trace(args.trace, **trace_load_options(args))
        counts, source, model_hint = np.asarray(trace.step_counts()), str(args.trace), trace.meta.model
    if args.layers is not None:
        bad = [p for p in args.layers if p >= counts.shape[1]]
        if bad:
            raise InputError("--layers", f"positions in [0, {counts.shape[1]})", bad[0])
        counts = counts[:, args.layers]
    steps, layers, experts = counts.shape
    if args.window is None:
        args.window = min(1000, steps)
    elif args.window > steps:
        raise InputError("--window", f"at most the {steps} steps of the trace (the start-up plan is made on them)",
                         args.window)
    redundant = args.gpus if args.redundant is None else args.redundant
    physical = experts + redundant
    if physical % args.gpus:
        raise InputError("--redundant", f"a count making {experts} + R slots divisible by --gpus {args.gpus}", redundant)
    model = args.model or infer_model_name(model_hint) or "Qwen3-30B-A3B"  # the default: the bundled traces' model
    cost = cluster_cost(args.gpus, args.nodes, args.hardware, model,
                        nic_gbit_per_s=args.nic_gbit, copy_schedule=args.copy_schedule, migration=args.migration)
    options: dict = {}
    if args.controller == "periodic-eplb":
        options = dict(window_size=args.window, step_interval=args.step_interval)
    elif args.controller == "ours":
        if args.horizon is not None and args.horizon > steps:  # its history buffer is sized by it
            raise InputError("--horizon", f"at most the {steps} steps of the trace", args.horizon)
        horizon = 32 if args.horizon is None else args.horizon
        options = dict(check_every=args.check_every, predictor=Predictor(args.predictor, horizon=horizon),
                       hysteresis=args.hysteresis, min_relative_saving=args.min_saving,
                       max_moved_slots=args.max_moved_slots,
                       max_bytes=None if args.max_mib is None else int(args.max_mib * 2**20))
    controller = make_controller(args.controller, cost, layers, experts, **options)
    start = initial_placement(counts, args.gpus, physical, args.nodes, window=args.window)
    bar = None if args.no_progress else ProgressBar(steps, f"replay {args.controller}", "steps")

    def after_step(_step: int) -> None:
        raise_if_interrupted()  # between steps, also when an interrupt was swallowed inside one
        if bar is not None:
            bar.advance()

    try:
        result = replay(counts, controller, cost, start, drain_steps=args.drain_steps, on_step=after_step)
    finally:  # also when interrupted: the message that follows starts on its own line
        if bar is not None:
            bar.close()
    doc = {**result.to_json(per_step=not args.no_per_step), "trace": source, "layers": layers, "experts": experts,
           "gpus": args.gpus, "nodes": args.nodes, "physical": physical, "hardware": cost.gpu.name,
           "model": cost.model.name, "expert_bytes": cost.expert_bytes, "copy_schedule": args.copy_schedule,
           "migration": args.migration}
    if args.out:
        write_json_atomic(args.out, doc)
        wrote("json", args.out)
    if args.plot:
        title = f"{args.synthetic or Path(args.trace).name}, {args.gpus} GPUs"
        write_atomic(args.plot, render_replay_png([(title, {args.controller: result})]))
        wrote("plot", args.plot)
    if args.format == "json":
        print(json.dumps(doc))
        return 0
    print(f"controller            {doc['controller']}")
    print(f"steps                 {doc['steps']} ({layers} layers x {experts} experts on {args.gpus} x "
          f"{cost.gpu.name}, {args.nodes} node(s), {physical} slots)")
    print(f"rebalances            {doc['rebalances']}")
    print(f"bytes moved           {doc['bytes_moved'] / 2**20:.1f} MiB ({doc['slots_moved']} slots changed)")
    print(f"expert-layer time     {doc['total_expert_time_s'] * 1e3:.3f} ms")
    print(f"migration time        {doc['total_migration_time_s'] * 1e3:.3f} ms")
    print(f"total time            {doc['total_time_s'] * 1e3:.3f} ms")
    print(f"mean balancedness     {doc['mean_balancedness']:.4f}")
    return 0
