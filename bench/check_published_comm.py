"""The dispatch/combine model (formula 3) against DeepEP's published figures, and NCCL's small all-reduce.

What the cost model has not measured itself is checked here against published measurements, each
row with its source and the model's error (docs/calibration.md):

1. DeepEP's kernels (github.com/deepseek-ai/DeepEP), H800 GPUs with one CX7 400 Gb/s InfiniBand NIC
   each, DeepSeek-V3's hidden 7168, top-8 of 256 experts, FP8 dispatch (7168 B + 56 x 4 B of scales
   per row; the low-latency kernels add 16 B) and BF16 combine (14336 B per row):
   - normal kernels, 4096 tokens per rank, EP8 over NVLink and EP16/32/64 over RDMA with NVLink
     forwarding; the routing of DeepEP's tests: scores |N(0,1)| + 1, each token's experts in its
     top `min(nodes, 4)` nodes (the node's best score), then its top 8 there;
   - low-latency kernels, 128 tokens per rank, EP8-256, top 8 of uniform random scores; the table
     published now (NVLink inside a node since 2025-06-05) and the first one (pure RDMA, 2025-02-24).
   DeepEP reports a bandwidth, its test's bytes of one rank over the kernel's time
   (tests/test_intranode.py, test_internode.py, test_low_latency.py): intranode, the tokens the rank
   receives (its own included); internode, the (token, node) pairs the rank sends (its own node
   included, which never crosses a NIC); low-latency, the rank's (token, expert) selections, each one
   message (no merging of a token's experts on one GPU). The published time of a normal-kernel row is
   those bytes, counted on the same routing (rank 0), over the published bandwidth; a low-latency row
   publishes its time.
2. The model on the same setting: `cluster_topology` of the H800 (NVLink 160 GB/s per direction, DeepEP's
   "~160 GB/s NVLink maximum bandwidth"; NIC 400 Gbit/s = 50 GB/s), DeepSeek-V3's shape, one slot
   per expert (experts in order on the GPUs, as DeepEP's tests place them), tokens in blocks of a
   rank's batch, `step_cost` (formula 3 on the link graph): the `deepep` dispatch for normal kernels,
   `all-to-all` for the low-latency ones; the pure-RDMA table on one GPU per node (every message
   through the GPU's NIC).
3. A per-phase fixed latency `L` (what formula 3 leaves out: start-up, synchronisation), fitted on one
   table (least squares on the relative error of `T_model + L`) and checked on the others.
4. NCCL's small all-reduce: the model's figure (`allreduce_latency_s`, NCCL's own latency model) and
   what was published (no trustworthy figure for the setting was found: see `ALLREDUCE_SEARCH`).

    python bench/check_published_comm.py [--seed 0] [--out FILE.json] [--force]

The committed record: `python bench/check_published_comm.py --out bench/results/published_comm.json --force`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys

import numpy as np

from moe_place.cost.cluster import cluster_topology
from moe_place.analysis.dispatch import token_sources
from moe_place.cost.comm import CommModel, step_cost
from moe_place.cost.hardware import builtin_catalog
from moe_place.cost.models import get_model
from moe_place.cost.replicas import SlotTable, allreduce_latency_s
from moe_place.cost.topology import Topology
from moe_place.cost.units import gb_per_s

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from records import add_record_options, provenance, refuse_overwrite, write_record  # noqa: E402

RESULTS_JSON = "bench/results/published_comm.json"

# ---------------------------------------------------------------------- the published figures
DEEPEP = "deepseek-ai/DeepEP"
SOURCES = {
    "normal": {"repo": DEEPEP, "path": "docs/legacy.md", "commit": "dd758caf451848bd150e1046af3d0a73e5fff38d",
               "section": "Performance / Normal kernels with NVLink and RDMA forwarding",
               "note": "the same table as README.md from 3b1045db43ed232691d32dde0517dfed571b0a65 (2025-04-22) to "
                       "567632dd59810d77b3cc05553df953cc0f779799; moved to docs/legacy.md with DeepEP V2"},
    "low-latency": {"repo": DEEPEP, "path": "docs/legacy.md", "commit": "dd758caf451848bd150e1046af3d0a73e5fff38d",
                    "section": "Performance / Low-latency kernels with pure RDMA",
                    "note": "the numbers of README.md since d8dd185c686cddff0c13b49f640ce9cad4030d03 (2025-06-05: "
                            "'low-latency kernels now leverage NVLink as much as possible', PR #173); EP128 and "
                            "EP256 unchanged from the first table"},
    "low-latency-rdma": {"repo": DEEPEP, "path": "README.md", "commit": "ebfe47e46fa86a5b41be96c326a92f62ed6721da",
                         "section": "Performance / Low-latency kernels with pure RDMA",
                         "note": "the first release (2025-02-24), before the kernels used NVLink: every message "
                                 "through the RDMA NIC"},
    "bytes": {"repo": DEEPEP, "path": "tests/test_intranode.py, tests/test_internode.py, tests/test_low_latency.py",
              "commit": "567632dd59810d77b3cc05553df953cc0f779799",
              "section": "the bandwidth each test prints: bytes of one rank / kernel time",
              "note": "routing, token counts and bytes per row as those tests make them"},
}
# normal kernels: EP -> (nodes, dispatch GB/s, combine GB/s, the link DeepEP names)
NORMAL = {8: (1, 153, 158, "NVLink"), 16: (2, 43, 43, "RDMA"), 32: (4, 58, 57, "RDMA"), 64: (8, 51, 50, "RDMA")}
# low-latency kernels: EP -> (dispatch us, dispatch GB/s, combine us, combine GB/s)
LOW_LATENCY = {8: (77, 98, 114, 127), 16: (118, 63, 195, 74), 32: (155, 48, 273, 53), 64: (173, 43, 314, 46),
               128: (192, 39, 369, 39), 256: (194, 39, 360, 40)}
LOW_LATENCY_RDMA = {8: (163, 46, 318, 46), 16: (173, 43, 329, 44), 32: (182, 41, 350, 41), 64: (186, 40, 353, 41),
                    128: (192, 39, 369, 39), 256: (194, 39, 360, 40)}
TABLES = ("normal", "low-latency", "low-latency-rdma")

# ---------------------------------------------------------------------- the setting
HIDDEN = 7168
EXPERTS = 256                 # DeepSeek-V3's; DeepEP's low-latency test defaults to 288 (not divisible by 64-256)
TOP_K = 8
GPUS_PER_NODE = 8
NVLINK_GB_PER_S = 160         # DeepEP: "H800 (~160 GB/s NVLink maximum bandwidth)"
NIC_GBIT_PER_S = 400          # "CX7 InfiniBand 400 Gb/s RDMA network card (~50 GB/s maximum bandwidth)"
TOKENS = {"normal": 4096, "low-latency": 128, "low-latency-rdma": 128}   # per rank
FP8_ROW_BYTES = HIDDEN + HIDDEN // 128 * 4        # 7392: DeepEP's fp8_factor (1 + 4/128) / 2 of the BF16 row
FP8_LL_ROW_BYTES = FP8_ROW_BYTES + 16             # 7408: the low-latency message adds 16 B of source info
BF16_ROW_BYTES = HIDDEN * 2                       # 14336
PHASES = ("dispatch", "combine")

# ---------------------------------------------------------------------- NCCL's small all-reduce
ALLREDUCE_SETTINGS = ((8, 1), (32, 4))
ALLREDUCE_SEARCH = (
    "No trustworthy published latency of a small NCCL all-reduce on one node of 8 H100/H800 over NVLink, or on "
    "several such nodes over 400 Gb/s InfiniBand, was found (searched: NCCL's and nccl-tests' documentation, "
    "NVIDIA's NCCL blog posts, NVIDIA and cloud documentation, public repositories). NVIDIA's NCCL 2.27 post "
    "(developer.nvidia.com/blog/enabling-fast-inference-and-resilient-training-with-nccl-2-27) shows small-message "
    "latency only in a figure and states a ratio ('up to 9x' lower with symmetric-memory kernels), no number. "
    "What exists are third-party nccl-tests logs on other settings: 8 B all_reduce_perf on 8 B200 in one node "
    "20.25 us out of place (a vendor POC report), on 2 AWS p5.48xlarge over EFA 69.12 us (a tutorial), on 8 "
    "A100-40GB 31.8-32.2 us at 64-512 B; none is the H100/H800 + InfiniBand setting, their NCCL versions and "
    "settings differ, so none is used as a check. The model's figure is NCCL's own latency model "
    "(NVIDIA/nccl src/graph/tuning.cc at 01afd20, docs/MODEL.md), not a measurement.")


def h800_topology(gpus: int, nodes: int) -> Topology:
    """`gpus` H800 on `nodes` nodes: the catalog's H800 with DeepEP's effective NVLink, 400 Gbit/s NICs."""
    h800 = dataclasses.replace(builtin_catalog().gpu("H800"), nvlink_bytes_per_s=gb_per_s(NVLINK_GB_PER_S))
    return cluster_topology(gpus, nodes, h800, NIC_GBIT_PER_S)


def deepep_routing(rng: np.random.Generator, ranks: int, tokens: int, groups: int | None) -> np.ndarray:
    """int64 `[ranks * tokens, TOP_K]`: expert ids as DeepEP's tests draw them, rank by rank (blocks of `tokens`).

    Scores `|N(0,1)| + 1` per (token, expert); with `groups` (the nodes, experts contiguous per node) only
    the `min(groups, 4)` nodes of highest best score are eligible; the top `TOP_K` eligible scores win.
    """
    out = np.empty((ranks * tokens, TOP_K), dtype=np.int64)
    for rank in range(ranks):
        scores = np.abs(rng.standard_normal((tokens, EXPERTS), dtype=np.float32)) + 1
        if groups is not None and groups > 1:
            best = scores.reshape(tokens, groups, -1).max(axis=2)
            keep = np.argpartition(-best, min(groups, 4) - 1, axis=1)[:, :min(groups, 4)]
            allowed = np.zeros((tokens, groups), dtype=bool)
            allowed[np.arange(tokens)[:, None], keep] = True
            scores = np.where(np.repeat(allowed, EXPERTS // groups, axis=1), scores, -np.inf)
        out[rank * tokens:(rank + 1) * tokens] = np.argpartition(-scores, TOP_K - 1, axis=1)[:, :TOP_K]
    return out


def deepep_rows(table: str, ids: np.ndarray, ranks: int, nodes: int) -> tuple[int, int]:
    """(counted, crossing): rank 0's rows in DeepEP's bandwidth (module docstring: received tokens, (token, node)
    pairs, selections) and the part of them that crosses a link (from other GPUs, to other nodes, to other GPUs)."""
    tokens = TOKENS[table]
    gpu = ids // (EXPERTS // ranks)
    if table != "normal":
        return int(ids[:tokens].size), int((gpu[:tokens] != 0).sum())
    if nodes == 1:
        received = (gpu == 0).any(axis=1)
        return int(received.sum()), int(received[tokens:].sum())
    node = gpu[:tokens] // GPUS_PER_NODE
    pairs = [np.unique(row) for row in node]
    return int(sum(p.size for p in pairs)), int(sum((p != 0).sum() for p in pairs))


def model_rows(table: str, traffic, nodes: int) -> float:
    """The model's rows of rank 0 over the resource of `deepep_rows`' crossing part (GPU 0's NVLink receives,
    its NIC's sends, its sends)."""
    if table == "normal":
        return float(traffic.rows[:, 0].sum()) if nodes == 1 else float(traffic.nic_send_rows[0])
    return float(traffic.rows[0].sum())


def link_times_s(topology: Topology, volume: np.ndarray) -> dict[str, float]:
    """Seconds of the busiest link of each kind (nvlink, nic, ...) for `volume [G, G]` bytes: which one binds."""
    worst: dict[str, float] = {}
    for edge, load in topology.link_loads_bytes(volume).items():
        data = topology.graph.edges[edge]
        worst[data["kind"]] = max(worst.get(data["kind"], 0.0), load / data["capacity"])
    return worst


def published(table: str, ep: int, phase: str, rows: int) -> tuple[float, float]:
    """(seconds, GB/s) of one published cell; a normal-kernel time is DeepEP's bytes over its bandwidth."""
    which = PHASES.index(phase)
    if table == "normal":
        gbps = NORMAL[ep][1 + which]
        return row_bytes(table, phase) * rows / gb_per_s(gbps), float(gbps)
    cells = (LOW_LATENCY if table == "low-latency" else LOW_LATENCY_RDMA)[ep]
    return cells[2 * which] * 1e-6, float(cells[2 * which + 1])


def row_bytes(table: str, phase: str) -> int:
    if phase == "combine":
        return BF16_ROW_BYTES
    return FP8_ROW_BYTES if table == "normal" else FP8_LL_ROW_BYTES


def case(table: str, ep: int, seed: int) -> list[dict]:
    """The two rows (dispatch, combine) of one published configuration, the model beside the publication."""
    nodes = NORMAL[ep][0] if table == "normal" else (ep if table == "low-latency-rdma" else max(1, ep // GPUS_PER_NODE))
    rng = np.random.default_rng([seed, TABLES.index(table), ep])
    ids = deepep_routing(rng, ep, TOKENS[table], NORMAL[ep][0] if table == "normal" else None)
    topology = h800_topology(ep, nodes)
    model = CommModel(topology, get_model("DeepSeek-V3"), dispatch="deepep" if table == "normal" else "all-to-all",
                      dispatch_bytes_per_row=row_bytes(table, "dispatch"), combine_bytes_per_row=BF16_ROW_BYTES)
    slots = SlotTable(np.arange(EXPERTS), ep, nodes, EXPERTS)
    cost = step_cost(model, ids, token_sources(ids.shape[0], ep), slots)
    rows, crossing = deepep_rows(table, ids, ep, nodes)
    out = []
    for phase, model_s, volume in (("dispatch", cost.dispatch_s, cost.traffic.rows * model.dispatch_row_bytes),
                                   ("combine", cost.combine_s, cost.traffic.rows.T * model.combine_row_bytes)):
        pub_s, pub_gbps = published(table, ep, phase, rows)
        counted = rows * row_bytes(table, phase)
        out.append({"table": table, "ep": ep, "nodes": nodes, "gpus_per_node": ep // nodes, "phase": phase,
                    "tokens_per_rank": TOKENS[table], "deepep_rows_rank0": rows, "deepep_bytes_rank0": counted,
                    "deepep_rows_crossing_rank0": crossing, "model_rows_rank0": model_rows(table, cost.traffic, nodes),
                    "published_s": pub_s, "published_gb_per_s": pub_gbps, "model_s": model_s,
                    "model_gb_per_s": counted / model_s / 1e9, "model_over_published": model_s / pub_s,
                    "model_link_s": link_times_s(topology, volume), "source": SOURCES[table],
                    "bytes_source": SOURCES["bytes"]})
    return out


def fit_latency(rows: list[dict]) -> dict[str, float]:
    """Per phase, the `L` minimising the squared relative error of `model_s + L` against `published_s`."""
    fit = {}
    for phase in PHASES:
        t = np.array([r["published_s"] for r in rows if r["phase"] == phase])
        m = np.array([r["model_s"] for r in rows if r["phase"] == phase])
        fit[phase] = float(np.sum((t - m) / t ** 2) / np.sum(1 / t ** 2))
    return fit


def ratio_range(rows: list[dict], latency: dict[str, float] | None = None) -> list[float]:
    """[least, most] of (model + latency) / published over `rows`."""
    ratios = [(r["model_s"] + (latency or {}).get(r["phase"], 0.0)) / r["published_s"] for r in rows]
    return [min(ratios), max(ratios)]


def latency_fits(rows: list[dict]) -> list[dict]:
    """`L` fitted on each table, checked on every table (the proposal of docs/calibration.md)."""
    by_table = {t: [r for r in rows if r["table"] == t] for t in TABLES}
    fits = []
    for fitted_on in ("low-latency", "normal"):
        latency = fit_latency(by_table[fitted_on])
        fits.append({"fitted_on": fitted_on, "latency_s": latency,
                     "model_plus_latency_over_published": {
                         t: {p: ratio_range([r for r in by_table[t] if r["phase"] == p], latency) for p in PHASES}
                         for t in TABLES},
                     "model_alone_over_published": {
                         t: {p: ratio_range([r for r in by_table[t] if r["phase"] == p]) for p in PHASES}
                         for t in TABLES}})
    return fits


def compute(seed: int = 0) -> dict:
    """Everything the record holds that the model computes (no dates, no machine): rows, fits, all-reduce."""
    rows = [r for table, eps in (("normal", NORMAL), ("low-latency", LOW_LATENCY),
                                 ("low-latency-rdma", LOW_LATENCY_RDMA)) for ep in eps for r in case(table, ep, seed)]
    allreduce = [{"gpus": g, "nodes": n, "model_s": allreduce_latency_s(g, n), "published_s": None,
                  "source": {"model": "NVIDIA/nccl src/graph/tuning.cc at 01afd20 (docs/MODEL.md)",
                             "published": ALLREDUCE_SEARCH}} for g, n in ALLREDUCE_SETTINGS]
    return {"rows": rows, "latency_fits": latency_fits(rows), "allreduce": allreduce}


def settings(seed: int) -> dict:
    shape = get_model("DeepSeek-V3")
    return {"seed": seed, "gpu": f"H800 (catalog) with NVLink {NVLINK_GB_PER_S} GB/s per direction",
            "nic_gbit_per_s": NIC_GBIT_PER_S, "gpus_per_node": GPUS_PER_NODE, "model": shape.name,
            "hidden": HIDDEN, "experts": EXPERTS, "top_k": TOP_K, "tokens_per_rank": TOKENS,
            "row_bytes": {"fp8 dispatch (normal)": FP8_ROW_BYTES, "fp8 dispatch (low-latency)": FP8_LL_ROW_BYTES,
                          "bf16 combine": BF16_ROW_BYTES},
            "placement": "one slot per expert, experts in order on the GPUs", "token_home": "blocks",
            "dispatch": {"normal": "deepep", "low-latency": "all-to-all", "low-latency-rdma": "all-to-all, 1 GPU/node"},
            "formula": "docs/MODEL.md formula 3 (moe_place.cost.traffic.phase_time_s via comm.step_cost)"}


def print_table(result: dict) -> None:
    """The rows (rows d/m: rank 0's rows crossing a link as DeepEP counts them / as the model sends them), the fits."""
    print(f"{'table':<17} {'EP':>4} {'phase':<9} {'published':>10} {'model':>9} {'model/pub':>9} "
          f"{'pub GB/s':>8} {'model GB/s':>10} {'rows d/m':>12}  busiest link")
    for r in result["rows"]:
        link = max(r["model_link_s"], key=r["model_link_s"].get)
        print(f"{r['table']:<17} {r['ep']:>4} {r['phase']:<9} {r['published_s'] * 1e6:>8.0f}us "
              f"{r['model_s'] * 1e6:>7.0f}us {r['model_over_published']:>9.3f} {r['published_gb_per_s']:>8.0f} "
              f"{r['model_gb_per_s']:>10.1f} {r['deepep_rows_crossing_rank0']:>6}/{r['model_rows_rank0']:<6.0f} {link}")
    for fit in result["latency_fits"]:
        latency = ", ".join(f"{p} {s * 1e6:.1f} us" for p, s in fit["latency_s"].items())
        print(f"\nper-phase latency fitted on {fit['fitted_on']}: {latency}; (model + L) / published, least-most:")
        for table, phases in fit["model_plus_latency_over_published"].items():
            alone = fit["model_alone_over_published"][table]
            print(f"  {table:<17} " + "; ".join(f"{p} {lo:.2f}-{hi:.2f} (model alone {alone[p][0]:.2f}-"
                                                 f"{alone[p][1]:.2f})" for p, (lo, hi) in phases.items()))
    for a in result["allreduce"]:
        print(f"\nNCCL all-reduce of a few bytes, {a['gpus']} GPUs on {a['nodes']} node(s): model "
              f"{a['model_s'] * 1e6:.1f} us; published: none used (see the record)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="seed of the routing (default 0)")
    add_record_options(parser, committed=(RESULTS_JSON,))
    args = parser.parse_args(argv)
    refuse_overwrite(parser, args)
    result = compute(args.seed)
    print_table(result)
    if args.output_json:
        run = provenance()
        record = {"what": __doc__.splitlines()[0],
                  "command": f"python bench/check_published_comm.py --seed {args.seed} --out {args.output_json} --force",
                  "commit": run["commit"], "date": run["date"],
                  "machine": {**run["machine"], "python": platform.python_version(), "numpy": np.__version__},
                  "settings": settings(args.seed), "sources": SOURCES, **result, "provenance": run}
        write_record(args.output_json, record)
        print(f"wrote {args.output_json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
