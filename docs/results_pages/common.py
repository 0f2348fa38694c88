"""What the results pages share: the records' index (`RECORDS`), the pages' titles, reading a record and
formatting its numbers into a page (docs/gen_results.py assembles the pages)."""

from __future__ import annotations

import fnmatch
import glob
import importlib.util
import json
from pathlib import Path

from pagegen import GENERATED_NOTE, ROOT  # the docs' own helper, in docs/ (on the path: docs/gen_results.py)

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
    "sizing_ep*.json": (f"python bench/cli_record.py --out bench/results/sizing_epG.json --force -- plan {TRACE} "
                        "--gpus G --redundant auto --format json --no-progress --out /tmp/planG.json", "sizing"),
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
                         "vllm,vllm-sync --default-policy engine --torch-threads 1 "
                         "--out bench/results/replay_vllm.json --force", "replay"),
    "replay_sglang.json": (overlay("sglang", core=0)
                           + " bench/bench_replay.py --held-out --evaluation --protocols sglang "
                           "--default-policy engine --torch-threads 1 --out bench/results/replay_sglang.json --force",
                           "replay"),
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
    "offload_heldout_*.json": (f"python bench/cli_record.py --out bench/results/offload_heldout_M.json --force -- "
                               f"offload {TRACE} --gpu-memory M --kv-reserve 4GiB --format json", "offload"),
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
    "replay": "Online rebalancing, best against best", "multinode": "Multi-node EP", "offload": "Offloaded serving",
    "gpu": "GPU microbenchmarks",
    "split-placement": "Placement for the per-batch split", "split": "The per-batch split",
    "calibration": "The model against published measurements",
}


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


def bench_module(name: str):
    """bench/NAME.py as a module (bench/ is not a package): its table renderers, which docs/multinode.md
    shows verbatim too."""
    spec = importlib.util.spec_from_file_location(f"{name}_for_docs", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
