"""The results pages, generated: every table of docs/results/ from the committed records in bench/results/.

    python docs/gen_results.py [--check]

Nothing on those pages is typed by hand: each table and each figure in their sentences is computed here
from a record, and each page names the records it reads and the commands that wrote them (`RECORDS`).
After re-measuring (a benchmark's `--out bench/results/... --force`), rerun this and commit both;
tests/test_docs.py fails while a page differs from what this renders. A record whose shape this does not
know is an error naming it: teach the page its new shape.
"""

from __future__ import annotations

import collections
import fnmatch
import glob
import importlib.util
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pagegen import GENERATED_NOTE, ROOT, write_or_check  # noqa: E402 - the docs' own helper, beside this file

from moe_place.kernels.report import render_markdown  # noqa: E402

SCRIPT = "docs/gen_results.py"
RESULTS = ROOT / "bench" / "results"
# A results page's link to a committed record or plot: relative to docs/results/, so that it resolves where the
# page is read in the repository (GitHub, an editor); docs/hooks.py points it at the site's copy, records/.
RECORD_LINK = "../../bench/results/"
TRACE = "traces/data/qwen3-30b-a3b_prefill_topk.npz"


def overlay(engine: str, core: int | None = None) -> str:
    """The engine's Python with this checkout on its path (bench/engine_overlay.sh); `core`: pinned to that core, as
    the records whose CPU times count ran, each on a core of its own."""
    pin = "" if core is None else f"taskset -c {core} env "
    return (f"bash bench/engine_overlay.sh /path/to/{engine}-venv/bin/python /tmp/overlay-{engine} && "
            f"{pin}PYTHONPATH=/tmp/overlay-{engine} /path/to/{engine}-venv/bin/python")


# record file (a glob under bench/results/) -> (the command that writes it, the page that shows it)
RECORDS = {
    "plan_quality.json": ("python bench/bench_plan_quality.py --output-json bench/results/plan_quality.json --force",
                          "plan-quality"),
    "sizing_ep*.json": (f"moe-place plan {TRACE} --gpus G --redundant auto --format json --no-progress "
                        "--out /tmp/planG.json > bench/results/sizing_epG.json", "sizing"),
    "scale.json": ("python bench/bench_scale.py --output-json bench/results/scale.json --force", "scale"),
    "dropin.json": ("python bench/bench_dropin.py --repeats 9 --out bench/results/dropin.json --force", "dropin"),
    "windows.json": ("python bench/bench_windows.py --time-limit 20 --output-json bench/results/windows.json --force",
                     "windows"),
    "analyze_throughput_*.json": ("python bench/bench_trace_throughput.py --tokens T --layers 48 --experts 128 "
                                  "--steps S --repeats 11 --output-json bench/results/analyze_throughput_tT_sS.json "
                                  "--force", "throughput"),
    "engines_vllm.json": (overlay("vllm", core=0)
                          + " bench/bench_engines.py --engine vllm --vllm-modes async,sync --drift all --quiet "
                          "--out bench/results/engines_vllm.json --force", "engines"),
    "engines_sglang.json": (overlay("sglang", core=1)
                            + " bench/bench_engines.py --engine sglang --drift all --quiet "
                            "--out bench/results/engines_sglang.json --force", "engines"),
    "guard_engines_*.json": (overlay("ENGINE") + " bench/check_guard_engines.py --engine ENGINE --out "
                             "bench/results/guard_engines_ENGINE.json --force", "engines"),
    "eplb_ties.json": (overlay("vllm") + " bench/bench_eplb_ties.py --cases 200 "
                       "--out bench/results/eplb_ties.json --force", "engines"),
    "replay_vllm.json": (overlay("vllm", core=0) + " bench/bench_replay.py --held-out --evaluation --protocols "
                         "vllm,vllm-sync --default-policy engine --torch-threads 1 --out bench/results/replay_vllm.json --force",
                         "replay"),
    "replay_sglang.json": (overlay("sglang", core=0)
                           + " bench/bench_replay.py --held-out --evaluation --protocols sglang --default-policy engine "
                           "--torch-threads 1 --out bench/results/replay_sglang.json --force", "replay"),
    "stationary.json": ("python bench/bench_stationary.py --out bench/results/stationary.json --force", "replay"),
    "replay_*.png": ("python bench/bench_replay.py --replot bench/results/replay_ENGINE.json --plot "
                     "bench/results/replay_ENGINE.png --force", "replay"),
    "comm.json": ("python bench/bench_comm.py --out bench/results/comm.json --plot bench/results/comm.png "
                  "--no-cli-timing --force", "multinode"),
    "comm.png": ("the same command", "multinode"),
    "published_comm.json": ("python bench/check_published_comm.py --seed 0 --out bench/results/published_comm.json "
                            "--force", "calibration"),
    "comm_plan_time.json": ("python bench/bench_comm.py --timing-only --out bench/results/comm_plan_time.json --force",
                            "multinode"),
    "offload_heldout_*.json": (f"moe-place offload {TRACE} --gpu-memory M --kv-reserve 4GiB --format json "
                               "> bench/results/offload_heldout_M.json", "offload"),
    "offload_sweep.json": ("python bench/bench_offload_sweep.py --out bench/results/offload_sweep.json --plot "
                           "bench/results/offload_sweep.png --force", "offload"),
    "offload_sweep.png": ("the same command", "offload"),
    "offload_published.json": ("python bench/bench_offload_published.py --out bench/results/offload_published.json "
                               "--force", "offload"),
    "cpu_expert.json": ("python bench/bench_cpu_expert.py --reps 7 --output-json bench/results/cpu_expert.json "
                        "--parts-out bench/results/cpu_this_machine.toml --force", "offload"),
    "cpu_this_machine.toml": ("the same command", "offload"),
    "offload_replay.json": ("python bench/bench_offload_replay.py --steps 2000 --output-json "
                            "bench/results/offload_replay.json --force", "offload"),
    "split.json": ("python bench/bench_split.py --out bench/results/split.json --force", "split"),
    "split_engines_*.json": (overlay("ENGINE") + " bench/check_split_engines.py --engine ENGINE --out "
                             "bench/results/split_engines_ENGINE.json --force",
                             "split"),
    "split_placement.json": ("python bench/bench_split_placement.py --out bench/results/split_placement.json --force",
                             "split-placement"),
    "split_placement_tuning.json": ("python bench/bench_split_placement.py --tune --out "
                                    "bench/results/split_placement_tuning.json --force", "split-placement"),
    "NVIDIA_*Z.json": ("bash bench/gpu_check.sh (on the GPU; its .md, .log and PNGs beside it)", "gpu"),
    "NVIDIA_*_gemm_configs.json": ("python bench/gemm_configs.py --rows 2048 --output-json FILE (same lease)", "gpu"),
}

TITLES = {
    "plan-quality": "Plan quality", "sizing": "Redundancy sizing", "scale": "Scale", "dropin": "Drop-in timing",
    "windows": "Planning on windows", "throughput": "Trace throughput", "engines": "In the engines' own code",
    "replay": "Online rebalancing, best against best", "multinode": "Multi-node EP", "offload": "Offloaded serving", "gpu": "GPU microbenchmarks",
    "split-placement": "Placement for the per-batch split", "split": "The per-batch split",
    "calibration": "The model against published measurements",
}


# -------------------------------------------------------------------------------------------- helpers
class RecordError(Exception):
    """A record this generator cannot read: its file and what was expected."""


def record(name: str) -> dict:
    path = RESULTS / name
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise RecordError(f"bench/results/{name}: expected a JSON record ({exc})") from None


def records(pattern: str) -> list[str]:
    return sorted(Path(p).name for p in glob.glob(str(RESULTS / pattern)))


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(cell).replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def f(value: float, digits: int = 4) -> str:
    return f"{value:.{digits}f}"


def pct(value: float, digits: int = 1, sign: bool = True) -> str:
    return f"{value * 100:{'+' if sign else ''}.{digits}f}%"


def span(values, digits: int = 3) -> str:
    """'low-high' of some values (one value if they agree at these digits)."""
    low, high = f(min(values), digits), f(max(values), digits)
    return low if low == high else f"{low}-{high}"


def source(*names: str) -> str:
    """The sentence naming a page's records, each a link to it in bench/results/ (`RECORD_LINK`)."""
    links = ", ".join(f"[`bench/results/{n}`]({RECORD_LINK}{n})" for n in names)
    commands = []
    for pattern, (command, _page) in RECORDS.items():
        if any(fnmatch.fnmatch(n, pattern) for n in names) and command != "the same command":
            commands.append(f"`{command}`")
    return f"From {links}, written by " + " and ".join(dict.fromkeys(commands)) + "."


def page(slug: str, intro: str, *parts: str) -> str:
    body = [GENERATED_NOTE.format(script=SCRIPT).rstrip("\n"), "", f"# {TITLES[slug]}", "", intro]
    for part in parts:
        body += ["", part]
    return "\n".join(body) + "\n"


# ------------------------------------------------------------------------------------------ the pages
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
                "that still lowers it by 1% per GiB per GPU ([how](../plan.md#how-many-redundant-experts-redundant-auto)).",
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
        rows.append([r["loads"], r["ep"], method, wall, f"{pct(r['gap_mean'], 2, False)} / {pct(r['gap_worst'], 2, False)}",
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
        rows.append([f"{data['file_bytes'] / 1e6:.0f} MB, {kind}, {data['steps']} step{'s' if data['steps'] > 1 else ''}",
                     f"{data['decisions'] / 1e6:.1f} M", f"{by['analyze']['ratio_vs_baseline']:.2f}x ({f(by['analyze']['seconds'], 3)} s)",
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
        prediction_rows.append([label, d["scenario"], len(runs), pct(max(errors, key=abs), 2),
                                f"{worst['policy']} every {worst['cadence']['step_interval']}",
                                pct(max(model, key=abs), 2), sum(abs(e) <= 0.01 for e in errors)])
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
                   "where the engine waits for it (not in vLLM's async worker), both policies at the engine's default cadence and at "
                   "each one's best cadence in the replay record (window = interval); best against best: each "
                   "policy's best of these runs.",
                   table(["engine (mode)", "trace", "moe-place / default at the engine's default cadence",
                          "... at the default's best cadence", "... at moe-place's best cadence",
                          "best against best"], drift_rows))),
                "## CPU time per call\n\nThe policy's CPU seconds per call on the workload runs above (the calling "
                "thread's: vLLM's async worker, the serving thread otherwise; median over the run's calls): the "
                "engine's own default policy code and moe-place's rule, on the same calls of the same engine. In "
                "SGLang's runs each call also ran 4 more times from a copy of the policy's state "
                "(`bench/engine_harness.py` `Clock`): there a call's figure is the least CPU time of its five runs "
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
            "+ dispatch and combine + what serving pays for migration + the policy's CPU time where the engine waits for it (not in "
            "vLLM's async worker), both policies at every cadence `moe-place cadence` tries (window = interval) and "
            "at the engine's default. Each policy's best cadence in the engine's code, the cadence `moe-place "
            "cadence` advises for it (its replay of the same trace, cluster and protocol) with that cadence's total "
            "over the best, and best against best:",
            table(["engine (mode)", "trace", "default: best", "default: advised", "moe-place: best",
                   "moe-place: advised", "best against best"], best_rows),
            "The replay's prediction of every run beside it: the replay's total over the engine's, the worst run, "
            "the same without the policy's CPU time (expert + dispatch/combine + migration, which does not depend on "
            "the machine), "
            "and how many runs are within 1%:",
            table(["engine (mode)", "trace", "runs", "worst error on the total", "where",
                   "worst without CPU time", "within 1%"], prediction_rows),
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
                rows.append([t["name"], set_of.get(t["name"], "-"), t["kind"], f"{f(bd['total_s'], 3)} every {bd['step_interval']}",
                             f"{f(bo['total_s'], 3)} every {bo['step_interval']}", f(s["best_ratio"]),
                             f(s["hindsight_ratio"]), f"{f(s['ratio_at'][worst])} (every {worst})",
                             f(s["ratio_at"][str(default_at)]) if default_at else "-"])
            policy = data["traces"][0]["protocols"][protocol]["default_policy"]
            per_set = "".join(f" On the {which} set ({len(v)} traces): {f(statistics.mean(v))} ({span(v, 4)})."
                              for which, v in sorted(by_set.items()) if which != "-")
            parts.append(f"## {protocol}\n\nThe default policy is {policy}. Mean best against best over the "
                         f"{len(ratios)} drifting traces {f(statistics.mean(ratios))} (range {span(ratios, 4)}); "
                         f"hindsight {f(statistics.mean(hind))} ({span(hind, 4)}).{per_set}")
            parts.append(table(["trace", "set", "kind", "default at its best: total s", "moe-place at its best: total s",
                                "best against best", "hindsight / default's best",
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
                "SCENARIOS x seeds and the traces once held out, together the tuning set; the evaluation set, settings and "
                "seeds never used to choose a design, only to report; and a stationary one) is replayed under each "
                "engine's protocol at intervals from 10 steps to the engine's default, with the engine's default "
                "policy (its own code, as the engine runs it) and with moe-place's rule. Best against best: each "
                "policy's least total over the intervals, moe-place's over the default's. Hindsight: plans made on "
                "the next interval's load, moved for free, at its best interval, over the default's best (no policy "
                "reaches it). Total = expert time + dispatch and combine + migration + the policy's CPU time where "
                f"the engine waits for it ({data['policy_time']}). [Online rebalancing](../online.md) explains the protocols, its "
                "[design notes](../design/online.md) where the gains and losses come from.",
                source("replay_vllm.json", "replay_sglang.json", "replay_vllm.png", "replay_sglang.png",
                       "stationary.json"), *parts)


def _bench(name: str):
    """bench/NAME.py as a module (bench/ is not a package): its table renderers, which docs/multinode.md
    shows verbatim too."""
    spec = importlib.util.spec_from_file_location(f"{name}_for_docs", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def multinode() -> str:
    data = record("comm.json")
    timing = record("comm_plan_time.json")
    if "verdicts" not in data or not all("whole_model" in v for v in data["verdicts"]):
        raise RecordError("bench/results/comm.json: expected the record of bench_comm.py with verdicts[].whole_model "
                          "(teach docs/gen_results.py the record's new shape)")
    times = [[t["command"], f"{t['wall_s']:.1f}", f"{t['cpu_s']:.1f}", t["cores"], t["exit_code"]]
             for t in timing["plan_time"]]
    return page("multinode",
                "The real Qwen3-30B-A3B trace (three recorded prefill batches), all 48 layers, planned with "
                "`--objective time` on two batches and judged on the third (each fold), layer time predicted by the "
                "default model of the time objective, over the balance-only plan `fast`; then the synthetic test bed "
                "of known co-activation. [Multi-node EP](../multinode.md) explains the decision, its [design notes]"
                "(../design/multinode.md) what these tables say.",
                source("comm.json", "comm_plan_time.json", "comm.png"),
                _bench("bench_comm").results_table(data),
                "## Plan time\n\n" + table(["command", "wall s", "CPU s", "cores", "exit"], times),
                f"![layer time per method]({RECORD_LINK}comm.png)")


def calibration() -> str:
    data = record("published_comm.json")
    rows = [[r["table"], r["ep"], r["phase"], r["tokens_per_rank"], f"{r['published_s'] * 1e6:.1f}",
             f"{r['model_s'] * 1e6:.1f}", f(r["model_over_published"], 3),
             f"[{r['source']['path']}](https://github.com/{r['source']['repo']}/blob/{r['source']['commit']}/"
             f"{r['source']['path']})"] for r in data["rows"]]
    fits = [[fit["fitted_on"], f"{fit['latency_s']['dispatch'] * 1e6:.1f}", f"{fit['latency_s']['combine'] * 1e6:.1f}"]
            for fit in data["latency_fits"]]
    return page("calibration",
                "Formula 3 (dispatch and combine, the bottleneck of each phase's bytes, no start-up) against DeepEP's "
                "published kernel times, in the published settings (H800 nodes of 8 GPUs, one 400 Gb/s NIC per GPU, "
                "DeepSeek-V3's hidden size, top-8 of 256 experts, DeepEP's own routing recipe, seeded). "
                "[Calibration](../calibration.md) says how each row is set up and what the model leaves out.",
                source("published_comm.json"),
                table(["table", "EP", "phase", "tokens per rank", "published us", "model us", "model / published",
                       "source"], rows),
                "## A fixed start-up per phase, fitted on one table\n\n"
                + table(["fitted on", "dispatch us", "combine us"], fits))


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
                  f"Targets (rule + split at most 0.94x with R = G, 0.90x with R = 2G): {met}. The two totals come "
                  "from two runs, each with its own measure of the rule's CPU time, which SGLang's protocol pays "
                  "and which moves by several percent between identical runs on a shared machine; the last three "
                  "columns are the split's own part: the layer-steps it ran, the layer and migration time with it "
                  "over the same cadence without it, and the CPU time of the per-layer choice. The last column "
                  "is what no charged split can beat: the rule at its best cadence with the split on every layer "
                  "of every batch from the first step, its all-reduce, solve and choice free, over the default's "
                  "best (its expert time over the rule's without it in brackets)."]
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


OFFLOAD_METHODS = ["moe-place", "sglang-kt uniform", "sglang-kt frequency", "sglang-kt front-loading",
                   "sglang-kt random", "llama.cpp --n-cpu-moe", "llama.cpp -ot (layers from the trace)"]


def _offload_rows(data: dict) -> list[list]:
    memory = data["memory"]
    share = f"{memory['capacity_experts']} ({memory['capacity_experts'] / memory['all_experts'] * 100:.1f}%)"
    held = data["held_out"]
    judged = [(str(fold["judged_step"]), fold["total_s"]) for fold in held["folds"]] + [("mean", held["mean_total_s"])]
    rows = []
    for label, totals in judged:
        best_rule = min(totals[m] for m in OFFLOAD_METHODS if m.startswith("sglang-kt"))
        ours = totals["moe-place"]
        ratios = [ours / totals["sglang-kt uniform"] - 1, ours / best_rule - 1, ours / totals["llama.cpp --n-cpu-moe"] - 1]
        cells = [pct(ratios[0]), pct(ratios[1], 3), pct(ratios[2])]
        if label == "mean":
            cells = [f"**{cells[0]}**", cells[1], f"**{cells[2]}**"]
        rows.append([share, label] + [f"{totals[m] * 1e3:.1f}" for m in OFFLOAD_METHODS] + cells)
    return rows


def _offload_sweep(data: dict) -> str:
    """The sweep's tables and its target lines (an item each): what `bench_offload_sweep.py --table-from` prints."""
    sweep = _bench("bench_offload_sweep")
    return sweep.render_tables(data).rstrip("\n") + "\n\n" + "\n".join(f"- {line}" for line in sweep.targets(data)[0])


def offload() -> str:
    names = sorted(records("offload_heldout_*.json"), key=lambda n: float(re.search(r"[\d.]+(?=GiB)", n)[0]))
    held = [record(n) for n in names]
    rows = [row for data in held for row in _offload_rows(data)]
    cpu = record("cpu_expert.json")
    cpu_rows = []
    for dtype, d in cpu["dtypes"].items():
        for r in d["rows"]:
            cpu_rows.append([dtype, r["rows"], f(r["measured_s"] * 1e3, 3), f(r["predicted_s"] * 1e3, 3),
                             f(r["ratio"], 2), r["bound"], "> 25%" if r["flagged"] else ""])
    rates = [[dtype, f"{d['flops_per_s'] / 1e9:.1f} GFLOP/s", f"{d['dram_bytes_per_s'] / 1e9:.1f} GB/s",
              f"{d['expert_bytes'] / 2**20:.0f} MiB"] for dtype, d in cpu["dtypes"].items()]
    online = record("offload_replay.json")
    online_rows = []
    for case, c in online["cases"].items():
        static = c["policies"]["static"]["total_s"]
        for name, p in c["policies"].items():
            online_rows.append([case, c["threshold_tokens"], name, f(p["total_s"], 3), pct(p["total_s"] / static - 1),
                                f"{p['link_copies']:,}", f"{p['gpu_copies']:,}"])
    machine = cpu["machine"]
    published = record("offload_published.json")["readings"]["from the 100% row"]
    published_rows = [[f"{j['percent']}%", " > ".join(j["model_order"]), " > ".join(j["published_order"]),
                       "yes" if j["order_ok"] else "no",
                       ", ".join(f"{name} {f(m, 3)} vs {f(p, 3)}" for name, (m, p) in j["ratios"].items())]
                      for j in published["judged"]]
    return page("offload",
                "Every figure here is the cost model's prediction (no engine ran), except the CPU expert timings "
                "below.",
                "## Every budget, held out\n\nThe plan against sglang-kt's rules (the best of `uniform`, "
                "`frequency`, `front-loading`), llama.cpp and all-GPU at budgets from one expert per layer to all "
                "experts, each recorded step judged with the plan made on the other two; then each set's mean "
                "held-out step time (ms). [Offloaded serving](../offload.md) explains the plan, its [design notes]"
                "(../design/offload.md) what the sweep says. "
                + source("offload_sweep.json", "offload_sweep.png"),
                _offload_sweep(record("offload_sweep.json")),
                f"![step time over GPU memory]({RECORD_LINK}offload_sweep.png)",
                "## The published KTransformers table\n\nThe model configured for kt-kernel's published setup "
                "(Qwen3-Next-80B-A3B-FP8, 4 x RTX 4090, Xeon 6454S; the non-expert time per token from the table's "
                "100% row), the order of the three strategies and each one's ratio to `uniform`, model vs table "
                f"(order reproduced at every ratio: {'yes' if published['order_reproduced'] else 'no'}). "
                + source("offload_published.json"),
                table(["experts on the GPU", "model's order", "published order", "same", "ratio to uniform: model vs "
                       "published"], published_rows),
                "## Held out against the engines' rules\n\n`moe-place offload` on the real Qwen3-30B-A3B trace at "
                "three GPU memory budgets, each with `--kv-reserve 4GiB`: plan on two recorded batches, judge on the "
                "third; predicted weighted step time (decode 8 + decode 32 + prefill, ms) of the plan against "
                "sglang-kt's placement rules and llama.cpp's at the same memory. `random` is a seeded numpy draw of "
                "the same rule, not sglang-kt's torch draw; `frequency` reads the planning batches' counts, as a "
                "stats file recorded on them would give it. " + source(*names),
                table(["GPU experts", "judged step"] + OFFLOAD_METHODS
                      + ["plan vs uniform", "vs best sglang-kt rule", "vs `--n-cpu-moe`"], rows),
                "## The CPU half of formula 8, measured\n\n"
                f"One {cpu['model']} expert (gate+up, SiLU*up, down; {cpu['hidden']} x {cpu['intermediate']}) in torch "
                f"{machine['torch']} on {machine['torch_threads']} thread of a {machine['cores']}-core {machine['cpu']} "
                f"machine (load average {machine['load_average_1min']:.1f}), the experts cycled from a "
                f"{cpu['bank_mib']} MiB bank so that the weights come from DRAM; the CPU's rates calibrated in the "
                f"same run (least of {cpu['reps']} calls each). " + source("cpu_expert.json", "cpu_this_machine.toml"),
                table(["dtype", "calibrated compute", "calibrated DRAM", "expert bytes"], rates),
                table(["dtype", "rows", "measured ms", "predicted ms", "measured / predicted", "bound", ""], cpu_rows),
                "## Online: swap resident experts over PCIe only when it pays back\n\n"
                f"Seeded drifting serving runs ({online['model']} shape, {online['layers']} layers, "
                f"{online['capacity']} experts on the GPU, {online['steps']} steps), every policy from the same plan "
                "made on the first steps: `static` (that plan), `sglang-kt dynamic` (after each full-GPU prefill "
                "pass, the batch's most frequent experts), `payback` (ours: a hot expert replaces the least valuable "
                "resident one over PCIe when the copy pays back) and the plan made on the whole run (hindsight, a "
                "reference). " + source("offload_replay.json"),
                table(["case", "full-GPU prefill from (tokens)", "policy", "total s", "vs static", "link copies",
                       "GPU copies"], online_rows))


def gpu() -> str:
    names = records("NVIDIA_*Z.json")
    parts = []
    for name in names:
        result = record(name)
        stem = name[: -len(".json")]
        plots = {p.stem[len(stem) + 1:].replace("_", " "): f"{RECORD_LINK}{p.name}"
                 for p in sorted(RESULTS.glob(f"{stem}_*.png"))}
        parts += [source(name), render_markdown(result, RESULTS / name, plots)]
        configs = RESULTS / f"{stem}_gemm_configs.json"
        if configs.exists():
            c = json.loads(configs.read_text())
            rows = [[r["block_m"], r["block_n"], r["block_k"], r["num_warps"] or "default", r["num_stages"],
                     r["group_m"], f(r["ms"], 3), f"{r['tflops']:.0f}", f(r["of_dense_8192"], 2)] for r in c["configs"]]
            parts += [f"### Grouped-GEMM launch settings ({c['experts']} experts x {c['rows_per_expert']} rows, "
                      f"h={c['hidden']}, I={c['intermediate']})", source(configs.name),
                      table(["BLOCK_M", "BLOCK_N", "BLOCK_K", "warps", "stages", "GROUP_M", "ms", "TFLOP/s",
                             "of dense 8192^3"], rows)]
    return page("gpu", "Predicted against measured on a GPU, per run: `moe-place report`'s rendering of each "
                "committed microbenchmark record ([how to run one](../microbench.md)).", *parts)



# ------------------------------------------------------------------------- figures on the task pages
# The regions between `<!-- figures: ... -->` and `<!-- end of figures -->` on these task pages are rendered here
# from the same records as the results pages (issue 46: the best cadences and ratios are generated, not typed).
FIGURE_PAGES = ("vllm.md", "sglang.md", "online.md", "split.md")
MODES = {"vllm async": ("vllm", True), "vllm sync": ("vllm", False), "sglang": ("sglang", False)}
MODE_LABEL = {"vllm async": "vLLM 0.33 async", "vllm sync": "vLLM 0.33 sync", "sglang": "SGLang 0.5.23"}
REPLAY_PROTOCOL = {"vllm async": ("vllm", "vllm"), "vllm sync": ("vllm", "vllm-sync"), "sglang": ("sglang", "sglang")}


def _replay_set(mode: str, which: str) -> tuple[list[float], list[float], list[int]]:
    """(best-against-best ratios, hindsight ratios, moe-place's best intervals) of the drifting traces of one set
    ("tuning" or "evaluation") of the replay record for `mode`."""
    engine, protocol = REPLAY_PROTOCOL[mode]
    data = record(f"replay_{engine}.json")
    names = set(data["sets"][which]) if "sets" in data else None
    ratios, hind, best = [], [], []
    for t in data["traces"]:
        if t["kind"] == "stationary" or (names is not None and t["name"] not in names):
            continue
        s = t["protocols"][protocol]
        ratios.append(s["best_ratio"])
        hind.append(s["hindsight_ratio"])
        best.append(s["best"]["moe-place"]["step_interval"])
    return ratios, hind, best


def _cadences(intervals: list[int]) -> str:
    counts = sorted(((n, i) for i, n in collections.Counter(intervals).items()), key=lambda x: (-x[0], x[1]))
    return ", ".join(f"{i} on {n}" for n, i in counts)


def _engine_drift(mode: str) -> list[dict]:
    engine, use_async = MODES[mode]
    return [d for d in record(f"engines_{engine}.json")["drift"] if d["engine"].endswith(engine) and d["async"] == use_async]


def _engine_best(mode: str) -> list[float]:
    out = []
    for d in _engine_drift(mode):
        best = {p: min(r["total_s"] for r in d["runs"] if r["policy"] == p) for p in ("default", "moe-place")}
        out.append(best["moe-place"] / best["default"])
    return out


def _engine_advised(mode: str, policy: str) -> list[float]:
    out = []
    for d in _engine_drift(mode):
        mine = [r for r in d["runs"] if r["policy"] == policy]
        advised = next(r for r in mine if r["cadence"]["step_interval"] == d["advised"][policy])
        out.append(advised["total_s"] / min(r["total_s"] for r in mine))
    return out


def _engine_prediction(mode: str, key: str = "replay_error") -> float:
    return max((abs(r[key]) for d in _engine_drift(mode) for r in d["runs"]), default=float("nan"))


def _engine_cpu(mode: str) -> list[float]:
    engine, use_async = MODES[mode]
    out = []
    for w in record(f"engines_{engine}.json")["workloads"]:
        if w["async"] == use_async or engine == "sglang":
            default, ours = ([c["policy_s"] for c in w["rows"][p]] for p in ("default", "moe-place"))
            out.append(statistics.median(ours) / statistics.median(default))
    return out


def _engine_moved(mode: str) -> tuple[list[int], list[int]]:
    engine, use_async = MODES[mode]
    ours, default = [], []
    for w in record(f"engines_{engine}.json")["workloads"]:
        if w["async"] == use_async or engine == "sglang":
            ours.append(sum(c["slots_changed"] for c in w["rows"]["moe-place"]))
            default.append(sum(c["slots_changed"] for c in w["rows"]["default"]))
    return ours, default


def _int_range(values: list[int]) -> str:
    return f"{min(values):,}" if min(values) == max(values) else f"{min(values):,}-{max(values):,}"


def _range(values, digits: int = 4) -> str:
    return span(values, digits)


def _engine_figures(modes: tuple[str, ...], what: str) -> str:
    modes = tuple(m for m in modes if _engine_drift(m)) or modes   # the modes the engine's record measured
    header = ["", *(MODE_LABEL[m] for m in modes)]
    sets = [(which, _replay_set(modes[0], which)) for which in ("evaluation", "tuning")]
    rows = [[f"the rule's best cadence in the replay (predicted by the cost model), {which} set ({len(r[2])} drifting "
             "traces)",
             *(f"every {_cadences(_replay_set(m, which)[2])}" for m in modes)] for which, r in sets]
    drift = len(_engine_drift(modes[0]))
    rows += [[f"best against best in {what} (the engine's code on a CPU, time from the cost model), {drift} drifting "
              "traces: moe-place's total over the default's",
              *(_range(_engine_best(m)) for m in modes)],
             ["`moe-place cadence`'s advised cadence in the engine's code, its total over the best cadence there: "
              "moe-place / default", *(f"{_range(_engine_advised(m, 'moe-place'))} / {_range(_engine_advised(m, 'default'))}"
                                       for m in modes)],
             ["the replay's prediction of each of those runs, worst error on the total (the policy's CPU time "
              "measured in both) / on the time without it",
              *(f"{pct(_engine_prediction(m), 2, sign=False)} / {pct(_engine_prediction(m, 'replay_model_error'), 2, sign=False)}"
                for m in modes)],
             [f"the policy's CPU time per call over the engine's own, {len(_engine_cpu(modes[0]))} sizes (measured)",
              *(f"{_range(_engine_cpu(m), 2)}x" for m in modes)]]
    moved = [_engine_moved(m) for m in modes]
    rows.append([f"slots moved over a run (a stationary load, then a new popularity), {len(moved[0][0])} sizes",
                 *(f"{_int_range(o)}, the default {_int_range(d)}" for o, d in moved)])
    return table(header, rows)


def _online_figures() -> str:
    rows = []
    for mode in MODES:
        ev, ev_h, _ = _replay_set(mode, "evaluation")
        tu, tu_h, _ = _replay_set(mode, "tuning")
        rows.append([MODE_LABEL[mode], f"{f(statistics.mean(ev))} ({_range(ev)})", f(statistics.mean(ev_h)),
                     f"{f(statistics.mean(tu))} ({_range(tu)})",
                     _range(_engine_best(mode)) if _engine_drift(mode) else "not measured",
                     f"{_range(_engine_cpu(mode), 2)}x" if _engine_cpu(mode) else "not measured"])
    ev_n, tu_n = (len(_replay_set("sglang", w)[0]) for w in ("evaluation", "tuning"))
    return table(["protocol", f"replay, evaluation set ({ev_n} traces): mean (range), predicted", "hindsight, mean",
                  f"replay, tuning set ({tu_n} traces): mean (range), predicted",
                  f"in the engine's own code, {len(_engine_drift('sglang'))} traces (time from the cost model)",
                  "CPU time per call, over the engine's own (measured)"], rows)


def _split_figures() -> str:
    data = record("split.json")
    rows = []
    if "accuracy" in data:
        rows.append(["the fast split's busiest GPU over the exact split's (whole rows), every layer and batch "
                     "(computed)", f"worst {f(data['accuracy']['worst'], 4)}"])
    for protocol in ("vllm", "sglang"):
        for factor in (1, 2):
            mine = [r for r in data.get("replay", {}).get("rows", [])
                    if r["protocol"] == protocol and r["redundant"] == factor * r["gpus"]]
            if mine:
                rows.append([f"{protocol} protocol, R = {factor}G, {len(mine)} evaluation traces: over the default's "
                             "best, the rule / the rule with the split (predicted)",
                             f"{_range([r['rule_ratio'] for r in mine])} / {_range([r['split_ratio'] for r in mine])}"])
                if all("free_split_ratio" in r for r in mine):
                    rows.append([f"{protocol} protocol, R = {factor}G: the same with a free split, every layer of "
                                 "every batch (predicted; what no charged split can beat)",
                                 _range([r["free_split_ratio"] for r in mine])])
    if "guard" in data:
        rows.append(["no redundant experts or decode batches: the rule with the split over the rule alone, worst "
                     "cadence (predicted)", f(data["guard"]["worst"], 4)])
    return table(["", "figure"], rows)


def figure_regions() -> dict[str, str]:
    """{task page under docs/: its figures region's table}."""
    return {"split.md": _split_figures(),"vllm.md": _engine_figures(("vllm async", "vllm sync"), "vLLM's own `EplbState`"),
            "sglang.md": _engine_figures(("sglang",), "SGLang's own `EPLBManager`"),
            "online.md": _online_figures()}


def render_figures() -> dict[str, str]:
    """{task page under docs/: its whole text with the figures region rendered}."""
    pages = {}
    for name, body in figure_regions().items():
        text = (ROOT / "docs" / name).read_text(encoding="utf-8")
        match = re.search(r"(<!-- figures: [^\n]*-->\n)(.*?)(<!-- end of figures -->)", text, flags=re.S)
        if match is None:
            raise RecordError(f"docs/{name}: expected a <!-- figures: ... --> ... <!-- end of figures --> region")
        pages[name] = text[:match.start(2)] + body + "\n" + text[match.end(2):]
    return pages

PAGES = {"plan-quality": plan_quality, "sizing": sizing, "scale": scale, "dropin": dropin, "windows": windows,
         "throughput": throughput, "engines": engines, "replay": replay, "multinode": multinode, "offload": offload,
         "gpu": gpu, "split": split, "split-placement": split_placement, "calibration": calibration}


def index() -> str:
    rows = []
    for path in sorted(RESULTS.iterdir()):
        if path.suffix == ".md" or not path.is_file():
            continue
        pattern = next((p for p in RECORDS if fnmatch.fnmatch(path.name, p)), None)
        if pattern is None and path.suffix in (".png", ".log"):
            owner = next((p for p in RECORDS if p.endswith("Z.json") and fnmatch.fnmatch(
                re.sub(r"(_[a-z_]+)?\.(png|log)$", ".json", path.name), p)), None)
            pattern = owner
        if pattern is None:
            raise RecordError(f"bench/results/{path.name}: a record no results page reads (add it to RECORDS in "
                              f"{SCRIPT})")
        command, slug = RECORDS[pattern]
        rows.append([f"[`{path.name}`]({RECORD_LINK}{path.name})", f"[{TITLES[slug]}]({slug}.md)", f"`{command}`"])
    return "\n".join([GENERATED_NOTE.format(script=SCRIPT).rstrip("\n"), "", "# Results", "",
                      "Every table on these pages is rendered by `docs/gen_results.py` from a committed record in "
                      "`bench/results/`, and the tests check that each page is what the script renders from the "
                      "records. The commands say `--force` where they overwrite a committed record: without it, "
                      "every benchmark keeps an existing file.", "",
                      table(["record", "page", "written by"], rows)]) + "\n"


def render() -> dict[str, str]:
    pages = {f"results/{slug}.md": build() for slug, build in PAGES.items()}
    pages["results/index.md"] = index()
    return pages


def write_or_check_figures(argv: list[str] | None = None) -> int:
    """The figures regions of the task pages: write them, or with --check exit 1 naming each that differs."""
    check = "--check" in (sys.argv[1:] if argv is None else argv)
    differ = 0
    for name, text in render_figures().items():
        path = ROOT / "docs" / name
        if path.read_text(encoding="utf-8") != text:
            differ += 1
            if check:
                print(f"{SCRIPT}: docs/{name}'s figures are not what the generator renders: run `python {SCRIPT}`",
                      file=sys.stderr)
            else:
                path.write_text(text, encoding="utf-8")
                print(f"wrote the figures of docs/{name}")
    return 1 if check and differ else 0


if __name__ == "__main__":
    try:
        code = write_or_check(SCRIPT, "results", render)
        sys.exit(write_or_check_figures() or code)
    except RecordError as exc:
        sys.exit(f"{SCRIPT}: error: {exc}")
