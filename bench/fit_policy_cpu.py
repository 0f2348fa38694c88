"""Fit the policies' CPU price per call (`moe_place.online.policy_cpu`) on the committed replay records.

Fits `t = a L + b L P + c L E W / 1000` per protocol and policy on the tuning traces of
`bench/results/replay_sglang.json` and `replay_vllm.json` (the engines' own default code and moe-place's
rule, timed one call at a time), and prints the price against what each run measured on both sets:
per run (its calls' total) and summed over the set's runs. The evaluation traces are never fitted on.

    python bench/fit_policy_cpu.py [--out bench/results/policy_cpu.json --force]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from moe_place.online.policy_cpu import COEFFICIENTS, POLICIES, PROTOCOLS, RECORDS, fit, record_runs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import add_record_options, missed_targets, refuse_overwrite, write_record  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def errors(runs: list[dict], coefficients) -> dict:
    """Priced over measured, per run (least, most) and summed over the runs."""
    priced = np.array([r["calls"] * float(r["terms"] @ np.array(coefficients)) for r in runs])
    measured = np.array([r["cpu_s"] for r in runs])
    ratio = priced / measured
    return {"runs": len(runs), "least": float(ratio.min()), "most": float(ratio.max()),
            "sum": float(priced.sum() / measured.sum())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_record_options(parser, committed=("bench/results/policy_cpu.json",))
    args = parser.parse_args(argv)
    refuse_overwrite(parser, args)
    rows = []
    print(f"{'protocol':>10} {'policy':>10} {'a us':>8} {'b us':>8} {'c us':>8}   priced/measured per run, "
          "least-most (sum): tuning | evaluation | committed")
    for protocol in PROTOCOLS:
        record = json.loads((ROOT / RECORDS[protocol]).read_text())
        runs = record_runs(record, protocol)
        for policy in POLICIES:
            mine = [r for r in runs if r["policy"] == policy]
            coefficients = fit([r for r in mine if r["set"] == "tuning"])
            seen = {kind: errors([r for r in mine if r["set"] == kind], coefficients)
                    for kind in ("tuning", "evaluation")}
            same = bool(np.allclose(coefficients, COEFFICIENTS[(protocol, policy)], rtol=1e-6, atol=1e-12))
            rows.append({"protocol": protocol, "policy": policy, "record": RECORDS[protocol],
                         "coefficients_s": list(coefficients), "committed": same, **seen})
            text = " | ".join(f"{e['least']:.2f}-{e['most']:.2f} ({e['sum']:.3f})" for e in seen.values())
            print(f"{protocol:>10} {policy:>10} " + " ".join(f"{c * 1e6:>8.3f}" for c in coefficients)
                  + f"   {text} | {'same' if same else 'DIFFERS'}")
    if args.output_json:
        write_record(args.output_json, {"command": ["bench/fit_policy_cpu.py", *(argv if argv is not None else
                                                                             sys.argv[1:])],
                                     "model": "t = a L + b L P + c L E W / 1000 seconds per call", "fits": rows})
        print(f"wrote {args.output_json}")
    differ = [f"{r['protocol']} {r['policy']}" for r in rows if not r["committed"]]
    return missed_targets("fit_policy_cpu", [f"the committed prices of moe_place.online.policy_cpu differ from "
                                             f"this fit: {', '.join(differ)}"] if differ else [])


if __name__ == "__main__":
    sys.exit(main())
