"""On a stationary load, what moe-place's moves after its first call buy: the rule against the same rule frozen there.

`bench_replay.py` counts the slots moe-place moves after its first call on its stationary trace
(`STATIONARY`: the 1 x 8 Qwen3 cluster, no drift, sampling noise only); at the shortest cadences it
moves a few tens of slots. Is that noise? Here each cadence is replayed twice under an engine's
protocol (`moe_place.online.replay.replay`, as `moe-place replay` runs it): with the rule as it is,
and with the same rule frozen after its first call (it still runs and pays its CPU time; its later
answers are dropped). If the later moves were noise, the frozen rule would
serve the steps as fast; the record gives, per cadence, the expert-layer time of both, the copies
the moves cost, and the slots moved after the first call.

    python bench/bench_stationary.py [--protocol sglang] [--steps 6000] [--out bench/results/stationary.json]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_replay import PROTOCOLS, SCENARIOS, STATIONARY  # noqa: E402 - bench/ is not a package
from records import add_record_options, interrupted, refuse_overwrite, write_record  # noqa: E402

from moe_place.cost.cluster import cluster_cost  # noqa: E402
from moe_place.online.cadence import DEFAULT_INTERVALS, cadences  # noqa: E402
from moe_place.online.controller import initial_map, make_controller  # noqa: E402
from moe_place.online.policy import RebalanceRule, RuleAnswer, RuleState  # noqa: E402
from moe_place.online.replay import parse_synthetic, replay  # noqa: E402


class FrozenAfterFirstCall(RebalanceRule):
    """The rule, whose answers after its first call are dropped (it still runs and pays its CPU time)."""

    def decide(self, state: RuleState, *args, **kwargs) -> RuleAnswer:
        answer = super().decide(state, *args, **kwargs)
        return answer if state.calls == 0 else replace(answer, decision=None)


def measure(protocol: str, steps: int, intervals: tuple[int, ...]) -> dict:
    name, (cluster, spec, label) = next(iter(STATIONARY.items()))
    cfg = SCENARIOS[cluster]
    counts, params = parse_synthetic(spec.format(steps=steps))
    _, layers, experts = counts.shape
    gpus, nodes = cfg["gpus"], cfg["nodes"]
    start = initial_map(layers, experts, experts + gpus, gpus, nodes)
    engine, use_async = PROTOCOLS[protocol]
    rows = []
    for cadence in cadences(engine, intervals, use_async, steps):
        cost = cluster_cost(gpus, nodes, "H100", cfg["model"], migration=cadence.migration,
                            copy_schedule=cadence.copy_schedule)
        runs = {}
        for kind, rule in (("rule", RebalanceRule), ("frozen", FrozenAfterFirstCall)):
            controller = make_controller("ours", cadence, layers, experts, rule=rule(cost, layers, experts))
            runs[kind] = replay(counts, controller, cost, start, layer_per_step=cadence.layer_per_step,
                                policy_in_worker=cadence.policy_in_worker)
        rule, frozen = runs["rule"], runs["frozen"]
        calls = np.flatnonzero(rule.called_at)   # as bench_replay counts them (CadenceRun.of)
        later = int(rule.slots_moved_at[calls[0] + 1:].sum()) if calls.size else 0
        rows.append({"step_interval": cadence.step_interval, "window": cadence.window_size,
                     "expert_s": rule.total_expert_time_s, "frozen_expert_s": frozen.total_expert_time_s,
                     "migration_s": rule.total_migration_time_s, "frozen_migration_s": frozen.total_migration_time_s,
                     "slots_after_first": later,
                     "expert_ratio": rule.total_expert_time_s / frozen.total_expert_time_s})
    return {"trace": name, "label": label, "spec": params, "protocol": protocol, "steps": steps, "rows": rows}


def table(record: dict) -> str:
    lines = [f"{record['trace']} ({record['label']}), {record['protocol']} protocol, {record['steps']} steps",
             f"{'interval':>8} {'slots later':>11} {'expert s':>10} {'frozen s':>10} {'ratio':>9} "
             f"{'copies s':>9} {'frozen copies s':>15}"]
    for r in record["rows"]:
        lines.append(f"{r['step_interval']:>8} {r['slots_after_first']:>11} {r['expert_s']:>10.4f} "
                     f"{r['frozen_expert_s']:>10.4f} {r['expert_ratio']:>9.6f} {r['migration_s']:>9.4f} "
                     f"{r['frozen_migration_s']:>15.4f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--protocol", choices=sorted(PROTOCOLS), default="sglang",
                        help="the engine protocol to replay under (default sglang)")
    parser.add_argument("--steps", type=int, default=6000, help="steps of the stationary trace (default 6000)")
    parser.add_argument("--intervals", default="10,20,50,100",
                        help=f"comma list of cadences in steps (default 10,20,50,100; the replay's: "
                             f"{','.join(map(str, DEFAULT_INTERVALS))})")
    add_record_options(parser, committed=("bench/results/stationary.json",))
    args = parser.parse_args(argv)
    refuse_overwrite(parser, args)
    try:
        intervals = tuple(int(x) for x in args.intervals.split(","))
    except ValueError:
        parser.error(f"--intervals: expected a comma list of steps, got {args.intervals!r}")
    if min(intervals) < 1 or args.steps < 1:
        parser.error("--intervals and --steps: expected integers >= 1")
    try:
        record = measure(args.protocol, args.steps, intervals)
    except KeyboardInterrupt:
        return interrupted("bench_stationary")
    print(table(record))
    if args.output_json:
        write_record(args.output_json, {"command": ["bench_stationary.py", *(argv or sys.argv[1:])], **record})
        print(f"wrote {args.output_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
