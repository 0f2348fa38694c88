"""What a re-plan moves and what the move costs: the one model of a migration.

Used by the online controller (its payback rule), the replay (what a rebalance pays), the payback
calculator (`moe_place.cost.payback`, formula 7) and, through `moved_slots`, the planner's
migration mode, which counts and caps exactly these moves.

What moves. Going from map `old` to map `new` (same shape), every slot whose logical expert
changes (`Placement.moved_slots`) receives one copy of its new expert's weights, `W_e` bytes.
The copy comes from the holder of that expert in `old` with the cheapest route to the slot's
GPU: the same GPU (a local copy, free of links), else the widest route of the topology (NVLink
inside a server before the NIC across servers), lowest GPU index on ties. The old map stays
valid until the switch, so every old replica can serve as a source.

What the copies take (`copy_time_s`):
- `serial`: one after another, `sum (W_e / B_path + alpha)` over copies between GPUs (formula 7);
- `parallel`: all at once, `alpha + max over links (bytes crossing it / capacity)`, the lower bound
  of a fair schedule, what a batched send/receive approaches.

What serving pays for them (`MIGRATION_MODELS`):
- `stall`: serving stops while the copies run; the whole copy time is paid.
- `async`: the copies run on a side stream while serving goes on with the old map (vLLM's
  `use_async`, SGLang's layer-chunked updates); the switch comes after the copies complete. The
  contention model: a step is `t` seconds of expert compute, during which the links carry no
  serving traffic, and `d` seconds of dispatch + combine on the links (`ReplayCost.served_times_s`).
  Copies use a link at full bandwidth while serving leaves it idle and share it fairly (half each)
  with dispatch/combine otherwise. So a step carries `t + d` seconds of copy work, the copies
  complete after `T_copy / (t + d)` steps, and each second of copy work done beside
  dispatch/combine delays them by one second: serving pays `T_copy * d / (t + d)` in all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from moe_place.cost.topology import Topology
from moe_place.errors import InputError
from moe_place.placement import Placement

__all__ = ["Copy", "CopyPlan", "Migration", "MigrationCharge", "copy_path", "copy_time_s", "copy_times_by_layer",
           "moved_slots", "plan_copies", "plan_copy_arrays"]

COPY_SCHEDULES = ("serial", "parallel")
MIGRATION_MODELS = ("stall", "async")


@dataclass(frozen=True)
class Copy:
    """Copy one expert's weights (`num_bytes`) from GPU `src_gpu` to GPU `dst_gpu`.

    layer / slot / expert: what the copy fills (the slot of `layer` that receives logical `expert`);
    -1 when the copy is not tied to a placement (a payback scenario's list of copies).
    """

    src_gpu: int
    dst_gpu: int
    num_bytes: float
    layer: int = -1
    slot: int = -1
    expert: int = -1

    def __post_init__(self) -> None:
        if not self.num_bytes > 0:
            raise InputError("copy bytes", "a number > 0", self.num_bytes)

    @property
    def local(self) -> bool:
        """True for a copy within one GPU (no link crossed, no time)."""
        return self.src_gpu == self.dst_gpu


def moved_slots(old: Placement, new: Placement) -> np.ndarray:
    """bool `[layers, P]`: the slots a re-plan fills with a copy (their logical expert changes)."""
    return new.moved_slots(old)


@dataclass(frozen=True)
class CopyPlan:
    """The copies of a re-plan as arrays, one entry per moved slot (what `plan_copies` lists).

    src / dst / layer / slot / expert: int64 `[copies]`, in layer, slot order.
    num_bytes: bytes of each copy (one expert's weights).
    """

    src: np.ndarray
    dst: np.ndarray
    layer: np.ndarray
    slot: np.ndarray
    expert: np.ndarray
    num_bytes: float

    def __len__(self) -> int:
        return len(self.src)

    @property
    def local(self) -> np.ndarray:
        """bool `[copies]`: copies within one GPU."""
        return self.src == self.dst

    def to_copies(self) -> list[Copy]:
        return [Copy(int(s), int(d), float(self.num_bytes), int(layer), int(slot), int(e))
                for s, d, layer, slot, e in zip(self.src, self.dst, self.layer, self.slot, self.expert)]


def plan_copy_arrays(old: Placement, new: Placement, topology: Topology, expert_bytes: float,
                     layers: np.ndarray | None = None) -> CopyPlan:
    """`plan_copies` as a `CopyPlan` (arrays, no per-copy objects: what a policy call can afford)."""
    if new.num_gpus > topology.num_gpus:
        raise InputError("placement num_gpus", f"at most the topology's {topology.num_gpus} GPUs", new.num_gpus)
    if not expert_bytes > 0:
        raise InputError("copy bytes", "a number > 0", expert_bytes)
    moved = moved_slots(old, new)
    if layers is not None:
        keep = np.zeros(old.num_layers, dtype=bool)
        keep[np.asarray(layers, dtype=np.int64)] = True
        moved = moved & keep[:, None]
    per_gpu = old.slots_per_gpu
    bandwidth = topology.path_bandwidths()                        # [src GPU, dst GPU], inf on the diagonal
    slot_gpu = np.arange(old.num_physical) // per_gpu
    held = np.zeros((old.num_layers, old.num_experts, old.num_gpus), dtype=bool)   # old GPU g holds e
    held[np.arange(old.num_layers)[:, None], old.phy2log, slot_gpu[None, :]] = True
    layer, slot = np.nonzero(moved)                               # every copy at once, in layer, slot order
    expert = new.phy2log[layer, slot]
    dst = slot // per_gpu
    width = np.where(held[layer, expert], bandwidth.T[dst], -1.0)   # [copies, GPUs]: route width from each holder
    src = np.argmax(width, axis=1)                                 # the widest holder, lowest GPU on ties
    as_int = lambda a: np.asarray(a, dtype=np.int64)  # noqa: E731
    return CopyPlan(as_int(src), as_int(dst), as_int(layer), as_int(slot), as_int(expert), float(expert_bytes))


def plan_copies(old: Placement, new: Placement, topology: Topology, expert_bytes: float,
                layers: np.ndarray | None = None) -> list[Copy]:
    """The copies that turn `old` into `new`: one per moved slot, from the cheapest holder (module note).

    layers: restrict to these layers (default: all). Returned in layer, slot order.
    """
    return plan_copy_arrays(old, new, topology, expert_bytes, layers).to_copies()


def copy_times_by_layer(topology: Topology, plan: CopyPlan, num_layers: int, alpha_s: float = 0.0,
                        schedule: str = "serial") -> np.ndarray:
    """float64 `[layers]`: `copy_time_s` of each layer's copies of `plan` on their own."""
    between = ~plan.local
    src, dst, layer = plan.src[between], plan.dst[between], plan.layer[between]
    if schedule == "serial":
        seconds = plan.num_bytes / topology.path_bandwidths()[src, dst] + alpha_s
        return np.bincount(layer, weights=seconds, minlength=num_layers)
    if schedule == "parallel":
        # sparse: each copy adds its bytes to the links of its route (no dense matrix product)
        _, capacity, _ = topology.route_incidence()
        start, edge = topology.route_hops()
        pair = src * topology.num_gpus + dst
        hops = start[pair + 1] - start[pair]                       # links each copy crosses
        copy_of_hop = np.repeat(np.arange(len(pair)), hops)
        first_hop = np.repeat(np.cumsum(hops) - hops, hops)        # where each copy's hops begin below
        edge_of_hop = edge[np.repeat(start[pair], hops) + np.arange(hops.sum()) - first_hop]
        loads = np.bincount(layer[copy_of_hop] * len(capacity) + edge_of_hop,
                            minlength=num_layers * len(capacity)).reshape(num_layers, -1) * plan.num_bytes
        busiest = (loads / capacity).max(axis=1, initial=0.0)
        return np.where(np.bincount(layer, minlength=num_layers) > 0, busiest + alpha_s, 0.0)
    raise InputError("copy schedule", f"one of {', '.join(COPY_SCHEDULES)}", repr(schedule))


def copy_path(topology: Topology, copy: Copy) -> str:
    """The link kinds a copy crosses ("same GPU" for a local copy)."""
    return "same GPU" if copy.local else topology.path_kind(copy.src_gpu, copy.dst_gpu)


def copy_time_s(topology: Topology, copies: list[Copy], alpha_s: float = 0.0, schedule: str = "serial") -> float:
    """Seconds to make every copy under `schedule` ("serial" or "parallel", module note); local copies are free."""
    if alpha_s < 0:
        raise InputError("alpha_s", "seconds >= 0", alpha_s)
    if schedule == "serial":
        bandwidth = topology.path_bandwidths()
        total = 0.0
        for c in copies:
            if not c.local:
                total += c.num_bytes / bandwidth[topology.check_gpu(c.src_gpu, "copy source"),
                                                 topology.check_gpu(c.dst_gpu, "copy destination")] + alpha_s
        return total
    if schedule == "parallel":
        volume = np.zeros((topology.num_gpus, topology.num_gpus))
        for c in copies:
            volume[topology.check_gpu(c.src_gpu, "copy source"),
                   topology.check_gpu(c.dst_gpu, "copy destination")] += c.num_bytes
        np.fill_diagonal(volume, 0.0)
        loads = topology.link_loads_bytes(volume)
        if not loads:
            return 0.0
        return alpha_s + max(load / topology.graph.edges[e]["capacity"] for e, load in loads.items())
    raise InputError("copy schedule", f"one of {', '.join(COPY_SCHEDULES)}", repr(schedule))


@dataclass(frozen=True)
class MigrationCharge:
    """What serving pays for one rebalance's copies.

    copy_s: the copies' own time (`copy_time_s`). charged_s: what serving pays (the copy time for
    `stall`, the contention delay for `async`). steps: whole steps the copies run beside serving
    before the switch can happen (0 for `stall`: they run while serving waits).
    """

    copy_s: float
    charged_s: float
    steps: int


@dataclass(frozen=True)
class Migration:
    """The migration model of one cluster: copy sizes, routes, schedule and what serving pays.

    topology: the cluster. expert_bytes: `W_e`. alpha_s: fixed cost per copy. schedule: `COPY_SCHEDULES`.
    model: `MIGRATION_MODELS` (module note).
    """

    topology: Topology
    expert_bytes: float
    alpha_s: float = 5e-6
    schedule: str = "serial"
    model: str = "stall"

    def __post_init__(self) -> None:
        if self.schedule not in COPY_SCHEDULES:
            raise InputError("copy_schedule", f"one of {', '.join(COPY_SCHEDULES)}", self.schedule)
        if self.model not in MIGRATION_MODELS:
            raise InputError("migration", f"one of {', '.join(MIGRATION_MODELS)}", self.model)
        if self.alpha_s < 0:
            raise InputError("alpha_s", "seconds >= 0", self.alpha_s)
        if not self.expert_bytes > 0:
            raise InputError("expert_bytes", "a number > 0", self.expert_bytes)

    def copies(self, old: Placement, new: Placement, layers: np.ndarray | None = None) -> list[Copy]:
        """`plan_copies` on this cluster."""
        return plan_copies(old, new, self.topology, self.expert_bytes, layers)

    def copy_time_s(self, copies: list[Copy]) -> float:
        """Seconds the copies take under `schedule`."""
        return copy_time_s(self.topology, copies, self.alpha_s, self.schedule)

    def copy_plan(self, old: Placement, new: Placement, layers: np.ndarray | None = None) -> CopyPlan:
        """`plan_copy_arrays` on this cluster."""
        return plan_copy_arrays(old, new, self.topology, self.expert_bytes, layers)

    def copy_times_by_layer(self, plan: CopyPlan, num_layers: int) -> np.ndarray:
        """float64 `[layers]`: seconds each layer's copies take under `schedule`, layer by layer."""
        return copy_times_by_layer(self.topology, plan, num_layers, self.alpha_s, self.schedule)

    def path(self, copy: Copy) -> str:
        return copy_path(self.topology, copy)

    def charge(self, copies: list[Copy], expert_s: float = 0.0, comm_s: float = 0.0) -> MigrationCharge:
        """What serving pays for `copies` when a step takes `expert_s` of compute and `comm_s` of
        dispatch/combine (module note; both only matter for `async`)."""
        return self.charge_for(self.copy_time_s(copies), expert_s, comm_s)

    def charge_for(self, copy_s: float, expert_s: float = 0.0, comm_s: float = 0.0) -> MigrationCharge:
        """`charge` for copies that take `copy_s` seconds."""
        if self.model == "stall" or copy_s == 0.0:
            return MigrationCharge(copy_s, copy_s, 0)
        step_s = expert_s + comm_s
        if step_s <= 0:  # an idle cluster: the copies have the links to themselves
            return MigrationCharge(copy_s, 0.0, 1)
        return MigrationCharge(copy_s, copy_s * comm_s / step_s, max(1, math.ceil(copy_s / step_s)))
