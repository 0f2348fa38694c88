"""Option parsers shared by subcommands: each rejects a bad value with one clear line.

Output paths are checked when the options are parsed, before any work starts: a directory, a
missing or unwritable folder, or a read-only file is a usage error (exit 2).
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

from moe_place.io import output_problem


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


def output_file(text: str) -> str:
    """A path a file can be written to (checked now, before the work: see the module docstring)."""
    problem = output_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"expected a writable file path, got {text!r} ({problem})")
    return text


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
    """Bytes as `24GiB`, `80GB`, `512 MiB`, `2.5e10` or a plain integer (rounded down to whole bytes)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"expected bytes like 24GiB, 80GB or 25769803776, got {text!r}")
    value = float(match.group(1)) * BYTE_UNITS[unit]
    if not math.isfinite(value) or value >= 2**62:
        raise argparse.ArgumentTypeError(f"expected a byte count below 2^62, got {text!r}")
    return int(value)


def int_list(text: str) -> list[int]:
    """A comma-separated list of positive integers, e.g. `8,16,32`."""
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return [positive_int(p) for p in parts]


def layer_selection(text: str) -> list[int]:
    """Layers as `0,5,7` or ranges `0-3,10` (inclusive), each >= 0."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if lo < 0 or hi < lo:
                    raise ValueError
                out.extend(range(lo, hi + 1))
            else:
                value = int(part)
                if value < 0:
                    raise ValueError
                out.append(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected layers like 0,5,7 or 0-3, got {text!r}") from None
    return sorted(set(out))


def add_trace_options(parser: argparse.ArgumentParser) -> None:
    """Options for reading a trace whose file does not record everything (count-only dumps)."""
    parser.add_argument("--top-k", type=positive_int, metavar="K",
                        help="the router's top-k, for count-only files that do not record it (default: the file's; "
                             "CSV/JSON count files without it need this)")
    parser.add_argument("--keep-dense-layers", action="store_true",
                        help="keep the all-zero rows of dense layers in SGLang dumps (default: drop them)")


def trace_load_options(args: argparse.Namespace) -> dict:
    """Keyword arguments for `moe_place.traces.load_trace` from `add_trace_options`."""
    return {"top_k": args.top_k, "keep_dense_layers": args.keep_dense_layers}


# ---------------------------------------------------------------------- the layer-time model
DISPATCH_CHOICES = ("deepep", "all-to-all")            # moe_place.cost.comm.DISPATCH_STYLES
REPLICA_CHOICE_NAMES = ("sglang-static", "vllm", "sglang-dynamic", "node-aware")  # ... REPLICA_CHOICES
TOKEN_HOME_CHOICES = ("blocks", "round-robin")          # ... TOKEN_HOMES
WEIGHT_CHOICES = ("once", "tiles", "l2", "none")        # moe_place.cost.gemm.WEIGHT_MODES


def add_time_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the layer-time model (`moe_place.cost.comm`), shared by `plan` and `evaluate`."""
    parser.add_argument("--topology", metavar="SPEC",
                        help="cluster, e.g. '4 nodes x 8 H100, NVLink 450 GB/s, 400 Gbit/s NIC per GPU' (default: "
                             "the plan's nodes of H100s with NVLink 450 GB/s and one 400 Gbit/s NIC per GPU)")
    parser.add_argument("--dispatch", choices=DISPATCH_CHOICES, default="deepep",
                        help="deepep: one RDMA send per (token, remote node), NVLink fan-out inside the node; "
                             "all-to-all: one send per (token, destination GPU) (default deepep)")
    parser.add_argument("--replica-choice", choices=REPLICA_CHOICE_NAMES, default="sglang-static",
                        help="which replica a (token, expert) pair uses: sglang-static (default: what SGLang does "
                             "with a plan from --init-expert-location: same GPU, same node, else a fair draw), vllm "
                             "(position modulo replicas), sglang-dynamic (uniform random), node-aware (ours: home "
                             "GPU, home node, a node the token visits anyway, the least-loaded)")
    parser.add_argument("--token-home", choices=TOKEN_HOME_CHOICES, default="blocks",
                        help="where a step's tokens live: contiguous blocks per GPU or round-robin (default blocks)")
    parser.add_argument("--model", metavar="PRESET",
                        help="expert shape for row bytes and FLOPs (default: from the trace's model name), e.g. "
                             "Qwen3-30B-A3B, DeepSeek-V3, Qwen3-235B-A22B, Mixtral-8x7B, OLMoE-1B-7B")
    parser.add_argument("--weights", choices=WEIGHT_CHOICES, default="once",
                        help="expert weight reads in the compute time: once (formula 1, default), tiles (formula 5, "
                             "needs --block-m), l2, none")
    parser.add_argument("--block-m", type=positive_int, metavar="M",
                        help="GEMM tile height, with --weights tiles (default: none)")


# ---------------------------------------------------------------------- redundancy sizing
def add_sizing_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `plan --redundant auto` (`moe_place.solvers.sizing`)."""
    group = parser.add_argument_group("redundancy sizing (--redundant auto)")
    group.add_argument("--min-gain-per-gib", type=non_negative_float, metavar="F",
                       help="with --redundant auto: the least relative drop in held-out busiest/mean that one GiB of "
                            "replicas per GPU must buy (default 0.01, i.e. 1%%)")
    group.add_argument("--max-redundant", type=non_negative_int, metavar="R",
                       help="with --redundant auto: the largest R to size (default 2E, at most E(G-1))")
    group.add_argument("--max-replica-bytes", type=positive_int, metavar="BYTES",
                       help="with --redundant auto: the most bytes per GPU the redundant experts may take "
                            "(default: no cap)")
    group.add_argument("--plot", type=output_file, metavar="FILE.png",
                       help="with --redundant auto: also write a PNG of held-out busiest/mean and KV tokens lost "
                            "against R (default: none)")
