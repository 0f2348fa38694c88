"""`plan --redundant auto`: size the redundant experts on held-out steps, then plan the recommended R.

What the CLI adds to `moe_place.solvers.sizing`: the sizing options' checks, the replica memory
from `--model` (or the trace's model name) and `--expert-bytes`, and the plot. `plan` imports
this module inside `run()` (it loads the library).
"""

from __future__ import annotations

import argparse
import sys

from moe_place.cli.shared import build_problem, load_args_trace
from moe_place.cost.models import PRESETS, get_model, infer_model_name
from moe_place.errors import InputError
from moe_place.io import write_atomic
from moe_place.solvers.plot import render_sizing_png
from moe_place.solvers.sizing import DEFAULT_MIN_GAIN_PER_GIB, ReplicaMemory, Sizing, held_out_steps, size_redundancy

SIZING_OPTIONS = ("min_gain_per_gib", "max_redundant", "max_replica_bytes", "plot")


def check_sizing_options(args: argparse.Namespace) -> None:
    """The sizing options need `--redundant auto`, and `auto` plans from scratch for balance."""
    if args.redundant != "auto":
        used = [name for name in SIZING_OPTIONS if getattr(args, name) is not None]
        if used:
            raise InputError(f"--{used[0].replace('_', '-')}", "--redundant auto as well",
                             f"--redundant {args.redundant}" if args.redundant is not None else "no --redundant")
        return
    if args.current is not None:
        raise InputError("--redundant auto", "a plan from scratch, without --current (a re-plan keeps the R in use)",
                         f"--current {args.current}")
    if args.objective == "time":
        raise InputError("--redundant auto", "--objective balance (the sizing judges balance plans; plan the "
                         "recommended R with --objective time in a second run)", "--objective time")


def replica_memory(args: argparse.Namespace, trace) -> ReplicaMemory:
    """What a redundant expert costs: `--expert-bytes` or the preset's `W_e`, the preset's MoE layers
    (the trace's layers without a preset) and its KV bytes per token."""
    name = args.model or infer_model_name(trace.meta.model)
    if name is None and args.expert_bytes is None:
        raise InputError("--model", f"an expert shape preset ({', '.join(PRESETS)}) for the replicas' bytes and the "
                         f"KV bytes per token, or --expert-bytes B; the trace's model {trace.meta.model!r} names none",
                         "nothing")
    if name is None:
        return ReplicaMemory(args.expert_bytes, trace.num_layers, None,
                             f"--expert-bytes {args.expert_bytes}, the trace's {trace.num_layers} layers, no KV preset")
    shape = get_model(name)
    if shape.num_experts != trace.num_experts:
        raise InputError("--model", f"a preset with the trace's {trace.num_experts} experts per layer",
                         f"{shape.name} ({shape.num_experts} experts)")
    if args.expert_bytes is None:
        return ReplicaMemory(shape.expert_bytes, shape.num_moe_layers, shape.kv_bytes_per_token, shape.name)
    return ReplicaMemory(args.expert_bytes, shape.num_moe_layers, shape.kv_bytes_per_token,
                         f"{shape.name} with --expert-bytes {args.expert_bytes}")


def size_for_plan(args: argparse.Namespace) -> tuple[argparse.Namespace, Sizing, object]:
    """(the options with `--redundant` set to the recommended R, the sizing, the trace)."""
    trace = load_args_trace(args)
    first = (-trace.num_experts) % args.gpus
    build_problem(_with(args, first), trace=trace)  # every option check of the plan before the sizing runs
    memory = replica_memory(args, trace)
    loads, folds = held_out_steps(trace)
    solver = "eplb" if args.solver == "eplb" else "fast"  # deterministic, no time limit (see plan --help)
    gain = DEFAULT_MIN_GAIN_PER_GIB if args.min_gain_per_gib is None else args.min_gain_per_gib
    sizing = size_redundancy(loads, args.gpus, memory, solver=solver, max_redundant=args.max_redundant,
                             max_replica_bytes=args.max_replica_bytes, min_gain_per_gib=gain,
                             num_nodes=args.nodes, num_groups=args.groups, allow_colocated=args.allow_colocated,
                             seed=args.seed, jobs=args.jobs, folds=folds, progress=not args.no_progress,
                             split="per-batch" if args.split == "per-batch" else "even")
    print(f"plan: sized R = {sizing.recommended} ({sizing.reason})", file=sys.stderr)
    if args.plot:
        write_atomic(args.plot, render_sizing_png(sizing))
        print(f"wrote plot {args.plot}", file=sys.stderr)
    return _with(args, sizing.recommended), sizing, trace


def _with(args: argparse.Namespace, redundant: int) -> argparse.Namespace:
    """The options with `--redundant R` (and no `--expert-bytes`: in sizing it priced the replicas,
    in `build_problem` it belongs to `--expert-memory-budget`)."""
    return argparse.Namespace(**{**vars(args), "redundant": redundant, "expert_bytes": None})
