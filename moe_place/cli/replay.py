"""`moe-place replay TRACE --controller static|engine-default|ours`: replay a multi-step trace
through an online controller at an engine's cadence and the cost model (expert-layer time +
migration time + the policy's own time)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moe_place.cli.options import (add_hardware_from_option, add_out_argument, add_progress_option,
                                   add_split_cost_arguments, add_trace_options, json_file,
                                   layer_selection, non_negative_float, non_negative_int, png_file, positive_float,
                                   positive_int, share_below_one, trace_load_options)
from moe_place.cli.output import model_header, plural, wrote
from moe_place.cost.hardware import BUILTIN_PARTS
from moe_place.cost.cluster import DEFAULT_NIC_GBIT
from moe_place.cost.models import DEFAULT_MODEL, PRESETS, infer_model_name
from moe_place.cost.replicas import DEFAULT_SOLVE_S, ENGINE_REPLICA_CHOICE, SPLIT_OFF_CHOICES
from moe_place.errors import InputError
from moe_place.interrupts import raise_if_interrupted
from moe_place.online import engine_default
from moe_place.online.policy_cpu import MACHINE, PolicyCpuPrice
from moe_place.io import write_atomic, write_json_atomic
from moe_place.progress import ProgressBar

HELP = "replay a multi-step trace through an engine's rebalance cadence, a policy and the cost model"
CONTROLLER_ALIASES = {"periodic-eplb": "engine-default"}  # the earlier name of the engine's default policy


def add_input_arguments(parser: argparse.ArgumentParser) -> None:
    """TRACE or --synthetic SPEC, and the trace options (shared with `cadence`)."""
    parser.add_argument("trace", nargs="?", metavar="TRACE",
                        help="a trace file with many recorded steps (any format load_trace reads); the bundled "
                             "traces hold three batches, too few: use --synthetic")
    parser.add_argument("--synthetic", metavar="SPEC",
                        help="replay the drifting domain-mixture generator instead, e.g. 'drift:steps=6000,seed=0' "
                             "(keys: steps, layers, experts, top_k, tokens, domains, drift, skew, shared, "
                             "concentration, hot, seed, preset=deepseek-r1; at most 1,000,000 steps and 2**28 "
                             "steps x layers x experts; default: replay TRACE)")
    add_trace_options(parser)


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """The cluster and model (shared with `cadence`)."""
    cluster = parser.add_argument_group("cluster (named as for `plan`)")
    cluster.add_argument("--gpus", type=positive_int, default=8, help="EP size G (default 8)")
    cluster.add_argument("--nodes", type=positive_int, default=1, help="servers (default 1)")
    cluster.add_argument("--redundant", type=non_negative_int, default=None,
                         help="redundant slots per layer (default: one per GPU)")
    cluster.add_argument("--groups", type=positive_int, default=None,
                         help="expert groups (hierarchical planning when a multiple of --nodes; default: none)")
    cluster.add_argument("--hardware", default=None,
                         help=f"GPU part: one of {', '.join(BUILTIN_PARTS['gpu'])}, or an alias such as H100; with "
                              "--hardware-from, the record's part (default H100-SXM)")
    add_hardware_from_option(cluster)
    cluster.add_argument("--model", default=None,
                         help=f"expert shape preset for time and copy size: one of {', '.join(PRESETS)} "
                              "(default: from the trace, else Qwen3-30B-A3B)")
    cluster.add_argument("--nic-gbit", type=positive_float, default=DEFAULT_NIC_GBIT,
                         help=f"NIC per GPU, Gbit/s (default {DEFAULT_NIC_GBIT:g})")
    cluster.add_argument("--layers", type=layer_selection, default=None,
                         help="trace layer positions, e.g. 0-3 (default: all)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_input_arguments(parser)
    parser.add_argument("--controller", choices=("static", "engine-default", "ours", "periodic-eplb"), default="ours",
                        help="static: the start map, never moved; engine-default: the engine's own policy (DeepSeek "
                             "EPLB; vLLM keeps unmoved experts' slots) at its cadence; ours: moe-place's rebalance "
                             "rule at the same cadence, as the vLLM policy and SGLang hook run it (default ours; "
                             "periodic-eplb: the earlier name of engine-default)")
    engine = parser.add_argument_group("engine protocol (defaults: the engine's own)")
    engine.add_argument("--engine", choices=("vllm", "sglang"), default="vllm",
                        help="vllm (0.33): first call after step_interval/4 steps, then every 3000 steps on the last "
                             "1000, the policy in the async worker thread, every call's map committed one layer "
                             "per step; sglang (0.5.23): every 1000 passes on the last 1000, all layers at once "
                             "(stall). Both start from slot p = expert p %% E (default vllm)")
    for flag, text in (("--step-interval", "steps between policy calls (vLLM step_interval, SGLang "
                                           "--eplb-rebalance-num-iterations; default: the engine's)"),
                       ("--window", "steps of load a call sees (vLLM window_size; SGLang's recorder buffer; default: "
                                    "the engine's), also the steps an offline start plan is made from")):
        engine.add_argument(flag, type=positive_int, default=None, help=text)
    engine.add_argument("--start", choices=("engine", "offline"), default="engine",
                        help="engine: the engine's start map (default); offline: a plan made from the first --window "
                             "steps, as a user loading a plan at start-up has")
    engine.add_argument("--migration", choices=("stall", "async"), default=None,
                        help="serving stops for the copies, or they run beside it sharing the links with "
                             "dispatch/combine (default: the engine's, vllm async, sglang stall; vllm stall is its "
                             "sync mode)")
    engine.add_argument("--drain-steps", type=non_negative_int, default=1,
                        help="batches in flight that finish on the old map before a switch (default 1)")
    engine.add_argument("--copy-schedule", choices=("serial", "parallel"), default=None,
                        help="a rebalance's copies one after another (formula 7) or all at once, the links setting "
                             "the time (default: parallel, as both engines batch a layer's transfers)")
    add_cluster_arguments(parser)
    add_rule_arguments(parser)
    add_split_arguments(parser)
    add_policy_time_argument(parser)
    add_default_policy_argument(parser)
    parser.add_argument("--format", choices=("table", "json"), default="table", help="output format (default table)")
    parser.add_argument("--no-per-step", action="store_true", help="json: leave out the per-step list")
    add_out_argument(parser, json_file, "FILE.json", "also write the JSON result to FILE")
    parser.add_argument("--plot", type=png_file, metavar="FILE.png",
                        help="also write a PNG: per-step balancedness and cumulative time (default: none)")
    add_progress_option(parser)


def synthetic_command(args: argparse.Namespace, cadence) -> str:
    """The `replay --synthetic` command line of the same cluster and cadence, on a drifting trace long
    enough for a few policy calls (what to run when TRACE has too few steps)."""
    steps = max(6000, -(-(cadence.first_call + 2 * cadence.step_interval) // 1000) * 1000)
    words = ["moe-place replay", f"--synthetic drift:steps={steps},seed=0", f"--gpus {args.gpus}"]
    given = (("--nodes", args.nodes, 1), ("--redundant", args.redundant, None), ("--engine", args.engine, "vllm"),
             ("--controller", args.controller, "ours"), ("--step-interval", args.step_interval, None),
             ("--window", args.window, None))
    words += [f"{flag} {value}" for flag, value, default in given if value != default]
    return " ".join(words)


REPLICA_CHOICE_NAMES = ("engine", *SPLIT_OFF_CHOICES)


def add_split_arguments(parser: argparse.ArgumentParser) -> None:
    """The per-batch split and how serving sends rows to replicas (shared with `cadence`)."""
    split = parser.add_argument_group("per-batch split (moe_place.split; docs/split.md)")
    split.add_argument("--split", choices=("even", "per-batch"), default="even",
                       help="per-batch: moe-place's rule also splits each batch's rows among an expert's replicas so "
                            "that the busiest GPU is least, on the layers where that saves more than it costs "
                            "(decided at each policy call); even: no split (default)")
    split.add_argument("--replica-choice", choices=REPLICA_CHOICE_NAMES, default=None,
                       help="how serving sends an expert's rows to its replicas where the split is off, for both "
                            "policies: engine (vLLM's token-index hash, SGLang's static dispatch), even (1/replicas "
                            "each, what EPLB assumes), vllm, sglang-static, sglang-dynamic (default: engine, the "
                            "same in every command)")
    add_split_cost_arguments(split)


def split_charges(args: argparse.Namespace) -> dict[str, float | None]:
    """`cluster_cost`'s `split_solve_s` and `split_allreduce_s` (None: NCCL's model) of `add_split_cost_arguments`."""
    return dict(split_solve_s=DEFAULT_SOLVE_S if args.split_solve_us is None else args.split_solve_us * 1e-6,
                split_allreduce_s=None if args.split_allreduce_us is None else args.split_allreduce_us * 1e-6)


def split_cost_options(args: argparse.Namespace) -> dict:
    """Keyword arguments of `cluster_cost` for the split options (`add_split_arguments`)."""
    choice = args.replica_choice or "engine"
    return dict(replica_choice=ENGINE_REPLICA_CHOICE[args.engine] if choice == "engine" else choice,
                **split_charges(args))


def add_rule_arguments(parser: argparse.ArgumentParser) -> None:
    """moe-place's rule settings (shared with `cadence`)."""
    ours = parser.add_argument_group("ours (moe_place.online.policy.RebalanceRule)")
    ours.add_argument("--min-gain", type=share_below_one, default=0.005,
                      help="a layer moves only when its busiest GPU drops by more than this share of the mean GPU "
                           "load, in [0, 1) (default 0.005: 0.5%%)")
    ours.add_argument("--noise-margin", type=non_negative_float, default=2.0,
                      help="... and by more than this many times the measured noise floor (default 2)")
    ours.add_argument("--estimate", choices=("adaptive", "window"), default="adaptive",
                      help="the coming load: adaptive (exponentially weighted steps, the half-life that predicted "
                           "best; per-step windows only, SGLang's) or window (the window's mean, as the engines' "
                           "default policies; default adaptive)")
    ours.add_argument("--max-moved-slots", type=non_negative_int, default=None,
                      help="a cap the engine states: slots changed per layer and call (default: none)")
    ours.add_argument("--max-mib", type=positive_float, default=None,
                      help="a cap on MiB copied per call, e.g. the engine's move buffer (default: none)")


def add_policy_time_argument(parser: argparse.ArgumentParser) -> None:
    """`--policy-time priced|measured` (shared with `cadence`): how a policy call is paid where serving waits."""
    parser.add_argument("--policy-time", choices=("priced", "measured"), default="priced",
                        help="where the engine waits for the policy (SGLang, vLLM --sync or --migration stall), each "
                             "call costs: priced, what the engine's own default code and moe-place's rule cost per "
                             "call in the committed records, scaled to the call's size (the same figures on every "
                             "run); measured, this machine's clock on each call (the replay's numpy copy of the "
                             "default costs less than the engine's code) (default priced; the clock is reported "
                             "either way)")


# what `replay` and `cadence` say of the split's per-layer choice where policy calls are priced
SPLIT_CHOICE_PRICED = "its committed price per slot, moe_place.online.splitting"


def add_default_policy_argument(parser: argparse.ArgumentParser) -> None:
    """`--default-policy auto|engine|numpy` (shared with `cadence`): which code the engine's default policy runs."""
    parser.add_argument("--default-policy", choices=("auto", "engine", "numpy"), default="auto",
                        help="the engine's default policy: engine, the installed engine's own code (vLLM's "
                             "DefaultEplbPolicy, SGLang's rebalance_experts); numpy, moe-place's copy of DeepSeek's "
                             "EPLB (the same maps, less CPU time); auto, the engine's code where it is importable "
                             "here, else the copy (default auto; the output says which ran)")


def default_policy(args: argparse.Namespace, engine: str) -> tuple:
    """(the default's `plan` callable or None for the numpy copy, the words that say which ran)."""
    here = engine_default.available(engine)
    if args.default_policy == "engine" and not here:
        raise InputError("--default-policy engine", f"{engine} importable in this Python (run it in the engine's "
                         "environment), or --default-policy numpy", f"no {engine} here")
    if args.default_policy == "numpy" or not here:
        why = "" if args.default_policy == "numpy" else f"; {engine} is not importable here"
        return None, f"moe-place's numpy copy of DeepSeek's EPLB (the engine's maps{why})"
    return (engine_default.default_plan(engine, args.groups),
            f"{engine} {engine_default.version(engine)}'s own code")


def policy_price(args: argparse.Namespace, engine: str, use_async: bool):
    """The `PolicyCpuPrice` of `--policy-time priced` under the engine's protocol, else None (the clock)."""
    if args.policy_time != "priced":
        return None
    return PolicyCpuPrice(engine if engine == "sglang" else ("vllm" if use_async else "vllm-sync"))


def cluster_slots(args: argparse.Namespace, experts: int) -> int:
    """Physical slots per layer: the experts + --redundant (default one per GPU), checked against --gpus / --groups."""
    redundant = args.gpus if args.redundant is None else args.redundant
    physical = experts + redundant
    if physical % args.gpus:
        raise InputError("--redundant", f"a count making {experts} + R slots divisible by --gpus {args.gpus}",
                         redundant)
    if args.groups is not None and experts % args.groups:
        raise InputError("--groups", f"a divisor of the {experts} experts", args.groups)
    return physical


def rule_settings(args: argparse.Namespace) -> dict:
    """moe-place's rule settings from the command's options (keyword arguments of `RebalanceRule`)."""
    return dict(num_groups=args.groups, min_gain=args.min_gain, noise_margin=args.noise_margin, estimate=args.estimate,
                max_moved_slots=args.max_moved_slots,
                max_bytes=None if args.max_mib is None else int(args.max_mib * 2**20))


def run(args: argparse.Namespace) -> int:
    from moe_place.cli.shared import gpu_with_record
    from moe_place.cost.cluster import cluster_cost
    from moe_place.online.controller import EngineCadence, initial_map, make_controller
    from moe_place.online.plot import render_replay_png
    from moe_place.online.policy import RebalanceRule
    from moe_place.online.replay import initial_placement, load_replay_counts, replay
    from moe_place.online.splitting import SplitChoice

    counts, source, model_hint = load_replay_counts(args.trace, args.synthetic, args.layers, trace_load_options(args))
    steps, layers, experts = counts.shape
    # vLLM with --migration stall is its sync mode: the step waits for the policy and for every layer's copies
    cadence = EngineCadence.of(args.engine, args.step_interval, args.window, use_async=args.migration != "stall")
    if args.start == "offline" and cadence.window_size > steps:
        raise InputError("--window", f"at most the {steps} steps of the trace (the offline start plan is made on them)",
                         cadence.window_size)
    if args.controller != "static" and cadence.first_call > steps:
        if args.synthetic:
            raise InputError("--step-interval", f"a cadence whose first call falls within the trace's {steps} steps "
                             f"({args.engine} calls its policy first after {cadence.first_call})",
                             cadence.step_interval)
        raise InputError(str(args.trace), f"a trace of at least {cadence.first_call} steps (the first call of "
                         f"{args.engine}'s policy comes after {cadence.first_call} at --step-interval "
                         f"{cadence.step_interval}; each recorded batch is one step)",
                         f"{plural(steps, 'step')}; for a trace of many steps run: {synthetic_command(args, cadence)}")
    physical = cluster_slots(args, experts)
    migration = args.migration or cadence.migration
    schedule = args.copy_schedule or cadence.copy_schedule
    model = args.model or infer_model_name(model_hint) or DEFAULT_MODEL
    cost = cluster_cost(args.gpus, args.nodes, gpu_with_record(args.hardware_from, args.hardware), model,
                        nic_gbit_per_s=args.nic_gbit, copy_schedule=schedule, migration=migration,
                        **split_cost_options(args))
    kind = CONTROLLER_ALIASES.get(args.controller, args.controller)
    if args.split == "per-batch" and kind != "ours":
        raise InputError("--split per-batch", "--controller ours (the split is moe-place's; the engine's own policy "
                         "runs its own replica choice, --replica-choice)", f"--controller {args.controller}")
    rule = RebalanceRule(cost, layers, experts, split=SplitChoice(cost) if args.split == "per-batch" else None,
                         **rule_settings(args))
    # the engine's own code (torch, the engine's package) is loaded only where its default policy runs
    default_plan, default_words = default_policy(args, args.engine) if kind == "engine-default" else (None, None)
    controller = make_controller(kind, cadence, layers, experts, rule=rule, num_groups=args.groups,
                                 default_plan=default_plan)
    if args.start == "offline":
        start = initial_placement(counts, args.gpus, physical, args.nodes, window=cadence.window_size,
                                  num_groups=args.groups)
    else:
        start = initial_map(layers, experts, physical, args.gpus, args.nodes)
    price = policy_price(args, args.engine, migration != "stall")
    paid_s = None if price is None or kind == "static" else \
        price.call_s("default" if kind == "engine-default" else "moe-place", layers, experts, physical,
                     cadence.window_size)
    bar = None if args.no_progress else ProgressBar(steps, f"replay {controller.name}", "steps")

    def after_step(_step: int) -> None:
        raise_if_interrupted()  # between steps, also when an interrupt was swallowed inside one
        if bar is not None:
            bar.advance()

    try:
        result = replay(counts, controller, cost, start, drain_steps=args.drain_steps, on_step=after_step,
                        layer_per_step=cadence.layer_per_step, policy_in_worker=cadence.policy_in_worker,
                        policy_price_s=paid_s)
    finally:  # also when interrupted: the message that follows starts on its own line
        if bar is not None:
            bar.close()
    doc = {**result.to_json(per_step=not args.no_per_step), "trace": source, "layers": layers, "experts": experts,
           "gpus": args.gpus, "nodes": args.nodes, "physical": physical, "hardware": cost.gpu.name,
           "expert_time": cost.gpu.gemm_profile().describe(),
           "model": cost.model.name, "expert_bytes": cost.expert_bytes, "copy_schedule": schedule,
           "migration": migration, "engine": args.engine, "step_interval": cadence.step_interval,
           "window": cadence.window_size, "start": args.start, "split": args.split,
           "replica_choice": cost.replica_choice, "split_overhead_s": cost.split_overhead_s,
           "policy_time": args.policy_time, "policy_price_s": paid_s,
           "policy_price_machine": None if paid_s is None else MACHINE,
           **({"default_policy": default_words} if kind == "engine-default" else {})}
    if args.out:
        write_json_atomic(args.out, doc)
        wrote("json", args.out)
    if args.plot:
        title = f"{args.synthetic or Path(args.trace).name}, {args.gpus} GPUs"
        write_atomic(args.plot, render_replay_png([(title, {controller.name: result})]))
        wrote("plot", args.plot)
    if args.format == "json":
        print(json.dumps(doc))
        return 0
    print(f"controller            {doc['controller']} ({args.engine} cadence: every {cadence.step_interval} steps "
          f"on the last {cadence.window_size}, {migration} {schedule} copies, {args.start} start map)")
    print(f"model                 {model_header(cost.gpu, cost.replica_choice, price, replay=True)}")
    if kind == "engine-default":
        print(f"default policy        {default_words}")
    print(f"steps                 {doc['steps']} ({layers} layers x {experts} experts on {args.gpus} x "
          f"{cost.gpu.name}, {args.nodes} node(s), {physical} slots)")
    print(f"rebalances            {doc['rebalances']}")
    print(f"bytes moved           {doc['bytes_moved'] / 2**20:.1f} MiB ({doc['slots_moved']} slots changed)")
    print(f"expert-layer time     {doc['total_expert_time_s'] * 1e3:.3f} ms")
    print(f"dispatch + combine    {doc['total_comm_time_s'] * 1e3:.3f} ms")
    print(f"migration time        {doc['total_migration_time_s'] * 1e3:.3f} ms")
    paid = ("vLLM runs it in its async worker thread, beside serving: not paid" if cadence.policy_in_worker
            else "serving waits for it: paid" + ("" if paid_s is None else f", {paid_s * 1e3:.3f} ms a call as priced"))
    print(f"policy time           {doc['total_policy_time_s'] * 1e3:.3f} ms ({doc['total_policy_cpu_s'] * 1e3:.3f} ms "
          f"CPU measured; {paid})")
    print(f"total time            {doc['total_time_s'] * 1e3:.3f} ms")
    print(f"mean balancedness     {doc['mean_balancedness']:.4f}")
    if args.split == "per-batch":
        print(f"per-batch split       on {doc['split_layer_steps']} of {steps * layers} layer-steps (each pays "
              f"{cost.split_overhead_s * 1e6:.1f} us: all-reduce of the counts + solve); elsewhere the replica choice "
              f"{cost.replica_choice}")
        if paid_s is not None and not cadence.policy_in_worker:
            print(f"split choice CPU      {doc['split_price_s'] * 1e3:.3f} ms priced in the total ({SPLIT_CHOICE_PRICED}); "
                  f"{doc['split_cpu_s'] * 1e3:.3f} ms on this machine's clock")
    return 0
