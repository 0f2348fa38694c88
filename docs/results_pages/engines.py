"""The online rebalancing pages: in the engines' own code (engines) and the replay, best against best."""

from __future__ import annotations

import statistics

from .common import RECORD_LINK, RecordError, f, page, pct, record, records, source, span, table


def _engine_label(w: dict, versions: dict) -> str:
    if w["engine"] == "vllm":
        return f"vllm {versions['vllm']} {'async' if w['async'] else 'sync'}"
    return f"sglang {versions['sglang']}"


def _workload_rows(data: dict) -> list[list]:
    rows = []
    for w in data["workloads"]:
        ours, default = w["rows"]["moe-place"], w["rows"]["default"]
        judged = lambda calls: [c["busiest_over_mean"] for c in calls if not c["stale"]]  # noqa: E731
        label = _engine_label(w, data["versions"])
        prefix = f"{w['engine']} {'async' if w['async'] else 'sync'} {w['size']}:" if w["engine"] == "vllm" \
            else f"{w['engine']} {w['size']}:"
        targets = [t for t in w["targets"] if t["name"].startswith(prefix)] or w["targets"]
        rows.append([label, w["size"], f"{f(max(judged(ours)), 3)} ({f(max(judged(default)), 3)})",
                     f"{sum(c['slots_changed'] for c in ours):,} / {sum(c['slots_changed'] for c in default):,}",
                     sum(c["slots_changed"] for c in ours[1:6]),
                     f"{sum(t['passed'] for t in targets)}/{len(targets)}"])
    return rows


def _drift_rows(data: dict) -> list[list]:
    """One row per drifting trace and engine mode: both policies at the engine's default cadence and at each
    one's best cadence from the replay record, and best against best (each policy's best of those runs)."""
    rows: list[list] = []
    for d in data["drift"]:
        runs = d["runs"]
        if not isinstance(runs, list) or not all("at" in r for r in runs):
            raise RecordError("bench/results/engines_*.json: expected drift[].runs as a list of priced runs with "
                              "'at' (teach docs/gen_results.py the record's new shape)")
        by = {(r["at"], r["policy"]): r for r in runs}
        label = f"{d['engine']} {'async' if d['async'] else 'sync'}" if d["engine"] == "vllm" else d["engine"]
        cells = []
        for at in ("default", "default's best", "moe-place's best"):
            if (at, "default") in by:
                o, g = by[(at, "moe-place")], by[(at, "default")]
                cells.append(f"{f(o['total_s'] / g['total_s'], 3)} (every {g['cadence']['step_interval']})")
            else:
                cells.append("-")
        best = {p: min(r["total_s"] for r in runs if r["policy"] == p) for p in ("default", "moe-place")}
        rows.append([label, d["scenario"], *cells, f(best["moe-place"] / best["default"], 4)])
    return rows


def _cadence_rows(data: dict) -> tuple[list[list], list[list], list[list]]:
    """From a record of every cadence (bench_engines.py since issue 46): per drifting trace and engine mode, each
    policy's best cadence in the engine's code and the cadence `moe-place cadence` advises with its total over
    that best, best against best; and the replay's prediction of each run (its error on the total and on expert
    + migration time)."""
    best_rows, prediction_rows, repeat_rows = [], [], []
    for d in data["drift"]:
        runs = d["runs"]
        label = f"{d['engine']} {'async' if d['async'] else 'sync'}" if d["engine"] == "vllm" else d["engine"]
        cells, best = [], {}
        for policy in ("default", "moe-place"):
            mine = [r for r in runs if r["policy"] == policy]
            top = min(mine, key=lambda r: r["total_s"])
            advised = next(r for r in mine if r["cadence"]["step_interval"] == d["advised"][policy])
            best[policy] = top["total_s"]
            cells += [f"every {top['cadence']['step_interval']}",
                      f"every {d['advised'][policy]} ({f(advised['total_s'] / top['total_s'], 4)})"]
        best_rows.append([label, d["scenario"], *cells, f(best["moe-place"] / best["default"], 4)])
        if "repeatability" in d:
            again = d["repeatability"]
            repeat_rows.append([label, d["scenario"], f"{again['policy']} every {again['step_interval']}",
                                ", ".join(f(x, 3) for x in again["policy_s"]), pct(again["spread"], 2, sign=False)])
        errors = [r["replay_error"] for r in runs]
        model = [r["replay_model_error"] for r in runs]
        worst = max(runs, key=lambda r: abs(r["replay_error"]))
        paid = [r["policy_s"] / r["replay_policy_s"] for r in runs
                if r["policy"] == "default" and r["policy_s"] > 0 and r.get("replay_policy_s", 0) > 0]
        prediction_rows.append([label, d["scenario"], len(runs), pct(max(errors, key=abs), 2),
                                f"{worst['policy']} every {worst['cadence']['step_interval']}",
                                pct(max(model, key=abs), 2), sum(abs(e) <= 0.01 for e in errors),
                                f"{f(min(paid), 2)}x to {f(max(paid), 2)}x" if paid else "not paid"])
    return best_rows, prediction_rows, repeat_rows


def _machines(*records: dict) -> str:
    """The sentence naming the CPU each record was measured on (records made before they named it add none)."""
    seen = []
    for data in records:
        m = data.get("machine")
        if m:
            line = f"{m['cpu']}, {m['cores']} cores, {'with' if m['avx512'] else 'no'} AVX-512"
            if m.get("torch_threads"):
                line += f" (torch's intra-op threads: {m['torch_threads']})"
            if line not in seen:
                seen.append(line)
    return f" Measured on {' and '.join(seen)}." if seen else ""


def engines() -> str:
    vllm, sglang = record("engines_vllm.json"), record("engines_sglang.json")
    ties = record("eplb_ties.json")
    cadence = vllm["settings"]
    workload_rows = _workload_rows(vllm) + _workload_rows(sglang)
    every_cadence = all("advised" in d for data in (vllm, sglang) for d in data["drift"])
    if every_cadence:
        best_rows, prediction_rows, repeat_rows = (a + b for a, b in zip(_cadence_rows(vllm), _cadence_rows(sglang)))
    else:
        drift_rows = _drift_rows(vllm) + _drift_rows(sglang)
    cpu_rows = []
    for data in (vllm, sglang):
        for w in data["workloads"]:
            label = f"{w['engine']} {'async' if w['async'] else 'sync'}" if w["engine"] == "vllm" else w["engine"]
            default, ours = ([c["policy_s"] for c in w["rows"][p]] for p in ("default", "moe-place"))
            row = [label, w["size"], len(default), f(statistics.median(default) * 1e3, 2),
                   f(statistics.median(ours) * 1e3, 2), f(statistics.median(ours) / statistics.median(default), 2)]
            first = [[c.get("policy_first_s") for c in w["rows"][p]] for p in ("default", "moe-place")]
            if all(x is not None for calls in first for x in calls):   # runs that repeated each call (SGLang's)
                a, b = (statistics.median(calls) for calls in first)
                row += [f(a * 1e3, 2), f(b * 1e3, 2), f(b / a, 2)]
            else:
                row += ["-", "-", "-"]
            cpu_rows.append(row)
    targets = [[t["name"], "met" if t["passed"] else "**missed**", t["detail"]]
               for data in (vllm, sglang) for t in data["targets"]]
    met = sum(d["summary"]["met"] for d in (vllm, sglang))
    total = sum(d["summary"]["targets"] for d in (vllm, sglang))
    tie_rows = [[r["variant"], "yes" if r["map_in_use"] else "no", f"{r['exact']}/{ties['cases']}",
                 f"{r['same_gpu_sets']}/{ties['cases']}"] for r in ties["results"]]
    return page("engines",
                f"vLLM {vllm['versions']['vllm']}'s real `EplbState` (sync and `use_async`) and SGLang "
                f"{sglang['versions']['sglang']}'s real `EPLBManager` and recorder, driven on CPU with only the "
                "process group, communicator and weight copies stubbed (everything that decides a map is "
                "theirs), each from its own start map at its own cadence, once with the engine's default policy "
                "and once with moe-place installed as a user installs it (`install()`, `install_rebalance_hook()`). "
                f"First a stationary load for {cadence['stationary_calls']} policy calls, then a new popularity "
                f"for {cadence['changed_calls']} more; busiest/mean is that of the steps each map serves, calls "
                "whose steps span the change are not judged.",
                source("engines_vllm.json", "engines_sglang.json"),
                table(["engine (mode)", "size", "busiest/mean, worst judged call: moe-place (default)",
                       "slots moved over the run: moe-place / default", "slots moved on noise alone (calls 2-6)",
                       "targets met"], workload_rows),
                *(_drift_section(cadence, best_rows, prediction_rows, repeat_rows) if every_cadence else
                  ("## Drifting traces\n\nThe replay's drifting traces (`bench/bench_replay.py` SCENARIOS, seed "
                   f"{cadence['seed']}, {cadence['steps']} steps) in the engines' code, priced on the cost model: "
                   "expert time + dispatch and combine + what serving pays for migration + the policy's CPU time "
                   "where the engine waits for it (not in vLLM's async worker), both policies at the engine's "
                   "default cadence and at each one's best cadence in the replay record (window = interval); best "
                   "against best: each policy's best of these runs.",
                   table(["engine (mode)", "trace", "moe-place / default at the engine's default cadence",
                          "... at the default's best cadence", "... at moe-place's best cadence",
                          "best against best"], drift_rows))),
                "## CPU time per call\n\nThe policy's CPU seconds per call on the workload runs above (the calling "
                "thread's: vLLM's async worker, the serving thread otherwise; median over the run's calls): the "
                "engine's own default policy code and moe-place's rule, on the same calls of the same engine. In "
                "SGLang's runs each call also ran 4 more times from a copy of the policy's state "
                "(`bench/inengine/harness.py` `Clock`): there a call's figure is the least CPU time of its five runs "
                "(what the call costs with the machine's interruptions left out; the medians of single calls "
                "moved 20-30% between runs of this machine), and \"as called\" is the call the engine made, "
                "run once, after the harness's engine steps since the last call." + _machines(vllm, sglang),
                table(["engine (mode)", "size", "calls", "default ms", "moe-place ms", "moe-place / default",
                       "default ms, as called", "moe-place ms, as called", "moe-place / default, as called"],
                      cpu_rows),
                f"## Targets\n\n{met} of {total} met.",
                table(["target", "", "detail"], targets),
                *_guard_section(),
                "## Ties\n\nOn seeded tied integer-load cases, the planner's EPLB against vLLM "
                f"{ties['vllm']}'s `DefaultEplbPolicy` (numpy {ties['numpy']}, torch {ties['torch']}): `numpy-order` "
                "is the planner's EPLB with numpy's argsort as its order, `stable` with its own stable order, "
                "`standin` the CI stand-in of vLLM's policy. " + source("eplb_ties.json"),
                table(["variant", "with the map in use", "maps exactly vLLM's", "same experts per GPU"], tie_rows))


def _guard_section() -> list[str]:
    """Never taking a server down: the guard's checks in each engine's own code (bench/check_guard_engines.py)."""
    parts = ["## Never taking a server down\n\nAn exception inside moe-place code the engine calls logs one warning "
             "and the engine's own algorithm answers that call (`moe_place.engines.guard`); checked in each "
             "engine's own rebalance code on a CPU (small sizes; the harness's stubs as above)."]
    for name in records("guard_engines_*.json"):
        g = record(name)
        rows = [[c["check"], "PASS" if c["passed"] else "FAIL"] for c in g["checks"]]
        rows += [[line.split("  ", 1)[-1], "not run"] for line in g.get("not_run", [])]
        parts += [f"### {g['engine']} {g['version']}\n\n" + source(name), table(["check", "result"], rows)]
    return parts


def _drift_section(cadence: dict, best_rows: list[list], prediction_rows: list[list],
                   repeat_rows: list[list]) -> tuple[str, ...]:
    return ("## Drifting traces\n\nThe replay's drifting traces (`bench/bench_replay.py` SCENARIOS, seed "
            f"{cadence['seed']}, {cadence['steps']} steps) in the engines' code, priced on the one model: expert time "
            "+ dispatch and combine + what serving pays for migration + the policy's CPU time where the engine "
            "waits for it (not in vLLM's async worker), both policies at every cadence `moe-place cadence` tries "
            "(window = interval) and at the engine's default. Each policy's best cadence in the engine's code, the "
            "cadence `moe-place cadence` advises for it (its replay of the same trace, cluster and protocol) with "
            "that cadence's total over the best, and best against best:",
            table(["engine (mode)", "trace", "default: best", "default: advised", "moe-place: best",
                   "moe-place: advised", "best against best"], best_rows),
            "The replay's prediction of every run beside it: the replay's total over the engine's, the worst run, "
            "the same without the policy's CPU time (expert + dispatch/combine + migration, which does not depend on "
            "the machine), how many runs are within 1%, and the engine's own default's CPU time per call over the "
            "price the replay charges for it (`moe_place.online.policy_cpu`, fitted on the machine the replay "
            "records name), where the engine waits for it:",
            table(["engine (mode)", "trace", "runs", "worst error on the total", "where",
                   "worst without CPU time", "within 1%", "default's CPU: measured / priced"], prediction_rows),
            *(("Where the engine waits for the policy (SGLang, vLLM sync), its CPU time is part of the total, and "
               "it is measured, not modelled: by the engine's harness in one run and by the replay in another. The "
               "same engine run measured again, back to back (`--repeat-runs`: the run the CPU time weighs most in, "
               "per trace), gives the spread of identical runs' totals. Where that spread is above 1%, no "
               "prediction of the total can be within 1% of every run on this machine; the time without it, "
               "which is modelled, is predicted as the previous table's \"worst without CPU time\" says.",
               table(["engine (mode)", "trace", "run", "policy's CPU seconds, identical runs", "totals' spread"],
                     repeat_rows)) if repeat_rows else ()))


def replay() -> str:
    parts, intro_traces = [], None
    for engine in ("vllm", "sglang"):
        data = record(f"replay_{engine}.json")
        if "traces" not in data or not all("protocols" in t for t in data["traces"]):
            raise RecordError(f"bench/results/replay_{engine}.json: expected the record of bench_replay.py with "
                              "traces[].protocols (teach docs/gen_results.py the record's new shape)")
        intro_traces = intro_traces or data
        set_of = {name: which for which, names in data.get("sets", {}).items() for name in names}
        for protocol in data["protocols"]:
            rows, ratios, hind = [], [], []
            by_set: dict[str, list[float]] = {}
            for t in data["traces"]:
                s = t["protocols"][protocol]
                bd, bo = s["best"]["default"], s["best"]["moe-place"]
                default_at = s["default_interval"]
                worst = max(s["ratio_at"], key=lambda i: s["ratio_at"][i])
                if t["kind"] != "stationary":
                    ratios.append(s["best_ratio"])
                    hind.append(s["hindsight_ratio"])
                    by_set.setdefault(set_of.get(t["name"], "-"), []).append(s["best_ratio"])
                rows.append([t["name"], set_of.get(t["name"], "-"), t["kind"],
                             f"{f(bd['total_s'], 3)} every {bd['step_interval']}",
                             f"{f(bo['total_s'], 3)} every {bo['step_interval']}", f(s["best_ratio"]),
                             f(s["hindsight_ratio"]), f"{f(s['ratio_at'][worst])} (every {worst})",
                             f(s["ratio_at"][str(default_at)]) if default_at else "-"])
            policy = data["traces"][0]["protocols"][protocol]["default_policy"]
            per_set = "".join(f" On the {which} set ({len(v)} traces): {f(statistics.mean(v))} ({span(v, 4)})."
                              for which, v in sorted(by_set.items()) if which != "-")
            parts.append(f"## {protocol}\n\nThe default policy is {policy}. Mean best against best over the "
                         f"{len(ratios)} drifting traces {f(statistics.mean(ratios))} (range {span(ratios, 4)}); "
                         f"hindsight {f(statistics.mean(hind))} ({span(hind, 4)}).{per_set}")
            parts.append(table(["trace", "set", "kind", "default at its best: total s",
                                "moe-place at its best: total s", "best against best", "hindsight / default's best",
                                "worst same-cadence ratio", "at the engine's default cadence"], rows))
            still = [t for t in data["traces"] if t["kind"] == "stationary"]
            for t in still:
                moved = {r["step_interval"]: r["slots_after_first"] for r in t["protocols"][protocol]["runs"]
                         if r["policy"] == "moe-place"}
                parts.append(f"Stationary load ({t['name']}): slots moe-place moved after its first call, per "
                             "interval: " + ", ".join(f"{i}: {n}" for i, n in sorted(moved.items())) + ".")
        parts.append(f"![{engine}: total time over the interval]({RECORD_LINK}replay_{engine}.png)")
    still = record("stationary.json")
    parts.append(f"## What the moves on the stationary load buy\n\n{still['trace']} under the {still['protocol']} "
                 "protocol, replayed with moe-place's rule and with the same rule frozen after its first call (it "
                 "still runs; its later answers are dropped): expert-layer seconds over the trace, and what the "
                 "copies cost serving.")
    parts.append(table(["interval", "slots moved after the first call", "expert s", "frozen: expert s",
                        "rule / frozen", "copies s", "frozen: copies s"],
                       [[r["step_interval"], r["slots_after_first"], f(r["expert_s"], 4), f(r["frozen_expert_s"], 4),
                         f(r["expert_ratio"], 6), f(r["migration_s"], 4), f(r["frozen_migration_s"], 4)]
                        for r in still["rows"]]))
    data = intro_traces
    return page("replay",
                f"Each trace ({data['steps']} steps of drifting domain-mixture routing: `bench/bench_replay.py` "
                "SCENARIOS x seeds and the traces once held out, together the tuning set; the evaluation set, "
                "settings and seeds never used to choose a design, only to report; and a stationary one) is replayed "
                "under each engine's protocol at intervals from 10 steps to the engine's default, with the engine's "
                "default policy (its own code, as the engine runs it) and with moe-place's rule. Best against best: "
                "each policy's least total over the intervals, moe-place's over the default's. Hindsight: plans made "
                "on the next interval's load, moved for free, at its best interval, over the default's best (no "
                "policy reaches it). Total = expert time + dispatch and combine + migration + the policy's CPU time "
                f"where the engine waits for it ({data['policy_time']}). [Online rebalancing](../online.md) explains "
                "the protocols, its [design notes](../design/online.md) where the gains and losses come from.",
                source("replay_vllm.json", "replay_sglang.json", "replay_vllm.png", "replay_sglang.png",
                       "stationary.json"), *parts)
