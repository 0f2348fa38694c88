"""The load the coming interval will see, estimated from the windows an engine hands its policy.

A plan made at a call serves the steps until the next call, so it should be planned for their
load, not the window's: on a load that drifts, the last steps of the window say more about the
coming ones than its first steps; on a stationary load, every step recorded so far says the same
thing and more of them say it with less sampling noise. How much weight the past deserves is the
persistence of the load, which differs from model to model and workload to workload, so it is
measured, not assumed.

`LoadEstimate` keeps, per candidate half-life `h` (1, 4, 16, ... steps, up to
`MAX_HALF_LIFE_INTERVALS` of the engine's interval), an exponentially weighted mean of every step
it has seen, each step weighted `2 ** (-age / h)` by its age in steps (numerator and denominator
carried from call to call, so windows of any length and the gaps between them are weighted by
real time); and the flat window, the engine's own estimate (every step of the last window weighted
alike, nothing before it). At each call, before it sees the new window, each candidate's estimate
is scored on it: the squared error of its per-expert loads against the mean of each block of
the window's new steps (up to `SCORE_BLOCKS` blocks, each predicted from the steps before it, so
a per-step window scores a candidate many times per call; a summed window is one block), relative
to each layer's mean load, summed over layers and blocks, the scores discounted by
`SCORE_DISCOUNT` per call; the estimate used is the candidate with the lowest score (the flat window until a call
has been scored, and on ties). So:
- stationary load: the errors are sampling noise, which the longest memory averages best: a long
  half-life wins, and the estimate settles instead of following each window's noise;
- sudden change: every long memory mispredicts the first window after the change by far more
  than noise does; that one error outweighs the discounted history, and a short half-life (or the
  flat window) is chosen at that very call;
- slow drift: the half-life that tracks the drift best without chasing noise wins: on the
  replay's drifting traces (16,384 tokens a step) one to a few steps, fresher than any window,
  which only per-step windows can express (SGLang's per-pass counts). A summed window (vLLM 0.33
  hands the sum over its window) is one observation of its steps' mean: there the choice is
  between the flat window and memories of earlier windows.
A window that overlaps the previous call's adds, and is scored on, only its steps since that call
(per-step windows; a summed window counts as the steps since the last call).

`resample` draws what an independent estimate of the same load could have been (the rule's
noise floor, `moe_place.online.policy`): the window's part of the chosen estimate redrawn (a
bootstrap of its steps with their weights, or a multinomial draw of its counts), its deviation
scaled to the noise of every step the estimate weighs (earlier windows' steps were as noisy as this
one's: by sqrt(sum of all squared weights / this window's)) and by sqrt(2), as two independent
estimates differ by twice the variance of one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_place.errors import InputError

MAX_HALF_LIFE_INTERVALS = 8   # the longest memory: half its weight after 8 intervals
HALF_LIFE_FACTOR = 4           # candidates 1, 4, 16, ... steps: the estimates of neighbours differ little
SCORE_DISCOUNT = 0.75   # a score forgets half of a call's error in about 2.4 calls: one bad window
# after a change outweighs a long calm history, one noisy window does not undo a steady one
SCORE_BLOCKS = 32         # a per-step window is scored on up to this many blocks of its steps
BOOTSTRAP_MIN_STEPS = 8   # per-step windows with fewer steps are redrawn from their counts


class LoadEstimate:
    """The coming interval's per-step load `[layers, E]` (module note), with its state between calls.

    adaptive: False keeps the flat window (the engines' estimate) at every call.
    """

    def __init__(self, num_layers: int, num_experts: int, adaptive: bool = True):
        self.shape = (num_layers, num_experts)
        self.adaptive = adaptive
        self.half_lives = np.zeros(0)        # steps, one per candidate (set at the first call)
        self.chosen = float("inf")           # half-life in steps of the last estimate (inf: the flat window)
        self._calls = 0
        self._num = self._den = self._score = None
        self._flat = np.zeros(self.shape)    # the last window's mean per step: the flat window's estimate
        self._draw: _Draw | None = None      # what `resample` redraws

    @property
    def calls(self) -> int:
        return self._calls

    def update(self, window: np.ndarray, window_steps: int, elapsed_steps: int) -> np.ndarray:
        """float64 `[layers, E]`: the estimate after this call's window, per step.

        window: float `[n, layers, E]` per-step counts, or `[layers, E]` counts summed over `window_steps`.
        elapsed_steps: steps since the previous call (its interval; ignored at the first call).
        """
        loads = np.asarray(window, dtype=np.float64)
        per_step = loads.ndim == 3
        if loads.shape[-2:] != self.shape or loads.ndim not in (2, 3) or window_steps < 1 or elapsed_steps < 1:
            raise InputError("load window", f"[n, {self.shape[0]}, {self.shape[1]}] or {list(self.shape)} counts "
                             "over window_steps >= 1, elapsed_steps >= 1",
                             (list(loads.shape), window_steps, elapsed_steps))
        total = loads.sum(axis=0) if per_step else loads
        flat = total / window_steps
        if not per_step or not self.adaptive:   # a summed window is one observation of its steps' mean:
            self._flat, self._calls = flat, self._calls + 1   # the estimate is the window (module note)
            self.chosen = float("inf")
            self._draw = _Draw(np.zeros(self.shape), 0.0, loads if per_step else None,
                               np.full(len(loads), window_steps / len(loads)) if per_step else None,
                               total, float(window_steps), total)
            return flat
        first = self._calls == 0
        if first:
            longest = MAX_HALF_LIFE_INTERVALS * max(elapsed_steps, window_steps)
            self.half_lives = float(HALF_LIFE_FACTOR) ** np.arange(int(np.log(longest) / np.log(HALF_LIFE_FACTOR)) + 1)
            self._num = np.zeros((len(self.half_lives),) + self.shape)
            self._den = np.zeros(len(self.half_lives))
            self._den2 = np.zeros(len(self.half_lives))       # the sum of the squared weights: the noise
            self._score = np.zeros(len(self.half_lives) + 1)   # the flat window last
        decay = 0.5 ** (1.0 / self.half_lives)                                     # per step, per candidate
        new = window_steps if first else min(window_steps, elapsed_steps)          # steps not seen yet
        steps = min(new, len(loads))
        gap = 0 if first else max(elapsed_steps - steps, 0)                         # steps the engine did not record
        old_num, old_den = decay[:, None, None] ** gap * self._num, decay ** gap * self._den
        fresh = loads[-steps:]
        num, den, errors = self._fold_steps(fresh, old_num, old_den, decay, first)
        if errors is not None:
            self._score = SCORE_DISCOUNT * self._score + errors
        keep = decay ** steps
        ages = np.arange(steps - 1, -1, -1, dtype=np.float64)
        window_w2 = (decay[:, None] ** (2 * ages)[None, :]).sum(axis=1)       # the new steps' squared weights
        self._den2 = decay ** (2 * (gap + steps)) * self._den2 + window_w2
        self._num, self._den, self._flat = num, den, flat
        self._calls += 1
        best = self._best()
        if best is None:   # the flat window: every step of it alike, nothing before it
            self.chosen = float("inf")
            even = np.full(len(loads), window_steps / len(loads))
            self._draw = _Draw(np.zeros(self.shape), 0.0, loads, even, total, float(window_steps), total)
            return flat
        self.chosen = float(self.half_lives[best])
        base_num, base_den = keep[best] * old_num[best], float(keep[best] * old_den[best])
        weights = decay[best] ** np.arange(steps - 1, -1, -1, dtype=np.float64)
        self._draw = _Draw(base_num, base_den, fresh, weights, num[best] - base_num, float(den[best]) - base_den,
                           fresh.sum(axis=0), float(np.sqrt(self._den2[best] / window_w2[best])))
        return num[best] / den[best]

    def _best(self) -> int | None:
        """The candidate with the lowest score, None for the flat window (also on a tie and before any score)."""
        if not self._score.any():
            return None
        best = int(np.argmin(self._score[:-1]))
        return best if self._score[best] < self._score[-1] else None

    def _fold_steps(self, fresh: np.ndarray, num: np.ndarray, den: np.ndarray, decay: np.ndarray,
                    first: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Fold per-step counts `fresh [n, layers, E]` into every candidate, block by block, scoring each
        candidate's prediction of each block's mean before it sees the block (the flat window predicts the
        last window's mean; at the first call, the running mean of the steps before the block, and the first
        block, which nothing predicts, is not scored). Returns (num, den, errors or None)."""
        n = len(fresh)
        blocks = min(SCORE_BLOCKS, n)
        size = n // blocks
        lead = n - blocks * size                                  # folded before the first scored block
        if lead:
            w = decay[:, None] ** np.arange(lead - 1, -1, -1, dtype=np.float64)[None, :]
            num = decay[:, None, None] ** lead * num + np.tensordot(w, fresh[:lead], axes=(1, 0))
            den = decay ** lead * den + w.sum(axis=1)
        body = fresh[lead:].reshape((blocks, size) + self.shape)
        w = decay[:, None] ** np.arange(size - 1, -1, -1, dtype=np.float64)[None, :]        # [candidates, size]
        sums = np.einsum("cm,kmle->ckle", w, body)                                          # each block's weighted sum
        shrink, block_den = decay ** size, w.sum(axis=1)
        predictions = np.empty((len(decay), blocks) + self.shape)
        for k in range(blocks):
            predictions[:, k] = num / np.maximum(den, 1e-300)[:, None, None]
            num = shrink[:, None, None] * num + sums[:, k]
            den = shrink * den + block_den
        targets = body.mean(axis=1)                                                          # [blocks, layers, E]
        if first:
            if blocks < 2:
                return num, den, None
            running = np.cumsum(body.sum(axis=1), axis=0)[:-1] / (lead + size * np.arange(1, blocks))[:, None, None]
            flat = np.concatenate([running[:1], running])      # block 0's entry is dropped below
            errors = self._point_errors(predictions[:, 1:], flat[1:], targets[1:])
        else:
            errors = self._point_errors(predictions, self._flat[None], targets)
        return num, den, errors

    @staticmethod
    def _point_errors(predictions: np.ndarray, flat: np.ndarray, targets: np.ndarray) -> np.ndarray:
        """float64 `[candidates + 1]`: squared errors of the candidates' `predictions [C, ..., layers, E]` and
        the flat window's `flat [..., layers, E]` against `targets [..., layers, E]`, each relative to its
        layer's mean target load, summed."""
        scale = np.maximum(targets.mean(axis=-1, keepdims=True), 1e-12)
        candidates = (((predictions - targets[None]) / scale[None]) ** 2).reshape(len(predictions), -1).sum(axis=1)
        return np.append(candidates, (((flat - targets) / scale) ** 2).sum())

    def resample(self, layers: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """float64 `[len(layers), E]`: an estimate of these layers that differs from the last one as much
        as an independent estimate of the same load would (module note)."""
        d = self._draw
        layers = np.asarray(layers, dtype=np.int64)
        if d.samples is not None and len(d.samples) >= BOOTSTRAP_MIN_STEPS:
            picks = rng.integers(0, len(d.samples), size=len(d.samples))          # a bootstrap of the steps,
            mass = np.bincount(picks, weights=d.weights, minlength=len(d.samples))  # each draw with its weight
            part = np.tensordot(mass, d.samples[:, layers], axes=(0, 0))
        else:                    # a multinomial draw of the window's counts, weighted as the estimate weighs them
            counts = d.counts[layers]
            part = np.zeros_like(counts)
            for i, row in enumerate(counts):
                n = int(round(row.sum()))
                if n > 0:
                    part[i] = rng.multinomial(n, row / row.sum()) * (d.window_num[layers[i]].sum() / n)
        den = d.base_den + d.window_den
        current = (d.base_num[layers] + d.window_num[layers]) / den
        # the window's deviation, scaled to the whole estimate's noise (its earlier steps were as noisy)
        drawn = (d.base_num[layers] + d.window_num[layers] + d.noise_scale * (part - d.window_num[layers])) / den
        return np.clip(current + np.sqrt(2.0) * (drawn - current), 0.0, None)


@dataclass(frozen=True)
class _Draw:
    """The chosen estimate as `(base_num + window_num) / (base_den + window_den)`: the memory of earlier
    calls and this window's part: its per-step `samples` with their `weights` (or None: a summed window), and
    its `counts` `[layers, E]`. `resample` redraws the window's part and scales its deviation by
    `noise_scale`, so that the draw has the noise of every step the estimate weighs, not only this window's."""

    base_num: np.ndarray
    base_den: float
    samples: np.ndarray | None
    weights: np.ndarray | None
    window_num: np.ndarray
    window_den: float
    counts: np.ndarray
    noise_scale: float = 1.0   # sqrt(all steps' squared weights / this window's): the memory's noise too
