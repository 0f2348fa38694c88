"""The planning pages: plan quality, redundancy sizing, scale, drop-in timing, planning on windows and trace
throughput."""

from __future__ import annotations

import re
import statistics

from .common import TRACE, RecordError, f, page, pct, record, records, source, table


def plan_quality() -> str:
    data = record("plan_quality.json")
    rows = [[f"EP{r['ep']}+{r['redundant']}", f"{f(r['eplb_in_mean'])} / {f(r['eplb_in_worst'])}",
             f"{f(r['fast_in_mean'])} / {f(r['fast_in_worst'])}", f(r["eplb_out_balancedness"], 3),
             f(r["fast_out_balancedness"], 3), r["fast_worse_than_eplb_layers"]] for r in data["rows"]]
    worse = sum(r["fast_worse_than_eplb_layers"] for r in data["rows"])
    return page("plan-quality",
                f"`fast` against DeepSeek's EPLB (solver `eplb`) on the real {data['trace']} trace, "
                f"{data['layers']} layers. In sample: plan on the three recorded batches summed, busiest GPU "
                "over the best certified lower bound, mean / worst layer (1.0 = proved optimal). Out of "
                "sample: plan on one recorded batch, judge on each other one (all 6 ordered pairs), mean "
                "balancedness.",
                source("plan_quality.json"),
                table(["config", "eplb in sample", "fast in sample", "eplb out of sample", "fast out of sample",
                       "layers where fast > eplb"], rows),
                f"`fast` is above `eplb` in sample on {worse} layers of all the rows. Out of sample both lose "
                "most of their balance: a plan is only as good as the load it was made for.")


def sizing() -> str:
    names = sorted(records("sizing_ep*.json"), key=lambda n: int(re.search(r"\d+", n)[0]))
    if not names:
        raise RecordError("bench/results/sizing_ep*.json: expected the sizing records")
    summary, details = [], []
    for name in names:
        s = record(name)["sizing"]
        by_r = {c["redundant"]: c for c in s["candidates"]}
        best, zero = by_r[s["recommended_redundant"]], by_r[0]
        gain = best["held_out_busiest_over_mean"] / zero["held_out_busiest_over_mean"] - 1
        summary.append([s["num_gpus"], s["recommended_redundant"], f(zero["held_out_busiest_over_mean"]),
                        f"{f(best['held_out_busiest_over_mean'])} ({pct(gain)})",
                        f(best["replica_bytes_per_gpu"] / 2**30, 2), f"{best['kv_tokens_per_gpu']:,}", s["reason"]])
        rows = []
        for c in s["candidates"]:
            vs = c["held_out_busiest_over_mean"] / zero["held_out_busiest_over_mean"] - 1
            mark = " (recommended)" if c["redundant"] == s["recommended_redundant"] else ""
            rows.append([f"{c['redundant']}{mark}", c["num_physical"], c["slots_per_gpu"],
                         f(c["held_out_busiest_over_mean"]), f(max(c["fold_held_out_busiest_over_mean"])),
                         pct(vs), f(c["replica_bytes_per_gpu"] / 2**30, 2), f"{c['kv_tokens_per_gpu']:,}",
                         "yes" if c["on_hull"] else ""])
        memory = s["memory"]
        details += [f"## EP{s['num_gpus']}", "",
                    f"{s['folds']}, {s['solver']} plans; {memory['source']}: W_e {memory['expert_bytes'] / 2**20:.2f} "
                    f"MiB x {memory['moe_layers']} MoE layers, KV cache {memory['kv_bytes_per_token']:,} bytes/token.",
                    "", table(["R", "P", "slots/GPU", "held-out busiest/mean", "worst fold", "vs R = 0",
                               "replica GiB/GPU", "KV tokens lost/GPU", "on the hull"], rows), ""]
    return page("sizing",
                f"`moe-place plan --redundant auto` on the real Qwen3-30B-A3B trace ({TRACE}): for every "
                "candidate R, plan on all recorded steps but one and judge on the one left out; the knee is "
                "the last step along the lower convex hull of held-out busiest/mean against replica memory "
                "that still lowers it by 1% per GiB per GPU "
                "([how](../plan.md#how-many-redundant-experts-redundant-auto)).",
                source(*names),
                table(["EP", "recommended R", "held-out busiest/mean at R = 0", "at the recommended R",
                       "replica GiB/GPU", "KV tokens lost/GPU", "why it stops"], summary),
                "\n".join(details).rstrip("\n"))


def scale() -> str:
    data = record("scale.json")
    rows = []
    for r in data["rows"]:
        if r["method"].startswith("drop-in"):
            wall = f"{f(r['wall_s'], 3)} (worst {f(r['wall_worst_s'], 3)}; {r['over_eplb']:.1f}x eplb)"
            method = f"drop-in, {r['time_limit_s']:g} s limit"
        else:
            wall, method = f"{r['wall_s']:.3g}", r["method"]
        rows.append([r["loads"], r["ep"], method, wall,
                     f"{pct(r['gap_mean'], 2, False)} / {pct(r['gap_worst'], 2, False)}",
                     f"{r['layers_gap_le_1pct']}/58"])
    return page("scale",
                f"A DeepSeek-V3-shaped model, 58 layers x 256 experts + 32 redundant ({data['num_physical']} slots), "
                "with synthetic DeepSeek-R1-calibrated loads (`r1`) and uniform random loads (`random`), on "
                f"{data['cores']} core. The drop-in row times what an engine calls, "
                "`moe_place.eplb.rebalance_experts(weight, 288, 1, 1, G, time_limit_s=0.1)`, end to end (torch "
                "tensors in and out; median and worst of the calls), against EPLB in the same run.",
                source("scale.json"),
                table(["loads", "EP", "solver", "wall s", "gap mean / worst vs certified bound", "layers within 1%"],
                      rows),
                "At EP144 (2 slots per GPU) the bound that certifies the plans is the pairing bound of "
                "`solvers/bounds.py`, not the simple average/count bounds.")


def dropin() -> str:
    data = record("dropin.json")
    rows = []
    for r in data["rows"]:
        topology = f"EP{r['ep']}" + (f" ({r['nodes']} nodes, {r['groups']} groups: hierarchical)" if r["groups"] > 1
                                     else f" ({r['nodes']} nodes: global)" if r["nodes"] > 1 else "")
        rows.append([f"{r['model']}, {r['layers']} x {r['experts']}", f"{r['physical']}, {topology}", r["loads"],
                     f"{f(r['dropin_median_s'], 3)} / {f(r['dropin_worst_s'], 3)}", f(r["eplb_median_s"], 3),
                     f"{f(r['busiest_vs_eplb_mean'])} / {f(r['busiest_vs_eplb_worst'])}",
                     "yes" if r["deterministic"] else "no"])
    worst = max(r["dropin_worst_s"] for r in data["rows"])
    never_worse = all(r["busiest_vs_eplb_worst"] <= 1 for r in data["rows"])
    return page("dropin",
                "The drop-in's default call as an engine makes it: `moe_place.eplb.rebalance_experts(weight, ...)` "
                "with no keyword (solver `quick`, EPLB's own plan a candidate on every layer, no time limit), "
                f"torch tensors in and out, on {data['cores']} core; median and worst of {data['repeats']} calls, "
                "DeepSeek EPLB (`solver=\"eplb\"`) timed alternately. Busiest GPU against EPLB's: mean and worst "
                "layer (below 1: less busy).",
                source("dropin.json"),
                table(["model, layers x experts", "slots, EP", "loads", "drop-in median / worst s", "EPLB s",
                       "busiest GPU vs EPLB's, mean / worst layer", "same maps every call"], rows),
                f"Worst call {f(worst, 3)} s (target: an engine never waits more than about 0.2 s); "
                + ("never busier than EPLB on any layer." if never_worse else "busier than EPLB on some layer."))


def windows() -> str:
    data = record("windows.json")
    cases: dict[str, dict[str, float]] = {}
    for r in data["rows"]:
        cases.setdefault(r["case"], {})[r["method"]] = r["held_out_busiest_over_mean"]
    methods = ["sum", "windows-mean", "windows-max"]
    rows = [[case] + [f(values[m], 3) for m in methods] for case, values in cases.items()]
    rows.append(["mean"] + [f(statistics.mean(v[m] for v in cases.values())) for m in methods])
    return page("windows",
                "A plan minimising the mean or the max of per-window busiest loads over the training windows "
                f"(CP-SAT from the summed-load plan, {data['time_limit_s']:g} s) against the plan on the summed "
                "loads, judged on every held-out step: busiest / mean GPU rows, EP8 + 8 redundant, 8 layers. The "
                "window objectives give no consistent held-out gain, so `plan` and `compare` plan on the summed "
                "loads; `evaluate --windows` still judges a plan per window.",
                source("windows.json"),
                table(["case", "summed loads", "windows, mean", "windows, max"], rows))


def throughput() -> str:
    names = records("analyze_throughput_*.json")
    rows = []
    for name in names:
        data = record(name)
        by = {r["method"]: r for r in data["results"]}
        kind = "streamed" if data["streamed"] else "read whole"
        plural = "s" if data["steps"] > 1 else ""
        rows.append([f"{data['file_bytes'] / 1e6:.0f} MB, {kind}, {data['steps']} step{plural}",
                     f"{data['decisions'] / 1e6:.1f} M",
                     f"{by['analyze']['ratio_vs_baseline']:.2f}x ({f(by['analyze']['seconds'], 3)} s)",
                     f"{by['analyze-1t']['ratio_vs_baseline']:.2f}x",
                     f"{by['stream']['ratio_vs_baseline']:.2f}x / {by['memory']['ratio_vs_baseline']:.2f}x",
                     f"{data['analyze_peak_bytes'] / 1e6:.1f} MB",
                     f"{data['load_average']['before']:.1f}"])
    return page("throughput",
                "`moe-place analyze TRACE` end to end (file read, every id validated, every column of the table), "
                "timed in-process, against a one-core `np.bincount` per layer on contiguous int64 ids in the same "
                "run (the ratio: above 1 is faster than that reference); 48 layers x top-8 of 128 experts, best of "
                "11 round-robin runs, on a 2-core machine shared with other jobs (its load average in the last "
                "column). Files over 256 MiB are streamed.",
                source(*names),
                table(["trace file", "routing decisions", "analyze, 2 threads", "analyze, 1 thread",
                       "counting alone: stream / memory", "peak traced memory", "load average"], rows))
