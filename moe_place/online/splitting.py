"""Where the per-batch split pays: a per-layer choice made at each policy call.

The split (`moe_place.split`) lowers a layer's busiest GPU in each batch, but it costs the layer an all-reduce
of the batch's counts and a solve on its critical path (`moe_place.cost.replicas.split_overhead_s`). Without
redundant experts it can move nothing; on small batches, or where the replicas already share the load well,
it saves less than it costs. So at every call the engine makes, `SplitChoice.decide` prices, per layer and on
the map the engine will run, the mean layer time of a batch (dispatch, the busiest GPU's expert time, combine:
`ReplayCost.served_times_s`) under the engine's own replica choice and under the split, over batches like the
window's, and turns the split on where the saving is more than the overhead (times `1 + margin`). A layer's choice stands while its map row is unchanged, for up to `REFRESH_STEPS`
steps, so a short cadence does not pay for it at every call (the choice is part of the policy's call and
its CPU time is the policy's, which SGLang and vLLM's sync mode wait for). Two cases cost next to nothing:
a layer whose map replicates no expert is off without pricing (the split has no choice to make there), and
a layer priced off by a wide margin (its saving at most `SETTLED_SHARE` of the overhead) stays off, unpriced,
until its map gains a replicated expert or its batches grow by more than `SETTLED_GROWTH`: what the split can
save there is set by the batch's size and the GPUs' time per row, which the rule's moves barely change (it
moves slots to lower the busiest GPU, which lowers the saving further); such a layer is looked at again when
its map row changes or `REFRESH_STEPS` after the last look. A call on the same map array as the last one,
with no choice old, returns the last choice at once.

Batches like the window's: the window's own steps where the engine hands them (SGLang's per-pass counts, the
last `samples` of them); where it hands their sum (vLLM), `samples` batches drawn from it, each a multinomial
draw of the window's mean batch (the dispatches of one batch spread over the experts in the window's
proportions), seeded by the call's index, so the choice repeats. A batch's imbalance is mostly that
sampling noise, which the window's mean hides.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moe_place.errors import InputError
from moe_place.cost.cluster import ReplayCost
from moe_place.placement import Placement

SPLIT_SAMPLES = 4       # batches priced per call (its CPU time is the policy call's)
BOUND_SLACK = 1.5       # a layer is priced in full unless 1.5 x the most it could save is below the overhead
CHOICE_SWEEPS = 8       # the choice needs the saving to a few percent, not the split's last 0.1%
REFRESH_STEPS = 1000    # a layer's choice stands until its map row changes or it is this old: the engines'
                        # own re-planning period (SGLang's default interval, vLLM's window)
SETTLED_SHARE = 0.5     # off by a wide margin: a priced saving at most half the overhead (a round margin, not tuned)
SETTLED_GROWTH = 1.5    # ... until the layer's rows per batch grow by half (a round margin, not tuned)


@dataclass
class SplitChoice:
    """The per-layer split choice (module note).

    cost: the serving cost model, with the engine's own replica choice (`ReplayCost.replica_choice`) and the
        split's solve time (`split_solve_s`). margin: the saving must exceed the overhead by this share.
    on: bool `[layers]`, the last choice (None before the first call). saving_s: float `[layers]`, the
        last priced saving per batch (layer time under the engine's choice minus under the split, before
        the overhead).
    """

    cost: ReplayCost
    samples: int = SPLIT_SAMPLES
    margin: float = 0.0
    seed: int = 0
    on: np.ndarray | None = field(default=None, init=False)
    saving_s: np.ndarray | None = field(default=None, init=False)
    calls: int = field(default=0, init=False)
    _rows: np.ndarray | None = field(default=None, init=False, repr=False)          # the map rows last decided on
    _decided_at: np.ndarray | None = field(default=None, init=False, repr=False)    # [layers] the step of each choice
    _replicated: np.ndarray | None = field(default=None, init=False, repr=False)    # [layers] rows last decided on
    _batch_rows: np.ndarray | None = field(default=None, init=False, repr=False)    # [layers] rows per batch then
    _seen: np.ndarray | None = field(default=None, init=False, repr=False)          # the map array the last call saw
    _next_due: int = field(default=0, init=False, repr=False)                        # the step a choice falls old

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise InputError("split samples", "an integer >= 1", self.samples)
        if not self.margin >= 0:
            raise InputError("split margin", "a share >= 0", self.margin)

    def decide(self, window: np.ndarray, window_steps: int, placement: Placement, step: int | None = None) -> np.ndarray:
        """bool `[layers]`: the layers whose batches the split should take, from the engine's window
        (`[layers, E]` summed over `window_steps` steps, or `[steps, layers, E]` per step) and the map it runs.

        A layer whose saving cannot reach the overhead is settled first, without solving a split: the split
        cannot bring the busiest GPU below the mean GPU's rows, so its saving is at most the busiest GPU's
        time less that GPU's time with its rows scaled down to the mean (`ceiling_s`); where `BOUND_SLACK`
        times that is still below the overhead, the layer stays off. The others are priced in full."""
        layers = placement.num_layers
        first = self.on is None or step is None or self._rows.shape != placement.phy2log.shape
        if not first and placement.phy2log is self._seen and step < self._next_due:
            self.calls += 1   # the map the last call saw, no choice old: nothing to do (most short-cadence calls)
            return self.on
        self._seen = placement.phy2log
        overhead = self.cost.split_overhead_s * (1.0 + self.margin)
        if first:
            self.on, self.saving_s = np.zeros(layers, dtype=bool), np.zeros(layers)
            self._decided_at, self._batch_rows = np.zeros(layers, dtype=np.int64), np.zeros(layers)
            self._replicated, changed = np.zeros(layers, dtype=bool), np.ones(layers, dtype=bool)
            due = changed.copy()
        else:   # a layer whose map row changed or whose choice is old (most calls: none, and nothing to do)
            changed = (placement.phy2log != self._rows).any(axis=1)
            due = changed | (step - self._decided_at >= REFRESH_STEPS)
        self.calls += 1
        if not due.any():
            return self._chosen()
        self._rows = placement.phy2log.copy()
        replicated = self._replicated.copy()
        if placement.num_physical > placement.num_experts:   # a valid map holds every expert: P = E leaves no room
            replicated[changed] = replicates_an_expert(placement.phy2log[changed])
        window = np.asarray(window, dtype=np.float64)
        batch_rows = window.sum(axis=(0, 2) if window.ndim == 3 else 1) / max(window_steps, 1)   # [layers]
        if not first:   # settled off stays off (module note), looked at again an interval of choices later
            settled = due & ~self.on & (self.saving_s <= SETTLED_SHARE * overhead) & (replicated <= self._replicated) \
                & (batch_rows <= SETTLED_GROWTH * self._batch_rows)
            due &= ~settled
            self._decided_at[settled] = step
        self._replicated = replicated
        self._batch_rows[due] = batch_rows[due]
        plain = due & ~replicated   # nothing to split: off, unpriced
        self.on[plain], self.saving_s[plain] = False, 0.0
        if step is not None:
            self._decided_at[plain] = step
        due &= replicated
        if due.any():   # first on the window's mean batch, with room for a batch's noise (no split solved)
            mean = (window.sum(axis=0) if window.ndim == 3 else window) / max(window_steps, 1)
            ceiling = self._noisy_ceiling_s(placement.phy2log[due], mean[due])
            settled = np.flatnonzero(due)[ceiling <= overhead]
            self.on[settled], self.saving_s[settled] = False, ceiling[ceiling <= overhead]
            if step is not None:
                self._decided_at[settled] = step
            due[settled] = False
        if not due.any():
            return self._chosen()
        batches = self._batches(window, window_steps)[:, due]   # [n, due layers, E]
        n, count, experts = batches.shape
        rows = np.broadcast_to(placement.phy2log[due][None], (n, count, placement.num_physical)).reshape(n * count, -1)
        flat = batches.reshape(n * count, experts)
        engine, ceiling, _ = self._ceiling_s(rows, flat)
        saving = ceiling.reshape(n, count).mean(axis=0)
        open_ = BOUND_SLACK * saving > overhead
        if open_.any():
            take = np.broadcast_to(open_[None], (n, count)).reshape(-1)
            split, comm, _ = self.cost.served_times_s(rows[take], flat[take], split=True, max_sweeps=CHOICE_SWEEPS)
            saving[open_] = (engine[take] - (split + comm - self.cost.split_overhead_s)).reshape(n, -1).mean(axis=0)
        self.saving_s[due] = saving
        self.on[due] = open_ & (saving > overhead)
        if step is not None:
            self._decided_at[due] = step
        return self._chosen()

    def _chosen(self) -> np.ndarray:
        self._next_due = int(self._decided_at.min()) + REFRESH_STEPS
        return self.on

    def _noisy_ceiling_s(self, rows: np.ndarray, mean: np.ndarray) -> np.ndarray:
        """float64 `[n]`: the most the split could save on a batch drawn around the mean batch `mean [n, E]` of map
        rows `[n, P]`: the mean batch's ceiling (`_ceiling_s`) plus what the busiest GPU's noise can add, `sqrt(2
        ln G)` standard deviations of its rows (the expected maximum of G independent counts), each row priced at
        that GPU's time per row (its fixed costs included: more than a row's marginal time)."""
        engine, ceiling, busiest = self._ceiling_s(rows, mean)
        noise = np.sqrt(2.0 * np.log(max(self.cost.num_gpus, 2)) * busiest)
        return ceiling + noise * np.divide(engine, busiest, out=np.zeros(len(rows)), where=busiest > 0)

    def _ceiling_s(self, rows: np.ndarray, loads: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(layer time under the engine's replica choice `[n]`, the most the split can save `[n]`, the busiest
        GPU's rows `[n]`) of map rows `[n, P]` serving `loads [n, E]` (the `decide` note): the expert time down to
        the busiest GPU's rows scaled to the mean, dispatch and combine down to those of every GPU at the mean."""
        gpus = self.cost.num_gpus
        slots = self.cost.slot_rows(rows, loads).reshape(len(rows), gpus, -1)
        times = self.cost.gpu_times_s(slots)                                             # [n, G]
        busiest = np.argmax(times, axis=1)
        top = slots[np.arange(len(rows)), busiest]                                       # [n, S]
        per_gpu = slots.sum(axis=2)                                                      # [n, G]
        scale = np.divide(per_gpu.mean(axis=1), top.sum(axis=1), out=np.ones(len(rows)), where=top.sum(axis=1) > 0)
        floor = self.cost.gpu_times_s((top * np.minimum(scale, 1.0)[:, None])[:, None, :])[:, 0]
        comm = self.cost.comm_times_s(np.concatenate([per_gpu, np.repeat(per_gpu.mean(axis=1, keepdims=True), gpus,
                                                                        axis=1)])).reshape(2, -1)
        engine = times.max(axis=1) + comm[0]
        return engine, np.maximum(engine - floor - comm[1], 0.0), top.sum(axis=1)

    def _batches(self, window: np.ndarray, window_steps: int) -> np.ndarray:
        if window.ndim == 3:
            return np.rint(window[-self.samples:])
        mean = window / max(window_steps, 1)                                            # [layers, E]
        rng = np.random.default_rng([self.seed, self.calls])
        out = np.zeros((self.samples, *mean.shape))
        for layer, row in enumerate(mean):
            total = int(round(row.sum()))
            if total > 0:
                out[:, layer] = rng.multinomial(total, row / row.sum(), size=self.samples)
        return out


def replicates_an_expert(phy2log: np.ndarray) -> np.ndarray:
    """bool `[layers]`: whether the layer's map row of `phy2log [layers, P]` holds some expert more than once."""
    rows = np.sort(np.asarray(phy2log), axis=1)
    return (rows[:, 1:] == rows[:, :-1]).any(axis=1)
