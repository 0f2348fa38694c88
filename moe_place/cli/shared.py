"""What several subcommands do with the library: build the placement problem from the shared
options, evaluate plans, and build the layer-time model from the options.

This module imports the library (numpy, the solvers' evaluation, the cost model) at its top, so
the subcommands import it inside `run()`, keeping `--help` fast.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np

from moe_place.cli.options import (DISPATCH_CHOICES, REPLICA_CHOICE_NAMES, SOLVER_CHOICES, TOKEN_HOME_CHOICES,
                                   WEIGHT_CHOICES, time_model_defaults, trace_load_options)
from moe_place.cost.cluster import cluster_topology
from moe_place.cost.comm import DISPATCH_STYLES, TOKEN_HOMES, CommModel, compute_only_s, layer_cost
from moe_place.cost.gemm import WEIGHT_MODES
from moe_place.cost.hardware import DEFAULT_GPU, GpuSpec, builtin_catalog, gpu_from_record
from moe_place.cost.replicas import TOKEN_CHOICES, SlotTable, split_overhead_s
from moe_place.cost.models import PRESETS, get_model, infer_model_name
from moe_place.cost.topology import parse_topology_spec
from moe_place.errors import InputError, check_registry
from moe_place.placement import Placement
from moe_place.problem import PlacementProblem
from moe_place.progress import ProgressBar
from moe_place.solvers import solver_names
from moe_place.solvers.evaluate import layer_figures, optimal_split
from moe_place.split import round_shares, split_shares
from moe_place.traces.load import load_trace

for _option, _registered, _offered in (("--dispatch", DISPATCH_STYLES, DISPATCH_CHOICES),
                                      ("--replica-choice", TOKEN_CHOICES, REPLICA_CHOICE_NAMES),
                                      ("--token-home", TOKEN_HOMES, TOKEN_HOME_CHOICES),
                                      ("--weights", WEIGHT_MODES, WEIGHT_CHOICES),
                                      ("--solver", ("auto", *solver_names()), SOLVER_CHOICES)):
    check_registry(_option, _registered, _offered)

TIME_KEYS = ("distinct_nodes_per_token", "rdma_bytes", "nvlink_bytes", "dispatch_s", "compute_s", "combine_s",
             "layer_time_s")


def load_args_trace(args: argparse.Namespace):
    """The trace the shared options name (`TRACE`, the trace options, `--layers`, `--steps`); `args.steps`
    becomes the positions of the steps it names (what a plan records)."""
    trace = load_trace(args.trace, **trace_load_options(args))
    if args.layers is not None:
        trace = trace.select_layer_ids(args.layers)
    return select_args_steps(args, trace)


def select_args_steps(args: argparse.Namespace, trace):
    """The steps of `trace` that `--steps` names (all without it); sets `args.steps` to their positions."""
    if args.steps is None:
        return trace
    args.steps = trace.step_positions(args.steps)
    return trace.select_steps(args.steps)


def build_problem(args: argparse.Namespace, current_plan=None, trace=None):
    """(PlacementProblem, trace, options dict) from the shared options; InputError on bad values.

    current_plan: the plan file in use now (`--current`), restricted here to the planned layers.
    trace: the trace `load_args_trace(args)` read already (None: read it here).
    """
    if args.expert_bytes is not None and args.expert_memory_budget is None:  # option checks before the trace is read
        raise InputError("--expert-bytes", "--expert-memory-budget as well (it is used only for the budget)",
                         "no budget")
    if args.expert_memory_budget is not None and args.expert_bytes is None:
        raise InputError("--expert-memory-budget", "--expert-bytes B as well (bytes of one expert)")
    if args.nodes and args.gpus % args.nodes:
        raise InputError("--nodes", f"a divisor of --gpus {args.gpus}", args.nodes)
    if trace is None:
        trace = load_args_trace(args)
    current = None if current_plan is None else current_for(current_plan, trace.meta.layer_ids, args.current)
    loads = trace.window_counts(None).astype(np.float64)  # summed over steps (bench/bench_windows.py: why)
    experts, gpus = trace.num_experts, args.gpus
    if args.expert_memory_budget is not None:
        slots = args.expert_memory_budget // (args.expert_bytes * trace.num_layers)
        if slots * gpus < experts:
            raise InputError("--expert-memory-budget",
                             f"room for one copy of each of the {experts} experts in each of the {trace.num_layers} "
                             f"layers: at least {-(-experts // gpus) * args.expert_bytes * trace.num_layers} bytes "
                             f"per GPU", args.expert_memory_budget)
        physical = min(slots, experts) * gpus
    else:
        physical = experts + (args.redundant or 0)
        if physical % gpus:
            raise InputError("--redundant", f"R with E + R divisible by --gpus {gpus} (E = {experts}); "
                             f"e.g. {(-experts) % gpus}", args.redundant or 0)
        if physical > experts * gpus:
            raise InputError("--redundant", f"at most {experts * gpus - experts} (one replica per GPU per expert)",
                             args.redundant)
    if args.groups is not None and experts % args.groups:
        raise InputError("--groups", f"a divisor of the {experts} experts", args.groups)
    options = {"gpus": gpus, "nodes": args.nodes, "groups": args.groups, "num_physical": physical,
               "redundant": physical - experts, "split": args.split, "layers": args.layers, "steps": args.steps,
               "time_limit_s": args.time_limit,
               "allow_colocated": args.allow_colocated}
    extra = {}
    if current is not None:
        extra = {"current": current, "max_moved_slots": getattr(args, "max_moved_slots", None),
                 "move_cost_weight": getattr(args, "move_cost", 0.0)}
    problem = PlacementProblem(loads, gpus, physical, num_nodes=args.nodes, num_groups=args.groups,
                               split=args.split, expert_bytes=args.expert_bytes, layer_ids=tuple(trace.meta.layer_ids),
                               seed=args.seed, allow_colocated=args.allow_colocated, **extra)
    return problem, trace, options


def report_rows(problem, solution, split: str) -> list[dict]:
    """Per-layer report rows of a solution, evaluated under `split`.

    The solvers' bounds (CP-SAT's included) are for the even split they optimise; other splits
    get the bounds that hold for any split (moe_place.solvers.bounds).
    """
    rows = []
    for i, layer in enumerate(solution.layers):
        figures = layer_figures(layer.phy2log, problem.layer_loads(i), problem.num_gpus, split,
                                problem.window_objective, problem.quantile, problem.layer_id(i),
                                lower_bound=layer.lower_bound if split == "even" else None)
        rows.append({**figures.to_dict(), "status": layer.status})
    return rows


def current_for(plan, layer_ids, path: str):
    """The current plan's placement restricted to the planned layers `layer_ids` (same order)."""
    rows = {layer_id: i for i, layer_id in enumerate(plan.layer_ids)}
    missing = [layer for layer in layer_ids if layer not in rows]
    if missing:
        raise InputError(f"{path}: layer_ids", "every planned layer", f"no layer {missing[0]}")
    p = plan.placement
    return Placement(p.phy2log[[rows[layer] for layer in layer_ids]], p.num_experts, p.num_gpus, p.num_nodes,
                     allow_colocated=p.allow_colocated)


def time_model_from_args(args: argparse.Namespace, num_gpus: int, num_nodes: int, trace_model: str,
                         required: bool, seed: int = 0):
    """The `CommModel` the options describe for a plan of `num_gpus` GPUs on `num_nodes` nodes; options
    still None take the one set of defaults (`TIME_MODEL_DEFAULTS`); `--hardware-from` (when the command has
    it) gives the GPU its measured formula-11 terms.

    Returns None when no expert shape is known (no --model and a trace model name that names no
    preset) and `required` is False; InputError naming --model when it is True.
    """
    time_model_defaults(args)
    record = getattr(args, "hardware_from", None)
    name = args.model or infer_model_name(trace_model)
    if name is None:
        if required:
            raise InputError("--model", f"an expert shape preset ({', '.join(PRESETS)}) for row bytes and FLOPs; "
                             f"the trace's model {trace_model!r} names none", "nothing")
        return None
    model = get_model(name)
    if args.topology is not None:
        topology = parse_topology_spec(args.topology)
        if (topology.num_servers, topology.num_gpus) != (num_nodes, num_gpus):
            raise InputError("--topology", f"{num_nodes} node(s) x {num_gpus // num_nodes} GPUs (the plan's "
                             f"{num_gpus} GPUs on {num_nodes} node(s))",
                             f"{topology.num_servers} x {topology.gpus_per_server}")
        if record is not None:
            topology = replace(topology, gpu=gpu_from_record(record, topology.gpu))
    else:
        topology = cluster_topology(num_gpus, num_nodes, DEFAULT_GPU if record is None else gpu_from_record(record))
    if args.weights == "tiles" and args.block_m is None:
        raise InputError("--block-m", "a tile height with --weights tiles", "nothing")
    return CommModel(topology, model, dispatch=args.dispatch, replica_choice=args.replica_choice,
                     token_home=args.token_home, weights=args.weights, block_m=args.block_m, seed=seed)


# what `evaluate` takes from a plan's recorded inputs when its command line does not say: the option's
# attribute and the key of `inputs.options` (the seed is `inputs.seed`)
PLAN_OPTIONS = (("split", "split"), ("model", "model"), ("topology", "topology_spec"))
# what `evaluate` never takes from a plan: the layer-time model's own options. Every plan is judged under the
# command line's, else the one set of defaults, so two plans of one trace are judged by the same model
MODEL_OPTIONS = (("dispatch", "dispatch"), ("replica_choice", "replica_choice"), ("token_home", "token_home"),
                 ("weights", "weights"), ("block_m", "block_m"))


def options_from_plan(args: argparse.Namespace, plan) -> dict:
    """Set the options the command line left unset (None) to the values the plan recorded (in place);
    returns {option: value} of those taken, for the command to say which it used."""
    recorded = dict(plan.inputs.get("options") or {})
    recorded["seed"] = plan.inputs.get("seed")
    taken = {}
    for attribute, key in PLAN_OPTIONS + (("seed", "seed"),):
        value = recorded.get(key)
        if getattr(args, attribute, None) is None and value is not None:
            setattr(args, attribute, value)
            taken[attribute] = value
    return taken


def model_options_unlike_plan(args: argparse.Namespace, plan) -> dict:
    """{option: (the plan's, the one judged with)} of the layer-time model's options (`MODEL_OPTIONS`, after
    `time_model_defaults`) where the plan recorded another value: what `evaluate` says it judged differently."""
    recorded = dict(plan.inputs.get("options") or {})
    return {attribute: (recorded[key], getattr(args, attribute)) for attribute, key in MODEL_OPTIONS
            if recorded.get(key) is not None and recorded[key] != getattr(args, attribute)}


def split_rule(phy2log: np.ndarray, num_gpus: int, split: str):
    """The per-batch split of one layer's map as the time model takes it (counts `[E]` or `[steps, E]` in,
    rows per slot out): `per-batch` the fast method, `optimal` the LP's split in whole rows; None for the
    splits the replica choice models (`even`, `local`)."""
    if split == "per-batch":
        return lambda counts: split_shares(phy2log, counts, num_gpus)

    if split == "optimal":
        def optimal(counts):
            rows = np.atleast_2d(counts)
            exact = np.array([optimal_split(phy2log, c, num_gpus)[1] for c in rows])
            shares = round_shares(phy2log, rows, exact, num_gpus)
            return shares if np.ndim(counts) == 2 else shares[0]
        return optimal
    return None


def time_figures(placement, trace, model, progress: bool = False, split: str = "even",
                 split_overhead: float | None = None) -> tuple[list[dict], dict]:
    """(per-layer dicts with TIME_KEYS and the NIC/node bytes, top-level sums and notes) of a plan on a
    trace whose layers are the plan's. Count-level traces get the compute time only. The random replica
    choices are seeded by each layer's id in the model (as `plan --objective time` does). progress: a
    bar on stderr (when a terminal) over the layers of a token-level trace, the part that takes long.
    split: `per-batch` or `optimal` send each step's tokens as that split of the step says (`split_rule`)
    instead of the model's replica choice, and each layer and step pays `split_overhead` seconds (the counts'
    all-reduce and the solve, `moe_place.cost.replicas.split_overhead_s`: `split_s`, in the layer time)."""
    layers, top = [], {"time_model": model.describe()}
    splitting = split_rule(placement.phy2log[0], placement.num_gpus, split) is not None
    if splitting:
        top["time_model"]["replica_choice"] = f"the {split} split of each step"
        overhead = split_overhead_s(placement.num_gpus, placement.num_nodes) if split_overhead is None \
            else split_overhead
        top["time_model"]["split_overhead_s"] = overhead
    if trace.is_token_level:
        bar = ProgressBar(placement.num_layers, "evaluate time", "layers", enabled=None if progress else False)
        for i in range(placement.num_layers):
            table = SlotTable(placement.phy2log[i], placement.num_gpus, placement.num_nodes,
                              placement.num_experts)
            cost = layer_cost(model, [ids[:, i, :] for ids in trace.topk_ids], table, trace.meta.layer_ids[i],
                              split=split_rule(placement.phy2log[i], placement.num_gpus, split))
            row = cost.to_dict()
            if splitting:
                row["split_s"] = overhead * len(trace.topk_ids)
                row["layer_time_s"] += row["split_s"]
            layers.append(row)
            bar.advance()
        bar.close()
        top["layer_time_s"] = float(sum(x["layer_time_s"] for x in layers))
        top["rdma_bytes"] = float(sum(x["rdma_bytes"] for x in layers))
        top["nvlink_bytes"] = float(sum(x["nvlink_bytes"] for x in layers))
    else:
        steps = trace.step_counts()
        for i in range(placement.num_layers):
            compute = compute_only_s(model, steps[:, i, :].astype(np.float64), placement.phy2log[i],
                                     placement.num_gpus, split=split_rule(placement.phy2log[i], placement.num_gpus,
                                                                          split))
            layers.append({**{key: None for key in TIME_KEYS}, "compute_s": compute,
                           **({"split_s": overhead * len(steps)} if splitting else {})})
        top.update({"layer_time_s": None, "rdma_bytes": None, "nvlink_bytes": None,
                    "compute_s": float(sum(x["compute_s"] for x in layers)),
                    "note": f"count-level trace: only the compute time (replicas split each expert's rows "
                            f"{'evenly' if split_rule(placement.phy2log[0], placement.num_gpus, split) is None else 'as the ' + split + ' split of each step says'}); "
                            "dispatch, combine and traffic need token-level expert ids"})
    return layers, top


def gpu_with_record(record: str | None, part: str | None, default: str = DEFAULT_GPU) -> GpuSpec:
    """The GPU `replay` and `cadence` run on: the catalog `part` (None: the record's part, else
    `default`), with formula 11's terms fitted on `record` (`--hardware-from`) when one is given."""
    gpu = None if part is None else builtin_catalog().gpu(part)
    if record is None:
        return gpu or builtin_catalog().gpu(default)
    return gpu_from_record(record, gpu)
