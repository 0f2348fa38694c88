"""Online re-planning on drifting traces, under the engines' own protocol: ours against the engine default.

Traces: the drifting domain-mixture generator (`moe_place.online.replay.parse_synthetic`), where
each data domain has its own hot experts and the mix drifts (a random walk of the mixture
logits), so hot spots last tens to hundreds of steps (`hot_spot_steps` in the record).

The protocol is the engine's (`moe_place.online.controller.EngineCadence`), not ours:
- vllm (0.33): the linear start map, the first policy call after `step_interval // 4` steps, then
  every `step_interval` (3000) steps on the load of the last `window_size` (1000) steps summed;
  async moves (`use_async`), one layer per step, a layer's copies batched (parallel schedule).
- sglang (0.5.23): the trivial start map (the same `p % E`), a call every
  `--eplb-rebalance-num-iterations` (1000) passes on the recorder's per-pass counts of as many
  passes; all layers updated at once while serving waits (stall), copies batched.
For each engine and start map (`engine`: the engine's own; `offline`: a plan made from the first
window, what a user loading a plan at start-up has) it replays:
- `default`: the engine's own policy (DeepSeek EPLB; vLLM keeps unmoved experts' slots) at its
  default cadence: the baseline;
- `ours`: moe-place's rule (`moe_place.online.policy.RebalanceRule`, what the vLLM policy and the
  SGLang hook run) at the same cadence;
- `ours@rec` and `default@rec`: both at the cadence moe-place recommends (`RECOMMENDED`, settable
  in the engine's own config: vLLM `--eplb-config '{"step_interval": N, "window_size": N}'`,
  SGLang `--eplb-rebalance-num-iterations N`);
- references without migration cost: `hindsight-static` (one plan for the whole trace, known in
  advance) and `free-replan-16` (a fresh plan every 16 steps from the last 16).
Time = expert-layer time (busiest GPU per layer, summed over layers, cost model) + what serving
pays for migration under the engine's model + the policy's own CPU time per call.

Targets (issue "the online policy must never be worse than the engine's own default"):
- at the engine's default cadence, ours' total time at most the default's on every run, with fewer bytes;
- at the recommended cadence, ours at most 0.90x the default at its default cadence, on average.

    python bench/bench_replay.py [--steps 6000] [--seeds 0,1,2] [--scenarios all] [--engines vllm,sglang] \
        [--starts engine,offline] [--jobs 2] [--out FILE.json] [--plot FILE.png] [--force]

The committed record (bench/results/replay.json and .png; the figure shows the engine start map and
the first seed) comes from:

    python bench/bench_replay.py --seeds 0,1,2 --jobs 2 --out bench/results/replay.json \
        --plot bench/results/replay.png --force
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from moe_place.analysis.persistence import run_lengths
from moe_place.cli.options import add_record_options, refuse_overwrite
from moe_place.cli.output import missed_targets
from moe_place.cost.models import ExpertShape
from moe_place.io import write_atomic, write_json_atomic
from moe_place.online.controller import ENGINES, EngineCadence, initial_map, make_controller
from moe_place.online.costing import cluster_cost
from moe_place.online.plot import render_replay_png
from moe_place.online.policy import RebalanceRule
from moe_place.online.replay import (ReplayResult, free_replan_reference, hindsight_static, initial_placement,
                                     parse_synthetic, replay)

DEEPSEEK_V3_BF16 = ExpertShape("DeepSeek-V3-BF16", 7168, 2048, 256, 8, 58, dtype_bytes=2.0)
SCENARIOS = {
    "1x8-qwen3-30b": dict(spec="drift:steps={steps},layers=8,experts=64,tokens=4096,seed={seed}", gpus=8, nodes=1,
                          model="Qwen3-30B-A3B", label="1 node x 8 H100, 64 experts x 8 layers, 72 slots, 9 MiB experts"),
    "4x8-deepseek-v3": dict(spec="drift:steps={steps},layers=8,experts=256,tokens=16384,domains=8,seed={seed}",
                            gpus=32, nodes=4, model="DeepSeek-V3",
                            label="4 nodes x 8 H100 (EP32), 256 experts x 8 layers, 288 slots, 42 MiB experts"),
    # the same trace and cluster with DeepSeek-V3 experts in BF16 (3*7168*2048*2 = 88 MB each)
    "4x8-deepseek-v3-bf16": dict(spec="drift:steps={steps},layers=8,experts=256,tokens=16384,domains=8,seed={seed}",
                                 gpus=32, nodes=4, model=DEEPSEEK_V3_BF16,
                                 label="4 nodes x 8 H100 (EP32), 256 experts x 8 layers, 288 slots, 84 MiB (88 MB) "
                                       "BF16 experts"),
}
# the cadence moe-place recommends (step_interval, window_size): measured by this bench
RECOMMENDED = {"vllm": (100, 100), "sglang": (100, 100)}
STARTS = ("engine", "offline")
TARGET_AT_RECOMMENDED = 0.90   # ours at the recommended cadence / the default at its own, on average
FREE_REPLAN_EVERY = 16
RESULTS_JSON, RESULTS_PNG = "bench/results/replay.json", "bench/results/replay.png"


def hot_spot_steps(counts: np.ndarray, smooth: int = 16, hot_factor: float = 2.0) -> dict:
    """How long hot spots last in a trace `[steps, layers, E]`: an expert is hot while its `smooth`-step
    mean load exceeds `hot_factor` x its layer's mean; run lengths in steps, over all layers and experts."""
    counts = np.asarray(counts, dtype=np.float64)
    total = np.concatenate([np.zeros((1,) + counts.shape[1:]), np.cumsum(counts, axis=0)])
    mean = (total[smooth:] - total[:-smooth]) / smooth                  # [steps - smooth + 1, layers, E]
    hot = mean > hot_factor * mean.mean(axis=-1, keepdims=True)
    runs = run_lengths(np.moveaxis(hot, 0, 1))                                  # [layers, windows, E]
    if runs.size == 0:
        return {"runs": 0}
    return {"runs": int(runs.size), "median": float(np.median(runs)), "mean": float(runs.mean()),
            "p90": float(np.percentile(runs, 90))}


def run_scenario(name: str, steps: int, seed: int, engines: tuple[str, ...] = ENGINES,
                 starts: tuple[str, ...] = STARTS) -> tuple[dict, dict]:
    """One trace and cluster under each engine's protocol (module note). Returns the summary and
    `{(engine, start): {run name: ReplayResult}}` (references included)."""
    cfg = SCENARIOS[name]
    counts, params = parse_synthetic(cfg["spec"].format(steps=steps, seed=seed))
    _, layers, experts = counts.shape
    gpus, nodes = cfg["gpus"], cfg["nodes"]
    physical = experts + gpus
    runs: dict = {}
    summary: dict = {"scenario": name, "label": cfg["label"], "trace": params, "hot_spot_steps": hot_spot_steps(counts),
                     "gpus": gpus, "nodes": nodes, "physical": physical, "engines": {}}
    for engine in engines:
        default_cadence = EngineCadence.of(engine)
        recommended = EngineCadence.of(engine, *RECOMMENDED[engine])
        cost = cluster_cost(gpus, nodes, "H100", cfg["model"], migration=default_cadence.migration,
                            copy_schedule=default_cadence.copy_schedule)
        summary.update(model=cost.model.name, expert_bytes=cost.expert_bytes)
        references = {"hindsight-static": hindsight_static(counts, cost, physical, nodes)}
        for start_kind in starts:
            start = (initial_map(layers, experts, physical, gpus, nodes) if start_kind == "engine" else
                     initial_placement(counts, gpus, physical, nodes, window=default_cadence.window_size))
            results: dict[str, ReplayResult] = {}
            for label, kind, cadence in (("default", "engine-default", default_cadence),
                                         ("ours", "ours", default_cadence),
                                         ("default@rec", "engine-default", recommended),
                                         ("ours@rec", "ours", recommended)):
                controller = make_controller(kind, cadence, layers, experts,
                                             rule=RebalanceRule(cost, layers, experts))
                results[label] = replay(counts, controller, cost, start, layer_per_step=cadence.layer_per_step)
            results[f"free-replan-{FREE_REPLAN_EVERY}"] = free_replan_reference(counts, cost, start, FREE_REPLAN_EVERY)
            results.update(references)
            runs[(engine, start_kind)] = results
            base = results["default"]
            summary["engines"].setdefault(engine, {"cadence": [default_cadence.step_interval,
                                                               default_cadence.window_size],
                                                   "recommended": list(RECOMMENDED[engine]),
                                                   "migration": default_cadence.migration,
                                                   "copy_schedule": default_cadence.copy_schedule, "starts": {}})
            summary["engines"][engine]["starts"][start_kind] = {
                "results": {k: r.to_json(per_step=False) for k, r in results.items()},
                "ours_vs_default": results["ours"].total_time_s / base.total_time_s,
                "ours_bytes_vs_default": results["ours"].total_bytes_moved / max(base.total_bytes_moved, 1),
                "ours_rec_vs_default": results["ours@rec"].total_time_s / base.total_time_s,
                "default_rec_vs_default": results["default@rec"].total_time_s / base.total_time_s,
                "ours_rec_bytes_vs_default_rec":
                    results["ours@rec"].total_bytes_moved / max(results["default@rec"].total_bytes_moved, 1),
                "at_most_default_with_fewer_bytes": bool(
                    results["ours"].total_time_s <= base.total_time_s
                    and results["ours"].total_bytes_moved < base.total_bytes_moved),
            }
    return summary, runs


def table(summary: dict, engine: str, start: str) -> str:
    run = summary["engines"][engine]["starts"][start]
    base = run["results"]["default"]["total_time_s"]
    life = summary["hot_spot_steps"]
    lines = [f"{summary['scenario']} seed {summary['trace']['seed']}, {engine} protocol, {start} start map: "
             f"{summary['label']}; hot spots last {life.get('median', 0):.0f} steps (median), "
             f"{life.get('mean', 0):.0f} (mean), {life.get('p90', 0):.0f} (p90)",
             f"{'run':<20}{'total s':>10}{'expert s':>10}{'migr. s':>9}{'policy s':>9}{'rebal.':>8}{'GiB moved':>11}"
             f"{'vs default':>12}"]
    for name, r in run["results"].items():
        lines.append(f"{name:<20}{r['total_time_s']:>10.3f}{r['total_expert_time_s']:>10.3f}"
                     f"{r['total_migration_time_s']:>9.3f}{r['total_policy_time_s']:>9.3f}{r['rebalances']:>8}"
                     f"{r['bytes_moved'] / 2**30:>11.2f}{r['total_time_s'] / base:>12.4f}")
    lines.append(f"ours/default {run['ours_vs_default']:.4f} (target <= 1) with {run['ours_bytes_vs_default']:.2f}x "
                 f"the bytes (target < 1): {'MET' if run['at_most_default_with_fewer_bytes'] else 'NOT MET'}; "
                 f"at the recommended cadence ours/default {run['ours_rec_vs_default']:.4f}, "
                 f"default/default {run['default_rec_vs_default']:.4f}")
    return "\n".join(lines)


def targets(summaries: list[dict]) -> tuple[list[str], list[str]]:
    """The two targets of the module note over every run: lines to print, and the targets missed."""
    lines, missed = [], []
    for engine in sorted({e for s in summaries for e in s["engines"]}):
        for start in STARTS:
            cells = [s["engines"][engine]["starts"][start] for s in summaries
                     if engine in s["engines"] and start in s["engines"][engine]["starts"]]
            if not cells:
                continue
            every = all(c["at_most_default_with_fewer_bytes"] for c in cells)
            worst = max(c["ours_vs_default"] for c in cells)
            mean_rec = float(np.mean([c["ours_rec_vs_default"] for c in cells]))
            if not every:
                missed.append(f"{engine}, {start} start: default cadence ours/default <= 1 with fewer bytes on every "
                              f"run (worst {worst:.4f})")
            if mean_rec > TARGET_AT_RECOMMENDED:
                missed.append(f"{engine}, {start} start: recommended cadence ours/default mean {mean_rec:.4f} > "
                              f"{TARGET_AT_RECOMMENDED}")
            lines.append(f"{engine}, {start} start: default cadence ours/default worst {worst:.4f}, fewer bytes on "
                         f"{sum(c['ours_bytes_vs_default'] < 1 for c in cells)}/{len(cells)} runs "
                         f"({'MET' if every else 'NOT MET'}); recommended cadence {RECOMMENDED[engine]} ours/default "
                         f"mean {mean_rec:.4f} (target <= {TARGET_AT_RECOMMENDED}: "
                         f"{'MET' if mean_rec <= TARGET_AT_RECOMMENDED else 'NOT MET'})")
    return lines, missed


def _run_job(job: tuple) -> tuple[dict, dict]:
    return run_scenario(*job)


def _comma(choices: tuple[str, ...]):
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(x for x in text.split(",") if x)
        if text == "all":
            return choices
        bad = [x for x in items if x not in choices]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(choices)} (or all), got {text!r}")
        return items
    return parse


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(s < 0 for s in seeds):
        raise argparse.ArgumentTypeError(f"expected seeds >= 0, got {text!r}")
    return seeds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=_positive, default=6000, help="steps per trace (default 6000)")
    parser.add_argument("--seeds", type=_seeds, default=[0], help="trace seeds, e.g. 0,1,2 (default 0)")
    parser.add_argument("--scenarios", type=_comma(tuple(SCENARIOS)), default=tuple(SCENARIOS),
                        help=f"comma list of {', '.join(SCENARIOS)} (default all)")
    parser.add_argument("--engines", type=_comma(ENGINES), default=ENGINES, help="vllm,sglang (default both)")
    parser.add_argument("--starts", type=_comma(STARTS), default=STARTS, help="engine,offline (default both)")
    parser.add_argument("--jobs", type=_positive, default=1,
                        help=f"scenario runs in parallel processes, at most the cores ({os.cpu_count()}; default 1)")
    add_record_options(parser, plot=True, committed=(RESULTS_JSON, RESULTS_PNG))
    args = parser.parse_args(argv)
    if args.jobs > (os.cpu_count() or 1):
        parser.error(f"--jobs: expected at most the {os.cpu_count()} cores, got {args.jobs}")
    refuse_overwrite(parser, args)
    jobs = [(name, args.steps, seed, args.engines, args.starts) for name in args.scenarios for seed in args.seeds]
    started = time.perf_counter()
    if args.jobs > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            runs = list(pool.map(_run_job, jobs))
    else:
        runs = [_run_job(job) for job in jobs]
    summaries = [s for s, _ in runs]
    for summary in summaries:
        for engine in summary["engines"]:
            for start in summary["engines"][engine]["starts"]:
                print(table(summary, engine, start) + "\n", flush=True)
    lines, missed = targets(summaries)
    print("\n".join(lines))
    if args.output_json:
        write_json_atomic(args.output_json, {"steps": args.steps, "seeds": args.seeds, "recommended": RECOMMENDED,
                                     "policy_time": "CPU seconds of the policy's calls (time.thread_time)",
                                     "wall_s": time.perf_counter() - started, "runs": summaries})
    if args.plot:
        write_atomic(args.plot, render_replay_png([
            (f"{s['scenario']} seed {s['trace']['seed']} ({engine}, engine start)",
             {k: r for k, r in results.items() if k in ("default", "ours", "default@rec", "ours@rec")})
            for s, by_run in runs for (engine, start), results in by_run.items()
            if start == "engine" and s["trace"]["seed"] == args.seeds[0]]))   # one seed: the figure stays readable
    return missed_targets("bench_replay", missed)


if __name__ == "__main__":
    sys.exit(main())
