"""The benchmarks' record plumbing: their output options (`add_record_options`, `refuse_overwrite`), their exit
codes (`missed_targets`, `interrupted`), and what every record says of its run (`provenance`, which
`write_record` adds). Here, in bench/, so that no bench script imports the CLI (`moe_place.cli`) for it."""

from __future__ import annotations

import argparse
import datetime
import inspect
import os
import platform
import subprocess
import sys
from pathlib import Path

from moe_place.io import output_file, write_json_atomic


def add_record_options(parser: argparse.ArgumentParser, plot: bool = False, committed: tuple[str, ...] = ()) -> None:
    """A benchmark's output files: `--out FILE` (alias `--output-json`, the older name; dest
    `output_json`) for its JSON record, `--plot FILE.png` if `plot`, and `--force`. After
    `parse_args`, `refuse_overwrite(parser, args)` keeps existing files (the committed records in
    bench/results/, named in the help by `committed`) unless `--force`."""
    record = f"; the committed record: {', '.join(committed)}" if committed else ""
    parser.add_argument("--out", "--output-json", dest="output_json", type=output_file, metavar="FILE",
                        help="write the results as JSON to FILE (--output-json is the same); an existing file is "
                             f"kept unless --force (default: print only{record})")
    if plot:
        parser.add_argument("--plot", type=output_file, metavar="FILE.png",
                            help="also write a PNG; an existing file is kept unless --force (default: none)")
    parser.add_argument("--force", action="store_true", help="overwrite existing --out/--plot files")


def refuse_overwrite(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit 2 with one line, before any work, when an output file of `add_record_options` exists and
    `--force` is not given: rerunning a benchmark must not silently replace a committed record."""
    for flag, path in (("--out", args.output_json), ("--plot", getattr(args, "plot", None))):
        if path and Path(path).exists() and not args.force:
            parser.exit(2, f"{parser.prog}: error: {flag} {path}: the file exists (a committed record?); give "
                           f"another path, or --force to overwrite it\n")


def missed_targets(prog: str, missed: list[str]) -> int:
    """A benchmark's exit code: 0 when no target was `missed`; else 1, after one line on stderr naming
    each missed target (the table on stdout may be redirected to a file; the verdict must still show)."""
    if not missed:
        return 0
    targets = "1 target" if len(missed) == 1 else f"{len(missed)} targets"
    print(f"{prog}: {targets} missed: {'; '.join(missed)}", file=sys.stderr)
    return 1


def interrupted(prog: str) -> int:
    """A benchmark's exit code after Ctrl-C stopped it before it wrote anything: 130, after one line on
    stderr saying so."""
    print(f"{prog}: interrupted; nothing written", file=sys.stderr)
    return 130


def machine() -> dict:
    """The CPU a record's times were measured on (policies' CPU times per call, and their ratio, differ
    between machines): its model as /proc/cpuinfo names it (else `platform`'s), its cores, and whether it
    has AVX-512."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return {"cpu": fields.get("model name") or platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "avx512": "avx512f" in fields.get("flags", "").split()}


def provenance() -> dict:
    """What a record says of its run: this checkout's commit (None where git cannot say) and whether files differed
    from it, the UTC date, the machine (`machine`) and the layer-time model's defaults (`moe_place.cost.cluster`'s
    cluster and expert time, dispatch and combine as each step's expected DeepEP rows)."""
    from moe_place.cost.cluster import DEFAULT_BLOCK_M, cluster_cost
    from moe_place.cost.gemm import DEFAULT_WEIGHTS

    cluster = {name: p.default for name, p in inspect.signature(cluster_cost).parameters.items()
               if name in ("hardware", "nic_gbit_per_s", "model")}
    return {"commit": _git("rev-parse", "HEAD"), "uncommitted_changes": bool(_git("status", "--porcelain")),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
            "model_defaults": {"expert_time": DEFAULT_WEIGHTS, "block_m": DEFAULT_BLOCK_M, **cluster,
                               "dispatch_combine": "deepep, each step's expected rows"}}


def write_record(path: str | Path, doc: dict) -> None:
    """Write a benchmark's JSON record `doc` to `path` (atomically), with its `provenance` unless it has one."""
    if "provenance" not in doc:
        doc["provenance"] = provenance()
    write_json_atomic(path, doc)


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None
