"""`moe-place offload`: which experts stay on the GPU when the rest run on the CPU (sglang-kt,
llama.cpp), judged held out against the engines' own rules, with the files and flags to run it.

    moe-place offload traces/data/qwen3-30b-a3b_prefill_topk.npz --gpu-memory 12GiB --kv-reserve 4GiB \\
        --hardware H100 --cpu Xeon-Platinum-8452Y --stats-out stats.pt --out offload.json
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys

from moe_place.cli.options import (add_trace_options, byte_size, int_list, json_file, non_negative_float,
                                   non_negative_int, output_file, png_file, positive_int, trace_load_options)
from moe_place.cli.output import emit, wrote
from moe_place.cost.hardware import BUILTIN_PARTS, DEFAULT_GPU
from moe_place.cost.models import PRESETS
from moe_place.cost.units import GIB_BYTES, MIB_BYTES
from moe_place.errors import InputError
from moe_place.io import write_atomic, write_json_atomic

HELP = ("offloaded serving: which experts get GPU memory (the rest on the CPU), held out against sglang-kt's "
        "and llama.cpp's rules, the prefill threshold, sglang-kt stats and llama.cpp flags")
DEFAULT_CPU = "Xeon-Platinum-8452Y"
DEFAULT_ALPHA_US = 5.0       # per transfer, as row C10
PLAN_FORMAT = "moe-place-offload"
PLAN_VERSION = 1
MAX_BATCHES = 65536  # = moe_place.solvers.offload_compare.MAX_BATCHES (that module loads the solvers; a test keeps them equal)


def _size(text: str) -> int:
    """`byte_size`, with a sign said as such (argparse reads "-4GiB" as an option: see add_arguments)."""
    if str(text).strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"expected a size >= 0 like 12GiB, got {text!r}")
    return byte_size(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # "-4GiB" would read as an unknown option ("expected one argument"); as a value it gets _size's
    # line. No option of this command looks like a negative number, so nothing else changes.
    setattr(parser, "_negative_number_matcher", re.compile(r"^-\.?[0-9]"))  # argparse's own hook (3.11-3.13)
    parser.add_argument("trace", metavar="TRACE", help="routing trace (any format `moe-place analyze` reads)")
    add_trace_options(parser)
    parser.add_argument("--model", metavar="PRESET",
                        help=f"expert shape: one of {', '.join(PRESETS)} (default: from the trace's model name)")
    parser.add_argument("--gpu-memory", type=_size, required=True, metavar="BYTES",
                        help="GPU memory for the routed experts and the KV cache, after the dense weights "
                             "(e.g. 12GiB, 80GB; required)")
    parser.add_argument("--kv-reserve", type=_size, default=0, metavar="BYTES",
                        help="of it, kept for the KV cache (default 0)")
    parser.add_argument("--layerwise-prefill", action="store_true",
                        help="also keep one MoE layer of GPU memory for sglang-kt's full-GPU prefill and put "
                             "--kt-gpu-prefill-token-threshold in the flags (default: only report the threshold)")
    parser.add_argument("--hardware", metavar="GPU", default=DEFAULT_GPU,
                        help=f"GPU part ({', '.join(BUILTIN_PARTS['gpu'])}, or one of --parts; default {DEFAULT_GPU})")
    parser.add_argument("--cpu", metavar="CPU", default=DEFAULT_CPU,
                        help=f"CPU part ({', '.join(BUILTIN_PARTS['cpu'])}, or one of --parts; default {DEFAULT_CPU})")
    parser.add_argument("--cpu-kernel", metavar="KERNEL",
                        help="the CPU's kernel whose FLOP/s apply, e.g. amx, avx512 (default: amx if it has it, "
                             "else its first)")
    parser.add_argument("--socket", choices=("local", "remote"), default="local",
                        help="DRAM the CPU reads the weights from (default local)")
    parser.add_argument("--link-gb-per-s", type=non_negative_float, metavar="GB/S",
                        help="CPU-GPU link per direction (default: the GPU's PCIe)")
    parser.add_argument("--alpha-us", type=non_negative_float, default=DEFAULT_ALPHA_US, metavar="US",
                        help=f"start-up per transfer, microseconds (default {DEFAULT_ALPHA_US:g})")
    parser.add_argument("--parts", metavar="FILE", help="TOML/JSON of more hardware parts, e.g. bench/bench_cpu_expert.py --parts-out (default: none)")
    parser.add_argument("--batch-sizes", type=int_list, default=[8, 32], metavar="N1,N2",
                        help="decode batch sizes to plan and judge for, one step each (default 8,32)")
    parser.add_argument("--prefill-tokens", type=non_negative_int, metavar="N",
                        help="prefill batch size (default: the recorded steps' own batches; 0: no prefill)")
    parser.add_argument("--prefill-weight", type=non_negative_float, default=1.0, metavar="W",
                        help="weight of one prefill step against one decode step of each size (default 1)")
    parser.add_argument("--batches", type=positive_int, default=512, metavar="B",
                        help="decode batches drawn per step and batch size, to plan on and to judge on, at most "
                             "65,536 (default 512)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the drawn batches (default 0)")
    parser.add_argument("--no-held-out", action="store_true", help="skip the held-out comparison")
    parser.add_argument("--num-model-layers", type=positive_int, metavar="N",
                        help="decoder layers of the model, dense ones included, for the stats file's rows "
                             "(default: the highest MoE layer id + 1)")
    parser.add_argument("--stats-out", type=output_file, metavar="FILE.pt",
                        help="write sglang-kt's --init-expert-location stats file (needs torch; default: none)")
    parser.add_argument("--out", "--output", dest="out", type=json_file, metavar="FILE.json",
                        help="write the offload plan (resident experts per layer, flags, predictions; default: none)")
    parser.add_argument("--format", choices=("table", "json"), default="table", help="stdout format (default table)")
    parser.add_argument("--plot", type=png_file, metavar="FILE.png",
                        help="draw the held-out step times per set (PNG; default: none)")


def _check_options(args: argparse.Namespace) -> None:
    """The option problems found before the trace is read (one line each)."""
    if args.stats_out and not args.stats_out.endswith(".pt"):
        raise InputError(f"--stats-out {args.stats_out}", "a file name ending in .pt (sglang-kt loads it with torch.load)")
    if args.stats_out:
        try:
            import torch  # noqa: F401 - checked before the work: writing the stats file needs it
        except ImportError:
            raise InputError("--stats-out", "torch installed (pip install torch)", "no torch") from None
    if args.batches > MAX_BATCHES:
        raise InputError("--batches", f"at most {MAX_BATCHES:,}", f"{args.batches:,}")
    if args.gpu_memory <= 0:
        raise InputError("--gpu-memory", "a size > 0 (GPU memory for the routed experts and the KV cache)",
                         f"{args.gpu_memory:,} bytes")
    if args.kv_reserve >= args.gpu_memory:
        raise InputError("--kv-reserve", f"less than --gpu-memory ({args.gpu_memory:,} bytes)", f"{args.kv_reserve:,}")


def run(args: argparse.Namespace) -> int:
    from moe_place.cost.hardware import load_catalog
    from moe_place.cost.models import get_model, infer_model_name
    from moe_place.cost.offload import OffloadRates, crossover_rows, prefill_threshold_tokens
    from moe_place.engines import llama_cpp, sglang_kt
    from moe_place.solvers import offload_rules
    from moe_place.solvers.offload import mean_objective_s, whole_layer_plan
    from moe_place.solvers.offload_compare import (LAYERS_FROM_TRACE, N_CPU_MOE, PLAN, PlanningData, Scenarios,
                                                   compare_held_out, drawn_from, render_comparison_png, step_problems,
                                                   step_tokens)
    from moe_place.traces import load_trace
    import numpy as np  # noqa: I001 - the library's, lazily like the rest (the command's start stays short)

    _check_options(args)
    catalog = load_catalog(args.parts)
    gpu, cpu = catalog.gpu(args.hardware), catalog.cpu(args.cpu)
    kernel = args.cpu_kernel or ("amx" if "amx" in cpu.kernels else cpu.kernels[0])
    rates = OffloadRates.of(gpu, cpu, kernel, args.socket,
                            None if args.link_gb_per_s is None else args.link_gb_per_s * 1e9, args.alpha_us * 1e-6)
    scenarios = Scenarios(tuple(args.batch_sizes), args.prefill_tokens, args.prefill_weight)
    trace = load_trace(args.trace, **trace_load_options(args))
    name = args.model or infer_model_name(trace.meta.model)
    if name is None:
        raise InputError("--model", f"a preset ({', '.join(PRESETS)}): the trace's model "
                                    f"{trace.meta.model!r} names none")
    model = get_model(name)
    if (model.num_experts, model.top_k) != (trace.num_experts, trace.top_k):
        raise InputError("--model", f"a preset with the trace's {trace.num_experts} experts and top-{trace.top_k}",
                         f"{model.name}: {model.num_experts} experts, top-{model.top_k}")
    reserve = trace.num_experts * model.expert_bytes if args.layerwise_prefill else 0
    room = args.gpu_memory - args.kv_reserve - reserve
    capacity = room // model.expert_bytes
    if capacity < 1:
        raise InputError("--gpu-memory", f"room for at least one {model.expert_bytes / MIB_BYTES:g} MiB expert after "
                                         "--kv-reserve" + (" and the layerwise-prefill layer" if reserve else ""),
                         f"{max(room, 0):,} bytes")
    every = trace.num_layers * trace.num_experts
    capacity = min(int(capacity), every)

    problems = step_problems(trace, scenarios, model, rates, args.batches, args.seed)
    data = PlanningData.of(trace, problems, range(trace.num_steps))
    plan = data.plan(capacity)
    layer_ids = tuple(int(i) for i in trace.meta.layer_ids)
    share = data.counts / float(step_tokens(trace).sum())
    threshold = prefill_threshold_tokens(share, plan.resident, model, rates)
    gpu_layers = capacity // trace.num_experts
    layers_mask = whole_layer_plan(data.parts, gpu_layers)
    n_cpu_moe = offload_rules.n_cpu_moe_for(layer_ids, gpu_layers)
    n_cpu_mask = offload_rules.n_cpu_moe_mask(layer_ids, trace.num_experts, n_cpu_moe)
    comparison = None
    if not args.no_held_out and trace.num_steps >= 2:
        comparison = compare_held_out(trace, scenarios, model, rates, capacity, args.batches, args.seed,
                                      problems=problems)
    kt_flags = sglang_kt.launch_flags(plan.num_resident, trace.num_layers, trace.num_experts, args.stats_out,
                                      threshold if args.layerwise_prefill else None)
    report = {
        "trace": args.trace, "model": model.name, "layers": trace.num_layers, "experts": trace.num_experts,
        "expert_bytes": model.expert_bytes, "steps": trace.num_steps,
        "hardware": {"gpu": gpu.name, "gpu_flops_per_s": rates.gpu_flops_per_s, "hbm_bytes_per_s": rates.hbm_bytes_per_s,
                     "cpu": cpu.name, "cpu_kernel": kernel, "cpu_flops_per_s": rates.cpu_flops_per_s,
                     "dram_bytes_per_s": rates.dram_bytes_per_s, "link_bytes_per_s": rates.link_bytes_per_s,
                     "alpha_s": rates.alpha_s},
        "memory": {"gpu_memory_bytes": args.gpu_memory, "kv_reserve_bytes": args.kv_reserve,
                   "layerwise_prefill_bytes": reserve, "capacity_experts": capacity, "all_experts": every},
        "scenarios": [{"name": n, "tokens": None if n == "prefill" and args.prefill_tokens is None else t, "weight": w}
                      for n, t, w in scenarios.planned(0)],
        "batches": {"per_step_and_size": args.batches, "seed": args.seed, "drawn_from": drawn_from(trace)},
        "plan": {"resident_experts": plan.num_resident, "source": plan.source, "value_s": plan.value_s,
                 "lower_bound_s": plan.lower_bound_s, "gap": plan.gap, "held_out_estimate_s": plan.held_out_s,
                 "candidates_s": plan.candidates_s, "notes": list(plan.notes),
                 "scenario_times_s": np.mean([p.scenario_times_s(plan.resident) for p in data.parts], axis=0).tolist(),
                 "experts_per_layer": plan.experts_per_layer.tolist(), "layer_value_s": plan.layer_value_s.tolist()},
        "prefill_threshold_tokens": threshold,
        "formula8_crossover_rows": crossover_rows(model, rates),
        "sglang_kt": {"flags": kt_flags, "stats": args.stats_out},
        "llama_cpp": {"gpu_layers": gpu_layers, "flags": llama_cpp.launch_flags(layers_mask, layer_ids),
                      "n_cpu_moe": n_cpu_moe,
                      "predicted_s": mean_objective_s(data.parts, layers_mask),
                      "n_cpu_moe_predicted_s": mean_objective_s(data.parts, n_cpu_mask)},
        "held_out": None if comparison is None else _comparison_json(comparison),
    }
    if args.stats_out:
        stats = sglang_kt.planned_stats(plan.resident, data.counts, layer_ids, args.num_model_layers)
        sglang_kt.write_stats(args.stats_out, stats)
        wrote("sglang-kt stats", args.stats_out)
    if args.out:
        write_json_atomic(args.out, _plan_file(report, plan.resident, layer_ids))
        wrote("offload plan", args.out)
    if args.plot and comparison is not None:
        write_atomic(args.plot, render_comparison_png(comparison))
        wrote("plot", args.plot)
    elif args.plot:
        print("moe-place offload: no plot: the held-out comparison did not run", file=sys.stderr)
    text = json.dumps(report, indent=1) + "\n" if args.format == "json" else _table(report, PLAN, N_CPU_MOE,
                                                                                    LAYERS_FROM_TRACE)
    emit(text, None, args.format)
    return 0


def _comparison_json(comparison) -> dict:
    return {"scenarios": list(comparison.scenario_names), "batches": comparison.batches,
            "drawn_from": comparison.drawn_from,
            "folds": [{"plan_steps": list(f.plan_steps), "judged_step": f.judged_step,
                       "times_s": {k: v.tolist() for k, v in f.times_s.items()},
                       "total_s": {k: f.total_s(k) for k in f.times_s}} for f in comparison.folds],
            "mean_total_s": {k: comparison.mean_total_s(k) for k in comparison.names},
            "mean_times_s": {k: comparison.mean_times_s(k).tolist() for k in comparison.names}}


def _plan_file(report: dict, resident, layer_ids: tuple[int, ...]) -> dict:
    """The offload plan file: resident expert ids per model layer (checked before it is written)."""
    rows = {str(layer): [int(e) for e in resident[i].nonzero()[0]] for i, layer in enumerate(layer_ids)}
    assert sum(len(v) for v in rows.values()) == report["plan"]["resident_experts"] <= report["memory"]["capacity_experts"]
    keys = ("trace", "model", "layers", "experts", "expert_bytes", "hardware", "memory", "scenarios", "batches", "plan",
            "prefill_threshold_tokens", "sglang_kt", "llama_cpp")
    return {"format": PLAN_FORMAT, "version": PLAN_VERSION, "resident_experts": rows, **{k: report[k] for k in keys}}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:10.3f}"


def _table(report: dict, plan_name: str, n_cpu_name: str, layers_name: str) -> str:
    hw, mem, plan = report["hardware"], report["memory"], report["plan"]
    lines = [f"offload {report['trace']}: {report['model']}, {report['layers']} layers x {report['experts']} experts of "
             f"{report['expert_bytes'] / MIB_BYTES:g} MiB, {report['steps']} steps",
             f"GPU {hw['gpu']} ({hw['gpu_flops_per_s'] / 1e12:.4g} TFLOP/s, {hw['hbm_bytes_per_s'] / 1e9:.4g} GB/s), "
             f"CPU {hw['cpu']} {hw['cpu_kernel']} ({hw['cpu_flops_per_s'] / 1e12:.4g} TFLOP/s, "
             f"{hw['dram_bytes_per_s'] / 1e9:.4g} GB/s), link {hw['link_bytes_per_s'] / 1e9:g} GB/s, "
             f"alpha {hw['alpha_s'] * 1e6:g} us",
             f"GPU memory {mem['gpu_memory_bytes'] / GIB_BYTES:.2f} GiB - KV {mem['kv_reserve_bytes'] / GIB_BYTES:.2f} GiB"
             + (f" - prefill layer {mem['layerwise_prefill_bytes'] / GIB_BYTES:.2f} GiB" if mem["layerwise_prefill_bytes"] else "")
             + f": {mem['capacity_experts']} of {mem['all_experts']} experts on the GPU "
               f"({mem['capacity_experts'] / mem['all_experts']:.1%})"]
    names = [s["name"] for s in report["scenarios"]]
    per_layer = sorted(plan["experts_per_layer"])
    source = plan["source"]
    if source == "thinned frequency":  # frequency takes all the capacity; fewer: some went back to the CPU
        source = "sglang-kt frequency's set" + ("" if plan["resident_experts"] == mem["capacity_experts"] else ", thinned")
    batches = report["batches"]
    lines.append(f"plan on all {report['steps']} steps ({batches['per_step_and_size']} decode batches per step and "
                 f"size drawn from {batches['drawn_from'].replace('the judged step', 'each step')}): "
                 f"{plan['resident_experts']} experts ({source}), per layer "
                 f"{per_layer[0]}-{per_layer[-1]} (median {per_layer[len(per_layer) // 2]}); predicted "
                 + ", ".join(f"{n} {t * 1e3:.3f} ms" for n, t in zip(names, plan["scenario_times_s"]))
                 + f"; weighted {plan['value_s'] * 1e3:.3f} ms, lower bound {plan['lower_bound_s'] * 1e3:.3f} ms "
                   f"(gap {plan['gap']:.2%})")
    lines += [f"note: {n}" for n in plan["notes"]]
    held = report["held_out"]
    if held is not None:
        how = (f"{held['batches']} decode batches drawn from {held['drawn_from']}; prefill: "
               + ("its recorded batch" if report["scenarios"][-1]["tokens"] is None else "drawn as decode"))
        lines += ["", f"held out (plan on the other steps, judge on one; {how}), predicted step time in ms:",
                  f"{'judged':>6} {'set':<40}" + "".join(f"{n:>10}" for n in names) + f"{'weighted':>10} {'vs uniform':>10}"]
        for fold in held["folds"]:
            base = fold["total_s"]["sglang-kt uniform"]
            for key, times in fold["times_s"].items():
                lines.append(f"{fold['judged_step']:>6} {key:<40}" + "".join(_ms(t) for t in times)
                             + _ms(fold["total_s"][key]) + f" {fold['total_s'][key] / base - 1:>+9.1%}")
        means = held["mean_total_s"]
        base = means["sglang-kt uniform"]
        best_kt = min((v, k) for k, v in means.items() if k.startswith("sglang-kt"))
        worst = max((f["total_s"][plan_name] / min(v for k, v in f["total_s"].items() if k.startswith("sglang-kt")),
                     f["judged_step"]) for f in held["folds"])
        lines.append(f"{'mean':>6} " + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in means.items()))
        lines.append(f"{plan_name}: {means[plan_name] / base - 1:+.1%} against sglang-kt's default uniform, "
                     f"{means[plan_name] / best_kt[0] - 1:+.2%} against the best sglang-kt rule ({best_kt[1]}), "
                     f"{means[plan_name] / means[n_cpu_name] - 1:+.1%} against {n_cpu_name} "
                     f"and {means[plan_name] / means[layers_name] - 1:+.1%} against whole layers from the trace; "
                     f"worst fold {worst[0]:.4f}x the fold's best sglang-kt rule (judged step {worst[1]})")
    threshold = report["prefill_threshold_tokens"]
    crossover = report["formula8_crossover_rows"]
    lines.append("")
    lines.append("prefill: the full-GPU pass of every layer (copy its CPU experts, run all on the GPU) is faster from "
                 + (f"{threshold:,} tokens" if threshold else "no batch size up to 4M tokens")
                 + " (formula 8 per expert: from "
                 + (f"{crossover:,} row{'s' if crossover != 1 else ''}" if crossover else "never") + ")"
                 + ("" if report["memory"]["layerwise_prefill_bytes"] or not threshold else
                    f"; --kt-gpu-prefill-token-threshold {threshold} needs one MoE layer of GPU memory "
                    f"({report['experts'] * report['expert_bytes'] / GIB_BYTES:.2f} GiB): --layerwise-prefill keeps it"))
    lines.append("sglang-kt: " + shlex.join(report["sglang_kt"]["flags"]))
    llama = report["llama_cpp"]
    lines.append(f"llama.cpp ({llama['gpu_layers']} whole layers on the GPU): "
                 + shlex.join(llama["flags"])
                 + f"  (predicted {llama['predicted_s'] * 1e3:.3f} ms weighted; --n-cpu-moe {llama['n_cpu_moe']}: "
                   f"{llama['n_cpu_moe_predicted_s'] * 1e3:.3f} ms)")
    return "\n".join(lines) + "\n"
