"""The double-buffered map switch: the map in use stays valid until in-flight batches drain.

A rebalance decided after step `t` copies the new replicas into free buffers while the old map
keeps serving (no slot of the old map is overwritten). When the copies run beside serving
(asynchronous migration) they take `copy_steps` steps; then batches already dispatched with the
old map, up to `drain_steps` of them in a pipelined engine, finish with it; the new map takes
effect at step `t + 1 + copy_steps + drain_steps`. Only then are the old replicas released. So
during a switch each receiving GPU holds both copies: the staging memory of a rebalance is its bytes moved.

Invariants (checked on every transition): both maps are valid `Placement`s of the same shape,
one switch at a time, and the map returned for a step is never a half-written one.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_place.errors import InputError
from moe_place.placement import Placement


@dataclass
class MapSwitch:
    """The map in use (`active`) and at most one `pending` map with the step it takes effect."""

    active: Placement
    drain_steps: int = 1
    pending: Placement | None = None
    switch_step: int | None = None
    staging_bytes: int = 0
    switches: int = 0

    def __post_init__(self) -> None:
        if self.drain_steps < 0:
            raise InputError("drain_steps", "an integer >= 0", self.drain_steps)

    @property
    def latest(self) -> Placement:
        """The map the engine will run once the pending switch (if any) completes."""
        return self.pending if self.pending is not None else self.active

    @property
    def busy(self) -> bool:
        return self.pending is not None

    def map_for_step(self, step: int) -> Placement:
        """The map that serves batch `step`, completing a due switch first."""
        if self.pending is not None and step >= self.switch_step:
            self.active, self.pending, self.switch_step = self.pending, None, None
            self.staging_bytes = 0
            self.switches += 1
        return self.active

    def schedule(self, new: Placement, decided_at_step: int, staging_bytes: int = 0, copy_steps: int = 0) -> int:
        """Start a switch to `new` after step `decided_at_step`, its copies running beside `copy_steps`
        steps; returns the step it takes effect."""
        if self.pending is not None:
            raise InputError("map switch", "no switch in flight (one at a time)", f"one due at step {self.switch_step}")
        old = self.active
        if not isinstance(new, Placement):
            raise InputError("new map", "a Placement", type(new).__name__)
        if (new.num_layers, new.num_physical, new.num_experts, new.num_gpus) != (
                old.num_layers, old.num_physical, old.num_experts, old.num_gpus):
            raise InputError("new map", f"the shape of the map in use {old.phy2log.shape}", new.phy2log.shape)
        self.pending = new
        if copy_steps < 0:
            raise InputError("copy_steps", "an integer >= 0", copy_steps)
        self.switch_step = decided_at_step + 1 + int(copy_steps) + self.drain_steps
        self.staging_bytes = int(staging_bytes)
        return self.switch_step
