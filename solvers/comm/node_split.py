"""Step 1 of the time planner: the node of each expert, co-activated experts together (`community_nodes`) or by
load alone (`balanced_nodes`).
"""

from __future__ import annotations

import networkx as nx
import numpy as np

from moe_place.solvers.comm.tokens import LayerTokens

__all__ = ["balanced_nodes", "community_nodes"]

COMMUNITY_NEIGHBOURS = 16            # co-activation graph: each expert joined to its 16 most frequent partners


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
