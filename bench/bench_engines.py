"""moe-place's policy inside the engines' own rebalance code, against the engine's default.

Runs `bench/inengine/harness.py`: each engine's real rebalance machinery (vLLM 0.33 `EplbState`, SGLang 0.5.23
`EPLBManager`, when importable) or its stand-in (`standin-vllm`, `standin-sglang`: CI), from the engine's own
start map at its own cadence, with its default policy and with moe-place's (`install()` /
`install_rebalance_hook()`), on
1. a stationary Dirichlet-skewed load for `--stationary-calls` policy calls, then a new popularity for
   `--changed-calls` more, on each of `--sizes`; per call a table of both policies side by side
   (busiest/mean GPU load of the steps the map serves, slots changed, MiB copied between GPUs, policy
   seconds), and the targets: busiest/mean at most 1% above the default's after every call (calls whose
   served steps span the change are shown, not judged), fewer slots and bytes over the run, no slot moved
   on the stationary calls after the first (sampling noise alone), every group inside one node on a
   hierarchical size;
2. the replay's drifting traces (`--drift`, bench_replay.py SCENARIOS, `--steps` long, `--seed`), priced on
   the cost model (expert-layer time + what serving pays for migration under the engine's model, a layer's
   copies batched + the policy's CPU time where the engine waits for it: not in vLLM's async worker), both
   policies at every cadence `moe-place cadence` tries (10 to 1000 steps, window = interval) and the engine's
   default. Beside every engine run, the replay's prediction of it (`replay_total_s`, with expert, migration,
   policy time and bytes: the same trace, cluster, policy, protocol and cadence through
   `moe_place.online.cadence.sweep`, the default by the engine's own code), and per scenario what `moe-place
   cadence` advises (`advised`: each policy's best cadence in that replay). Targets: at the engine's default
   cadence moe-place at most the default's total time with fewer bytes; at every cadence run, moe-place at most
   `SAME_CADENCE` x the default; best against best (each policy's best of the cadences run) at most
   `BEST_AGAINST_BEST` x the default's, on every trace; every prediction within `PREDICTION_TOLERANCE` of the
   engine's total; the advised cadence within `ADVICE_TOLERANCE` of the best of the engine's sweep, each policy.
   The policy's CPU time is measured in each run apart (the replay's and the engine's), so two runs differ by
   that noise; `replay_model_error` gives the error without it, and where the engine waits for the policy
   (SGLang, vLLM sync) `repeatability` measures the run the CPU time weighs most in `--repeat-runs` more times:
   the spread of identical runs' totals, which no prediction of the total can beat on the machine.
Each target is printed PASS/FAIL with its numbers; exit status 1 if any fails. `--out` writes the record
(JSON, with the engine, torch and numpy versions, the commit it ran, whether the rule's files were as
committed, and a digest of each of them, `inengine.harness.RULE_FILES`: tests/test_engines_records.py fails
once one of them changed after the record); it refuses to overwrite a file unless `--force`.

Real engines live in their own environments; put moe-place on the path as installed (its package-dir
mapping) and run, e.g.:

    PYTHONPATH=OVERLAY /path/to/vllm-venv/bin/python bench/bench_engines.py --engine vllm --out vllm.json
    PYTHONPATH=OVERLAY /path/to/sglang-venv/bin/python bench/bench_engines.py --engine sglang --out sglang.json

The committed records ran each engine on a core of its own (`taskset -c 0` / `taskset -c 1`, nothing else
running on it) with torch's intra-op threads at 1 (`--torch-threads`, recorded with `cores_allowed` in the
record's `machine`).
    python bench/bench_engines.py --engine standin-vllm,standin-sglang --sizes 1x8-e64 --drift none
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

from moe_place.engines.config import EngineConfig
from moe_place.online.cadence import DEFAULT_INTERVALS, CadenceSweep, sweep
from moe_place.online.controller import initial_map
from moe_place.online.policy import RebalanceRule
from moe_place.progress import ProgressBar

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_replay  # noqa: E402 - bench/, beside this script: its SCENARIOS
from inengine import harness, torch_threads  # noqa: E402 - bench/inengine, the in-engine kit
from moe_place.online import engine_default  # noqa: E402
from records import (add_record_options, interrupted, machine, missed_targets, refuse_overwrite,  # noqa: E402
                     write_record)

VLLM_MODES = ("async", "sync")


def _list(choices: tuple[str, ...] | list[str], allow_none: bool = False):
    def parse(text: str) -> list[str]:
        if text == "all":
            return list(choices)
        if allow_none and text == "none":
            return []
        items = [t for t in text.split(",") if t]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(choices)} or all, got {text!r}")
        return items
    return parse


def _runs(engines: list[str], modes: list[str]) -> list[tuple[str, bool]]:
    """(engine, use_async) pairs: vLLM engines once per mode, SGLang engines once."""
    return [(e, m == "async") for e in engines for m in (modes if "vllm" in e else ["stall"])]


def _label(engine: str, use_async: bool) -> str:
    return f"{engine} {'async' if use_async else 'sync'}" if "vllm" in engine else engine


def _run(engine, policy, size, counts, cadence, use_async, quiet):
    bar = ProgressBar(len(counts), f"{engine} {policy} {size.name}", "steps", enabled=None if not quiet else False)
    try:
        return harness.run_engine(engine, policy, size, counts, cadence, use_async, on_step=lambda _: bar.advance())
    finally:
        bar.close()


def workload_section(engine: str, use_async: bool, size, args) -> tuple[dict, list]:
    cadence = harness.default_cadence(engine)
    workload = harness.skewed_workload(size, engine, cadence["step_interval"], args.stationary_calls,
                                       args.changed_calls, args.seed)
    rows = {}
    for policy in harness.POLICIES:
        run = _run(engine, policy, size, workload.counts, cadence, use_async, args.quiet)
        rows[policy] = harness.rebalance_rows(run, workload, size)
    label = f"{_label(engine, use_async)} {size.name}"
    targets = harness.judge_workload(label, rows["default"], rows["moe-place"], size, args.stationary_calls)
    print(workload_table(label, size, workload, cadence, rows))
    for target in targets:
        print("  " + target.line())
    print(flush=True)
    record = {"engine": engine, "async": use_async, "size": size.name, "cadence": cadence,
              "workload": workload.description, "change_step": workload.change_step, "rows": rows,
              "targets": [t.__dict__ for t in targets]}
    return record, targets


def workload_table(label: str, size, workload, cadence: dict, rows: dict) -> str:
    kind = "hierarchical" if size.hierarchical else "global"
    lines = [f"{label}: {size.experts} experts + {size.redundant} redundant on {size.gpus} GPUs ({size.nodes} "
             f"node{'s' if size.nodes > 1 else ''}), {size.layers} layers, {kind}; cadence {cadence}; "
             f"{workload.description}",
             f"{'call':>4} {'step':>6} | {'default: b/m':>12} {'slots':>6} {'MiB':>8} {'cpu s':>6} | "
             f"{'moe-place: b/m':>14} {'slots':>6} {'MiB':>8} {'cpu s':>6} | note"]
    for d, o in zip(rows["default"], rows["moe-place"]):
        note = []
        if d["stale"]:
            note.append("workload changed: not judged")
        for who, r in (("default", d), ("moe-place", o)):
            if r.get("groups_inside_nodes") is False:
                note.append(f"{who}: a group spans nodes")
            if r["applied"] is False:
                note.append(f"{who}: engine ran another map")
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        lines.append(f"{d['call']:>4} {d['step']:>6} | {fmt(d['busiest_over_mean']):>12} {d['slots_changed']:>6} "
                     f"{d['bytes_moved'] / 2**20:>8.0f} {d['policy_s']:>6.3f} | {fmt(o['busiest_over_mean']):>14} "
                     f"{o['slots_changed']:>6} {o['bytes_moved'] / 2**20:>8.0f} {o['policy_s']:>6.3f} | "
                     + "; ".join(note))
    return "\n".join(lines)


def replay_sweep(engine: str, use_async: bool, size, counts: np.ndarray, steps: int) -> CadenceSweep:
    """What `moe-place cadence` runs for this trace, cluster and protocol (`moe_place.online.cadence.sweep` at its
    intervals and the engine's default): both policies, the default by the engine's own code where the engine
    is importable (the stand-ins: moe-place's numpy port), the rule as the adapters build it (EngineConfig's
    defaults, the engine's groups). Its runs are the replay's predictions of the engine runs; its bests are the
    advice."""
    name = "sglang" if "sglang" in engine else "vllm"
    groups = size.groups if name == "sglang" else size.vllm_groups
    default_plan = engine_default.default_plan(name, groups) if engine in engine_default.ENGINES else None
    config = EngineConfig()
    start = initial_map(size.layers, size.experts, size.physical, size.gpus, size.nodes)
    return sweep(counts, lambda cadence: size.cost(cadence.migration), start, name, DEFAULT_INTERVALS, use_async,
                 groups, rule_of=lambda cost: RebalanceRule(cost, size.layers, size.experts, num_groups=groups,
                                                            min_gain=config.min_gain, noise_margin=config.noise_margin,
                                                            estimate=config.estimate),
                 hindsight=False, default_plan=default_plan)


def drift_section(engine: str, use_async: bool, args, scenarios: dict) -> tuple[list, list]:
    label = _label(engine, use_async)
    records, at_default, rows, predictions, advice = [], [], [], [], []
    print(f"{label}: drifting traces, {args.steps} steps, seed {args.seed}; total = expert time + dispatch/combine "
          f"+ migration ({'async' if use_async else 'stall'}) + the policy's CPU time"
          f"{' (not paid: the async worker)' if use_async else ''}; every cadence of `moe-place cadence`, the replay's "
          f"prediction beside each run (error: on the total; model: on the model's time, without the "
          f"policy's CPU time, which two runs measure apart)")
    print(f"{'scenario':<22} {'policy':<10} {'every':>6} {'expert s':>9} {'comm s':>8} {'migr. s':>8} {'policy s':>9} "
          f"{'total s':>9} {'GiB':>7} {'calls':>6} {'vs default':>10} {'replay s':>9} {'error':>7} {'model':>7}")
    for scenario in args.drift:
        size = harness.drift_size(scenario, scenarios)
        workload = harness.drift_workload(scenario, scenarios, args.steps, args.seed)
        replay = replay_sweep(engine, use_async, size, workload.counts, args.steps)
        advised = {policy: replay.best(policy).step_interval for policy in harness.POLICIES}
        priced = {}
        for interval in replay.intervals():
            predicted = {run.policy: run for run in replay.runs if run.step_interval == interval}
            for policy in harness.POLICIES:
                cadence = dict(step_interval=interval, window=predicted[policy].window)
                run = _run(engine, policy, size, workload.counts, cadence, use_async, args.quiet)
                p = {"scenario": scenario, "policy": policy, "cadence": run.cadence,
                     "at": "default" if interval == replay.default_interval else f"every {interval}",
                     **harness.price_run(run, workload.counts, size)}
                guess = predicted[policy]
                p.update(replay_total_s=guess.total_s, replay_expert_s=guess.expert_s, replay_comm_s=guess.comm_s,
                         replay_migration_s=guess.migration_s, replay_policy_s=guess.policy_s,
                         replay_bytes_moved=guess.bytes_moved, replay_error=guess.total_s / p["total_s"] - 1.0,
                         replay_model_error=(guess.expert_s + guess.comm_s + guess.migration_s) / p["model_s"] - 1.0)
                priced[(interval, policy)] = p
        for (interval, policy), p in priced.items():
            base = priced[(interval, "default")]["total_s"]
            print(f"{scenario:<22} {policy:<10} {interval:>6} {p['expert_s']:>9.3f} {p['comm_s']:>8.3f} "
                  f"{p['migration_s']:>8.3f} {p['policy_s']:>9.3f} {p['total_s']:>9.3f} {p['bytes_moved'] / 2**30:>7.2f} {p['calls']:>6} "
                  f"{p['total_s'] / base:>10.3f} {p['replay_total_s']:>9.3f} {p['replay_error']:>+7.2%} "
                  f"{p['replay_model_error']:>+7.2%}")
        if replay.default_interval:
            at_default.append((priced[(replay.default_interval, "default")],
                               priced[(replay.default_interval, "moe-place")]))
        rows.append({"scenario": scenario, "runs": list(priced.values())})
        predictions += [(scenario, interval, policy, p["replay_error"]) for (interval, policy), p in priced.items()]
        for policy in harness.POLICIES:
            best = min(p["total_s"] for (_, who), p in priced.items() if who == policy)
            advice.append((scenario, policy, advised[policy], priced[(advised[policy], policy)]["total_s"] / best))
        record = {"engine": engine, "async": use_async, "scenario": scenario, "workload": workload.description,
                  "advised": advised, "replay_intervals": replay.intervals(), "runs": list(priced.values())}
        if not use_async and args.repeat_runs:
            record["repeatability"] = repeatability(engine, size, workload.counts, priced, args)
        records.append(record)
    targets = (harness.judge_drift(label, at_default) + harness.judge_cadences(label, rows)
               + harness.judge_predictions(label, predictions) + harness.judge_advice(label, advice))
    for target in targets:
        print("  " + target.line())
    print(flush=True)
    return records, targets


def repeatability(engine: str, size, counts, priced: dict, args) -> dict:
    """The same engine run measured again (`--repeat-runs` more times): the run whose total the policy's CPU time
    weighs most in, where the engine waits for the policy. Its expert and migration time are the same each time
    (the same maps); the CPU time is the spread a prediction of the total cannot beat on this machine."""
    (interval, policy), p = max(priced.items(), key=lambda item: item[1]["policy_s"] / item[1]["total_s"])
    cpu, totals = [p["policy_s"]], [p["total_s"]]
    for _ in range(args.repeat_runs):
        again = harness.price_run(_run(engine, policy, size, counts, p["cadence"], False, args.quiet), counts, size)
        cpu.append(again["policy_s"])
        totals.append(again["total_s"])
    spread = max(totals) / min(totals) - 1.0
    print(f"  repeatability: {p['scenario']} {policy} every {interval}, the policy's CPU time in {len(cpu)} identical "
          f"runs {', '.join(f'{c:.3f}' for c in cpu)} s; totals spread {spread:.2%}")
    return {"policy": policy, "step_interval": interval, "policy_s": cpu, "total_s": totals, "spread": spread}


def _commit() -> str | None:
    return harness.git("rev-parse", "HEAD") or None


def _rule_files_committed() -> bool | None:
    """True when the rule's files are as the commit has them (the commit then names the code measured)."""
    status = harness.git("status", "--porcelain", "--", *harness.RULE_FILES)
    return None if status is None else status == ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--engine", type=_list(harness.ENGINES), default=["standin-vllm", "standin-sglang"],
                        help=f"comma list of {', '.join(harness.ENGINES)} (default: the stand-ins)")
    parser.add_argument("--vllm-modes", type=_list(VLLM_MODES), default=list(VLLM_MODES),
                        help="vLLM's use_async on (async, its default) and off (sync); default both")
    parser.add_argument("--sizes", type=_list(list(harness.SIZES), allow_none=True), default=list(harness.SIZES),
                        help=f"comma list of {', '.join(harness.SIZES)}, all or none (default all)")
    parser.add_argument("--stationary-calls", type=int, default=6, help="policy calls on the first popularity")
    parser.add_argument("--changed-calls", type=int, default=4, help="policy calls after the change")
    parser.add_argument("--drift", default="all", help="bench_replay scenarios (comma list), all or none")
    parser.add_argument("--steps", type=int, default=6000, help="steps of each drifting trace (default 6000)")
    parser.add_argument("--seed", type=int, default=0)
    add_record_options(parser, committed=("bench/results/engines_vllm.json", "bench/results/engines_sglang.json"))
    parser.add_argument("--repeat-runs", type=int, default=2,
                        help="where the engine waits for the policy (SGLang, vLLM sync): measure the run the policy's "
                             "CPU time weighs most in this many more times, per drifting trace (default 2; 0: none)")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch's intra-op threads while the policies run (default 1; "
                             "inengine.torch_threads says why)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.torch_threads < 1:
        parser.error("--torch-threads: expected an integer >= 1")
    if args.repeat_runs < 0:
        parser.error("--repeat-runs: expected an integer >= 0")
    refuse_overwrite(parser, args)
    scenarios = bench_replay.SCENARIOS
    try:
        args.drift = _list(list(scenarios), allow_none=True)(args.drift)
    except argparse.ArgumentTypeError as exc:
        parser.error(f"--drift: {exc}")
    for name in ("stationary_calls", "changed_calls", "steps"):
        if getattr(args, name) < (2 if name == "stationary_calls" else 1):
            parser.error(f"--{name.replace('_', '-')}: expected an integer >= {2 if name == 'stationary_calls' else 1}")
    missing = [e for e in args.engine if not harness.importable(e)]
    if missing:
        print(f"bench_engines: --engine {missing[0]}: not importable in this Python ({sys.executable})",
              file=sys.stderr)
        return 2
    threads = torch_threads(args.torch_threads)
    start = time.perf_counter()
    # what is measured, read before it runs (an edit during the run must not be recorded as what ran)
    ran = {"moe_place_commit": _commit(), "rule_files_committed": _rule_files_committed(),
           "rule_sources": harness.rule_sources()}
    workloads, drifts, targets = [], [], []
    try:
        for engine, use_async in _runs(args.engine, args.vllm_modes):
            for name in args.sizes:
                record, judged = workload_section(engine, use_async, harness.SIZES[name], args)
                workloads.append(record)
                targets += judged
            if args.drift:
                records, judged = drift_section(engine, use_async, args, scenarios)
                drifts += records
                targets += judged
    except KeyboardInterrupt:
        return interrupted("bench_engines")
    failed = [t for t in targets if not t.passed]
    print(f"summary: {len(targets) - len(failed)}/{len(targets)} targets met "
          f"({time.perf_counter() - start:.0f} s)")
    for target in targets:
        print("  " + target.line())
    if args.output_json:
        write_record(args.output_json, {
            "command": [Path(sys.argv[0]).name] + (sys.argv[1:] if argv is None else list(argv)),
            **ran, "seconds": round(time.perf_counter() - start, 1),
            "versions": harness.engine_versions(args.engine),
            "machine": {**machine(), "cores_allowed": len(os.sched_getaffinity(0)),
                        "torch_threads": threads},
            "settings": {k: v for k, v in vars(args).items() if k not in ("output_json", "force", "quiet")},
            "workloads": workloads, "drift": drifts, "targets": [t.__dict__ for t in targets],
            "summary": {"met": len(targets) - len(failed), "targets": len(targets)}})
    return missed_targets("bench_engines", [f"{t.name} ({t.detail})" for t in failed])


if __name__ == "__main__":
    sys.exit(main())
