"""The cluster as a directed graph: GPUs, NVLink switches, NICs, the fabric, host PCIe.

Nodes are named `gpu{g}` (g = global GPU index, node-major), `nvswitch{n}`, `nic{g}`, `leaf{n}`,
`spine`, `host{n}`; attribute `kind` is the prefix and `server` the server index. Every edge is one
*direction* of a physical link with `capacity` in bytes/s and a `kind`:

    gpu{g} <-> nvswitch{n}   nvlink   NVLink bandwidth per direction (absent when 0)
    gpu{g} <-> host{n}       pcie     PCIe to host memory
    gpu{g} <-> nic{g}        pcie     PCIe from the GPU to its NIC
    nic{g} <-> leaf{n}       nic      the NIC's port (e.g. 400 Gbit/s = 50 GB/s)
    leaf{n} <-> spine        uplink   the fabric between servers (default: sum of the NICs)

A copy between two GPUs takes the widest route (largest bottleneck, then fewest hops) that does
not pass through a third GPU. Cut capacities come from the graph: the sum of capacities of the
edges leaving a node set, or a max-flow between GPU sets; nothing is special-cased by name.
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass, field

import networkx as nx
import numpy as np

from moe_place.cost.files import get_number, read_table_file
from moe_place.cost.hardware import Catalog, GpuSpec, builtin_catalog
from moe_place.cost.units import GB_BYTES, gb_per_s, gbit_per_s
from moe_place.errors import InputError, check_keys

__all__ = ["Topology", "build_cluster", "gpu_node", "parse_topology_spec", "topology_from_table",
           "with_link_overrides"]

Edge = tuple[str, str]


def gpu_node(g: int) -> str:
    return f"gpu{g}"


@dataclass(frozen=True)
class Topology:
    """A frozen networkx DiGraph plus the GPU part and the server layout.

    graph: DiGraph with node attrs `kind`, `server` and edge attrs `capacity` (bytes/s), `kind`.
    gpu: the GPU part every `gpu{g}` node is (homogeneous clusters).
    """

    graph: nx.DiGraph
    gpu: GpuSpec
    num_servers: int
    gpus_per_server: int
    _routes: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _flows: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _incidence: list = field(default_factory=list, init=False, repr=False, compare=False)
    _bandwidths: list = field(default_factory=list, init=False, repr=False, compare=False)
    _hops: list = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        graph = self.graph
        for g in range(self.num_gpus):
            if gpu_node(g) not in graph:
                raise InputError("topology", f"a node gpu{g} for each of the {self.num_gpus} GPUs", "missing")
        for u, v, data in graph.edges(data=True):
            cap = data.get("capacity")
            if cap is None or not (cap > 0) or cap != cap:
                raise InputError(f"topology link {u}->{v}", "a bandwidth > 0 bytes/s", cap)
        object.__setattr__(self, "graph", nx.freeze(graph))

    # ------------------------------------------------------------------ layout
    @property
    def num_gpus(self) -> int:
        return self.num_servers * self.gpus_per_server

    def check_gpu(self, g: int, where: str = "GPU") -> int:
        if isinstance(g, bool) or not isinstance(g, (int, np.integer)) or not 0 <= g < self.num_gpus:
            raise InputError(where, f"a GPU index in [0, {self.num_gpus}) of the topology", g)
        return int(g)

    def server_nodes(self, server: int) -> frozenset[str]:
        """Every graph node that belongs to one server (its GPUs, switch, NICs, leaf, host)."""
        return frozenset(n for n, d in self.graph.nodes(data=True) if d.get("server") == server)

    # ------------------------------------------------------------------ routes
    def route(self, src: int, dst: int) -> tuple[Edge, ...]:
        """The directed edges a copy from GPU `src` to GPU `dst` crosses (empty when src == dst)."""
        src, dst = self.check_gpu(src, "source GPU"), self.check_gpu(dst, "destination GPU")
        if src == dst:
            return ()
        if src not in self._routes:
            self._routes[src] = _widest_routes(self.graph, gpu_node(src))
        path = self._routes[src].get(gpu_node(dst))
        if path is None:
            raise InputError("topology", f"a route from gpu{src} to gpu{dst}", "none")
        return tuple(zip(path[:-1], path[1:]))

    def path_bandwidth_bytes_per_s(self, src: int, dst: int) -> float:
        """Bottleneck bandwidth of the route from `src` to `dst`; `inf` for a copy within one GPU."""
        edges = self.route(src, dst)
        if not edges:
            return float("inf")
        return min(self.graph.edges[e]["capacity"] for e in edges)

    def path_bandwidths(self) -> np.ndarray:
        """float64 `[G, G]`: `path_bandwidth_bytes_per_s` of every pair (`inf` on the diagonal), built
        once per topology (read-only)."""
        if not self._bandwidths:
            table = _widest_widths(self.graph, self.num_gpus)
            table.setflags(write=False)
            self._bandwidths.append(table)
        return self._bandwidths[0]

    def path_kind(self, src: int, dst: int) -> str:
        """`same GPU`, or the kinds of link on the route, e.g. `nvlink` or `pcie+nic+uplink`."""
        edges = self.route(src, dst)
        if not edges:
            return "same GPU"
        kinds = []
        for e in edges:
            kind = self.graph.edges[e]["kind"]
            if kind not in kinds:
                kinds.append(kind)
        return "+".join(kinds)

    def link_loads_bytes(self, volume_bytes: np.ndarray) -> dict[Edge, float]:
        """Bytes each directed edge carries when `volume_bytes[src, dst]` ([G, G]) follows the routes."""
        volume = self.check_volume(volume_bytes)
        loads: dict[Edge, float] = {}
        for src, dst in zip(*np.nonzero(volume)):
            for edge in self.route(int(src), int(dst)):
                loads[edge] = loads.get(edge, 0.0) + float(volume[src, dst])
        return loads

    def route_incidence(self) -> tuple[tuple[Edge, ...], np.ndarray, np.ndarray]:
        """(edges, capacities, incidence): every directed edge some GPU-to-GPU route crosses, its
        capacity (float64 `[edges]`, bytes/s) and float64 `[G*G, edges]` with 1 where the route of
        pair `src*G + dst` crosses the edge. `volume.ravel() @ incidence` are the link loads of
        `link_loads_bytes`, for every pair at once (built once per topology)."""
        if not self._incidence:
            gpus = self.num_gpus
            pairs = [(s, d) for s in range(gpus) for d in range(gpus) if s != d]
            edges = sorted({e for s, d in pairs for e in self.route(s, d)})
            column = {e: i for i, e in enumerate(edges)}
            incidence = np.zeros((gpus * gpus, len(edges)))
            for s, d in pairs:
                for e in self.route(s, d):
                    incidence[s * gpus + d, column[e]] = 1.0
            capacity = np.array([self.graph.edges[e]["capacity"] for e in edges], dtype=np.float64)
            incidence.setflags(write=False)
            capacity.setflags(write=False)
            self._incidence.append((tuple(edges), capacity, incidence))
        return self._incidence[0]

    def route_hops(self) -> tuple[np.ndarray, np.ndarray]:
        """(start, edge): the routes of `route_incidence` as lists, int64 `[G*G + 1]` and `[hops]`: the
        edges (columns of `route_incidence`) of pair `src*G + dst` are `edge[start[p]:start[p + 1]]`."""
        if not self._hops:
            _, _, incidence = self.route_incidence()
            pair, edge = np.nonzero(incidence)
            start = np.searchsorted(pair, np.arange(incidence.shape[0] + 1))
            start.setflags(write=False)
            edge.setflags(write=False)
            self._hops.append((start, edge))
        return self._hops[0]

    def check_volume(self, volume_bytes: np.ndarray, where: str = "traffic") -> np.ndarray:
        volume = np.asarray(volume_bytes, dtype=np.float64)
        if volume.shape != (self.num_gpus, self.num_gpus):
            raise InputError(where, f"a [{self.num_gpus}, {self.num_gpus}] matrix over the topology's GPUs",
                             f"shape {volume.shape}")
        if not np.isfinite(volume).all() or (volume < 0).any():
            raise InputError(where, "finite bytes >= 0", "a negative or non-finite entry")
        return volume

    # ------------------------------------------------------------------ cuts
    def cut_capacity_bytes_per_s(self, nodes: frozenset[str] | set[str]) -> float:
        """Sum of the capacities of the edges leaving the node set `nodes`."""
        inside = set(nodes)
        return float(sum(d["capacity"] for u, v, d in self.graph.edges(data=True) if u in inside and v not in inside))

    def max_flow_bytes_per_s(self, sources: list[int], sinks: list[int]) -> float:
        """Max flow from GPU set `sources` to GPU set `sinks`, no GPU forwarding for others.

        Cached per (sources, sinks) pair: a phase bound asks the same few questions layer after layer.
        """
        key = (frozenset(self.check_gpu(g) for g in sources), frozenset(self.check_gpu(g) for g in sinks))
        if key not in self._flows:
            self._flows[key] = self._max_flow(key[0], key[1])
        return self._flows[key]

    def _max_flow(self, sources: frozenset[int], sinks: frozenset[int]) -> float:
        src_nodes = {gpu_node(g) for g in sources}
        dst_nodes = {gpu_node(g) for g in sinks}
        if src_nodes & dst_nodes:
            return float("inf")
        keep = [n for n, d in self.graph.nodes(data=True) if d["kind"] != "gpu" or n in src_nodes | dst_nodes]
        flow_graph = nx.DiGraph(self.graph.subgraph(keep))
        for n in src_nodes:
            flow_graph.add_edge("_source", n)  # no capacity attribute = infinite
        for n in dst_nodes:
            flow_graph.add_edge(n, "_sink")
        return float(nx.maximum_flow_value(flow_graph, "_source", "_sink"))

    def describe(self) -> str:
        g = self.gpu
        kinds = {}
        for _, _, d in self.graph.edges(data=True):
            kinds.setdefault(d["kind"], set()).add(d["capacity"])
        links = ", ".join(f"{k} {'/'.join(f'{c / GB_BYTES:g}' for c in sorted(v))} GB/s" for k, v in sorted(kinds.items()))
        return f"{self.num_servers} x {self.gpus_per_server} {g.name} ({links})"


def _widest_widths(graph: nx.DiGraph, num_gpus: int) -> np.ndarray:
    """float64 `[G, G]`: the bottleneck bandwidth of the widest route between every pair of GPUs
    (`inf` on the diagonal), routes not transiting other GPUs: the max-min closure of the link
    capacities over the non-GPU nodes (Floyd-Warshall in the bottleneck semiring), all pairs at
    once. The widest width is unique, so it is the width of `_widest_routes`' route."""
    nodes = list(graph.nodes)
    index = {node: i for i, node in enumerate(nodes)}
    width = np.zeros((len(nodes), len(nodes)))
    for u, v, data in graph.edges(data=True):
        width[index[u], index[v]] = max(width[index[u], index[v]], data["capacity"])
    np.fill_diagonal(width, np.inf)
    for k, node in enumerate(nodes):
        if graph.nodes[node]["kind"] != "gpu":   # GPUs end routes, they do not forward
            np.maximum(width, np.minimum(width[:, k:k + 1], width[k:k + 1, :]), out=width)
    gpus = [index[gpu_node(g)] for g in range(num_gpus)]
    table = width[np.ix_(gpus, gpus)]
    missing = np.argwhere(table <= 0)
    if missing.size:
        src, dst = missing[0]
        raise InputError("topology", f"a route from gpu{src} to gpu{dst}", "none")
    return table


def _widest_routes(graph: nx.DiGraph, source: str) -> dict[str, list[str]]:
    """Widest-then-shortest paths from `source` to every reachable node, not transiting other GPUs."""
    best: dict[str, tuple[float, int]] = {source: (float("inf"), 0)}
    parent: dict[str, str] = {}
    heap = [(-float("inf"), 0, source)]
    done: set[str] = set()
    while heap:
        neg_width, hops, node = heapq.heappop(heap)
        if node in done:
            continue
        done.add(node)
        if node != source and graph.nodes[node]["kind"] == "gpu":
            continue  # GPUs end routes, they do not forward
        for nxt in sorted(graph.successors(node)):
            width = min(-neg_width, graph.edges[node, nxt]["capacity"])
            cand = (width, hops + 1)
            old = best.get(nxt)
            if old is None or cand[0] > old[0] or (cand[0] == old[0] and cand[1] < old[1]):
                best[nxt] = cand
                parent[nxt] = node
                heapq.heappush(heap, (-width, hops + 1, nxt))
    routes = {}
    for node in best:
        if node == source or graph.nodes[node]["kind"] != "gpu":
            continue
        path = [node]
        while path[-1] != source:
            path.append(parent[path[-1]])
        routes[node] = path[::-1]
    return routes


# ---------------------------------------------------------------------- builders
def build_cluster(gpu: GpuSpec, num_servers: int, gpus_per_server: int, *,
                  nvlink_bytes_per_s: float | None = None, nic_bytes_per_s: float = 0.0,
                  inter_server_bytes_per_s: float | None = None, pcie_bytes_per_s: float | None = None,
                  host_pcie_bytes_per_s: float | None = None) -> Topology:
    """A homogeneous cluster; defaults come from the GPU part (NVLink, PCIe) and the NICs.

    nvlink_bytes_per_s: per direction per GPU; 0 means no NVLink switch (PCIe-only cards).
    nic_bytes_per_s: per direction per GPU NIC; needed when num_servers > 1.
    inter_server_bytes_per_s: each server's uplink to the fabric, per direction (default: its NICs' sum).
    host_pcie_bytes_per_s: GPU <-> host memory (default: the GPU's PCIe figure).
    """
    for name, value in (("num_servers", num_servers), ("gpus_per_server", gpus_per_server)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"topology.{name}", "an integer >= 1", value)
    nvlink = gpu.nvlink_bytes_per_s if nvlink_bytes_per_s is None else nvlink_bytes_per_s
    pcie = gpu.pcie_bytes_per_s if pcie_bytes_per_s is None else pcie_bytes_per_s
    host_pcie = pcie if host_pcie_bytes_per_s is None else host_pcie_bytes_per_s
    for name, value in (("NVLink bandwidth", nvlink), ("NIC bandwidth", nic_bytes_per_s)):
        if value < 0:
            raise InputError(f"topology: {name}", "bytes/s >= 0", value)
    for name, value in (("PCIe bandwidth", pcie), ("host PCIe bandwidth", host_pcie)):
        if not value > 0:
            raise InputError(f"topology: {name}", "bytes/s > 0", value)
    if num_servers > 1 and not nic_bytes_per_s > 0:
        raise InputError("topology: NIC bandwidth", f"bytes/s > 0 to join {num_servers} servers", nic_bytes_per_s)
    uplink = gpus_per_server * nic_bytes_per_s if inter_server_bytes_per_s is None else inter_server_bytes_per_s
    if num_servers > 1 and not uplink > 0:
        raise InputError("topology: bandwidth between servers", "bytes/s > 0", uplink)

    graph = nx.DiGraph()

    def link(u: str, v: str, capacity: float, kind: str) -> None:
        graph.add_edge(u, v, capacity=float(capacity), kind=kind)
        graph.add_edge(v, u, capacity=float(capacity), kind=kind)

    if num_servers > 1:
        graph.add_node("spine", kind="spine", server=None)
    for s in range(num_servers):
        graph.add_node(f"host{s}", kind="host", server=s)
        if nvlink > 0:
            graph.add_node(f"nvswitch{s}", kind="nvswitch", server=s)
        if num_servers > 1:
            graph.add_node(f"leaf{s}", kind="leaf", server=s)
            link(f"leaf{s}", "spine", uplink, "uplink")
        for local in range(gpus_per_server):
            g = s * gpus_per_server + local
            graph.add_node(gpu_node(g), kind="gpu", server=s)
            link(gpu_node(g), f"host{s}", host_pcie, "pcie")
            if nvlink > 0:
                link(gpu_node(g), f"nvswitch{s}", nvlink, "nvlink")
            if num_servers > 1:
                graph.add_node(f"nic{g}", kind="nic", server=s)
                link(gpu_node(g), f"nic{g}", pcie, "pcie")
                link(f"nic{g}", f"leaf{s}", nic_bytes_per_s, "nic")
    return Topology(graph, gpu, num_servers, gpus_per_server)


_BW = r"(-?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(tb/s|gb/s|gbit/s|gb/sec|gbps|gbit)"


def _bandwidth(value: str, unit: str) -> float:
    unit = unit.lower()
    number = float(value)
    if unit == "tb/s":
        return number * 1e12
    if unit in ("gbit/s", "gbps", "gbit"):
        return gbit_per_s(number)
    return gb_per_s(number)


def parse_topology_spec(text: str, catalog: Catalog | None = None) -> Topology:
    """Build a topology from a short description, clauses separated by commas:

        "2 nodes x 8 H100, NVLink 450 GB/s, 400 Gbit/s NIC per GPU, 200 GB/s between nodes,
         PCIe 64 GB/s, host PCIe 25 GB/s"

    The first clause (`[N nodes x] G PART`) is required; the others override the part's figures.
    `no NVLink` removes the NVLink switch. Units: GB/s, TB/s (decimal bytes), Gbit/s (bits).
    """
    catalog = catalog or builtin_catalog()
    clauses = [c.strip() for c in str(text).split(",") if c.strip()]
    if not clauses:
        raise InputError("topology spec", "text like '2 nodes x 8 H100, 400 Gbit/s NIC per GPU'", repr(text))
    head = re.fullmatch(r"(?:(\d+)\s*(?:nodes?|servers?)\s*[x×*]\s*)?(\d+)\s*[x×]?\s*(.+)", clauses[0], re.I)
    if not head:
        raise InputError("topology spec", "a first clause like '2 nodes x 8 H100'", repr(clauses[0]))
    servers, per_server = int(head.group(1) or 1), int(head.group(2))
    gpu = catalog.gpu(head.group(3).strip())
    options: dict[str, float] = {}
    for clause in clauses[1:]:
        low = clause.lower()
        if re.fullmatch(r"no\s+nvlink", low):
            options["nvlink_bytes_per_s"] = 0.0
            continue
        match = re.search(_BW, low)
        if not match:
            raise InputError("topology spec", "a bandwidth like '450 GB/s' or '400 Gbit/s' in each clause", repr(clause))
        bw = _bandwidth(match.group(1), match.group(2))
        if "host" in low:
            key = "host_pcie_bytes_per_s"
        elif "nvlink" in low:
            key = "nvlink_bytes_per_s"
        elif "between" in low or "uplink" in low or "fabric" in low:
            key = "inter_server_bytes_per_s"
        elif "nic" in low:
            key = "nic_bytes_per_s"
        elif "pcie" in low:
            key = "pcie_bytes_per_s"
        else:
            raise InputError("topology spec", "a clause naming NVLink, NIC, PCIe, host PCIe or 'between nodes'",
                             repr(clause))
        options[key] = bw
    return build_cluster(gpu, servers, per_server, **options)


def topology_from_table(table: dict, catalog: Catalog | None = None, where: str = "topology") -> Topology:
    """A topology from a scenario/topology-file table.

    Either `spec = "2 nodes x 8 H100, ..."`, or keys: gpu, nodes, gpus_per_node, nvlink_gb_per_s,
    nic_gbit_per_s (or nic_gb_per_s), inter_node_gb_per_s, pcie_gb_per_s, host_pcie_gb_per_s,
    or `file = "topo.toml"` holding one of these in a [topology] table. Either form takes
    `links = [{from, to, gb_per_s}]` to set single link directions (see `with_link_overrides`).
    """
    catalog = catalog or builtin_catalog()
    known = {"gpu", "nodes", "gpus_per_node", "nvlink_gb_per_s", "nic_gbit_per_s", "nic_gb_per_s",
             "inter_node_gb_per_s", "pcie_gb_per_s", "host_pcie_gb_per_s", "links", "spec", "file"}
    check_keys(table, known, where)
    for form, allowed in (("file", {"file"}), ("spec", {"spec", "links"})):
        extra = sorted(set(table) - allowed)
        if form in table and extra:  # the spec or file names the whole cluster: another key would be ignored
            raise InputError(f"{where}.{extra[0]}", f"no other key beside {form} (it names the whole cluster)",
                             f"{extra[0]} and {form}")
    if "file" in table:
        data = read_table_file(table["file"])
        return topology_from_table(data.get("topology", data), catalog, str(table["file"]))
    links = table.get("links", [])
    if "spec" in table:
        return with_link_overrides(parse_topology_spec(str(table["spec"]), catalog), links, where)
    if "gpu" not in table:
        raise InputError(f"{where}.gpu", "a GPU part name", "nothing")
    gpu = catalog.gpu(str(table["gpu"]))
    options: dict[str, float] = {}
    for key, name in (("nvlink_gb_per_s", "nvlink_bytes_per_s"), ("nic_gb_per_s", "nic_bytes_per_s"),
                      ("inter_node_gb_per_s", "inter_server_bytes_per_s"), ("pcie_gb_per_s", "pcie_bytes_per_s"),
                      ("host_pcie_gb_per_s", "host_pcie_bytes_per_s")):
        if key in table:
            options[name] = gb_per_s(get_number(table, key, where, allow_zero=key in ("nvlink_gb_per_s",)))
    if "nic_gbit_per_s" in table:
        options["nic_bytes_per_s"] = gbit_per_s(get_number(table, "nic_gbit_per_s", where))
    nodes = table.get("nodes", 1)
    per = table.get("gpus_per_node", 8)
    return with_link_overrides(build_cluster(gpu, nodes, per, **options), links, where)


def with_link_overrides(topology: Topology, links: list, where: str = "topology") -> Topology:
    """A copy of `topology` with the bandwidth of single link directions replaced.

    links: `[{from = "leaf0", to = "spine", gb_per_s = 50}, ...]` (or `gbit_per_s`), one direction each,
    e.g. a degraded NIC or an asymmetric uplink. The edge must exist in the graph.
    """
    if not links:
        return topology
    if not isinstance(links, list):
        raise InputError(f"{where}.links", "a list of {from, to, gb_per_s} tables", type(links).__name__)
    graph = nx.DiGraph(topology.graph)
    for i, link in enumerate(links):
        here = f"{where}.links[{i}]"
        if not isinstance(link, dict) or "from" not in link or "to" not in link:
            raise InputError(here, "a table with from, to and gb_per_s (or gbit_per_s)", repr(link))
        check_keys(link, ("from", "to", "gb_per_s", "gbit_per_s"), here)
        u, v = str(link["from"]), str(link["to"])
        if not graph.has_edge(u, v):
            raise InputError(here, "an existing link direction (nodes like gpu0, nvswitch0, nic0, leaf0, spine, "
                                   "host0)", f"{u}->{v}")
        if "gbit_per_s" in link:
            capacity = gbit_per_s(get_number(link, "gbit_per_s", here))
        else:
            capacity = gb_per_s(get_number(link, "gb_per_s", here))
        graph.edges[u, v]["capacity"] = capacity
    return Topology(graph, topology.gpu, topology.num_servers, topology.gpus_per_server)
