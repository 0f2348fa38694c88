"""The load the coming interval will see, estimated from the windows an engine hands its policy.

A plan made at a call serves the steps until the next call, so it should be planned for their
load, not the window's: on a load that drifts, the last steps of the window say more about the
coming ones than its first steps; on a stationary load, every step recorded so far says the same
thing and more of them say it with less sampling noise. How much weight the past deserves is the
persistence of the load, which differs from model to model and workload to workload, so it is
measured, not assumed.

The state carried from call to call (`EstimateState`; `LoadEstimate.update` reads one and returns the
next, as the rule does with its own state) holds, per layer and candidate half-life `h` (1, 4, 16, ...
steps, up to `MAX_HALF_LIFE_INTERVALS` of the engine's interval), an exponentially weighted mean of
every step seen so far, each step weighted `2 ** (-age / h)` by its age in steps (numerator and denominator
carried from call to call, so windows of any length and the gaps between them are weighted by
real time); and the flat window, the engine's own estimate (every step of the last window weighted
alike, nothing before it). At each call, before it sees the new window, each candidate's estimate
is scored on it: the squared error of its per-expert loads against the mean of each block of
the window's new steps (up to `SCORE_BLOCKS` blocks, each predicted from the steps before it, so
a per-step window scores a candidate many times per call; a summed window is one block), relative
to the layer's mean load, summed over blocks, the scores discounted by `SCORE_DISCOUNT` per call;
each layer's estimate is its candidate with the lowest score (the flat window before any score,
and on ties). So:
- stationary load: the errors are sampling noise, which the longest memory averages best: a long
  half-life wins, and the estimate settles instead of following each window's noise;
- sudden change: the rule finds the layer's load changed beyond noise (its same-pattern test) and
  asks for a reset: that layer's memory and scores start again from the new window, scored block
  by block within it (the flat window then predicts each block by the running mean of the steps
  before it), so the estimate after a change is the new window's, not a mix with the old load;
- slow drift: the half-life that tracks the drift best without chasing noise wins: on the
  replay's drifting traces (16,384 tokens a step) one to a few steps, fresher than any window,
  which only per-step windows can express (SGLang's per-pass counts).
A summed window (vLLM 0.33 hands the sum over its window) is one observation of its steps' mean:
the estimate is then the window (memories of earlier windows, chosen on one point per call,
followed drift too slowly: +1% expert time at 200-500-step cadences on the replay's 1 x 8 trace).
A per-step window that overlaps the previous call's adds, and is scored on, only its steps since
that call, and ages the memory by those steps only (a layer that starts again takes the whole window).
The weighted sums are float32 matrix products (the counts are exact in float32, a weighted sum keeps
24 bits, far below any estimate's sampling noise), carried from call to call in float64.

`Draw.resample` draws what an independent estimate of the same load could have been (the rule's
noise floor, `moe_place.online.policy`): the window's part of the chosen estimate redrawn (a
bootstrap of its steps with their weights, or a multinomial draw of its counts), its deviation
scaled to the noise of every step the estimate weighs (earlier windows' steps were as noisy as this
one's: by sqrt(sum of all squared weights / this window's)) and by sqrt(2), as two independent
estimates differ by twice the variance of one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from moe_place.errors import InputError

__all__ = ["Draw", "EstimateState", "LoadEstimate", "step_sums"]

MAX_HALF_LIFE_INTERVALS = 8   # the longest memory: half its weight after 8 intervals
HALF_LIFE_FACTOR = 4           # candidates 1, 4, 16, ... steps: the estimates of neighbours differ little
SCORE_DISCOUNT = 0.75   # a score forgets half of a call's error in about 2.4 calls: one bad window
# after a change outweighs a long calm history, one noisy window does not undo a steady one
SCORE_BLOCKS = 32         # a per-step window is scored on up to this many blocks of its steps
BOOTSTRAP_MIN_STEPS = 8   # per-step windows with fewer steps are redrawn from their counts
BLAS_ONE_THREAD_WORK = 2 ** 17   # multiply-adds per matrix product below OpenBLAS's threading threshold (4 x 65536)


@dataclass(frozen=True)
class EstimateState:
    """What `LoadEstimate` carries from one call to the next (module note); a call returns a new one and
    never writes into the one it read.

    calls: windows folded so far. half_lives: float64 `[C]` candidate half-lives in steps (empty until the
    first per-step window). chosen: float64 `[L]`, each layer's half-life (inf: the flat window).
    num / den / den2: the candidates' weighted sums `[C, L, E]`, their weights `[C, L]` and squared weights
    `[C, L]` (None before the first per-step window). score: `[C + 1, L]`, the candidates' discounted
    errors, the flat window last. fresh: bool `[L]`, layers with no memory (first call, or just reset).
    flat: `[L, E]`, the last window's mean per step (the flat window's estimate).
    """

    calls: int
    half_lives: np.ndarray
    chosen: np.ndarray
    num: np.ndarray | None
    den: np.ndarray | None
    den2: np.ndarray | None
    score: np.ndarray | None
    fresh: np.ndarray
    flat: np.ndarray


@dataclass(frozen=True)
class LoadEstimate:
    """The coming interval's per-step load `[layers, E]` (module note): `update` folds one window into an
    `EstimateState` and returns the estimate, the new state and what `Draw.resample` redraws.

    Each layer keeps its own scores and choice. adaptive: False keeps the flat window (the engines'
    estimate) at every call.
    """

    num_layers: int
    num_experts: int
    adaptive: bool = True

    @property
    def shape(self) -> tuple[int, int]:
        return self.num_layers, self.num_experts

    def create_state(self) -> EstimateState:
        """The state before any window: every layer fresh, the flat window chosen."""
        return EstimateState(0, np.zeros(0), np.full(self.num_layers, np.inf), None, None, None, None,
                             np.ones(self.num_layers, dtype=bool), np.zeros(self.shape))

    def update(self, state: EstimateState, window: np.ndarray, window_steps: int, elapsed_steps: int,
               reset: np.ndarray | None = None, total: np.ndarray | None = None
               ) -> tuple[np.ndarray, EstimateState, Draw]:
        """(float64 `[layers, E]`: the estimate after this call's window, per step; the state after it;
        what `Draw.resample` redraws of it).

        window: float `[n, layers, E]` per-step counts, or `[layers, E]` counts summed over `window_steps`.
        elapsed_steps: steps since the previous call (its interval; ignored at the first call).
        reset: bool `[layers]`, layers whose load changed beyond noise since the last call: their memory
            and scores start again from this window (a sudden change is then followed from its window on,
            and a layer that keeps its load keeps its memory).
        total: the window's counts summed over its steps, where the caller has them (else summed here).
        """
        loads = np.asarray(window)
        per_step = loads.ndim == 3
        loads = loads.astype(np.float32 if per_step else np.float64, copy=False)   # as `_fold_steps` multiplies
        if loads.shape[-2:] != self.shape or loads.ndim not in (2, 3) or window_steps < 1 or elapsed_steps < 1:
            raise InputError("load window", f"[n, {self.shape[0]}, {self.shape[1]}] or {list(self.shape)} counts "
                             "over window_steps >= 1, elapsed_steps >= 1",
                             (list(loads.shape), window_steps, elapsed_steps))
        if total is None:
            total = step_sums(loads) if per_step else loads
        flat = total / window_steps
        calls = state.calls + 1
        layers = self.shape[0]
        if not per_step or not self.adaptive:   # a summed window is one observation of its steps' mean:
            even = np.full(len(loads), window_steps / len(loads)) if per_step else None   # the estimate is the
            draw = Draw(np.zeros(self.shape), np.zeros(layers), loads if per_step else None,   # window (module note)
                        None if even is None else np.tile(even, (layers, 1)), total,
                        np.full(layers, float(window_steps)), total, np.ones(layers))
            return flat, replace(state, calls=calls, chosen=np.full(layers, np.inf), flat=flat), draw
        half_lives, memory = state.half_lives, (state.num, state.den, state.den2, state.score)
        if state.num is None:
            longest = MAX_HALF_LIFE_INTERVALS * max(elapsed_steps, window_steps)
            half_lives = float(HALF_LIFE_FACTOR) ** np.arange(int(np.log(longest) / np.log(HALF_LIFE_FACTOR)) + 1)
            count = len(half_lives)
            memory = (np.zeros((count,) + self.shape), np.zeros((count, layers)), np.zeros((count, layers)),
                      np.zeros((count + 1, layers)))   # the flat window's score last
        fresh_layers = state.fresh | np.asarray(reset, dtype=bool) if reset is not None else state.fresh
        old_num, old_den, old_den2, old_score = (_forget(a, fresh_layers) for a in memory)
        decay = 0.5 ** (1.0 / half_lives)                                          # per step, per candidate
        first = calls == 1
        new = window_steps if first else min(window_steps, elapsed_steps)          # steps not seen yet
        steps = min(new, len(loads))
        # a layer that starts again takes the whole window; the others its steps since the last call
        steps_of = np.where(fresh_layers, len(loads), steps)
        gap = 0 if first else max(elapsed_steps - steps, 0)                         # steps the engine did not record
        num, den = np.empty_like(old_num), np.empty_like(old_den)
        errors = np.empty_like(old_score)
        # each group of layers over its own steps: one fold where both groups take the whole window
        folds = [(np.arange(layers), len(loads))] if steps == len(loads) else \
            [(np.flatnonzero(fresh_layers), len(loads)), (np.flatnonzero(~fresh_layers), steps)]
        for idx, taken in folds:
            if idx.size:
                part = loads[-taken:] if idx.size == layers else loads[-taken:, idx]
                num[:, idx], den[:, idx], errors[:, idx] = _fold_steps(
                    part, decay[:, None, None] ** gap * old_num[:, idx], decay[:, None] ** gap * old_den[:, idx],
                    decay, fresh_layers[idx], state.flat[idx])
        score = SCORE_DISCOUNT * old_score + errors
        n = int(steps_of.max())
        ages = np.arange(n - 1, -1, -1, dtype=np.float64)
        inside = ages[None, :] < steps_of[:, None]                                 # [L, n] steps each layer takes
        weights = np.where(inside[None], decay[:, None, None] ** ages[None, None, :], 0.0)   # [C, L, n]
        window_w2 = (weights ** 2).sum(axis=2)
        keep = decay[:, None] ** (gap + steps_of[None, :])
        base_num, base_den = keep[:, :, None] * old_num, keep * old_den
        den2 = keep ** 2 * old_den2 + window_w2
        best = _best(score)                                                        # [L], -1: the flat window
        rows = np.arange(layers)
        pick = np.maximum(best, 0)
        estimate = np.where((best < 0)[:, None], flat, num[pick, rows] / den[pick, rows][:, None])
        chosen = np.where(best < 0, np.inf, half_lives[pick])
        use_flat = best < 0
        even = np.full((layers, len(loads)), window_steps / len(loads))
        chosen_weights = _pad_left(weights[pick, rows], len(loads))                # [L, len(loads)]
        taken = chosen_weights > 0
        taken_counts = total if taken.all() else np.einsum("ln,nle->le", taken.astype(np.float64), loads)
        draw = Draw(np.where(use_flat[:, None], 0.0, base_num[pick, rows]),
                    np.where(use_flat, 0.0, base_den[pick, rows]), loads,
                    np.where(use_flat[:, None], even, chosen_weights),
                    np.where(use_flat[:, None], total, num[pick, rows] - base_num[pick, rows]),
                    np.where(use_flat, float(window_steps), den[pick, rows] - base_den[pick, rows]),
                    np.where(use_flat[:, None], total, taken_counts),
                    np.where(use_flat, 1.0, np.sqrt(den2[pick, rows] / np.maximum(window_w2[pick, rows], 1e-300))))
        new_state = EstimateState(calls, half_lives, chosen, num, den, den2, score, np.zeros(layers, dtype=bool), flat)
        return estimate, new_state, draw


def _forget(memory: np.ndarray, layers: np.ndarray) -> np.ndarray:
    """`memory [C, L, ...]` with the rows of `layers` (bool `[L]`) zeroed: a copy where any is, else itself."""
    if not layers.any():
        return memory
    memory = memory.copy()
    memory[:, layers] = 0.0
    return memory


def _best(score: np.ndarray) -> np.ndarray:
    """int `[layers]`: each layer's candidate with the lowest `score [C + 1, layers]`, -1 for the flat window
    (also on a tie and before any score)."""
    best = np.argmin(score[:-1], axis=0)
    scored = score.any(axis=0)
    better = score[best, np.arange(score.shape[1])] < score[-1]
    return np.where(scored & better, best, -1)


def _fold_steps(fresh: np.ndarray, num: np.ndarray, den: np.ndarray, decay: np.ndarray, restart: np.ndarray,
                last_flat: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fold every step of `fresh` (float32 `[n, l, E]`, some layers' counts) into every candidate's memory
    (`num [C, l, E]`, `den [C, l]`, as they stand before its first step), block by block, scoring each
    candidate's prediction of each block's mean before it sees the block. The flat window predicts the
    last window's mean (`last_flat [l, E]`); for layers that start again (`restart`, bool `[l]`), the
    running mean of the steps before the block, and their first block, which nothing predicts, is not
    scored. Returns (num, den, errors `[candidates + 1, l]`).

    The matrix products run in float32 (counts are exact in it up to 2**24, and a weighted sum keeps 24
    bits, far below the sampling noise of any estimate); the memory carried between calls is float64."""
    n, count, shape = len(fresh), len(decay), fresh.shape[1:]
    blocks = min(SCORE_BLOCKS, n)
    size = n // blocks
    lead = n - blocks * size                                  # folded before the first scored block
    lead_sum = fresh[:lead].sum(axis=0, dtype=np.float64)    # [l, E]
    if lead:
        w = decay[:, None] ** np.arange(lead - 1, -1, -1, dtype=np.float64)[None, :]
        num = decay[:, None, None] ** lead * num + _matmul_one_thread(
            w.astype(np.float32), fresh[:lead].reshape(lead, -1)).reshape(num.shape)
        den = decay[:, None] ** lead * den + w.sum(axis=1)[:, None]
    # each block's weighted sum per candidate, and its plain sum (the last row): `[C + 1, size] @
    # [size, l*E]` a block, in column slices small enough that BLAS keeps each product on the calling
    # thread (its CPU time is then the call's)
    w = np.vstack([decay[:, None] ** np.arange(size - 1, -1, -1, dtype=np.float64)[None, :], np.ones(size)])
    sums = _matmul_one_thread(w.astype(np.float32), fresh[lead:].reshape(blocks, size, -1))  # [blocks, C+1, l*E]
    block_sums = sums[:, count].reshape((blocks,) + shape).astype(np.float64)
    # block j's weighted sums as they stand before block k (row `blocks`: after the last), per candidate:
    # shrink^(k - 1 - j) for j < k; the memory before the blocks is carried by shrink^k
    shrink = decay ** size
    order = np.arange(blocks + 1)[:, None] - 1 - np.arange(blocks)[None, :]              # [blocks + 1, blocks]
    carry = np.where(order >= 0, shrink[:, None, None] ** np.maximum(order, 0), 0.0)   # [C, blocks + 1, blocks]
    start = shrink[:, None] ** np.arange(blocks + 1)[None, :]                           # [C, blocks + 1]
    nums = _matmul_one_thread(carry.astype(np.float32),
                              np.ascontiguousarray(sums[:, :count].swapaxes(0, 1)))    # [C, blocks + 1, l*E]
    dens = start[:, :, None] * den[:, None] + (carry.sum(axis=2) * w[:count].sum(axis=1)[:, None])[:, :, None]
    dens_before = dens[:, :-1]                                                          # [C, blocks, l]
    # each block's prediction in float32 (scores need no more): the block's predecessors in the window,
    # weighted, and the earlier memory's mean with its share of the weight (a mean and a share, not their
    # float64 sums, which can be below float32's range after a long gap)
    inverse = np.minimum(1.0 / np.maximum(dens_before, 1e-300), 1e30)   # clipped only where no window step came
    predictions = nums[:, :-1].reshape((count, blocks) + shape)
    predictions *= inverse[..., None].astype(np.float32)
    memory = (num / np.maximum(den, 1e-300)[:, :, None]).astype(np.float32)            # [C, l, E]
    share = start[:, :-1, None] * den[:, None] / np.maximum(dens_before, 1e-300)        # in [0, 1]
    predictions += memory[:, None] * share.astype(np.float32)[..., None]
    num = start[:, -1, None, None] * num + nums[:, -1].reshape(num.shape)
    den = dens[:, -1]
    targets = block_sums / size
    use = np.broadcast_to(dens_before.max(axis=0) > 0, (blocks, shape[0]))             # some memory before it
    if restart.any():   # the running mean of the steps before each block, for the layers that start again
        seen = lead + size * np.arange(blocks)
        sums_before = np.concatenate([lead_sum[None], lead_sum + np.cumsum(block_sums, axis=0)[:-1]])
        running = sums_before / np.maximum(seen, 1)[:, None, None]
        flat = running if restart.all() else np.where(restart[None, :, None], running, last_flat[None])
        use = use & ((seen > 0)[:, None] | ~restart[None, :])
    else:
        flat = last_flat[None]
    return num, den, _point_errors(predictions, flat, targets, use)


def _point_errors(predictions: np.ndarray, flat: np.ndarray, targets: np.ndarray,
                  use: np.ndarray) -> np.ndarray:
    """float64 `[candidates + 1, layers]`: squared errors of the candidates' `predictions [C, blocks,
    layers, E]` (float32 or float64, overwritten) and the flat window's `flat [blocks, layers, E]`
    against `targets [blocks, layers, E]`, each relative to its layer's mean target load, summed over
    the blocks `use [blocks, layers]` marks."""
    weight = use[:, :, None] / np.maximum(targets.mean(axis=-1, keepdims=True), 1e-12)   # [blocks, L, 1]
    predictions -= targets[None].astype(predictions.dtype)
    predictions *= weight[None].astype(predictions.dtype)
    np.square(predictions, out=predictions)
    flat_error = np.square((flat - targets) * weight)
    return np.vstack([predictions.sum(axis=(1, 3), dtype=np.float64), flat_error.sum(axis=(0, 2))])


SUM_CHUNK_STEPS = 64   # steps summed in float32 at a time: exact for integer counts up to 2**18 a step


def step_sums(loads: np.ndarray) -> np.ndarray:
    """float64 `[layers, E]`: per-step counts `loads` (float32 `[n, layers, E]`) summed over their steps, as
    float32 products of `SUM_CHUNK_STEPS` steps at a time (exact for integer counts, on the calling thread)
    accumulated in float64; a few times faster than numpy's float64 sum of a float32 array."""
    n, shape = len(loads), loads.shape[1:]
    flat = loads.reshape(n, -1)
    whole = n - n % SUM_CHUNK_STEPS
    total = np.zeros(flat.shape[1])
    if whole:
        ones = np.ones((1, SUM_CHUNK_STEPS), dtype=loads.dtype)
        total += _matmul_one_thread(ones, flat[:whole].reshape(-1, SUM_CHUNK_STEPS, flat.shape[1])).sum(
            axis=0, dtype=np.float64)[0]
    if whole < n:
        total += flat[whole:].sum(axis=0, dtype=np.float64)
    return total.reshape(shape)


def _matmul_one_thread(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """`a [..., M, K] @ b [..., K, N]`, in column slices of `b` small enough that BLAS keeps each product on the
    calling thread: the policy's CPU time is then its thread's, as the engines and the replay count it."""
    width = max(1, BLAS_ONE_THREAD_WORK // (a.shape[-2] * a.shape[-1]))
    if b.shape[-1] <= width:
        return np.matmul(a, b)
    return np.concatenate([np.matmul(a, b[..., j:j + width]) for j in range(0, b.shape[-1], width)], axis=-1)


def _pad_left(weights: np.ndarray, length: int) -> np.ndarray:
    """`weights [L, n]` padded with zeros on the left to `[L, length]` (older steps the estimate did not take)."""
    out = np.zeros((weights.shape[0], length))
    out[:, length - weights.shape[1]:] = weights
    return out


@dataclass(frozen=True)
class Draw:
    """Each layer's estimate as `(base_num + window_num) / (base_den + window_den)`: the memory of earlier
    calls and this window's part: the window's per-step `samples [n, layers, E]` with each layer's `weights
    [layers, n]` (or None: a summed window), and its `counts` `[layers, E]`. `resample` redraws the window's
    part and scales its deviation by `noise_scale [layers]`, so that the draw has the noise of every step the
    estimate weighs, not only this window's."""

    base_num: np.ndarray
    base_den: np.ndarray
    samples: np.ndarray | None
    weights: np.ndarray | None
    window_num: np.ndarray
    window_den: np.ndarray
    counts: np.ndarray
    noise_scale: np.ndarray   # sqrt(all steps' squared weights / this window's): the memory's noise too

    def resample(self, layers: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """float64 `[len(layers), E]`: an estimate of these layers that differs from the last one as much
        as an independent estimate of the same load would (module note)."""
        layers = np.asarray(layers, dtype=np.int64)
        if self.samples is not None and len(self.samples) >= BOOTSTRAP_MIN_STEPS:
            picks = rng.integers(0, len(self.samples), size=len(self.samples))          # a bootstrap of the steps,
            part = np.stack([np.tensordot(np.bincount(picks, weights=self.weights[layer], minlength=len(self.samples)),
                                          self.samples[:, layer], axes=(0, 0)) for layer in layers])  # each with its weight
        else:                    # a multinomial draw of the window's counts, weighted as the estimate weighs them
            counts = self.counts[layers]
            part = np.zeros_like(counts)
            for i, row in enumerate(counts):
                n = int(round(row.sum()))
                if n > 0:
                    part[i] = rng.multinomial(n, row / row.sum()) * (self.window_num[layers[i]].sum() / n)
        den = (self.base_den + self.window_den)[layers][:, None]
        current = (self.base_num[layers] + self.window_num[layers]) / den
        # the window's deviation, scaled to the whole estimate's noise (its earlier steps were as noisy)
        scale = self.noise_scale[layers][:, None]
        drawn = (self.base_num[layers] + self.window_num[layers] + scale * (part - self.window_num[layers])) / den
        return np.clip(current + np.sqrt(2.0) * (drawn - current), 0.0, None)
