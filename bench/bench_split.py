"""The per-batch split: how close the fast split is to the exact one, and what it buys in the replay.

Three sections, each printing a table and its targets (MET / NOT MET; exit 1 if one is missed):
1. `accuracy`: the fast split (`moe_place.split.split_shares`, what `evaluate --split per-batch` and the engine
   plugins run) against the exact one (`solvers.evaluate.optimal_split`, an LP per layer and batch) on every
   layer of the bundled real Qwen3 trace (an EPLB plan made on one batch, judged on the two others: EP16, EP32,
   EP64 with R = G and R = 2G) and on batches of the evaluation set's drifting traces (an EPLB plan made on
   their first 100 steps, judged on 10 later ones, every layer). The busiest GPU in whole rows against the
   whole-row optimum (the LP's, rounded up). Target: at most 1.005 on every layer and batch.
2. `replay`: the evaluation set's drifting traces (`bench_replay.EVALUATION`, never used to choose a design)
   replayed (`moe_place.online.cadence.sweep`, what `moe-place cadence` runs) with R = G and R = 2G under
   vLLM's async protocol and SGLang's, every policy sending rows to replicas as its engine does (vLLM's
   token-index hash, SGLang's static dispatch; `moe_place.cost.replicas`), moe-place's rule with and without
   `--split per-batch` (the split charged its all-reduce, NCCL's latency model, and a 10 us solve), each
   policy at its best cadence. Targets: the rule with the split at most 0.94x the default's best
   with R = G and 0.90x with R = 2G, in both protocols. Beside each, the rule with a free split (no all-reduce,
   no solve, no choice: on every layer of every batch) at the rule's best cadence: what no charged split can
   beat.
   Target too: the split's choice costs at most 0.5% best against best where it runs (rule + split over the
   rule alone, each at its best cadence, at most 1.005 on every row).
3. `guard`: traces where the split has nothing to give, no redundant experts and decode-sized batches (512
   tokens a step): the rule with `--split per-batch` at most 1.005x the rule without it at every cadence.
4. `choice_price`: what the choice's two stages cost this core per slot of a layer's map row (the screen on the
   mean batch; the pricing in full, per batch priced) at four sizes, the median of 5 timings;
   `moe_place.online.splitting`'s `SCREEN_S_PER_SLOT` and `PRICE_S_PER_SLOT` are at least the most of them
   (tests/test_replicas.py checks).

    python bench/bench_split.py [--sections accuracy,replay,guard,choice_price] [--steps 3000] [--out FILE.json]
        [--force]

The committed record: `python bench/bench_split.py --out bench/results/split.json --force`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from moe_place.cost.replicas import DEFAULT_SOLVE_S, ENGINE_REPLICA_CHOICE, split_overhead_s
from moe_place.online.cadence import CadenceRun, cadences, sweep
from moe_place.online.controller import RuleController, initial_map
from moe_place.online.policy import RebalanceRule
from moe_place.online.replay import replay
from moe_place.online.splitting import PRICE_S_PER_SLOT, SCREEN_S_PER_SLOT, SPLIT_SAMPLES, SplitChoice
from moe_place.placement import Placement
from moe_place.cost.cluster import cluster_cost
from moe_place.online.replay import parse_synthetic
from moe_place.solvers.deepseek import eplb_rebalance
from moe_place.solvers.evaluate import optimal_split
from moe_place.split import gpu_rows, split_shares
from moe_place.traces.load import load_trace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_replay  # noqa: E402  (bench/ is not a package)
from records import add_record_options, interrupted, missed_targets, refuse_overwrite, write_record  # noqa: E402

SECTIONS = ("accuracy", "replay", "guard", "choice_price")
TARGET_ACCURACY = 1.005      # the fast split's busiest GPU over the whole-row optimum, every layer and batch
TARGET_SPLIT = {1: 0.94, 2: 0.90}   # rule + split at its best cadence over the default at its best: R = G, 2G
TARGET_GUARD = 1.005         # rule + split over the rule alone, at every cadence, where the split cannot pay
TARGET_CHOICE = 1.005        # rule + split over the rule alone, each at its best cadence, on every replay row
PRICE_SIZES = ((8, 1, 64, 8, "Qwen3-30B-A3B", 4096), (8, 1, 64, 16, "Qwen3-30B-A3B", 32768),   # (G, N, E, R,
               (32, 4, 256, 32, "DeepSeek-V3", 65536), (32, 4, 256, 64, "DeepSeek-V3", 65536))   # model, tokens)
INTERVALS = (10, 50, 200, 1000)
PROTOCOLS = {"vllm": ("vllm", True), "sglang": ("sglang", False)}
REPLAY_TRACES = ("1x8-qwen3-30b-e101", "1x8-qwen3-30b-e103", "4x8-deepseek-v3-e104", "4x8-deepseek-v3-e105")
GUARD_TRACES = {   # (cluster scenario, spec, redundant slots per GPU)
    "1x8-qwen3-30b no redundant": ("1x8-qwen3-30b", "drift:steps={steps},layers=8,experts=64,tokens=8192,seed=201",
                                   0),
    "1x8-qwen3-30b decode": ("1x8-qwen3-30b", "drift:steps={steps},layers=8,experts=64,tokens=512,seed=202", 1),
    "4x8-deepseek-v3 decode": ("4x8-deepseek-v3", "drift:steps={steps},layers=8,experts=256,tokens=512,domains=8,"
                                                  "seed=203", 1),
}


# ---------------------------------------------------------------------- 1. accuracy
def accuracy_rows(plans: np.ndarray, loads: np.ndarray, gpus: int) -> list[float]:
    """The fast split's busiest GPU over the whole-row optimum, per row of `plans [n, P]` and `loads [n, E]`."""
    shares = split_shares(plans, loads, gpus)
    out = []
    for plan, load, share in zip(plans, loads, shares):
        best = math.ceil(optimal_split(plan, load, gpus)[0] - 1e-6)
        out.append(float(gpu_rows(share, gpus).max() / best) if best > 0 else 1.0)
    return out


def accuracy_section() -> dict:
    cases = []
    trace = load_trace(str(Path(__file__).resolve().parents[1] / "traces" / "data" / "qwen3-30b-a3b_prefill_topk.npz"))
    steps = trace.step_counts()
    for gpus in (16, 32, 64):
        for factor in (1, 2):
            plans = eplb_rebalance(steps[0].astype(np.float64), trace.num_experts + factor * gpus, 1, 1, gpus)
            ratios = []
            for judged in (1, 2):
                ratios += accuracy_rows(plans, steps[judged], gpus)
            cases.append({"trace": f"bundled Qwen3 EP{gpus} + {factor * gpus}", "rows": len(ratios),
                          "mean": float(np.mean(ratios)), "max": float(np.max(ratios))})
    for name in REPLAY_TRACES:
        cluster, spec, _ = bench_replay.EVALUATION[name]
        gpus = bench_replay.SCENARIOS[cluster]["gpus"]
        counts, _ = parse_synthetic(spec.format(steps=300))
        counts = counts.astype(np.int64)
        for factor in (1, 2):
            plans = eplb_rebalance(counts[:100].sum(axis=0).astype(np.float64), counts.shape[2] + factor * gpus,
                                   1, 1, gpus)
            judged = counts[100:300:20]                                          # 10 batches, every layer
            ratios = accuracy_rows(np.tile(plans, (len(judged), 1)), judged.reshape(-1, counts.shape[2]), gpus)
            cases.append({"trace": f"{name} EP{gpus} + {factor * gpus}", "rows": len(ratios),
                          "mean": float(np.mean(ratios)), "max": float(np.max(ratios))})
    worst = max(c["max"] for c in cases)
    return {"cases": cases, "worst": worst, "met": worst <= TARGET_ACCURACY}


# ---------------------------------------------------------------------- 2. replay and 3. guard
def run_sweeps(spec: str, cluster: str, redundant_per_gpu: int, protocol: str, steps: int,
               ceiling: bool = False) -> dict:
    """Both policies at every cadence of `INTERVALS` (and the engine's default), moe-place's rule without and with
    the split, every policy sending rows as its engine does. ceiling: also the rule with a free split (no
    all-reduce, no solve, no choice: on every layer of every batch from the first step; the rule's maps are the
    same, it does not see the split) at the rule's best cadence, over the default's best: what no charged split
    can beat."""
    cfg = bench_replay.SCENARIOS[cluster]
    engine, use_async = PROTOCOLS[protocol]
    counts, _ = parse_synthetic(spec.format(steps=steps))
    _, layers, experts = counts.shape
    gpus, nodes = cfg["gpus"], cfg["nodes"]
    start = initial_map(layers, experts, experts + redundant_per_gpu * gpus, gpus, nodes)

    def cost_of(cadence, **free):
        return cluster_cost(gpus, nodes, "H100", cfg["model"], migration=cadence.migration,
                            copy_schedule=cadence.copy_schedule, replica_choice=ENGINE_REPLICA_CHOICE[engine], **free)

    out = {}
    for split in (False, True):
        result = sweep(counts, cost_of, start, engine, INTERVALS, use_async, cfg.get("groups"), hindsight=False,
                       split=split)
        out["split" if split else "rule"] = result.to_json()
    runs = {name: {(r["policy"], r["step_interval"]): r for r in doc["runs"]} for name, doc in out.items()}
    intervals = sorted({i for _, i in runs["rule"]})
    best = {"default": min(runs["rule"][("default", i)]["total_s"] for i in intervals),
            "rule": min(runs["rule"][("moe-place", i)]["total_s"] for i in intervals),
            "rule + split": min(runs["split"][("moe-place", i)]["total_s"] for i in intervals)}
    same = {i: split_over_rule(runs["split"][("moe-place", i)], runs["rule"][("moe-place", i)]) for i in intervals}
    free = {}
    if ceiling:
        at = min(intervals, key=lambda i: runs["rule"][("moe-place", i)]["total_s"])
        cadence = next(c for c in cadences(engine, INTERVALS, use_async, steps) if c.step_interval == at)
        cost = cost_of(cadence, split_solve_s=0.0, split_allreduce_s=0.0)
        policy = RebalanceRule(cost, layers, experts, num_groups=cfg.get("groups"))
        controller = RuleController(cadence, layers, experts, rule=policy, split_all=True)
        result = CadenceRun.of("moe-place", cadence, replay(counts, controller, cost, start,
                                                          layer_per_step=cadence.layer_per_step,
                                                          policy_in_worker=cadence.policy_in_worker))
        rule = runs["rule"][("moe-place", at)]   # the rule's own CPU time from its run: the choice is free too
        free = {"free_split_at": at,
                "free_split_ratio": (result.expert_s + result.comm_s + result.migration_s + rule["policy_s"])
                / best["default"],
                "free_split_expert_over_rule": result.expert_s / rule["expert_s"]}
    return {"protocol": protocol, "redundant": redundant_per_gpu * gpus, "gpus": gpus, "nodes": nodes,
            "best_s": best, "rule_ratio": best["rule"] / best["default"],
            "split_ratio": best["rule + split"] / best["default"], "split_over_rule_at": same,
            "overhead_s": split_overhead_s(gpus, nodes, DEFAULT_SOLVE_S), **free,
            "sweeps": out}


def split_over_rule(split: dict, rule: dict) -> float:
    """The rule with the split over the rule alone at one cadence, on their totals with the rule's own CPU time
    taken from the run without the split in both (the rule decides the same maps with or without the split; its
    CPU time per call varies by 20% between two identical runs on a shared machine, more than the split
    changes) and the split's choice's CPU time, measured in its run, added where the engine pays for it."""
    paid = split["policy_s"] > 0                          # the engine waits for the policy (SGLang, vLLM sync)
    split_total = (split["expert_s"] + split["comm_s"] + split["migration_s"] + rule["policy_s"]
                   + (split["split_cpu_s"] if paid else 0))
    return split_total / rule["total_s"]


def replay_section(steps: int, progress) -> dict:
    rows = []
    for name in REPLAY_TRACES:
        cluster, spec, label = bench_replay.EVALUATION[name]
        for factor in (1, 2):
            for protocol in PROTOCOLS:
                row = {"trace": name, "label": label, **run_sweeps(spec, cluster, factor, protocol, steps,
                                                                    ceiling=True)}
                row["target"] = TARGET_SPLIT[factor]
                rows.append(row)
                progress(f"{name} R = {factor}G {protocol}: rule {row['rule_ratio']:.4f}, rule + split "
                         f"{row['split_ratio']:.4f}, rule + a free split {row['free_split_ratio']:.4f}")
    met = {f: all(r["split_ratio"] <= TARGET_SPLIT[f] for r in rows if r["redundant"] == f * r["gpus"])
           for f in TARGET_SPLIT}
    choice = max(r["split_ratio"] / r["rule_ratio"] for r in rows)
    return {"rows": rows, "met": met, "choice_worst": choice, "choice_met": choice <= TARGET_CHOICE}


def guard_section(steps: int, progress) -> dict:
    rows = []
    for name, (cluster, spec, per_gpu) in GUARD_TRACES.items():
        for protocol in PROTOCOLS:
            row = {"trace": name, **run_sweeps(spec, cluster, per_gpu, protocol, steps)}
            rows.append(row)
            progress(f"{name} {protocol}: worst rule + split / rule {max(row['split_over_rule_at'].values()):.4f}")
    worst = max(max(r["split_over_rule_at"].values()) for r in rows)
    return {"rows": rows, "worst": worst, "met": worst <= TARGET_GUARD}


# ---------------------------------------------------------------------- 4. what the choice costs
def choice_price_section(repeats: int = 5) -> dict:
    """Seconds per slot of a layer's map row of the split choice's whole call, timed on this thread: a first call
    (`SplitChoice.decide`) on 8 layers of EPLB maps of Dirichlet(0.5) loads and a per-step window of
    `SPLIT_SAMPLES` batches at each of `PRICE_SIZES`, with a fresh cost model each time (its tables cold, as for
    a map row the choice has not seen): charged 1 s a layer, every layer settles at the screen (its price per
    slot); charged nothing, every layer is priced in full (the difference, per slot and batch, the price)."""
    rows = []
    rng = np.random.default_rng(0)
    for gpus, nodes, experts, redundant, model, tokens in PRICE_SIZES:
        slots, layers = experts + redundant, 8
        popularity = rng.dirichlet(np.full(experts, 0.5), size=layers)
        placement = Placement(eplb_rebalance(popularity * 1000, slots, 1, 1, gpus), experts, gpus, nodes,
                              allow_colocated=True)
        window = np.stack([rng.multinomial(tokens * 8, p, size=SPLIT_SAMPLES) for p in popularity], axis=1)
        seconds = {}
        for name, allreduce in (("screen", 1.0), ("full", 0.0)):
            runs = []
            for _ in range(repeats):
                choice = SplitChoice(cluster_cost(gpus, nodes, "H100", model, replica_choice="sglang-static",
                                                  split_solve_s=0.0, split_allreduce_s=allreduce))
                started = time.thread_time()
                choice.decide(None, window, SPLIT_SAMPLES, placement, step=0)
                runs.append(time.thread_time() - started)
            seconds[name] = float(np.median(runs))
        rows.append({"gpus": gpus, "experts": experts, "slots": slots, "tokens": tokens,
                     "screen_s_per_slot": seconds["screen"] / (layers * slots),
                     "price_s_per_slot": (seconds["full"] - seconds["screen"]) / (layers * slots * SPLIT_SAMPLES)})
    most = {key: max(r[key] for r in rows) for key in ("screen_s_per_slot", "price_s_per_slot")}
    met = most["screen_s_per_slot"] <= SCREEN_S_PER_SLOT and most["price_s_per_slot"] <= PRICE_S_PER_SLOT
    return {"rows": rows, "most": most, "met": met}


# ---------------------------------------------------------------------- the command
def report(doc: dict) -> list[str]:
    lines = []
    if "accuracy" in doc:
        a = doc["accuracy"]
        lines.append("accuracy: the fast split's busiest GPU over the whole-row optimum (the LP's, rounded up)")
        lines += [f"  {c['trace']:<40} {c['rows']:>5} rows  mean {c['mean']:.5f}  max {c['max']:.5f}" for c in a["cases"]]
        lines.append(f"  worst {a['worst']:.5f} (target <= {TARGET_ACCURACY}: {'MET' if a['met'] else 'NOT MET'})")
    if "replay" in doc:
        lines.append("replay (evaluation set): best against best over the default's best, every policy with its "
                     "engine's replica choice")
        for r in doc["replay"]["rows"]:
            lines.append(f"  {r['trace']:<28} R={r['redundant']:>3} {r['protocol']:<7} rule {r['rule_ratio']:.4f}  "
                         f"rule + split {r['split_ratio']:.4f} (target <= {r['target']})  overhead "
                         f"{r['overhead_s'] * 1e6:.1f} us/layer"
                         + (f"  rule + a free split {r['free_split_ratio']:.4f} (its expert time "
                            f"{r['free_split_expert_over_rule']:.4f} of the rule's)" if "free_split_ratio" in r else ""))
        for f, met in doc["replay"]["met"].items():
            lines.append(f"  R = {f}G: rule + split <= {TARGET_SPLIT[f]} on every trace and protocol: "
                         f"{'MET' if met else 'NOT MET'}")
        lines.append(f"  the split's choice, rule + split over the rule alone (best against best): worst "
                     f"{doc['replay']['choice_worst']:.4f} (target <= {TARGET_CHOICE}: "
                     f"{'MET' if doc['replay']['choice_met'] else 'NOT MET'})")
    if "guard" in doc:
        g = doc["guard"]
        lines.append("guard: rule + split over the rule alone at every cadence, where the split has nothing to give")
        for r in g["rows"]:
            worst = max(r["split_over_rule_at"].values())
            lines.append(f"  {r['trace']:<28} {r['protocol']:<7} worst {worst:.4f} "
                         f"({', '.join(f'{i}: {v:.4f}' for i, v in r['split_over_rule_at'].items())})")
        lines.append(f"  worst {g['worst']:.4f} (target <= {TARGET_GUARD}: {'MET' if g['met'] else 'NOT MET'})")
    if "choice_price" in doc:
        c = doc["choice_price"]
        lines.append("choice_price: the split choice's CPU per slot of a layer's map row (this core)")
        lines += [f"  G={r['gpus']:>2} E={r['experts']:>3} P={r['slots']:>3} {r['tokens']:>6} tokens  screen "
                  f"{r['screen_s_per_slot'] * 1e6:.3f} us  priced {r['price_s_per_slot'] * 1e6:.3f} us a batch"
                  for r in c["rows"]]
        lines.append(f"  the prices moe-place charges, screen {SCREEN_S_PER_SLOT * 1e6:.3f} us and priced "
                     f"{PRICE_S_PER_SLOT * 1e6:.3f} us, at least the most measured: {'MET' if c['met'] else 'NOT MET'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--sections", default="all",
                        help=f"comma list of {', '.join(SECTIONS)} or all (default all)")
    parser.add_argument("--steps", type=int, default=3000, help="steps of each replayed trace (default 3000)")
    add_record_options(parser, committed=("bench/results/split.json",))
    args = parser.parse_args(argv)
    refuse_overwrite(parser, args)
    sections = SECTIONS if args.sections == "all" else tuple(s for s in args.sections.split(",") if s)
    bad = [s for s in sections if s not in SECTIONS]
    if bad or not sections:
        parser.error(f"--sections: expected a comma list of {', '.join(SECTIONS)} or all, got {args.sections!r}")
    if args.steps < 1100:
        parser.error(f"--steps: expected at least 1100 (the default cadence's first call comes after 1001), "
                     f"got {args.steps}")
    started = time.perf_counter()

    def progress(line: str) -> None:
        print(f"bench_split: {line} ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)

    doc: dict = {"command": [Path(sys.argv[0]).name] + (sys.argv[1:] if argv is None else list(argv)),
                 "steps": args.steps, "intervals": list(INTERVALS), "solve_s": DEFAULT_SOLVE_S}
    try:
        if "accuracy" in sections:
            doc["accuracy"] = accuracy_section()
            progress(f"accuracy: worst {doc['accuracy']['worst']:.5f}")
        if "replay" in sections:
            doc["replay"] = replay_section(args.steps, progress)
        if "guard" in sections:
            doc["guard"] = guard_section(args.steps, progress)
        if "choice_price" in sections:
            doc["choice_price"] = choice_price_section()
            progress(f"choice_price: most {doc['choice_price']['most']}")
    except KeyboardInterrupt:
        return interrupted("bench_split")
    doc["seconds"] = round(time.perf_counter() - started, 1)
    lines = report(doc)
    print("\n".join(lines))
    if args.output_json:
        write_record(args.output_json, doc)
    return missed_targets("bench_split", [line.strip() for line in lines if "NOT MET" in line])


if __name__ == "__main__":
    sys.exit(main())
