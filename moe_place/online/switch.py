"""The double-buffered map switch: the map in use stays valid until in-flight batches drain.

A rebalance decided after step `t` copies the new replicas into free buffers while the old map
keeps serving (no slot of the old map is overwritten). When the copies run beside serving
(asynchronous migration) they take `copy_steps` steps; then batches already dispatched with the
old map, up to `drain_steps` of them in a pipelined engine, finish with it; the new map takes
effect at step `t + 1 + copy_steps + drain_steps`. Only then are the old replicas released. So
during a switch each receiving GPU holds both copies: the staging memory of a rebalance is its bytes moved.

A layer walk (`schedule_layers`) is how vLLM's asynchronous worker commits a new map
(`vllm/distributed/eplb/async_worker.py`, 0.33): one layer per forward pass, every layer in
order whether its row changed or not; layer `l` takes effect at its own step, so the map in use
mixes old and new rows until the walk ends, and the engine asks its policy again only after it.

Invariants (checked on every transition): both maps are valid `Placement`s of the same shape,
one switch at a time, and the map returned for a step is never a half-written one (a walk's
mixed maps are whole rows of the two valid maps, each valid).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moe_place.errors import InputError
from moe_place.placement import Placement

__all__ = ["MapSwitch"]


@dataclass
class MapSwitch:
    """The map in use (`active`) and at most one `pending` map with the step it takes effect.

    layer_steps: int64 `[layers]`, the step each layer's row takes effect, during a layer walk
        (None for a whole-map switch, which takes effect at `switch_step`).
    """

    active: Placement
    drain_steps: int = 1
    pending: Placement | None = None
    switch_step: int | None = None
    staging_bytes: int = 0
    layer_steps: np.ndarray | None = None
    _old: Placement | None = field(default=None, repr=False)   # the map a walk started from

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

    def busy_at(self, step: int) -> bool:
        """After batch `step` (its map already taken with `map_for_step`): is a switch still under way?
        A walk is done once its last layer takes effect with the next batch."""
        if self.pending is None:
            return False
        if self.layer_steps is not None:
            return int(self.layer_steps.max()) > step + 1
        return True

    def map_for_step(self, step: int) -> Placement:
        """The map that serves batch `step`, completing a due switch (or a walk's due layers) first."""
        if self.pending is None:
            return self.active
        if self.layer_steps is None:
            if step >= self.switch_step:
                self._complete(self.pending)
            return self.active
        due = self.layer_steps <= step
        if due.all():
            self._complete(self.pending)
        elif due.any():
            rows = np.where(due[:, None], self.pending.phy2log, self._old.phy2log)
            if not np.array_equal(rows, self.active.phy2log):
                self.active = Placement(rows, self.pending.num_experts, self.pending.num_gpus,
                                        self.pending.num_nodes, allow_colocated=True)
        return self.active

    def _complete(self, new: Placement) -> None:
        self.active, self.pending, self.switch_step, self.layer_steps = new, None, None, None
        self.staging_bytes = 0

    def _check(self, new: Placement, decided_at_step: int) -> None:
        if self.pending is not None and not self.busy_at(decided_at_step):
            self._complete(self.pending)   # a walk whose last layer takes effect with the next batch
        if self.pending is not None:
            raise InputError("map switch", "no switch in flight (one at a time)", f"one due at step {self.switch_step}")
        old = self.active
        if not isinstance(new, Placement):
            raise InputError("new map", "a Placement", type(new).__name__)
        if (new.num_layers, new.num_physical, new.num_experts, new.num_gpus) != (
                old.num_layers, old.num_physical, old.num_experts, old.num_gpus):
            raise InputError("new map", f"the shape of the map in use {old.phy2log.shape}", new.phy2log.shape)

    def schedule(self, new: Placement, decided_at_step: int, staging_bytes: int = 0, copy_steps: int = 0) -> int:
        """Start a switch to `new` after step `decided_at_step`, its copies running beside `copy_steps`
        steps; returns the step it takes effect."""
        self._check(new, decided_at_step)
        if copy_steps < 0:
            raise InputError("copy_steps", "an integer >= 0", copy_steps)
        self.pending = new
        self.switch_step = decided_at_step + 1 + int(copy_steps) + self.drain_steps
        self.staging_bytes = int(staging_bytes)
        return self.switch_step

    def schedule_layers(self, new: Placement, decided_at_step: int, layer_copy_steps: np.ndarray,
                        staging_bytes: int = 0) -> int:
        """A layer walk to `new` after step `decided_at_step` (module note): layer `l` takes
        `layer_copy_steps[l]` steps (at least one, changed or not), one layer after another, and
        takes effect `drain_steps` batches after its copies; returns the step the walk ends."""
        self._check(new, decided_at_step)
        steps = np.asarray(layer_copy_steps, dtype=np.int64)
        if steps.shape != (new.num_layers,) or (steps < 1).any():
            raise InputError("layer_copy_steps", f"[{new.num_layers}] integers >= 1", steps.tolist())
        self.pending, self._old = new, self.active
        self.layer_steps = decided_at_step + np.cumsum(steps) + self.drain_steps
        self.switch_step = int(self.layer_steps.max())
        self.staging_bytes = int(staging_bytes)
        return self.switch_step
