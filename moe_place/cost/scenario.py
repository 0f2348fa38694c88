"""Scenario files for `moe-place predict` / `payback`: hardware, topology, model, workload and the
optional sections pipeline, payback, offload, capacity, nic. TOML or JSON; relative paths are
resolved against the scenario file's folder. See `SCHEMA` for every key.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from moe_place.analysis.dispatch import dispatch_matrix, expert_to_gpu_share, token_sources
from moe_place.cost import comm, gemm, offload, pipeline, replicas, traffic
from moe_place.cost.files import get_int, get_number, read_table_file
from moe_place.cost.hardware import Catalog, gpu_from_record, load_catalog
from moe_place.cost.models import ExpertShape, model_from_table
from moe_place.cost.migration import Copy
from moe_place.cost.payback import payback
from moe_place.cost.topology import Topology, topology_from_table
from moe_place.cost.units import BYTES_PER_DTYPE, GIB_BYTES, MIB_BYTES, GB_BYTES, gb_per_s
from moe_place.errors import InputError, check_keys
from moe_place.planfile import read_plan
from moe_place.traces.load import load_trace

SCHEMA = """\
name = "..."                      # optional label
[hardware]  parts_file = "my_parts.toml" (optional extra parts), efficiency = 0.5 (GPU compute and HBM)
[topology]  spec = "2 nodes x 8 H100, NVLink 450 GB/s, 400 Gbit/s NIC per GPU, 200 GB/s between nodes"
            | file = "topo.toml" | gpu/nodes/gpus_per_node/nvlink_gb_per_s/nic_gbit_per_s/inter_node_gb_per_s/...
            links = [{from = "nic8", to = "leaf1", gb_per_s = 25}]  (optional: set single link directions)
[model]     preset = "Qwen3-235B-A22B" (+ overrides) | hidden/intermediate/num_experts/top_k/num_moe_layers/dtype
[workload]  exactly one of
              dispatch = [[a_ij]] + sources = [GPU ids of rows] + groups = [GPU ids of columns]
              rows_per_expert = [[rows of each local expert] per GPU] (+ gpus = [GPU ids], default 0..)
              trace = "trace.npz" + plan = "plan.json" (+ layer = 0, step = 0, token_layout = "blocks",
                sources = [GPU ids holding the tokens], default all GPUs of the plan,
                traffic = "per-dispatch" (one row per token and expert, replicas split evenly; default)
                  | "deepep" | "all-to-all" (token-level traces: moe_place.cost.comm's dispatch rules),
                replica_choice = "sglang-static" | "vllm" | "sglang-dynamic" | "node-aware" (with those))
            tokens = n (optional: dispatches must sum to n * top_k)
            weights = "calibrated" | "none" | "once" | "tiles" | "l2" (default "calibrated": formula 11, block_m
              default 64); block_m, block_n = 128, pad_empty = false
            dispatch_dtype / combine_dtype = "bf16" | "fp8" (row = hidden * bytes) or dispatch_bytes / combine_bytes
            flops_per_dispatch (default 2 * P_e)
[pipeline]  micro_batches = 2, breakeven = [["dispatch", "combine"], ["compute"]]
[payback]   rows_after = [[...] per GPU]  (the workload after the replica move; or saving_per_batch_ms)
            [[payback.cases]] name, copy_from = GPU, copy_to = [GPUs]   (or copies = [[src, dst], ...])
            alpha_us = 0, mode = "serial" | "parallel", free_mib (per receiving GPU), batches = [16, 64],
            max_batches = 64 (curve)
[offload]   cpu = "Xeon-Platinum-8452Y", kernels = ["avx512", "amx"], socket = "local" | "remote",
            gpu = "A100-40GB-PCIe" (efficiency from [hardware]), link_gb_per_s = 25, alpha_us = 5,
            rows = [1, 128], experts = 8 (run one after another)
[capacity]  replica_layers = [94, 8] (one extra expert per layer on a GPU), resident_per_layer = [32, 16],
            gpu_memory_gb = 80
[nic]       nic = "ConnectX-7" | gbit_per_s + messages_per_s, message_bytes = [8192, 4096]
[pool]      rate_batches_per_s = 1000 (formula 9: every expert GPU's FLOPs and every link's bytes per batch
            of the [workload], times the rate, against its capacity)
"""

SECTIONS = ("name", "spec_row", "hardware", "topology", "model", "workload", "pipeline", "payback", "offload",
            "capacity", "nic", "pool")
# every key each section reads (SCHEMA above); any other key is an error naming the closest of these,
# so that a misspelled key never leaves its default in force ([model] and [topology]: their own readers)
SECTION_KEYS = {
    "hardware": ("parts_file", "efficiency"),
    "workload": ("dispatch", "sources", "groups", "rows_per_expert", "gpus", "trace", "plan", "layer", "step",
                 "token_layout", "traffic", "replica_choice", "tokens", "weights", "block_m", "block_n", "pad_empty",
                 "dispatch_dtype", "combine_dtype", "dispatch_bytes", "combine_bytes", "flops_per_dispatch"),
    "pipeline": ("micro_batches", "breakeven"),
    "payback": ("rows_after", "gpus_after", "saving_per_batch_ms", "cases", "copy_from", "copy_to", "copies",
                "alpha_us", "mode", "free_mib", "copy_bytes", "batches", "max_batches"),
    "offload": ("cpu", "kernels", "socket", "gpu", "link_gb_per_s", "alpha_us", "rows", "experts"),
    "capacity": ("replica_layers", "resident_per_layer", "gpu_memory_gb"),
    "nic": ("nic", "gbit_per_s", "messages_per_s", "message_bytes"),
    "pool": ("rate_batches_per_s",),
}
CASE_KEYS = ("name", "copy_from", "copy_to", "copies")  # [[payback.cases]]


@dataclass(frozen=True)
class Scenario:
    """A parsed scenario file: the raw tables plus the objects built from them."""

    path: Path
    data: dict
    catalog: Catalog
    model: ExpertShape
    topology: Topology | None
    efficiency: float | None

    @property
    def name(self) -> str:
        return str(self.data.get("name", self.path.stem))

    def section(self, key: str) -> dict:
        value = self.data.get(key, {})
        if not isinstance(value, dict):
            raise InputError(f"{self.path}: [{key}]", "a table", type(value).__name__)
        return value

    def resolve(self, value: str) -> Path:
        path = Path(value)
        return path if path.is_absolute() else self.path.parent / path


PREDICT_SECTIONS = ("workload", "pipeline", "payback", "offload", "capacity", "nic")  # what `predict` answers
MAX_PAYBACK_BATCHES = 100_000  # the longest net-gain curve (one point per batch)


def load_scenario(path: str | Path, gemm_record: str | Path | None = None) -> Scenario:
    """The scenario of a file; `gemm_record`: a `bench/gpu_check.sh` result whose fitted formula-11 terms
    the topology's GPU takes (`--hardware-from`)."""
    path = Path(path)
    return with_gemm_record(scenario_from_table(read_table_file(path), path), gemm_record)


def with_gemm_record(sc: Scenario, gemm_record: str | Path | None, where: str = "--hardware-from") -> Scenario:
    """`sc` with its topology's GPU given the formula-11 terms fitted on `gemm_record` (None: `sc` as it is)."""
    if gemm_record is None:
        return sc
    if sc.topology is None:
        raise InputError(where, f"a scenario with a [topology] (its GPU takes the record's terms); {sc.path} has "
                         "none", gemm_record)
    gpu = gpu_from_record(gemm_record, sc.topology.gpu, sc.catalog, where)
    return replace(sc, topology=replace(sc.topology, gpu=gpu))


def scenario_from_table(data: dict, path: str | Path = "scenario") -> Scenario:
    """A scenario from its parsed table; `path` names it in errors and anchors relative file names."""
    path = Path(path)
    check_keys(data, SECTIONS, f"{path}:")
    for section, known in SECTION_KEYS.items():
        if section in data:
            if not isinstance(data[section], dict):
                raise InputError(f"{path}: [{section}]", "a table", type(data[section]).__name__)
            check_keys(data[section], known, f"{path}: {section}")
    for i, case in enumerate(data.get("payback", {}).get("cases") or []):
        if isinstance(case, dict):
            check_keys(case, CASE_KEYS, f"{path}: payback.cases[{i}]")
    hardware = data.get("hardware", {})
    parts = hardware.get("parts_file")
    catalog = load_catalog(path.parent / parts if parts else None)
    efficiency = get_number(hardware, "efficiency", f"{path}: hardware") if "efficiency" in hardware else None
    if efficiency is not None and efficiency > 1:
        raise InputError(f"{path}: hardware.efficiency", "a fraction in (0, 1]", efficiency)
    if "model" not in data:
        raise InputError(f"{path}: [model]", "a model section (preset = \"...\")", "nothing")
    model = model_from_table(data["model"], f"{path}: model")
    topology = None
    if "topology" in data:
        table = dict(data["topology"])
        if "file" in table:
            table["file"] = str(path.parent / table["file"])
        topology = topology_from_table(table, catalog, f"{path}: topology")
        if efficiency is not None:
            topology = replace(topology, gpu=topology.gpu.with_efficiency(efficiency))
    return Scenario(path, data, catalog, model, topology, efficiency)


# ---------------------------------------------------------------------- workload
@dataclass(frozen=True)
class Workload:
    """rows_per_gpu: per GPU (topology index), rows of each local expert; a_full: `[G, G]` or None;
    groups: the GPUs that compute experts (`R` of the expert skew)."""

    rows_per_gpu: tuple[np.ndarray, ...]
    a_full: np.ndarray | None
    groups: tuple[int, ...] = ()
    from_plan: tuple[tuple[str, str], ...] = ()  # (workload key, value) taken from the plan's recorded options


def build_workload(sc: Scenario, table: dict | None = None, where: str = "workload") -> Workload:
    table = sc.section("workload") if table is None else table
    here = f"{sc.path}: {where}"
    topo = _need_topology(sc)
    if ("trace" in table) == ("dispatch" in table or "rows_per_expert" in table):
        raise InputError(here, "either trace + plan, or dispatch and/or rows_per_expert",
                         sorted(k for k in ("dispatch", "rows_per_expert", "trace") if k in table) or "none")
    a_full = None
    from_plan: tuple = ()
    if "trace" in table:
        rows_per_gpu, a_full, groups, from_plan = _trace_workload(sc, table, here, topo)
    else:
        rows = [np.zeros(0)] * topo.num_gpus
        if "dispatch" in table:
            a = _matrix(table["dispatch"], f"{here}.dispatch")
            sources = _gpu_list(table, "sources", here, topo, default=list(range(a.shape[0])))
            groups = _gpu_list(table, "groups", here, topo, default=list(range(a.shape[1])))
            a_full = traffic.embed_dispatch(a, sources, groups, topo)
            for j, g in enumerate(groups):
                rows[g] = np.array([a[:, j].sum()])  # one block of rows unless rows_per_expert splits it
        if "rows_per_expert" in table:
            per_gpu = table["rows_per_expert"]
            if not isinstance(per_gpu, list) or not all(isinstance(r, list) for r in per_gpu):
                raise InputError(f"{here}.rows_per_expert", "a list (per GPU) of lists (rows per local expert)")
            default = groups if "dispatch" in table else list(range(len(per_gpu)))
            gpus = _gpu_list(table, "gpus", here, topo, default=default)
            if len(gpus) != len(per_gpu):
                raise InputError(f"{here}.gpus", f"{len(per_gpu)} GPU ids, one per rows_per_expert entry", len(gpus))
            for g, r in zip(gpus, per_gpu):
                new = gemm.check_rows(r, f"{here}.rows_per_expert[{g}]")
                if "dispatch" in table and abs(new.sum() - rows[g].sum()) > 1e-9 * max(1.0, rows[g].sum()):
                    raise InputError(f"{here}.rows_per_expert[{g}]", f"rows summing to the {rows[g].sum():g} "
                                     f"dispatches the dispatch matrix sends to GPU {g}", f"{new.sum():g}")
                rows[g] = new
            groups = gpus if "dispatch" not in table else groups
        elif table.get("weights", gemm.DEFAULT_WEIGHTS) != "none":
            raise InputError(f"{here}.weights", "'none' unless rows_per_expert says how rows split over experts",
                             repr(table.get("weights", gemm.DEFAULT_WEIGHTS)))
        rows_per_gpu = tuple(rows)
    total = sum(float(r.sum()) for r in rows_per_gpu)
    if "tokens" in table:
        tokens = get_number(table, "tokens", here)
        expected = tokens * sc.model.top_k
        if abs(total - expected) > 1e-6 * max(expected, 1):
            raise InputError(f"{here}.tokens", f"rows summing to tokens x top_k = {expected:g} dispatches", f"{total:g}")
    return Workload(rows_per_gpu, a_full, tuple(groups), from_plan)


def _trace_workload(sc: Scenario, table: dict, here: str, topo: Topology):
    if "plan" not in table:
        raise InputError(f"{here}.plan", "a plan file next to the trace", "nothing")
    plan_path = sc.resolve(str(table["plan"]))
    plan = read_plan(plan_path)  # checked: version, keys, shapes, log2phy/logcnt agree
    placement = plan.placement
    table, from_plan = _with_plan_options(table, plan)
    if placement.num_gpus > topo.num_gpus:
        raise InputError(f"{plan_path}: num_gpus", f"at most the topology's {topo.num_gpus} GPUs", placement.num_gpus)
    trace = load_trace(sc.resolve(str(table["trace"])))
    layer = get_int(table, "layer", here, 0)
    step = get_int(table, "step", here, 0)
    if not 0 <= layer < min(trace.num_layers, placement.num_layers):
        raise InputError(f"{here}.layer", f"a layer in [0, {min(trace.num_layers, placement.num_layers)})", layer)
    if not 0 <= step < trace.num_steps:
        raise InputError(f"{here}.step", f"a step in [0, {trace.num_steps})", step)
    if trace.num_experts != placement.num_experts:
        raise InputError(f"{plan_path}: num_logical_experts", f"the trace's {trace.num_experts} experts",
                         placement.num_experts)
    sources = _gpu_list(table, "sources", here, topo, default=list(range(placement.num_gpus)))
    style = str(table.get("traffic", "per-dispatch"))
    if style not in ("per-dispatch",) + comm.DISPATCH_STYLES:
        raise InputError(f"{here}.traffic", f"one of per-dispatch, {', '.join(comm.DISPATCH_STYLES)}", repr(style))
    if style != "per-dispatch":
        return (*_comm_workload(trace, placement, table, here, topo, sources, layer, step, style), from_plan)
    if "replica_choice" in table:
        raise InputError(f"{here}.replica_choice", "traffic = \"deepep\" or \"all-to-all\" with it")
    if trace.is_token_level:
        ids = trace.topk_ids[step][:, layer, :]
        src = token_sources(ids.shape[0], len(sources), str(table.get("token_layout", "blocks")))
        a = dispatch_matrix(ids, src, placement, layer, num_sources=len(sources))
    else:  # count level: tokens spread evenly over the sources
        counts = trace.step_counts()[step, layer].astype(np.float64)
        a = np.outer(np.full(len(sources), 1.0 / len(sources)), counts @ expert_to_gpu_share(placement, layer))
    a_full = traffic.embed_dispatch(a, sources, list(range(placement.num_gpus)), topo)
    per_slot = placement.slot_loads(_layer_counts(trace, step, layer, placement))[layer]
    rows = [np.zeros(0)] * topo.num_gpus
    for g in range(placement.num_gpus):
        rows[g] = per_slot[g * placement.slots_per_gpu:(g + 1) * placement.slots_per_gpu]
    return tuple(rows), a_full, list(range(placement.num_gpus)), from_plan


# [workload] keys a plan made for the layer time (`plan --objective time`) decides when the scenario
# leaves them out: the scenario key and the key of the plan's `inputs.options`
PLAN_WORKLOAD_KEYS = (("traffic", "dispatch"), ("replica_choice", "replica_choice"), ("token_layout", "token_home"))


def _with_plan_options(table: dict, plan) -> tuple[dict, tuple[tuple[str, str], ...]]:
    """The [workload] table with the traffic model the plan was made for, where the table does not say
    (the table wins); and the (key, value) pairs so taken, which `predict` reports."""
    recorded = plan.inputs.get("options") or {}
    taken = tuple((key, str(recorded[option])) for key, option in PLAN_WORKLOAD_KEYS
                  if key not in table and recorded.get(option) is not None)
    return {**table, **dict(taken)}, taken


def _comm_workload(trace, placement, table: dict, here: str, topo: Topology, sources: list[int], layer: int, step: int,
                   style: str):
    """Rows and the dispatch matrix of one step of a token-level trace under `moe_place.cost.comm`'s
    dispatch rules: replicas chosen per (token, expert), DeepEP or all-to-all sends."""
    if not trace.is_token_level:
        raise InputError(f"{here}.traffic", "a token-level trace (per-token expert ids) with deepep/all-to-all",
                         "counts only")
    rule = str(table.get("replica_choice", replicas.DEFAULT_REPLICA_CHOICE))
    ids = trace.topk_ids[step][:, layer, :]
    homes = np.asarray(sources)[token_sources(ids.shape[0], len(sources), str(table.get("token_layout", "blocks")))]
    slot_table = replicas.SlotTable(placement.phy2log[layer], placement.num_gpus, placement.num_nodes,
                                placement.num_experts)
    try:
        slots = replicas.choose_replicas(ids, homes, slot_table, rule)
    except InputError as exc:
        raise InputError(f"{here}.replica_choice" if exc.where == "replica choice" else f"{here}.sources",
                         exc.expected, exc.got) from None
    moved = comm.step_traffic(slots, homes, slot_table, style)
    gpus = list(range(placement.num_gpus))
    a_full = traffic.embed_dispatch(moved.rows, gpus, gpus, topo)
    per_slot = moved.rows_per_slot.astype(np.float64)
    rows = [np.zeros(0)] * topo.num_gpus
    for g in gpus:
        rows[g] = per_slot[g * placement.slots_per_gpu:(g + 1) * placement.slots_per_gpu]
    return tuple(rows), a_full, gpus


def _layer_counts(trace, step: int, layer: int, placement) -> np.ndarray:
    load = np.zeros((placement.num_layers, placement.num_experts))
    load[layer] = trace.step_counts()[step, layer]
    return load


def _matrix(value, where: str) -> np.ndarray:
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise InputError(where, "a rectangular matrix of numbers") from None
    if arr.ndim != 2 or arr.size == 0:
        raise InputError(where, "a non-empty 2-D matrix", f"shape {arr.shape}")
    if not np.isfinite(arr).all() or (arr < 0).any():
        raise InputError(where, "counts >= 0", "a negative or non-finite entry")
    return arr


def _gpu_list(table: dict, key: str, here: str, topo: Topology, default: list[int]) -> list[int]:
    ids = table.get(key, default)
    if not isinstance(ids, list):
        raise InputError(f"{here}.{key}", "a list of GPU indices", repr(ids))
    for g in ids:
        topo.check_gpu(g, f"{here}.{key}")
    return [int(g) for g in ids]


def _need_topology(sc: Scenario) -> Topology:
    if sc.topology is None:
        raise InputError(f"{sc.path}: [topology]", "a topology section for this workload", "nothing")
    return sc.topology


def _row_bytes(sc: Scenario, table: dict, phase: str, here: str) -> float:
    if f"{phase}_bytes" in table:
        return get_number(table, f"{phase}_bytes", here)
    dtype = str(table.get(f"{phase}_dtype", "bf16")).lower()
    if dtype not in BYTES_PER_DTYPE:
        raise InputError(f"{here}.{phase}_dtype", f"one of {list(BYTES_PER_DTYPE)}", repr(dtype))
    return sc.model.hidden * BYTES_PER_DTYPE[dtype]


# ---------------------------------------------------------------------- evaluation
def compute_layer(sc: Scenario, workload: Workload, table: dict, here: str) -> gemm.LayerTime:
    gpu = _need_topology(sc).gpu
    m = sc.model
    options = dict(weights=str(table.get("weights", gemm.DEFAULT_WEIGHTS)),
                   block_n=get_int(table, "block_n", here, 128, 1), pad_empty=bool(table.get("pad_empty", False)),
                   matrices=m.matrices, profile=gpu.gemm_profile())
    if "block_m" in table:
        options["block_m"] = get_int(table, "block_m", here, 0, 1)
    flops_per_row = get_number(table, "flops_per_dispatch", here, default=float(m.flops_per_row()))
    per_gpu = tuple(gemm.gpu_expert_work(rows, m.hidden, m.intermediate, m.dtype_bytes, gpu.flops_per_s,
                                         gpu.memory_bytes_per_s, flops_per_row=flops_per_row, **options)
                    for rows in workload.rows_per_gpu)
    return gemm.LayerTime(per_gpu)


def _phase_json(bound: traffic.PhaseBound) -> dict:
    worst = {}
    for kind in ("sender", "receiver", "cut", "link"):
        t = bound.worst(kind)
        if t is not None:
            worst[kind] = {"where": t.where, "time_s": t.time_s, "bytes": t.bytes,
                           "capacity_bytes_per_s": t.capacity_bytes_per_s}
    return {"time_s": bound.time_s, "total_bytes": bound.total_bytes,
            "binding": [f"{t.kind} {t.where}" for t in bound.binding()], "worst_by_kind": worst}


def predict(sc: Scenario) -> dict:
    """Every bound the scenario asks for, JSON-ready (seconds, bytes, FLOPs; names say which)."""
    asked = [name for name in PREDICT_SECTIONS if name in sc.data]
    if not asked:
        raise InputError(str(sc.path), f"at least one of [{'], ['.join(PREDICT_SECTIONS)}] to predict",
                         f"only [{'], ['.join(sorted(sc.data)) or 'nothing'}]")
    report: dict = {"scenario": sc.name, "model": {"name": sc.model.name, "expert_bytes": sc.model.expert_bytes,
                                                    "expert_mib": sc.model.expert_bytes / MIB_BYTES}}
    if sc.topology is not None:
        report["topology"] = sc.topology.describe()
        report["gpu"] = {"name": sc.topology.gpu.name, "flops_per_s": sc.topology.gpu.flops_per_s,
                         "memory_bytes_per_s": sc.topology.gpu.memory_bytes_per_s, "efficiency": sc.topology.gpu.efficiency}
    stages: dict[str, float] = {}
    if "workload" in sc.data:
        table = sc.section("workload")
        here = f"{sc.path}: workload"
        workload = build_workload(sc, table)
        if workload.from_plan:
            report["workload_from_plan"] = dict(workload.from_plan)
        layer = compute_layer(sc, workload, table, here)
        busiest = layer.per_gpu[layer.busiest_gpu]
        rows = np.array([w.valid_rows for w in layer.per_gpu])
        group_rows = rows[list(workload.groups)]
        report["compute"] = {
            "time_s": layer.time_s, "busiest_gpu": layer.busiest_gpu, "bound": busiest.bound,
            "busiest_flops": busiest.flops, "busiest_memory_bytes": busiest.memory_bytes,
            "busiest_compute_s": busiest.compute_s, "busiest_memory_s": busiest.memory_s,
            "busiest_tile_bytes": busiest.tile_bytes, "busiest_tile_s": busiest.tile_s,
            "busiest_fixed_s": busiest.fixed_s, "weights": str(table.get("weights", gemm.DEFAULT_WEIGHTS)),
            "per_gpu_s": layer.times_s.tolist(), "rows_per_gpu": rows.tolist(),
            "valid_rows": float(rows.sum()), "computed_rows": float(sum(w.computed_rows for w in layer.per_gpu)),
            "expert_skew": traffic.expert_skew(group_rows) if group_rows.sum() > 0 else 1.0,
        }
        if "block_m" in table:
            bm = get_int(table, "block_m", here, 0, 1)
            all_rows = np.concatenate([r for r in workload.rows_per_gpu if r.size])
            report["padding"] = {"block_m": bm, "valid_rows": float(all_rows.sum()),
                                 "padded_rows": gemm.padded_rows(all_rows, bm),
                                 "padded_rows_pad_empty": gemm.padded_rows(all_rows, bm, pad_empty=True),
                                 "padded_rows_batched": gemm.padded_rows_batched(all_rows, bm)}
        stages["compute"] = layer.time_s
        if workload.a_full is not None:
            d_bytes, c_bytes = _row_bytes(sc, table, "dispatch", here), _row_bytes(sc, table, "combine", here)
            v_d, v_c = traffic.phase_volumes_bytes(workload.a_full, d_bytes, c_bytes)
            dispatch = traffic.phase_lower_bound(sc.topology, v_d)
            combine = traffic.phase_lower_bound(sc.topology, v_c)
            report["dispatch"] = {**_phase_json(dispatch), "row_bytes": d_bytes}
            report["combine"] = {**_phase_json(combine), "row_bytes": c_bytes}
            stages = {"dispatch": dispatch.time_s, "compute": layer.time_s, "combine": combine.time_s}
        if "pool" in sc.data:
            report["pool"] = _pool(sc, layer, workload, table, here)
        report["stages_s"] = stages
        report["barrier_total_s"] = float(sum(stages.values()))
        report["binds"] = max(stages, key=stages.get)
    if "pipeline" in sc.data:
        report["pipeline"] = _pipeline(sc, stages)
    if "payback" in sc.data:
        report["payback"] = payback_report(sc)
    if "offload" in sc.data:
        report["offload"] = _offload(sc)
    if "capacity" in sc.data:
        report["capacity"] = _capacity(sc)
    if "nic" in sc.data:
        report["nic"] = _nic(sc)
    return report


def _pool(sc: Scenario, layer: gemm.LayerTime, workload: Workload, table: dict, here: str) -> dict:
    pool_table = sc.section("pool")
    rate = get_number(pool_table, "rate_batches_per_s", f"{sc.path}: pool")
    topo = _need_topology(sc)
    names = [f"gpu{g} flops" for g in range(len(layer.per_gpu))]
    demand = [w.flops for w in layer.per_gpu]
    capacity = [topo.gpu.flops_per_s] * len(layer.per_gpu)
    if workload.a_full is not None:
        v_d, v_c = traffic.phase_volumes_bytes(workload.a_full, _row_bytes(sc, table, "dispatch", here),
                                               _row_bytes(sc, table, "combine", here))
        loads = topo.link_loads_bytes(v_d + v_c)
        for (u, v), load in sorted(loads.items()):
            names.append(f"link {u}->{v}")
            demand.append(load)
            capacity.append(topo.graph.edges[u, v]["capacity"])
    result = offload.pool_stability(rate, demand, capacity, names)
    return {"rate_batches_per_s": rate, "stable": result.stable, "binding": result.binding,
            "max_utilization": float(result.utilization.max()),
            "max_rate_batches_per_s": result.max_rate_batches_per_s}


def _pipeline(sc: Scenario, stages: dict[str, float]) -> dict:
    table = sc.section("pipeline")
    here = f"{sc.path}: pipeline"
    if not stages:
        raise InputError(here, "a [workload] section whose stages are pipelined", "nothing")
    q = get_int(table, "micro_batches", here, 2, 1)
    names = list(stages)
    times = [stages[n] for n in names]
    serial = float(sum(times))
    piped = pipeline.split_pipeline_time_s(times, q)
    out = {"micro_batches": q, "stages": names, "serial_s": serial, "pipelined_s": piped, "saving_s": serial - piped,
           "breakeven_slowdown": {}}
    for group in table.get("breakeven", []):
        if not isinstance(group, list) or any(g not in names for g in group):
            raise InputError(f"{here}.breakeven", f"lists of stage names from {names}", repr(group))
        factor = pipeline.breakeven_slowdown(times, q, [names.index(g) for g in group])
        out["breakeven_slowdown"]["+".join(group)] = factor
    return out


def payback_report(sc: Scenario) -> dict:
    table = sc.section("payback")
    here = f"{sc.path}: payback"
    topo = _need_topology(sc)
    if "saving_per_batch_ms" in table:
        saving = get_number(table, "saving_per_batch_ms", here) * 1e-3
        before_s = after_s = None
        memory = {}
    else:
        if "rows_after" not in table or "workload" not in sc.data:
            raise InputError(here, "rows_after (with a [workload] as the before) or saving_per_batch_ms", "neither")
        wl_table = sc.section("workload")
        before = compute_layer(sc, build_workload(sc, wl_table), wl_table, f"{sc.path}: workload")
        after_table = {k: v for k, v in wl_table.items() if k not in ("rows_per_expert", "dispatch", "trace")}
        after_table["rows_per_expert"] = table["rows_after"]
        if "gpus_after" in table:
            after_table["gpus"] = table["gpus_after"]
        after = compute_layer(sc, build_workload(sc, after_table, "payback.rows_after"), after_table, here)
        before_s, after_s = before.time_s, after.time_s
        saving = before_s - after_s
        memory = {"before_busiest_memory_bytes": before.per_gpu[before.busiest_gpu].memory_bytes,
                  "after_busiest_memory_bytes": after.per_gpu[after.busiest_gpu].memory_bytes}
        memory["saving_memory_bytes"] = memory["before_busiest_memory_bytes"] - memory["after_busiest_memory_bytes"]
    alpha = get_number(table, "alpha_us", here, default=0.0, allow_zero=True) * 1e-6
    mode = str(table.get("mode", "serial"))
    free = get_number(table, "free_mib", here, allow_zero=True) * MIB_BYTES if "free_mib" in table else None
    copy_bytes = get_number(table, "copy_bytes", here, default=float(sc.model.expert_bytes))
    batches = _batches(table.get("batches", [16, 64]), f"{here}.batches")
    if mode not in ("serial", "parallel"):
        raise InputError(f"{here}.mode", "serial or parallel", repr(mode))
    cases = table.get("cases") or [{"name": "copy", **{k: table[k] for k in ("copy_from", "copy_to", "copies")
                                                       if k in table}}]
    out = {"saving_per_batch_s": saving, "before_s": before_s, "after_s": after_s, **memory, "alpha_s": alpha,
           "mode": mode,
           "copy_bytes": copy_bytes, "max_batches": _batches([get_int(table, "max_batches", here, 64, 1)],
                                                             f"{here}.max_batches")[0], "cases": []}
    for i, case in enumerate(cases):
        where = f"{here}.cases[{i}]"
        copies = _copies(case, where, copy_bytes)
        result = payback(topo, copies, saving, alpha_s=alpha, mode=mode, free_bytes_per_gpu=free, strict=True)
        out["cases"].append({
            "name": str(case.get("name", f"case{i}")), "copies": len(copies),
            "path": sorted({topo.path_kind(c.src_gpu, c.dst_gpu) for c in copies}),
            "path_bandwidth_bytes_per_s": min(topo.path_bandwidth_bytes_per_s(c.src_gpu, c.dst_gpu) for c in copies),
            "copy_time_s": result.copy_time_s, "n_min": result.n_min, "feasible": result.feasible,
            "net_gain_s": {str(b): result.net_gain_s(b) for b in batches}})
    return out


def _batches(values, where: str) -> list[int]:
    """Batch counts: integers in [1, MAX_PAYBACK_BATCHES] (the net-gain curve has one point per batch)."""
    if not isinstance(values, list) or not values or any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise InputError(where, "a list of integers", repr(values))
    bad = [v for v in values if not 1 <= v <= MAX_PAYBACK_BATCHES]
    if bad:
        raise InputError(where, f"batch counts in [1, {MAX_PAYBACK_BATCHES:,}]", bad[0])
    return list(values)


def _copies(case: dict, where: str, copy_bytes: float) -> list[Copy]:
    if "copies" in case:
        pairs = case["copies"]
        if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2 for p in pairs):
            raise InputError(f"{where}.copies", "a list of [source GPU, destination GPU] pairs", repr(pairs))
        return [Copy(int(s), int(d), copy_bytes) for s, d in pairs]
    if "copy_from" in case and "copy_to" in case:
        return [Copy(int(case["copy_from"]), int(d), copy_bytes) for d in case["copy_to"]]
    raise InputError(where, "copies = [[src, dst], ...] or copy_from + copy_to", "neither")


def _offload(sc: Scenario) -> dict:
    table = sc.section("offload")
    here = f"{sc.path}: offload"
    cpu = sc.catalog.cpu(str(table.get("cpu", "Xeon-Platinum-8452Y")))
    if "gpu" in table:
        gpu = sc.catalog.gpu(str(table["gpu"]))
        gpu = gpu.with_efficiency(sc.efficiency) if sc.efficiency is not None else gpu
    else:
        gpu = _need_topology(sc).gpu
    link = gb_per_s(get_number(table, "link_gb_per_s", here)) if "link_gb_per_s" in table else gpu.pcie_bytes_per_s
    alpha = get_number(table, "alpha_us", here, default=0.0, allow_zero=True) * 1e-6
    socket = str(table.get("socket", "local"))
    experts = get_int(table, "experts", here, 1, 1)
    rows = [int(r) for r in table.get("rows", [1])]
    out = {"cpu": cpu.name, "gpu": gpu.name, "gpu_flops_per_s": gpu.flops_per_s,
           "gpu_memory_bytes_per_s": gpu.memory_bytes_per_s, "link_bytes_per_s": link, "alpha_s": alpha,
           "experts": experts, "socket": socket, "kernels": {}}
    for kernel in table.get("kernels", list(cpu.kernels)):
        rates = offload.OffloadRates.of(gpu, cpu, kernel, socket, link, alpha)
        out["kernels"][kernel] = {
            "cpu_s": {str(m): experts * offload.cpu_time_s(m, sc.model, rates) for m in rows},
            "gpu_s": {str(m): experts * offload.gpu_time_s(m, sc.model, rates) for m in rows},
            "gpu_faster_from_rows": offload.crossover_rows(sc.model, rates)}
    return out


def _capacity(sc: Scenario) -> dict:
    table = sc.section("capacity")
    here = f"{sc.path}: capacity"
    m = sc.model
    out: dict = {"expert_bytes": m.expert_bytes, "layers": m.num_moe_layers, "replicas": {}, "resident": {}}
    for layers in table.get("replica_layers", []):
        b = offload.replica_bytes(m, 1, int(layers))
        out["replicas"][str(layers)] = {"bytes": b, "mib": b / MIB_BYTES, "gib": b / GIB_BYTES}
    memory = get_number(table, "gpu_memory_gb", here) * GB_BYTES if "gpu_memory_gb" in table else None
    for per_layer in table.get("resident_per_layer", []):
        total = offload.resident_bytes(m, int(per_layer))
        entry = {"per_layer_gib": m.expert_bytes * int(per_layer) / GIB_BYTES, "bytes": total, "gib": total / GIB_BYTES}
        if memory is not None:
            entry["fits"] = total <= memory
        out["resident"][str(per_layer)] = entry
    if memory is not None:
        out["gpu_memory_gib"] = memory / GIB_BYTES
        out["max_resident_per_layer"] = offload.max_resident_per_layer(m, memory)
    return out


def _nic(sc: Scenario) -> dict:
    table = sc.section("nic")
    here = f"{sc.path}: nic"
    if "nic" in table:
        nic = sc.catalog.nic(str(table["nic"]))
        bw, rate = nic.bytes_per_s, nic.messages_per_s
    else:
        bw = get_number(table, "gbit_per_s", here) * 1e9 / 8
        rate = get_number(table, "messages_per_s", here)
    if "messages_per_s" in table:
        rate = get_number(table, "messages_per_s", here)
    crossover = traffic.message_rate_crossover_bytes(bw, rate)
    return {"bytes_per_s": bw, "messages_per_s": rate, "crossover_bytes": crossover,
            "messages": {str(int(b)): traffic.nic_regime(float(b), bw, rate) for b in table.get("message_bytes", [])}}


__all__ = ["SCHEMA", "Scenario", "Workload", "build_workload", "compute_layer", "load_scenario", "payback_report",
           "predict", "scenario_from_table", "with_gemm_record"]
