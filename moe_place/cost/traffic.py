"""Dispatch/combine traffic and its lower bound (formula 3), FP8 vs BF16 payloads, and the
NIC message-rate crossover (C13).

`a[i][j]`: dispatches (token, expert pairs) sent from source GPU `i` to expert GPU `j`. The
dispatch phase moves `V_D[i][j] = a[i][j] * d_D` bytes from i to j; the combine phase moves
`V_C[j][i] = a[i][j] * d_C` bytes back. The bound on a phase is the largest of
- senders:   bytes GPU i sends / max-flow from i to the GPUs it sends to,
- receivers: bytes GPU j receives / max-flow into j from the GPUs that send to it,
- cuts:      bytes leaving (entering) each server / capacity of the graph edges leaving (entering) it,
- links:     bytes each directed link carries on the routes / its capacity (flows that share a
             physical direction add up).
No startup, queueing or late arrival is included, so a real schedule can only be slower.
`a[i][j]` from a trace + placement comes from `moe_place.analysis.dispatch.dispatch_matrix`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_place.cost.topology import Topology
from moe_place.errors import InputError

__all__ = ["BoundTerm", "PhaseBound", "embed_dispatch", "expert_skew", "message_rate_crossover_bytes", "nic_regime",
           "phase_lower_bound", "phase_time_s", "phase_volumes_bytes"]


def embed_dispatch(a, sources: list[int], groups: list[int], topology: Topology) -> np.ndarray:
    """float64 `[G, G]`: `a` (`[len(sources), len(groups)]`) placed at the topology's GPU indices."""
    arr = np.asarray(a, dtype=np.float64)
    if arr.ndim != 2 or arr.shape != (len(sources), len(groups)):
        raise InputError("dispatch", f"a [{len(sources)} sources, {len(groups)} groups] matrix", f"shape {arr.shape}")
    if not np.isfinite(arr).all() or (arr < 0).any():
        raise InputError("dispatch", "dispatch counts >= 0", "a negative or non-finite entry")
    for where, ids in (("sources", sources), ("groups", groups)):
        for g in ids:
            topology.check_gpu(g, f"workload.{where}")
        if len(set(ids)) != len(ids):
            raise InputError(f"workload.{where}", "distinct GPU indices", list(ids))
    full = np.zeros((topology.num_gpus, topology.num_gpus))
    full[np.ix_(sources, groups)] = arr
    return full


def phase_volumes_bytes(a_full: np.ndarray, dispatch_bytes_per_row: float,
                        combine_bytes_per_row: float) -> tuple[np.ndarray, np.ndarray]:
    """(`V_D`, `V_C`), float64 `[G, G]` each, indexed [from, to]: `V_D = a*d_D`, `V_C = a.T*d_C`."""
    if not dispatch_bytes_per_row > 0 or not combine_bytes_per_row > 0:
        raise InputError("row bytes", "bytes per dispatched/combined row > 0",
                         f"{dispatch_bytes_per_row}, {combine_bytes_per_row}")
    a_full = np.asarray(a_full, dtype=np.float64)
    return a_full * dispatch_bytes_per_row, a_full.T * combine_bytes_per_row


@dataclass(frozen=True)
class BoundTerm:
    """One term of the lower bound: `kind` in sender/receiver/cut/link, `where` names the resource."""

    kind: str
    where: str
    bytes: float
    capacity_bytes_per_s: float

    @property
    def time_s(self) -> float:
        return self.bytes / self.capacity_bytes_per_s if self.bytes else 0.0


@dataclass(frozen=True)
class PhaseBound:
    """Formula 3 for one phase: every term and the largest one."""

    terms: tuple[BoundTerm, ...]
    total_bytes: float

    @property
    def time_s(self) -> float:
        return max((t.time_s for t in self.terms), default=0.0)

    def binding(self, rtol: float = 1e-9) -> tuple[BoundTerm, ...]:
        """The terms that reach the bound (ties included)."""
        top = self.time_s
        if top == 0:
            return ()
        return tuple(t for t in self.terms if t.time_s >= top * (1 - rtol))

    def worst(self, kind: str) -> BoundTerm | None:
        terms = [t for t in self.terms if t.kind == kind]
        return max(terms, key=lambda t: t.time_s) if terms else None


def phase_lower_bound(topology: Topology, volume_bytes: np.ndarray) -> PhaseBound:
    """Formula 3 for a volume matrix `[G, G]` in bytes, indexed [from GPU, to GPU]."""
    volume = topology.check_volume(volume_bytes).copy()
    np.fill_diagonal(volume, 0.0)  # a GPU's rows for its own experts never leave it
    terms: list[BoundTerm] = []
    for i in np.nonzero(volume.sum(axis=1))[0]:
        dests = [int(j) for j in np.nonzero(volume[i])[0]]
        terms.append(BoundTerm("sender", f"gpu{i}", float(volume[i].sum()),
                               topology.max_flow_bytes_per_s([int(i)], dests)))
    for j in np.nonzero(volume.sum(axis=0))[0]:
        srcs = [int(i) for i in np.nonzero(volume[:, j])[0]]
        terms.append(BoundTerm("receiver", f"gpu{j}", float(volume[:, j].sum()),
                               topology.max_flow_bytes_per_s(srcs, [int(j)])))
    if topology.num_servers > 1:
        per = topology.gpus_per_server
        for s in range(topology.num_servers):
            inside = np.zeros(topology.num_gpus, dtype=bool)
            inside[s * per:(s + 1) * per] = True
            nodes = topology.server_nodes(s)
            others = frozenset(topology.graph.nodes) - nodes
            out_bytes = float(volume[np.ix_(inside, ~inside)].sum())
            in_bytes = float(volume[np.ix_(~inside, inside)].sum())
            if out_bytes:
                terms.append(BoundTerm("cut", f"server{s} out", out_bytes, topology.cut_capacity_bytes_per_s(nodes)))
            if in_bytes:
                terms.append(BoundTerm("cut", f"server{s} in", in_bytes, topology.cut_capacity_bytes_per_s(others)))
    for (u, v), load in sorted(topology.link_loads_bytes(volume).items()):
        terms.append(BoundTerm("link", f"{u}->{v}", load, topology.graph.edges[u, v]["capacity"]))
    return PhaseBound(tuple(terms), float(volume.sum()))


def phase_time_s(topology: Topology, volume_bytes: np.ndarray) -> float:
    """`phase_lower_bound(topology, volume_bytes).time_s`, from the link terms alone, in one product.

    The other terms never exceed the largest link term: a sender's bytes all cross the minimum
    cut between it and its destinations (routes and max flows use the same graph, with no other
    GPU forwarding), so some edge of that cut carries at least `bytes / cut capacity` of its
    capacity; the same holds for receivers and for the edges leaving a server. The link loads are
    `volume.ravel() @ incidence` (`Topology.route_incidence`), summed hop by hop over the routes
    (`Topology.route_hops`: a few hops per pair, where the dense product reads all `G*G x edges`).
    Tests check it against `phase_lower_bound` on random volumes and topologies.
    """
    volume = topology.check_volume(volume_bytes).copy()
    np.fill_diagonal(volume, 0.0)
    _, capacity, _ = topology.route_incidence()
    if not volume.any() or not capacity.size:
        return 0.0
    start, edge = topology.route_hops()
    pair_of_hop = np.repeat(np.arange(start.size - 1), np.diff(start))
    loads = np.bincount(edge, weights=volume.ravel()[pair_of_hop], minlength=capacity.size)
    return float((loads / capacity).max())


def expert_skew(rows_per_group) -> float:
    """`s_expert = max_j m[j] / (n*k/R)` for the rows `m` of the `R` groups (1 = balanced)."""
    rows = np.asarray(rows_per_group, dtype=np.float64)
    if rows.ndim != 1 or rows.size == 0 or rows.sum() <= 0:
        raise InputError("rows per group", "a non-empty 1-D list with a positive total", rows.shape)
    return float(rows.max() / rows.mean())


# ---------------------------------------------------------------------- NIC message rate (C13)
def message_rate_crossover_bytes(nic_bytes_per_s: float, messages_per_s: float) -> float:
    """Message size at which the NIC's bandwidth and its request rate take equal time (`B / R`).

    50 GB/s and 54 M requests/s -> about 926 bytes (0.93 KB): larger messages are bandwidth-bound.
    """
    if not nic_bytes_per_s > 0 or not messages_per_s > 0:
        raise InputError("NIC", "bandwidth and message rate > 0", f"{nic_bytes_per_s}, {messages_per_s}")
    return nic_bytes_per_s / messages_per_s


def nic_regime(message_bytes: float, nic_bytes_per_s: float, messages_per_s: float) -> str:
    """`bandwidth` when messages are larger than the crossover, else `message-rate`."""
    crossover = message_rate_crossover_bytes(nic_bytes_per_s, messages_per_s)
    return "bandwidth" if message_bytes > crossover else "message-rate"
