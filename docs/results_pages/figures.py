"""The figures on the task pages (docs/vllm.md, sglang.md, online.md, split.md).

The regions between `<!-- figures: ... -->` and `<!-- end of figures -->` on these task pages are rendered here
from the same records as the results pages (issue 46: the best cadences and ratios are generated, not typed).
"""

from __future__ import annotations

import collections
import re
import statistics
import sys

from .common import ROOT, SCRIPT, RecordError, f, pct, record, span, table

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
    return [d for d in record(f"engines_{engine}.json")["drift"]
            if d["engine"].endswith(engine) and d["async"] == use_async]


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
              "moe-place / default",
              *(f"{_range(_engine_advised(m, 'moe-place'))} / {_range(_engine_advised(m, 'default'))}"
                for m in modes)],
             ["the replay's prediction of each of those runs, worst error on the total (the policy's CPU time "
              "measured in both) / on the time without it",
              *(f"{pct(_engine_prediction(m), 2, sign=False)} / "
                f"{pct(_engine_prediction(m, 'replay_model_error'), 2, sign=False)}" for m in modes)],
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
                             f"{_range([r['rule_ratio'] for r in mine])} / "
                             f"{_range([r['split_ratio'] for r in mine])}"])
                if all("free_split_ratio" in r for r in mine):
                    rows.append([f"{protocol} protocol, R = {factor}G: the same with a free split, every layer of "
                                 "every batch (predicted; what no charged split can beat)",
                                 _range([r["free_split_ratio"] for r in mine])])
    if "choice_worst" in data.get("replay", {}):
        rows.append(["what the split's choice costs where it runs: the rule with the split over the rule alone, "
                     "each at its best cadence, worst row (predicted; the choice's CPU at the clock)",
                     f(data["replay"]["choice_worst"], 4)])
    if "guard" in data:
        rows.append(["no redundant experts or decode batches: the rule with the split over the rule alone, worst "
                     "cadence (predicted)", f(data["guard"]["worst"], 4)])
    return table(["", "figure"], rows)


def figure_regions() -> dict[str, str]:
    """{task page under docs/: its figures region's table}."""
    return {"split.md": _split_figures(),
            "vllm.md": _engine_figures(("vllm async", "vllm sync"), "vLLM's own `EplbState`"),
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
