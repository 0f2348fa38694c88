"""Does planning for the layer time pay at multi-node EP, and does it hold on every part of the model?
Predicted MoE layer time (dispatch + compute + combine, `moe_place.cost.comm`) of the bundled real
Qwen3-30B-A3B trace, in and out of sample.

Cases: EP32 on 4 nodes x 8 H100 with R = 0 and R = 32 redundant experts, EP64 on 8 x 8 with
R = 64; the default model of `moe-place plan --objective time` (DeepEP dispatch, SGLang's static
replica choice, tokens in blocks, NVLink 450 GB/s, one 400 Gbit/s NIC per GPU, weights read once).
Samples: `in` (plan on the three recorded batches, judge on the same three) and leave-one-batch-out
`hold k` (plan on the two others, judge on batch k; the planner never sees batch k). Methods:
- `contiguous`: the engines' default placement (redundant slots wrap around to experts 0, 1, ...);
- `eplb`: DeepSeek EPLB's global policy (the hierarchical one needs expert groups; Qwen3 has none);
- `eplb-hier`: EPLB's hierarchical policy with one expert group per node (contiguous blocks of E/N);
- `fast`: our balance-only plan (`--objective balance --solver fast`);
- `time`: `--objective time` (`moe_place.solvers.comm.plan_time`: nodes from Louvain communities
  of the networkx co-activation graph held to the balance-only plan's node loads, co-activated
  experts spread over a node's GPUs, a layer grouped only if its dispatch + combine save more
  than `MIN_SAVING` (5%) of the balance-only plan's layer time on every held-out window of the
  training batches);
- `time-layer`: the same with the guard judging the whole layer time on the windows, compute too;
- `time-bal`: the same from the grouping-free balanced node split instead of the communities;
- `ungated`: `time`'s plan on every layer, without the guard (`strength=0`);
- `grouped`: every layer grouped at the largest strength of the search, no guard: what grouping for
  the training tokens does when nothing holds it back.
Columns: distinct nodes per token, RDMA GB (dispatch phase), busiest/mean GPU rows (per step,
averaged), busiest/mean NIC (dispatch time over the time the mean NIC needs), predicted layer time
(ms, summed over the layers and the judged batches) and its dispatch/compute/combine parts.
Subsets: `SUBSETS` seeded random sets of `SUBSET_LAYERS` layers; for each and each held-out batch,
a method's layer time over fast's, summed over the subset's layers (every plan here is made layer
by layer: `check_subsets` plans some subsets alone and checks the rows are the whole model's).
Targets (issue): held out, `time`/`fast` at most 1.00 on 95% of the subset-fold pairs and at most
1.01 on every pair; over all layers, the mean over folds at most 0.97 at EP32+32 and 0.95 at
EP64+64. `eplb`/`fast` over the same pairs is the chance between two balance-only plans. A missed
target is named on stderr and the script exits 1 (`--timing-only` has no targets).
What the windows say: does the guard's evidence (each layer planned on one training batch, judged
on the other) predict the held-out batch? The correlation of the windows' compute and traffic
differences with the held-out ones, and the frontier of the guard's bar (`SAVING_LEVELS`).
Plan time of 48 layers at EP32 on 2 cores: `moe-place plan` timed end to end.

    python bench/bench_comm.py [--layers 48] [--out bench/results/comm.json] [--plot bench/results/comm.png] [--force]
    python bench/bench_comm.py --timing-only [--output-json FILE]   # just the end-to-end plan times
"""

from __future__ import annotations

import argparse
import io
import itertools
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from moe_place.cli.options import add_record_options, refuse_overwrite
from moe_place.cli.output import missed_targets
from moe_place.cost.comm import CommModel, SlotTable, default_topology, layer_cost
from moe_place.cost.models import get_model
from moe_place.io import write_atomic, write_json_atomic
from moe_place.placement import Placement
from moe_place.problem import PlacementProblem
from moe_place.solvers import solve
from moe_place.solvers.comm import GROUP_STRENGTH, MIN_SAVING, STRENGTHS, HeldOut, guard, plan_time
from moe_place.solvers.deepseek import eplb_rebalance
from moe_place.traces.bundled import bundled_path
from moe_place.traces.load import load_trace

CASES = ((32, 4, 0), (32, 4, 32), (64, 8, 64))
METHODS = ("contiguous", "eplb", "eplb-hier", "fast", "time", "time-layer", "time-bal", "ungated", "grouped")
BASELINES = ("contiguous", "eplb", "fast")   # the "best of"
PARTS = ("dispatch_s", "compute_s", "combine_s")
SUBSETS, SUBSET_LAYERS, SUBSET_SEED = 50, 4, 0
SUBSET_METHODS = ("time", "time-layer", "ungated", "grouped", "eplb")   # each over fast, per subset and fold
CHECKED_SUBSETS = 2                                        # per case and sample: planned alone, rows compared
MEAN_TARGETS = {(32, 32): 0.97, (64, 64): 0.95}            # time/fast over all layers, mean over folds
SAVING_LEVELS = (0.0, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06)   # the guard's bar (`min_saving`) the frontier tries


def plans(train: list[np.ndarray], gpus: int, nodes: int, redundant: int, model: CommModel,
          layer_ids: list[int]) -> dict:
    """{method: (phy2log [L, P], plan seconds, extra)} for one case and training sample (layers: the model's
    `layer_ids`)."""
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
    problem = PlacementProblem(loads, gpus, physical, num_nodes=nodes, layer_ids=tuple(layer_ids))
    start = time.perf_counter()
    out["fast"] = (solve(problem, "fast").placement.phy2log, time.perf_counter() - start, {})
    results = {}
    for method, strength, begin in (("time", None, "communities"), ("time-bal", None, "balanced"),
                                    ("ungated", GROUP_STRENGTH, "communities"),
                                    ("grouped", max(STRENGTHS), "communities")):
        start = time.perf_counter()
        results[method] = result = plan_time(problem, train, model, strength=strength, start=begin)
        extra = {"strength": result.strength, "layers_grouped": sum(x.choice == "grouped" for x in result.layers),
                 # the guard's evidence per layer and window: grouped and balance-only dispatch + combine, compute
                 "windows": [[[g.comm_s, g.compute_s, b.comm_s, b.compute_s]
                              for g, b in zip(x.windows, x.balance_windows)] for x in result.layers],
                 "cv_held_out_s": result.cv, "lower_bound_s": sum(x.lower_bound_s for x in result.layers),
                 "predicted_train_s": sum(x.predicted_s for x in result.layers)}
        out[method] = (result.placement.phy2log, time.perf_counter() - start, extra)
    # time's grouped layers are ungated's rows, the others fast's (each layer is planned alone), so judging
    # the whole layer time on the same windows instead of dispatch + combine picks among the same rows
    for i, layer in enumerate(results["time"].layers):
        assert np.array_equal(layer.phy2log, out["ungated" if layer.choice == "grouped" else "fast"][0][i])
    judged = [guard(layer.windows, layer.balance_windows, judge="layer") for layer in results["time"].layers]
    rows = np.stack([out["ungated" if judged[i] else "fast"][0][i] for i in range(layers)])
    out["time-layer"] = (rows, out["time"][1], {"layers_grouped": int(sum(judged))})
    return out


def judge(phy2log: np.ndarray, test: list[np.ndarray], gpus: int, nodes: int, model: CommModel,
          layer_ids: list[int]) -> dict:
    """The figures of one plan on the judged batches, summed (or averaged) over layers (each seeded by its
    id in the model, as `moe-place evaluate` does)."""
    costs = [layer_cost(model, [s[:, i, :] for s in test], SlotTable(phy2log[i], gpus, nodes, 128), layer_ids[i])
             for i in range(phy2log.shape[0])]
    nic = min(d["capacity"] for _, _, d in model.topology.graph.edges(data=True) if d["kind"] == "nic")
    rdma = sum(c.rdma_bytes for c in costs)
    mean_nic_s = rdma / gpus / nic
    return {"distinct_nodes_per_token": float(np.mean([c.distinct_nodes_per_token for c in costs])),
            "rdma_gb": rdma / 1e9,
            "busiest_over_mean_gpu_rows": float(np.mean([c.busiest_rows / c.mean_rows for c in costs])),
            "busiest_over_mean_nic": sum(c.dispatch_s for c in costs) / mean_nic_s if mean_nic_s else 0.0,
            **{part: sum(getattr(c, part) for c in costs) for part in PARTS},
            "layer_time_s": sum(c.layer_time_s for c in costs),
            "layer_times_s": [c.layer_time_s for c in costs],
            "layer_comm_s": [c.dispatch_s + c.combine_s for c in costs],
            "layer_compute_s": [c.compute_s for c in costs]}


def subset_list(num_layers: int) -> list[list[int]]:
    """The seeded random subsets: `SUBSETS` sets of `SUBSET_LAYERS` distinct positions in the layers run
    (all of them when fewer are run)."""
    rng = np.random.default_rng(SUBSET_SEED)
    size = min(SUBSET_LAYERS, num_layers)
    return [sorted(int(x) for x in rng.choice(num_layers, size, replace=False)) for _ in range(SUBSETS)]


def check_subsets(train: list[np.ndarray], made: dict, gpus: int, nodes: int, redundant: int,
                  model: CommModel, layer_ids: list[int]) -> list[dict]:
    """Plan the first `CHECKED_SUBSETS` subsets alone (`time` and `fast` on those layers' tokens only) and
    compare their rows with the whole model's: the subset figures are then what planning the subset gives."""
    out = []
    for subset in subset_list(train[0].shape[1])[:CHECKED_SUBSETS]:
        part = [s[:, subset, :] for s in train]
        loads = np.stack([sum(np.bincount(s[:, i, :].ravel(), minlength=128) for s in part)
                          for i in range(len(subset))]).astype(np.float64)
        problem = PlacementProblem(loads, gpus, 128 + redundant, num_nodes=nodes,
                                   layer_ids=tuple(layer_ids[i] for i in subset))
        same = {"time": np.array_equal(plan_time(problem, part, model).placement.phy2log, made["time"][0][subset]),
                "fast": np.array_equal(solve(problem, "fast").placement.phy2log, made["fast"][0][subset])}
        out.append({"layers": [layer_ids[i] for i in subset], **same})
    return out


def run(steps: list[np.ndarray], layers: list[int]) -> tuple[list[dict], list[dict]]:
    """(rows: one per case, sample and method; checks: `check_subsets` per case and held-out sample)."""
    rows, checks = [], []
    steps = [s[:, layers, :].astype(np.int64) for s in steps]
    for gpus, nodes, redundant in CASES:
        model = CommModel(default_topology(gpus, nodes), get_model("Qwen3-30B-A3B"))
        samples = [("in", list(range(3)), list(range(3)))] + [(f"hold {k}", [i for i in range(3) if i != k], [k])
                                                              for k in range(3)]
        for sample, train_ids, test_ids in samples:
            made = plans([steps[i] for i in train_ids], gpus, nodes, redundant, model, layers)
            if sample != "in":
                checks += [{"ep": gpus, "redundant": redundant, "sample": sample, **c}
                           for c in check_subsets([steps[i] for i in train_ids], made, gpus, nodes, redundant, model,
                                                  layers)]
            for method in METHODS:
                phy2log, plan_s, extra = made[method]
                figures = judge(phy2log, [steps[i] for i in test_ids], gpus, nodes, model, layers)
                rows.append({"ep": gpus, "nodes": nodes, "redundant": redundant, "sample": sample, "method": method,
                             "layers": len(layers), "plan_s": plan_s, **figures, **extra})
                print(f"EP{gpus}+{redundant} {sample:<6} {method:<10} {figures['layer_time_s'] * 1e3:8.4f} ms "
                      f"(plan {plan_s:.1f} s)", file=sys.stderr)
    return rows, checks


def row_of(rows: list[dict], gpus: int, redundant: int, sample: str, method: str) -> dict:
    """The row of one case, sample and method."""
    return next(r for r in rows if (r["ep"], r["redundant"], r["sample"], r["method"]) == (gpus, redundant, sample,
                                                                                          method))


def held_out_folds(rows: list[dict], gpus: int, redundant: int) -> list[str]:
    """The held-out samples of one case (`hold k`), sorted."""
    return sorted({r["sample"] for r in rows if (r["ep"], r["redundant"]) == (gpus, redundant) and r["sample"] != "in"})


def summed_ratios(times: np.ndarray, base: np.ndarray, sets: np.ndarray) -> np.ndarray:
    """float64 `[sets]`: per-layer `times` over `base`, each summed over a set of layer positions (`sets`, int
    `[count, size]`)."""
    return times[sets].sum(axis=1) / base[sets].sum(axis=1)


def held_out_ratios(rows: list[dict], gpus: int, redundant: int, method: str, sets: np.ndarray) -> np.ndarray:
    """float64 `[folds * sets]`: `method`/fast on the held-out batch, summed over each set's layers, fold by fold."""
    return np.concatenate([summed_ratios(np.array(row_of(rows, gpus, redundant, f, method)["layer_times_s"]),
                                         np.array(row_of(rows, gpus, redundant, f, "fast")["layer_times_s"]), sets)
                           for f in held_out_folds(rows, gpus, redundant)])


def subset_ratios(rows: list[dict], gpus: int, redundant: int, method: str) -> np.ndarray:
    """float64 `[folds * SUBSETS]`: `method`/fast on the held-out batch, summed over each seeded subset's layers."""
    return held_out_ratios(rows, gpus, redundant, method, np.array(subset_list(rows[0]["layers"])))


def every_subset_figures(rows: list[dict], gpus: int, redundant: int, method: str) -> dict:
    """`method`/fast on the held-out batch over every set of `SUBSET_LAYERS` layers x every fold (not only the
    seeded sample): the share at most 1.00 and 1.01, and the worst."""
    layers = rows[0]["layers"]
    sets = np.array(list(itertools.combinations(range(layers), min(SUBSET_LAYERS, layers))))
    ratios = held_out_ratios(rows, gpus, redundant, method, sets)
    return {"pairs": int(ratios.size), "at_most_1.00": float(np.mean(ratios <= 1.0)),
            "at_most_1.01": float(np.mean(ratios <= 1.01)), "max": float(ratios.max())}


def subset_figures(rows: list[dict], gpus: int, redundant: int, method: str) -> dict:
    """The statistics of `subset_ratios` the summary reports."""
    ratios = subset_ratios(rows, gpus, redundant, method)
    return {"pairs": int(ratios.size), "at_most_1.00": float(np.mean(ratios <= 1.0)),
            "at_most_1.01": float(np.mean(ratios <= 1.01)), "min": float(ratios.min()),
            "median": float(np.median(ratios)), "q95": float(np.quantile(ratios, 0.95)), "max": float(ratios.max())}


def window_evidence(rows: list[dict], gpus: int, redundant: int) -> dict:
    """What the guard's windows say about the held-out batch, per case (layers x folds): the correlation of
    the windows' compute difference (hedged plan minus balance-only, mean over windows) with the held-out
    one (`ungated` minus `fast`), the same for dispatch + combine, and the held-out compute difference's
    spread over fast's layer time. Then the frontier: the guard at each bar of `SAVING_LEVELS` on the same
    evidence (time's grouped rows are ungated's, so each bar picks, per layer, ungated's or fast's held-out
    figures exactly): mean over folds of time/fast and the subset statistics. And a bound no planner has:
    the same bars on the held-out batch's own dispatch + combine saving (`ungated` against `fast`, over
    fast's layer time), a guard told the traffic of the batch it has not seen but not its compute."""
    folds = held_out_folds(rows, gpus, redundant)

    def get(sample, method):
        return row_of(rows, gpus, redundant, sample, method)

    win_compute, win_comm, held_compute, held_comm, spread = [], [], [], [], []
    for f in folds:
        ung, fast = get(f, "ungated"), get(f, "fast")
        for i, windows in enumerate(get(f, "time")["windows"]):
            w = np.array(windows)
            win_compute.append(float(np.mean(w[:, 1] - w[:, 3])))
            win_comm.append(float(np.mean(w[:, 0] - w[:, 2])))
            held_compute.append(ung["layer_compute_s"][i] - fast["layer_compute_s"][i])
            held_comm.append(ung["layer_comm_s"][i] - fast["layer_comm_s"][i])
            spread.append(held_compute[-1] / fast["layer_times_s"][i])

    def point(level: float, told: bool) -> dict:
        means, ratios = [], []
        for f in folds:
            ung, fast = get(f, "ungated"), get(f, "fast")
            ung_s, fast_s = np.array(ung["layer_times_s"]), np.array(fast["layer_times_s"])
            if told:
                picked = (np.array(fast["layer_comm_s"]) - np.array(ung["layer_comm_s"])) / fast_s > level
            else:
                picked = np.array([guard(tuple(HeldOut(g, c) for g, c, _, _ in windows),
                                         tuple(HeldOut(g, c) for _, _, g, c in windows), min_saving=level)
                                   for windows in get(f, "time")["windows"]], dtype=bool)
            times = np.where(picked, ung_s, fast_s)
            means.append(float(times.sum() / fast_s.sum()))
            ratios.append(summed_ratios(times, fast_s, np.array(subset_list(fast_s.size))))
        ratios = np.concatenate(ratios)
        return {"min_saving": level, "mean_over_folds": float(np.mean(means)),
                "subsets_at_most_1.00": float(np.mean(ratios <= 1.0)), "subsets_max": float(ratios.max())}

    return {"corr_compute": float(np.corrcoef(win_compute, held_compute)[0, 1]),
            "corr_comm": float(np.corrcoef(win_comm, held_comm)[0, 1]),
            "held_out_compute_spread": float(np.std(spread)), "held_out_compute_mean": float(np.mean(spread)),
            "frontier": [point(level, False) for level in SAVING_LEVELS],
            "told_traffic": [point(level, True) for level in SAVING_LEVELS]}


def verdicts(rows: list[dict]) -> list[dict]:
    """Per case: time vs the best baseline and vs eplb's RDMA in sample; mean over folds out of sample."""
    out = []
    for gpus, nodes, redundant in CASES:
        def get(sample, method):
            return row_of(rows, gpus, redundant, sample, method)

        best_in = min(get("in", m)["layer_time_s"] for m in BASELINES)
        folds = held_out_folds(rows, gpus, redundant)
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
                         for f in folds])),
                    "held_out_time_over_fast": [get(f, "time")["layer_time_s"] / get(f, "fast")["layer_time_s"]
                                                for f in folds],
                    "held_out_time_over_fast_mean": float(np.mean([get(f, "time")["layer_time_s"]
                                                                   / get(f, "fast")["layer_time_s"] for f in folds])),
                    "layers_grouped": {f: get(f, "time")["layers_grouped"] for f in folds},
                    "subsets": {m: subset_figures(rows, gpus, redundant, m) for m in SUBSET_METHODS},
                    "every_subset": {m: every_subset_figures(rows, gpus, redundant, m) for m in SUBSET_METHODS},
                    "windows": window_evidence(rows, gpus, redundant)})
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


def met(ok: bool) -> str:
    return "met" if ok else "missed"


def held_out_targets(v: dict) -> dict[str, tuple[str, bool]]:
    """This issue's targets for one case of `verdicts`: {name: (what it asks, whether it holds)}."""
    case = f"EP{v['ep']}+{v['redundant']}"
    targets = {}
    mean_target = MEAN_TARGETS.get((v["ep"], v["redundant"]))
    if mean_target is not None:
        mean = v["held_out_time_over_fast_mean"]
        targets["mean"] = (f"{case} held-out time/fast, mean over folds, <= {mean_target:.2f} (got {mean:.4f})",
                           mean <= mean_target)
    f = v["subsets"].get("time")
    if f is not None:
        targets["share"] = (f"{case} time/fast <= 1.00 on 95% of the subset-fold pairs (got "
                            f"{f['at_most_1.00']:.1%})", f["at_most_1.00"] >= 0.95)
        targets["max"] = (f"{case} time/fast <= 1.01 on every subset-fold pair (got a max of {f['max']:.4f})",
                          f["max"] <= 1.01)
    return targets


def subset_table(summary: list[dict], checks: list[dict]) -> str:
    """This issue's targets: time/fast held out, over all layers (per fold) and over the subsets."""
    lines = []
    for v in summary:
        targets = held_out_targets(v)
        mean = v["held_out_time_over_fast_mean"]
        line = (f"EP{v['ep']}+{v['redundant']}: held out time/fast per fold "
                f"{' '.join(f'{x:.4f}' for x in v['held_out_time_over_fast'])}, mean {mean:.4f}")
        if "mean" in targets:
            line += f" (target <= {MEAN_TARGETS[(v['ep'], v['redundant'])]:.2f}: {met(targets['mean'][1])})"
        grouped = v["layers_grouped"]
        lines.append(line + f"; layers grouped {'/'.join(str(grouped[f]) for f in sorted(grouped))}")
        for method, f in v["subsets"].items():
            text = (f"  {method:>8}/fast over {f['pairs']} subset-fold pairs: <= 1.00 on {f['at_most_1.00']:.1%}, "
                    f"<= 1.01 on {f['at_most_1.01']:.1%}; min {f['min']:.4f} median {f['median']:.4f} "
                    f"q95 {f['q95']:.4f} max {f['max']:.4f}")
            if method == "time":
                text += (f" (targets: <= 1.00 on 95%: {met(targets['share'][1])}; "
                         f"<= 1.01 on every pair: {met(targets['max'][1])})")
            lines.append(text)
        for method, f in v["every_subset"].items():
            lines.append(f"  {method:>8}/fast over every {SUBSET_LAYERS}-layer subset x fold ({f['pairs']:,} pairs): "
                         f"<= 1.00 on {f['at_most_1.00']:.1%}, <= 1.01 on {f['at_most_1.01']:.1%}, max {f['max']:.4f}")
    lines.append(f"what the windows say (layers x folds; ungated - fast held out; the guard's bar is {MIN_SAVING:g}):")
    for v in summary:
        w = v["windows"]
        mean_target = MEAN_TARGETS.get((v["ep"], v["redundant"]))
        lines.append(f"  EP{v['ep']}+{v['redundant']}: corr(windows' compute difference, held-out compute difference) "
                     f"{w['corr_compute']:+.2f}, dispatch + combine {w['corr_comm']:+.2f}; held-out compute difference "
                     f"over fast's layer time: mean {w['held_out_compute_mean']:+.4f}, spread {w['held_out_compute_spread']:.4f}")
        for told, points in ((False, w["frontier"]), (True, w["told_traffic"])):
            lines.append("    the guard at each bar, on its windows:" if not told else
                         "    bound: the same bars on the held-out batch's own traffic saving (compute unknown):")
            for p in points:
                lines.append(f"      bar {p['min_saving']:.2f}: mean over folds {p['mean_over_folds']:.4f}"
                             f"{f' (target <= {mean_target:.2f})' if mean_target is not None else ''}, subsets <= 1.00 "
                             f"on {p['subsets_at_most_1.00']:.1%}, max {p['subsets_max']:.4f}")
    for method in ("time", "fast"):
        same = sum(c[method] for c in checks)
        lines.append(f"subsets planned alone ({method}): rows identical to the whole model's on {same} of {len(checks)}")
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


def plot_png(rows: list[dict], summary: list[dict]) -> bytes:
    """Layer time stacked by dispatch / compute / combine, per method, for every case and sample; the subset-fold
    pairs sorted; the guard's bars (mean gain against the share of pairs at most 1.00, on the windows and the
    bound told the held-out traffic)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    samples = ["in", "hold 0", "hold 1", "hold 2"]
    fig = Figure(figsize=(24, 9), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(CASES), len(samples) + 2, squeeze=False)
    for r_i, v in enumerate(summary):   # last column: the guard's bars
        ax = axes[r_i][-1]
        for key, style, label in (("frontier", "o-", "the guard on its windows"),
                                  ("told_traffic", "s--", "bound: told the held-out traffic")):
            points = v["windows"][key]
            x = [p["mean_over_folds"] for p in points]
            y = [p["subsets_at_most_1.00"] for p in points]
            ax.plot(x, y, style, markersize=4, label=label if r_i == 0 else None)
            if key == "frontier":
                for p, a, b in zip(points, x, y):
                    ax.annotate(f"{p['min_saving']:g}", (a, b), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.axhline(0.95, color="black", linewidth=0.8, linestyle=":")
        target = MEAN_TARGETS.get((v["ep"], v["redundant"]))
        if target is not None:
            ax.axvline(target, color="black", linewidth=0.8, linestyle=":")
        ax.set_title(f"EP{v['ep']}+{v['redundant']}: the guard's bar (labels), held out", fontsize=10)
        ax.set_xlabel("time/fast, all layers, mean over folds", fontsize=8)
        ax.set_ylabel("share of subset-fold pairs <= 1.00", fontsize=8)
        if r_i == 0:
            ax.legend(fontsize=8)
    for r_i, (gpus, _, redundant) in enumerate(CASES):   # next to last column: the subsets, sorted
        ax = axes[r_i][-2]
        for method in SUBSET_METHODS:
            ratios = np.sort(subset_ratios(rows, gpus, redundant, method))
            ax.plot(np.arange(1, ratios.size + 1) / ratios.size, ratios, label=f"{method}/fast" if r_i == 0 else None)
        for level in (1.0, 1.01):
            ax.axhline(level, color="black", linewidth=0.8, linestyle=":" if level > 1 else "-")
        ax.set_title(f"EP{gpus}+{redundant}: {SUBSET_LAYERS}-layer subsets x folds, held out", fontsize=10)
        ax.set_xlabel("share of subset-fold pairs", fontsize=8)
        if r_i == 0:
            ax.legend(fontsize=8)
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
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="outside lower center", ncols=3)
    fig.suptitle("Qwen3-30B-A3B (3 real batches): predicted MoE layer time by method, DeepEP dispatch, "
                 "SGLang static replica choice", fontsize=12, fontweight="bold")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=48, help="layers, evenly spaced (default all 48)")
    add_record_options(parser, plot=True, committed=("bench/results/comm.json", "bench/results/comm.png"))
    parser.add_argument("--no-cli-timing", action="store_true", help="skip timing `moe-place plan` end to end")
    parser.add_argument("--timing-only", action="store_true", help="only time `moe-place plan` end to end")
    args = parser.parse_args(argv)
    refuse_overwrite(parser, args)
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
    rows, checks = run(list(trace.topk_ids), layers)
    summary = verdicts(rows)
    print(table(rows, summary))
    print(subset_table(summary, checks))
    timing = [] if args.no_cli_timing else [plan_time_cli(path, redundant, 60.0) for redundant in (0, 32)]
    for t in timing:
        print(f"plan time: {t['command']}: {t['wall_s']:.1f} s on {t['cores']} cores (exit {t['exit_code']})"
              f"{'; ' + '; '.join(t['notes']) if t['notes'] else ''}")
    if args.output_json:
        write_json_atomic(args.output_json, {"layers": layers, "rows": rows, "verdicts": summary,
                                             "subsets": {"count": SUBSETS, "layers": SUBSET_LAYERS, "seed": SUBSET_SEED,
                                                         "positions": subset_list(len(layers)),
                                                         "checked_alone": checks},
                                             "plan_time": timing})
    if args.plot:
        write_atomic(args.plot, plot_png(rows, summary))
    missed = [what for v in summary for what, held in held_out_targets(v).values() if not held]
    return missed_targets("bench_comm", missed)


if __name__ == "__main__":
    sys.exit(main())
