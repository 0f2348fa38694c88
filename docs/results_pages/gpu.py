"""The GPU microbenchmarks page."""

from __future__ import annotations

import json

from moe_place.kernels.report import render_markdown

from .common import RECORD_LINK, RESULTS, f, page, record, records, source, table


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
                     r["group_m"], f(r["ms"], 3), f"{r['tflops']:.0f}", f(r["of_dense_8192"], 2)]
                    for r in c["configs"]]
            parts += [f"### Grouped-GEMM launch settings ({c['experts']} experts x {c['rows_per_expert']} rows, "
                      f"h={c['hidden']}, I={c['intermediate']})", source(configs.name),
                      table(["BLOCK_M", "BLOCK_N", "BLOCK_K", "warps", "stages", "GROUP_M", "ms", "TFLOP/s",
                             "of dense 8192^3"], rows)]
    return page("gpu", "Predicted against measured on a GPU, per run: `moe-place report`'s rendering of each "
                "committed microbenchmark record ([how to run one](../microbench.md)).", *parts)
