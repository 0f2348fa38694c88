"""Valid lower bounds on the best busiest-GPU load of a layer.

Problem (docs/MODEL.md, "The placement problem"): loads `w[e] >= 0` of `E` experts, `G` GPUs with `S` slots each,
`P = G*S` physical experts; replica counts `r[e] >= 1`, `sum r = P`, no two replicas of one
expert on one GPU. Bounds 1-2 hold for every split policy: they bound `T*`, the smallest
busiest-GPU load any plan reaches with the *optimal* split (each expert's load shared among its
replicas in any proportions), and the even and local splits can only do worse on the same
plan. Bound 3 assumes the even split (every replica of `e` carries `w[e]/r[e]`), which is what
the solvers optimise; `even=False` leaves it out.

1. Average: `T* >= sum(w) / G` (the load has to go somewhere).
2. Count ("apportionment") bound: a GPU with load `<= T` carries at most `T` of any expert, so
   expert `e` needs `r[e] >= ceil(w[e] / T)` replicas, and `r[e] <= G` (one per GPU). Hence
   `T* >= min_r max_e w[e] / r[e]` over `1 <= r[e] <= G`, `sum r <= P`. The minimum is computed
   exactly, without a bisection on floats: handing out replicas one at a time to the largest
   `w / r` (the greedy that DeepSeek EPLB uses) is optimal for this min-max apportionment, and
   the cap `r <= G` adds `max(w) / G`. The value is a quotient `w[e] / r[e]`, computed exactly as
   the even-split item load is, so floating point can never push it above a plan's load. It
   implies `max(w) / min(G, P - E + 1)`.
3. Pigeonhole (cardinality) bound, new here: for a candidate `T`, every expert has at least
   `m[e] = max(1, ceil(w[e]/T))` replicas and at most `R[e] = min(G, m[e] + k)` with
   `k = P - sum m` spare slots, so it contributes `m[e]` items of size at least `w[e] / R[e]`.
   Sorting these guaranteed sizes `q_1 >= q_2 >= ...`: among the `jG + 1` largest items some GPU
   holds `j + 1`, so `T >= q_{jG-j+1} + ... + q_{jG+1}` for `j = 1..S-1`. The test gets only
   harder as `T` falls (fewer spare slots, larger items), so a bisection finds the threshold;
   we return the largest `T` seen to fail (shrunk by 1e-12 relative), a certified bound (a
   failed test proves `T` infeasible, and infeasibility of a target is inherited by every
   smaller one). With no redundant slots (`P = E`) this is the classic `p_G + p_{G+1}` bound.
   The same test also checks, with the guaranteed sizes (real sorted sizes dominate them):
   - `S = 2`: pairs. The best pairing of sorted items is largest with smallest, so
     `T >= q_i + q_{P+1-i}` for every `i` (`q = 0` past the guaranteed items);
   - `S >= 3`: the `j` largest items sit on `j` distinct GPUs together with at least the
     `j(S-1)` smallest items (`T >= q_j + their sum / j`) or two of them share a GPU
     (`T >= 2 q_j + (S-2) q_P`): `T >= min` of the two;
   - `S = 2`, partners: `_partners_short` (a knapsack over how the spare slots can split experts
     so that every big piece finds a small partner).
   All of these bound the even split only; brute force checks them on random tiny layers.

4. Pairing LP bound, 2 slots per GPU only (`pairing_lp_bound`, proof in its docstring): the
   sorted pairing is the best pairing of fixed pieces, Hall's condition on partner limits turns
   "some replica counts pair up under `T`" into prefix-sum constraints over one-hot count
   choices, and an infeasible LP relaxation proves `T` infeasible. ~0.05-0.1 s a layer at EP144,
   so it is not part of `lower_bounds`; `fast` reports it for 2-slot layers; it lifted the certified bound of
   the synthetic DeepSeek-V3 layers at EP144 by ~2% (bounds 1-3 were the weak side there).
5. Pairing IP, 2 slots per GPU (`pairing_ip`): the same model with integer count choices, solved
   by SCIP. Exact for the relaxation that only drops the no-co-location rule, so "infeasible"
   proves the target infeasible and "feasible" hands back replica counts whose sorted pairing
   reaches it. 0.1-0.6 s a test at EP144; `fast` runs it only where the gap to bound 4 stays
   above 1% (it certified 2 such layers and improved the plan of a third).

Several windows (`[windows, E]`): the objective is the max, mean or a quantile of per-window
busiest loads; each window's load is at least its own bound, and max, mean and quantiles are
monotone, so the same aggregate of per-window bounds is a bound. For max and mean also
`mean_w max_g L_w[g] >= max_g mean_w L_w[g]`, so the bound of the mean load vector counts.
"""

from __future__ import annotations

import numpy as np

from moe_place.problem import PlacementProblem, combine_windows
from moe_place.solvers.base import require_ortools

__all__ = ["apportion", "average_bound", "count_bound", "layer_lower_bound", "lower_bounds", "model_lower_bounds",
           "pairing_ip", "pairing_lp_bound", "pairing_lp_infeasible", "pigeonhole_bound", "window_lower_bound",
           "windows_lower_bound"]

_SHRINK = 1.0 - 1e-12  # safety margin on bisection results (never on the exact quotients)


def average_bound(loads: np.ndarray, num_gpus: int) -> np.ndarray:
    """float64 `[...]`: `sum(w) / G` of loads `[..., E]`."""
    return np.asarray(loads, dtype=np.float64).sum(axis=-1) / num_gpus


def count_bound(loads: np.ndarray, num_gpus: int, num_physical: int) -> np.ndarray:
    """float64 `[layers]`: `min_r max_e w[e] / r[e]` with `1 <= r <= G`, `sum r = P` (bound 2).

    loads: `[layers, E]`. Exact (greedy apportionment, vectorised over layers).
    """
    loads = np.atleast_2d(np.asarray(loads, dtype=np.float64))
    replicas = apportion(loads, num_physical)
    return np.maximum((loads / replicas).max(axis=1), loads.max(axis=1) / num_gpus)


def apportion(loads: np.ndarray, num_physical: int, cap: int | None = None) -> np.ndarray:
    """int64 `[layers, E]`: replica counts minimising `max_e w[e] / r[e]` with `sum r = P`.

    Greedy: one replica each, then each extra replica to the largest `w / r` (first on ties)
    among the experts with fewer than `cap` replicas (None: no cap). loads: float64
    `[layers, E]`, `E <= P <= E * cap`.
    """
    layers, experts = loads.shape
    replicas = np.ones((layers, experts), dtype=np.int64)
    rows = np.arange(layers)
    extra = num_physical - experts
    if extra <= 0:
        return replicas
    # Jump ahead safely: r0 = max(1, floor(w / T_up)) with T_up >= the optimum (the max of a
    # feasible r) never exceeds an optimal r, so the greedy from r0 ends at the same optimum.
    if extra > experts:
        total = loads.sum(axis=1, keepdims=True)
        per_load = np.where(total > 0, extra / np.where(total > 0, total, 1.0), 0.0)
        feasible = np.maximum(1, np.floor(loads * per_load).astype(np.int64))
        upper = (loads / feasible).max(axis=1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(upper > 0, loads / np.where(upper > 0, upper, 1.0), 0.0)
        replicas = np.maximum(1, np.floor(ratio).astype(np.int64))
        if cap is not None:
            replicas = np.minimum(replicas, cap)
    for _ in range(int((num_physical - replicas.sum(axis=1)).max())):
        need = replicas.sum(axis=1) < num_physical
        density = loads / replicas
        if cap is not None:
            density = np.where(replicas < cap, density, -np.inf)
        expert = np.argmax(density, axis=1)
        replicas[rows[need], expert[need]] += 1
    return replicas


def pigeonhole_bound(loads: np.ndarray, num_gpus: int, num_physical: int, start: np.ndarray,
                     rel_tol: float = 1e-7) -> np.ndarray:
    """float64 `[layers]`: bound 3, at least `start` (a valid bound `[layers]` already known).

    Brackets the threshold between `start` (fails) and the first of `start * (1 + 2**-4 * 4**i)`
    that passes, then bisects to `rel_tol`; returns the largest failing target, shrunk by 1e-12.
    """
    loads = np.atleast_2d(np.asarray(loads, dtype=np.float64))
    start = np.asarray(start, dtype=np.float64)
    if num_physical // num_gpus < 2:
        return start.copy()
    lo = start.copy()
    active = _pigeonhole_fails(loads, num_gpus, num_physical, lo) & (lo > 0)
    hi = np.where(active, np.maximum(loads.sum(axis=1), lo), lo)  # the test always passes at T = sum(w)
    step = 1.0 / 16
    unbracketed = active.copy()
    while unbracketed.any() and step < 1e6:
        trial = lo * (1 + step)
        passes = unbracketed & (trial < hi) & ~_pigeonhole_fails(loads, num_gpus, num_physical, trial)
        hi = np.where(passes, trial, hi)
        lo = np.where(unbracketed & (trial < hi) & ~passes, trial, lo)
        unbracketed &= ~passes & (trial < hi)
        step *= 4
    while True:
        todo = active & (hi - lo > rel_tol * lo)
        if not todo.any():
            break
        mid = 0.5 * (lo + hi)
        mid_fails = _pigeonhole_fails(loads, num_gpus, num_physical, mid)
        lo = np.where(todo & mid_fails, mid, lo)
        hi = np.where(todo & ~mid_fails, mid, hi)
    return np.where(active, np.maximum(start, lo * _SHRINK), start)


def _pigeonhole_fails(loads: np.ndarray, num_gpus: int, num_physical: int, target: np.ndarray) -> np.ndarray:
    """bool `[layers]`: True where no plan can have busiest load <= target (the test of bound 3)."""
    layers, experts = loads.shape
    slots = num_physical // num_gpus
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(target[:, None] > 0, loads / target[:, None], np.where(loads > 0, np.inf, 0.0))
    ratio = np.minimum(ratio, num_physical + 1.0)
    least = np.maximum(1, np.ceil(ratio * (1 - 1e-12))).astype(np.int64)  # conservative ceil
    spare = num_physical - least.sum(axis=1)
    fails = spare < 0
    most = np.minimum(num_gpus, least + np.maximum(spare, 0)[:, None])
    size = loads / most
    order = np.argsort(-size, axis=1, kind="stable")
    size_sorted = np.take_along_axis(size, order, axis=1)
    count_sorted = np.take_along_axis(least, order, axis=1)
    cum_count = np.cumsum(count_sorted, axis=1)
    cum_size = np.cumsum(size_sorted * count_sorted, axis=1)

    total_items = cum_count[:, -1]                                                      # [layers]
    # one sorted array for all layers (row l shifted by l * big): a single searchsorted finds segments
    big = int(cum_count.max()) + num_physical * num_gpus + 2
    shift = np.arange(layers, dtype=np.int64)[:, None] * big
    flat_count = (cum_count + shift).ravel()

    def segment(i: np.ndarray) -> np.ndarray:
        """`[layers, J]`: index of the segment holding the i-th largest item (count of cum < i)."""
        found = np.searchsorted(flat_count, (i + shift).ravel(), side="left").reshape(i.shape)
        return found - np.arange(layers)[:, None] * experts

    def top_sum(i: np.ndarray) -> np.ndarray:
        """Sum of the i largest guaranteed items, i `[layers, J]` (clipped to the items there are)."""
        i = np.minimum(i, total_items[:, None])
        seg = np.minimum(segment(i), experts - 1)
        prev = np.maximum(seg - 1, 0)
        prev_count = np.where(seg > 0, np.take_along_axis(cum_count, prev, axis=1), 0)
        prev_size = np.where(seg > 0, np.take_along_axis(cum_size, prev, axis=1), 0.0)
        return prev_size + (i - prev_count) * np.take_along_axis(size_sorted, seg, axis=1)

    def value_at(i: np.ndarray) -> np.ndarray:
        """The i-th largest guaranteed item (1-based), 0 past the last one; i `[layers, J]`."""
        seg = np.minimum(segment(i), experts - 1)
        return np.where(i <= total_items[:, None], np.take_along_axis(size_sorted, seg, axis=1), 0.0)

    limit = target[:, None] * (1 + 1e-12)
    j = np.broadcast_to(np.arange(1, slots), (layers, slots - 1))
    upper = j * num_gpus + 1  # the jG+1 largest items ...
    lower = upper - j - 1     # ... minus the jG-j largest leave the j+1 smallest of them
    window = top_sum(upper) - top_sum(lower)
    violated = ((upper <= total_items[:, None]) & (window > limit)).any(axis=1)
    rank = np.broadcast_to(np.arange(1, num_gpus + 1), (layers, num_gpus))
    if slots == 2:  # items pair up: sorted pairing (largest with smallest) is the best there is
        pair = value_at(rank) + value_at(num_physical + 1 - rank)
        violated |= (pair > limit).any(axis=1)
        violated |= _partners_short(loads, least, spare, num_gpus, target)
    else:  # the j largest items: on j distinct GPUs (with the j(S-1) smallest items at best) or two share one
        bottom = top_sum(np.full_like(rank, num_physical)) - top_sum(num_physical - rank * (slots - 1))
        largest = value_at(rank)
        smallest = value_at(np.full_like(rank, num_physical))
        spread = largest + bottom / rank
        shared = 2 * largest + (slots - 2) * smallest
        violated |= (np.minimum(spread, shared) > limit).any(axis=1)
    return fails | violated


PARTNER_CANDIDATES = 8  # partner-size thresholds y tried by `_partners_short`


def _partners_short(loads: np.ndarray, least: np.ndarray, spare: np.ndarray, num_gpus: int,
                    target: np.ndarray) -> np.ndarray:
    """bool `[layers]`: with 2 slots per GPU, the big pieces cannot all find small partners.

    For a partner size `y < T/2`, every piece larger than `x = T - y` shares its GPU with a piece
    of at most `y`, so a plan at `T` needs `#pieces > x <= #pieces <= y`. Counting each expert's
    pieces as `+r` when small (`<= y`), `-r` when big (`> x`), 0 in between, the spare slots can
    only (a) go to a small expert, +1 each, (b) split a big expert until its pieces are `<= x`,
    (c) split further until they are `<= y`. The best use is a knapsack over (b) and (c); its
    fractional relaxation over-estimates it, so a negative total proves that no plan reaches `T`
    (conflicts ignored, even split). Tried for the smallest pieces as `y`.
    """
    layers, experts = loads.shape
    small_piece = loads / least
    half = target[:, None] / 2
    candidates = np.sort(np.where(small_piece < half, small_piece, np.inf), axis=1)[:, :PARTNER_CANDIDATES]
    y = candidates[:, :, None]                                  # [layers, J, 1]
    valid_y = np.isfinite(y[..., 0])
    y = np.where(np.isfinite(y), y, 0.0)
    x = target[:, None, None] - y
    w, m, s = loads[:, None, :], least[:, None, :], small_piece[:, None, :]
    good = s <= y
    bad = s > x
    base = (m * good - m * bad).sum(axis=2) + spare[:, None]    # [layers, J]
    with np.errstate(divide="ignore", invalid="ignore"):
        to_mid = np.maximum(m, np.ceil(w / x * (1 - 1e-12)))
        to_good = np.where(y > 0, np.maximum(m, np.ceil(w / np.where(y > 0, y, 1.0) * (1 - 1e-12))),
                           np.where(w > 0, np.inf, m))
    mid_ok = bad & (to_mid <= num_gpus)
    cost1 = np.where(mid_ok, to_mid - m, 0.0)
    gain1 = np.where(mid_ok, m - cost1, 0.0)
    start = np.where(bad, to_mid, m)
    good_ok = ~good & (to_good <= num_gpus) & (~bad | mid_ok)
    cost2 = np.where(good_ok, to_good - start, 0.0)
    gain2 = np.where(good_ok, start, 0.0)
    cost = np.concatenate([cost1, cost2], axis=2)
    gain = np.concatenate([gain1, gain2], axis=2)
    useful = gain > 0  # a step of cost 0 (pieces already small enough) is free: taken first
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(useful, np.where(cost > 0, gain / np.where(cost > 0, cost, 1.0), np.inf), -1.0)
    order = np.argsort(-ratio, axis=2, kind="stable")
    cost = np.where(useful, cost, 0.0)
    gain = np.where(useful, gain, 0.0)
    cost_sorted = np.take_along_axis(cost, order, axis=2)
    gain_sorted = np.take_along_axis(gain, order, axis=2)
    before = np.cumsum(cost_sorted, axis=2) - cost_sorted
    budget = spare[:, None, None].astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        fraction = np.where(cost_sorted > 0, np.clip((budget - before) / np.where(cost_sorted > 0, cost_sorted, 1.0),
                                                     0.0, 1.0), 1.0)
    best = base + (gain_sorted * fraction).sum(axis=2)
    return (valid_y & (best < -1e-9)).any(axis=1)


def lower_bounds(loads: np.ndarray, num_gpus: int, num_physical: int, pigeonhole: bool = True) -> np.ndarray:
    """float64 `[layers]`: the best of bounds 1-3 for each layer of loads `[layers, E]`."""
    loads = np.atleast_2d(np.asarray(loads, dtype=np.float64))
    best = np.maximum(average_bound(loads, num_gpus), count_bound(loads, num_gpus, num_physical))
    if pigeonhole:
        best = pigeonhole_bound(loads, num_gpus, num_physical, best)
    return best


def layer_lower_bound(loads: np.ndarray, num_gpus: int, num_physical: int, even: bool = True) -> float:
    """The best bound for one layer's loads `[E]` (bound 3 only when `even`)."""
    return float(lower_bounds(np.asarray(loads)[None], num_gpus, num_physical, pigeonhole=even)[0])


def windows_lower_bound(loads: np.ndarray, num_gpus: int, num_physical: int, objective: str = "max",
                        quantile: float = 0.9, even: bool = True) -> float:
    """Bound on the aggregated objective of one layer with loads `[windows, E]`."""
    loads = np.atleast_2d(np.asarray(loads, dtype=np.float64))
    per_window = lower_bounds(loads, num_gpus, num_physical, pigeonhole=even)
    bound = combine_windows(per_window, objective, quantile)
    if objective in ("max", "mean") and loads.shape[0] > 1:
        bound = max(bound, layer_lower_bound(loads.mean(axis=0), num_gpus, num_physical, even))
    return bound


def model_lower_bounds(problem: PlacementProblem, quick: bool = False) -> np.ndarray:
    """float64 `[layers]`: `window_lower_bound` of every layer, computed in one vectorised pass.

    quick: bounds 1-2 only (milliseconds for a whole model; bound 3 can take a second at EP144).
    """
    windows, layers, experts = problem.loads.shape
    per_window = lower_bounds(problem.loads.reshape(windows * layers, experts), problem.num_gpus,
                              problem.num_physical, pigeonhole=not quick).reshape(windows, layers)
    out = np.array([problem.aggregate(per_window[:, i]) for i in range(layers)])
    if problem.window_objective in ("max", "mean") and windows > 1:
        out = np.maximum(out, lower_bounds(problem.loads.mean(axis=0), problem.num_gpus, problem.num_physical,
                                           pigeonhole=not quick))
    return out


def window_lower_bound(problem: PlacementProblem, layer: int) -> float:
    """The bound of one layer of `problem` (its windows combined by its window objective)."""
    return windows_lower_bound(problem.layer_loads(layer), problem.num_gpus, problem.num_physical,
                               problem.window_objective, problem.quantile)


# ---------------------------------------------------------------------- S = 2: pairing LP bound
def _pairing_lp_model(w: np.ndarray, num_gpus: int, num_physical: int, target: float):
    """(the LP of `pairing_lp_infeasible` as an `MPModelProto`, int64 `[K]` replica count of
    each option variable, int64 `[K]` its expert), or True when the count bounds alone already
    rule `target` out. Built from numpy arrays (no per-option Python objects)."""
    require_ortools("the pairing bound (2 slots per GPU)")
    from ortools.linear_solver import linear_solver_pb2 as pb  # OR-Tools is optional: see solvers.base

    G, P, T = num_gpus, num_physical, float(target)
    least = np.maximum(1, np.ceil(w / T * (1 - 1e-12))).astype(np.int64)
    if least.max() > G or least.sum() > P:
        return True
    spare = P - int(least.sum())
    top = np.minimum(G, least + spare)
    count = top - least + 1                                     # options per expert
    K = int(count.sum())
    start = np.concatenate(([0], np.cumsum(count)[:-1]))
    experts = np.repeat(np.arange(w.size), count)
    reps = least[experts] + np.arange(K) - start[experts]       # [K] replica count of each option
    piece = w[experts] / reps
    small = piece <= 0.5 * T * (1 + 1e-9)                       # lenient: more supply, never less
    # supply counts from its size on (lenient), demand from its partner limit on (exact)
    level = np.where(small, piece * (1 - 1e-9), T - piece)
    coef = np.where(small, reps, -reps).astype(np.float64)
    checkpoints = np.unique(level[~small])                      # a prefix constraint at every demand level
    C = checkpoints.size
    slot = np.searchsorted(checkpoints, level, side="left")     # first checkpoint at or above the level
    model = pb.MPModelProto()
    model.variable.extend([pb.MPVariableProto(lower_bound=0.0, upper_bound=1.0)] * K)
    model.variable.extend([pb.MPVariableProto(lower_bound=0.0, upper_bound=float("inf"))] * C)
    options = np.arange(K)
    for e in range(w.size):                                     # one count per expert
        model.constraint.add(var_index=options[start[e]:start[e] + count[e]].tolist(),
                             coefficient=[1.0] * int(count[e]), lower_bound=1.0, upper_bound=1.0)
    model.constraint.add(var_index=options.tolist(), coefficient=reps.astype(np.float64).tolist(),
                         lower_bound=float(P), upper_bound=float(P))
    # balance b_c = b_{c-1} + (supply minus demand of the options whose level falls in (c-1, c]) >= 0
    keep = slot < C
    order = np.argsort(slot[keep], kind="stable")
    idx, sl, cf = options[keep][order], slot[keep][order], coef[keep][order]
    bounds = np.searchsorted(sl, np.arange(C + 1), side="left")
    for c in range(C):
        lo, hi = bounds[c], bounds[c + 1]
        var_index = idx[lo:hi].tolist() + [K + c] + ([K + c - 1] if c else [])
        coefficient = (-cf[lo:hi]).tolist() + [1.0] + ([-1.0] if c else [])
        model.constraint.add(var_index=var_index, coefficient=coefficient, lower_bound=0.0, upper_bound=0.0)
    return model, reps, experts


def pairing_lp_infeasible(loads: np.ndarray, num_gpus: int, num_physical: int, target: float) -> bool:
    """True when no even-split plan with 2 slots per GPU has busiest load <= `target` (LP proof).

    loads: float64 `[E]`; requires `num_physical == 2 * num_gpus`. See `pairing_lp_bound` for
    the model; False means only that the LP relaxation is feasible (no proof either way).
    """
    require_ortools("the pairing bound (2 slots per GPU)")
    from ortools.linear_solver import pywraplp  # OR-Tools is optional: see solvers.base

    w = np.asarray(loads, dtype=np.float64)
    if float(target) <= 0:
        return bool((w > 0).any())
    built = _pairing_lp_model(w, num_gpus, num_physical, target)
    if built is True:
        return True
    model = built[0]
    solver = pywraplp.Solver.CreateSolver("GLOP")
    error = solver.LoadModelFromProto(model)
    if error:
        raise RuntimeError(f"pairing LP: {error}")
    # small integer coefficients: scaling and presolve cost more than they save (2x measured);
    # INFEASIBLE still means no point within GLOP's feasibility tolerance
    solver.SetSolverSpecificParametersAsString("use_scaling: false use_preprocessing: false")
    return solver.Solve() == pywraplp.Solver.INFEASIBLE


def pairing_lp_bound(loads: np.ndarray, num_gpus: int, num_physical: int, lower: float, upper: float,
                     rel_tol: float = 1e-3) -> float:
    """A certified bound for one layer with 2 slots per GPU under the even split (bound 4).

    loads: float64 `[E]`; `num_physical == 2 * num_gpus`. lower: a valid bound already known
    (e.g. `layer_lower_bound`); upper: the busiest load of some plan (the optimum lies in
    `[lower, upper]`). Searches `T` with `pairing_lp_infeasible` (galloping down from `upper` by
    `2, 4, 8, ... x rel_tol`, then bisecting) until the bracket is within `rel_tol`, and returns
    the largest target proven infeasible, shrunk by 1e-9 (or `lower`); `upper` only steers the
    search, validity never depends on it. About 15 ms per test at EP144 (256 experts, 288
    slots; the LP is built from numpy arrays), 3-6 tests per layer.

    Why it is valid. With `S = 2` every GPU holds two pieces, so a plan is a perfect matching
    of the `P` pieces (`r[e]` pieces of size `w[e]/r[e]`) and its busiest load is the largest
    pair sum; ignoring the rule against two replicas of one expert on a GPU only lowers it.
    (i) For fixed pieces the least largest pair sum over all matchings is the sorted pairing
    `max_i a_(i) + a_(P+1-i)` (exchange argument: if `a >= b >= c >= d` and `a` is paired with
    `c` and `b` with `d`, re-pairing `a-d`, `b-c` does not raise the larger sum). (ii) A target
    `T` admits a matching iff (Hall, neighbourhoods nested): call a piece *big* when it exceeds
    `T/2` and give it the partner limit `T - size`; for every level `v`, the number of big
    pieces with limit `<= v` is at most the number of small pieces of size `<= v`. (Bigs with
    the tightest limits need distinct partners below their limits; smalls left over pair among
    themselves, any two summing to `<= T`.) (iii) This is linear in one-hot choices `x[e, r]`
    of the replica count (`ceil(w/T) <= r <= min(G, ceil(w/T) + spare)`, the spare being what
    the fewest counts leave of `P`): an option adds `+r` at level `w/r` when small and `-r` at
    level `T - w/r` when big; `sum_r x[e, r] = 1`, `sum r x = P`, every prefix sum over levels
    `>= 0`. Its LP relaxation being infeasible proves `T` infeasible, and infeasibility is
    inherited by every smaller `T` (a plan at `T' < T` is a plan at `T`). Tolerances lean
    towards feasibility (a small piece counts from just below its size, `T/2` ties are small).
    Measured on the synthetic DeepSeek-V3 layers at EP144: within ~1% of the exact optimum of
    the same relaxation without LP (CP-SAT), where bounds 1-3 were 3% low.
    """
    if num_physical != 2 * num_gpus:
        raise ValueError("pairing_lp_bound needs exactly 2 slots per GPU")
    lo, hi = float(lower), float(upper)
    best = lo
    step: float | None = 2 * rel_tol  # gallop down from `upper` (plans are usually near the bound), then bisect
    while hi - lo > rel_tol * hi:
        mid = hi * (1 - step) if step is not None and hi * (1 - step) > lo else 0.5 * (lo + hi)
        if pairing_lp_infeasible(loads, num_gpus, num_physical, mid):
            lo, step = mid, None
            best = max(best, mid * (1 - 1e-9))
        else:
            hi = mid
            step = None if step is None else 2 * step
    return best


def pairing_ip(loads: np.ndarray, num_gpus: int, num_physical: int, target: float,
               time_limit_s: float = 10.0) -> tuple[str, np.ndarray | None]:
    """The integer version of `pairing_lp_infeasible`'s model (bound 5), solved by SCIP.

    Returns ("infeasible", None): no even-split plan with 2 slots per GPU reaches `target` (a
    proof: the integer model is exactly conditions (ii)-(iii) of `pairing_lp_bound` on integer
    replica counts, which every plan satisfies; only the rule against co-located replicas is
    relaxed); ("feasible", counts int64 `[E]`): replica counts whose sorted pairing (largest with
    smallest) has every pair sum <= `target` (up to co-location, which `fast.pair_plan`
    repairs); ("unknown", None) when SCIP stops at `time_limit_s` (a safety net: single-threaded
    SCIP is deterministic, and the EP144 layers take 0.1-0.6 s). Costs 10-50x one LP test, so
    `fast` uses it only on layers whose gap stays above 1% after bound 4.
    """
    require_ortools("the integer pairing test (2 slots per GPU)")
    from ortools.linear_solver import pywraplp  # OR-Tools is optional: see solvers.base

    w = np.asarray(loads, dtype=np.float64)
    if float(target) <= 0:
        return ("infeasible", None) if (w > 0).any() else ("unknown", None)
    built = _pairing_lp_model(w, num_gpus, num_physical, target)
    if built is True:
        return "infeasible", None
    model, reps, experts = built
    for variable in model.variable[:reps.size]:
        variable.is_integer = True
    solver = pywraplp.Solver.CreateSolver("SCIP")
    if solver is None:
        return "unknown", None
    # SCIP's own Ctrl-C handler would end the solve as "interrupted" and swallow the signal (the command
    # then went on); off, the signal waits for the solve (0.1-0.6 s) and stops the command (moe_place.interrupts)
    solver.SetSolverSpecificParametersAsString("misc/catchctrlc = FALSE\n")
    error = solver.LoadModelFromProto(model)
    if error:
        raise RuntimeError(f"pairing IP: {error}")
    solver.SetTimeLimit(int(time_limit_s * 1000))
    status = solver.Solve()
    if status == pywraplp.Solver.INFEASIBLE:
        return "infeasible", None
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        return "unknown", None
    chosen = np.array([v.solution_value() for v in solver.variables()[:reps.size]]) > 0.5
    counts = np.zeros(w.size, dtype=np.int64)
    counts[experts[chosen]] = reps[chosen]
    if (np.bincount(experts[chosen], minlength=w.size) != 1).any() or counts.sum() != num_physical:
        return "unknown", None
    return "feasible", counts
