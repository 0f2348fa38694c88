"""The `time` objective: plans for the predicted MoE layer time (dispatch + compute + combine).

At multi-node EP the dispatch/combine of DeepEP-style kernels sends a token over RDMA once per
remote node holding one of its experts (`moe_place.cost.comm`), so experts that tokens pick
together belong on one node. Grouping alone puts correlated hot experts together (docs/MODEL.md,
"co-activation and cross-node traffic"), so the plan is made for the layer time itself, and
how hard to group is chosen on held-out windows of the training trace.

Per layer (tokens of the training steps, homes as `CommModel.token_home` says):
1. Node split, equal numbers of experts per node (`E/N`, the first `E % N` nodes one more).
   Default (`communities`, `community_nodes`): the co-activation graph of the training tokens
   (networkx) is split into Louvain communities, which fill the nodes heaviest first, each
   expert to the node holding most of its community among those with room. The other start,
   `balanced` (`balanced_nodes`), ignores co-activation: heaviest expert first to the lightest
   node. On the Qwen3 trace (bench/bench_comm.py, 48 layers) the communities start gave the
   lower predicted time in and out of sample on 10 of 12 case/sample pairs and was never
   slower than `fast` on a held-out batch; the balanced start was, by 0.3-0.5%, on two.
2. Grouping (`NodeSearch`): swaps of two experts between nodes, best first, each lowering a
   surrogate of the layer time on the training tokens: per step, the busiest NIC's RDMA rows
   (sent, or received: the DeepEP rule of `moe_place.cost.comm`) over the NIC bandwidth, for
   dispatch and combine, plus the compute time of a GPU holding the busiest node's rows spread
   over its GPUs, plus `MEAN_WEIGHT` x the mean NIC's term (swaps away from the busiest NIC
   still count). Candidates are ranked by the first-order change of that surrogate
   (`NodeSearch.move_gains`: each visit of a token to a remote node priced by a softmax over the
   NICs' loads) and the first that lowers the exact surrogate is taken. The *strength* of
   grouping is the number of swaps taken (0 = the start of step 1). The surrogate follows DeepEP's
   rule; with `all-to-all` dispatch the held-out windows of step 5 judge with that model.
3. Replica nodes (`replica_nodes`, OR-Tools CP-SAT). Spare slots (`P/N` minus the node's
   experts) take replicas. With a dispatcher that prefers a replica on the token's own node
   (`sglang-static`, `node-aware`) a replica of `e` on node `n` serves the tokens homed on `n`,
   so CP-SAT chooses, for every node, which other nodes' experts get a replica there: the
   traffic it saves (tokens for which `e` was the only reason to visit `e`'s node, priced like
   step 2) against the compute of the busiest node (`max(floor, rows * F/C)`), with at most the
   node's spare slots. Deterministic time, one worker, fixed seed, the node-closed plan as hint.
   With `vllm` or `sglang-dynamic` (replica chosen without regard to the token's node) a remote
   replica only adds traffic: replicas stay on their expert's node.
4. GPUs inside each node: `quick_plan` (replica counts and GPUs, vectorised over the nodes and
   strengths) on the rows each expert serves on that node.
5. Strength by cross-validation: the training steps form `W <= MAX_WINDOWS` windows of
   consecutive steps (one step: its two halves); for each window, steps 1-4 on the others at
   every strength in `STRENGTHS`, judged by `layer_cost` on the held-out window, beside the
   balance-only plan (`quick_plan` on the same training loads, `fast`'s anytime start). One
   strength for all layers: the one with the least held-out time summed over windows and
   layers. A layer is grouped only if at that strength no held-out window found it slower than
   its balance-only plan, and only if over all layers grouping beats the balance-only plans by
   more than `MIN_CV_GAIN` (a margin for the noise of two or three windows); the other layers
   keep the balance-only plan (`fast` on all the training loads): no layer is returned whose
   held-out predicted time is worse than the balance-only plan's. Grouped layers: steps 1-4 on
   all training steps at the chosen strength.

Lower bound (`layer_lower_bound_s`, reported per layer on the training tokens): busiest-GPU
compute is at least the mean GPU's rows (`F/C`) and at least `ceil(experts used / G)` expert
weight reads (`W/B`) per step; with one slot per expert (`P = E`) and DeepEP dispatch, some
node holds each expert, so the NIC of local rank `r` on that node receives at least the tokens
of rank `r` on other nodes that use it: per step, the largest over experts of the smallest over
nodes of that count is a bound on the busiest NIC's rows, for dispatch and for combine.

Determinism: no randomness and no wall-clock decisions; a time limit is a safety stop only
(`notes` say when it cut a phase: the layers not reached keep the balance-only plan).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import networkx as nx
import numpy as np

from moe_place.analysis.coactivation import coactivation
from moe_place.cost.comm import CommModel, SlotTable, layer_cost, token_homes
from moe_place.errors import InputError
from moe_place.placement import Placement
from moe_place.problem import PlacementProblem
from moe_place.progress import ProgressBar
from moe_place.solvers import solve
from moe_place.solvers.base import require_ortools, stoppable_solve
from moe_place.solvers.quick import quick_plan

STRENGTHS = (0, 2, 4, 8, 16, 32, 64)  # node swaps away from the start (step 2)
MAX_WINDOWS = 3                       # cross-validation windows (folds) at most
SEARCH_CANDIDATES = 32                # swaps tried per round, best first-order change first
SWAPS_PER_ROUND = 4                   # swaps taken per round before the ranking is recomputed
MEAN_WEIGHT = 1.0                     # weight of the mean NIC's term in the search surrogate
PRICE_TEMPERATURE = 0.02              # softmax temperature of the NIC prices, relative to the busiest NIC
MIN_CV_GAIN = 0.01                    # group only if held-out time beats the balance-only plans' by this share
COMMUNITY_NEIGHBOURS = 16            # co-activation graph: each expert joined to its 16 most frequent partners
REPLICA_DET_S = 0.2                   # CP-SAT deterministic seconds for the replica nodes of one layer
REPLICA_CANDIDATES = 4                # candidate experts per spare slot offered to CP-SAT
HOME_FIRST = ("sglang-static", "node-aware")  # dispatchers that prefer a replica on the token's node


# ---------------------------------------------------------------------- data
@dataclass(frozen=True)
class LayerTokens:
    """The training tokens of one layer, every step together.

    ids: int64 `[T, k]` expert ids; step: int64 `[T]` step of each token; home: int64 `[T]` home GPU.
    loads: float64 `[steps, E]` dispatches per expert and step.
    """

    ids: np.ndarray
    step: np.ndarray
    home: np.ndarray
    loads: np.ndarray

    @classmethod
    def from_steps(cls, steps: list[np.ndarray], num_experts: int, num_gpus: int, token_home: str) -> "LayerTokens":
        """From one int `[tokens, k]` array per step (homes are per step, as in `layer_cost`)."""
        ids = np.concatenate([np.asarray(s, dtype=np.int64) for s in steps])
        step = np.concatenate([np.full(s.shape[0], i, dtype=np.int64) for i, s in enumerate(steps)])
        home = np.concatenate([token_homes(s.shape[0], num_gpus, token_home) for s in steps])
        loads = np.stack([np.bincount(np.asarray(s).ravel(), minlength=num_experts) for s in steps])
        return cls(ids, step, home, loads.astype(np.float64))

    @property
    def num_steps(self) -> int:
        return self.loads.shape[0]


def community_nodes(tokens: LayerTokens, num_nodes: int, neighbours: int = COMMUNITY_NEIGHBOURS,
                    seed: int = 0) -> np.ndarray:
    """int64 `[E]`: node of each expert, co-activated experts together as far as balance allows (step 1).

    The co-activation graph of the tokens (networkx; each expert joined to the `neighbours` experts
    it is picked with most often, weight = tokens picking both) is split into communities (Louvain,
    seeded); communities, heaviest first, fill the nodes: each expert, heaviest first, goes to the
    node holding most of its community among the nodes with room (ties: the lightest). Node `n`
    takes `E // N` experts, one more when `n < E % N`.
    """
    loads = tokens.loads.sum(axis=0)
    experts = loads.size
    pairs = coactivation(tokens.ids[:, None, :], experts)[0].astype(np.float64)
    np.fill_diagonal(pairs, 0.0)
    near = np.argsort(-pairs, axis=1, kind="stable")[:, :neighbours]
    graph = nx.Graph()
    graph.add_nodes_from(range(experts))
    graph.add_weighted_edges_from((a, int(b), float(pairs[a, b])) for a in range(experts) for b in near[a]
                                  if pairs[a, b] > 0)
    found = nx.community.louvain_communities(graph, weight="weight", seed=seed)
    communities = sorted((sorted(c) for c in found), key=lambda c: (-loads[c].sum(), c[0]))
    room = np.full(num_nodes, experts // num_nodes) + (np.arange(num_nodes) < experts % num_nodes)
    node_load = np.zeros(num_nodes)
    node_of = np.full(experts, -1, dtype=np.int64)
    for members in communities:
        for e in sorted(members, key=lambda x: (-loads[x], x)):
            held = np.bincount(node_of[members][node_of[members] >= 0], minlength=num_nodes)
            score = np.where(room > 0, held * (loads.sum() + 1.0) - node_load, -np.inf)
            n = int(np.argmax(score))
            node_of[e], room[n] = n, room[n] - 1
            node_load[n] += loads[e]
    return node_of


def balanced_nodes(loads: np.ndarray, num_nodes: int) -> np.ndarray:
    """int64 `[E]`: node of each expert, heaviest first to the lightest node with room (step 1).

    Node `n` takes `E // N` experts, one more when `n < E % N`. loads: float `[E]`.
    """
    loads = np.asarray(loads, dtype=np.float64)
    experts = loads.size
    room = np.full(num_nodes, experts // num_nodes) + (np.arange(num_nodes) < experts % num_nodes)
    node_load = np.zeros(num_nodes)
    node_of = np.empty(experts, dtype=np.int64)
    for e in np.argsort(-loads, kind="stable"):
        n = int(np.argmin(np.where(room > 0, node_load, np.inf)))
        node_of[e], room[n] = n, room[n] - 1
        node_load[n] += loads[e]
    return node_of


# ---------------------------------------------------------------------- step 2: grouping
class NodeSearch:
    """A node assignment of experts and its surrogate layer time on training tokens (step 2).

    State: `node_of [E]`; `count [T, N]`: how many of each token's experts each node holds;
    `visits [steps * G, N]`: tokens of each (step, home GPU) that visit each node;
    `node_load [steps, N]`: rows each node computes per step.
    """

    def __init__(self, tokens: LayerTokens, node_of: np.ndarray, num_gpus: int, num_nodes: int,
                 slots_per_gpu: int, model: CommModel):
        self.tokens, self.model = tokens, model
        self.num_gpus, self.num_nodes, self.slots_per_gpu = num_gpus, num_nodes, slots_per_gpu
        self.gpn = num_gpus // num_nodes
        experts = tokens.loads.shape[1]
        count_t, k = tokens.ids.shape
        self._flat_tokens = np.repeat(np.arange(count_t), k)
        order = np.argsort(tokens.ids.ravel(), kind="stable")
        bounds = np.cumsum(np.bincount(tokens.ids.ravel(), minlength=experts))[:-1]
        self._by_expert = self._flat_tokens[order]                             # tokens, expert after expert
        self._expert_starts = np.concatenate(([0], bounds))
        self._used = np.bincount(tokens.ids.ravel(), minlength=experts) > 0
        self.tokens_of = np.split(self._by_expert, bounds)                     # tokens of each expert
        self.group = tokens.step * num_gpus + tokens.home                      # (step, home GPU) of each token
        self.remote = np.arange(num_nodes)[None, :] != (tokens.home // self.gpn)[:, None]   # [T, N]
        self.seconds_per_row = _nic_seconds_per_row(model)
        self._mark = np.zeros(count_t, dtype=bool)
        self.reset(node_of)

    def reset(self, node_of: np.ndarray) -> None:
        """Start from another node assignment `[E]` (same tokens)."""
        self.node_of = np.asarray(node_of, dtype=np.int64).copy()
        tokens = self.tokens
        self.count = np.zeros((tokens.ids.shape[0], self.num_nodes), dtype=np.int64)
        np.add.at(self.count, (self._flat_tokens, self.node_of[tokens.ids].ravel()), 1)
        self.visits = np.zeros((tokens.num_steps * self.num_gpus, self.num_nodes))
        np.add.at(self.visits, self.group, (self.count > 0).astype(np.float64))
        self.node_load = np.stack([tokens.loads[:, self.node_of == n].sum(axis=1) for n in range(self.num_nodes)],
                                  axis=1)

    # ------------------------------------------------------------------ surrogate
    def nic_rows(self, visits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(sent, received) RDMA rows per step and GPU NIC, float64 `[steps, G]` each."""
        steps, n, gpn = self.tokens.num_steps, self.num_nodes, self.gpn
        v = np.where(~np.eye(n, dtype=bool)[None, :, None, :], visits.reshape(steps, n, gpn, n), 0.0)
        sent = v.sum(axis=3).reshape(steps, -1)                    # [step, home node * gpn + rank]
        received = v.sum(axis=1).transpose(0, 2, 1).reshape(steps, -1)   # [step, node * gpn + rank]
        return sent, received

    def compute_s(self, node_load: np.ndarray) -> np.ndarray:
        """float64 `[steps]`: expert time of a GPU holding the busiest node's rows spread over its GPUs."""
        per_slot = node_load.max(axis=1) / (self.gpn * self.slots_per_gpu)
        return self.model.compute_times_s(np.repeat(per_slot[:, None], self.slots_per_gpu, axis=1), 1)[:, 0]

    def value(self, visits: np.ndarray | None = None, node_load: np.ndarray | None = None) -> float:
        """The surrogate of the module docstring (step 2), seconds summed over steps."""
        visits = self.visits if visits is None else visits
        node_load = self.node_load if node_load is None else node_load
        sent, received = self.nic_rows(visits)
        busiest = np.maximum(sent.max(axis=1), received.max(axis=1))
        comm = (busiest + MEAN_WEIGHT * sent.mean(axis=1)) * self.seconds_per_row
        return float(comm.sum() + self.compute_s(node_load).sum())

    def visit_prices(self) -> np.ndarray:
        """float64 `[T, N]`: first-order cost (in rows) of one more visit of token t to node n: its row
        on the home GPU's send and on the node's receiving NIC, each NIC priced by a softmax over its
        step's NIC loads (the busiest cost most) plus the mean term; 0 for the home node."""
        sent, received = self.nic_rows(self.visits)
        loads = np.concatenate([sent, received], axis=1)                       # [steps, 2G]
        top = loads.max(axis=1, keepdims=True)
        soft = np.exp((loads - top) / np.maximum(top * PRICE_TEMPERATURE, 1e-9))
        soft /= soft.sum(axis=1, keepdims=True)
        gpus = self.num_gpus
        price_send = soft[:, :gpus] + MEAN_WEIGHT / gpus                       # [steps, G]
        price_recv = soft[:, gpus:].reshape(-1, self.num_nodes, self.gpn)      # [steps, node, rank]
        step, home = self.tokens.step, self.tokens.home
        cost = price_send[step, home][:, None] + price_recv[step, :, home % self.gpn]
        return np.where(self.remote, cost, 0.0)

    def per_expert(self, values: np.ndarray) -> np.ndarray:
        """float64 `[E, N]`: `values [T, N]` summed over the tokens of each expert."""
        out = np.zeros((self.node_of.size, values.shape[1]))
        if self._by_expert.size:
            sums = np.add.reduceat(values[self._by_expert], np.minimum(self._expert_starts, self._by_expert.size - 1))
            out[self._used] = sums[self._used]
        return out

    def move_gains(self) -> np.ndarray:
        """float64 `[E, N]`: first-order change of the NIC terms if expert e alone moved to node n."""
        price = self.visit_prices()
        both = self.per_expert(np.concatenate([np.where(self.count == 0, price, 0.0),
                                               np.where(self.count == 1, price, 0.0)], axis=1))
        add = both[:, :self.num_nodes]
        lose = both[:, self.num_nodes:][np.arange(self.node_of.size), self.node_of]
        gains = add - lose[:, None]
        gains[np.arange(self.node_of.size), self.node_of] = 0.0
        return gains

    # ------------------------------------------------------------------ swaps
    def _swap_delta(self, e: int, f: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, change of their count on e's node (f's node: the opposite), visit change on e's
        node, on f's node) if e and f swapped nodes; tokens holding both do not change."""
        a, b = self.node_of[e], self.node_of[f]
        te, tf = self.tokens_of[e], self.tokens_of[f]
        self._mark[tf] = True
        only_e = te[~self._mark[te]]
        self._mark[tf] = False
        self._mark[te] = True
        only_f = tf[~self._mark[tf]]
        self._mark[te] = False
        toks = np.concatenate([only_e, only_f])
        change = np.concatenate([-np.ones(only_e.size, dtype=np.int64), np.ones(only_f.size, dtype=np.int64)])
        old_a, old_b = self.count[toks, a], self.count[toks, b]
        dv_a = (old_a + change > 0).astype(np.float64) - (old_a > 0)
        dv_b = (old_b - change > 0).astype(np.float64) - (old_b > 0)
        return toks, change, dv_a, dv_b

    def _after_swap(self, e: int, f: int, toks, dv_a, dv_b) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.node_of[e], self.node_of[f]
        visits = self.visits.copy()
        groups = self.group[toks]
        np.add.at(visits[:, a], groups, dv_a)
        np.add.at(visits[:, b], groups, dv_b)
        shift = self.tokens.loads[:, f] - self.tokens.loads[:, e]
        node_load = self.node_load.copy()
        node_load[:, a] += shift
        node_load[:, b] -= shift
        return visits, node_load

    def swap_value(self, e: int, f: int) -> float:
        """The surrogate if experts e and f (on different nodes) swapped nodes."""
        toks, _, dv_a, dv_b = self._swap_delta(e, f)
        return self.value(*self._after_swap(e, f, toks, dv_a, dv_b))

    def apply_swap(self, e: int, f: int) -> None:
        a, b = self.node_of[e], self.node_of[f]
        toks, change, dv_a, dv_b = self._swap_delta(e, f)
        self.visits, self.node_load = self._after_swap(e, f, toks, dv_a, dv_b)
        self.count[toks, a] += change
        self.count[toks, b] -= change
        self.node_of[e], self.node_of[f] = b, a

    def search(self, max_swaps: int, snapshots: tuple[int, ...] = ()) -> dict[int, np.ndarray]:
        """Swaps while the surrogate falls, at most `max_swaps` (step 2); {swaps: node_of} for every
        count in `snapshots` (a search that stops early gives its last state for the larger ones)."""
        out = {0: self.node_of.copy()}
        current = self.value()
        experts = self.node_of.size
        upper = np.triu_indices(experts, 1)
        swaps = 0
        while swaps < max_swaps:
            gains = self.move_gains()
            pair = gains[np.arange(experts)[:, None], self.node_of[None, :]] + \
                gains[np.arange(experts)[None, :], self.node_of[:, None]]          # e to f's node, f to e's
            pair[self.node_of[:, None] == self.node_of[None, :]] = np.inf
            scores = pair[upper]
            top = np.argpartition(scores, min(SEARCH_CANDIDATES, scores.size) - 1)[:SEARCH_CANDIDATES]
            moved: set[int] = set()
            taken = 0
            for index in top[np.lexsort((top, scores[top]))]:  # best first, ties by pair index
                e, f = int(upper[0][index]), int(upper[1][index])
                if not np.isfinite(scores[index]) or swaps >= max_swaps or taken >= SWAPS_PER_ROUND:
                    break
                if e in moved or f in moved or self.node_of[e] == self.node_of[f]:
                    continue  # the ranking is stale for experts already moved this round
                value = self.swap_value(e, f)
                if value < current * (1 - 1e-12):
                    self.apply_swap(e, f)
                    current, swaps, taken = value, swaps + 1, taken + 1
                    moved |= {e, f}
                    out[swaps] = self.node_of.copy()
            if not taken:
                break
        return {s: out[min(s, swaps)] for s in sorted(set(snapshots) | {0})}


def _nic_seconds_per_row(model: CommModel) -> float:
    """Seconds one dispatched row and its combined row take on the slowest NIC port (0 without NICs)."""
    ports = [d["capacity"] for _, _, d in model.topology.graph.edges(data=True) if d["kind"] == "nic"]
    if not ports:
        return 0.0
    return (model.dispatch_row_bytes + model.combine_row_bytes) / min(ports)


# ---------------------------------------------------------------------- step 3: replica nodes
@dataclass(frozen=True)
class ReplicaNodes:
    """Where replicas go beyond each expert's own node (step 3).

    present: bool `[E, N]`, expert e has at least one slot on node n (its own node always).
    served: float64 `[E, N]`, training rows each node is expected to serve for each expert.
    status: the CP-SAT status name, or "node-closed" when no remote replica was considered.
    """

    present: np.ndarray
    served: np.ndarray
    status: str = "node-closed"


def local_demand(tokens: LayerTokens, num_experts: int, num_nodes: int, gpus_per_node: int) -> np.ndarray:
    """float64 `[E, N]`: dispatches to each expert from the tokens homed on each node."""
    home_node = np.repeat(tokens.home // gpus_per_node, tokens.ids.shape[1])
    flat = tokens.ids.ravel() * num_nodes + home_node
    return np.bincount(flat, minlength=num_experts * num_nodes).reshape(num_experts, num_nodes).astype(np.float64)


def replica_nodes(search: NodeSearch, num_physical: int, seed: int = 0, det_time_s: float = REPLICA_DET_S,
                  exact: bool = True) -> ReplicaNodes:
    """Step 3 for the state of `search` (its node assignment and token counts).

    exact: CP-SAT (the final plan); False: the same choice made greedily, slot by slot (cross-
    validation, where thousands of these are made).
    """
    tokens, model = search.tokens, search.model
    experts, nodes, gpn = search.node_of.size, search.num_nodes, search.gpn
    demand = local_demand(tokens, experts, nodes, gpn)                     # [E, N]
    own = np.zeros((experts, nodes), dtype=bool)
    own[np.arange(experts), search.node_of] = True
    spare = num_physical // nodes - own.sum(axis=0)
    if model.replica_choice not in HOME_FIRST or spare.max() <= 0 or nodes == 1:
        return ReplicaNodes(own, np.where(own, demand.sum(axis=1, keepdims=True), 0.0))
    # saving[e, n]: priced visits to e's node by tokens homed on n for which e is the only reason
    price = search.visit_prices() * search.seconds_per_row                  # seconds per visit
    only = search.count[np.repeat(np.arange(tokens.ids.shape[0]), tokens.ids.shape[1]),
                        search.node_of[tokens.ids].ravel()] == 1
    rows = np.repeat(np.arange(tokens.ids.shape[0]), tokens.ids.shape[1])[only]
    experts_hit = tokens.ids.ravel()[only]
    home_node = tokens.home[rows] // gpn
    saving = np.zeros((experts, nodes))
    np.add.at(saving, (experts_hit, home_node), price[rows, search.node_of[experts_hit]])
    saving[own] = 0.0
    if exact:
        present, status = _replica_cpsat(search, demand, saving, spare, seed, det_time_s)
    else:
        present, status = _replica_greedy(search, demand, saving, spare), "greedy"
    present |= own
    served = np.where(present & ~own, demand, 0.0)
    served[np.arange(experts), search.node_of] = demand.sum(axis=1) - served.sum(axis=1)
    return ReplicaNodes(present, served, status)


def _compute_rows_seconds(search: NodeSearch) -> tuple[float, float]:
    """(seconds per row on the busiest GPU, the per-step weight-read floor in seconds) of the model."""
    slots = search.slots_per_gpu
    one_row = search.model.compute_times_s(np.full((1, slots), 1e6 / slots), 1)[0, 0] / 1e6
    floor = search.model.compute_times_s(np.full((1, slots), 1e-9), 1)[0, 0]
    return float(one_row), float(floor)


def _node_loads(search: NodeSearch, demand: np.ndarray, present: np.ndarray) -> np.ndarray:
    """float64 `[N]`: training rows per node when remote replicas in `present` serve their node's demand."""
    own = np.zeros_like(present)
    own[np.arange(present.shape[0]), search.node_of] = True
    remote = present & ~own
    moved = np.where(remote, demand, 0.0)
    load = moved.sum(axis=0)
    np.add.at(load, search.node_of, demand.sum(axis=1) - moved.sum(axis=1))
    return load


def _replica_greedy(search: NodeSearch, demand: np.ndarray, saving: np.ndarray, spare: np.ndarray) -> np.ndarray:
    """bool `[E, N]` remote replicas: each spare slot to the largest saving still positive after the
    compute change it causes (a slot at a time, nodes in turn)."""
    per_row, floor = _compute_rows_seconds(search)
    steps = search.tokens.num_steps
    present = np.zeros_like(saving, dtype=bool)
    left = spare.copy()
    gpn = search.gpn

    def compute(load: np.ndarray) -> float:
        return max(steps * floor, load.max() / gpn * per_row)

    base = compute(_node_loads(search, demand, present))
    while left.max() > 0:
        gain = np.where(present | (left[None, :] <= 0), -np.inf, saving)
        e, n = np.unravel_index(int(np.argmax(gain)), gain.shape)
        if not gain[e, n] > 0:
            break
        present[e, n] = True
        value = compute(_node_loads(search, demand, present))
        if saving[e, n] <= value - base:
            present[e, n] = False
            saving = saving.copy()
            saving[e, n] = 0.0
            continue
        base, left[n] = value, left[n] - 1
    return present


def _replica_cpsat(search: NodeSearch, demand: np.ndarray, saving: np.ndarray, spare: np.ndarray, seed: int,
                   det_time_s: float) -> tuple[np.ndarray, str]:
    """bool `[E, N]` remote replicas chosen by CP-SAT (module docstring, step 3), and the status name."""
    experts, nodes = saving.shape
    per_row, floor = _compute_rows_seconds(search)
    steps, gpn = search.tokens.num_steps, search.gpn
    unit = 1e-12  # objective in picoseconds
    present = np.zeros((experts, nodes), dtype=bool)
    cand = []  # per node, the REPLICA_CANDIDATES * spare experts that save most
    for n in range(nodes):
        order = np.argsort(-saving[:, n], kind="stable")[:REPLICA_CANDIDATES * max(int(spare[n]), 0)]
        cand += [(int(e), n) for e in order if saving[e, n] > 0]
    if not cand:
        return present, "no candidate"
    base_load = _node_loads(search, demand, present)
    row_unit = max(1.0, demand.sum() / 1e6)          # rows per model unit: loads stay below ~1e6 units
    top = int(demand.sum() / row_unit) + 1
    require_ortools("plan --objective time (the replica-node model)")
    from ortools.sat.python import cp_model  # OR-Tools is optional: see solvers.base

    model = cp_model.CpModel()
    x = {c: model.NewBoolVar(f"replica_e{c[0]}_n{c[1]}") for c in cand}     # a replica of e on node n
    for n in range(nodes):  # at most the node's spare slots
        model.Add(sum(v for (e, m), v in x.items() if m == n) <= int(spare[n]))
    loads = []
    for n in range(nodes):
        # rows node n serves: its own experts' demand, less what their replicas elsewhere serve, plus its replicas'
        gives = [int(round(demand[e, m] / row_unit)) * v for (e, m), v in x.items() if search.node_of[e] == n]
        takes = [int(round(demand[e, m] / row_unit)) * v for (e, m), v in x.items() if m == n]
        load = model.NewIntVar(0, top, f"rows_node{n}")
        model.Add(load == int(round(base_load[n] / row_unit)) - sum(gives) + sum(takes))
        loads.append(load)
    busiest = model.NewIntVar(0, top, "busiest_node_rows")
    model.AddMaxEquality(busiest, loads)
    # busiest GPU's compute over the training steps: max(steps * floor, busiest node rows / GPUs per node * F/C)
    compute = model.NewIntVar(0, 1 << 60, "compute_ps")
    model.Add(compute >= int(round(steps * floor / unit)))
    model.Add(compute >= int(round(row_unit * per_row / gpn / unit)) * busiest)
    model.Minimize(compute - sum(int(round(saving[e, n] / unit)) * v for (e, n), v in x.items()))
    for v in x.values():
        model.AddHint(v, 0)  # the node-closed plan
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = int(seed)
    solver.parameters.max_deterministic_time = float(det_time_s)
    solver.parameters.max_time_in_seconds = 10.0 * det_time_s + 10.0  # a safety stop only
    status = stoppable_solve(solver, model)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        for (e, n), v in x.items():
            present[e, n] = bool(solver.Value(v))
    return present, solver.StatusName(status)


# ---------------------------------------------------------------------- step 4: GPUs inside nodes
def assemble(plans: list[ReplicaNodes], num_gpus: int, num_nodes: int, num_physical: int) -> list[np.ndarray]:
    """int64 `[P]` per plan: node n's slots `n*P/N ..` hold the experts present there, packed on its
    GPUs by `quick_plan` (replica counts and GPUs for the rows each serves there). Nodes with the same
    number of experts, over all plans, are planned in one vectorised call."""
    per_node, gpn = num_physical // num_nodes, num_gpus // num_nodes
    rows = [np.empty(num_physical, dtype=np.int64) for _ in plans]
    jobs: dict[int, list[tuple[int, int, np.ndarray]]] = {}
    for p, plan in enumerate(plans):
        for n in range(num_nodes):
            experts = np.flatnonzero(plan.present[:, n])
            jobs.setdefault(experts.size, []).append((p, n, experts))
    for size, items in sorted(jobs.items()):
        loads = np.stack([plans[p].served[experts, n] for p, n, experts in items]) + 1e-9  # idle experts take a slot
        local = quick_plan(loads, gpn, per_node)
        for (p, n, experts), slots in zip(items, local):
            rows[p][n * per_node:(n + 1) * per_node] = experts[slots]
    return rows


def node_closed_feasible(num_experts: int, num_gpus: int, num_nodes: int, num_physical: int) -> bool:
    """Every node can hold its `E // N` experts and fill its GPUs' slots without two replicas of one
    expert on one GPU (`S <= E // N`)."""
    return num_experts // num_nodes >= num_physical // num_gpus and num_nodes > 1


# ---------------------------------------------------------------------- bounds
def layer_lower_bound_s(steps: list[np.ndarray], model: CommModel, num_experts: int, num_gpus: int, num_nodes: int,
                        num_physical: int) -> float:
    """A lower bound on `layer_cost(...).layer_time_s` over every plan of one layer (module docstring).

    steps: one int `[tokens, k]` array per step.
    """
    gpn, slots = num_gpus // num_nodes, num_physical // num_gpus
    total = 0.0
    per_row_dispatch = per_row_combine = 0.0
    ports = [d["capacity"] for _, _, d in model.topology.graph.edges(data=True) if d["kind"] == "nic"]
    if ports and model.dispatch == "deepep" and num_physical == num_experts and num_nodes > 1:
        per_row_dispatch = model.dispatch_row_bytes / max(ports)
        per_row_combine = model.combine_row_bytes / max(ports)
    for ids in steps:
        ids = np.asarray(ids, dtype=np.int64)
        tokens = ids.shape[0]
        used = np.unique(ids).size
        # the GPU with the most rows: at least the mean, in at least one slot (FLOPs, padding, tiles: all grow)
        mean_rows = np.zeros((1, slots))
        mean_rows[0, 0] = tokens * ids.shape[1] / num_gpus
        # the GPU touching the most experts reads at least ceil(used / G) experts' weights
        weights_only = np.zeros((1, slots))
        weights_only[0, :min(-(-used // num_gpus), slots)] = 1e-9
        total += max(float(model.compute_times_s(mean_rows, 1)[0, 0]),
                     float(model.compute_times_s(weights_only, 1)[0, 0]))
        if per_row_dispatch:
            home = token_homes(tokens, num_gpus, model.token_home)
            rank, home_node = home % gpn, home // gpn
            # uses[e, node, rank]: tokens of that home node and rank using expert e
            uses = np.zeros((num_experts, num_nodes, gpn))
            np.add.at(uses, (ids, np.repeat(home_node[:, None], ids.shape[1], axis=1),
                             np.repeat(rank[:, None], ids.shape[1], axis=1)), 1.0)
            from_others = uses.sum(axis=1, keepdims=True) - uses                    # [E, node, rank]
            rows = float(from_others.max(axis=2).min(axis=1).max())
            total += rows * (per_row_dispatch + per_row_combine)
    return total


# ---------------------------------------------------------------------- the planner
@dataclass(frozen=True)
class TimeLayer:
    """One layer of a time plan.

    phy2log: int64 `[P]`. choice: "grouped" (steps 1-4 at the chosen strength) or "balance"
    (the balance-only plan: the guard of step 5, or no grouping possible). predicted_s: the
    predicted layer time on the training tokens; lower_bound_s: `layer_lower_bound_s`.
    held_out_s / balance_held_out_s: summed held-out time over the cross-validation windows at
    the chosen strength and of the balance-only plan (None without cross-validation).
    replica_status: step 3's status.
    """

    phy2log: np.ndarray
    choice: str
    predicted_s: float
    lower_bound_s: float
    held_out_s: float | None
    balance_held_out_s: float | None
    replica_status: str = "node-closed"


@dataclass(frozen=True)
class TimePlan:
    """A whole-model plan for the layer time.

    placement: the plan. layers: one TimeLayer per layer. strength: the chosen number of swaps
    (None when every layer kept the balance-only plan before any choice). cv: held-out time
    summed over windows and layers, per strength (`"balance"` for the balance-only plans).
    balance: the balance-only plan (`fast`), kept for reports. notes: lines about the time limit
    or a fallback. wall_s: seconds.
    """

    placement: Placement
    layers: tuple[TimeLayer, ...]
    strength: int | None
    cv: dict = field(default_factory=dict)
    balance: Placement | None = None
    notes: tuple[str, ...] = ()
    wall_s: float = 0.0


def cv_windows(steps: list[np.ndarray]) -> list[list[np.ndarray]]:
    """Windows of the training steps for cross-validation: `min(steps, MAX_WINDOWS)` runs of
    consecutive steps; a single step is split into its two halves. Each item is a list of
    int `[tokens, layers, k]` arrays."""
    if len(steps) == 1:
        half = steps[0].shape[0] // 2
        if half == 0:
            return []
        return [[steps[0][:half]], [steps[0][half:]]]
    count = min(len(steps), MAX_WINDOWS)
    bounds = np.linspace(0, len(steps), count + 1).round().astype(int)
    return [list(steps[bounds[i]:bounds[i + 1]]) for i in range(count)]


def plan_layer(tokens: LayerTokens, problem: PlacementProblem, model: CommModel, strengths: tuple[int, ...],
               exact: bool, start: str = "communities") -> dict[int, tuple[np.ndarray, str]]:
    """{strength: (phy2log `[P]`, replica status)}: steps 1-4 of one layer on `tokens` from the
    `communities` of the co-activation graph (`community_nodes`) or the `balanced` split."""
    if start == "communities":
        start = community_nodes(tokens, problem.num_nodes, seed=problem.seed)
    else:
        start = balanced_nodes(tokens.loads.sum(axis=0), problem.num_nodes)
    search = NodeSearch(tokens, start, problem.num_gpus, problem.num_nodes, problem.slots_per_gpu, model)
    snapshots = search.search(max(strengths), strengths)
    order = sorted(strengths, reverse=True)  # the search ends at the largest: no reset for it
    plans = []
    for strength in order:
        if not np.array_equal(search.node_of, snapshots[strength]):
            search.reset(snapshots[strength])
        plans.append(replica_nodes(search, problem.num_physical, problem.seed, exact=exact))
    rows = assemble(plans, problem.num_gpus, problem.num_nodes, problem.num_physical)
    return {strength: (row, plan.status) for strength, row, plan in zip(order, rows, plans)}


def plan_time(problem: PlacementProblem, steps: list[np.ndarray], model: CommModel,
              time_limit_s: float | None = None, progress: bool = False, strength: int | None = None,
              start: str = "communities") -> TimePlan:
    """Plan every layer of `problem` for the predicted layer time (module docstring).

    steps: the training trace, one int `[tokens, layers, k]` array per step (the problem's layers).
    model: the cost model (topology with the problem's GPUs and nodes).
    time_limit_s: wall-clock safety stop for the whole plan (None: none).
    strength: group every layer at this strength with no cross-validation and no guard (to measure
        what grouping does when nothing holds it back, e.g. in benchmarks); None: step 5.
    start: `communities` (`community_nodes`, the default) or `balanced` (`balanced_nodes`): step 1.
    """
    if start not in ("balanced", "communities"):
        raise InputError("start", "balanced or communities", start)
    began = time.monotonic()
    deadline = None if time_limit_s is None else began + time_limit_s
    model.check_placement(problem.num_gpus, problem.num_nodes, "topology")
    if problem.current is not None:
        raise InputError("--objective time", "no --current plan (migration-aware re-plans balance load only)")
    experts, layers = problem.num_experts, problem.num_layers
    steps = [np.asarray(s) for s in steps]
    if not steps or any(s.ndim != 3 or s.shape[1] != layers for s in steps):
        raise InputError("trace", f"token-level steps [tokens, {layers} layers, k] for --objective time")
    notes: list[str] = []
    full_loads = np.stack([sum(np.bincount(s[:, i, :].ravel(), minlength=experts) for s in steps)
                           for i in range(layers)]).astype(np.float64)
    balance = solve(PlacementProblem(full_loads, problem.num_gpus, problem.num_physical, problem.num_nodes,
                                     problem.num_groups, seed=problem.seed), "fast").placement
    balance_rows = balance.phy2log

    def finish(rows, layer_reports, strength, cv) -> TimePlan:
        return TimePlan(Placement(np.stack(rows), experts, problem.num_gpus, problem.num_nodes),
                        tuple(layer_reports), strength, cv, balance, tuple(notes), time.monotonic() - began)

    def train_cost(i: int, row: np.ndarray, on: list[np.ndarray]) -> float:
        table = SlotTable(row, problem.num_gpus, problem.num_nodes, experts)
        return layer_cost(model, [s[:, i, :] for s in on], table, i).layer_time_s

    def bound(i: int) -> float:
        return layer_lower_bound_s([s[:, i, :] for s in steps], model, experts, problem.num_gpus, problem.num_nodes,
                                   problem.num_physical)

    if not node_closed_feasible(experts, problem.num_gpus, problem.num_nodes, problem.num_physical):
        notes.append(f"no grouping: {problem.num_nodes} node(s) of {experts // problem.num_nodes} experts cannot fill "
                     f"{problem.slots_per_gpu} slots per GPU with distinct experts; returned the balance-only plan")
        reports = [TimeLayer(balance_rows[i], "balance", train_cost(i, balance_rows[i], steps), bound(i), None, None)
                   for i in range(layers)]
        return finish(list(balance_rows), reports, None, {})

    windows = cv_windows(steps) if strength is None else []
    bar = ProgressBar((len(windows) + 1) * layers, "plan time", "layer plans") if progress else None
    # held-out time per finished window: [windows, strengths, layers] and the balance-only plans' [windows, layers]
    held: list[np.ndarray] = []
    held_balance: list[np.ndarray] = []
    for w, validation in enumerate(windows):
        train = [s for v, window in enumerate(windows) if v != w for s in window]
        train_loads = np.stack([sum(np.bincount(s[:, i, :].ravel(), minlength=experts) for s in train)
                                for i in range(layers)]).astype(np.float64)
        fold_balance_rows = quick_plan(train_loads, problem.num_gpus, problem.num_physical)
        fold = np.zeros((len(STRENGTHS), layers))
        fold_balance = np.zeros(layers)
        for i in range(layers):
            if deadline is not None and time.monotonic() > deadline:
                break
            tokens = LayerTokens.from_steps([s[:, i, :] for s in train], experts, problem.num_gpus, model.token_home)
            for strength, (row, _) in plan_layer(tokens, problem, model, STRENGTHS, False, start).items():
                fold[STRENGTHS.index(strength), i] = train_cost(i, row, validation)
            fold_balance[i] = train_cost(i, fold_balance_rows[i], validation)
            if bar:
                bar.advance(1)
        else:
            held.append(fold)
            held_balance.append(fold_balance)
            continue
        notes.append(f"time limit {time_limit_s:g} s ran out during cross-validation window {w + 1} of "
                     f"{len(windows)}: the strength is chosen on the windows finished, and a rerun may differ")
        break
    if held:
        total = np.sum(held, axis=0)                                          # [strengths, layers]
        choice = min(range(len(STRENGTHS)), key=lambda j: (total[j].sum(), STRENGTHS[j]))
        strength = STRENGTHS[choice]
        cv = {str(s): float(total[j].sum()) for j, s in enumerate(STRENGTHS)}
        cv["balance"] = float(np.sum(held_balance))
        # a layer is grouped only if, at that strength, no held-out window found it slower than balance-only,
        # and only if grouping wins by more than the noise of a few windows over all layers
        wins = np.all([fold[choice] <= base for fold, base in zip(held, held_balance)], axis=0)
        if total[choice].sum() > (1 - MIN_CV_GAIN) * np.sum(held_balance):
            wins[:] = False
            notes.append(f"held-out time at the best strength ({strength}) is within {MIN_CV_GAIN:.0%} of the "
                         f"balance-only plans': returned the balance-only plan")
        held_chosen, held_base = total[choice], np.sum(held_balance, axis=0)
    else:
        cv, wins = {}, np.full(layers, strength is not None)
        held_chosen = held_base = None
        if windows:
            notes.append("no cross-validation window finished within the time limit: returned the balance-only plan")
    rows, reports = [], []
    stopped = False
    for i in range(layers):
        grouped = bool(wins[i])
        if grouped and not stopped and deadline is not None and time.monotonic() > deadline:
            stopped = True
            notes.append(f"time limit {time_limit_s:g} s ran out at layer {problem.layer_id(i)}: the layers from "
                         f"there keep the balance-only plan, and a rerun may differ")
        grouped = grouped and not stopped
        if grouped:
            tokens = LayerTokens.from_steps([s[:, i, :] for s in steps], experts, problem.num_gpus, model.token_home)
            row, status = plan_layer(tokens, problem, model, (strength,), True, start)[strength]
        else:
            row, status = balance_rows[i], "node-closed"
        rows.append(row)
        reports.append(TimeLayer(np.asarray(row), "grouped" if grouped else "balance", train_cost(i, row, steps),
                                 bound(i), None if held_chosen is None else float(held_chosen[i]),
                                 None if held_base is None else float(held_base[i]), status))
        if bar:
            bar.advance(1)
    if bar:
        bar.close()
    return finish(rows, reports, strength, cv)
