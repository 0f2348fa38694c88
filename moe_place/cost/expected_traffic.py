"""Dispatch and combine of count-level steps: formula 3 on the rows a step is expected to move.

A count-level trace holds each step's rows per expert, not which token chose which experts, so the traffic
of `moe_place.cost.comm` (which follows every token) cannot be counted. What the counts allow is its
expectation under two assumptions, both the replay's already: a step's `T = rows / k` tokens are spread
evenly over the `G` GPUs (`blocks`), and each of a token's `k` choices lands on GPU `g` with probability
`q_g = m_g / sum(m)`, `m_g` the rows GPU `g` computes (its slots' rows under the replica choice),
independently of its other choices. A token then visits GPU `g` with probability `v_g = 1 - (1 - q_g)^k`
and node `n` with `u_n = 1 - (1 - Q_n)^k` (`Q_n` its GPUs' share), and the expected rows `a[i][j]` sent from
GPU `i` to GPU `j` in the dispatch phase are, for the two dispatch styles of `moe_place.cost.comm`:

- `all-to-all`: one row per (token, destination GPU): `a[i][j] = (T / G) v_j`, `i != j`;
- `deepep`: one RDMA row per (token, remote node), to the GPU of the token's local rank there,
  `a[i][j] = (T / G) u_n` for `j` on another node `n` with `i`'s local rank; then NVLink rows from
  each GPU `f` of node `n` to each other GPU `g` of it, for the tokens `f` holds (its own and those it
  received), `a[f][g] = (T / G) v_g + (N - 1) (T / G) u_n (v_g / u_n) = T v_g / gpn`.

Combine sends the same rows back. Each phase takes formula 3 on the cluster of `cost.cluster_topology`
(`gpu <-> nvswitch` NVLink ports, `gpu -> nic -> leaf -> spine` for other nodes): the busiest of the
GPUs' NVLink ports, their PCIe links to the NICs, the NIC ports and the servers' uplinks, each port's
rows in closed form (a test builds the whole matrix and checks that the two agree with
`moe_place.cost.traffic.phase_time_s`).

What the expectation leaves out: which experts a token chooses together. Tokens that choose experts of
one node visit fewer nodes than independence says, so on a trace with co-activation the expectation is
high; `tests/test_expected_traffic.py` measures it against the exact count on the bundled token-level
trace (docs/MODEL.md, "One model").
"""

from __future__ import annotations

import numpy as np

from moe_place.cost.topology import Topology
from moe_place.errors import InputError

__all__ = ["expected_phase_times_s", "visit_probabilities"]

STYLES = ("deepep", "all-to-all")


def visit_probabilities(gpu_rows: np.ndarray, top_k: int, gpus_per_node: int) -> tuple[np.ndarray, np.ndarray]:
    """(`v` `[B, G]`, `u` `[B, N]`): the chance a token visits each GPU and each node (module docstring)."""
    rows = np.asarray(gpu_rows, dtype=np.float64)
    total = rows.sum(axis=-1, keepdims=True)
    share = np.divide(rows, total, out=np.zeros_like(rows), where=total > 0)
    node_share = share.reshape(*share.shape[:-1], -1, gpus_per_node).sum(axis=-1)
    return 1.0 - (1.0 - share) ** top_k, 1.0 - (1.0 - node_share) ** top_k


def expected_phase_times_s(topology: Topology, gpu_rows: np.ndarray, top_k: int, dispatch_row_bytes: float,
                           combine_row_bytes: float, style: str = "deepep") -> tuple[np.ndarray, np.ndarray]:
    """(dispatch seconds `[B]`, combine seconds `[B]`) of each step whose GPUs compute `gpu_rows [B, G]`: formula
    3 on the expected rows (module docstring), the ports' loads in closed form."""
    if style not in STYLES:
        raise InputError("dispatch", f"one of {', '.join(STYLES)}", style)
    rows = np.atleast_2d(np.asarray(gpu_rows, dtype=np.float64))
    gpus, gpn = topology.num_gpus, topology.gpus_per_server
    if rows.shape[-1] != gpus:
        raise InputError("gpu rows", f"[steps, {gpus}] (the cluster's GPUs)", rows.shape)
    nodes = gpus // gpn
    tokens = rows.sum(axis=1, keepdims=True) / top_k                      # [B, 1]
    v, u = visit_probabilities(rows, top_k, gpn)
    v_node = v.reshape(-1, nodes, gpn)
    # NVLink rows into and out of each GPU; RDMA rows into and out of each GPU's NIC
    if style == "all-to-all":
        per_source = tokens[:, :, None] / gpus                             # [B, 1, 1]
        nvl_in = (gpn - 1) * per_source * v_node
        nvl_out = per_source * (v_node.sum(axis=2, keepdims=True) - v_node)
        remote_v = v.sum(axis=1, keepdims=True) - v_node.sum(axis=2).repeat(gpn, axis=1)    # [B, G]
        nic_out = (tokens / gpus) * remote_v
        nic_in = (gpus - gpn) * (tokens / gpus) * v
    else:
        per_forwarder = tokens[:, :, None] / gpn
        nvl_in = (gpn - 1) * per_forwarder * v_node
        nvl_out = per_forwarder * (v_node.sum(axis=2, keepdims=True) - v_node)
        remote_u = u.sum(axis=1, keepdims=True) - u                          # [B, N]: the other nodes
        nic_out = (tokens / gpus) * remote_u.repeat(gpn, axis=1)
        nic_in = (nodes - 1) * (tokens / gpus) * u.repeat(gpn, axis=1)
    nvl_in, nvl_out = nvl_in.reshape(-1, gpus), nvl_out.reshape(-1, gpus)
    caps = _capacities(topology)
    # seconds per byte of a row: the busiest port, each direction of a link its own (combine runs every row of
    # dispatch backwards, so its ports carry the same rows the other way: the same busiest port)
    per_byte = np.zeros(rows.shape[0])
    if caps["nvlink"]:
        per_byte = np.maximum(per_byte, np.maximum(nvl_in, nvl_out).max(axis=1) / caps["nvlink"])
    if nodes > 1:
        nic = np.maximum(nic_in, nic_out).max(axis=1)
        per_byte = np.maximum(per_byte, nic / min(caps["pcie_nic"], caps["nic"]))
        leaf = np.maximum(nic_in.reshape(-1, nodes, gpn).sum(axis=2), nic_out.reshape(-1, nodes, gpn).sum(axis=2))
        per_byte = np.maximum(per_byte, leaf.max(axis=1) / caps["uplink"])
    return per_byte * dispatch_row_bytes, per_byte * combine_row_bytes


def _capacities(topology: Topology) -> dict:
    """Bytes/s of the links the phases use, read off the graph of `cost.topology.build_cluster` (GPU 0's)."""
    graph = topology.graph
    caps = {"nvlink": graph.edges["gpu0", "nvswitch0"]["capacity"] if graph.has_edge("gpu0", "nvswitch0") else 0.0}
    if topology.num_servers > 1:
        caps.update(pcie_nic=graph.edges["gpu0", "nic0"]["capacity"], nic=graph.edges["nic0", "leaf0"]["capacity"],
                    uplink=graph.edges["leaf0", "spine"]["capacity"])
    if not caps["nvlink"] and topology.gpus_per_server > 1:
        raise InputError("topology", "NVLink between a server's GPUs for the expected dispatch and combine",
                         "PCIe only")
    return caps
