"""Where a subcommand's result goes: stdout, or a file written atomically (said on stderr)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from moe_place.errors import InputError
from moe_place.io import write_atomic


def report_format(fmt: str | None, out: str | None) -> tuple[str, str]:
    """(format, label for `emit`) of a table-or-JSON report: `--format` if given, else JSON for an
    `--out` ending in `.json` (the label says it was the suffix), else the table. `--format table`
    with a `.json` file is an InputError: the file would not be what its name says."""
    is_json = out is not None and Path(out).suffix.lower() == ".json"
    if fmt == "table" and is_json:
        raise InputError("--out", "a file name not ending in .json for --format table (or --format json)", out)
    if fmt is None and is_json:
        return "json", "json (as its suffix says)"
    return fmt or "table", fmt or "table"


def emit(text: str, output: str | None, label: str) -> None:
    """Write `text` to the file `output` (atomically), or to stdout when `output` is None."""
    if output:
        write_atomic(output, text)
        print(f"wrote {label} {output}", file=sys.stderr)
    else:
        sys.stdout.write(text)


def plural(count: int, word: str) -> str:
    """`1 step`, `3 steps`."""
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def wrote(what: str, path: str) -> None:
    """Tell the user (on stderr) that a file was written."""
    print(f"wrote {what} {path}", file=sys.stderr)


def print_report(report: dict, fmt: str, header: str = "") -> None:
    """Report to stdout as JSON or as a per-layer table with a summary line."""
    if fmt == "json":
        sys.stdout.write(json.dumps(report, indent=1) + "\n")
        return
    lines = [header] if header else []
    lines.append(f"{'layer':>6} {'max_gpu_load':>14} {'mean_gpu_load':>14} {'balanced':>9} {'lower_bound':>14} "
                 f"{'gap':>8}  status")
    for row in report["layers"]:
        lines.append(f"{row['layer']:>6} {row['max_gpu_load']:>14.2f} {row['mean_gpu_load']:>14.2f} "
                     f"{row['balancedness']:>9.4f} {row['lower_bound']:>14.2f} {row['gap']:>8.2%}  "
                     f"{row.get('status', '')}")
    gaps = [row["gap"] for row in report["layers"]]
    balance = [row["balancedness"] for row in report["layers"]]
    summary = f"mean gap {sum(gaps) / len(gaps):.2%}, worst gap {max(gaps):.2%}, mean balancedness " \
              f"{sum(balance) / len(balance):.4f}"
    if "status" in report:
        summary += f", status {report['status']}, {report.get('wall_s', 0):.2f} s"
    lines.append(summary)
    if "time" in report:
        t = report["time"]
        cv = t["cv_held_out_s"]
        lines.append(f"predicted layer time on the training tokens (summed over layers and steps) "
                     f"{t['predicted_layer_time_s'] * 1e3:.4f} ms, balance-only plan {t['balance_predicted_layer_time_s'] * 1e3:.4f} ms, lower bound "
                     f"{t['lower_bound_s'] * 1e3:.4f} ms; grouping strength {t['strength']} "
                     f"({t['layers_grouped']} of {len(report['layers'])} layers grouped"
                     + (f": those whose dispatch + combine saved more than {t['min_saving']:.0%} of the layer time "
                        f"on every held-out window" if t.get("min_saving") is not None else
                        ": those whose expected saving over the layers' held-out windows is positive"
                        if t.get("decision") == "expected" else "") + ")")
        if cv:
            lines.append("held-out time of the windows (ms): " + ", ".join(f"{k} {v * 1e3:.4f}" for k, v in cv.items()))
        if t.get("pooled"):
            lines.append("expected saving over the layers (share of the layer time): " + ", ".join(
                f"{part} {p['mean']:+.2%} (each layer's own windows kept at {p['weight']:.2f})"
                for part, p in t["pooled"].items()))
    sys.stdout.write("\n".join(lines) + "\n")


def model_header(gpu, replica_choice: str, price=None, weights: str = "calibrated", block_m: int | None = None,
                 dispatch: str = "deepep", replay: bool = False) -> str:
    """One line: the layer-time model a command priced with, the same words in every command (docs/MODEL.md,
    "One model"). gpu: a `GpuSpec`; replay: the line of `replay` and `cadence`, which also say how a policy call
    is paid (price: their `PolicyCpuPrice`, None: the clock) and that the traffic is each step's expected rows."""
    if weights == "calibrated":
        expert = f"expert time formula 11 on {gpu.name} ({profile_words(gpu)}; BLOCK_M {block_m or 64})"
    else:
        expert = f"expert time weights {weights} on {gpu.name}" + (f" (BLOCK_M {block_m})" if block_m else "")
    traffic = f"dispatch {dispatch}" + (" (each step's expected rows)" if replay else "")
    parts = [expert, traffic, f"replica choice {replica_choice}"]
    if replay:
        parts.append("policy calls priced as the engines' own code and the rule cost in the records" if price
                     is not None else "policy calls at this machine's clock")
    return ", ".join(parts)


def profile_words(gpu) -> str:
    """Where a GPU's formula-11 terms come from, in a few words: the committed H200 fit, scaled or not, or a
    record of its own (`--hardware-from`)."""
    source = gpu.gemm_profile().source
    if "scaled to" in source:
        return "the H200 record's fit, scaled by its rates"
    return "fitted on " + source.removeprefix("fit of ")
