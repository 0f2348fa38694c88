"""Step 2 of the time planner: the node cap and the grouping swaps (`NodeSearch`)."""

from __future__ import annotations

import numpy as np

from moe_place.cost.comm import CommModel
from moe_place.solvers.comm.tokens import LayerTokens

__all__ = ["NodeSearch"]

STRENGTHS = (0, 2, 4, 8, 16, 32, 64)  # node swaps away from the start (step 2) that benchmarks and tests try
GROUP_STRENGTH = 0                    # swaps of step 2 in the time plan: none (package docstring, step 2)
SEARCH_CANDIDATES = 32                # swaps tried per round, best first-order change first
SWAPS_PER_ROUND = 4                   # swaps taken per round before the ranking is recomputed
MEAN_WEIGHT = 1.0                     # weight of the mean NIC's term in the search surrogate
PRICE_TEMPERATURE = 0.02              # softmax temperature of the NIC prices, relative to the busiest NIC


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
        """The surrogate of the package docstring (step 2), seconds summed over steps."""
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
