"""How long an engine waits for the drop-in's default call: `moe_place.eplb.rebalance_experts(weight, ...)`.

An engine stalls (vLLM's sync path, SGLang's rebalance) or delays its new map (vLLM's async
worker) while its balancer runs, so the drop-in's default call must be bounded. It is the anytime
plan (solver `quick`) with EPLB's plan a candidate on every layer, no time limit needed. This
times the call as an engine makes it (torch tensors in and out), median and worst of `--repeats`,
against DeepSeek EPLB's own algorithm (`solver="eplb"`, our faithful reimplementation of
`eplb.py`) measured alternately in the same run, on the shapes of DeepSeek-V3 (58 MoE layers x 256
experts, 8 groups: global and hierarchical on G/8 nodes) and Kimi-K2 (60 x 384, one group), with
loads from the DeepSeek-R1-calibrated generator (`r1`) and uniform random ones. It also checks
that two calls on the same input return the same maps, and reports the busiest GPU against EPLB's.
The process is pinned to one core (`--cores 1`).

    python bench/bench_dropin.py [--repeats 9] [--cores 1] [--out FILE.json] [--force]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from moe_place.eplb import rebalance_experts
from moe_place.solvers.evaluate import even_gpu_loads
from moe_place.online.replay import parse_synthetic

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from records import add_record_options, missed_targets, refuse_overwrite, write_record  # noqa: E402

# (model, MoE layers, experts, groups, physical experts, EP size, nodes)
SHAPES = (
    ("DeepSeek-V3", 58, 256, 1, 288, 32, 1),
    ("DeepSeek-V3", 58, 256, 8, 288, 32, 4),      # hierarchical: 8 groups on 4 nodes of 8 GPUs
    ("DeepSeek-V3", 58, 256, 1, 288, 144, 1),
    ("DeepSeek-V3", 58, 256, 8, 288, 144, 18),    # 18 nodes of 8 GPUs: 8 groups not a multiple -> global
    ("Kimi-K2", 60, 384, 1, 416, 32, 1),
    ("Kimi-K2", 60, 384, 1, 448, 64, 1),
    ("Kimi-K2", 60, 384, 1, 512, 128, 1),
)
STALL_TARGET_S = 0.2


def loads_of(kind: str, layers: int, experts: int, seed: int = 0) -> np.ndarray:
    """float64 `[layers, E]`: 8 steps of the DeepSeek-R1-calibrated drifting mixture (`r1`) summed, or
    uniform random counts."""
    if kind == "r1":
        spec = f"drift:preset=deepseek-r1,layers={layers},experts={experts},steps=8,tokens=4096,seed={seed}"
        return parse_synthetic(spec)[0].sum(axis=0).astype(np.float64)
    return np.random.default_rng(seed).integers(1, 10_000, size=(layers, experts)).astype(np.float64)


def busiest(phy2log: np.ndarray, loads: np.ndarray, gpus: int) -> np.ndarray:
    return np.array([even_gpu_loads(phy2log[i], loads[i], gpus).max() for i in range(len(loads))])


def run_shape(shape: tuple, kind: str, repeats: int) -> dict:
    import torch  # the drop-in takes and returns torch tensors, as engines call it

    model, layers, experts, groups, physical, gpus, nodes = shape
    loads = loads_of(kind, layers, experts)
    weight = torch.from_numpy(loads)
    rebalance_experts(weight, physical, groups, nodes, gpus)                 # warm-up (imports, caches)
    ours, theirs, outputs = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        outputs.append(rebalance_experts(weight, physical, groups, nodes, gpus)[0].numpy())
        ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        eplb = rebalance_experts(weight, physical, groups, nodes, gpus, solver="eplb")[0].numpy()
        theirs.append(time.perf_counter() - start)
    same = all(np.array_equal(outputs[0], o) for o in outputs[1:])
    ratio = busiest(outputs[0], loads, gpus) / busiest(eplb, loads, gpus)
    return {"model": model, "layers": layers, "experts": experts, "groups": groups, "physical": physical,
            "ep": gpus, "nodes": nodes, "loads": kind, "dropin_median_s": float(np.median(ours)),
            "dropin_worst_s": float(np.max(ours)), "eplb_median_s": float(np.median(theirs)),
            "deterministic": bool(same), "busiest_vs_eplb_mean": float(ratio.mean()),
            "busiest_vs_eplb_worst": float(ratio.max())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9, help="timed calls per shape (default 9)")
    parser.add_argument("--cores", type=int, default=1, help="pin the process to this many cores (default 1)")
    add_record_options(parser, committed=("bench/results/dropin.json",))
    args = parser.parse_args(argv)
    if args.repeats < 1 or not 1 <= args.cores <= (os.cpu_count() or 1):
        parser.error(f"expected --repeats >= 1 and --cores in [1, {os.cpu_count()}]")
    refuse_overwrite(parser, args)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:args.cores]))
    rows = []
    print(f"{'model':<12}{'L x E':>10}{'P':>5}{'EP':>5}{'nodes':>6}{'groups':>7}{'loads':>7}{'drop-in s':>11}"
          f"{'worst s':>9}{'eplb s':>8}{'same':>6}{'busiest/eplb':>14}")
    for shape in SHAPES:
        for kind in ("r1", "random"):
            row = run_shape(shape, kind, args.repeats)
            rows.append(row)
            print(f"{row['model']:<12}{row['layers']:>4} x {row['experts']:<4}{row['physical']:>5}{row['ep']:>5}"
                  f"{row['nodes']:>6}{row['groups']:>7}{kind:>7}{row['dropin_median_s']:>11.3f}"
                  f"{row['dropin_worst_s']:>9.3f}{row['eplb_median_s']:>8.3f}{'yes' if row['deterministic'] else 'NO':>6}"
                  f"{row['busiest_vs_eplb_mean']:>8.4f}/{row['busiest_vs_eplb_worst']:.4f}", flush=True)
    worst = max(r["dropin_worst_s"] for r in rows)
    missed = missed_of(rows, worst)
    print(f"worst drop-in call {worst:.3f} s (target <= {STALL_TARGET_S} s), deterministic on every shape, never "
          f"busier than EPLB on any layer: {'NOT MET' if missed else 'MET'}")
    if args.output_json:
        write_record(args.output_json, {"cores": args.cores, "repeats": args.repeats, "rows": rows})
    return missed_targets("bench_dropin", missed)


def missed_of(rows: list[dict], worst: float) -> list[str]:
    """The targets the rows miss, each naming the shapes that miss it."""
    def shapes(bad: list[dict]) -> str:
        return ", ".join(f"{r['model']} EP{r['ep']} {r['loads']}" for r in bad)

    missed = []
    if worst > STALL_TARGET_S:
        missed.append(f"worst drop-in call {worst:.3f} s > {STALL_TARGET_S} s "
                      f"({shapes([r for r in rows if r['dropin_worst_s'] > STALL_TARGET_S])})")
    if not all(r["deterministic"] for r in rows):
        missed.append(f"two calls differ on {shapes([r for r in rows if not r['deterministic']])}")
    busier = [r for r in rows if r["busiest_vs_eplb_worst"] > 1 + 1e-9]
    if busier:
        missed.append(f"busier than EPLB on a layer of {shapes(busier)}")
    return missed


if __name__ == "__main__":
    sys.exit(main())
