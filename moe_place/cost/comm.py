"""The MoE layer time of a placement at multi-node EP: dispatch + busiest-GPU compute + combine.

Inputs: the token-level expert ids of one layer (one array per step: a step is one forward
pass), where each token lives (its *home* GPU: data-parallel attention puts a batch's tokens on
the `G` GPUs), a placement row `phy2log [P]` and a `CommModel` (topology, expert shape,
dispatch style, replica choice). Per step:

1. Replica choice (`moe_place.cost.replicas.choose_replicas`, where every rule is described): every
   (token, logical expert) pair goes to one physical slot by the rule `replica_choice` names (the default,
   SGLang's `static`, is what SGLang does with a plan from `--init-expert-location`), or by a per-batch
   split of the step (`step_cost`'s `split`).
2. Traffic (`step_traffic`), rows moved in the dispatch phase, `rows[i][j]` from GPU i to j:
   - `deepep` (DeepEP internode kernels, used by SGLang and vLLM across nodes): a token is sent
     over RDMA once to every remote node holding one of its chosen slots, to the GPU with the
     home GPU's local rank there; that GPU (on the home node: the home GPU itself) forwards it
     over NVLink once to each other GPU of the node that holds one of its slots.
   - `all-to-all`: one send per (token, destination GPU) from the home GPU; same GPU is free.
   Combine mirrors dispatch: the same rows in the opposite direction (`rows.T`).
3. Times: dispatch and combine from formula 3 on the topology's graph
   (`traffic.phase_time_s`, equal to `phase_lower_bound`), with `dispatch_bytes_per_row` and
   `combine_bytes_per_row`; compute is the busiest GPU's expert time over the rows each slot
   received: formula 11 (`weights="calibrated"`, the one default of every command), or `max(F/C, W/B)`
   (formula 1, `weights="once"`), formula 5 (`weights="tiles"`).
   `layer_time_s = dispatch + compute + combine`, barriers between the phases as in row C6.
Figures of a trace are sums over its steps (the time to run them one after another), except
`distinct_nodes_per_token`, a mean over all tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from moe_place.analysis.dispatch import TOKEN_LAYOUTS as TOKEN_HOMES, token_sources
from moe_place.cost.gemm import DEFAULT_WEIGHTS, WEIGHT_MODES, gpu_times_s
from moe_place.cost.models import ExpertShape
from moe_place.cost.topology import Topology
from moe_place.cost.traffic import phase_time_s
from moe_place.errors import InputError
from moe_place.cost.replicas import DEFAULT_REPLICA_CHOICE, TOKEN_CHOICES, SlotTable, choose_replicas
from moe_place.split import map_tokens

__all__ = ["CommModel", "LayerCost", "StepCost", "StepTraffic", "compute_only_s", "layer_cost", "step_cost",
           "step_traffic"]

DISPATCH_STYLES = ("deepep", "all-to-all")


@dataclass(frozen=True)
class StepTraffic:
    """Rows one step of one layer moves and computes (module docstring, step 2).

    rows: float64 `[G, G]`, dispatch-phase rows sent from GPU i to GPU j (zero diagonal).
    rows_per_slot: int64 `[P]`, the rows each physical expert computes.
    tokens: tokens of the step; visited_nodes: sum over tokens of the distinct nodes holding
    their chosen slots.
    """

    rows: np.ndarray
    rows_per_slot: np.ndarray
    tokens: int
    visited_nodes: int
    gpus_per_node: int

    @property
    def cross_node(self) -> np.ndarray:
        """bool `[G, G]`: pairs on different nodes."""
        node = np.arange(self.rows.shape[0]) // self.gpus_per_node
        return node[:, None] != node[None, :]

    @property
    def rdma_rows(self) -> float:
        return float(self.rows[self.cross_node].sum())

    @property
    def nvlink_rows(self) -> float:
        return float(self.rows[~self.cross_node].sum())

    @property
    def nic_send_rows(self) -> np.ndarray:
        """float64 `[G]`: rows each GPU's NIC sends to other nodes in the dispatch phase."""
        return np.where(self.cross_node, self.rows, 0.0).sum(axis=1)

    @property
    def nic_recv_rows(self) -> np.ndarray:
        """float64 `[G]`: rows each GPU's NIC receives from other nodes in the dispatch phase."""
        return np.where(self.cross_node, self.rows, 0.0).sum(axis=0)


def step_traffic(slots: np.ndarray, home: np.ndarray, table: SlotTable, style: str = "deepep") -> StepTraffic:
    """The rows of one step (module docstring, step 2). slots: int `[tokens, k]` from `choose_replicas`."""
    if style not in DISPATCH_STYLES:
        raise InputError("dispatch", f"one of {', '.join(DISPATCH_STYLES)}", style)
    slots = np.asarray(slots, dtype=np.int64)
    home = np.asarray(home, dtype=np.int64)
    tokens = slots.shape[0]
    gpus, gpn = table.num_gpus, table.gpus_per_node
    rows_idx = np.repeat(np.arange(tokens), slots.shape[1])
    gpu_visit = np.zeros((tokens, gpus), dtype=bool)
    gpu_visit[rows_idx, table.gpu_of_slot[slots].ravel()] = True
    node_visit = gpu_visit.reshape(tokens, table.num_nodes, gpn).any(axis=2)
    t, g = np.nonzero(gpu_visit)
    if style == "all-to-all":
        src, dst = home[t], g
    else:
        forwarder = (g // gpn) * gpn + home[t] % gpn                  # NVLink fan-out from here
        remote = node_visit.copy()
        remote[np.arange(tokens), home // gpn] = False
        t_remote, n_remote = np.nonzero(remote)
        src = np.concatenate([home[t_remote], forwarder])
        dst = np.concatenate([n_remote * gpn + home[t_remote] % gpn, g])
    keep = src != dst
    rows = np.bincount(src[keep] * gpus + dst[keep], minlength=gpus * gpus).reshape(gpus, gpus).astype(np.float64)
    rows_per_slot = np.bincount(slots.ravel(), minlength=table.phy2log.size)
    return StepTraffic(rows, rows_per_slot, int(tokens), int(node_visit.sum()), gpn)


# ---------------------------------------------------------------------- the layer time
@dataclass(frozen=True)
class CommModel:
    """How a layer's time is predicted (module docstring).

    topology: the cluster; its GPUs and nodes must match the plan's. model: the expert shape
    (FLOPs and weight bytes per expert, activation row bytes). dispatch: one of DISPATCH_STYLES.
    replica_choice: one of `moe_place.cost.replicas.TOKEN_CHOICES`. token_home: one of TOKEN_HOMES.
    weights: the expert time (`moe_place.cost.gemm`): calibrated = formula 11 with the GPU's
    `gemm_profile()` and `block_m` (default 64; the one default of every command), once = formula 1,
    tiles = formula 5 with `block_m`.
    dispatch_bytes_per_row / combine_bytes_per_row: None = the model's row bytes.
    seed: for the random replica choices.
    """

    topology: Topology
    model: ExpertShape
    dispatch: str = "deepep"
    replica_choice: str = DEFAULT_REPLICA_CHOICE
    token_home: str = "blocks"
    weights: str = DEFAULT_WEIGHTS
    block_m: int | None = None
    block_n: int = 128
    dispatch_bytes_per_row: float | None = None
    combine_bytes_per_row: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name, value, known in (("dispatch", self.dispatch, DISPATCH_STYLES),
                                   ("replica choice", self.replica_choice, TOKEN_CHOICES),
                                   ("token home", self.token_home, TOKEN_HOMES),
                                   ("weights", self.weights, WEIGHT_MODES)):
            if value not in known:
                raise InputError(name, f"one of {', '.join(known)}", value)
        if self.weights == "tiles" and self.block_m is None:
            raise InputError("block_m", "a tile height when weights = 'tiles'", "nothing")
        for name in ("dispatch_bytes_per_row", "combine_bytes_per_row"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise InputError(name, "bytes > 0", value)

    @property
    def dispatch_row_bytes(self) -> float:
        return float(self.model.row_bytes if self.dispatch_bytes_per_row is None else self.dispatch_bytes_per_row)

    @property
    def combine_row_bytes(self) -> float:
        return float(self.model.row_bytes if self.combine_bytes_per_row is None else self.combine_bytes_per_row)

    def check_placement(self, num_gpus: int, num_nodes: int, where: str = "topology") -> None:
        """InputError unless the topology has the plan's GPUs and nodes."""
        topo = self.topology
        if (topo.num_gpus, topo.num_servers) != (num_gpus, num_nodes):
            raise InputError(where, f"{num_nodes} nodes of {num_gpus // num_nodes} GPUs (the plan's {num_gpus} GPUs "
                             f"on {num_nodes} nodes)", f"{topo.num_servers} x {topo.gpus_per_server}")

    def compute_times_s(self, rows_per_slot: np.ndarray, num_gpus: int) -> np.ndarray:
        """float64 `[..., G]`: each GPU's expert time for rows per slot `[..., P]`."""
        rows = np.asarray(rows_per_slot, dtype=np.float64)
        gpu, m = self.topology.gpu, self.model
        return gpu_times_s(rows.reshape(*rows.shape[:-1], num_gpus, -1), m.hidden, m.intermediate, m.dtype_bytes,
                           gpu.flops_per_s, gpu.memory_bytes_per_s, weights=self.weights, block_m=self.block_m,
                           block_n=self.block_n, matrices=m.matrices, flops_per_row=float(m.flops_per_row()),
                           profile=gpu.gemm_profile())

    def describe(self) -> dict:
        """JSON-ready: what the figures assume."""
        return {"topology": self.topology.describe(), "model": self.model.name, "dispatch": self.dispatch,
                "replica_choice": self.replica_choice, "token_home": self.token_home, "weights": self.weights,
                **({"gemm_profile": self.topology.gpu.gemm_profile().source} if self.weights == "calibrated" else {}),
                "dispatch_bytes_per_row": self.dispatch_row_bytes, "combine_bytes_per_row": self.combine_row_bytes}


@dataclass(frozen=True)
class LayerCost:
    """Predicted figures of one layer over a trace's steps (sums over steps unless said otherwise).

    tokens: tokens in all steps. distinct_nodes_per_token: mean over tokens of the nodes their
    chosen slots are on. rdma_bytes / nvlink_bytes: dispatch-phase bytes over the NICs / over
    NVLink (combine moves the same rows back at `combine_bytes_per_row`). nic_send_bytes /
    nic_recv_bytes: float64 `[G]` dispatch-phase bytes each GPU's NIC sends / receives;
    node_send_bytes / node_recv_bytes: float64 `[N]` the same per node. rows_per_gpu: float64
    `[G]` rows computed. busiest_rows / mean_rows: busiest and mean GPU rows, summed over steps
    (the busiest of each step). dispatch_s, compute_s, combine_s: seconds, summed over steps.
    """

    tokens: int
    distinct_nodes_per_token: float
    rdma_bytes: float
    nvlink_bytes: float
    nic_send_bytes: np.ndarray
    nic_recv_bytes: np.ndarray
    node_send_bytes: np.ndarray
    node_recv_bytes: np.ndarray
    rows_per_gpu: np.ndarray
    busiest_rows: float
    mean_rows: float
    dispatch_s: float
    compute_s: float
    combine_s: float

    @property
    def layer_time_s(self) -> float:
        return self.dispatch_s + self.compute_s + self.combine_s

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "distinct_nodes_per_token": self.distinct_nodes_per_token,
                "rdma_bytes": self.rdma_bytes, "nvlink_bytes": self.nvlink_bytes,
                "nic_send_bytes_max": float(self.nic_send_bytes.max(initial=0.0)),
                "nic_recv_bytes_max": float(self.nic_recv_bytes.max(initial=0.0)),
                "node_send_bytes": self.node_send_bytes.tolist(), "node_recv_bytes": self.node_recv_bytes.tolist(),
                "busiest_gpu_rows": self.busiest_rows, "mean_gpu_rows": self.mean_rows,
                "dispatch_s": self.dispatch_s, "compute_s": self.compute_s, "combine_s": self.combine_s,
                "layer_time_s": self.layer_time_s}


@dataclass(frozen=True)
class StepCost:
    """One step of one layer: its traffic and the three phase times (seconds)."""

    traffic: StepTraffic
    dispatch_s: float
    compute_s: float
    combine_s: float


# A per-batch split (`moe_place.split`): the batch's global counts per logical expert `[E]` in, rows per
# slot `[P]` out; the tokens then go to the replicas by `moe_place.split.map_tokens` (step 1's rule).
SplitRule = Callable[[np.ndarray], np.ndarray]


def step_cost(model: CommModel, topk_ids: np.ndarray, home: np.ndarray, table: SlotTable, seed: int = 0,
              split: SplitRule | None = None) -> StepCost:
    """Replica choice, traffic and times of one step (module docstring, steps 1-3).

    topk_ids: int `[tokens, k]`; home: int `[tokens]` home GPUs (any, e.g. only some GPUs hold tokens).
    split: a per-batch split; the pairs then go where `map_tokens` sends them instead of `model.replica_choice`.
    """
    model.check_placement(table.num_gpus, table.num_nodes)
    if split is None:
        slots = choose_replicas(topk_ids, home, table, model.replica_choice, seed)
    else:
        counts = np.bincount(np.asarray(topk_ids, dtype=np.int64).ravel(), minlength=table.num_experts)
        slots = map_tokens(topk_ids, home, table.phy2log, np.asarray(split(counts)), table.num_gpus)
    traffic = step_traffic(slots, home, table, model.dispatch)
    return StepCost(traffic, phase_time_s(model.topology, traffic.rows * model.dispatch_row_bytes),
                    float(model.compute_times_s(traffic.rows_per_slot, table.num_gpus).max()),
                    phase_time_s(model.topology, traffic.rows.T * model.combine_row_bytes))


def layer_cost(model: CommModel, steps: list[np.ndarray], table: SlotTable, layer: int = 0,
               split: SplitRule | None = None) -> LayerCost:
    """The figures of one layer of a plan on token-level ids (module docstring).

    steps: one int `[tokens, k]` array of this layer's expert ids per step; each step's tokens live
    on the GPUs as `model.token_home` says. table: the layer's plan. layer: mixed into the seed of
    the random replica choices (each layer and step draws its own). split: a per-batch split of
    each step (`step_cost`), in place of the model's replica choice.
    """
    num_gpus, num_nodes = table.num_gpus, table.num_nodes
    model.check_placement(num_gpus, num_nodes)
    gpn = num_gpus // num_nodes
    d_row = model.dispatch_row_bytes
    tokens = visited = 0
    rdma = nvlink = dispatch = combine = compute = busiest = mean = 0.0
    send, recv, rows_gpu = np.zeros(num_gpus), np.zeros(num_gpus), np.zeros(num_gpus)
    for index, ids in enumerate(steps):
        home = token_sources(ids.shape[0], num_gpus, model.token_home)
        # SGLang builds its static table once; the dynamic choice draws anew every batch
        draw = index if model.replica_choice == "sglang-dynamic" else 0
        step = step_cost(model, ids, home, table, seed=_seed(model.seed, layer, draw), split=split)
        traffic = step.traffic
        tokens += traffic.tokens
        visited += traffic.visited_nodes
        rdma += traffic.rdma_rows * d_row
        nvlink += traffic.nvlink_rows * d_row
        send += traffic.nic_send_rows * d_row
        recv += traffic.nic_recv_rows * d_row
        dispatch += step.dispatch_s
        combine += step.combine_s
        compute += step.compute_s
        per_gpu = traffic.rows_per_slot.reshape(num_gpus, -1).sum(axis=1).astype(np.float64)
        rows_gpu += per_gpu
        busiest += float(per_gpu.max())
        mean += float(per_gpu.mean())
    return LayerCost(tokens, visited / max(tokens, 1), rdma, nvlink, send, recv,
                     send.reshape(num_nodes, gpn).sum(axis=1), recv.reshape(num_nodes, gpn).sum(axis=1), rows_gpu,
                     busiest, mean, dispatch, compute, combine)


def compute_only_s(model: CommModel, step_loads: np.ndarray, phy2log: np.ndarray, num_gpus: int,
                   split: SplitRule | None = None) -> float:
    """Seconds of busiest-GPU compute summed over steps, for count-level loads (no token ids).

    step_loads: `[steps, E]` dispatches per logical expert of one layer; replicas split them evenly, or
    as `split` says (it takes `[steps, E]` and returns rows per slot `[steps, P]`).
    """
    loads = np.atleast_2d(np.asarray(step_loads, dtype=np.float64))
    row = np.asarray(phy2log, dtype=np.int64)
    if split is not None:
        per_slot = np.atleast_2d(np.asarray(split(np.rint(loads).astype(np.int64)), dtype=np.float64))
        return float(model.compute_times_s(per_slot, num_gpus).max(axis=-1).sum())
    logcnt = np.bincount(row, minlength=loads.shape[1])
    per_slot = (loads / np.maximum(logcnt, 1))[:, row]                  # [steps, P]
    return float(model.compute_times_s(per_slot, num_gpus).max(axis=-1).sum())


def _seed(seed: int, layer: int, step: int) -> int:
    """One seed per (model seed, layer, step): random replica choices differ by layer and step, repeatably."""
    return int(np.random.SeedSequence([seed, layer, step]).generate_state(1)[0])
