"""The per-batch split's pages: the split and the placement made for it."""

from __future__ import annotations

import statistics

from .common import TRACE, f, page, pct, record, records, source, span, table


def _split_anatomy(row: dict) -> list[str]:
    """At the best cadence of the rule with the split: the layer-steps it split, its expert time over the rule's
    at that cadence (expert + dispatch/combine + migration, no CPU time) and the CPU seconds of the per-layer
    choice."""
    runs = {name: {r["step_interval"]: r for r in doc["runs"] if r["policy"] == "moe-place"}
            for name, doc in row["sweeps"].items()}
    best = min(runs["split"].values(), key=lambda r: r["total_s"])
    rule = runs["rule"][best["step_interval"]]
    model = lambda r: r["expert_s"] + r.get("comm_s", 0.0) + r["migration_s"]  # noqa: E731
    return [f"{best['split_layer_steps']:,} (every {best['step_interval']})", f(model(best) / model(rule), 4),
            f"{best['split_cpu_s']:.3f}"]


def split() -> str:
    data = record("split.json")
    parts = []
    if "accuracy" in data:
        a = data["accuracy"]
        rows = [[c["trace"], c["rows"], f(c["mean"], 5), f(c["max"], 5)] for c in a["cases"]]
        parts += ["## The fast split against the exact one",
                  "The fast split (`moe_place.split.split_shares`: `evaluate --split per-batch`, the engines' "
                  "plugins) against the exact one (`--split optimal`, an LP per layer and batch): the busiest GPU "
                  "in whole rows over the LP's optimum rounded up, on every layer of the bundled real trace (an "
                  "EPLB plan made on one recorded batch, judged on the two others) and on 10 batches of each "
                  "evaluation-set drifting trace (an EPLB plan made on its first 100 steps).",
                  table(["trace, plan", "layer-batches", "mean", "worst"], rows),
                  f"Worst {f(a['worst'], 5)} (target at most 1.005: {'met' if a['met'] else 'not met'})."]
    if "replay" in data:
        r = data["replay"]
        rows = [[x["trace"], f"{x['gpus']} GPUs, {x['nodes']} node(s)", x["redundant"], x["protocol"],
                 f(x["rule_ratio"]), f(x["split_ratio"]), x["target"], f"{x['overhead_s'] * 1e6:.1f}",
                 *_split_anatomy(x),
                 f"{f(x['free_split_ratio'])} (expert {f(x['free_split_expert_over_rule'])})"
                 if "free_split_ratio" in x else "-"] for x in r["rows"]]
        met = ", ".join(f"R = {k}G {'met' if v else 'not met'}" for k, v in r["met"].items())
        parts += ["## Over a serving run (predicted by the cost model)",
                  f"`moe_place.online.cadence.sweep` (what `moe-place cadence` runs) on the evaluation set's "
                  f"drifting traces ({data['steps']} steps, never used to choose a design), every policy sending "
                  "rows to replicas as its engine does (vLLM: its token-index hash; SGLang: its static "
                  "dispatch), each policy at its best cadence of "
                  f"{', '.join(str(i) for i in data['intervals'])} and the engine's default. Totals (expert, "
                  "migration and the policy's CPU time where the engine waits for it) over the engine default's "
                  "best; the split charged its all-reduce (NCCL's latency model) and a "
                  f"{data['solve_s'] * 1e6:.0f} us solve per layer (overhead column; the solve is the kernels' "
                  "goal, not a GPU measurement).",
                  table(["trace", "cluster", "redundant", "protocol", "rule", "rule + split", "target",
                         "split overhead us/layer", "at rule + split's best cadence: layer-steps split",
                         "layer time, with the split over without", "the choice's CPU s",
                         "rule + a free split (its expert time over the rule's)"], rows),
                  f"Targets (rule + split at most 0.94x with R = G, 0.90x with R = 2G): {met}."
                  + (f" The split's choice, rule + split over the rule alone each at its best cadence: worst "
                     f"{f(r['choice_worst'])} (target at most 1.005: {'met' if r['choice_met'] else 'not met'})."
                     if "choice_worst" in r else "") + " The two totals come "
                  "from two runs, each with its own measure of the rule's CPU time, which SGLang's protocol pays "
                  "and which moves by several percent between identical runs on a shared machine; the last three "
                  "columns are the split's own part: the layer-steps it ran, the layer and migration time with it "
                  "over the same cadence without it, and the CPU time of the per-layer choice. The last column "
                  "is what no charged split can beat: the rule at its best cadence with the split on every layer "
                  "of every batch from the first step, its all-reduce, solve and choice free, over the default's "
                  "best (its expert time over the rule's without it in brackets)."]
    if "choice_price" in data:
        c = data["choice_price"]
        rows = [[x["gpus"], x["experts"], x["slots"], x["tokens"], f"{x['screen_s_per_slot'] * 1e6:.2f}",
                 f"{x['price_s_per_slot'] * 1e6:.2f}"] for x in c["rows"]]
        parts += ["## What the choice costs the CPU (measured)",
                  "The split's per-layer choice on 8 layers of a map it has not seen, timed on one core: the screen "
                  "(the mean batch's bound, the engine's replica tables built) per slot of a layer's map row, and "
                  "the pricing in full per slot and batch. A call screens and prices only the layers it can afford "
                  "at these prices, at least the most measured (`moe_place.online.splitting`): at most 0.2% of the "
                  "layers' time until the next call.",
                  table(["GPUs", "experts", "slots", "tokens a batch", "screen us/slot", "priced us/slot/batch"],
                        rows)]
    if "guard" in data:
        g = data["guard"]
        rows = [[x["trace"], x["protocol"], x["redundant"],
                 ", ".join(f"{i}: {f(v)}" for i, v in x["split_over_rule_at"].items())] for x in g["rows"]]
        parts += ["## Where the split has nothing to give (predicted by the cost model)",
                  "No redundant experts, or decode-sized batches (512 tokens a step): the rule with `--split "
                  "per-batch` over the rule alone at each cadence (the rule's per-layer choice should keep the "
                  "split off).",
                  table(["trace", "protocol", "redundant", "rule + split over rule, per cadence"], rows),
                  f"Worst {f(g['worst'])} (target at most 1.005: {'met' if g['met'] else 'not met'})."]
    for name in records("split_engines_*.json"):
        e = record(name)
        rows = [[c["check"], "PASS" if c["passed"] else "FAIL"] for c in e["checks"]]
        b = e["busiest_rank_rows"]
        parts += [f"## In {e['engine']} {e['version']}'s own code on a CPU, {e['ranks']} gloo ranks", source(name),
                  e["ran_in_the_engine"], table(["check", "result"], rows),
                  f"The busiest rank's rows per batch and layer: the split {b['split']}, the engine's own choice "
                  f"{b['engine']}, the lower bound of any split {[round(x, 1) for x in b['bound']]}."]
    return page("split",
                "The per-batch split ([how to use it](../split.md)): its accuracy against the exact split, what it "
                "gives over a serving run with its costs charged, and where it must stay off. "
                + source("split.json"), *parts)


def split_placement() -> str:
    data = record("split_placement.json")
    rows, kept = [], []
    for r in data["rows"]:
        case = "Qwen3-30B-A3B" if r["case"] == "real" else f"drift, seeds {span(data['drift_seeds'], 0)}"
        rows.append([case, f"EP{r['ep']}+{r['redundant']}", r["protocol"], len(r["folds"]), f(r["eplb_held_out"]),
                     f(r["fast_held_out"]), f(r["split_held_out"]),
                     f"{pct(r['split_vs_eplb'], 2)} ({pct(r['split_vs_eplb_best_fold'], 2)} / "
                     f"{pct(r['split_vs_eplb_worst_fold'], 2)})", pct(r["fast_vs_eplb"], 2),
                     pct(r["split_in_sample_vs_eplb"], 2), f"{r['split_plan_s']:.1f}"])
        kept.append(r["split_vs_eplb"] < 0)
    real = [r["split_vs_eplb"] for r in data["rows"] if r["case"] == "real"]
    drift = [r["split_vs_eplb"] for r in data["rows"] if r["case"] == "drift"]
    verdict = (f"The split's placement is less busy than EPLB's held out on {sum(kept)} of {len(kept)} rows (mean "
               f"change {pct(sum(real) / len(real), 2)} on the real rows, {pct(sum(drift) / len(drift), 2)} on the "
               "drift rows)" if real and drift else f"less busy held out on {sum(kept)} of {len(kept)} rows")
    return page("split-placement",
                "Plans made for the per-batch split (`moe-place plan --split per-batch`, "
                "`moe_place.solvers.split_placement`) against EPLB's and `fast`'s plans from the same planning "
                "steps, all judged with the same per-batch split (`split_shares`) on steps none was made on: the "
                "busiest GPU's rows summed over layers over the mean GPU's rows, averaged over the held-out steps "
                "(1 = perfect balance). \"vs EPLB\" is the relative change of that figure, mean over folds (best / "
                "worst fold); in sample: on the planning steps. The real rows plan on the bundled trace's recorded "
                f"batches ({TRACE}); the drift rows on the first {data['drift_window']} steps of drifting synthetic "
                f"traces (256 experts, top-8, {data['drift_layers']} layers; seeds {span(data['drift_seeds'], 0)}, "
                f"the planner's constants were tuned on seeds {data['tuning_seeds']}). "
                "[Plan replicas offline](../plan.md#plan-for-the-per-batch-split-split-per-batch) says how to use "
                "it, its [design notes](../design/split-placement.md) what was tried.",
                source("split_placement.json", "split_placement_tuning.json"),
                table(["trace", "config", "protocol", "folds", "EPLB", "fast", "split's", "split's vs EPLB",
                       "fast vs EPLB", "in sample vs EPLB", "plan s"], rows),
                verdict + ".",
                "## Tuning the deviation gain\n\n" + _split_tuning(record("split_placement_tuning.json")))


def _split_tuning(data: dict) -> str:
    """The tuning record's table: the split's placement against EPLB's held out, mean over the tuning seeds."""
    gains = list(dict.fromkeys(r["deviation_gain"] for r in data["rows"]))
    configs = list(dict.fromkeys((r["ep"], r["redundant"]) for r in data["rows"]))
    rows = [[f"EP{ep}+{redundant}"] + [pct(statistics.mean(r["split_vs_eplb"] for r in data["rows"] if (
        r["ep"], r["redundant"], r["deviation_gain"]) == (ep, redundant, g)), 2) for g in gains]
            for ep, redundant in configs]
    return (f"The planner's one tuned constant, the scale of the planning steps' deviations from their mean "
            f"(`DEVIATION_GAIN`), on the tuning seeds {span(data['seeds'], 0)} only (never the reported ones): the "
            f"split's placement against EPLB's, held-out busiest/mean under the per-batch split on the "
            f"{data['drift_judged']} steps after a {data['drift_window']}-step window, {data['drift_layers']} layers, "
            "mean over seeds.\n\n" + table(["config"] + [f"gain {g:g}" for g in gains], rows))
