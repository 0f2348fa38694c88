"""Redundancy sizing: how many redundant experts per layer are worth the GPU memory they take.

vLLM (`num_redundant_experts`) and SGLang (`--ep-num-redundant-experts`) take the number of
redundant experts `R` from the user. Each one is another copy of an expert's weights in every MoE
layer, memory the KV cache no longer has (vLLM issue #30075 asks for an automatic value; its
proposal is the smallest `R` that makes `E + R` divisible by the EP size). `size_redundancy`
measures, for each candidate `R`, what the plans buy out of sample and what they cost:

1. Candidates (`candidate_redundancies`): every `R >= 0` with `(E + R) % G == 0` (engines give
   every GPU the same number of slots) up to `max_redundant` (default `2E`, and never more than
   `E(G - 1)`: one copy of each expert on every GPU), evenly spaced a multiple of `G` apart so that
   there are at most `MAX_CANDIDATES`; with a memory cap, those whose replicas fit it.
2. Held-out folds (`fold_slices`): the steps (recorded batches) in `min(steps, MAX_FOLDS)` runs of
   consecutive steps; with three steps, each step is left out once. For each fold the candidate's
   plan is made on the other steps' loads summed (as `moe-place plan` plans) and judged on each
   step of the fold. A one-step token-level trace is split into its two halves of tokens
   (`held_out_steps`); one step of counts cannot be judged out of sample (InputError).
3. Held-out busiest/mean of a plan on one step: summed over layers, the busiest GPU's load under
   the even split (with `split="per-batch"`: the per-batch split of that step, and the judged plans are
   placed for it, `moe_place.solvers.split_placement`) over the mean GPU's load; the step's expert compute against a perfect balance
   (formula 1 of docs/MODEL.md: the busiest GPU sets each layer's time, and layers run one after
   another). A top-k trace gives every layer the same load, so this is also the mean over layers
   of each layer's busiest/mean. A candidate's figure is the mean over all held-out steps.
4. Memory (`ReplicaMemory`): `R / G` replicas per GPU (on average) in each of the model's MoE
   layers, `R / G * moe_layers * W_e` bytes per GPU, and the KV-cache tokens those bytes would hold
   (`bytes // kv_bytes_per_token`: each GPU caches whole tokens, as with data-parallel attention,
   vLLM's DP + EP and SGLang's `--enable-dp-attention`; tensor-parallel GQA attention over `T`
   GPUs splits the KV heads, and the same bytes hold up to `T` times as many tokens).
5. Recommendation (`recommend`): the knee of held-out busiest/mean against memory, priced. Points
   (replica GiB per GPU, held-out busiest/mean), one per candidate; their lower convex hull from
   the cheapest candidate; its segments in order of memory, kept while each lowers held-out
   busiest/mean by at least `min_gain_per_gib` of its value per GiB per GPU (default 1%); the
   recommendation is the end of the last segment kept (the cheapest candidate if none is). The
   hull passes over a candidate that a cheaper and a dearer one together beat (the noise of a few
   held-out steps), and a price per GiB makes the answer independent of how far the candidates
   go, except when every segment pays: then it is the largest candidate, and the reason says that
   more may pay.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_place.analysis.windows import consecutive_runs
from moe_place.cost.units import GIB_BYTES, MIB_BYTES
from moe_place.errors import InputError
from moe_place.placement import even_split_gpu_loads
from moe_place.problem import PlacementProblem
from moe_place.progress import ProgressBar
from moe_place.solvers import solve
from moe_place.solvers.deepseek import eplb_rebalance
from moe_place.solvers.split_placement import ROUNDS, plan_for_split, split_busiest_over_mean
from moe_place.traces.model import Trace, count_dispatches

__all__ = ["ReplicaMemory", "Sizing", "SizingRow", "busiest_over_mean", "candidate_redundancies", "fold_slices",
           "held_out_steps", "lower_hull", "recommend", "size_redundancy"]

MAX_FOLDS = 3        # held-out folds at most (as the time planner's cross-validation, solvers/comm/decision.py)
MAX_CANDIDATES = 33  # candidates at most: 0..2E in steps of 8 for E = 128 at EP8, each planned once per fold
# A GiB of replicas per GPU must lower held-out busiest/mean by 1% of its value. One GiB per GPU holds
# 10,922 tokens of Qwen3-30B-A3B's KV cache (15,279 of DeepSeek-V3's): 1.7-2.5% of the tokens of a GPU
# with 40-60 GiB of KV cache, while 1% lower busiest/mean is at most 1% less expert time. Raise the price
# when the KV cache limits the batch; lower it when it does not.
DEFAULT_MIN_GAIN_PER_GIB = 0.01


@dataclass(frozen=True)
class ReplicaMemory:
    """What a redundant expert costs in GPU memory.

    expert_bytes: `W_e`, one expert's weights. moe_layers: the model's MoE layers (each holds `R`
    redundant experts). kv_bytes_per_token: one token's KV cache over all layers, or None (unknown:
    no KV tokens reported). source: where the figures come from (a preset name, `--expert-bytes`).
    """

    expert_bytes: int
    moe_layers: int
    kv_bytes_per_token: int | None = None
    source: str = ""

    def __post_init__(self) -> None:
        for key in ("expert_bytes", "moe_layers"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"replica memory {key}", "an integer >= 1", value)
        if self.kv_bytes_per_token is not None and not self.kv_bytes_per_token >= 1:
            raise InputError("replica memory kv_bytes_per_token", "an integer >= 1 or None", self.kv_bytes_per_token)

    def bytes_per_gpu(self, redundant: int, num_gpus: int) -> int:
        """Bytes the `redundant` experts of every MoE layer take per GPU, on average (rounded down)."""
        return redundant * self.moe_layers * self.expert_bytes // num_gpus

    def kv_tokens(self, num_bytes: int) -> int | None:
        """KV-cache tokens `num_bytes` would hold (None when the KV bytes per token are unknown)."""
        return None if self.kv_bytes_per_token is None else int(num_bytes // self.kv_bytes_per_token)


@dataclass(frozen=True)
class SizingRow:
    """One candidate.

    redundant: `R`; num_physical: `P = E + R`; slots_per_gpu: `P / G`.
    held_out: mean over the held-out steps of their busiest/mean (module docstring, step 3).
    fold_held_out: the same per fold (mean over the fold's steps), in fold order.
    replica_bytes_per_gpu / kv_tokens_per_gpu: step 4 (kv None when unknown).
    on_hull: the candidate is a vertex of the lower convex hull the recommendation walks.
    """

    redundant: int
    num_physical: int
    slots_per_gpu: int
    held_out: float
    fold_held_out: tuple[float, ...]
    replica_bytes_per_gpu: int
    kv_tokens_per_gpu: int | None
    on_hull: bool

    @property
    def replica_gib_per_gpu(self) -> float:
        return self.replica_bytes_per_gpu / GIB_BYTES

    def to_dict(self) -> dict:
        return {"redundant": self.redundant, "num_physical": self.num_physical, "slots_per_gpu": self.slots_per_gpu,
                "held_out_busiest_over_mean": round(self.held_out, 6),
                "fold_held_out_busiest_over_mean": [round(v, 6) for v in self.fold_held_out],
                "replica_bytes_per_gpu": self.replica_bytes_per_gpu, "kv_tokens_per_gpu": self.kv_tokens_per_gpu,
                "on_hull": self.on_hull}


@dataclass(frozen=True)
class Sizing:
    """The sizing of one EP deployment: every candidate, the recommended `R` and why.

    rows: candidates in increasing `R`. recommended: the `R` of one of them. reason: one sentence.
    folds: how the held-out steps were formed. solver: the solver of the judged plans.
    split: the split the plans are placed for and judged with (`even` or `per-batch`).
    """

    num_experts: int
    num_gpus: int
    rows: tuple[SizingRow, ...]
    recommended: int
    reason: str
    min_gain_per_gib: float
    memory: ReplicaMemory
    folds: str
    solver: str
    split: str = "even"

    def __post_init__(self) -> None:
        if not self.rows or [r.redundant for r in self.rows] != sorted({r.redundant for r in self.rows}):
            raise InputError("sizing rows", "candidates in increasing R")
        if self.recommended not in [r.redundant for r in self.rows]:
            raise InputError("sizing recommended", "one of the candidates", self.recommended)

    def to_dict(self) -> dict:
        return {"recommended_redundant": self.recommended, "reason": self.reason,
                "rule": {"min_gain_per_gib": self.min_gain_per_gib},
                "num_experts": self.num_experts, "num_gpus": self.num_gpus, "folds": self.folds,
                "solver": self.solver, "split": self.split,
                "memory": {"expert_bytes": self.memory.expert_bytes, "moe_layers": self.memory.moe_layers,
                           "kv_bytes_per_token": self.memory.kv_bytes_per_token, "source": self.memory.source},
                "candidates": [r.to_dict() for r in self.rows]}

    def table(self) -> str:
        """The candidates as a text table, the recommendation marked and explained below it."""
        first = self.rows[0].held_out
        kv = self.memory.kv_bytes_per_token
        lines = [f"redundancy sizing: E = {self.num_experts} on {self.num_gpus} GPUs, {self.folds}, "
                 f"{self.solver} plans" + (", placed for and judged with the per-batch split" if self.split == "per-batch" else ""),
                 f"memory: {self.memory.source}, W_e {self.memory.expert_bytes / MIB_BYTES:.2f} MiB x "
                 f"{self.memory.moe_layers} MoE layers, KV cache "
                 + (f"{kv:,} bytes/token" if kv is not None else "bytes/token unknown"),
                 f"{'R':>5} {'P':>5} {'slots/GPU':>9} {'held-out busiest/mean':>21} {'worst fold':>10} "
                 f"{'vs first':>8} {'replica GiB/GPU':>15} {'KV tokens lost/GPU':>18}"]
        for row in self.rows:
            mark = "  <- recommended" if row.redundant == self.recommended else ""
            tokens = f"{row.kv_tokens_per_gpu:,}" if row.kv_tokens_per_gpu is not None else "-"
            lines.append(f"{row.redundant:>5} {row.num_physical:>5} {row.slots_per_gpu:>9} {row.held_out:>21.4f} "
                         f"{max(row.fold_held_out):>10.4f} {row.held_out / first - 1:>+8.1%} "
                         f"{row.replica_gib_per_gpu:>15.2f} {tokens:>18}{mark}")
        lines.append(f"recommended R = {self.recommended}: {self.reason}")
        return "\n".join(lines) + "\n"


def candidate_redundancies(num_experts: int, num_gpus: int, max_redundant: int | None = None) -> list[int]:
    """Increasing `R` values to size (module docstring, step 1; without the memory cap)."""
    if num_experts < 1 or num_gpus < 1:
        raise InputError("candidates", "num_experts and num_gpus >= 1", (num_experts, num_gpus))
    ceiling = num_experts * (num_gpus - 1)
    top = min(2 * num_experts if max_redundant is None else max_redundant, ceiling)
    first = (-num_experts) % num_gpus
    if top < first:
        raise InputError("--max-redundant", f"at least R = {first} (the smallest R with E + R divisible by "
                         f"{num_gpus})", top)
    count = (top - first) // num_gpus + 1
    stride = -(-count // MAX_CANDIDATES)  # candidates this many multiples of G apart
    return list(range(first, top + 1, stride * num_gpus))


def fold_slices(num_steps: int) -> list[range]:
    """The held-out folds: `min(num_steps, MAX_FOLDS)` runs of consecutive step indices."""
    if num_steps < 2:
        raise InputError("held-out folds", "at least two steps", num_steps)
    return consecutive_runs(num_steps, MAX_FOLDS)


def held_out_steps(trace: Trace) -> tuple[np.ndarray, str]:
    """(int64 `[steps, layers, E]` loads to fold, a description) of a trace (module docstring, step 2)."""
    steps = trace.step_counts()
    if trace.num_steps >= 2:
        folds = fold_slices(trace.num_steps)
        how = "leave one step out" if len(folds) == trace.num_steps else "runs of consecutive steps"
        return steps, f"{len(folds)} held-out folds of {trace.num_steps} steps ({how})"
    if trace.is_token_level and trace.topk_ids[0].shape[0] >= 2:
        ids = trace.topk_ids[0]
        half = ids.shape[0] // 2
        halves = np.stack([count_dispatches(ids[:half], trace.num_experts),
                           count_dispatches(ids[half:], trace.num_experts)])
        return halves, "2 held-out folds: the one step's two halves of tokens (plan on one, judge on the other)"
    raise InputError("--redundant auto", "a trace with two or more steps (each candidate is judged on steps it was "
                     "not planned on) or token-level ids (one step is split in halves)",
                     "one step of counts" if not trace.is_token_level else "one step of one token")


def busiest_over_mean(phy2log: np.ndarray, step_loads: np.ndarray, num_gpus: int) -> np.ndarray:
    """float64 `[steps]`: each step's busiest/mean GPU summed over layers (module docstring, step 3).

    phy2log: int `[layers, P]`; step_loads: `[steps, layers, E]`. 1 for a step without load.
    """
    loads = np.asarray(step_loads, dtype=np.float64)
    steps, layers, experts = loads.shape
    rows = np.broadcast_to(np.asarray(phy2log, dtype=np.int64), (steps, layers, phy2log.shape[-1]))
    gpu = even_split_gpu_loads(rows.reshape(steps * layers, -1), loads.reshape(steps * layers, experts), num_gpus)
    busiest = gpu.max(axis=1).reshape(steps, layers).sum(axis=1)
    mean = loads.sum(axis=(1, 2)) / num_gpus
    return np.divide(busiest, mean, out=np.ones_like(mean), where=mean > 0)


def lower_hull(x: list[float], y: list[float]) -> list[int]:
    """Indices of the lower convex hull of the points `(x[i], y[i])`, `x` increasing, left to right."""
    hull: list[int] = []
    for i in range(len(x)):
        while len(hull) >= 2:
            o, a = hull[-2], hull[-1]
            cross = (x[a] - x[o]) * (y[i] - y[o]) - (y[a] - y[o]) * (x[i] - x[o])
            if cross > 0:
                break
            hull.pop()  # `a` lies on or above the line from `o` to `i`
        hull.append(i)
    return hull


def recommend(redundancies: list[int], gib_per_gpu: list[float], held_out: list[float],
              min_gain_per_gib: float = DEFAULT_MIN_GAIN_PER_GIB) -> tuple[int, str, list[int]]:
    """(recommended R, the reason, indices of the hull's vertices): step 5 of the module docstring.

    redundancies / gib_per_gpu / held_out: one value per candidate, in increasing R (and memory).
    """
    n = len(redundancies)
    if n == 0 or len(gib_per_gpu) != n or len(held_out) != n:
        raise InputError("recommend", "one memory and one held-out value per candidate, at least one")
    if any(b <= a for a, b in zip(gib_per_gpu, gib_per_gpu[1:])):
        raise InputError("recommend", "memory increasing with R", gib_per_gpu)
    if not min_gain_per_gib >= 0:
        raise InputError("min_gain_per_gib", "a number >= 0", min_gain_per_gib)
    hull = lower_hull(gib_per_gpu, held_out)
    if n == 1:
        return redundancies[0], "the only candidate", hull
    price = f"{min_gain_per_gib:.2%} per GiB per GPU"
    curve = "the lower convex hull of held-out busiest/mean against replica memory"
    chosen, last_gain = hull[0], None
    for a, b in zip(hull, hull[1:]):
        gain = (held_out[a] - held_out[b]) / held_out[a] / (gib_per_gpu[b] - gib_per_gpu[a])
        if gain < min_gain_per_gib:
            effect = (f"lowers it by only {gain:.2%} per GiB per GPU" if gain > 0 else
                      f"does not lower it ({-gain:+.2%} per GiB per GPU)")
            if last_gain is None:
                return (redundancies[chosen], f"no step pays {price}: the first along {curve}, to "
                        f"R = {redundancies[b]}, {effect}", hull)
            return (redundancies[chosen], f"up to it each step along {curve} lowers it by at least {price} (the "
                    f"last: {last_gain:.2%}); the next, to R = {redundancies[b]}, {effect}", hull)
        chosen, last_gain = b, gain
    return (redundancies[chosen], f"the largest candidate: every step along {curve} lowers it by at least {price} "
            f"(the last: {last_gain:.2%}), so more replicas may pay too (the candidates stop here)", hull)


def size_redundancy(step_loads: np.ndarray, num_gpus: int, memory: ReplicaMemory, *, solver: str = "fast",
                    max_redundant: int | None = None, max_replica_bytes: int | None = None,
                    min_gain_per_gib: float = DEFAULT_MIN_GAIN_PER_GIB, num_nodes: int = 1,
                    num_groups: int | None = None, allow_colocated: bool = False, seed: int = 0, jobs: int = 1,
                    folds: str = "", progress: bool = False, split: str = "even") -> Sizing:
    """Size `R` for `num_gpus` GPUs on held-out steps (module docstring).

    step_loads: `[steps, layers, E]`, at least two steps (`held_out_steps` makes them from a trace).
    solver: the solver of the judged plans (`fast` or `eplb`, no time limit: deterministic).
    max_replica_bytes: the most replica bytes per GPU a candidate may take (None: no cap).
    folds: how the steps were formed, for the report (default: from the fold count).
    split: `even`, or `per-batch`: each fold's plan placed for the per-batch split from the better of the
        solver's plan and EPLB's on the fold's training steps (`plan_for_split`), judged with that split.
    progress: show the work done on stderr (`moe_place.progress`: a bar on a terminal, else a line every few
        seconds): plans, or with the per-batch split the layer rounds of their searches.
    """
    if split not in ("even", "per-batch"):
        raise InputError("split", "even or per-batch", split)
    loads = np.asarray(step_loads, dtype=np.float64)
    if loads.ndim != 3:
        raise InputError("step_loads", "a 3-D array [steps, layers, experts]", f"shape {loads.shape}")
    steps, _, experts = loads.shape
    slices = fold_slices(steps)
    candidates = candidate_redundancies(experts, num_gpus, max_redundant)
    if max_replica_bytes is not None:
        fitting = [r for r in candidates if memory.bytes_per_gpu(r, num_gpus) <= max_replica_bytes]
        if not fitting:
            raise InputError("--max-replica-bytes", f"at least {memory.bytes_per_gpu(candidates[0], num_gpus)} bytes "
                             f"(R = {candidates[0]}, the smallest R that {num_gpus} GPUs allow)", max_replica_bytes)
        candidates = fitting
    plans = len(candidates) * len(slices)
    # the work: plans, or with the per-batch split the layer rounds of each plan's search (its long part)
    per_plan = loads.shape[1] * ROUNDS if split == "per-batch" else 1
    bar = ProgressBar(plans * per_plan, f"size redundancy ({plans} plans)",
                      "layer rounds of the split's search" if split == "per-batch" else "plans", enabled=progress)
    held: list[list[np.ndarray]] = []  # per candidate, per fold: the fold's steps' busiest/mean
    for redundant in candidates:
        per_fold = []
        for fold in slices:
            train = np.delete(loads, list(fold), axis=0).sum(axis=0)
            problem = PlacementProblem(train[None], num_gpus, experts + redundant, num_nodes=num_nodes,
                                       num_groups=num_groups, seed=seed, allow_colocated=allow_colocated)
            plan = solve(problem, solver, jobs=jobs).placement.phy2log
            if split == "per-batch":
                starts = np.stack([plan, eplb_rebalance(train, experts + redundant, 1, 1, num_gpus)])
                plan = plan_for_split(starts, np.delete(loads, list(fold), axis=0), num_gpus,
                                      allow_colocated=allow_colocated, seed=seed, advance=bar.advance).phy2log
                per_fold.append(split_busiest_over_mean(plan, loads[fold.start:fold.stop], num_gpus))
            else:
                per_fold.append(busiest_over_mean(plan, loads[fold.start:fold.stop], num_gpus))
                bar.advance(1)
        held.append(per_fold)
    bar.close()
    held_out = [float(np.concatenate(per_fold).mean()) for per_fold in held]
    memory_bytes = [memory.bytes_per_gpu(r, num_gpus) for r in candidates]
    recommended, reason, hull = recommend(candidates, [b / GIB_BYTES for b in memory_bytes], held_out,
                                          min_gain_per_gib)
    rows = tuple(SizingRow(r, experts + r, (experts + r) // num_gpus, held_out[i],
                           tuple(float(v.mean()) for v in held[i]), memory_bytes[i], memory.kv_tokens(memory_bytes[i]),
                           i in hull) for i, r in enumerate(candidates))
    return Sizing(experts, num_gpus, rows, recommended, reason, min_gain_per_gib, memory,
                  folds or f"{len(slices)} held-out folds of {steps} steps", solver, split)
