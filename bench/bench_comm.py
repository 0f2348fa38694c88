"""Does planning for the layer time pay at multi-node EP? Predicted MoE layer time (dispatch + compute
+ combine, `moe_place.cost.comm`) of the bundled real Qwen3-30B-A3B trace, in and out of sample.

Cases: EP32 on 4 nodes x 8 H100 with R = 0 and R = 32 redundant experts, EP64 on 8 x 8 with
R = 64; the default model of `moe-place plan --objective time` (DeepEP dispatch, SGLang's static
replica choice, tokens in blocks, NVLink 450 GB/s, one 400 Gbit/s NIC per GPU, weights read once).
Samples: `in` (plan on the three recorded batches, judge on the same three) and leave-one-batch-out
`hold k` (plan on the two others, judge on batch k). Methods:
- `contiguous`: the engines' default placement (redundant slots wrap around to experts 0, 1, ...);
- `eplb`: DeepSeek EPLB's global policy (the hierarchical one needs expert groups; Qwen3 has none);
- `eplb-hier`: EPLB's hierarchical policy with one expert group per node (contiguous blocks of E/N);
- `fast`: our balance-only plan (`--objective balance --solver fast`);
- `time`: `--objective time` (`moe_place.solvers.comm.plan_time`: nodes start from Louvain
  communities of the networkx co-activation graph, strength chosen on held-out windows of the
  training batches, guarded against the balance-only plan);
- `time-bal`: the same from the grouping-free balanced node split instead of the communities;
- `grouped`: the same planner with every layer grouped at the largest strength and no hold-out or
  guard: what grouping for the training tokens does when nothing holds it back.
Columns: distinct nodes per token, RDMA GB (dispatch phase), busiest/mean GPU rows (per step,
averaged), busiest/mean NIC (dispatch time over the time the mean NIC needs), predicted layer time
(ms, summed over 48 layers and the judged batches) and its dispatch/compute/combine parts.
Targets (issue): in sample `time` at least 15% below the best of contiguous, eplb and fast with RDMA
at least 30% below eplb's; out of sample (mean over folds) at least 5% below the best, and never
above fast's on a fold. Plan time of 48 layers at EP32 on 2 cores: `moe-place plan` timed end to end.

    python bench/bench_comm.py [--layers 48] [--output-json bench/results/comm.json] [--plot bench/results/comm.png]
    python bench/bench_comm.py --timing-only [--output-json FILE]   # just the end-to-end plan times
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from moe_place.cost.comm import CommModel, SlotTable, default_topology, layer_cost
from moe_place.cost.models import get_model
from moe_place.io import write_atomic, write_json_atomic
from moe_place.placement import Placement
from moe_place.problem import PlacementProblem
from moe_place.solvers import solve
from moe_place.solvers.comm import STRENGTHS, plan_time
from moe_place.solvers.deepseek import eplb_rebalance
from moe_place.traces.bundled import bundled_path
from moe_place.traces.load import load_trace

CASES = ((32, 4, 0), (32, 4, 32), (64, 8, 64))
METHODS = ("contiguous", "eplb", "eplb-hier", "fast", "time", "time-bal", "grouped")
BASELINES = ("contiguous", "eplb", "fast")   # the "best of"
PARTS = ("dispatch_s", "compute_s", "combine_s")


def plans(train: list[np.ndarray], gpus: int, nodes: int, redundant: int, model: CommModel) -> dict:
    """{method: (phy2log [L, P], plan seconds, extra)} for one case and training sample."""
    layers, experts = train[0].shape[1], 128
    loads = np.stack([sum(np.bincount(s[:, i, :].ravel(), minlength=experts) for s in train)
                      for i in range(layers)]).astype(np.float64)
    physical = experts + redundant
    out = {}
    start = time.perf_counter()
    out["contiguous"] = (Placement.contiguous(layers, experts, gpus, nodes, redundant).phy2log, 0.0, {})
    start = time.perf_counter()
    out["eplb"] = (eplb_rebalance(loads, physical, 1, nodes, gpus), time.perf_counter() - start, {})
    start = time.perf_counter()
    out["eplb-hier"] = (eplb_rebalance(loads, physical, nodes, nodes, gpus), time.perf_counter() - start, {})
    problem = PlacementProblem(loads, gpus, physical, num_nodes=nodes)
    start = time.perf_counter()
    out["fast"] = (solve(problem, "fast").placement.phy2log, time.perf_counter() - start, {})
    for method, strength, begin in (("time", None, "communities"), ("time-bal", None, "balanced"),
                                    ("grouped", max(STRENGTHS), "communities")):
        start = time.perf_counter()
        result = plan_time(problem, train, model, strength=strength, start=begin)
        extra = {"strength": result.strength, "layers_grouped": sum(x.choice == "grouped" for x in result.layers),
                 "cv_held_out_s": result.cv, "lower_bound_s": sum(x.lower_bound_s for x in result.layers),
                 "predicted_train_s": sum(x.predicted_s for x in result.layers)}
        out[method] = (result.placement.phy2log, time.perf_counter() - start, extra)
    return out


def judge(phy2log: np.ndarray, test: list[np.ndarray], gpus: int, nodes: int, model: CommModel) -> dict:
    """The figures of one plan on the judged batches, summed (or averaged) over layers."""
    costs = [layer_cost(model, [s[:, i, :] for s in test], SlotTable(phy2log[i], gpus, nodes, 128), i)
             for i in range(phy2log.shape[0])]
    nic = min(d["capacity"] for _, _, d in model.topology.graph.edges(data=True) if d["kind"] == "nic")
    rdma = sum(c.rdma_bytes for c in costs)
    mean_nic_s = rdma / gpus / nic
    return {"distinct_nodes_per_token": float(np.mean([c.distinct_nodes_per_token for c in costs])),
            "rdma_gb": rdma / 1e9,
            "busiest_over_mean_gpu_rows": float(np.mean([c.busiest_rows / c.mean_rows for c in costs])),
            "busiest_over_mean_nic": sum(c.dispatch_s for c in costs) / mean_nic_s if mean_nic_s else 0.0,
            **{part: sum(getattr(c, part) for c in costs) for part in PARTS},
            "layer_time_s": sum(c.layer_time_s for c in costs)}


def run(steps: list[np.ndarray], layers: list[int]) -> list[dict]:
    rows = []
    steps = [s[:, layers, :].astype(np.int64) for s in steps]
    for gpus, nodes, redundant in CASES:
        model = CommModel(default_topology(gpus, nodes), get_model("Qwen3-30B-A3B"))
        samples = [("in", list(range(3)), list(range(3)))] + [(f"hold {k}", [i for i in range(3) if i != k], [k])
                                                              for k in range(3)]
        for sample, train_ids, test_ids in samples:
            made = plans([steps[i] for i in train_ids], gpus, nodes, redundant, model)
            for method in METHODS:
                phy2log, plan_s, extra = made[method]
                figures = judge(phy2log, [steps[i] for i in test_ids], gpus, nodes, model)
                rows.append({"ep": gpus, "nodes": nodes, "redundant": redundant, "sample": sample, "method": method,
                             "layers": len(layers), "plan_s": plan_s, **figures, **extra})
                print(f"EP{gpus}+{redundant} {sample:<6} {method:<10} {figures['layer_time_s'] * 1e3:8.4f} ms "
                      f"(plan {plan_s:.1f} s)", file=sys.stderr)
    return rows


def verdicts(rows: list[dict]) -> list[dict]:
    """Per case: time vs the best baseline and vs eplb's RDMA in sample; mean over folds out of sample."""
    out = []
    for gpus, nodes, redundant in CASES:
        case = [r for r in rows if (r["ep"], r["redundant"]) == (gpus, redundant)]

        def get(sample, method):
            return next(r for r in case if r["sample"] == sample and r["method"] == method)

        best_in = min(get("in", m)["layer_time_s"] for m in BASELINES)
        folds = sorted({r["sample"] for r in case if r["sample"] != "in"})
        gains = [get(f, "time")["layer_time_s"] / min(get(f, m)["layer_time_s"] for m in BASELINES) - 1 for f in folds]
        vs_fast = [get(f, "time")["layer_time_s"] / get(f, "fast")["layer_time_s"] - 1 for f in folds]
        out.append({"ep": gpus, "redundant": redundant,
                    "in_sample_time_vs_best": get("in", "time")["layer_time_s"] / best_in - 1,
                    "in_sample_rdma_vs_eplb": get("in", "time")["rdma_gb"] / get("in", "eplb")["rdma_gb"] - 1,
                    "in_sample_grouped_vs_best": get("in", "grouped")["layer_time_s"] / best_in - 1,
                    "in_sample_grouped_rdma_vs_eplb": get("in", "grouped")["rdma_gb"] / get("in", "eplb")["rdma_gb"] - 1,
                    "held_out_time_vs_best_mean": float(np.mean(gains)),
                    "held_out_time_vs_fast_worst": float(max(vs_fast)),
                    "held_out_grouped_vs_best_mean": float(np.mean(
                        [get(f, "grouped")["layer_time_s"] / min(get(f, m)["layer_time_s"] for m in BASELINES) - 1
                         for f in folds]))})
    return out


def table(rows: list[dict], summary: list[dict]) -> str:
    lines = [f"{'case':<9} {'sample':<7} {'method':<11} {'nodes/tok':>9} {'RDMA GB':>8} {'GPU b/m':>8} "
             f"{'NIC b/m':>8} {'dispatch':>9} {'compute':>8} {'combine':>8} {'layer ms':>9} {'vs best':>8}"]
    for r in rows:
        same = [x for x in rows if (x["ep"], x["redundant"], x["sample"]) == (r["ep"], r["redundant"], r["sample"])]
        best = min(x["layer_time_s"] for x in same if x["method"] in BASELINES)
        lines.append(f"EP{r['ep']}+{r['redundant']:<4} {r['sample']:<7} {r['method']:<11} "
                     f"{r['distinct_nodes_per_token']:>9.3f} {r['rdma_gb']:>8.3f} {r['busiest_over_mean_gpu_rows']:>8.3f} "
                     f"{r['busiest_over_mean_nic']:>8.3f} {r['dispatch_s'] * 1e3:>9.4f} {r['compute_s'] * 1e3:>8.4f} "
                     f"{r['combine_s'] * 1e3:>8.4f} {r['layer_time_s'] * 1e3:>9.4f} {r['layer_time_s'] / best - 1:>+8.1%}")
    lines.append("")
    for v in summary:
        lines.append(f"EP{v['ep']}+{v['redundant']}: in sample time {v['in_sample_time_vs_best']:+.1%} vs best "
                     f"(target <= -15%), RDMA {v['in_sample_rdma_vs_eplb']:+.1%} vs eplb (target <= -30%); "
                     f"grouped {v['in_sample_grouped_vs_best']:+.1%} / RDMA {v['in_sample_grouped_rdma_vs_eplb']:+.1%}; "
                     f"held out mean {v['held_out_time_vs_best_mean']:+.1%} vs best (target <= -5%), worst fold vs fast "
                     f"{v['held_out_time_vs_fast_worst']:+.1%} (target <= 0); grouped held out "
                     f"{v['held_out_grouped_vs_best_mean']:+.1%}")
    return "\n".join(lines)


def plan_time_cli(trace: str, redundant: int, time_limit: float) -> dict:
    """Wall seconds of `moe-place plan TRACE --gpus 32 --nodes 4 --redundant R --objective time --time-limit S`
    (48 layers, what a user runs: trace loading, plan, report and plan file included)."""
    command = ["moe-place", "plan", trace, "--gpus", "32", "--nodes", "4", "--redundant", str(redundant),
               "--objective", "time", "--time-limit", f"{time_limit:g}", "--no-progress"]
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        done = subprocess.run(command + ["--out", os.path.join(tmp, "plan.json")], capture_output=True, text=True)
        wall = time.perf_counter() - start
    notes = [line for line in done.stderr.splitlines() if "note" in line]
    return {"command": " ".join(command[:2] + ["TRACE"] + command[3:]), "exit_code": done.returncode,
            "wall_s": wall, "notes": notes, "cores": os.cpu_count()}


def plot_png(rows: list[dict]) -> bytes:
    """Layer time stacked by dispatch / compute / combine, per method, for every case and sample."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    samples = ["in", "hold 0", "hold 1", "hold 2"]
    fig = Figure(figsize=(16, 9), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(CASES), len(samples), sharey="row", squeeze=False)
    colors = {"dispatch_s": "#4c72b0", "compute_s": "#dd8452", "combine_s": "#55a868"}
    for r_i, (gpus, _, redundant) in enumerate(CASES):
        for c_i, sample in enumerate(samples):
            ax = axes[r_i][c_i]
            chosen = [r for r in rows if (r["ep"], r["redundant"], r["sample"]) == (gpus, redundant, sample)]
            batches = 3 if sample == "in" else 1
            x = np.arange(len(chosen))
            bottom = np.zeros(len(chosen))
            for part in PARTS:
                values = np.array([r[part] for r in chosen]) * 1e3 / batches
                ax.bar(x, values, bottom=bottom, color=colors[part], label=part[:-2] if (r_i, c_i) == (0, 0) else None)
                bottom += values
            ax.set_xticks(x, [r["method"] for r in chosen], rotation=35, ha="right", fontsize=8)
            ax.set_title(f"EP{gpus}+{redundant}, {sample}", fontsize=10)
            if c_i == 0:
                ax.set_ylabel(f"ms per batch, {rows[0]['layers']} layers")
    fig.legend(loc="outside lower center", ncols=3)
    fig.suptitle("Qwen3-30B-A3B (3 real batches): predicted MoE layer time by method, DeepEP dispatch, "
                 "SGLang static replica choice", fontsize=12, fontweight="bold")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=48, help="layers, evenly spaced (default all 48)")
    parser.add_argument("--output-json", metavar="FILE")
    parser.add_argument("--plot", metavar="PNG")
    parser.add_argument("--no-cli-timing", action="store_true", help="skip timing `moe-place plan` end to end")
    parser.add_argument("--timing-only", action="store_true", help="only time `moe-place plan` end to end")
    args = parser.parse_args(argv)
    path = str(bundled_path("qwen3-30b-a3b_prefill_topk.npz"))
    if args.timing_only:
        timing = [plan_time_cli(path, redundant, 60.0) for redundant in (0, 32)]
        for t in timing:
            print(f"plan time: {t['command']}: {t['wall_s']:.1f} s on {t['cores']} cores (exit {t['exit_code']})"
                  f"{'; ' + '; '.join(t['notes']) if t['notes'] else ''}")
        if args.output_json:
            write_json_atomic(args.output_json, {"plan_time": timing})
        return 0
    trace = load_trace(path)
    layers = list(range(0, trace.num_layers, max(1, trace.num_layers // args.layers)))[:args.layers]
    rows = run(list(trace.topk_ids), layers)
    summary = verdicts(rows)
    print(table(rows, summary))
    timing = [] if args.no_cli_timing else [plan_time_cli(path, redundant, 60.0) for redundant in (0, 32)]
    for t in timing:
        print(f"plan time: {t['command']}: {t['wall_s']:.1f} s on {t['cores']} cores (exit {t['exit_code']})"
              f"{'; ' + '; '.join(t['notes']) if t['notes'] else ''}")
    if args.output_json:
        write_json_atomic(args.output_json, {"layers": layers, "rows": rows, "verdicts": summary,
                                             "plan_time": timing})
    if args.plot:
        write_atomic(args.plot, plot_png(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
