"""Option parsers shared by subcommands: each rejects a bad value with one clear line.

Output paths are checked when the options are parsed, before any work starts: a directory, a
missing or unwritable folder, or a read-only file is a usage error (exit 2).
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

from moe_place.cores import parse_workers, workers_expected
from moe_place.io import output_file, output_problem


def _int_at_least(text: str, minimum: int, expected: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0, "an integer >= 0")


def _float_where(text: str, ok, expected: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not math.isfinite(value) or not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def redundant_count(text: str) -> int | str:
    """`--redundant` of `plan`: an integer >= 0, or `auto` (size it: moe_place.solvers.sizing)."""
    if text.strip().lower() == "auto":
        return "auto"
    return _int_at_least(text, 0, "an integer >= 0 or auto")


def positive_float(text: str) -> float:
    return _float_where(text, lambda v: v > 0, "a positive finite number")


def non_negative_float(text: str) -> float:
    return _float_where(text, lambda v: v >= 0, "a finite number >= 0")


def fraction(text: str) -> float:
    return _float_where(text, lambda v: 0 <= v <= 1, "a number in [0, 1]")


def share_below_one(text: str) -> float:
    """A share of a whole in [0, 1), e.g. 0.005 for half a percent (5 would be 500%)."""
    return _float_where(text, lambda v: 0 <= v < 1, "a share in [0, 1), e.g. 0.005 for 0.5%")


MAX_LAYERS = 1 << 16  # model layer ids and layer counts on a command line: a sanity bound (models have ~100)


def jobs(text: str) -> int:
    """Worker processes: 1 up to the usable cores (`moe_place.cores`: the rule $MOE_PLACE_THREADS follows too)."""
    value = parse_workers(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"expected {workers_expected()}, got {text!r}")
    return value


def layer_count(text: str) -> int:
    """A number of model layers, 1 to MAX_LAYERS."""
    value = positive_int(text)
    if value > MAX_LAYERS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_LAYERS} layers, got {text!r}")
    return value


def add_split_cost_arguments(parser) -> None:
    """What the per-batch split charges each layer and batch where it is on (`evaluate`, `replay`, `cadence`)."""
    parser.add_argument("--split-solve-us", type=non_negative_float, default=None,
                        help="with the per-batch (or optimal) split: microseconds its solve adds to a layer and batch "
                             "(default 10: the kernel's goal, not a measurement; bench/gpu_check.sh times it)")
    parser.add_argument("--split-allreduce-us", type=non_negative_float, default=None,
                        help="... and the all-reduce of the batch's counts (default: NCCL's latency model for the "
                             "cluster: 10.2 us on 1 node of 8 GPUs, 37.5 us on 4)")


def add_progress_option(parser: argparse.ArgumentParser) -> None:
    """`--no-progress`, taken by every subcommand whose work can run long (dest `no_progress`): the
    progress bar on stderr is drawn only when stderr is a terminal, and never with this."""
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar on stderr (default: one while the long part runs, when stderr is a "
                             "terminal)")


# Output file names whose suffix must say what is written (docs/errors.md, "Output files"):
OTHER_FORMATS = (".npz", ".npy", ".pt", ".png", ".csv", ".toml")  # never the name of a table or JSON report


def output_with_suffix(suffixes: tuple[str, ...], what: str):
    """An argparse type: a writable path (`output_file`) ending in one of `suffixes`; `what` says why."""
    def check(text: str) -> str:
        output_file(text)
        if Path(text).suffix.lower() not in suffixes:
            raise argparse.ArgumentTypeError(f"expected a file name ending in {' or '.join(suffixes)} ({what}), "
                                             f"got {text!r}")
        return text
    return check


json_file = output_with_suffix((".json",), "the file is JSON")
png_file = output_with_suffix((".png",), "the plot is a PNG")
trace_file = output_with_suffix((".npz", ".csv", ".json"), "the trace is written in the format its suffix names")


def report_file(text: str) -> str:
    """A writable path for a table or JSON report: `.json` gets JSON (`output.report_format`), the
    suffixes of other formats (`OTHER_FORMATS`) are refused, any other name gets the table."""
    output_file(text)
    if Path(text).suffix.lower() in OTHER_FORMATS:
        raise argparse.ArgumentTypeError(f"expected a file name for a table (.txt, .md, ...) or JSON (.json), not "
                                         f"{Path(text).suffix}, got {text!r}")
    return text


def add_out_argument(parser: argparse.ArgumentParser, kind, metavar: str, what: str, *, aliases: tuple[str, ...] = (),
                     required: bool = False, default_text: str = "none") -> None:
    """`--out` (dest `out`), the one name of a subcommand's output file; `aliases` are the older names,
    kept so old command lines still work."""
    also = f" ({', '.join(aliases)}: the same, the older name)" if aliases else ""
    default = "required" if required else f"default: {default_text}"
    parser.add_argument("--out", *aliases, dest="out", type=kind, required=required, metavar=metavar,
                        help=f"{what}{also} ({default})")


def format_option(parser: argparse.ArgumentParser) -> None:
    """`--format table|json` for a subcommand whose `--out` is a `report_file` (default: from `--out`'s suffix)."""
    parser.add_argument("--format", choices=("table", "json"), default=None,
                        help="output format (default: json when --out ends in .json, else table)")


def output_dir(text: str) -> str:
    """A folder to write into: an existing writable folder, or a new one in an existing writable folder."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"expected a folder, got {text!r} (a file)")
    probe = path / "probe" if path.is_dir() else path
    problem = output_problem(probe)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"expected a writable folder, got {text!r} ({problem})")
    return text


BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # GB decimal, GiB binary (cost/units.py)


def byte_size(text: str) -> int:
    """Bytes as `24GiB`, `1.4GiB`, `80GB`, `512 MiB`, `2.5e10` or a plain integer (rounded down to
    whole bytes): the one syntax of every memory option."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"expected bytes like 24GiB, 1.5MiB, 80GB or 25769803776, got {text!r}")
    value = float(match.group(1)) * BYTE_UNITS[unit]
    if not math.isfinite(value) or value >= 2**62:
        raise argparse.ArgumentTypeError(f"expected a byte count below 2^62, got {text!r}")
    return int(value)


def positive_byte_size(text: str) -> int:
    """`byte_size` of at least one byte (a budget or an object's size: 0 would divide by zero later)."""
    value = byte_size(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1 byte (like 24GiB, 1.5MiB or 4096), got {text!r}")
    return value


def int_list(text: str) -> list[int]:
    """A comma-separated list of positive integers, e.g. `8,16,32`."""
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return [positive_int(p) for p in parts]


def layer_selection(text: str) -> list[int]:
    """Layers as `0,5,7` or ranges `0-3,10` (inclusive), each in [0, MAX_LAYERS) (checked before a
    range is expanded)."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        try:
            lo, hi = (int(x) for x in part.split("-", 1)) if "-" in part else (int(part), int(part))
            if lo < 0 or hi < lo or hi >= MAX_LAYERS:
                raise ValueError
            out.extend(range(lo, hi + 1))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected layers like 0,5,7 or 0-3, each in [0, {MAX_LAYERS}), "
                                             f"got {text!r}") from None
    return sorted(set(out))


def step_items(text: str) -> list[str]:
    """`--steps`: comma-separated step names or positions, ranges of positions inclusive (`0-1,ep_states`);
    checked against the trace when it is read (`Trace.step_positions`)."""
    items = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in items):
        raise argparse.ArgumentTypeError(f"expected comma-separated step positions or names, like 0,1 or 0-1 or "
                                         f"ep_states, got {text!r}")
    return items


def add_steps_option(parser: argparse.ArgumentParser, what: str) -> None:
    """`--steps IDS` (dest `steps`): the steps of the trace a command uses; `what` says what it does with them.
    A plan made with `--steps 0,1` and judged with `evaluate --steps 2` is judged out of sample."""
    parser.add_argument("--steps", type=step_items, metavar="IDS",
                        help=f"{what} only these steps of the trace, by position (0,1 or 0-1) or name (ep_states): "
                             "each recorded batch of a bundled trace is a step; with `plan --steps` and `evaluate "
                             "--steps` one file gives a plan and the steps it never saw (default: all)")


def add_trace_options(parser: argparse.ArgumentParser) -> None:
    """Options for reading a trace whose file does not record everything (count-only dumps)."""
    parser.add_argument("--top-k", type=positive_int, metavar="K",
                        help="the router's top-k, for count-only files that do not record it (default: the file's; "
                             "CSV/JSON count files without it need this)")
    parser.add_argument("--keep-dense-layers", action="store_true",
                        help="keep the all-zero rows of dense layers in SGLang dumps (default: drop them)")


def trace_load_options(args: argparse.Namespace) -> dict:
    """Keyword arguments for `moe_place.traces.load_trace` from `add_trace_options` (and
    `add_progress_option`: a command without it draws the bar whenever stderr is a terminal)."""
    return {"top_k": args.top_k, "keep_dense_layers": args.keep_dense_layers,
            "progress": not getattr(args, "no_progress", False)}


# ---------------------------------------------------------------------- the layer-time model
# the registries' names without importing them here (`--help` stays fast: CP-SAT's import alone takes a second);
# moe_place.cli.shared checks each list against its registry at import
SOLVER_CHOICES = ("auto", "cpsat", "eplb", "fast", "trtllm")  # moe_place.solvers.solver_names() and "auto"
DISPATCH_CHOICES = ("deepep", "all-to-all")            # moe_place.cost.comm.DISPATCH_STYLES
REPLICA_CHOICE_NAMES = ("sglang-static", "vllm", "sglang-dynamic", "node-aware")  # cost.replicas.TOKEN_CHOICES
TOKEN_HOME_CHOICES = ("blocks", "round-robin")          # ... TOKEN_HOMES
WEIGHT_CHOICES = ("calibrated", "once", "tiles", "l2", "none")  # moe_place.cost.gemm.WEIGHT_MODES


# the layer-time model's one set of defaults, the same for every command that prices time (`plan`, `evaluate`,
# `compare`; `replay` and `cadence` take the expert time from the same `moe_place.cost.gemm.DEFAULT_WEIGHTS`):
# formula 11, the expert time calibrated on a GPU's measured grouped GEMM (docs/MODEL.md)
TIME_MODEL_DEFAULTS = {"dispatch": "deepep", "replica_choice": "sglang-static", "token_home": "blocks",
                       "weights": "calibrated"}   # moe_place.cost.gemm.DEFAULT_WEIGHTS (a test checks they agree)


def add_time_model_arguments(parser: argparse.ArgumentParser, from_plan: bool = False) -> None:
    """Options of the layer-time model (`moe_place.cost.comm`), shared by `plan`, `evaluate` and `compare`.
    Their defaults are None (then `time_model_defaults`: the same in every command), so a command that reads a
    plan (`from_plan`: evaluate) can say where the plan was made under other options; it judges with these."""
    plan = "the plan's, else " if from_plan else ""
    parser.add_argument("--topology", metavar="SPEC",
                        help="cluster, e.g. '4 nodes x 8 H100, NVLink 450 GB/s, 400 Gbit/s NIC per GPU' (default: "
                             f"{'the --topology the plan was made with, else ' if from_plan else ''}the plan's nodes "
                             "of H100s with NVLink 450 GB/s and one 400 Gbit/s NIC per GPU)")
    parser.add_argument("--dispatch", choices=DISPATCH_CHOICES, default=None,
                        help="deepep: one RDMA send per (token, remote node), NVLink fan-out inside the node; "
                             "all-to-all: one send per (token, destination GPU) (default: deepep)")
    parser.add_argument("--replica-choice", choices=REPLICA_CHOICE_NAMES, default=None,
                        help="which replica a (token, expert) pair uses: sglang-static (what SGLang does "
                             "with a plan from --init-expert-location: same GPU, same node, else a fair draw), vllm "
                             "0.33 (the Knuth hash of the token's index in its rank's batch), sglang-dynamic (uniform "
                             "random), node-aware (ours: home GPU, home node, a node the token visits anyway, the "
                             "least-loaded) (default: sglang-static)")
    parser.add_argument("--token-home", choices=TOKEN_HOME_CHOICES, default=None,
                        help="where a step's tokens live: contiguous blocks per GPU or round-robin "
                             "(default: blocks)")
    parser.add_argument("--model", metavar="PRESET",
                        help=f"expert shape for row bytes and FLOPs (default: {plan}from the trace's model name), e.g. "
                             "Qwen3-30B-A3B, DeepSeek-V3, Qwen3-235B-A22B, Mixtral-8x7B, OLMoE-1B-7B")
    parser.add_argument("--weights", choices=WEIGHT_CHOICES, default=None,
                        help="the expert time: calibrated (formula 11, fitted on a GPU's measured grouped GEMM; "
                             "see --hardware-from), once (formula 1: weights read once), tiles (formula 5, needs "
                             "--block-m), l2, none (default: calibrated, the same in every command)")
    parser.add_argument("--block-m", type=positive_int, metavar="M",
                        help="GEMM tile height, with --weights tiles or calibrated (default: 64 for calibrated)")


def time_model_defaults(args: argparse.Namespace) -> None:
    """Fill the time-model options still None with `TIME_MODEL_DEFAULTS` (in place)."""
    for key, value in TIME_MODEL_DEFAULTS.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


# ---------------------------------------------------------------------- redundancy sizing
def add_sizing_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `plan --redundant auto` (`moe_place.solvers.sizing`)."""
    group = parser.add_argument_group("redundancy sizing (--redundant auto)")
    for flag, kind, metavar, text in (
            ("--min-gain-per-gib", non_negative_float, "F", "the least relative drop in held-out busiest/mean that "
             "one GiB of replicas per GPU must buy (default 0.01, i.e. 1%%)"),
            ("--max-redundant", non_negative_int, "R", "the largest R to size (default 2E, at most E(G-1))"),
            ("--max-replica-bytes", positive_byte_size, "BYTES", "the most bytes per GPU the redundant experts may "
             "take, e.g. 8GiB (default: no cap)"),
            ("--plot", png_file, "FILE.png", "also write a PNG of held-out busiest/mean and KV tokens lost against R "
             "(default: none)")):
        group.add_argument(flag, type=kind, metavar=metavar, help="with --redundant auto: " + text)


# ---------------------------------------------------------------------- the expert time measured on a GPU
def add_hardware_from_option(parser) -> None:
    """`--hardware-from RESULT.json` (dest `hardware_from`): formula 11's terms fitted on a GPU's
    `bench/gpu_check.sh` result (`moe_place.cli.shared.gpu_with_record`)."""
    parser.add_argument("--hardware-from", metavar="RESULT.json",
                        help="price expert time with formula 11's terms fitted on this bench/gpu_check.sh result "
                             "(bench/results/*.json); the GPU is the record's part (default: the part's terms "
                             "scaled from the committed H200 record, docs/MODEL.md)")

