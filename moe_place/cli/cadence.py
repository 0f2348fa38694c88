"""`moe-place cadence TRACE --engine vllm|sglang`: how often to rebalance, best against best.

Replays the trace at rebalance intervals from 10 steps to the engine's default
(`moe_place.online.cadence.sweep`) with the engine's default policy and with moe-place's rule,
prints each one's total at every interval, each one's best interval, moe-place's gain at the two
best cadences (what the rule adds beyond the cadence, which the default gets too), the hindsight
reference (plans made on the next interval, moved for free: no policy gets there), and the engine
settings for the best cadence.
"""

from __future__ import annotations

import argparse
import json

from moe_place.cli.options import (add_out_argument, add_progress_option, int_list, json_file, png_file,
                                   trace_load_options)
from moe_place.cli.output import model_header, plural, wrote
from moe_place.cli.replay import (SPLIT_CHOICE_PRICED, add_cluster_arguments, add_default_policy_argument,
                                  add_input_arguments, add_policy_time_argument, add_rule_arguments,
                                  add_split_arguments, cluster_slots, default_policy, policy_price, rule_settings,
                                  split_cost_options)
from moe_place.cost.models import DEFAULT_MODEL, infer_model_name
from moe_place.errors import InputError
from moe_place.interrupts import raise_if_interrupted
from moe_place.io import write_atomic, write_json_atomic
from moe_place.progress import ProgressBar

HELP = "sweep the rebalance interval for the engine's default policy and moe-place's: each one's best, and the settings"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_input_arguments(parser)
    engine = parser.add_argument_group("engine protocol")
    engine.add_argument("--engine", choices=("vllm", "sglang"), default="vllm",
                        help="vllm (0.33): the policy in the async worker thread, every call's map committed one "
                             "layer per step, copies beside serving; sglang (0.5.23): per-pass windows, all layers "
                             "at once while serving waits (default vllm)")
    engine.add_argument("--sync", action="store_true",
                        help="vllm with use_async off: the step waits for the policy and the copies")
    engine.add_argument("--intervals", type=int_list, default=None,
                        help="rebalance intervals to try, e.g. 10,20,50 (default 10,20,50,100,200,500,1000; the "
                             "engine's own default is always tried)")
    add_cluster_arguments(parser)
    add_rule_arguments(parser)
    add_split_arguments(parser)
    add_policy_time_argument(parser)
    add_default_policy_argument(parser)
    parser.add_argument("--no-hindsight", action="store_true", help="leave out the hindsight reference")
    parser.add_argument("--format", choices=("table", "json"), default="table", help="output format (default table)")
    add_out_argument(parser, json_file, "FILE.json", "also write the JSON result to FILE")
    parser.add_argument("--plot", type=png_file, metavar="FILE.png",
                        help="also write a PNG: total time over the interval for both policies and the reference (default: none)")
    add_progress_option(parser)


def run(args: argparse.Namespace) -> int:
    from moe_place.cli.shared import gpu_with_record
    from moe_place.cost.cluster import cluster_cost
    from moe_place.engines.launch import engine_settings
    from moe_place.online.cadence import DEFAULT_INTERVALS, POLICIES, cadences, sweep
    from moe_place.online.controller import EngineCadence, initial_map
    from moe_place.online.plot import render_cadence_png
    from moe_place.online.policy import RebalanceRule
    from moe_place.online.replay import load_replay_counts

    if args.sync and args.engine != "vllm":
        raise InputError("--sync", "--engine vllm (SGLang's rebalance is always synchronous)", args.engine)
    intervals = tuple(args.intervals) if args.intervals else DEFAULT_INTERVALS
    counts, source, model_hint = load_replay_counts(args.trace, args.synthetic, args.layers,
                                                    trace_load_options(args))
    steps, layers, experts = counts.shape
    physical = cluster_slots(args, experts)
    use_async = not args.sync
    own = EngineCadence.of(args.engine, use_async=use_async)
    if steps < own.first_call:  # best against best needs the default at its own cadence, as `replay` runs it
        raise InputError(str(args.trace or args.synthetic), f"a trace of at least {own.first_call} steps (the first "
                         f"call of {args.engine}'s policy at its own cadence, every {own.step_interval}; each "
                         "recorded batch is one step)", f"{plural(steps, 'step')}; for a trace of many steps run: "
                         f"moe-place cadence --synthetic drift:steps=6000,seed=0 --engine {args.engine}")
    plan = cadences(args.engine, intervals, use_async, steps)
    model = args.model or infer_model_name(model_hint) or DEFAULT_MODEL
    gpu = gpu_with_record(args.hardware_from, args.hardware)

    def cost_of(cadence):
        return cluster_cost(args.gpus, args.nodes, gpu, model, nic_gbit_per_s=args.nic_gbit,
                            copy_schedule=cadence.copy_schedule, migration=cadence.migration, **split_cost_options(args))

    price = policy_price(args, args.engine, use_async)
    default_plan, default_words = default_policy(args, args.engine)
    start = initial_map(layers, experts, physical, args.gpus, args.nodes)
    runs = len(plan) * 2   # the two policies step through the trace; the hindsight reference does not
    bar = None if args.no_progress else ProgressBar(runs * steps, f"cadence {args.engine}", "steps")

    def step(_step: int) -> None:
        raise_if_interrupted()
        if bar is not None:
            bar.advance()

    try:
        result = sweep(counts, cost_of, start, args.engine, intervals, use_async, args.groups,
                       rule_of=lambda cost: RebalanceRule(cost, layers, experts, **rule_settings(args)),
                       hindsight=not args.no_hindsight,
                       on_step=step, split=args.split == "per-batch", price=price, default_plan=default_plan)
    finally:
        if bar is not None:
            bar.close()
    best_default, best_ours = result.best("default"), result.best("moe-place")
    wins = best_ours.total_s < best_default.total_s     # never advise a loss: else keep the engine's default
    split = args.split == "per-batch"
    if wins:
        settings = engine_settings(args.engine, best_ours.step_interval, best_ours.window, physical - experts,
                                   use_async, model, rule_settings(args), split=split)
    else:
        settings = engine_settings(args.engine, best_default.step_interval, best_default.window, physical - experts,
                                   use_async, ours=False)
    options = split_cost_options(args)
    header = model_header(gpu, options["replica_choice"], price, replay=True)
    doc = {**result.to_json(), "trace": source, "steps": steps, "layers": layers, "experts": experts,
           "gpus": args.gpus, "nodes": args.nodes, "physical": physical, "model": model, "hardware": gpu.name,
           "expert_time": gpu.gemm_profile().describe(), "replica_choice": options["replica_choice"],
           "policy_time": args.policy_time, "default_policy": default_words,
           "advice": "moe-place" if wins else "default", "settings": settings}
    if args.out:
        write_json_atomic(args.out, doc)
        wrote("json", args.out)
    if args.plot:
        record = {"name": source, "kind": "trace", "protocols": {f"{args.engine}{'-sync' if args.sync else ''}":
                                                                 result.to_json()}}
        write_atomic(args.plot, render_cadence_png([record]))
        wrote("plot", args.plot)
    if args.format == "json":
        print(json.dumps(doc))
        return 0
    protocol = f"{args.engine}{' sync' if args.sync else ''}"
    print(f"cadence sweep        {protocol}: {steps} steps of {source}, {layers} layers x {experts} experts on "
          f"{args.gpus} GPUs ({args.nodes} node(s), {physical} slots), {model} experts")
    print(f"model                {header}")
    print(f"default policy       {default_words}")
    if split:
        print("split                moe-place splits each batch on the layers where it pays; elsewhere, and for the "
              f"default, {options['replica_choice']}")
    print(f"{'interval':>8} {'window':>7} {'default s':>11} {'moe-place s':>12} {'ratio':>7} {'default GiB':>12} "
          f"{'moe-place GiB':>14}" + ("" if args.no_hindsight else f" {'hindsight s':>12}"))
    for interval in result.intervals():
        d, o = result.run("default", interval), result.run("moe-place", interval)
        line = (f"{interval:>8} {d.window:>7} {d.total_s:>11.3f} {o.total_s:>12.3f} {o.total_s / d.total_s:>7.4f} "
                f"{d.bytes_moved / 2**30:>12.1f} {o.bytes_moved / 2**30:>14.1f}")
        print(line + ("" if args.no_hindsight else f" {result.hindsight[interval]:>12.3f}"))
    print(f"best                 default {best_default.total_s:.3f} s every {best_default.step_interval} steps; "
          f"moe-place {best_ours.total_s:.3f} s every {best_ours.step_interval}: {result.best_ratio:.4f}x "
          "(moe-place's gain, the cadence's taken out)")
    at_default = result.default_interval
    if at_default:
        print(f"at the default's own cadence ({at_default}): moe-place {result.ratio_at(at_default):.4f}x the "
              f"default; the best cadence gives the default "
              f"{best_default.total_s / result.run('default', at_default).total_s:.4f}x")
    if not args.no_hindsight:
        interval, total = result.hindsight_best
        print(f"hindsight            {total:.3f} s every {interval} ({result.hindsight_ratio:.4f}x the default's "
              "best): "
              "plans made on the next interval's load, moved for free; no policy reaches it")
    if price is not None and not own.policy_in_worker:
        measured = {policy: sum(r.policy_cpu_s for r in result.runs if r.policy == policy) for policy in POLICIES}
        print("policy CPU time      priced in the totals; this machine's clock over every run: "
              + ", ".join(f"{policy} {seconds:.3f} s" for policy, seconds in measured.items())
              + ("" if default_plan is not None else
                 " (the default: the replay's numpy copy, cheaper than the engine's own code)"))
        if split:
            ours = [r for r in result.runs if r.policy == "moe-place"]
            print(f"split choice CPU     {sum(r.split_price_s for r in ours):.3f} s priced in moe-place's totals "
                  f"({SPLIT_CHOICE_PRICED}); {sum(r.split_cpu_s for r in ours):.3f} s on this machine's clock")
    if wins:
        print(f"advice               moe-place every {best_ours.step_interval} steps"
              + (", with the per-batch split" if split else "") + ":")
    else:
        print(f"advice               keep the engine's default policy: moe-place does not beat its best "
              f"({result.best_ratio:.4f}x); the default at its best cadence, every {best_default.step_interval} "
              "steps:")
    for line in settings:
        print(f"  {line}")
    return 0
