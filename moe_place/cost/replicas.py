"""Replica choice: which replica of an expert each dispatch goes to, every rule in one place.

`REPLICA_CHOICES`, each on a batch's token ids (`choose_replicas`: the slot of every (token, expert) pair, what the
multi-node model `moe_place.cost.comm` routes) and, where a trace has counts only, on its dispatches per logical
expert (`slot_rows`: the expected rows per slot, with the batch's tokens spread evenly over the `G` ranks; the
engines' own rules key on each token's index or rank, which counts do not carry):
- `even`: every replica takes `counts[e] / logcnt[e]` (what EPLB plans for); counts only.
- `vllm`: vLLM 0.33's router (`fused_moe/router/base_router.py`, `_eplb_map_and_record_i32_kernel`): a token
  with index `t` in its rank's batch sends each of its experts to replica `((t * 2654435769) mod 2^32) mod
  logcnt[e]` of `logical_to_physical_map` (slots ascending), the Knuth hash of its index. On counts replica `i`
  takes the share of the indices `t < n` (`n` tokens per rank: the batch's dispatches / top-k / G) with that
  residue (`vllm_hash_fractions`): about `1/logcnt` on long batches; on short ones index 0 (every rank's first
  token) always lands on replica 0.
- `sglang-static`: SGLang 0.5.23's `static` dispatch, its default with EPLB and an all-to-all backend
  (`arg_groups/parallel_hook.py`) and with a plan from `--init-expert-location`
  (`eplb/expert_location.py`, `compute_logical_to_rank_dispatch_physical_map`): each rank sends all its
  dispatches of an expert to one replica, on its own GPU, else its node (the lowest slot; only where some
  replicas are on other nodes: `_find_nearest_expert` prefers the node only when that narrows the candidates),
  else a seeded fair draw over all replicas, every replica drawn equally often across the ranks left
  (`static_rank_table`; our draw is seeded numpy, not SGLang's `random.Random(42)`). On counts ranks send equally.
- `sglang-dynamic`: SGLang's `dynamic` dispatch (`eplb/expert_location_dispatch.py`,
  `topk_ids_logical_to_physical`): a uniform random replica per dispatch, seeded; on counts the even split.
- `per-batch`: moe-place's per-batch split of the batch's global counts (`moe_place.split.split_shares`), the
  rule behind SGLang's `lp` dispatch and vLLM's router with `MOE_PLACE_SPLIT=per-batch`; on token ids
  `moe_place.split.map_tokens` sends each rank's dispatches (`moe_place.cost.comm.step_cost`'s `split`).
- `node-aware` (our recommended dispatcher): a replica on the token's home GPU, else on its home node, else on a
  node the token already visits, else the least-loaded replica (rows the step has put on each GPU so far).
  Experts with one replica are placed first (they fix nodes the token must visit); the rest are resolved one per
  token per round; token ids only (it reads which nodes a token visits).
Without redundant slots every rule is the same: an expert has one slot. What each engine does by default:
`ENGINE_REPLICA_CHOICE`.

What the split costs a layer (`split_overhead_s`): it needs the batch's global counts, an all-reduce of `E`
int32 counts over the EP group before the dispatch, then the solve; both sit on the layer's critical path.
The all-reduce is priced by NCCL's own latency model for small messages (the LL protocol, the least of tree and
ring: `baseLat + 2 ((G/N - 1) intraLat + log2(N) interLat)` for the tree, `baseLat + (2(G-1) - 2(N-1))
intraLat + 2(N-1) interLat` for the ring, with NCCL's constants in microseconds, `intraLat` x 1.8 across
nodes: NVIDIA/nccl `src/graph/tuning.cc`, `baseLat`, `hwLat`, `ncclTopoTuneModel`, at commit 01afd20): 10.2 us
on one node of 8 GPUs, 37.5 us on 4 nodes of 8. The solve is a figure you give (`solve_s`): its kernel's
time on your GPU (`bench/gpu_check.sh` times it); the default is the kernel's goal, 10 us, not a measurement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from moe_place.errors import InputError
from moe_place.placement import Placement, even_split_slot_loads
from moe_place.split import MAX_SWEEPS, split_shares

__all__ = ["SlotTable", "allreduce_latency_s", "choose_replicas", "local_positions", "slot_rows", "split_overhead_s",
           "static_rank_table", "vllm_hash_fractions", "vllm_replica_index", "water_fill"]

REPLICA_CHOICES = ("even", "vllm", "sglang-static", "sglang-dynamic", "per-batch", "node-aware")   # module note
COUNT_CHOICES = REPLICA_CHOICES[:5]                     # `slot_rows`: node-aware needs the tokens' nodes
TOKEN_CHOICES = ("vllm", "sglang-static", "sglang-dynamic", "node-aware")   # `choose_replicas`; per-batch:
# `moe_place.split.map_tokens`
SPLIT_OFF_CHOICES = tuple(c for c in COUNT_CHOICES if c != "per-batch")   # where the split is off, on counts
ENGINE_REPLICA_CHOICE = {"vllm": "vllm", "sglang": "sglang-static"}   # what each engine does by default
# the multi-node model's default: SGLang's rule with a plan loaded by `--init-expert-location`, the way our plans
# reach it (SGLang then sets `--ep-dispatch-algorithm static`, python/sglang/srt/server_args.py)
DEFAULT_REPLICA_CHOICE = ENGINE_REPLICA_CHOICE["sglang"]
KNUTH_MULTIPLIER = 2654435769       # vLLM 0.33's replica hash: floor(2^32 / golden ratio)
DEFAULT_SOLVE_S = 10e-6             # the split kernel's goal per layer (not measured: give yours)
# NCCL's latency model (us), LL protocol: baseLat[tree, ring], hwLat[NVLink | network][tree, ring]
NCCL_BASE_LAT_US = {"tree": 4.4, "ring": 3.6}
NCCL_NVLINK_LAT_US = {"tree": 0.52, "ring": 0.47}
NCCL_NET_LAT_US = {"tree": 5.0, "ring": 2.7}
NCCL_MULTI_NODE_INTRA_FACTOR = 1.8


def allreduce_latency_s(num_gpus: int, num_nodes: int) -> float:
    """Seconds of a small all-reduce over `num_gpus` GPUs on `num_nodes` nodes by NCCL's model (module note)."""
    if num_gpus < 1 or num_nodes < 1 or num_gpus % num_nodes:
        raise InputError("all-reduce group", "GPUs divisible by nodes, both >= 1", f"{num_gpus} on {num_nodes}")
    if num_gpus == 1:
        return 0.0
    per_node = num_gpus // num_nodes
    factor = NCCL_MULTI_NODE_INTRA_FACTOR if num_nodes > 1 else 1.0
    tree = NCCL_BASE_LAT_US["tree"] + 2 * ((per_node - 1) * NCCL_NVLINK_LAT_US["tree"] * factor
                                           + math.log2(num_nodes) * NCCL_NET_LAT_US["tree"])
    steps, inter = 2 * (num_gpus - 1), 2 * (num_nodes - 1)
    ring = NCCL_BASE_LAT_US["ring"] + (steps - inter) * NCCL_NVLINK_LAT_US["ring"] * factor \
        + inter * NCCL_NET_LAT_US["ring"]
    return min(tree, ring) * 1e-6


def split_overhead_s(num_gpus: int, num_nodes: int, split_solve_s: float = DEFAULT_SOLVE_S,
                     split_allreduce_s: float | None = None) -> float:
    """Seconds the per-batch split adds to a layer: the counts' all-reduce (`split_allreduce_s`, None: NCCL's
    latency on `num_gpus` GPUs over `num_nodes` nodes) and the solve (module note)."""
    for name, value in (("solve", split_solve_s), ("all-reduce", split_allreduce_s)):
        if value is not None and (not value >= 0 or value == float("inf")):
            raise InputError(f"split {name} time", "seconds >= 0", value)
    return (allreduce_latency_s(num_gpus, num_nodes) if split_allreduce_s is None else split_allreduce_s) \
        + split_solve_s


def vllm_replica_index(token_index: np.ndarray, replicas: np.ndarray) -> np.ndarray:
    """int64: vLLM 0.33's replica of a token with index `token_index` in its rank's batch among `replicas`
    copies, `((t * 2654435769) mod 2^32) mod replicas` (module note)."""
    hashed = (np.asarray(token_index, dtype=np.int64) * KNUTH_MULTIPLIER) & 0xFFFFFFFF
    return hashed % np.maximum(np.asarray(replicas, dtype=np.int64), 1)


def vllm_hash_fractions(tokens_per_rank: int, replicas: int) -> np.ndarray:
    """float64 `[replicas]`: the share of token indices `t < tokens_per_rank` whose hash picks each replica."""
    n = max(int(tokens_per_rank), 1)
    return np.bincount(vllm_replica_index(np.arange(n), replicas), minlength=replicas) / n


def slot_rows(phy2log: np.ndarray, counts: np.ndarray, num_gpus: int, choice: str, *, num_nodes: int = 1,
              top_k: int = 8, static_tables: dict | None = None, max_sweeps: int = MAX_SWEEPS) -> np.ndarray:
    """float64 `[B, P]`: the rows each slot of `phy2log` int `[B, P]` receives from `counts [B, E]` under the
    replica choice `choice` (module note). top_k: dispatches per token (vLLM's tokens per rank).
    static_tables: a cache for `sglang-static` (one table per distinct map row). max_sweeps: the split's cap."""
    if choice not in COUNT_CHOICES:
        raise InputError("replica choice", f"one of {', '.join(COUNT_CHOICES)}", choice)
    rows = np.asarray(phy2log, dtype=np.int64)
    load = np.asarray(counts, dtype=np.float64)
    if choice in ("even", "sglang-dynamic"):
        return even_split_slot_loads(rows, load)
    if choice == "per-batch":
        return split_shares(rows, np.rint(load).astype(np.int64), num_gpus, max_sweeps=max_sweeps).astype(np.float64)
    if choice == "vllm":
        return _vllm_rows(rows, load, num_gpus, top_k)
    return _static_rows(rows, load, num_gpus, num_nodes, {} if static_tables is None else static_tables)


def _vllm_rows(rows: np.ndarray, load: np.ndarray, num_gpus: int, top_k: int) -> np.ndarray:
    batch, physical = rows.shape
    experts = load.shape[1]
    out = np.empty((batch, physical))
    tokens = load.sum(axis=1) / max(top_k, 1) / num_gpus
    for b in range(batch):
        logcnt = np.bincount(rows[b], minlength=experts)
        occurrence = np.zeros(physical, dtype=np.int64)
        order = np.argsort(rows[b], kind="stable")
        starts = np.cumsum(logcnt) - logcnt
        occurrence[order] = np.arange(physical) - starts[rows[b][order]]
        n = int(round(tokens[b]))
        fractions = {c: vllm_hash_fractions(n, c) for c in np.unique(logcnt[rows[b]]).tolist()}
        share = np.array([fractions[c][i] for c, i in zip(logcnt[rows[b]].tolist(), occurrence.tolist())])
        out[b] = load[b, rows[b]] * share
    return out


def _static_rows(rows: np.ndarray, load: np.ndarray, num_gpus: int, num_nodes: int, cache: dict) -> np.ndarray:
    """Rows per slot when each rank sends an expert's dispatches to its static replica (one weight matrix
    `[P, E]` per distinct map row, cached)."""
    batch, physical = rows.shape
    experts = load.shape[1]
    out = np.empty((batch, physical))
    for b in range(batch):
        key = rows[b].tobytes()
        if key not in cache:
            table = static_rank_table(SlotTable(rows[b], num_gpus, num_nodes, experts), 0)   # [G, E] slot per rank
            weight = np.zeros((physical, experts))
            np.add.at(weight, (table.ravel(), np.tile(np.arange(experts), num_gpus)), 1.0 / num_gpus)
            cache[key] = weight
        out[b] = cache[key] @ load[b]
    return out


# ---------------------------------------------------------------------- one layer's slots, by expert
@dataclass(frozen=True)
class SlotTable:
    """The slots of one layer's plan, grouped by expert.

    One layer's row of a `Placement` (which checks it and derives `logcnt` and the candidates, its `log2phy`)
    indexed for the replica choice, which looks up every token of every step in it (candidates padded to this
    layer's widest expert, the slots' GPUs and nodes, SGLang's static dispatch tables cached per seed).

    phy2log: int64 `[P]`. candidates: int64 `[E, width]`, the slots of each expert ascending,
    -1 padded (vLLM's `logical_to_physical_map` row). logcnt: int64 `[E]`.
    gpu_of_slot / node_of_slot: int64 `[P]`.
    """

    phy2log: np.ndarray
    num_gpus: int
    num_nodes: int
    num_experts: int
    candidates: np.ndarray = field(init=False, repr=False)
    logcnt: np.ndarray = field(init=False, repr=False)
    static_tables: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    gpu_of_slot: np.ndarray = field(init=False, repr=False)
    node_of_slot: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        layer = Placement(np.asarray(self.phy2log, dtype=np.int64)[None], self.num_experts, self.num_gpus,
                          self.num_nodes, allow_colocated=True)   # checks the row; its logcnt and log2phy
        gpu = layer.gpu_of_slot()
        for name, value in (("phy2log", layer.phy2log[0]), ("candidates", layer.log2phy[0]), ("logcnt", layer.logcnt[0]),
                            ("gpu_of_slot", gpu), ("node_of_slot", gpu // layer.gpus_per_node)):
            value.setflags(write=False)
            object.__setattr__(self, name, value)

    @property
    def slots_per_gpu(self) -> int:
        return self.phy2log.size // self.num_gpus

    @property
    def gpus_per_node(self) -> int:
        return self.num_gpus // self.num_nodes


def static_rank_table(table: SlotTable, seed: int) -> np.ndarray:
    """int64 `[G, E]`: the slot each rank uses for each expert under SGLang's static dispatch (cached
    per seed on the table: the engine builds it once, not per batch)."""
    if seed in table.static_tables:
        return table.static_tables[seed]
    gpus, gpn = table.num_gpus, table.gpus_per_node
    cand = table.candidates                                                # [E, W], -1 padded
    valid = cand >= 0
    cand_gpu = np.where(valid, table.gpu_of_slot[np.maximum(cand, 0)], -1)
    cand_node = np.where(valid, table.node_of_slot[np.maximum(cand, 0)], -1)
    out = np.full((gpus, table.num_experts), -1, dtype=np.int64)
    same_node = cand_node[None] == (np.arange(gpus) // gpn)[:, None, None]
    for match in (same_node, cand_gpu[None] == np.arange(gpus)[:, None, None]):  # same node, then same GPU (wins)
        hit = match.any(axis=2)
        if match is same_node:   # SGLang prefers its node's replicas only when that narrows the candidates
            hit &= match.sum(axis=2) < table.logcnt[None, :]
        first = np.argmax(match, axis=2)                                       # the lowest such slot
        out = np.where(hit, cand[np.arange(table.num_experts)[None, :], first], out)
    out[:, table.logcnt == 1] = cand[table.logcnt == 1, 0]
    rng = np.random.default_rng(seed)
    for e in np.flatnonzero((out < 0).any(axis=0)):  # nobody near: a fair draw over all replicas
        slots = cand[e, :table.logcnt[e]]
        left = np.flatnonzero(out[:, e] < 0)
        quotient, remainder = divmod(left.size, slots.size)
        draws = np.concatenate([np.tile(slots, quotient), rng.choice(slots, remainder, replace=False)])
        rng.shuffle(draws)
        out[left, e] = draws
    out.setflags(write=False)
    table.static_tables[seed] = out
    return out


# ---------------------------------------------------------------------- on token ids
def local_positions(home: np.ndarray, num_gpus: int) -> np.ndarray:
    """int64 `[tokens]`: each token's index among the tokens of its home GPU (in token order)."""
    order = np.argsort(home, kind="stable")
    counts = np.bincount(home, minlength=num_gpus)
    starts = np.cumsum(counts) - counts
    local = np.empty(home.size, dtype=np.int64)
    local[order] = np.arange(home.size) - starts[home[order]]
    return local


def choose_replicas(topk_ids: np.ndarray, home: np.ndarray, table: SlotTable, rule: str = DEFAULT_REPLICA_CHOICE,
                    seed: int = 0) -> np.ndarray:
    """int64 `[tokens, k]`: the physical slot each (token, expert) pair is sent to (module note).

    topk_ids: int `[tokens, k]` logical expert ids of one layer and step; home: int `[tokens]` home GPUs.
    seed: for `sglang-static` and `sglang-dynamic` (the same seed gives the same choice).
    """
    ids = np.asarray(topk_ids, dtype=np.int64)
    home = np.asarray(home, dtype=np.int64)
    if rule not in TOKEN_CHOICES:
        raise InputError("replica choice", f"one of {', '.join(TOKEN_CHOICES)}", rule)
    if ids.ndim != 2 or home.shape != ids.shape[:1]:
        raise InputError("topk_ids", "[tokens, k] ids and one home GPU per token", f"{ids.shape}, {home.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= table.num_experts):
        raise InputError("topk_ids", f"expert ids in [0, {table.num_experts})")
    if home.size and (home.min() < 0 or home.max() >= table.num_gpus):
        raise InputError("home", f"GPUs in [0, {table.num_gpus})")
    count = table.logcnt[ids]
    if table.candidates.shape[1] == 1 or ids.size == 0:
        return table.candidates[ids, 0]
    if rule == "vllm":
        index = vllm_replica_index(local_positions(home, table.num_gpus)[:, None], count)
        return table.candidates[ids, index]
    if rule == "sglang-dynamic":
        draw = np.random.default_rng(seed).integers(0, 65536, size=ids.shape)
        return table.candidates[ids, draw % count]
    if rule == "sglang-static":
        return static_rank_table(table, seed)[home[:, None], ids]
    return _node_aware(ids, home, table)


def _node_aware(ids: np.ndarray, home: np.ndarray, table: SlotTable) -> np.ndarray:
    """Our dispatcher (module note): home GPU, home node, a visited node, the least-loaded GPU."""
    tokens, k = ids.shape
    rows = np.arange(tokens)
    cand = table.candidates[ids]                                   # [T, k, width]
    valid = cand >= 0
    cand_gpu = np.where(valid, table.gpu_of_slot[np.maximum(cand, 0)], -1)
    cand_node = np.where(valid, table.node_of_slot[np.maximum(cand, 0)], -1)
    home_node = home // table.gpus_per_node
    spread = rows[:, None] + np.arange(k)[None, :]  # spreads tokens over equally good replicas
    chosen = np.where(table.logcnt[ids] == 1, cand[..., 0], -1)

    def pick(mask: np.ndarray) -> np.ndarray:
        """For each pair, the (spread mod hits)-th candidate where `mask` holds; -1 where none."""
        hits = mask.sum(axis=-1)
        nth = spread % np.maximum(hits, 1)
        index = np.argmax(np.cumsum(mask, axis=-1) > nth[..., None], axis=-1)
        return np.where(hits > 0, np.take_along_axis(cand, index[..., None], axis=-1)[..., 0], -1)

    open_ = chosen < 0
    for mask in (cand_gpu == home[:, None, None], cand_node == home_node[:, None, None]):
        choice = pick(mask & valid)
        take = open_ & (choice >= 0)
        chosen[take] = choice[take]
        open_ &= ~take
    load = np.bincount(table.gpu_of_slot[chosen[~open_]], minlength=table.num_gpus).astype(np.int64)
    while open_.any():
        visited = np.zeros((tokens, table.num_nodes), dtype=bool)
        done = ~open_
        visited[np.repeat(rows, k)[done.ravel()], table.node_of_slot[chosen[done]]] = True
        # one open pair per token this round: its first
        first = np.argmax(open_, axis=1)
        active = open_[rows, first]
        t_act, j_act = rows[active], first[active]
        on_visited = visited[t_act[:, None], np.maximum(cand_node[t_act, j_act], 0)] & valid[t_act, j_act]
        hits = on_visited.sum(axis=1)
        nth = (t_act + j_act) % np.maximum(hits, 1)
        index = np.argmax(np.cumsum(on_visited, axis=1) > nth[:, None], axis=1)
        pick_visited = cand[t_act, j_act, index]
        via_visited = hits > 0
        chosen[t_act[via_visited], j_act[via_visited]] = pick_visited[via_visited]
        np.add.at(load, table.gpu_of_slot[pick_visited[via_visited]], 1)
        rest_t, rest_j = t_act[~via_visited], j_act[~via_visited]
        experts = ids[rest_t, rest_j]
        for e in np.unique(experts):
            which = np.flatnonzero(experts == e)
            slots = table.candidates[e, :table.logcnt[e]]
            counts = water_fill(load[table.gpu_of_slot[slots]], which.size)
            chosen[rest_t[which], rest_j[which]] = np.repeat(slots, counts)
            np.add.at(load, table.gpu_of_slot[slots], counts)
        open_[t_act, j_act] = False
    return chosen


def water_fill(levels: np.ndarray, amount: int) -> np.ndarray:
    """int64 `[n]`: `amount` units added one at a time to the lowest level (ties: the first index).

    levels: int `[n]` current loads. The result is what that greedy gives, in closed form.
    """
    levels = np.asarray(levels, dtype=np.int64)
    add = np.zeros(levels.size, dtype=np.int64)
    if amount <= 0 or levels.size == 0:
        return add
    low, high = int(levels.min()), int(levels.min()) + amount  # the final water level lies in [low, high]
    while low < high:  # largest level L with sum(max(0, L - levels)) <= amount
        mid = (low + high + 1) // 2
        if np.maximum(0, mid - levels).sum() <= amount:
            low = mid
        else:
            high = mid - 1
    add = np.maximum(0, low - levels)
    left = amount - int(add.sum())
    at_level = np.flatnonzero(levels + add == low)
    add[at_level[:left]] += 1
    return add


# ---------------------------------------------------------------------- traffic
