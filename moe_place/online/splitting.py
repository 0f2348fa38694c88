"""Where the per-batch split pays: a per-layer choice made at each policy call.

The split (`moe_place.split`) lowers a layer's busiest GPU in each batch, but it costs the layer an all-reduce
of the batch's counts and a solve on its critical path (`moe_place.cost.replicas.split_overhead_s`). Without
redundant experts it can move nothing; on small batches, or where the replicas already share the load well,
it saves less than it costs. So at every call the engine makes, `SplitChoice.decide` prices, per layer and on
the map the engine will run, the mean expert time of a batch under the engine's own replica choice and under
the split, over batches like the window's, and turns the split on where the saving is more than the overhead
(times `1 + margin`).

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
from moe_place.online.costing import ReplayCost
from moe_place.placement import Placement

SPLIT_SAMPLES = 16      # batches priced per call


@dataclass
class SplitChoice:
    """The per-layer split choice (module note).

    cost: the serving cost model, with the engine's own replica choice (`ReplayCost.replica_choice`) and the
        split's solve time (`split_solve_s`). margin: the saving must exceed the overhead by this share.
    on: bool `[layers]`, the last choice (None before the first call). saving_s: float `[layers]`, the
        last priced saving per batch (expert time under the engine's choice minus under the split, before
        the overhead).
    """

    cost: ReplayCost
    samples: int = SPLIT_SAMPLES
    margin: float = 0.0
    seed: int = 0
    on: np.ndarray | None = field(default=None, init=False)
    saving_s: np.ndarray | None = field(default=None, init=False)
    calls: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise InputError("split samples", "an integer >= 1", self.samples)
        if not self.margin >= 0:
            raise InputError("split margin", "a share >= 0", self.margin)

    def decide(self, window: np.ndarray, window_steps: int, placement: Placement) -> np.ndarray:
        """bool `[layers]`: the layers whose batches the split should take, from the engine's window
        (`[layers, E]` summed over `window_steps` steps, or `[steps, layers, E]` per step) and the map it runs."""
        batches = self._batches(np.asarray(window, dtype=np.float64), window_steps)      # [n, layers, E]
        n, layers, experts = batches.shape
        rows = np.broadcast_to(placement.phy2log[None], (n, layers, placement.num_physical)).reshape(n * layers, -1)
        flat = batches.reshape(n * layers, experts)
        engine, _ = self.cost.served_times_s(rows, flat, split=False)
        split, _ = self.cost.served_times_s(rows, flat, split=True)
        overhead = self.cost.split_overhead_s
        self.saving_s = (engine - (split - overhead)).reshape(n, layers).mean(axis=0)
        self.on = self.saving_s > overhead * (1.0 + self.margin)
        self.calls += 1
        return self.on

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
