"""Placement for the per-batch split, held out: plans made for the split against EPLB's and `fast`'s, all judged
with the same per-batch split on steps they were not made on.

Three plans per fold, from the same planning steps: EPLB's (`eplb_rebalance` on the steps summed), `fast`'s
(the default `moe-place plan`), and the split's (`plan_for_split` from those two, on the planning steps as
`moe-place plan --split per-batch` cuts them: what that command writes). Each is judged with `split_shares`
on every held-out step: the busiest GPU's rows summed over layers over the mean GPU's rows, averaged over the
held-out steps (busiest/mean, 1 = perfect balance); "vs EPLB" is the relative change of that figure.

- real: the bundled Qwen3-30B-A3B trace (3 recorded prefill batches), EP 16/32/64 with R = G and 2G; plan on
  one batch and judge on the other two (3 folds), and plan on two and judge on the third (3 folds).
- drift: drifting synthetic traces (`drift:experts=256,top_k=8`, 4,096 tokens a step), EP32 with R = 32 and
  64; plan on the first `--window` steps, judge on the next 100 and on the next `--judge` steps. The reported
  seeds are 200 and up; the planner's constants were tuned on seeds 1-8 (solvers/split_placement.py).
- tune (`--tune`, instead of the above): the drift rows' split placement at each `--gains` deviation gain
  (solvers/split_placement.py, step 1) on the tuning seeds 1-8, held out against EPLB.

    python bench/bench_split_placement.py [--ep 16,32,64] [--seeds 200,201,202,203,204] [--out FILE [--force]]
    python bench/bench_split_placement.py --tune [--seeds 1,2,3,4,5,6,7,8] [--gains 1,2,3] [--out FILE [--force]]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from moe_place.online.replay import parse_synthetic
from moe_place.problem import PlacementProblem
from moe_place.solvers import solve
from moe_place.solvers.deepseek import eplb_rebalance
from moe_place.solvers.split_placement import plan_for_split, planning_pieces, split_busiest_over_mean
from moe_place.traces.bundled import bundled_path
from moe_place.traces.load import load_trace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import add_record_options, refuse_overwrite, write_record  # noqa: E402  (bench/ is not a package)

PLANS = ("eplb", "fast", "split")
DRIFT_SEEDS = "200,201,202,203,204"   # reported seeds: 200 and up
TUNING_SEEDS = "1,2,3,4,5,6,7,8"      # the seeds the planner's constants were chosen on (--tune)
NEAR = 100  # the drift rows' first judged window: the next 100 steps


def timed(fn, *args, **kwargs):
    """(result, seconds) of one call: the benchmark's only timing helper."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def three_plans(summed: np.ndarray, pieces: np.ndarray, gpus: int, physical: int, seed: int) -> tuple[dict, float]:
    """({plan name: phy2log [layers, P]}, seconds of the split's placement) from the planning steps' loads
    summed `[layers, E]` and the pieces the split plans on `[T, layers, E]`."""
    eplb = eplb_rebalance(summed, physical, 1, 1, gpus)
    fast = solve(PlacementProblem(summed, gpus, physical, seed=seed), "fast").placement.phy2log
    split, seconds = timed(plan_for_split, np.stack([fast, eplb]), pieces, gpus, seed=seed)
    return {"eplb": eplb, "fast": fast, "split": split.phy2log}, seconds


def judge(plans: dict, steps: np.ndarray, gpus: int) -> dict:
    """{plan name: mean over `steps [T, layers, E]` of busiest/mean under the per-batch split}."""
    return {name: float(split_busiest_over_mean(plan, steps, gpus).mean()) for name, plan in plans.items()}


def real_rows(eps: list[int], redundancy: list[str]) -> list[dict]:
    trace = load_trace(bundled_path("qwen3-30b-a3b_prefill_topk.npz"))
    steps = trace.step_counts()
    experts = trace.num_experts
    folds = [("plan on 1 batch, judge on 2", [k], [j for j in range(3) if j != k]) for k in range(3)]
    folds += [("plan on 2 batches, judge on 1", [j for j in range(3) if j != k], [k]) for k in range(3)]
    rows = []
    for gpus in eps:
        for token in redundancy:
            redundant = {"G": gpus, "2G": 2 * gpus}.get(token) or int(token)
            for protocol in dict.fromkeys(name for name, _, _ in folds):
                per_fold = []
                for name, train, test in folds:
                    if name != protocol:
                        continue
                    part = trace.select_steps(train)
                    pieces, _ = planning_pieces(part)
                    plans, seconds = three_plans(steps[train].sum(axis=0).astype(np.float64), pieces, gpus,
                                                 experts + redundant, 0)
                    per_fold.append({"plan_steps": train, "judge_steps": test, "split_plan_s": seconds,
                                     "in_sample": judge(plans, steps[train], gpus),
                                     "held_out": judge(plans, steps[test], gpus)})
                rows.append(summarise("real", protocol, gpus, redundant, per_fold))
                print(f"real EP{gpus}+{redundant} {protocol}: split vs EPLB {rows[-1]['split_vs_eplb']:+.2%}",
                      file=sys.stderr)
    return rows


def drift_rows(seeds: list[int], redundancy: list[int], gpus: int, layers: int, window: int, judged: int) -> list[dict]:
    rows = []
    for redundant in redundancy:
        near, far = [], []
        for seed in seeds:
            counts, _ = parse_synthetic(f"drift:steps={window + judged},layers={layers},experts=256,top_k=8,"
                                        f"seed={seed}")
            train = counts[:window]
            plans, seconds = three_plans(train.sum(axis=0).astype(np.float64), train, gpus, 256 + redundant, 0)
            held = {name: split_busiest_over_mean(plan, counts[window:], gpus) for name, plan in plans.items()}
            in_sample = judge(plans, train, gpus)
            for bucket, stop in ((near, NEAR), (far, judged)):
                bucket.append({"seed": seed, "plan_steps": [0, window], "judge_steps": [window, window + stop],
                               "split_plan_s": seconds, "in_sample": in_sample,
                               "held_out": {name: float(v[:stop].mean()) for name, v in held.items()}})
        rows.append(summarise("drift", f"plan on {window} steps, judge on the next {NEAR}", gpus, redundant, near))
        rows.append(summarise("drift", f"plan on {window} steps, judge on the next {judged}", gpus, redundant, far))
        print(f"drift EP{gpus}+{redundant}: split vs EPLB {rows[-2]['split_vs_eplb']:+.2%} (next {NEAR}), "
              f"{rows[-1]['split_vs_eplb']:+.2%} (next {judged})", file=sys.stderr)
    return rows


def tuning_rows(seeds: list[int], redundancy: list[int], gains: list[float], gpus: int, layers: int, window: int,
                judged: int) -> list[dict]:
    """Per seed, R and deviation gain: the split's placement against EPLB's, judged on the next `judged` steps."""
    rows = []
    for redundant in redundancy:
        for seed in seeds:
            counts, _ = parse_synthetic(f"drift:steps={window + judged},layers={layers},experts=256,top_k=8,"
                                        f"seed={seed}")
            train, test = counts[:window], counts[window:]
            summed = train.sum(axis=0).astype(np.float64)
            eplb = eplb_rebalance(summed, 256 + redundant, 1, 1, gpus)
            fast = solve(PlacementProblem(summed, gpus, 256 + redundant), "fast").placement.phy2log
            base = float(split_busiest_over_mean(eplb, test, gpus).mean())
            for gain in gains:
                plan = plan_for_split(np.stack([fast, eplb]), train, gpus, deviation_gain=gain).phy2log
                held = float(split_busiest_over_mean(plan, test, gpus).mean())
                rows.append({"seed": seed, "ep": gpus, "redundant": redundant, "deviation_gain": gain,
                             "eplb_held_out": base, "split_held_out": held, "split_vs_eplb": held / base - 1})
            print(f"tune EP{gpus}+{redundant} seed {seed}: " + ", ".join(
                f"gain {r['deviation_gain']:g} {r['split_vs_eplb']:+.2%}" for r in rows[-len(gains):]), file=sys.stderr)
    return rows


def tuning_table(rows: list[dict]) -> str:
    gains = list(dict.fromkeys(r["deviation_gain"] for r in rows))
    lines = [f"{'config':<10} " + " ".join(f"{'gain ' + format(g, 'g'):>10}" for g in gains)]
    for config in dict.fromkeys((r["ep"], r["redundant"]) for r in rows):
        mine = [r for r in rows if (r["ep"], r["redundant"]) == config]
        lines.append(f"{'EP' + str(config[0]) + '+' + str(config[1]):<10} " + " ".join(
            f"{np.mean([r['split_vs_eplb'] for r in mine if r['deviation_gain'] == g]):>+10.2%}" for g in gains))
    return "\n".join(lines)


def summarise(case: str, protocol: str, gpus: int, redundant: int, folds: list[dict]) -> dict:
    """One table row: the means over folds, the split's change against EPLB (mean, best and worst fold)."""
    held = {name: float(np.mean([f["held_out"][name] for f in folds])) for name in PLANS}
    inside = {name: float(np.mean([f["in_sample"][name] for f in folds])) for name in PLANS}
    changes = [f["held_out"]["split"] / f["held_out"]["eplb"] - 1 for f in folds]
    return {"case": case, "protocol": protocol, "ep": gpus, "redundant": redundant, "folds": folds,
            **{f"{name}_held_out": held[name] for name in PLANS},
            **{f"{name}_in_sample": inside[name] for name in PLANS},
            "split_vs_eplb": held["split"] / held["eplb"] - 1, "fast_vs_eplb": held["fast"] / held["eplb"] - 1,
            "split_vs_fast": held["split"] / held["fast"] - 1,
            "split_vs_eplb_best_fold": float(min(changes)), "split_vs_eplb_worst_fold": float(max(changes)),
            "split_in_sample_vs_eplb": inside["split"] / inside["eplb"] - 1,
            "split_plan_s": float(np.mean([f["split_plan_s"] for f in folds]))}


def table(rows: list[dict]) -> str:
    lines = [f"{'case':<6} {'config':<10} {'protocol':<38} {'eplb':>7} {'fast':>7} {'split':>7} {'split vs eplb':>13} "
             f"{'folds best/worst':>17} {'fast vs eplb':>12} {'in-sample':>9} {'plan s':>7}"]
    for r in rows:
        lines.append(f"{r['case']:<6} {'EP' + str(r['ep']) + '+' + str(r['redundant']):<10} {r['protocol']:<38} "
                     f"{r['eplb_held_out']:>7.4f} {r['fast_held_out']:>7.4f} {r['split_held_out']:>7.4f} "
                     f"{r['split_vs_eplb']:>+13.2%} {r['split_vs_eplb_best_fold']:>+8.2%}/{r['split_vs_eplb_worst_fold']:<+8.2%} "
                     f"{r['fast_vs_eplb']:>+12.2%} {r['split_in_sample_vs_eplb']:>+9.2%} {r['split_plan_s']:>7.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", default="16,32,64", help="EP sizes of the real rows (default 16,32,64)")
    parser.add_argument("--redundant", default="G,2G", help="redundant experts of the real rows: G, 2G or integers "
                                                            "(default G,2G)")
    parser.add_argument("--seeds", default=DRIFT_SEEDS,
                        help="drift seeds (default 200-204; the planner was tuned on seeds 1-8)")
    parser.add_argument("--drift-redundant", default="32,64", help="redundant experts of the drift rows (default 32,64)")
    parser.add_argument("--layers", type=int, default=4, help="layers of each drift trace (default 4)")
    parser.add_argument("--window", type=int, default=100, help="drift steps planned on (default 100)")
    parser.add_argument("--judge", type=int, default=1000, help="drift steps judged after the window (default 1000)")
    parser.add_argument("--skip-real", action="store_true", help="only the drift rows")
    parser.add_argument("--skip-drift", action="store_true", help="only the real rows")
    parser.add_argument("--tune", action="store_true",
                        help="instead: the split's placement at each --gains deviation gain on the drift rows of "
                             "--seeds (default 1-8, the tuning seeds)")
    parser.add_argument("--gains", default="1,2,3", help="with --tune: deviation gains to try (default 1,2,3)")
    add_record_options(parser, committed=("bench/results/split_placement.json",
                                          "bench/results/split_placement_tuning.json"))
    args = parser.parse_args(argv)
    refuse_overwrite(parser, args)
    if args.tune:
        seeds = [int(s) for s in (args.seeds if args.seeds != DRIFT_SEEDS else TUNING_SEEDS).split(",")]
        rows = tuning_rows(seeds, [int(x) for x in args.drift_redundant.split(",")],
                           [float(g) for g in args.gains.split(",")], 32, args.layers, args.window, args.judge)
        print(f"drift, seeds {args.seeds if args.seeds != DRIFT_SEEDS else TUNING_SEEDS}: the split's placement "
              "against EPLB's, held-out busiest/mean under the per-batch split, mean over seeds")
        print(tuning_table(rows))
        if args.output_json:
            write_record(args.output_json, {"seeds": seeds, "drift_layers": args.layers, "drift_window":
                                            args.window, "drift_judged": args.judge, "rows": rows})
        return 0
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = [] if args.skip_real else real_rows([int(x) for x in args.ep.split(",")], args.redundant.split(","))
    if not args.skip_drift:
        rows += drift_rows(seeds, [int(x) for x in args.drift_redundant.split(",")], 32, args.layers, args.window,
                           args.judge)
    print("held-out busiest/mean GPU rows under the per-batch split of each step (1 = perfect balance); "
          "split vs eplb: its relative change, mean over folds (best/worst fold)")
    print(table(rows))
    if args.output_json:
        write_record(args.output_json, {"trace": "qwen3-30b-a3b_prefill_topk.npz", "drift_seeds": seeds,
                                        "tuning_seeds": "1-8", "drift_layers": args.layers,
                                        "drift_window": args.window, "drift_judged": args.judge, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
