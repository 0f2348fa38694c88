"""The `time` objective: plans for the predicted MoE layer time (dispatch + compute + combine).

At multi-node EP the dispatch/combine of DeepEP-style kernels sends a token over RDMA once per
remote node holding one of its experts (`moe_place.cost.comm`), so experts that tokens pick
together belong on one node. Out of sample the two terms behave differently (docs/MODEL.md,
"Multi-node EP: the layer-time plan out of sample"): which experts fire together carries over
to other batches, which experts are hot does not. So co-activation decides the nodes, the
balance-only plan bounds the compute (the hedge), and held-out windows judge which layers to group.

Per layer (tokens of the training steps, homes as `CommModel.token_home` says):
1. Node split, equal numbers of experts per node (`E/N`, the first `E % N` nodes one more).
   Default (`communities`, `community_nodes`): the co-activation graph of the training tokens
   (networkx) is split into Louvain communities, which fill the nodes heaviest first, each
   expert to the node holding most of its community among those with room. The other start,
   `balanced` (`balanced_nodes`), ignores co-activation: heaviest expert first to the lightest
   node.
2. Node cap (`NodeSearch.within_cap`): on every training step no node may carry more rows than
   the balance-only plan's busiest node carries on that step (`balance_caps`, replicas splitting
   evenly; or `FLOOR_HEADROOM` of the rows at which its GPUs would leave the weight-read floor,
   if that is more): swaps of two experts between nodes, the one that lowers the rows over the
   cap most first (ties: the best first-order NIC change). Experts that fire together are hot
   together, so a node of one community can take a batch's new hot experts all at once: the cap
   keeps the grouped plan's nodes as loaded as the balance-only plan's, not more.
   Then, if `strength` > 0, grouping (`NodeSearch.search`): swaps of two experts between nodes,
   best first, each lowering a surrogate of the layer time on the training tokens without
   raising the rows over the cap: per step, the busiest NIC's RDMA rows (sent, or received: the
   DeepEP rule of `moe_place.cost.comm`) over the NIC bandwidth, for dispatch and combine, plus
   the compute time of a GPU holding the busiest node's rows spread over its GPUs, plus
   `MEAN_WEIGHT` x the mean NIC's term. Candidates are ranked by the first-order change of that
   surrogate (`NodeSearch.move_gains`: each visit of a token to a remote node priced by a
   softmax over the NICs' loads) and the first that lowers the exact surrogate is taken. The
   *strength* is the number of swaps taken. The time plan uses `GROUP_STRENGTH` = 0: the
   surrogate's busiest NIC and compute are those of the training batches, which is what does
   not carry over (bench/bench_comm.py: `grouped`, the largest strength, against `ungated`).
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
   strengths) on the rows each expert serves on that node, then `spread_within_nodes`: swaps of
   slots between the GPUs of a node, first while they lower the rows over the GPU cap (the
   balance-only plan's busiest GPU per training step, or `FLOOR_HEADROOM` of the floor), then
   while they lower the co-activation affinity (`LayerTokens.affinity`, cosine of the experts'
   token sets) of the experts sharing a GPU without going over it: the experts a new batch makes
   hot together land on different GPUs of their node.
5. The decision, over the layers (`expected_savings`, the default): the training steps form
   `W <= MAX_WINDOWS` windows of consecutive steps (one step: its two halves); for each window and
   layer, steps 1-4 on the other windows (greedy replicas), judged by `layer_cost` on the held-out
   window beside the balance-only plan of the same steps (`quick_plan`, `fast`'s anytime start).
   Each window measures two savings of the layer, as shares of the balance-only plan's layer time
   there: its dispatch + combine (`traffic_savings`) and its compute (`compute_savings`, the
   compute risk: a plan whose GPUs hold other experts than the balance-only plan's may lose there).
   A layer's own windows measure its expected saving with noise: a new batch's hot experts land
   where they land (on the bundled Qwen3 trace the windows' compute difference does not predict
   the held-out one, docs/MODEL.md). So each part is estimated from all the layers together: the
   layer's mean over its windows is shrunk toward the mean over the layers by the positive-part
   James-Stein factor (`shrunk_means`), `1 - (L - 3) * noise / spread`, where `noise` is the
   variance of a layer's window mean (the spread of each layer's windows around their mean, pooled
   over the layers) and `spread` the squared deviations of the layers' means from their mean: a
   part whose layers differ no more than their windows' noise is the same for every layer (its mean
   over the layers); one whose layers differ far more keeps each layer's own mean. Nothing in it is
   chosen: the data set both the mean and the factor. A layer is grouped where its expected saving
   (traffic plus compute) is positive; then steps 1-4 on all training steps. Otherwise it keeps the
   balance-only plan (`fast` on all the training loads). That minimises the expected whole-model
   layer time held out, for plans with these two rows per layer to choose from. With fewer than
   four layers each layer's own means decide (the factor needs four).
   The per-layer guard (`decision="guard"`, `guard`): a layer is grouped only if its dispatch +
   combine save more than `min_saving` of the balance-only plan's layer time on every window; it
   keeps each part of the model close to the balance-only plan and gives up most of the
   whole-model gain (docs/multinode.md). Each layer's rows depend on its own tokens only; under the
   default decision, whether a layer is grouped depends on the other planned layers' windows too.

Lower bound (`layer_lower_bound_s`, reported per layer on the training tokens): busiest-GPU
compute is at least the mean GPU's rows (`F/C`) and at least `ceil(experts used / G)` expert
weight reads (`W/B`) per step; with one slot per expert (`P = E`) and DeepEP dispatch, some
node holds each expert, so the NIC of local rank `r` on that node receives at least the tokens
of rank `r` on other nodes that use it: per step, the largest over experts of the smallest over
nodes of that count is a bound on the busiest NIC's rows, for dispatch and for combine.

Determinism: no randomness and no wall-clock decisions; a time limit is a safety stop only
(`notes` say when it cut the plan: the layers not reached keep the balance-only plan).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property

import networkx as nx
import numpy as np

from moe_place.analysis.coactivation import coactivation
from moe_place.analysis.windows import consecutive_runs
from moe_place.cost.comm import CommModel, SlotTable, layer_cost, token_homes
from moe_place.errors import InputError
from moe_place.placement import Placement
from moe_place.problem import PlacementProblem
from moe_place.progress import ProgressBar
from moe_place.solvers import solve
from moe_place.solvers.base import require_ortools, stoppable_solve
from moe_place.solvers.quick import quick_plan

STRENGTHS = (0, 2, 4, 8, 16, 32, 64)  # node swaps away from the start (step 2) that benchmarks and tests try
GROUP_STRENGTH = 0                    # swaps of step 2 in the time plan: none (module docstring, step 2)
MAX_WINDOWS = 3                       # cross-validation windows (folds) at most
SEARCH_CANDIDATES = 32                # swaps tried per round, best first-order change first
SWAPS_PER_ROUND = 4                   # swaps taken per round before the ranking is recomputed
MEAN_WEIGHT = 1.0                     # weight of the mean NIC's term in the search surrogate
PRICE_TEMPERATURE = 0.02              # softmax temperature of the NIC prices, relative to the busiest NIC
DECISIONS = ("expected", "guard")     # step 5: the expected saving over the layers (default), or the per-layer guard
JUDGES = ("comm", "layer")            # the guard judges dispatch + combine (the default) or the whole layer time
MIN_SAVING = 0.05                     # the guard's default bar: the saving, every window, as a share of the layer time
COMMUNITY_NEIGHBOURS = 16            # co-activation graph: each expert joined to its 16 most frequent partners
FLOOR_HEADROOM = 0.25                 # caps are at least a quarter of the rows at which FLOPs outlast weight reads
SPREAD_SWAPS = 4                      # step 4's swaps inside a node: at most this many per slot of the node
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

    @cached_property
    def pairs(self) -> np.ndarray:
        """float64 `[E, E]`: tokens picking both experts (`coactivation`; the diagonal is each expert's load)."""
        return coactivation(self.ids[:, None, :], self.loads.shape[1])[0].astype(np.float64)

    def affinity(self) -> np.ndarray:
        """float64 `[E, E]`: cosine similarity of the experts' token sets, `pairs[a, b] / sqrt(load_a * load_b)`
        (0 for an unused expert; 1 on the diagonal): how often two experts fire together whatever
        their volume, the part of the co-activation that carries over to other batches."""
        loads = self.loads.sum(axis=0)
        out = self.pairs / np.sqrt(np.maximum(loads[:, None] * loads[None, :], 1.0))
        np.fill_diagonal(out, 1.0)
        return out


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
    pairs = tokens.pairs.copy()
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
                 slots_per_gpu: int, model: CommModel, cap: np.ndarray | None = None):
        self.tokens, self.model = tokens, model
        self.cap = None if cap is None else np.asarray(cap, dtype=np.float64)   # [steps] node rows (`excess`)
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
        return self.swap_outcome(e, f)[0]

    def swap_outcome(self, e: int, f: int) -> tuple[float, float]:
        """(surrogate, `excess`) if experts e and f (on different nodes) swapped nodes."""
        toks, _, dv_a, dv_b = self._swap_delta(e, f)
        visits, node_load = self._after_swap(e, f, toks, dv_a, dv_b)
        return self.value(visits, node_load), self.excess(node_load)

    # ------------------------------------------------------------------ the node cap (compute hedge)
    def excess(self, node_load: np.ndarray | None = None) -> float:
        """Rows over the cap, summed over steps and nodes: `sum max(0, node_load[s, n] - cap[s])`
        (0 without a cap). node_load: `[steps, N]`, default the current one."""
        if self.cap is None:
            return 0.0
        node_load = self.node_load if node_load is None else node_load
        return float(np.maximum(node_load - self.cap[:, None], 0.0).sum())

    def within_cap(self, max_swaps: int = 4 * 128) -> int:
        """Swaps that lower `excess` until it is 0 (or no swap lowers it, or `max_swaps`); of the swaps
        that lower it most, the one that keeps most co-activation inside the nodes (tokens picking
        two experts of one node, `LayerTokens.pairs`). Returns the swaps taken. Every pair of experts
        on different nodes is scored at once on the node loads alone (`[steps, pairs]`)."""
        if self.cap is None:
            return 0
        loads = self.tokens.loads
        together = self.tokens.pairs.copy()
        np.fill_diagonal(together, 0.0)
        first, second = np.triu_indices(self.node_of.size, 1)
        taken = 0
        while taken < max_swaps:
            over = np.maximum(self.node_load - self.cap[:, None], 0.0)      # [steps, N]
            excess = over.sum()
            if excess <= 0:
                break
            a, b = self.node_of[first], self.node_of[second]
            apart = a != b
            e, f, a, b = first[apart], second[apart], a[apart], b[apart]
            shift = loads[:, f] - loads[:, e]                               # [steps, pairs]: rows node a gains
            cap = self.cap[:, None]
            left = (excess - over[:, a].sum(axis=0) - over[:, b].sum(axis=0)
                    + np.maximum(self.node_load[:, a] + shift - cap, 0.0).sum(axis=0)
                    + np.maximum(self.node_load[:, b] - shift - cap, 0.0).sum(axis=0))
            best = left.min()
            if not best < excess * (1 - 1e-9):
                break
            tied = np.flatnonzero(left <= best + 1e-9 * excess)
            inside = together @ (self.node_of[:, None] == np.arange(self.num_nodes)[None, :])   # [E, N]
            e, f, a, b = e[tied], f[tied], a[tied], b[tied]
            kept = inside[f, a] + inside[e, b] - inside[e, a] - inside[f, b] - 2 * together[e, f]
            pick = int(np.argmax(kept))
            self.apply_swap(int(e[pick]), int(f[pick]))
            taken += 1
        return taken

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
        current, over = self.value(), self.excess()
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
                value, excess = self.swap_outcome(e, f)
                if value < current * (1 - 1e-12) and excess <= over:   # never further over the cap
                    self.apply_swap(e, f)
                    current, over, swaps, taken = value, excess, swaps + 1, taken + 1
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
    """float64 `[steps, E, N]`: dispatches to each expert from the tokens homed on each node, per step."""
    k = tokens.ids.shape[1]
    home_node = np.repeat(tokens.home // gpus_per_node, k)
    flat = (np.repeat(tokens.step, k) * num_experts + tokens.ids.ravel()) * num_nodes + home_node
    size = tokens.num_steps * num_experts * num_nodes
    return np.bincount(flat, minlength=size).reshape(tokens.num_steps, num_experts, num_nodes).astype(np.float64)


def served_per_step(plan: "ReplicaNodes", node_of: np.ndarray, demand: np.ndarray) -> np.ndarray:
    """float64 `[steps, E, N]`: rows each node serves for each expert per step under `plan` (a remote
    replica serves its node's demand, the expert's own node the rest). demand: `local_demand`."""
    experts = node_of.size
    own = np.zeros_like(plan.present)
    own[np.arange(experts), node_of] = True
    served = np.where((plan.present & ~own)[None], demand, 0.0)
    served[:, np.arange(experts), node_of] = demand.sum(axis=2) - served.sum(axis=2)
    return served


def replica_nodes(search: NodeSearch, num_physical: int, seed: int = 0, det_time_s: float = REPLICA_DET_S,
                  exact: bool = True) -> ReplicaNodes:
    """Step 3 for the state of `search` (its node assignment and token counts).

    exact: CP-SAT (the final plan); False: the same choice made greedily, slot by slot (cross-
    validation, where thousands of these are made).
    """
    tokens, model = search.tokens, search.model
    experts, nodes, gpn = search.node_of.size, search.num_nodes, search.gpn
    demand = local_demand(tokens, experts, nodes, gpn).sum(axis=0)         # [E, N]
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


def _compute_rows_seconds(model: CommModel, slots: int) -> tuple[float, float]:
    """(seconds per row on the busiest GPU, the per-step weight-read floor in seconds) of the model,
    for a GPU of `slots` slots."""
    one_row = model.compute_times_s(np.full((1, slots), 1e6 / slots), 1)[0, 0] / 1e6
    floor = model.compute_times_s(np.full((1, slots), 1e-9), 1)[0, 0]
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
    per_row, floor = _compute_rows_seconds(search.model, search.slots_per_gpu)
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
    per_row, floor = _compute_rows_seconds(search.model, search.slots_per_gpu)
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


def spread_within_nodes(row: np.ndarray, served: np.ndarray, affinity: np.ndarray, gpu_cap: np.ndarray | None,
                        num_gpus: int, num_nodes: int) -> np.ndarray:
    """int64 `[P]`: `row` with slots swapped between the GPUs of each node (step 4, the compute hedge):
    first while that lowers the rows over `gpu_cap` (`[steps]`, summed over steps and GPUs), then
    while it lowers the `affinity` (`[E, E]`) of the experts sharing a GPU without raising that
    excess. Experts that fire together are hot together in other batches, so they go to different
    GPUs of their node. served: `served_per_step` `[steps, E, N]`, replicas of one expert on a node
    split its rows evenly. Each round, every node takes its best swap (all nodes at once, arrays
    `[N, ...]`); never two replicas of one expert on one GPU."""
    held = np.asarray(row, dtype=np.int64).reshape(num_nodes, -1).copy()   # [N, Q] expert of each slot
    per_node, gpn = held.shape[1], num_gpus // num_nodes
    experts = affinity.shape[0]
    gpu = np.arange(per_node) // (per_node // gpn)                       # GPU of each slot, inside its node
    on_gpu = (gpu[:, None] == np.arange(gpn)[None, :]).astype(np.float64)   # [Q, gpn]
    first, second = np.triu_indices(per_node, 1)
    apart = gpu[first] != gpu[second]
    first, second = first[apart], second[apart]                          # slot pairs on different GPUs
    g1, g2 = gpu[first], gpu[second]
    steps = served.shape[0]
    cap = (np.full(steps, np.inf) if gpu_cap is None else np.asarray(gpu_cap, dtype=np.float64))[None, :, None]
    node = np.arange(num_nodes)[:, None]
    count = np.zeros((num_nodes, experts))
    np.add.at(count, (node, held), 1.0)
    rows = served[:, held, node].transpose(1, 0, 2) / count[node, held][:, None, :]   # [N, steps, Q]
    for _ in range(SPREAD_SWAPS * per_node):
        load = rows @ on_gpu                                             # [N, steps, gpn]
        over = np.maximum(load - cap, 0.0)
        excess = over.sum(axis=(1, 2))                                   # [N]
        pair = affinity[held[:, :, None], held[:, None, :]]              # [N, Q, Q]
        near = pair @ on_gpu                                             # affinity of each slot to each GPU
        # affinity change if slots first and second swap GPUs (each leaves its GPU, joins the other's)
        change = (near[:, first, g2] - near[:, first, g1] + near[:, second, g1] - near[:, second, g2]
                  - 2 * pair[:, first, second] + pair[:, first, first] + pair[:, second, second])
        holds = np.zeros((num_nodes, gpn, experts), dtype=bool)
        holds[node, gpu[None, :], held] = True
        allowed = (held[:, first] != held[:, second]) & ~holds[node, g1[None, :], held[:, second]] \
            & ~holds[node, g2[None, :], held[:, first]]
        moved = rows[:, :, second] - rows[:, :, first]                   # [N, steps, pairs]: rows GPU g1 gains
        after = (excess[:, None] - over[:, :, g1].sum(axis=1) - over[:, :, g2].sum(axis=1)
                 + np.maximum(load[:, :, g1] + moved - cap, 0.0).sum(axis=1)
                 + np.maximum(load[:, :, g2] - moved - cap, 0.0).sum(axis=1))      # [N, pairs]
        repair = excess[:, None] > 0
        score = np.where(repair, after + 1e-9 * excess[:, None] * change,     # ties: the lower affinity
                         np.where(after <= 0, change, np.inf))
        better = allowed & np.where(repair, after < excess[:, None] * (1 - 1e-9), (after <= 0) & (change < -1e-9))
        moving = np.flatnonzero(better.any(axis=1))
        if not moving.size:
            break
        pick = np.argmin(np.where(better, score, np.inf)[moving], axis=1)
        a, b = first[pick], second[pick]
        held[moving, a], held[moving, b] = held[moving, b], held[moving, a].copy()
        rows[moving, :, a], rows[moving, :, b] = rows[moving, :, b], rows[moving, :, a].copy()
    return held.reshape(-1)


def balance_caps(loads: np.ndarray, phy2log: np.ndarray, num_gpus: int,
                 num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """(float64 `[steps]` busiest node rows, float64 `[steps]` busiest GPU rows) of the plan `phy2log [P]`
    (the balance-only plan) under each step's loads (`[steps, E]`), replicas splitting evenly: what
    the time plan's nodes and GPUs may carry on that step (the compute hedge of steps 2 and 4)."""
    row = np.asarray(phy2log, dtype=np.int64)
    count = np.bincount(row, minlength=loads.shape[1])
    share = loads[:, row] / count[row]                                   # [steps, P]
    steps = loads.shape[0]
    return (share.reshape(steps, num_nodes, -1).sum(axis=2).max(axis=1),
            share.reshape(steps, num_gpus, -1).sum(axis=2).max(axis=1))


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

    phy2log: int64 `[P]`. choice: "grouped" (steps 1-4) or "balance" (the balance-only plan: the
    decision of step 5 said no, the time limit came first, or no grouping is possible). predicted_s:
    the predicted layer time on the training tokens; lower_bound_s: `layer_lower_bound_s`.
    held_out_s / balance_held_out_s: layer time summed over the held-out windows of step 5, of the
    grouped plans and of the balance-only plans (None without cross-validation).
    windows / balance_windows: per held-out window, the grouped plan's and the balance-only plan's
    figures there (`HeldOut`, step 5's evidence; empty without cross-validation); `comm_gains`
    and `layer_gains` are the shares of the balance-only plan's dispatch + combine and layer time they
    saved, `traffic_savings` / `compute_savings` the dispatch + combine / compute saved as a share of
    its layer time (step 5). expected_saving: step 5's estimate over the layers (`expected_savings`),
    None without windows. replica_status: step 3's status.
    """

    phy2log: np.ndarray
    choice: str
    predicted_s: float
    lower_bound_s: float
    held_out_s: float | None
    balance_held_out_s: float | None
    replica_status: str = "node-closed"
    windows: tuple["HeldOut", ...] = ()
    balance_windows: tuple["HeldOut", ...] = ()
    expected_saving: float | None = None

    @property
    def comm_gains(self) -> tuple[float, ...]:
        return comm_gains(self.windows, self.balance_windows)

    @property
    def layer_gains(self) -> tuple[float, ...]:
        return layer_gains(self.windows, self.balance_windows)

    @property
    def traffic_savings(self) -> tuple[float, ...]:
        return traffic_savings(self.windows, self.balance_windows)

    @property
    def compute_savings(self) -> tuple[float, ...]:
        return compute_savings(self.windows, self.balance_windows)


@dataclass(frozen=True)
class TimePlan:
    """A whole-model plan for the layer time.

    placement: the plan. layers: one TimeLayer per layer. strength: the swaps of step 2 (None when
    no layer could be grouped). cv: held-out time summed over windows and layers, of the grouped
    plans (`"grouped"`) and of the balance-only plans (`"balance"`); empty without cross-validation.
    balance: the balance-only plan (`fast`), kept for reports. notes: lines about the time limit
    or a fallback. wall_s: seconds. decision: step 5's rule ("expected" or "guard"; None where nothing was
    decided on windows: no window, a fixed strength, or no grouping possible). min_saving: the guard's bar,
    None unless the guard decided. pooled: {"traffic", "compute"}: `Pooled`, the estimates over the layers
    (`expected_savings`; empty without windows).
    """

    placement: Placement
    layers: tuple[TimeLayer, ...]
    strength: int | None
    cv: dict = field(default_factory=dict)
    balance: Placement | None = None
    notes: tuple[str, ...] = ()
    wall_s: float = 0.0
    min_saving: float | None = None
    decision: str | None = None
    pooled: dict = field(default_factory=dict)


@dataclass(frozen=True)
class HeldOut:
    """One layer's plan on one held-out window (step 5): dispatch + combine and compute, seconds."""

    comm_s: float
    compute_s: float

    @classmethod
    def of(cls, cost) -> "HeldOut":
        """From a `LayerCost`."""
        return cls(cost.dispatch_s + cost.combine_s, cost.compute_s)

    @property
    def layer_time_s(self) -> float:
        return self.comm_s + self.compute_s


def traffic_savings(grouped: tuple[HeldOut, ...], balance: tuple[HeldOut, ...]) -> tuple[float, ...]:
    """Per window, the dispatch + combine time the grouped plan saves, as a share of the balance-only plan's
    layer time (what step 5 judges: the saving has to outweigh the chance in the compute, which is
    measured in layer time)."""
    return tuple((b.comm_s - g.comm_s) / b.layer_time_s if b.layer_time_s > 0 else 0.0
                 for g, b in zip(grouped, balance))


def comm_gains(grouped: tuple[HeldOut, ...], balance: tuple[HeldOut, ...]) -> tuple[float, ...]:
    """Per window, the share of the balance-only plan's dispatch + combine time the grouped plan saves
    (0 where the balance-only plan has none)."""
    return tuple(1.0 - g.comm_s / b.comm_s if b.comm_s > 0 else 0.0 for g, b in zip(grouped, balance))


def layer_gains(grouped: tuple[HeldOut, ...], balance: tuple[HeldOut, ...]) -> tuple[float, ...]:
    """Per window, the share of the balance-only plan's layer time the grouped plan saves."""
    return tuple(1.0 - g.layer_time_s / b.layer_time_s if b.layer_time_s > 0 else 0.0
                 for g, b in zip(grouped, balance))


def guard(grouped: tuple[HeldOut, ...], balance: tuple[HeldOut, ...], judge: str = "comm",
          min_saving: float = MIN_SAVING) -> bool:
    """The per-layer guard (step 5, `decision="guard"`): group one layer only if its grouped plan saves more
    than `min_saving` of the balance-only plan's layer time on every held-out window: by its dispatch + combine (`judge="comm"`, the
    default, `traffic_savings`; compute is hedged by steps 2 and 4, module docstring) or by the whole layer
    time (`judge="layer"`, `layer_gains`: what judging compute on the windows too does). No window: no
    grouping."""
    if judge not in JUDGES:
        raise InputError("judge", f"one of {', '.join(JUDGES)}", judge)
    gains = layer_gains(grouped, balance) if judge == "layer" else traffic_savings(grouped, balance)
    return bool(gains) and min(gains) > min_saving


def compute_savings(grouped: tuple[HeldOut, ...], balance: tuple[HeldOut, ...]) -> tuple[float, ...]:
    """Per window, the compute time the grouped plan saves (negative: loses), as a share of the balance-only
    plan's layer time (step 5: the compute risk)."""
    return tuple((b.compute_s - g.compute_s) / b.layer_time_s if b.layer_time_s > 0 else 0.0
                 for g, b in zip(grouped, balance))


@dataclass(frozen=True)
class Pooled:
    """One part of the expected saving, estimated over the layers (step 5, `shrunk_means`).

    mean: the mean over the layers of their window means (a share of the layer time). weight: the
    James-Stein factor in [0, 1], how much of a layer's own deviation from that mean is kept (0: every
    layer gets the mean; 1: each its own). noise: the variance of a layer's window mean (pooled over the
    layers). layers: how many layers were pooled.
    """

    mean: float
    weight: float
    noise: float
    layers: int

    def to_dict(self) -> dict:
        return {"mean": self.mean, "weight": self.weight, "noise": self.noise, "layers": self.layers}


def shrunk_means(values: np.ndarray) -> tuple[np.ndarray, Pooled]:
    """(float64 `[L]` estimates, Pooled): each layer's mean of `values` (float `[L, W]`: L layers, W >= 2
    windows each) shrunk toward the mean over the layers by the positive-part James-Stein factor
    `max(0, 1 - (L - 3) * noise / sum_l (mean_l - mean)^2)`, `noise` = the within-layer variance of
    the windows (ddof 1, averaged over the layers) over W. Fewer than four layers: the own means."""
    values = np.asarray(values, dtype=np.float64)
    layers, windows = values.shape
    own = values.mean(axis=1)
    noise = float(values.var(axis=1, ddof=1).mean() / windows) if windows > 1 else 0.0
    mean = float(own.mean()) if layers else 0.0
    if layers < 4:
        return own, Pooled(mean, 1.0, noise, layers)
    spread = float(((own - mean) ** 2).sum())
    weight = max(0.0, 1.0 - (layers - 3) * noise / spread) if spread > 0 else 0.0
    return mean + weight * (own - mean), Pooled(mean, weight, noise, layers)


def expected_savings(evidence: list[tuple[tuple[HeldOut, ...], tuple[HeldOut, ...]]]
                     ) -> tuple[np.ndarray, dict[str, Pooled]]:
    """(float64 `[L]`, {"traffic": Pooled, "compute": Pooled}): step 5's expected saving of grouping each
    layer, a share of its balance-only layer time: the windows' dispatch + combine saving
    (`traffic_savings`) and compute saving (`compute_savings`), each estimated over the layers by
    `shrunk_means`, added. evidence: per layer, its grouped and balance-only windows (the same count,
    at least two, for every layer)."""
    if not evidence:
        return np.zeros(0), {}
    traffic = np.array([traffic_savings(g, b) for g, b in evidence])
    compute = np.array([compute_savings(g, b) for g, b in evidence])
    traffic_est, traffic_pool = shrunk_means(traffic)
    compute_est, compute_pool = shrunk_means(compute)
    return traffic_est + compute_est, {"traffic": traffic_pool, "compute": compute_pool}


def cv_windows(steps: list[np.ndarray]) -> list[list[np.ndarray]]:
    """Windows of the training steps for cross-validation: `min(steps, MAX_WINDOWS)` runs of
    consecutive steps; a single step is split into its two halves. Each item is a list of
    int `[tokens, layers, k]` arrays."""
    if len(steps) == 1:
        half = steps[0].shape[0] // 2
        if half == 0:
            return []
        return [[steps[0][:half]], [steps[0][half:]]]
    return [list(steps[run.start:run.stop]) for run in consecutive_runs(len(steps), MAX_WINDOWS)]


def plan_layer(tokens: LayerTokens, problem: PlacementProblem, model: CommModel, strengths: tuple[int, ...],
               exact: bool, start: str = "communities",
               balance_row: np.ndarray | None = None) -> dict[int, tuple[np.ndarray, str]]:
    """{strength: (phy2log `[P]`, replica status)}: steps 1-4 of one layer on `tokens` from the
    `communities` of the co-activation graph (`community_nodes`) or the `balanced` split.
    balance_row: the balance-only plan `[P]` of these tokens; its busiest node and GPU per step
    (`balance_caps`) cap the nodes (step 2) and the GPUs (step 4); None: no caps."""
    gpus, nodes = problem.num_gpus, problem.num_nodes
    if start == "communities":
        start = community_nodes(tokens, nodes, seed=problem.seed)
    else:
        start = balanced_nodes(tokens.loads.sum(axis=0), nodes)
    node_cap = gpu_cap = None
    if balance_row is not None:
        node_cap, gpu_cap = balance_caps(tokens.loads, balance_row, gpus, nodes)
        per_row, floor = _compute_rows_seconds(model, problem.slots_per_gpu)
        free = FLOOR_HEADROOM * floor / per_row                          # rows a GPU may always carry
        node_cap, gpu_cap = np.maximum(node_cap, free * gpus // nodes), np.maximum(gpu_cap, free)
    search = NodeSearch(tokens, start, gpus, nodes, problem.slots_per_gpu, model, cap=node_cap)
    search.within_cap()
    snapshots = search.search(max(strengths), strengths)
    order = sorted(strengths, reverse=True)  # the search ends at the largest: no reset for it
    plans, homes = [], []
    for strength in order:
        if not np.array_equal(search.node_of, snapshots[strength]):
            search.reset(snapshots[strength])
        plans.append(replica_nodes(search, problem.num_physical, problem.seed, exact=exact))
        homes.append(search.node_of.copy())
    rows = assemble(plans, gpus, nodes, problem.num_physical)
    demand = local_demand(tokens, problem.num_experts, nodes, gpus // nodes)
    affinity = tokens.affinity()
    rows = [spread_within_nodes(row, served_per_step(plan, home, demand), affinity, gpu_cap, gpus, nodes)
            for row, plan, home in zip(rows, plans, homes)]
    return {strength: (row, plan.status) for strength, row, plan in zip(order, rows, plans)}


def plan_time(problem: PlacementProblem, steps: list[np.ndarray], model: CommModel,
              time_limit_s: float | None = None, progress: bool = False, strength: int | None = None,
              start: str = "communities", decision: str = "expected", judge: str = "comm",
              min_saving: float = MIN_SAVING) -> TimePlan:
    """Plan every layer of `problem` for the predicted layer time (module docstring).

    steps: the training trace, one int `[tokens, layers, k]` array per step (the problem's layers).
    model: the cost model (topology with the problem's GPUs and nodes).
    time_limit_s: wall-clock safety stop for the whole plan (None: none).
    strength: group every layer at this strength with no cross-validation and no decision (to measure
        what grouping does when nothing holds it back, e.g. in benchmarks); None: `GROUP_STRENGTH`
        with the decision of step 5.
    start: `communities` (`community_nodes`, the default) or `balanced` (`balanced_nodes`): step 1.
    decision: step 5's rule: `expected` (the default: group where the expected saving estimated over the
        layers is positive, `expected_savings`) or `guard` (per layer, `guard`).
    judge, min_saving: the guard's (`guard`): what it judges on the windows (`comm` or `layer`) and its
        bar, a share of the balance-only layer time in [0, 1).
    Each layer's rows depend on that layer's tokens only; under `expected`, whether a layer is grouped
    depends on the windows of all the planned layers (a plan of some layers pools fewer).
    """
    if start not in ("balanced", "communities"):
        raise InputError("start", "balanced or communities", start)
    if decision not in DECISIONS:
        raise InputError("decision", f"one of {', '.join(DECISIONS)}", decision)
    if judge not in JUDGES:
        raise InputError("judge", f"one of {', '.join(JUDGES)}", judge)
    if not 0.0 <= min_saving < 1.0:
        raise InputError("min_saving", "a share of the layer time in [0, 1)", min_saving)
    began = time.monotonic()
    deadline = None if time_limit_s is None else began + time_limit_s
    model.check_placement(problem.num_gpus, problem.num_nodes, "topology")
    if problem.current is not None:
        raise InputError("--objective time", "no --current plan (migration-aware re-plans balance load only)")
    experts, layers = problem.num_experts, problem.num_layers
    gpus, nodes, physical = problem.num_gpus, problem.num_nodes, problem.num_physical
    steps = [np.asarray(s) for s in steps]
    if not steps or any(s.ndim != 3 or s.shape[1] != layers for s in steps):
        raise InputError("trace", f"token-level steps [tokens, {layers} layers, k] for --objective time")
    notes: list[str] = []

    def loads_of(on: list[np.ndarray]) -> np.ndarray:
        return np.stack([sum(np.bincount(s[:, i, :].ravel(), minlength=experts) for s in on)
                         for i in range(layers)]).astype(np.float64)

    balance = solve(PlacementProblem(loads_of(steps), gpus, physical, nodes, problem.num_groups, seed=problem.seed),
                    "fast").placement
    balance_rows = balance.phy2log

    def cost(i: int, row: np.ndarray, on: list[np.ndarray]):   # seeded by the layer's id, not its position
        return layer_cost(model, [s[:, i, :] for s in on], SlotTable(row, gpus, nodes, experts), problem.layer_id(i))

    def bound(i: int) -> float:
        return layer_lower_bound_s([s[:, i, :] for s in steps], model, experts, gpus, nodes, physical)

    def tokens_of(i: int, on: list[np.ndarray]) -> LayerTokens:
        return LayerTokens.from_steps([s[:, i, :] for s in on], experts, gpus, model.token_home)

    def out_of_time(i: int) -> bool:
        if deadline is None or time.monotonic() <= deadline:
            return False
        notes.append(f"time limit {time_limit_s:g} s ran out at layer {problem.layer_id(i)}: the layers from "
                     f"there keep the balance-only plan, and a rerun may differ")
        return True

    if not node_closed_feasible(experts, gpus, nodes, physical):
        notes.append(f"no grouping: {nodes} node(s) of {experts // nodes} experts cannot fill "
                     f"{problem.slots_per_gpu} slots per GPU with distinct experts; returned the balance-only plan")
        reports = [TimeLayer(balance_rows[i], "balance", cost(i, balance_rows[i], steps).layer_time_s, bound(i),
                             None, None) for i in range(layers)]
        return TimePlan(balance, tuple(reports), None, {}, balance, tuple(notes), time.monotonic() - began)

    decided = strength is None
    strength = GROUP_STRENGTH if decided else strength
    windows = cv_windows(steps) if decided else []
    if decided and not windows:
        notes.append("no held-out window (a single step of one token): returned the balance-only plan")
    bar = ProgressBar(layers * (2 if windows else 1), "plan time", "layer passes") if progress else None

    # step 5's evidence, layer by layer: per window, the grouped and balance-only plans of the other windows
    folds = [[s for v, window in enumerate(windows) if v != w for s in window] for w in range(len(windows))]
    fold_balance = [quick_plan(loads_of(train), gpus, physical) for train in folds]
    evidence: list[tuple[tuple[HeldOut, ...], tuple[HeldOut, ...]] | None] = [None] * layers
    stopped = False
    for i in range(layers if windows else 0):
        stopped = stopped or out_of_time(i)
        if not stopped:
            held, held_balance = [], []
            for w, validation in enumerate(windows):
                row = plan_layer(tokens_of(i, folds[w]), problem, model, (strength,), False, start,
                                 fold_balance[w][i])[strength][0]
                held.append(HeldOut.of(cost(i, row, validation)))
                held_balance.append(HeldOut.of(cost(i, fold_balance[w][i], validation)))
            evidence[i] = (tuple(held), tuple(held_balance))
        if bar:
            bar.advance(1)

    # step 5's decision
    judged = [i for i in range(layers) if evidence[i] is not None]
    estimates, pooled = expected_savings([evidence[i] for i in judged])
    expected = dict(zip(judged, estimates.tolist()))
    if not decided:
        group = [True] * layers
    elif decision == "guard":
        group = [evidence[i] is not None and guard(*evidence[i], judge, min_saving) for i in range(layers)]
    else:
        group = [expected.get(i, 0.0) > 0 for i in range(layers)]

    rows, reports = [], []
    for i in range(layers):
        stopped = stopped or (group[i] and out_of_time(i))
        grouped = group[i] and not stopped
        if grouped:
            row, status = plan_layer(tokens_of(i, steps), problem, model, (strength,), True, start,
                                     balance_rows[i])[strength]
        else:
            row, status = balance_rows[i], "node-closed"
        held, held_balance = evidence[i] or ((), ())
        rows.append(row)
        reports.append(TimeLayer(np.asarray(row), "grouped" if grouped else "balance",
                                 cost(i, row, steps).layer_time_s, bound(i),
                                 sum(h.layer_time_s for h in held) if held else None,
                                 sum(h.layer_time_s for h in held_balance) if held else None, status,
                                 held, held_balance, expected.get(i)))
        if bar:
            bar.advance(1)
    if bar:
        bar.close()
    cv = {"grouped": sum(sum(h.layer_time_s for h in e[0]) for e in evidence if e),
          "balance": sum(sum(h.layer_time_s for h in e[1]) for e in evidence if e)} if windows else {}
    return TimePlan(Placement(np.stack(rows), experts, gpus, nodes), tuple(reports), strength, cv, balance,
                    tuple(notes), time.monotonic() - began,
                    min_saving if windows and decision == "guard" else None,
                    decision if windows else None, pooled)
