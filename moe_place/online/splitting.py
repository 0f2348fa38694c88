"""Where the per-batch split pays: a per-layer choice made at each policy call.

The split (`moe_place.split`) lowers a layer's busiest GPU in each batch, but it costs the layer an all-reduce
of the batch's counts and a solve on its critical path (`moe_place.cost.replicas.split_overhead_s`). Without
redundant experts it can move nothing; on small batches, or where the replicas already share the load well,
it saves less than it costs. So at every call the engine makes, `SplitChoice.decide` prices, per layer and on
the map the engine will run, the mean layer time of a batch (dispatch, the busiest GPU's expert time, combine:
`ReplayCost.served_times_s`) under the engine's own replica choice and under the split, over batches like the
window's, and turns the split on where the saving is more than the overhead (times `1 + margin`). A layer's
choice stands while its map row is unchanged, for up to `REFRESH_STEPS` steps, so a short cadence does not
pay for it at every call (the choice is part of the policy's call and its CPU time is the policy's, which
SGLang and vLLM's sync mode wait for). A call spends at most `CHOICE_CPU_SHARE` of the layers' time until
the next call on the choice, at its committed price (`SCREEN_S_PER_SLOT`, `PRICE_S_PER_SLOT`); a layer it
cannot afford keeps its choice. Two cases cost next to nothing:
a layer whose map replicates no expert is off without pricing (the split has no choice to make there), and
a layer priced off by a wide margin (its saving at most `SETTLED_SHARE` of the overhead) stays off, unpriced,
until its map gains a replicated expert or its batches grow by more than `SETTLED_GROWTH`: what the split can
save there is set by the batch's size and the GPUs' time per row, which the rule's moves barely change (it
moves slots to lower the busiest GPU, which lowers the saving further); such a layer is looked at again when
its map row changes or `REFRESH_STEPS` after the last look. A call on the same map rows as the last one,
with no choice old, returns the last choice at once.

Batches like the window's: the window's own steps where the engine hands them (SGLang's per-pass counts, the
last `samples` of them); where it hands their sum (vLLM), `samples` batches drawn from it, each a multinomial
draw of the window's mean batch (the dispatches of one batch spread over the experts in the window's
proportions), seeded by the call's index, so the choice repeats. A batch's imbalance is mostly that
sampling noise, which the window's mean hides.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_place.errors import InputError
from moe_place.cost.cluster import ReplayCost
from moe_place.placement import Placement

__all__ = ["SplitChoice", "SplitState", "replicates_an_expert"]

SPLIT_SAMPLES = 4       # batches priced per call (its CPU time is the policy call's)
BOUND_SLACK = 1.5       # a layer is priced in full unless 1.5 x the most it could save is below the overhead
CHOICE_SWEEPS = 8       # the choice needs the saving to a few percent, not the split's last 0.1%
REFRESH_STEPS = 1000    # a layer's choice stands until its map row changes or it is this old: the engines'
                        # own re-planning period (SGLang's default interval, vLLM's window)
SETTLED_SHARE = 0.5     # off by a wide margin: a priced saving at most half the overhead (a round margin, not tuned)
SETTLED_GROWTH = 1.5    # ... until the layer's rows per batch grow by half (a round margin, not tuned)
CHOICE_CPU_SHARE = 0.002   # a call's choice may cost at most this share of the serving time until the next call
# the choice's CPU seconds per slot of a layer's map row it has not seen: the screen on the mean batch (the engine's
# replica tables built), and the pricing in full per batch priced (bench/bench_split.py's `choice_price`: at least
# the most over its sizes on one core of a 2-core AMD EPYC; tests/test_replicas.py checks them against that record)
SCREEN_S_PER_SLOT = 14.0e-6
PRICE_S_PER_SLOT = 8.0e-6


@dataclass(frozen=True)
class SplitState:
    """What the split's choice carries from one call to the next; `SplitChoice.decide` reads one and returns the
    next, never writing into the one it read.

    calls: calls answered (the sampled batches' seed takes it). on: bool `[L]`, the choice. saving_s: float64
    `[L]`, the last priced saving per batch (layer time under the engine's choice minus under the split, before
    the overhead; nan where the call could not afford to price the layer's row). rows: int64 `[L, P]`, the map
    rows last decided on. decided_at: int64 `[L]`, the step of each layer's choice. replicated: bool `[L]`,
    whether those rows replicate an expert. batch_rows: float64 `[L]`, rows per batch when each layer was
    decided. price_s: the committed price of this call's CPU time (`SCREEN_S_PER_SLOT`, `PRICE_S_PER_SLOT`), what
    a replay charges for it. step_s / step_rows: the layers' time per step (even split, the window's mean batch)
    that the budget is a share of, and the rows per step then (estimated again when those move by half).
    """

    calls: int
    on: np.ndarray
    saving_s: np.ndarray
    rows: np.ndarray
    decided_at: np.ndarray
    replicated: np.ndarray
    batch_rows: np.ndarray
    price_s: float = 0.0
    step_s: float = 0.0
    step_rows: float = 0.0

    @property
    def next_due(self) -> int:
        """The step at which the oldest choice falls old (`REFRESH_STEPS`)."""
        return int(self.decided_at.min()) + REFRESH_STEPS


@dataclass(frozen=True)
class SplitChoice:
    """The per-layer split choice (module note); the state between calls is a `SplitState`, handed in and
    returned by `decide`.

    cost: the serving cost model, with the engine's own replica choice (`ReplayCost.replica_choice`) and the
        split's solve time (`split_solve_s`). margin: the saving must exceed the overhead by this share.
    """

    cost: ReplayCost
    samples: int = SPLIT_SAMPLES
    margin: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise InputError("split samples", "an integer >= 1", self.samples)
        if not self.margin >= 0:
            raise InputError("split margin", "a share >= 0", self.margin)

    def decide(self, state: SplitState | None, window: np.ndarray, window_steps: int, placement: Placement,
               step: int | None = None, interval_steps: int | None = None,
               total: np.ndarray | None = None) -> SplitState:
        """The state after this call, whose `on` (bool `[layers]`) are the layers whose batches the split should
        take, from the engine's window (`[layers, E]` summed over `window_steps` steps, or `[steps, layers, E]` per
        step) and the map it runs; `state` None: the first call (as is every call without a `step`).

        A layer whose saving cannot reach the overhead is settled first, without solving a split: the split
        cannot bring the busiest GPU below the mean GPU's rows, so its saving is at most the busiest GPU's
        time less that GPU's time with its rows scaled down to the mean (`ceiling_s`); where `BOUND_SLACK`
        times that is still below the overhead, the layer stays off. The others are priced in full. Each stage
        takes only the layers the call can afford: its price (`price_s`) at most `CHOICE_CPU_SHARE` of the
        layers' time (even split, the window's mean batch) over the `interval_steps` until the next call (the
        engine may wait for it), the layers looked at longest ago first; the others keep their choice until their
        map row changes or it falls old (None: no cap). total: the window summed over its steps, float64
        `[layers, E]`, where the caller has it (the rule does)."""
        layers = placement.num_layers
        calls = 0 if state is None else state.calls
        first = state is None or step is None or state.rows.shape != placement.phy2log.shape
        if first:
            on, saving, decided_at = np.zeros(layers, dtype=bool), np.zeros(layers), np.zeros(layers, dtype=np.int64)
            batch_rows_then, old_replicated = np.zeros(layers), np.zeros(layers, dtype=bool)
            changed = np.ones(layers, dtype=bool)
            due = changed.copy()
        else:   # a layer whose map row changed or whose choice is old (most calls: none, and nothing to do)
            same = np.array_equal(placement.phy2log, state.rows)
            if same and step < state.next_due:   # (built directly: this is most calls)
                return SplitState(calls + 1, state.on, state.saving_s, state.rows, state.decided_at, state.replicated,
                                  state.batch_rows, 0.0, state.step_s, state.step_rows)
            changed = np.zeros(layers, dtype=bool) if same else (placement.phy2log != state.rows).any(axis=1)
            due = changed | (step - state.decided_at >= REFRESH_STEPS)
            on, saving, decided_at = state.on.copy(), state.saving_s.copy(), state.decided_at.copy()
            batch_rows_then, old_replicated = state.batch_rows.copy(), state.replicated
        replicated = old_replicated.copy()
        if placement.num_physical > placement.num_experts:   # a valid map holds every expert: P = E leaves no room
            replicated[changed] = replicates_an_expert(placement.phy2log[changed])
        step_s, step_rows = (0.0, 0.0) if first else (state.step_s, state.step_rows)

        def answer(price_s: float = 0.0) -> SplitState:
            return SplitState(calls + 1, on, saving, placement.phy2log.copy(), decided_at, replicated, batch_rows_then,
                              price_s, step_s, step_rows)

        if not due.any():
            return answer()
        slots = placement.num_physical
        overhead = self.cost.split_overhead_s * (1.0 + self.margin)
        window = np.asarray(window)
        if total is None:
            total = window.sum(axis=0, dtype=np.float64) if window.ndim == 3 else window.astype(np.float64)
        mean = total / max(window_steps, 1)                                    # the window's mean batch [layers, E]
        batch_rows = total.sum(axis=1) / max(window_steps, 1)
        if not first:   # settled off stays off (module note), looked at again an interval of choices later
            settled = due & ~on & (saving <= SETTLED_SHARE * overhead) & (replicated <= old_replicated) \
                & (batch_rows <= SETTLED_GROWTH * batch_rows_then)
            due &= ~settled
            decided_at[settled] = step
        batch_rows_then[due] = batch_rows[due]
        plain = due & ~replicated   # nothing to split: off, unpriced
        on[plain], saving[plain] = False, 0.0
        if step is not None:
            decided_at[plain] = step
        due &= replicated
        samples = len(window[-self.samples:]) if window.ndim == 3 else self.samples
        screen, price = SCREEN_S_PER_SLOT * slots, samples * PRICE_S_PER_SLOT * slots   # a layer's, each stage
        budget = np.inf
        if interval_steps is not None and due.any():
            rows_now = float(batch_rows.sum())
            if not step_rows or not step_rows / SETTLED_GROWTH <= rows_now <= step_rows * SETTLED_GROWTH:
                step_s = float(self.cost.rows_times_s(placement.phy2log, mean, placement.num_gpus).sum())
                step_rows = rows_now
            budget = CHOICE_CPU_SHARE * interval_steps * step_s

        def afford(each: float) -> None:   # the layers looked at longest ago first
            if budget == np.inf:
                return
            order, afforded = np.flatnonzero(due), max(int(budget // each), 0)
            if afforded >= order.size:
                return
            waiting = order[np.argsort(decided_at[order], kind="stable")][afforded:] if afforded else order
            due[waiting], saving[waiting] = False, np.nan   # its saving on this row: not priced (never settled)
            if step is not None:   # the choice stands until the row changes or falls old; dated a step before
                decided_at[waiting] = step - 1   # the layers decided now, so that it goes first when they tie

        afford(screen)
        screened = int(due.sum())
        if due.any():   # first on the window's mean batch, with room for a batch's noise (no split solved)
            ceiling = self._noisy_ceiling_s(placement.phy2log[due], mean[due])
            settled = np.flatnonzero(due)[ceiling <= overhead]
            on[settled], saving[settled] = False, ceiling[ceiling <= overhead]
            if step is not None:
                decided_at[settled] = step
            due[settled] = False
        budget -= screened * screen
        afford(price)
        if not due.any():
            return answer(screened * screen)
        batches = self._batches(window, mean, calls + 1)[:, due]   # [n, due layers, E]
        n, count, experts = batches.shape
        rows = np.broadcast_to(placement.phy2log[due][None], (n, count, placement.num_physical)).reshape(n * count, -1)
        flat = batches.reshape(n * count, experts)
        engine, ceiling, _ = self._ceiling_s(rows, flat)
        priced = ceiling.reshape(n, count).mean(axis=0)
        open_ = BOUND_SLACK * priced > overhead
        if open_.any():
            take = np.broadcast_to(open_[None], (n, count)).reshape(-1)
            split, comm, _ = self.cost.served_times_s(rows[take], flat[take], split=True, max_sweeps=CHOICE_SWEEPS)
            priced[open_] = (engine[take] - (split + comm - self.cost.split_overhead_s)).reshape(n, -1).mean(axis=0)
        saving[due] = priced
        on[due] = open_ & (priced > overhead)
        if step is not None:
            decided_at[due] = step
        return answer(screened * screen + count * price)

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

    def _batches(self, window: np.ndarray, mean: np.ndarray, calls: int) -> np.ndarray:
        if window.ndim == 3:
            return np.rint(np.asarray(window[-self.samples:], dtype=np.float64))
        rng = np.random.default_rng([self.seed, calls])
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
