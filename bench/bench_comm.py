"""Does planning for the layer time pay at multi-node EP, on the whole model a user runs? Predicted MoE
layer time (dispatch + compute + combine, `moe_place.cost.comm`) of the bundled real Qwen3-30B-A3B trace
held out, and of seeded synthetic traces whose co-activation structure and drift are known.

Real trace. Cases: EP32 on 4 nodes x 8 H100 with R = 0 and R = 32 redundant experts, EP64 on 8 x 8
with R = 64; the default model of `moe-place plan --objective time` (DeepEP dispatch, SGLang's static
replica choice, tokens in blocks, NVLink 450 GB/s, one 400 Gbit/s NIC per GPU, the expert time of formula 11: the
one model every command prices with, docs/MODEL.md).
Samples: `in` (plan on the three recorded batches, judge on the same three) and leave-one-batch-out
`hold k` (plan on the two others, judge on batch k; the planner never sees batch k). Methods:
- `contiguous`: the engines' default placement (redundant slots wrap around to experts 0, 1, ...);
- `eplb`: DeepSeek EPLB's global policy (the hierarchical one needs expert groups; Qwen3 has none);
- `eplb-hier`: EPLB's hierarchical policy with one expert group per node (contiguous blocks of E/N);
- `fast`: our balance-only plan (`--objective balance --solver fast`);
- `time`: `--objective time` (`moe_place.solvers.comm.plan_time`, the default decision: a layer is
  grouped where its expected saving, estimated from the held-out windows of the training batches
  over all the layers, is positive);
- `time-guard`: `--objective time --time-guard 0.05` (the per-layer guard: grouped only where the
  dispatch + combine save more than 5% of the layer time on every window);
- `time-layer`: the guard at 5% judging the whole layer time on the windows, compute too;
- `time-bal`: `time` from the grouping-free balanced node split instead of the communities;
- `ungated`: `time`'s grouped plan on every layer (`strength=0`);
- `grouped`: every layer grouped at the largest strength of the search, no decision.
`time`, `time-guard`, `time-layer` and `ungated` choose per layer between the same two rows
(`ungated`'s and `fast`'s; checked), so `hindsight`, the better of the two on the held-out batch layer
by layer, is what a decision could get at most.
First: whole model (all layers summed), held out, each method's layer time over `fast`'s, per fold
and the mean: what a user pays (targets: mean <= 0.97 at EP32+0 and EP32+32, <= 0.93 at EP64+64;
never above 1.00 on a fold). After it: the per-layer ratios' spread; seeded random subsets of
`SUBSET_LAYERS` layers and every such subset (the chance a part of the model loses, which two
balance-only plans, `eplb` and `fast`, already show); what the windows say (their compute and traffic
differences against the held-out ones) and the guard at each bar (`SAVING_LEVELS`): what it costs.
Synthetic test bed (`BED`, `coactivation_trace`): 16 layers (cohesion 0.9, 0.6, 0.3, 0: four each; at
cohesion 0 nothing fires together, so grouping cannot pay), 64 experts in 8 clusters, top-4, 1024
tokens per step, EP16 on 4 nodes with R = 0 and 16, a stationary drift of the topic mix and the hot
experts over a grid of spreads and persistences (`BED_DRIFTS`, one seed each); plan on the first 12
steps, judge on the next 24. The known best node split is the clusters; `hindsight` as above, judged
on the 24 steps (targets: `time` never above 1.00 of `fast`, at least 80% of `hindsight`'s gain over
the runs). A stress case where the 8 training steps do not span the drift (persistence 8) is
reported apart: no rule on these windows can see it.
Plan time: `moe-place plan` end to end, EP32 (R = 0, 32) and EP64+64, wall and CPU seconds.
Exit 1 when a target is missed (the last line says which).

    python bench/bench_comm.py --out bench/results/comm.json --plot bench/results/comm.png --no-cli-timing --force
    python bench/bench_comm.py --timing-only --out bench/results/comm_plan_time.json --force
    python bench/bench_comm.py --table bench/results/comm.json      # the results table of docs/multinode.md
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

from moe_place.cost.cluster import cluster_topology
from moe_place.cost.comm import CommModel, layer_cost
from moe_place.cost.replicas import SlotTable
from moe_place.cost.models import get_model
from moe_place.io import write_atomic
from moe_place.placement import Placement
from moe_place.plotting import new_figure, png_bytes
from moe_place.problem import PlacementProblem
from moe_place.solvers import solve
from moe_place.solvers.comm import GROUP_STRENGTH, MIN_SAVING, STRENGTHS, HeldOut, guard, plan_time
from moe_place.solvers.deepseek import eplb_rebalance
from moe_place.traces.bundled import bundled_path
from moe_place.traces.load import load_trace
from moe_place.traces.synthetic import coactivation_trace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from records import add_record_options, missed_targets, refuse_overwrite, write_record  # noqa: E402

CASES = ((32, 4, 0), (32, 4, 32), (64, 8, 64))
METHODS = ("contiguous", "eplb", "eplb-hier", "fast", "time", "time-guard", "time-layer", "time-bal", "ungated",
           "grouped")
BASELINES = ("contiguous", "eplb", "fast")   # the "best of" the in-sample lines compare with
PARTS = ("dispatch_s", "compute_s", "combine_s")
WHOLE_METHODS = ("time", "time-guard", "ungated", "hindsight", "eplb")   # the whole-model table, each over fast
TARGETS = {(32, 0): 0.97, (32, 32): 0.97, (64, 64): 0.93}                # time/fast, all layers, mean over folds
SUBSETS, SUBSET_LAYERS, SUBSET_SEED = 50, 4, 0
SUBSET_METHODS = ("time", "time-guard", "ungated", "eplb")               # each over fast, per subset and fold
CHECKED_SUBSETS = 2                                        # per case and sample: planned alone, rows compared
SAVING_LEVELS = (0.0, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06)   # the guard's bars (`--time-guard`) the frontier tries
# the synthetic test bed: its fixed shape, the layers' cohesion, the drift grid, the stress case
BED = {"experts": 128, "top_k": 8, "clusters": 8, "gpus": 32, "nodes": 4, "tokens_per_step": 2048,
       "train_steps": 12, "test_steps": 24, "model": "Qwen3-30B-A3B"}
BED_COHESION = (0.9,) * 4 + (0.6,) * 4 + (0.3,) * 4 + (0.0,) * 4
BED_REDUNDANT = (0, 32)
BED_DRIFTS = tuple(itertools.product((1.0, 2.0), (1.0, 4.0), (0.5, 1.0)))   # (topic spread, persistence, skew)
BED_STRESS = {"train_steps": 8, "persistence": 8.0, "spreads": (1.0, 2.0), "skew": 0.5}
BED_TARGET_SHARE = 0.8                                     # of hindsight's gain, over the runs


# ---------------------------------------------------------------------- the real trace
def plans(train: list[np.ndarray], gpus: int, nodes: int, redundant: int, model: CommModel,
          layer_ids: list[int]) -> dict:
    """{method: (phy2log [L, P], plan seconds, extra)} for one case and training sample (layers: the model's
    `layer_ids`)."""
    layers, experts = train[0].shape[1], 128
    loads = np.stack([sum(np.bincount(s[:, i, :].ravel(), minlength=experts) for s in train)
                      for i in range(layers)]).astype(np.float64)
    physical = experts + redundant
    out = {"contiguous": (Placement.contiguous(layers, experts, gpus, nodes, redundant).phy2log, 0.0, {})}
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
                 # the windows' evidence per layer and window: grouped and balance-only dispatch + combine, compute
                 "windows": [[[g.comm_s, g.compute_s, b.comm_s, b.compute_s]
                              for g, b in zip(x.windows, x.balance_windows)] for x in result.layers],
                 "expected_saving": [x.expected_saving for x in result.layers],
                 "pooled": {part: pool.to_dict() for part, pool in result.pooled.items()},
                 "cv_held_out_s": result.cv, "lower_bound_s": sum(x.lower_bound_s for x in result.layers),
                 "predicted_train_s": sum(x.predicted_s for x in result.layers)}
        out[method] = (result.placement.phy2log, time.perf_counter() - start, extra)
    # time's grouped layers are ungated's rows, the others fast's (each layer's rows come from its own tokens),
    # so the guard on the same windows picks among the same rows: judged from them, not planned again
    for i, layer in enumerate(results["time"].layers):
        assert np.array_equal(layer.phy2log, out["ungated" if layer.choice == "grouped" else "fast"][0][i])
    for method, judge_by in (("time-guard", "comm"), ("time-layer", "layer")):
        picked = [guard(x.windows, x.balance_windows, judge_by, MIN_SAVING) for x in results["time"].layers]
        rows = np.stack([out["ungated" if picked[i] else "fast"][0][i] for i in range(layers)])
        out[method] = (rows, out["time"][1], {"layers_grouped": int(sum(picked))})
    return out


def judge(phy2log: np.ndarray, test: list[np.ndarray], gpus: int, nodes: int, model: CommModel,
          layer_ids: list[int], experts: int = 128) -> dict:
    """The figures of one plan on the judged batches, summed (or averaged) over layers (each seeded by its
    id in the model, as `moe-place evaluate` does)."""
    costs = [layer_cost(model, [s[:, i, :] for s in test], SlotTable(phy2log[i], gpus, nodes, experts), layer_ids[i])
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
            "layer_nodes_per_token": [c.distinct_nodes_per_token for c in costs],
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
    """Plan the first `CHECKED_SUBSETS` subsets alone and compare their rows with the whole model's: the
    per-layer rows (`ungated`), the per-layer guard (`time-guard`) and `fast` depend on a layer's tokens
    only. (`time`'s decision pools the planned layers' windows: a subset alone pools fewer.)"""
    out = []
    for subset in subset_list(train[0].shape[1])[:CHECKED_SUBSETS]:
        part = [s[:, subset, :] for s in train]
        loads = np.stack([sum(np.bincount(s[:, i, :].ravel(), minlength=128) for s in part)
                          for i in range(len(subset))]).astype(np.float64)
        problem = PlacementProblem(loads, gpus, 128 + redundant, num_nodes=nodes,
                                   layer_ids=tuple(layer_ids[i] for i in subset))
        alone = {"ungated": plan_time(problem, part, model, strength=GROUP_STRENGTH).placement.phy2log,
                 "time-guard": plan_time(problem, part, model, decision="guard").placement.phy2log,
                 "fast": solve(problem, "fast").placement.phy2log}
        out.append({"layers": [layer_ids[i] for i in subset],
                    **{m: bool(np.array_equal(rows, made[m][0][subset])) for m, rows in alone.items()}})
    return out


def run(steps: list[np.ndarray], layers: list[int]) -> tuple[list[dict], list[dict]]:
    """(rows: one per case, sample and method; checks: `check_subsets` per case and held-out sample)."""
    rows, checks = [], []
    steps = [s[:, layers, :].astype(np.int64) for s in steps]
    for gpus, nodes, redundant in CASES:
        model = CommModel(cluster_topology(gpus, nodes), get_model("Qwen3-30B-A3B"))
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


def layer_times(rows: list[dict], gpus: int, redundant: int, fold: str, method: str) -> np.ndarray:
    """float64 `[L]`: a method's held-out layer times on one fold; `hindsight`: per layer the better of `ungated`
    and `fast` there (the best a decision between those rows could do, knowing the held-out batch)."""
    if method == "hindsight":
        return np.minimum(layer_times(rows, gpus, redundant, fold, "ungated"),
                          layer_times(rows, gpus, redundant, fold, "fast"))
    return np.array(row_of(rows, gpus, redundant, fold, method)["layer_times_s"])


def summed_ratios(times: np.ndarray, base: np.ndarray, sets: np.ndarray) -> np.ndarray:
    """float64 `[sets]`: per-layer `times` over `base`, each summed over a set of layer positions (`sets`, int
    `[count, size]`)."""
    return times[sets].sum(axis=1) / base[sets].sum(axis=1)


def held_out_ratios(rows: list[dict], gpus: int, redundant: int, method: str, sets: np.ndarray) -> np.ndarray:
    """float64 `[folds * sets]`: `method`/fast on the held-out batch, summed over each set's layers, fold by fold."""
    return np.concatenate([summed_ratios(layer_times(rows, gpus, redundant, f, method),
                                         layer_times(rows, gpus, redundant, f, "fast"), sets)
                           for f in held_out_folds(rows, gpus, redundant)])


def whole_model(rows: list[dict], gpus: int, redundant: int, method: str) -> list[float]:
    """Per fold, `method`/fast on the held-out batch over all the layers: what a user pays."""
    everything = np.arange(rows[0]["layers"])[None, :]
    return held_out_ratios(rows, gpus, redundant, method, everything).tolist()


def ratio_stats(ratios: np.ndarray) -> dict:
    return {"pairs": int(ratios.size), "at_most_1.00": float(np.mean(ratios <= 1.0)),
            "at_most_1.01": float(np.mean(ratios <= 1.01)), "min": float(ratios.min()),
            "median": float(np.median(ratios)), "q95": float(np.quantile(ratios, 0.95)), "max": float(ratios.max())}


def per_layer_figures(rows: list[dict], gpus: int, redundant: int, method: str) -> dict:
    """`method`/fast held out layer by layer, over every layer x fold."""
    return ratio_stats(held_out_ratios(rows, gpus, redundant, method, np.arange(rows[0]["layers"])[:, None]))


def subset_ratios(rows: list[dict], gpus: int, redundant: int, method: str) -> np.ndarray:
    """float64 `[folds * SUBSETS]`: `method`/fast on the held-out batch, summed over each seeded subset's layers."""
    return held_out_ratios(rows, gpus, redundant, method, np.array(subset_list(rows[0]["layers"])))


def every_subset_figures(rows: list[dict], gpus: int, redundant: int, method: str) -> dict:
    """`method`/fast on the held-out batch over every set of `SUBSET_LAYERS` layers x every fold: the share at
    most 1.00 and 1.01, and the worst."""
    layers = rows[0]["layers"]
    sets = np.array(list(itertools.combinations(range(layers), min(SUBSET_LAYERS, layers))))
    ratios = held_out_ratios(rows, gpus, redundant, method, sets)
    return {"pairs": int(ratios.size), "at_most_1.00": float(np.mean(ratios <= 1.0)),
            "at_most_1.01": float(np.mean(ratios <= 1.01)), "max": float(ratios.max())}


def window_evidence(rows: list[dict], gpus: int, redundant: int) -> dict:
    """What the windows say about the held-out batch, per case (layers x folds): the correlation of the
    windows' compute difference (grouped minus balance-only, mean over windows) with the held-out one
    (`ungated` minus `fast`), the same for dispatch + combine, and the held-out compute difference's mean and
    spread over fast's layer time. Then the guard at each bar of `SAVING_LEVELS` on the same evidence (it
    picks, per layer, ungated's or fast's held-out figures exactly), beside the default decision: mean over
    folds of time/fast over all layers, the worst fold and the subset statistics (what the guard buys and
    what it costs)."""
    folds = held_out_folds(rows, gpus, redundant)
    win_compute, win_comm, held_compute, held_comm, spread = [], [], [], [], []
    for f in folds:
        ung, fast = row_of(rows, gpus, redundant, f, "ungated"), row_of(rows, gpus, redundant, f, "fast")
        for i, windows in enumerate(row_of(rows, gpus, redundant, f, "time")["windows"]):
            w = np.array(windows)
            win_compute.append(float(np.mean(w[:, 1] - w[:, 3])))
            win_comm.append(float(np.mean(w[:, 0] - w[:, 2])))
            held_compute.append(ung["layer_compute_s"][i] - fast["layer_compute_s"][i])
            held_comm.append(ung["layer_comm_s"][i] - fast["layer_comm_s"][i])
            spread.append(held_compute[-1] / fast["layer_times_s"][i])

    def point(picks_of) -> dict:
        means, ratios = [], []
        for f in folds:
            ung_s, fast_s = layer_times(rows, gpus, redundant, f, "ungated"), layer_times(rows, gpus, redundant, f,
                                                                                          "fast")
            times = np.where(picks_of(f), ung_s, fast_s)
            means.append(float(times.sum() / fast_s.sum()))
            ratios.append(summed_ratios(times, fast_s, np.array(subset_list(fast_s.size))))
        ratios = np.concatenate(ratios)
        return {"mean_over_folds": float(np.mean(means)), "worst_fold": float(max(means)),
                "subsets_at_most_1.00": float(np.mean(ratios <= 1.0)), "subsets_max": float(ratios.max())}

    def guard_picks(level):
        return lambda f: np.array([guard(tuple(HeldOut(g, c) for g, c, _, _ in windows),
                                         tuple(HeldOut(g, c) for _, _, g, c in windows), min_saving=level)
                                   for windows in row_of(rows, gpus, redundant, f, "time")["windows"]], dtype=bool)

    def default_picks(f):
        return np.array([s is not None and s > 0 for s in row_of(rows, gpus, redundant, f, "time")["expected_saving"]])

    return {"corr_compute": float(np.corrcoef(win_compute, held_compute)[0, 1]),
            "corr_comm": float(np.corrcoef(win_comm, held_comm)[0, 1]),
            "held_out_compute_spread": float(np.std(spread)), "held_out_compute_mean": float(np.mean(spread)),
            "default": point(default_picks),
            "frontier": [{"min_saving": level, **point(guard_picks(level))} for level in SAVING_LEVELS]}


def verdicts(rows: list[dict]) -> list[dict]:
    """Per case: the whole model held out per fold (each method over fast) and the targets; then the per-layer
    and per-subset spread, the windows' evidence, and the in-sample lines."""
    out = []
    for gpus, nodes, redundant in CASES:
        def get(sample, method):
            return row_of(rows, gpus, redundant, sample, method)

        folds = held_out_folds(rows, gpus, redundant)
        whole = {m: whole_model(rows, gpus, redundant, m) for m in WHOLE_METHODS}
        best_in = min(get("in", m)["layer_time_s"] for m in BASELINES)
        target = TARGETS.get((gpus, redundant))
        time_mean = float(np.mean(whole["time"]))
        hind_gain = 1 - float(np.mean(whole["hindsight"]))
        out.append({"ep": gpus, "redundant": redundant, "folds": folds, "layers": rows[0]["layers"],
                    "whole_model": whole, "whole_model_mean": {m: float(np.mean(v)) for m, v in whole.items()},
                    "target_mean": target,
                    "target_mean_met": None if target is None else time_mean <= target,
                    "never_above_1_met": max(whole["time"]) <= 1.0,
                    "share_of_hindsight_gain": (1 - time_mean) / hind_gain if hind_gain > 0 else None,
                    "layers_grouped": {m: {f: get(f, m)["layers_grouped"] for f in folds}
                                       for m in ("time", "time-guard")},
                    "pooled": {f: get(f, "time")["pooled"] for f in folds},
                    "per_layer": {m: per_layer_figures(rows, gpus, redundant, m) for m in SUBSET_METHODS},
                    "subsets": {m: ratio_stats(subset_ratios(rows, gpus, redundant, m)) for m in SUBSET_METHODS},
                    "every_subset": {m: every_subset_figures(rows, gpus, redundant, m) for m in SUBSET_METHODS},
                    "windows": window_evidence(rows, gpus, redundant),
                    "in_sample_time_vs_best": get("in", "time")["layer_time_s"] / best_in - 1,
                    "in_sample_rdma_vs_eplb": get("in", "time")["rdma_gb"] / get("in", "eplb")["rdma_gb"] - 1,
                    "in_sample_grouped_vs_best": get("in", "grouped")["layer_time_s"] / best_in - 1})
    return out


# ---------------------------------------------------------------------- the synthetic test bed
def bed_run(seed: int, spread: float, persistence: float, skew: float, redundant: int,
            train_steps: int = BED["train_steps"], test_steps: int = BED["test_steps"]) -> dict:
    """One run of the bed: a `coactivation_trace` (the bed's shape, this drift), `time`, `ungated` and `fast`
    planned on the first `train_steps` steps, judged layer by layer on the next `test_steps`; the guard's
    choice (`--time-guard 0.05`) from `time`'s windows. Ratios over fast, all layers summed."""
    b = BED
    trace, clusters = coactivation_trace(train_steps + test_steps, b["tokens_per_step"], len(BED_COHESION),
                                         b["experts"], b["top_k"], b["clusters"], np.array(BED_COHESION),
                                         topic_spread=spread, topic_persistence=persistence, expert_skew=skew,
                                         expert_persistence=persistence, seed=seed)
    steps = [np.asarray(s, dtype=np.int64) for s in trace.topk_ids]
    train, test = steps[:train_steps], steps[train_steps:]
    layers, experts, gpus, nodes = len(BED_COHESION), b["experts"], b["gpus"], b["nodes"]
    loads = np.stack([sum(np.bincount(s[:, i].ravel(), minlength=experts) for s in train)
                      for i in range(layers)]).astype(np.float64)
    problem = PlacementProblem(loads, gpus, experts + redundant, num_nodes=nodes)
    model = CommModel(cluster_topology(gpus, nodes), get_model(b["model"]))
    made = plan_time(problem, train, model)
    ungated = plan_time(problem, train, model, strength=GROUP_STRENGTH).placement.phy2log
    fast = made.balance.phy2log
    ids = list(range(layers))
    judged = {"ungated": judge(ungated, test, gpus, nodes, model, ids, experts),
              "fast": judge(fast, test, gpus, nodes, model, ids, experts)}
    times = {m: np.array(j["layer_times_s"]) for m, j in judged.items()}
    # the known best node split: whole clusters, clusters / nodes per node; nodes a token visits with it
    truth = [np.mean([len(set(row)) for s in test for row in (clusters[i][s[:, i]] // (b["clusters"] // nodes))])
             for i in range(layers)]
    picks = {"time": [x.choice == "grouped" for x in made.layers],
             "time-guard": [guard(x.windows, x.balance_windows, min_saving=MIN_SAVING) for x in made.layers]}
    for i, layer in enumerate(made.layers):   # time's rows are ungated's or fast's, layer by layer
        assert np.array_equal(layer.phy2log, (ungated if picks["time"][i] else fast)[i])
    for method, picked in picks.items():
        times[method] = np.where(picked, times["ungated"], times["fast"])
    times["hindsight"] = np.minimum(times["ungated"], times["fast"])
    base = times["fast"].sum()
    return {"seed": seed, "topic_spread": spread, "persistence": persistence, "expert_skew": skew,
            "redundant": redundant, "train_steps": train_steps, "test_steps": test_steps,
            "whole_model": {m: float(t.sum() / base) for m, t in times.items() if m != "fast"},
            "per_layer": {m: (t / times["fast"]).tolist() for m, t in times.items() if m != "fast"},
            "grouped": {m: [bool(x) for x in p] for m, p in picks.items()},
            "expected_saving": [x.expected_saving for x in made.layers],
            "pooled": {part: pool.to_dict() for part, pool in made.pooled.items()},
            "nodes_per_token": {"clusters whole": [float(x) for x in truth],
                                **{m: j["layer_nodes_per_token"] for m, j in judged.items()}}}


def bed_runs() -> tuple[list[dict], list[dict]]:
    """(the bed's runs over `BED_DRIFTS` x `BED_REDUNDANT`, the stress runs): one seed per drift, its index."""
    main, stress = [], []
    for seed, (spread, persistence, skew) in enumerate(BED_DRIFTS):
        for redundant in BED_REDUNDANT:
            main.append(bed_run(seed, spread, persistence, skew, redundant))
            print(f"bed seed {seed} R {redundant}: time/fast {main[-1]['whole_model']['time']:.4f}", file=sys.stderr)
    for seed, spread in enumerate(BED_STRESS["spreads"], start=len(BED_DRIFTS)):
        for redundant in BED_REDUNDANT:
            stress.append(bed_run(seed, spread, BED_STRESS["persistence"], BED_STRESS["skew"], redundant,
                                  train_steps=BED_STRESS["train_steps"]))
    return main, stress


def bed_summary(runs: list[dict]) -> dict:
    """Over the runs: per method the worst and the mean whole-model ratio; `time`'s gain as a share of
    `hindsight`'s (the mean gains' ratio, and the mean of the runs' shares); per cohesion the share of layers
    `time` grouped and its per-layer ratio's mean."""
    methods = ("time", "time-guard", "ungated", "hindsight")
    ratio = {m: np.array([r["whole_model"][m] for r in runs]) for m in methods}
    gains = {m: 1 - ratio[m] for m in methods}
    cohesion = np.array(BED_COHESION)
    by_cohesion = {}
    for c in sorted(set(BED_COHESION), reverse=True):
        at = cohesion == c
        by_cohesion[f"{c:g}"] = {
            "time_grouped": float(np.mean([np.array(r["grouped"]["time"])[at].mean() for r in runs])),
            "time_per_layer_mean": float(np.mean([np.array(r["per_layer"]["time"])[at].mean() for r in runs])),
            "ungated_per_layer_mean": float(np.mean([np.array(r["per_layer"]["ungated"])[at].mean() for r in runs])),
            "hindsight_grouped": float(np.mean([(np.array(r["per_layer"]["ungated"])[at] < 1).mean() for r in runs])),
            "nodes_per_token": {m: float(np.mean([np.array(r["nodes_per_token"][m])[at].mean() for r in runs]))
                                for m in ("clusters whole", "ungated", "fast")}}
    share = float(gains["time"].mean() / gains["hindsight"].mean()) if gains["hindsight"].mean() > 0 else None
    per_layer = {m: np.concatenate([r["per_layer"][m] for r in runs]) for m in methods}
    return {"runs": len(runs), "max": {m: float(ratio[m].max()) for m in methods},
            "per_layer_above_1": {m: float(np.mean(x > 1.0)) for m, x in per_layer.items()},
            "per_layer_max": {m: float(x.max()) for m, x in per_layer.items()},
            "mean": {m: float(ratio[m].mean()) for m in methods},
            "share_of_hindsight_gain": share,
            "share_of_hindsight_gain_per_run_mean": float(np.mean(
                [g / h for g, h in zip(gains["time"], gains["hindsight"]) if h > 0])),
            "guard_share_of_hindsight_gain": (float(gains["time-guard"].mean() / gains["hindsight"].mean())
                                              if gains["hindsight"].mean() > 0 else None),
            "never_above_1_met": bool(ratio["time"].max() <= 1.0),
            "share_met": share is not None and share >= BED_TARGET_SHARE,
            "by_cohesion": by_cohesion}


# ---------------------------------------------------------------------- what is printed
def met(ok: bool | None) -> str:
    return "n/a" if ok is None else "met" if ok else "missed"


def whole_model_table(summary: list[dict]) -> str:
    """The first table: the whole model held out, per fold and the mean, each method over fast."""
    lines = ["whole model (all layers), held out (plan on two recorded batches, judge on the third), "
             "predicted layer time over fast's:"]
    for v in summary:
        folds = v["folds"]
        lines.append(f"  EP{v['ep']}+{v['redundant']:<3} {'method':<11} " + " ".join(f"{f:>7}" for f in folds)
                     + f" {'mean':>7}")
        for m in WHOLE_METHODS:
            ratios = v["whole_model"][m]
            line = f"  {'':<8} {m:<11} " + " ".join(f"{x:>7.4f}" for x in ratios) + f" {np.mean(ratios):>7.4f}"
            if m == "time":
                line += (f"  target mean <= {v['target_mean']:.2f}: {met(v['target_mean_met'])}; never above 1.00: "
                         f"{met(v['never_above_1_met'])}; {v['share_of_hindsight_gain']:.0%} of hindsight's gain")
            lines.append(line)
        grouped = v["layers_grouped"]
        lines.append(f"  {'':<8} layers grouped per fold (of {v['layers']}): time "
                     f"{'/'.join(str(grouped['time'][f]) for f in folds)}, time-guard "
                     f"{'/'.join(str(grouped['time-guard'][f]) for f in folds)}")
    return "\n".join(lines)


def spread_table(summary: list[dict], checks: list[dict]) -> str:
    """After it: the per-layer and per-subset spread, what the windows say and the guard's bars."""
    lines = ["per layer and per part of the model (held out, over fast):"]
    for v in summary:
        lines.append(f"  EP{v['ep']}+{v['redundant']}:")
        for m, f in v["per_layer"].items():
            lines.append(f"    {m:>10} per layer x fold ({f['pairs']}): <= 1.00 on {f['at_most_1.00']:.1%}; "
                         f"min {f['min']:.4f} median {f['median']:.4f} q95 {f['q95']:.4f} max {f['max']:.4f}")
        for m, f in v["subsets"].items():
            lines.append(f"    {m:>10} {SUBSET_LAYERS}-layer subsets x folds ({f['pairs']}): <= 1.00 on "
                         f"{f['at_most_1.00']:.1%}, <= 1.01 on {f['at_most_1.01']:.1%}; median {f['median']:.4f} "
                         f"max {f['max']:.4f}")
        for m, f in v["every_subset"].items():
            lines.append(f"    {m:>10} every {SUBSET_LAYERS}-layer subset x fold ({f['pairs']:,}): <= 1.00 on "
                         f"{f['at_most_1.00']:.1%}, <= 1.01 on {f['at_most_1.01']:.1%}, max {f['max']:.4f}")
    lines.append("what the windows say (layers x folds; ungated - fast held out), and the guard at each bar:")
    for v in summary:
        w = v["windows"]
        lines.append(f"  EP{v['ep']}+{v['redundant']}: corr(windows' compute difference, held-out one) "
                     f"{w['corr_compute']:+.2f}, dispatch + combine {w['corr_comm']:+.2f}; held-out compute "
                     f"difference over fast's layer time: mean {w['held_out_compute_mean']:+.4f}, spread "
                     f"{w['held_out_compute_spread']:.4f}")
        pooled = "; ".join(f"{f}: " + ", ".join(f"{part} mean {p['mean']:+.4f} weight {p['weight']:.2f}"
                                                for part, p in v["pooled"][f].items()) for f in v["folds"])
        lines.append(f"    the default's pooled estimates (saving shares): {pooled}")
        for label, p in [("default (expected saving > 0)", w["default"])] + \
                [(f"guard bar {p['min_saving']:.2f}", p) for p in w["frontier"]]:
            lines.append(f"    {label:<30} whole model mean {p['mean_over_folds']:.4f}, worst fold "
                         f"{p['worst_fold']:.4f}; subsets <= 1.00 on {p['subsets_at_most_1.00']:.1%}, "
                         f"max {p['subsets_max']:.4f}")
    for method in ("ungated", "time-guard", "fast"):
        same = sum(c[method] for c in checks)
        lines.append(f"subsets planned alone ({method}): rows identical to the whole model's on {same} of {len(checks)}")
    return "\n".join(lines)


def in_sample_lines(rows: list[dict], summary: list[dict]) -> str:
    lines = [f"{'case':<9} {'sample':<7} {'method':<11} {'nodes/tok':>9} {'RDMA GB':>8} {'GPU b/m':>8} "
             f"{'NIC b/m':>8} {'dispatch':>9} {'compute':>8} {'combine':>8} {'layer ms':>9} {'vs fast':>8}"]
    for r in rows:
        fast = row_of(rows, r["ep"], r["redundant"], r["sample"], "fast")["layer_time_s"]
        lines.append(f"EP{r['ep']}+{r['redundant']:<4} {r['sample']:<7} {r['method']:<11} "
                     f"{r['distinct_nodes_per_token']:>9.3f} {r['rdma_gb']:>8.3f} {r['busiest_over_mean_gpu_rows']:>8.3f} "
                     f"{r['busiest_over_mean_nic']:>8.3f} {r['dispatch_s'] * 1e3:>9.4f} {r['compute_s'] * 1e3:>8.4f} "
                     f"{r['combine_s'] * 1e3:>8.4f} {r['layer_time_s'] * 1e3:>9.4f} {r['layer_time_s'] / fast - 1:>+8.1%}")
    for v in summary:
        lines.append(f"EP{v['ep']}+{v['redundant']}: in sample time {v['in_sample_time_vs_best']:+.1%} vs the best "
                     f"baseline, RDMA {v['in_sample_rdma_vs_eplb']:+.1%} vs eplb; grouped "
                     f"{v['in_sample_grouped_vs_best']:+.1%}")
    return "\n".join(lines)


def bed_table(main: dict, stress: dict, runs: list[dict]) -> str:
    lines = [f"synthetic test bed ({main['runs']} runs: {len(BED_DRIFTS)} drifts x R in {BED_REDUNDANT}; plan on "
             f"{BED['train_steps']} steps, judge on the next {BED['test_steps']}), whole model over fast:"]
    for r in runs:
        w = r["whole_model"]
        lines.append(f"  seed {r['seed']} spread {r['topic_spread']:g} persistence {r['persistence']:g} skew "
                     f"{r['expert_skew']:g} R {r['redundant']:>2}: time {w['time']:.4f}  time-guard "
                     f"{w['time-guard']:.4f}  ungated {w['ungated']:.4f}  hindsight {w['hindsight']:.4f}; "
                     f"grouped {sum(r['grouped']['time'])}/{len(BED_COHESION)}")
    for label, s in (("bed", main), (f"stress (train {BED_STRESS['train_steps']} steps, persistence "
                                     f"{BED_STRESS['persistence']:g})", stress)):
        lines.append(f"  {label}: worst " + ", ".join(f"{m} {x:.4f}" for m, x in s["max"].items()) + "; mean "
                     + ", ".join(f"{m} {x:.4f}" for m, x in s["mean"].items()))
        lines.append(f"    time's gain / hindsight's: {s['share_of_hindsight_gain']:.0%} (mean of the runs' shares "
                     f"{s['share_of_hindsight_gain_per_run_mean']:.0%}); the guard's {s['guard_share_of_hindsight_gain']:.0%}"
                     + (f"; targets: never above 1.00 {met(s['never_above_1_met'])}, >= {BED_TARGET_SHARE:.0%} of "
                        f"hindsight's gain {met(s['share_met'])}" if s is main else ""))
        lines.append("    losses layer by layer (layer x run): above 1.00 of fast on " + ", ".join(
            f"{m} {s['per_layer_above_1'][m]:.1%} (worst {s['per_layer_max'][m]:.4f})" for m in s["max"]))
        lines.append("    by cohesion: " + "; ".join(
            f"{c}: time groups {x['time_grouped']:.0%} (hindsight {x['hindsight_grouped']:.0%}), per layer "
            f"{x['time_per_layer_mean']:.4f} (ungated {x['ungated_per_layer_mean']:.4f}), nodes per token "
            + "/".join(f"{v:.2f}" for v in x["nodes_per_token"].values()) + " (clusters whole/ungated/fast)"
            for c, x in s["by_cohesion"].items()))
    return "\n".join(lines)


def results_table(record: dict) -> str:
    """The results tables of docs/multinode.md, from a record of this script (`--table FILE`): the whole model
    held out per fold on the real trace, the default against the guard, every layer grouped and hindsight;
    then the synthetic bed."""
    lines = ["| case | `time` per fold | `time` mean (target) | `--time-guard 0.05` mean | every layer grouped "
             "(`ungated`) mean | hindsight mean | layers `time` grouped per fold |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for v in record["verdicts"]:
        whole, mean, grouped = v["whole_model"], v["whole_model_mean"], v["layers_grouped"]["time"]
        lines.append(f"| EP{v['ep']}+{v['redundant']} | {' / '.join(f'{x:.4f}' for x in whole['time'])} | "
                     f"{mean['time']:.4f} (<= {v['target_mean']:.2f}) | {mean['time-guard']:.4f} | "
                     f"{mean['ungated']:.4f} | {mean['hindsight']:.4f} | "
                     f"{' / '.join(str(grouped[f]) for f in v['folds'])} of {v['layers']} |")
    synthetic = record["synthetic"]
    lines += ["", "| synthetic bed | runs | `time`: worst, mean | `--time-guard 0.05`: worst, mean | `ungated` mean | "
              "hindsight mean | `time`'s share of hindsight's gain |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for label, s in (("trained on 12 steps, judged on the next 24", synthetic["summary"]),
                     ("stress: trained on 8 steps, drift persistence 8", synthetic["stress_summary"])):
        lines.append(f"| {label} | {s['runs']} | {s['max']['time']:.4f}, {s['mean']['time']:.4f} | "
                     f"{s['max']['time-guard']:.4f}, {s['mean']['time-guard']:.4f} | {s['mean']['ungated']:.4f} | "
                     f"{s['mean']['hindsight']:.4f} | {s['share_of_hindsight_gain']:.0%} (the guard "
                     f"{s['guard_share_of_hindsight_gain']:.0%}) |")
    return "\n".join(lines)


# ---------------------------------------------------------------------- plan time
def plan_time_cli(trace: str, gpus: int, nodes: int, redundant: int, time_limit: float) -> dict:
    """Wall and CPU seconds (the child's user + system time) of `moe-place plan TRACE --gpus G --nodes N
    --redundant R --objective time --time-limit S` (48 layers, what a user runs: trace loading, plan, report
    and plan file included)."""
    command = ["moe-place", "plan", trace, "--gpus", str(gpus), "--nodes", str(nodes), "--redundant", str(redundant),
               "--objective", "time", "--time-limit", f"{time_limit:g}", "--no-progress"]
    with tempfile.TemporaryDirectory() as tmp:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        done = subprocess.run(command + ["--out", os.path.join(tmp, "plan.json")], capture_output=True, text=True)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    notes = [line for line in done.stderr.splitlines() if "note" in line]
    return {"command": " ".join(command[:2] + ["TRACE"] + command[3:]), "exit_code": done.returncode,
            "wall_s": wall, "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "notes": notes, "cores": os.cpu_count()}


TIMED = ((32, 4, 0), (32, 4, 32), (64, 8, 64))


def timing_lines(timing: list[dict]) -> str:
    return "\n".join(f"plan time: {t['command']}: {t['wall_s']:.1f} s wall, {t['cpu_s']:.1f} s CPU on {t['cores']} "
                     f"cores (exit {t['exit_code']}){'; ' + '; '.join(t['notes']) if t['notes'] else ''}"
                     for t in timing)


# ---------------------------------------------------------------------- the plot
def plot_png(rows: list[dict], summary: list[dict], bed: list[dict]) -> bytes:
    """Row per case: the whole model held out per fold (each method over fast), the layer time stacked by
    dispatch / compute / combine per method and sample, the subset-fold pairs sorted, and the guard's bars
    (whole-model mean against the share of subsets at most 1.00, the default beside them). Last row: the
    synthetic bed's runs, each method over fast."""
    samples = ["in", "hold 0", "hold 1", "hold 2"]
    fig = new_figure((28, 13), layout="constrained")
    grid = fig.add_gridspec(len(CASES) + 1, len(samples) + 3)
    colors = {"dispatch_s": "#4c72b0", "compute_s": "#dd8452", "combine_s": "#55a868"}
    for r_i, v in enumerate(summary):
        gpus, redundant = v["ep"], v["redundant"]
        ax = fig.add_subplot(grid[r_i, 0])   # the whole model, per fold
        width = 0.8 / len(WHOLE_METHODS)
        for m_i, m in enumerate(WHOLE_METHODS):
            ax.bar(np.arange(len(v["folds"])) + m_i * width, v["whole_model"][m], width,
                   label=m if r_i == 0 else None)
        ax.axhline(1.0, color="black", linewidth=0.8)
        if v["target_mean"] is not None:
            ax.axhline(v["target_mean"], color="black", linewidth=0.8, linestyle=":")
        ax.set_xticks(np.arange(len(v["folds"])) + 0.4 - width / 2, v["folds"])
        low = min(min(x) for x in v["whole_model"].values())
        ax.set_ylim(low - 0.02, 1.03)
        ax.set_title(f"EP{gpus}+{redundant}: whole model, over fast", fontsize=10)
        if r_i == 0:
            ax.legend(fontsize=8)
        for c_i, sample in enumerate(samples):   # stacked parts
            ax = fig.add_subplot(grid[r_i, c_i + 1])
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
                if r_i == 0:
                    ax.legend(fontsize=8)
        ax = fig.add_subplot(grid[r_i, len(samples) + 1])   # subsets, sorted
        for method in SUBSET_METHODS:
            ratios = np.sort(subset_ratios(rows, gpus, redundant, method))
            ax.plot(np.arange(1, ratios.size + 1) / ratios.size, ratios, label=f"{method}/fast" if r_i == 0 else None)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title(f"EP{gpus}+{redundant}: {SUBSET_LAYERS}-layer subsets x folds, held out", fontsize=10)
        ax.set_xlabel("share of subset-fold pairs", fontsize=8)
        if r_i == 0:
            ax.legend(fontsize=8)
        ax = fig.add_subplot(grid[r_i, len(samples) + 2])   # the guard's bars against the default
        points = v["windows"]["frontier"]
        x = [p["mean_over_folds"] for p in points]
        y = [p["subsets_at_most_1.00"] for p in points]
        ax.plot(x, y, "o-", markersize=4, label="the guard at each bar" if r_i == 0 else None)
        for p, a, b in zip(points, x, y):
            ax.annotate(f"{p['min_saving']:g}", (a, b), fontsize=7, xytext=(3, 3), textcoords="offset points")
        d = v["windows"]["default"]
        ax.plot([d["mean_over_folds"]], [d["subsets_at_most_1.00"]], "r*", markersize=12,
                label="default: expected saving > 0" if r_i == 0 else None)
        if v["target_mean"] is not None:
            ax.axvline(v["target_mean"], color="black", linewidth=0.8, linestyle=":")
        ax.set_title(f"EP{gpus}+{redundant}: what the guard costs", fontsize=10)
        ax.set_xlabel("time/fast, all layers, mean over folds", fontsize=8)
        ax.set_ylabel("share of subset-fold pairs <= 1.00", fontsize=8)
        if r_i == 0:
            ax.legend(fontsize=8)
    ax = fig.add_subplot(grid[len(CASES), :])   # the synthetic bed
    methods = ("time", "time-guard", "ungated", "hindsight")
    width = 0.8 / len(methods)
    for m_i, m in enumerate(methods):
        ax.bar(np.arange(len(bed)) + m_i * width, [r["whole_model"][m] for r in bed], width, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(np.arange(len(bed)) + 0.4 - width / 2,
                  [f"s{r['seed']} sp{r['topic_spread']:g} p{r['persistence']:g} k{r['expert_skew']:g} R{r['redundant']}"
                   + (" (stress)" if r["train_steps"] != BED["train_steps"] else "") for r in bed],
                  rotation=30, ha="right", fontsize=8)
    ax.set_ylim(min(r["whole_model"]["hindsight"] for r in bed) - 0.02, 1.03)
    ax.set_title("synthetic bed (known co-activation, drift: spread sp, persistence p, expert skew k): whole model "
                 "on the next steps, over fast", fontsize=10)
    ax.legend(fontsize=8, ncols=4)
    fig.suptitle("Qwen3-30B-A3B (3 real batches) and the synthetic bed: predicted MoE layer time, DeepEP dispatch, "
                 "SGLang static replica choice", fontsize=12, fontweight="bold")
    return png_bytes(fig, dpi=90)


# ---------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=48, help="layers, evenly spaced (default all 48)")
    add_record_options(parser, plot=True, committed=("bench/results/comm.json", "bench/results/comm.png"))
    parser.add_argument("--no-cli-timing", action="store_true", help="skip timing `moe-place plan` end to end")
    parser.add_argument("--no-bed", action="store_true", help="skip the synthetic test bed")
    parser.add_argument("--timing-only", action="store_true", help="only time `moe-place plan` end to end")
    parser.add_argument("--table", metavar="RECORD", help="print the results table of docs/multinode.md from a "
                                                          "record of this script, and stop")
    args = parser.parse_args(argv)
    if args.table:
        try:
            with open(args.table) as f:
                print(results_table(json.load(f)))
        except (OSError, ValueError, KeyError) as error:
            parser.error(f"--table {args.table}: expected a record of this script ({error!r})")
        return 0
    refuse_overwrite(parser, args)
    path = str(bundled_path("qwen3-30b-a3b_prefill_topk.npz"))
    if args.timing_only:
        timing = [plan_time_cli(path, gpus, nodes, redundant, 60.0) for gpus, nodes, redundant in TIMED]
        print(timing_lines(timing))
        if args.output_json:
            write_record(args.output_json, {"plan_time": timing})
        return 0
    trace = load_trace(path)
    layers = list(range(0, trace.num_layers, max(1, trace.num_layers // args.layers)))[:args.layers]
    rows, checks = run(list(trace.topk_ids), layers)
    summary = verdicts(rows)
    bed, stress = ([], []) if args.no_bed else bed_runs()
    print(whole_model_table(summary))
    if bed:
        bed_figures = {"summary": bed_summary(bed), "stress_summary": bed_summary(stress)}
        print(bed_table(bed_figures["summary"], bed_figures["stress_summary"], bed + stress))
    print(spread_table(summary, checks))
    print(in_sample_lines(rows, summary))
    timing = [] if args.no_cli_timing else [plan_time_cli(path, g, n, r, 60.0) for g, n, r in TIMED]
    if timing:
        print(timing_lines(timing))
    if args.output_json:
        record = {"layers": layers, "rows": rows, "verdicts": summary,
                  "subsets": {"count": SUBSETS, "layers": SUBSET_LAYERS, "seed": SUBSET_SEED,
                              "positions": subset_list(len(layers)), "checked_alone": checks},
                  "plan_time": timing}
        if bed:
            record["synthetic"] = {"bed": {**BED, "cohesion": BED_COHESION, "redundant": BED_REDUNDANT,
                                           "drifts": BED_DRIFTS, "stress": BED_STRESS},
                                   "runs": bed, "stress_runs": stress, **bed_figures}
        write_record(args.output_json, record)
    if args.plot:
        write_atomic(args.plot, plot_png(rows, summary, bed + stress))
    missed = missed_target_lines(summary, bed_figures["summary"] if bed else None)
    print("targets: NOT MET: " + "; ".join(missed) if missed else "targets: all met")
    return missed_targets("bench_comm", missed)


def missed_target_lines(summary: list[dict], bed: dict | None) -> list[str]:
    """The targets of the module docstring that the figures miss, one line each."""
    missed = []
    for v in summary:
        case = f"EP{v['ep']}+{v['redundant']}"
        if v["target_mean_met"] is False:
            missed.append(f"{case} time/fast mean {v['whole_model_mean']['time']:.4f} > {v['target_mean']:.2f}")
        if not v["never_above_1_met"]:
            missed.append(f"{case} time/fast above 1.00 on a fold ({max(v['whole_model']['time']):.4f})")
    if bed is not None and not bed["never_above_1_met"]:
        missed.append(f"synthetic bed: time/fast above 1.00 on a run ({bed['max']['time']:.4f})")
    if bed is not None and not bed["share_met"]:
        missed.append(f"synthetic bed: {bed['share_of_hindsight_gain']:.0%} of hindsight's gain < "
                      f"{BED_TARGET_SHARE:.0%}")
    return missed


if __name__ == "__main__":
    sys.exit(main())
