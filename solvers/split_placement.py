"""Placement for the per-batch split: replica counts and GPUs chosen for the split's busiest GPU.

The solvers plan for the even split (each replica takes `1/logcnt` of its expert). With the per-batch
split (`moe_place.split.split_shares`) an expert's rows move between its replicas at every batch, so
what decides the busiest GPU is which GPUs share replicated experts (the replica graph: a GPU can hand
rows only to the GPUs it shares a replicated expert with) and how the load that cannot move (the
experts with one replica) sits on them. `plan_for_split` refines whole-model plans for that objective:

    objective of layer l = mean over the planning steps t of  max_g rows_t[g]   (rows: the split of step t)

1. Steps. The planning steps `[T, layers, E]` (the trace's steps, each a batch's global counts), at
   most `MAX_STEPS` of them, evenly spaced (`planning_sample`). A token-level trace of fewer than
   `MIN_PIECES` steps is planned on runs of consecutive tokens instead, each scaled to its step's
   tokens (`planning_pieces`): one recorded batch holds a few prompts, and the swings between them
   are all the trace says about the batches to come. Each step's deviation from the steps'
   mean is scaled by `DEVIATION_GAIN` (counts clipped at 0): a plan is judged later on steps further
   from the window's mean than the window's own steps are, and planning for wider swings hedges for
   that. The scale was chosen on drifting synthetic traces of seeds 1-8, never the reported ones
   (`python bench/bench_split_placement.py --tune`, bench/results/split_placement_tuning.json). A trace
   of one step has no deviation: the step itself is planned for.
2. Start. Per layer, the best of the given starting plans (EPLB's, the solver's) under the objective
   (ties: the first). A start that puts two replicas of one expert on one GPU (EPLB's often does) is
   first pulled apart unless `allow_colocated` (`separate_replicas`: such a pair is no use to the split,
   both replicas sit on one GPU); where that fails the start is skipped.
3. Local search, all layers in lockstep (one batched evaluation per round for every layer's
   candidates). Each round, per layer, `CANDIDATES` moves drawn (seeded) around the GPUs that are
   busiest at the most steps (hot) and those with the most room (cool): swap a slot of a hot GPU
   with a slot of a cool one, or turn a replica of an expert with several replicas on a cool GPU
   into another replica of an expert on a hot GPU (replica counts change; their sum does not). The
   best candidate is taken when it lowers the layer's objective by more than `MIN_GAIN` of it; a
   layer stops after `PATIENCE` rounds without one, all after `ROUNDS`. No move puts two replicas of
   one expert on one GPU. The work is `layers x rounds` layer rounds; `advance` (e.g. a progress bar's)
   hears of them as they are judged, `LAYER_CHUNK` layers at a time, and of those a stopped layer skips.
4. The candidates are judged by the split in real numbers (`relaxed_split_loads`: every replicated
   expert's rows water-filled over its GPUs given the others, hottest first, `SWEEPS` times: block
   coordinate descent, as `split_shares` does before it rounds to whole rows): an achievable split, so
   never below the exact one, and close to it after a few sweeps (tests/test_split_placement.py holds
   it to the LP's optimum on real layers).
5. Check. Each layer's result is judged with `split_shares` itself (whole rows, the engines' method)
   on the planning steps as they are (not scaled) against its start; where it is busier there, the
   start is kept. So a plan from here is never worse than its start on the steps it was made on.

Deterministic: the draws come from `seed`; nothing depends on the clock. The judged figures in
`SplitPlacement` are means over the planning steps of `split_shares`' busiest GPU rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from moe_place.errors import InputError
from moe_place.placement import colocated_gpus
from moe_place.split import gpu_rows, split_shares
from moe_place.traces.model import Trace, count_dispatches

__all__ = ["SplitPlacement", "plan_for_split", "planning_pieces", "planning_sample", "propose_moves",
           "relaxed_split_loads", "separate_replicas", "split_busiest", "split_busiest_over_mean", "widened_steps"]

MIN_PIECES = 8          # a token-level trace of fewer steps is cut into runs of tokens, this many at least
MAX_STEPS = 24          # steps the search judges a plan on (its work grows with them; a sample keeps the swings)
DEVIATION_GAIN = 2.0    # step 1: plan for swings twice the window's own (tuned on drift seeds 1-6, see above)
CANDIDATES = 16         # moves tried per layer and round
SWEEPS = 5              # water-filling sweeps of the relaxed split (step 4)
ROUNDS = 40             # rounds at most
PATIENCE = 4            # a layer stops after this many rounds without a move taken
MIN_GAIN = 1e-4         # a move must lower the objective by this share of it (below: the relaxation's noise)
SWAP_SHARE = 0.5        # share of the moves drawn that are swaps (the rest move a replica to another expert)
LAYER_CHUNK = 8         # layers whose candidates one batched evaluation judges: a few seconds at EP64 on 24 steps,
                        # so that progress shows between them (the layers are independent: the same result)


@dataclass(frozen=True)
class SplitPlacement:
    """A whole-model plan for the per-batch split, and how it compares with its start.

    phy2log: int64 `[layers, P]`, no expert twice on one GPU unless a start had it (`allow_colocated`).
    start: int64 `[layers]`, which of the starting plans each layer started from.
    start_busiest / busiest: float64 `[layers]`, mean over the planning steps of the busiest GPU's rows
        under `split_shares`, of the start and of the plan (busiest <= start_busiest on every layer).
    moves: int64 `[layers]`, moves the search took (0 where the start was kept).
    steps / sampled: planning steps given, and how many of them the search judged on.
    deviation_gain: the scale of the steps' deviations the search planned for (step 1).
    """

    phy2log: np.ndarray
    start: np.ndarray
    start_busiest: np.ndarray
    busiest: np.ndarray
    moves: np.ndarray
    steps: int
    sampled: int
    deviation_gain: float = DEVIATION_GAIN

    def __post_init__(self) -> None:
        layers = self.phy2log.shape[0]
        for name in ("start", "start_busiest", "busiest", "moves"):
            assert getattr(self, name).shape == (layers,), name
        assert (self.busiest <= self.start_busiest + 1e-9).all()

    @property
    def gain(self) -> float:
        """Relative change of the summed objective against the starts (negative: less busy)."""
        before = float(self.start_busiest.sum())
        return float(self.busiest.sum()) / before - 1 if before > 0 else 0.0

    def to_dict(self) -> dict:
        return {"planning_steps": self.steps, "sampled_steps": self.sampled,
                "deviation_gain": self.deviation_gain, "start": self.start.tolist(),
                "start_mean_busiest": [round(float(v), 4) for v in self.start_busiest],
                "mean_busiest": [round(float(v), 4) for v in self.busiest],
                "moves": self.moves.tolist(), "gain": round(self.gain, 6)}


# ------------------------------------------------------------------------------------- the relaxed split
def relaxed_split_loads(phy2log: np.ndarray, counts: np.ndarray, num_gpus: int, sweeps: int = SWEEPS) -> np.ndarray:
    """float64 `[B, G]`: GPU rows of the per-batch split in real numbers (step 4 of the module note).

    phy2log: int `[B, P]` (slot p on GPU p // (P/G); co-located replicas allowed); counts: `[B, E]` the
    dispatches of each row's batch (real numbers allowed). Rows are independent; the total of each row is
    kept. Each sweep water-fills every replicated expert, hottest first, over its GPUs given the rest.
    """
    rows = np.asarray(phy2log, dtype=np.int64)
    load = np.asarray(counts, dtype=np.float64)
    batch, physical = rows.shape
    slots_per_gpu = physical // num_gpus
    slots, logcnt = _replica_slots(rows, load.shape[1])
    width = slots.shape[2]
    valid = slots >= 0
    gpu = np.where(valid, slots // slots_per_gpu, num_gpus)                    # num_gpus: a spare column
    same = (gpu[..., :, None] == gpu[..., None, :]) & valid[..., None, :]
    first = valid & ~(same & np.tril(np.ones((width, width), dtype=bool), k=-1)).any(axis=-1)
    expert = rows[np.arange(batch)[:, None], np.maximum(slots[..., 0], 0)]
    amount = np.where(valid[..., 0], load[np.arange(batch)[:, None], expert], 0.0)   # [B, K]
    hottest = np.argsort(-amount, axis=1, kind="stable")
    gpu = np.take_along_axis(gpu, hottest[..., None], axis=1)
    first = np.take_along_axis(first, hottest[..., None], axis=1)
    amount = np.take_along_axis(amount, hottest, axis=1)
    single = np.take_along_axis(logcnt, rows, axis=1) == 1
    per_gpu = np.zeros((batch, num_gpus + 1))
    per_gpu[:, :num_gpus] = np.where(single, np.take_along_axis(load, rows, axis=1), 0.0).reshape(
        batch, num_gpus, slots_per_gpu).sum(axis=2)
    share = np.zeros(gpu.shape)                                                 # [B, K, M] rows per (expert, GPU)
    for _ in range(sweeps):
        for k in range(gpu.shape[1]):
            target = np.where(first[:, k], gpu[:, k], num_gpus)
            others = np.take_along_axis(per_gpu, target, axis=1) - share[:, k]
            poured = _water_fill(others, amount[:, k], first[:, k])
            np.put_along_axis(per_gpu, target, np.where(first[:, k], others + poured, 0.0), axis=1)
            share[:, k] = poured
    return per_gpu[:, :num_gpus]


def _replica_slots(rows: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """(int64 `[B, K, M]` the slots of each row's replicated experts, -1 padded; int64 `[B, E]` logcnt)."""
    batch, physical = rows.shape
    keys = rows + (np.arange(batch) * num_experts)[:, None]
    logcnt = np.bincount(keys.ravel(), minlength=batch * num_experts).reshape(batch, num_experts)
    order = np.argsort(rows, axis=1, kind="stable")
    ids = np.take_along_axis(rows, order, axis=1)
    replicated = np.take_along_axis(logcnt, ids, axis=1) >= 2
    new = np.ones_like(replicated)
    new[:, 1:] = ids[:, 1:] != ids[:, :-1]
    which = np.cumsum(new & replicated, axis=1) - 1
    index = np.broadcast_to(np.arange(physical), (batch, physical))
    nth = index - np.maximum.accumulate(np.where(new, index, 0), axis=1)
    slots = np.full((batch, max(1, int((new & replicated).sum(axis=1).max())), max(2, int(logcnt.max()))), -1,
                    dtype=np.int64)
    owner = np.broadcast_to(np.arange(batch)[:, None], (batch, physical))
    slots[owner[replicated], which[replicated], nth[replicated]] = order[replicated]
    return slots, logcnt


def _water_fill(level: np.ndarray, amount: np.ndarray, active: np.ndarray) -> np.ndarray:
    """float64 `[n, M]`: `amount [n]` poured onto the `active` entries of `level [n, M]`, lowest first, up to
    one common level `L = min_j (amount + sum of the j lowest) / j` (the least level that holds it)."""
    ranked = np.sort(np.where(active, level, np.inf), axis=1)
    filled = np.isfinite(ranked)
    candidates = (amount[:, None] + np.cumsum(np.where(filled, ranked, 0.0), axis=1)) / np.arange(1, level.shape[1] + 1)
    top = np.where(filled, candidates, np.inf).min(axis=1)
    top = np.where(np.isfinite(top), top, 0.0)
    return np.where(active, np.maximum(0.0, top[:, None] - level), 0.0)


# ------------------------------------------------------------------------------------------- objectives
def planning_pieces(trace: Trace) -> tuple[np.ndarray, str]:
    """(int64 `[T, layers, E]` the loads to plan for the split on, a description): the trace's steps, or for a
    token-level trace of fewer than `MIN_PIECES` steps each step cut into runs of consecutive tokens (as
    many per step as make `MIN_PIECES` in all), each run's counts scaled to its step's tokens."""
    if trace.num_steps >= MIN_PIECES or not trace.is_token_level:
        return trace.step_counts(), f"{trace.num_steps} step{'s' if trace.num_steps > 1 else ''}"
    per_step = -(-MIN_PIECES // trace.num_steps)
    pieces = []
    for ids in trace.topk_ids:
        for run in np.array_split(np.arange(len(ids)), min(per_step, len(ids))):
            pieces.append(np.rint(count_dispatches(ids[run], trace.num_experts) * (len(ids) / len(run))))
    return (np.stack(pieces).astype(np.int64),
            f"{len(pieces)} runs of consecutive tokens ({per_step} per step of {trace.num_steps}, each scaled to its "
            "step's tokens)")


def planning_sample(step_loads: np.ndarray, max_steps: int = MAX_STEPS) -> np.ndarray:
    """int64 positions of at most `max_steps` of the `[T, ...]` steps, evenly spaced, first and last included."""
    steps = len(step_loads)
    if steps <= max_steps:
        return np.arange(steps)
    return np.unique(np.linspace(0, steps - 1, max_steps).round().astype(np.int64))


def widened_steps(step_loads: np.ndarray, gain: float = DEVIATION_GAIN) -> np.ndarray:
    """float64 like `step_loads [T, layers, E]`: each step's deviation from the steps' mean times `gain`,
    clipped at 0 (step 1 of the module note)."""
    loads = np.asarray(step_loads, dtype=np.float64)
    mean = loads.mean(axis=0)
    return np.maximum(0.0, mean + gain * (loads - mean))


def split_busiest(phy2log: np.ndarray, step_loads: np.ndarray, num_gpus: int) -> np.ndarray:
    """float64 `[layers]`: mean over the steps of the busiest GPU's rows under `split_shares` (the judge).

    phy2log: int `[layers, P]`; step_loads: `[T, layers, E]` whole counts."""
    rows = np.asarray(phy2log, dtype=np.int64)
    loads = np.rint(np.asarray(step_loads)).astype(np.int64)
    steps, layers, experts = loads.shape
    shares = split_shares(np.repeat(rows, steps, axis=0), loads.transpose(1, 0, 2).reshape(layers * steps, experts),
                          num_gpus)
    return gpu_rows(shares, num_gpus).max(axis=1).reshape(layers, steps).mean(axis=1)


def split_busiest_over_mean(phy2log: np.ndarray, step_loads: np.ndarray, num_gpus: int) -> np.ndarray:
    """float64 `[steps]`: each step's busiest GPU rows under `split_shares`, summed over layers, over the mean
    GPU's rows (1 for a step without load): `solvers.sizing.busiest_over_mean` with the split on."""
    rows = np.asarray(phy2log, dtype=np.int64)
    loads = np.rint(np.asarray(step_loads)).astype(np.int64)
    steps, layers, experts = loads.shape
    shares = split_shares(np.tile(rows, (steps, 1)), loads.reshape(steps * layers, experts), num_gpus)
    busiest = gpu_rows(shares, num_gpus).max(axis=1).reshape(steps, layers).sum(axis=1).astype(np.float64)
    mean = loads.sum(axis=(1, 2)) / num_gpus
    return np.divide(busiest, mean, out=np.ones_like(mean), where=mean > 0)


def _relaxed_objective(maps: np.ndarray, steps: np.ndarray, num_gpus: int) -> tuple[np.ndarray, np.ndarray]:
    """(float64 `[layers, C]` mean over steps of the relaxed busiest GPU, float64 `[layers, C, T, G]` the loads)
    of candidate maps int64 `[layers, C, P]` on steps `[T, layers, E]`."""
    layers, count, physical = maps.shape
    num_steps, _, experts = steps.shape
    rows = np.repeat(maps.reshape(layers * count, physical), num_steps, axis=0)
    loads = np.broadcast_to(steps.transpose(1, 0, 2)[:, None], (layers, count, num_steps, experts))
    per_gpu = relaxed_split_loads(rows, loads.reshape(-1, experts), num_gpus).reshape(layers, count, num_steps, -1)
    return per_gpu.max(axis=3).mean(axis=2), per_gpu


# ------------------------------------------------------------------------------------------ the search
def plan_for_split(starts: np.ndarray, step_loads: np.ndarray, num_gpus: int, *, allow_colocated: bool = False,
                   seed: int = 0, rounds: int = ROUNDS, candidates: int = CANDIDATES,
                   max_steps: int = MAX_STEPS, deviation_gain: float = DEVIATION_GAIN,
                   advance: Callable[[int], None] | None = None) -> SplitPlacement:
    """The plan of the module note.

    starts: int `[n, layers, P]` (or `[layers, P]`) starting plans, e.g. EPLB's and the solver's, each a plan
        for all layers; step_loads: `[T, layers, E]` the planning steps' dispatches per expert (whole counts).
    deviation_gain: the scale of the steps' deviations from their mean the search plans for (step 1).
    advance: called with a count of layer rounds as the search goes, `layers * rounds` in all (step 3).
    """
    plans = np.asarray(starts, dtype=np.int64)
    if plans.ndim == 2:
        plans = plans[None]
    loads = np.asarray(step_loads)
    if loads.ndim != 3 or 0 in loads.shape:
        raise InputError("step_loads", "counts [steps, layers, experts]", f"shape {loads.shape}")
    if plans.ndim != 3 or plans.shape[1] != loads.shape[1] or plans.shape[2] % num_gpus:
        raise InputError("starts", f"plans [n, {loads.shape[1]} layers, P] with P a multiple of {num_gpus}",
                         f"shape {plans.shape}")
    if plans.min() < 0 or plans.max() >= loads.shape[2]:
        raise InputError("starts", f"expert ids in [0, {loads.shape[2]})", int(plans.max()))
    for name, value in (("rounds", rounds), ("candidates", candidates), ("max_steps", max_steps)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < (0 if name == "rounds" else 1):
            raise InputError(name, "a positive integer" if name != "rounds" else "an integer >= 0", value)
    layers = loads.shape[1]
    sample = planning_sample(loads, max_steps)
    if not deviation_gain >= 0:
        raise InputError("deviation_gain", "a number >= 0", deviation_gain)
    steps = widened_steps(loads, deviation_gain)[sample]
    if not allow_colocated:
        plans = np.stack([separate_replicas(plan, loads.mean(axis=0), num_gpus) for plan in plans])
    colocated = np.stack([[colocated_gpus(row, num_gpus).any() for row in plan] for plan in plans])  # [n, layers]
    if not allow_colocated and colocated.all(axis=0).any():
        raise InputError("starts", "on every layer a plan with no expert twice on one GPU (or allow_colocated)",
                         f"layer {int(np.flatnonzero(colocated.all(axis=0))[0])}")
    values = _relaxed_objective(plans.transpose(1, 0, 2), steps, num_gpus)[0]        # [layers, n]
    if not allow_colocated:
        values = np.where(colocated.T, np.inf, values)
    chosen = np.argmin(values, axis=1)
    start = plans[chosen, np.arange(layers)]
    maps, moves = _search(start, steps, num_gpus, np.random.default_rng(seed), rounds, candidates,
                          advance or (lambda count: None))
    before = split_busiest(start, loads, num_gpus)
    after = split_busiest(maps, loads, num_gpus)
    keep = after <= before
    return SplitPlacement(np.where(keep[:, None], maps, start), chosen.astype(np.int64), before,
                          np.where(keep, after, before), np.where(keep, moves, 0), len(loads), len(sample),
                          float(deviation_gain))


def separate_replicas(phy2log: np.ndarray, loads: np.ndarray, num_gpus: int) -> np.ndarray:
    """int64 `[layers, P]`: the plans with every second replica of an expert on one GPU swapped with a slot of
    another GPU that holds neither expert, the one whose even-split piece (`loads[e] / logcnt[e]`) is nearest
    in load (ties: the lower slot), so the GPUs' even-split loads barely move. A repeat with no such slot stays.

    phy2log: int `[layers, P]`; loads: `[layers, E]` (the planning steps' mean)."""
    rows = np.array(phy2log, dtype=np.int64)
    slots_per_gpu = rows.shape[1] // num_gpus
    gpu = np.arange(rows.shape[1]) // slots_per_gpu
    for layer, row in enumerate(rows):
        if not colocated_gpus(row, num_gpus).any():
            continue
        piece = loads[layer][row] / np.bincount(row, minlength=loads.shape[1])[row]
        for slot in range(rows.shape[1]):
            here = row[gpu == gpu[slot]]
            if (here == row[slot]).sum() < 2 or (row[gpu[slot] * slots_per_gpu:slot] != row[slot]).all():
                continue                                                   # not the second replica on its GPU
            holds = np.zeros((num_gpus, loads.shape[1]), dtype=bool)
            holds[gpu, row] = True
            ok = ~holds[gpu, row[slot]] & ~holds[gpu[slot], row]            # the other GPU lacks e, this one f
            if ok.any():
                other = np.flatnonzero(ok)[np.argmin(np.abs(piece[ok] - piece[slot]))]
                row[slot], row[other] = row[other], row[slot]
                piece[slot], piece[other] = piece[other], piece[slot]
    return rows


def _search(start: np.ndarray, steps: np.ndarray, num_gpus: int, rng: np.random.Generator, rounds: int,
            candidates: int, advance: Callable[[int], None]) -> tuple[np.ndarray, np.ndarray]:
    """(int64 `[layers, P]`, moves taken int64 `[layers]`): step 3 of the module note from `start`;
    `advance` hears of `layers * rounds` layer rounds in all."""
    maps = start.copy()
    layers = len(maps)
    value, per_gpu = _relaxed_objective(maps[:, None], steps, num_gpus)
    value, per_gpu = value[:, 0], per_gpu[:, 0]
    idle = np.zeros(layers, dtype=np.int64)
    moves = np.zeros(layers, dtype=np.int64)
    for done in range(rounds):
        live = np.flatnonzero(idle < PATIENCE)
        if live.size == 0:
            advance(layers * (rounds - done))
            break
        advance(layers - live.size)
        drawn = propose_moves(maps[live], per_gpu[live], steps.shape[2], num_gpus, candidates, rng)
        tried, tried_gpu = _judge_in_chunks(drawn, steps[:, live], num_gpus, advance)
        best = np.argmin(tried, axis=1)
        pick = tried[np.arange(live.size), best]
        better = pick < value[live] * (1 - MIN_GAIN)
        won = live[better]
        maps[won] = drawn[better, best[better]]
        value[won] = pick[better]
        per_gpu[won] = tried_gpu[better, best[better]]
        moves[won] += 1
        idle[won] = 0
        idle[live[~better]] += 1
    return maps, moves


def _judge_in_chunks(drawn: np.ndarray, steps: np.ndarray, num_gpus: int,
                     advance: Callable[[int], None]) -> tuple[np.ndarray, np.ndarray]:
    """`_relaxed_objective(drawn, steps, num_gpus)`, `LAYER_CHUNK` layers at a time, each chunk reported."""
    values, loads = [], []
    for first in range(0, len(drawn), LAYER_CHUNK):
        chunk = slice(first, first + LAYER_CHUNK)
        value, per_gpu = _relaxed_objective(drawn[chunk], steps[:, chunk], num_gpus)
        values.append(value)
        loads.append(per_gpu)
        advance(len(value))
    return np.concatenate(values), np.concatenate(loads)


def propose_moves(maps: np.ndarray, per_gpu: np.ndarray, num_experts: int, num_gpus: int, count: int,
                  rng: np.random.Generator) -> np.ndarray:
    """int64 `[layers, count, P]`: candidate plans, each one move from its layer's plan (step 3).

    maps: int64 `[layers, P]`; per_gpu: float64 `[layers, T, G]` their relaxed split loads on the steps.
    Moves that would put an expert twice on one GPU (or change nothing) are dropped; a layer short of
    `count` valid moves repeats its own plan (which is never taken: it does not lower the objective).
    """
    layers, physical = maps.shape
    slots_per_gpu = physical // num_gpus
    top = per_gpu.max(axis=2, keepdims=True)
    hot = (per_gpu >= top * (1 - 1e-3)).mean(axis=1) + 1e-3                          # [layers, G]
    cool = ((top - per_gpu) / np.maximum(top, 1e-9)).mean(axis=1) + 1e-3
    gpu = np.arange(physical) // slots_per_gpu
    logcnt = np.stack([np.bincount(row, minlength=num_experts) for row in maps])
    spare = np.take_along_axis(logcnt, maps, axis=1) >= 2                            # slots of replicated experts
    draws = 2 * count                                                                 # half may be dropped
    hot_slot = _draw(hot[:, gpu], draws, rng)
    cool_slot = _draw(cool[:, gpu], draws, rng)
    spare_slot = _draw(cool[:, gpu] * spare, draws, rng)
    swap = rng.random((layers, draws)) < SWAP_SHARE
    row = np.arange(layers)[:, None]
    drawn = np.repeat(maps[:, None], draws, axis=1)
    moved = np.where(swap, cool_slot, spare_slot)
    new_there = maps[row, hot_slot]                                                   # what lands on the moved slot
    drawn[row, np.arange(draws), moved] = new_there
    swapped = drawn[row, np.arange(draws), hot_slot]
    drawn[row, np.arange(draws), hot_slot] = np.where(swap, maps[row, cool_slot], swapped)
    ok = (drawn != maps[:, None]).any(axis=2) & _no_new_duplicates(drawn, maps, num_gpus)
    ok &= swap | spare[row, spare_slot]                                                # a replica to spare
    order = np.argsort(~ok, axis=1, kind="stable")[:, :count]                          # valid first, in draw order
    chosen = np.take_along_axis(drawn, order[..., None], axis=1)
    return np.where(np.take_along_axis(ok, order, axis=1)[..., None], chosen, maps[:, None])


def _draw(weight: np.ndarray, draws: int, rng: np.random.Generator) -> np.ndarray:
    """int64 `[layers, draws]`: slots drawn with probability proportional to `weight [layers, P]` (uniform
    where a row's weights are all 0)."""
    weight = np.where(weight.sum(axis=1, keepdims=True) > 0, weight, 1.0)
    cumulative = np.cumsum(weight, axis=1)
    point = rng.random((len(weight), draws)) * cumulative[:, -1:]
    return np.minimum((cumulative[:, None, :] <= point[..., None]).sum(axis=2), weight.shape[1] - 1)


def _no_new_duplicates(drawn: np.ndarray, maps: np.ndarray, num_gpus: int) -> np.ndarray:
    """bool `[layers, C]`: the candidate has no more (expert, GPU) repeats than its layer's plan."""
    def repeats(rows):
        grouped = np.sort(rows.reshape(*rows.shape[:-1], num_gpus, -1), axis=-1)
        return (grouped[..., 1:] == grouped[..., :-1]).sum(axis=(-1, -2))
    return repeats(drawn) <= repeats(maps)[:, None]
