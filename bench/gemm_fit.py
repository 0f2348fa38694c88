"""Formula 11 (the calibrated expert time, docs/MODEL.md) against a `bench/gpu_check.sh` record: the fit
and every check, beside the formulas it replaces.

    python bench/gemm_fit.py [bench/results/NVIDIA_H200_20261130T210929Z.json] [--points] [--out FIT.json]

Fits t0, C and B_t on the record's padding sweep at >= 64 rows per expert (the fit set,
`moe_place.cost.gemm_profile.fit_profile`) and prints predicted / measured per group of the record:
- `fit`: the fitted rows (8 experts, h = 2048, I = 768, BLOCK_M 16-128);
- `decode`: the sweep's rows under 64 rows per expert, not fitted;
- `gemm`: the GEMM section, another shape (8 experts, h = 4096, I = 1536, BLOCK_M 64 or 128), BF16;
- `fp8`: the same GEMMs with FP8 inputs (1-byte elements in the formula);
- `payback`: the payback section's before and after rows (h = 4096, BLOCK_M 64; uneven after);
- `skew`: every rank of the skew section (16 or 17 experts of uneven rows, h = 2048, BLOCK_M 64); a
  record without each rank's rows (`slot_rows`, older records) gets them dealt again as
  bench/microbench.py deals them, checked against the record's rows per rank.
Beside formula 11: formula 5 (`tiles`) and the L2 model at the record's measured rates (dense
matmul FLOP/s, copy read+write bytes/s), and the L2 model at the catalog part's rates (half its
peaks). `512-4096` columns: the points with 512 to 4,096 rows per expert (uneven rows: their mean).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np

from moe_place.cost.gemm import expert_time_s
from moe_place.cost.gemm_profile import FIT_MIN_ROWS, H200_RECORD, fit_profile, read_record, record_points, skew_points
from moe_place.cost.hardware import builtin_catalog

sys.path.insert(0, str(Path(__file__).resolve().parent))
import microbench  # noqa: E402  (bench/ is not a package: the skew section's own dealing of rows)
from records import add_record_options, refuse_overwrite, write_record  # noqa: E402  (bench/ is not a package)

FORMULAS = ("formula 11", "formula 5", "L2", "L2 catalog")


def dealt_skew_rows(data: dict) -> list[list[list[int]]]:
    """Each skew case's rows per rank and local expert, dealt again as bench/microbench.py deals them
    (for records older than `slot_rows`); each rank's sum must be the record's `rows_per_gpu`."""
    from moe_place.analysis.replicate_hottest import replicate_hottest
    from moe_place.placement import Placement

    skew = data["sections"]["skew"]
    sizes = microbench.Sizes(**{k: tuple(v) if isinstance(v, list) else v for k, v in data["sizes"].items()})
    loads = microbench.skew_loads(argparse.Namespace(sizes=sizes))
    experts, gpus = skew["experts"], skew["gpus"]
    out = []
    for case in skew["cases"]:
        load = loads[case["load"]]
        placement = (Placement.contiguous(1, experts, gpus) if case["placement"] == "contiguous" else
                     replicate_hottest(load[None, :].astype(np.float64), gpus, 1))
        slots = microbench.slot_rows(load, placement.phy2log[0]).reshape(gpus, -1)
        if slots.sum(axis=1).tolist() != case["rows_per_gpu"]:
            raise SystemExit(f"gemm_fit: error: skew case {case['load']}/{case['placement']}: the rows dealt again "
                             f"do not sum to the record's rows_per_gpu")
        out.append(slots.tolist())
    return out


def predictions(point, profile, data: dict) -> dict[str, float]:
    """Each formula's time for one point (seconds)."""
    cal = data["calibration"]
    part = builtin_catalog().gpu(data["env"]["gpu_part"])
    rows, shape = np.asarray(point.rows), (point.hidden, point.intermediate, point.dtype_bytes)
    tiles = dict(block_m=point.block_m, block_n=point.block_n)
    return {"formula 11": point.predicted_s(profile),
            "formula 5": expert_time_s(rows, *shape, cal["dense_flops_per_s"], cal["hbm_bytes_per_s"], **tiles),
            "L2": expert_time_s(rows, *shape, cal["dense_flops_per_s"], cal["hbm_bytes_per_s"], weights="l2", **tiles),
            "L2 catalog": expert_time_s(rows, *shape, part.flops_per_s, part.memory_bytes_per_s, weights="l2",
                                        **tiles)}


def span(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}" if values else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("record", metavar="RESULT.json", nargs="?", default=H200_RECORD,
                        help=f"a bench/gpu_check.sh result (default: {H200_RECORD}, from the repository root)")
    parser.add_argument("--points", action="store_true", help="also print every point (default: the groups)")
    add_record_options(parser)
    args = parser.parse_args(argv)
    refuse_overwrite(parser, args)
    data = read_record(args.record)
    groups = record_points(data, args.record)
    if "skew" in data["sections"] and not groups["skew"]:
        groups["skew"] = skew_points(data["sections"]["skew"], data["sections"]["padding"]["block_n"], args.record,
                                     dealt_skew_rows(data))
    profile = fit_profile(groups["fit"], float(data["calibration"]["hbm_bytes_per_s"]), f"fit of {args.record}")
    print(f"formula 11 on {args.record} ({data['env']['gpu_name']}): fitted on {profile.fit_points} padding rows of "
          f">= {FIT_MIN_ROWS} rows per expert")
    print(f"t0 {profile.fixed_s * 1e6:.2f} us, C {profile.flops_per_s / 1e12:.0f} TFLOP/s, B_t "
          f"{profile.tile_bytes_per_s / 1e12:.2f} TB/s, B_h {profile.hbm_bytes_per_s / 1e12:.3f} TB/s (the record's "
          "copy, not fitted)")
    print("predicted / measured, least-most (512-4096: the points of 512 to 4,096 rows per expert)")
    header = f"{'group':<8} {'points':>6}" + "".join(f" {name:>12} {'512-4096':>10}" for name in FORMULAS)
    print(header)
    doc = {"record": str(args.record), "profile": asdict(profile), "groups": {}}
    for name, points in groups.items():
        if not points:
            continue
        rows = [(p, predictions(p, profile, data)) for p in points]
        line = f"{name:<8} {len(points):>6}"
        doc["groups"][name] = {}
        for formula in FORMULAS:
            ratios = [pred[formula] / p.measured_s for p, pred in rows]
            middle = [r for (p, _), r in zip(rows, ratios) if 512 <= np.mean(p.rows) <= 4096]
            line += f" {span(ratios):>12} {span(middle):>10}"
            doc["groups"][name][formula] = {"ratios": ratios, "ratios_512_4096": middle}
        print(line)
    if args.points:
        print(f"{'group':<8} {'where (sections.)':<34} {'BLOCK_M':>7} {'rows/expert':>11} {'measured ms':>11} "
              f"{'formula 11 ms':>13} {'ratio':>6}")
        for name, points in groups.items():
            for p in points:
                predicted = p.predicted_s(profile)
                rows_text = f"{p.rows[0]}" if len(set(p.rows)) == 1 else f"{np.mean(p.rows):.0f} mean"
                where = p.where.split(": sections.", 1)[-1]
                print(f"{name:<8} {where:<34} {p.block_m:>7} {rows_text:>11} {p.measured_s * 1e3:>11.4f} "
                      f"{predicted * 1e3:>13.4f} {predicted / p.measured_s:>6.2f}")
    if args.output_json:
        write_record(args.output_json, doc)
        print(f"wrote {args.output_json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
