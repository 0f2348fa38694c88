"""Co-activation: which experts a token picks together (token-level traces and their token sample).

Experts picked together by many tokens receive their rows from the same tokens; placing them on
one GPU keeps a token's dispatches together, spreading them shares the load of one hot input.

Pair keys: a token's k distinct ids at top-k positions i < j give the k(k-1)/2 keys
`id_i * E + id_j`; one `np.bincount` per layer over all of them counts H[a, b], the tokens that
picked a at an earlier position than b, and the tokens picking both are C[a, b] = H[a, b] + H[b, a].

That is k(k-1)/2 keys per token-layer, 3.5x the ids at top-8, so the analyzer's top pair
(`top_pairs`) is computed on the trace's token sample (`moe_place.traces.sample`: at most
SAMPLE_TOKENS tokens drawn at random, every token when the trace has no more):
1. sample complete (every token): the most frequent pair, its tokens and its lift, exactly;
2. otherwise the sample's first quarter (`CHOOSE_ON`) chooses the pair and the other three
   quarters, independent of that choice, estimate how many tokens of the trace pick it. Reading the count off the part that
   chose it would overstate it: the largest of E(E-1)/2 noisy counts sits several standard
   deviations above its own mean (on uniform routing, 128 experts, top-8: lift ~1.7 for pairs
   that are all 1.0). The lift's standard error is that of a binomial proportion on the second
   three quarters, with the finite-population correction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from moe_place.errors import InputError
from moe_place.traces.count import key_dtype
from moe_place.traces.sample import TokenSample

__all__ = ["TopPairs", "coactivation", "top_pairs"]

#: A sampled (incomplete) token sample chooses each layer's pair on its first 1/CHOOSE_ON tokens and
#: counts the chosen pair on the rest: choosing counts k(k-1)/2 keys per token, counting one pair
#: two compares, so a quarter (2,048 of 8,192 tokens) halves the cost of a half and lowers the
#: estimate's standard error (6,144 tokens instead of 4,096).
CHOOSE_ON = 4
#: Pair keys per bincount call in `coactivation` (a few MB), so memory does not grow with the trace.
CHUNK_PAIRS = 1 << 20
#: Above this many experts a layer's E*E pair counts (8 MB at 1024) are not held densely:
#: `top_pairs` counts the distinct pairs it sees (np.unique) instead.
MAX_DENSE_EXPERTS = 1024


def coactivation(topk_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """int64 `[layers, E, E]`: `C[l, a, b]` = tokens whose layer-`l` top-k holds both `a` and `b`.

    topk_ids: int `[tokens, layers, k]` with distinct ids per token. `C` is symmetric; its
    diagonal `C[l, a, a]` is the load of expert `a` (tokens that picked it). Exact, every token:
    one vectorised pass of pair keys and bincount per layer, in chunks of CHUNK_PAIRS keys.
    """
    ids = np.asarray(topk_ids)
    if ids.ndim != 3:
        raise InputError("topk_ids", "a 3-D array [tokens, layers, k]", f"shape {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= num_experts):
        raise InputError("topk_ids", f"expert ids in [0, {num_experts})")
    tokens, layers, k = ids.shape
    out = np.zeros((layers, num_experts, num_experts), dtype=np.int64)
    chunk = max(1, CHUNK_PAIRS // max(k * (k - 1) // 2, 1))  # bounded memory: chunk * k(k-1)/2 keys at a time
    for start in range(0, tokens, chunk):
        for layer in range(layers):
            cols = _columns(ids[start:start + chunk, layer, :], num_experts)
            ordered = np.bincount(_pair_keys(cols, num_experts).ravel(),
                                  minlength=num_experts * num_experts).reshape(num_experts, num_experts)
            out[layer] += ordered + ordered.T
            out[layer][np.diag_indices(num_experts)] += np.bincount(cols.ravel(), minlength=num_experts)
    return out


@dataclass(frozen=True)
class TopPairs:
    """Per layer, the pair of distinct experts most often picked by the same token, and its lift.

    experts: int64 `[layers, 2]` (a < b; -1 where no token picks two experts, i.e. k = 1).
    tokens: float64 `[layers]` tokens of the whole trace picking both (estimated when sampled).
    lift: float64 `[layers]` `num_tokens * tokens / (load_a * load_b)`: 1 when a and b are picked
        independently (NaN where there is no pair).
    lift_stderr: float64 `[layers]` standard error of `lift` (0 when computed on every token).
    num_tokens: tokens of the trace; chosen_on, estimated_on: tokens the pairs were chosen on and
        counted on (both `num_tokens` when exact).
    Ties between pairs go to the smallest (a, b).
    """

    experts: np.ndarray
    tokens: np.ndarray
    lift: np.ndarray
    lift_stderr: np.ndarray
    num_tokens: int
    chosen_on: int
    estimated_on: int

    def __post_init__(self) -> None:
        layers = self.experts.shape[0]
        if self.experts.shape != (layers, 2) or any(a.shape != (layers,) for a in
                                                     (self.tokens, self.lift, self.lift_stderr)):
            raise InputError("TopPairs", "experts [layers, 2] and tokens, lift, lift_stderr [layers]")

    @property
    def exact(self) -> bool:
        return self.chosen_on == self.estimated_on == self.num_tokens


def top_pairs(sample: TokenSample, loads: np.ndarray) -> TopPairs:
    """The most frequent pair of each layer (see the module docstring for how it is chosen).

    sample: the trace's token sample (`Trace.token_sample()`), ids `[n, layers, k]`.
    loads: int64 `[layers, E]` dispatches per expert over the whole trace (tokens picking it).
    The pairs are chosen one layer after the other (a layer is ~0.2 ms of small numpy calls, which
    a second thread slows down more than it helps: it waits for the GIL), after one transpose of
    the tokens they are chosen on to `[layers, k, tokens]` (each top-k position of a layer
    contiguous: a strided `[tokens, k]` compare along k is ten times slower); a sampled trace's
    other tokens are counted for every layer at once (`_tokens_picking`), in the sample's layout.
    """
    loads = np.asarray(loads)
    ids = sample.ids
    n, layers, k = ids.shape
    if loads.ndim != 2 or loads.shape[0] != layers:
        raise InputError("loads", f"an array [{layers} layers, experts]", f"shape {loads.shape}")
    num_experts = loads.shape[1]
    chosen_on = n if sample.complete else n // CHOOSE_ON
    experts = np.full((layers, 2), -1, dtype=np.int64)
    chosen_count = [0] * layers  # tokens of the first `chosen_on` picking the layer's pair
    if n and k > 1:
        by_layer = np.empty((layers, k, chosen_on), dtype=key_dtype(num_experts * num_experts))
        by_layer[...] = ids[:chosen_on].transpose(1, 2, 0)
        keys = np.empty((k * (k - 1) // 2, chosen_on), dtype=by_layer.dtype)
        for layer in range(layers):
            pair = _most_frequent_pair(_pair_keys(by_layer[layer], num_experts, keys), num_experts)
            if pair is not None:
                experts[layer, 0], experts[layer, 1], chosen_count[layer] = pair
    paired = [layer for layer in range(layers) if experts[layer, 0] >= 0]
    load_ab = {layer: int(loads[layer, experts[layer, 0]]) * int(loads[layer, experts[layer, 1]]) for layer in paired}
    for layer in paired:
        if load_ab[layer] == 0:
            raise InputError("loads", "the trace's loads (its sample's experts have some)",
                             f"0 for expert {experts[layer, 0]} or {experts[layer, 1]}")
    tokens = np.zeros(layers)
    lift = np.full(layers, np.nan)
    stderr = np.zeros(layers)
    total = sample.num_tokens
    if sample.complete:
        for layer in paired:
            tokens[layer] = chosen_count[layer]
            lift[layer] = total * chosen_count[layer] / load_ab[layer]
    elif paired:
        hits = _tokens_picking(ids[chosen_on:], experts)
        for layer in paired:
            share, se = _proportion(int(hits[layer]), n - chosen_on, total - chosen_on)
            tokens[layer] = share * total
            lift[layer] = share * total * total / load_ab[layer]
            stderr[layer] = se * total * total / load_ab[layer]
    estimated_on = n if sample.complete else n - chosen_on
    return TopPairs(experts, tokens, lift, stderr, total, chosen_on, estimated_on)


# ---------------------------------------------------------------------- steps
def _columns(picked: np.ndarray, num_experts: int) -> np.ndarray:
    """The ids `[tokens, k]` of one layer as `[k, tokens]` (each top-k position contiguous), in the
    narrowest dtype holding the pair keys."""
    cols = np.empty(picked.shape[::-1], dtype=key_dtype(num_experts * num_experts))
    cols[...] = picked.T
    return cols


def _pair_keys(cols: np.ndarray, num_experts: int, out: np.ndarray | None = None) -> np.ndarray:
    """`[k(k-1)/2, tokens]` keys `id_i * E + id_j` of the position pairs i < j (rows ordered by i,
    then j) of one layer's ids `cols` `[k, tokens]`, in cols' dtype; written into `out` if given.
    Position i's row, times E, is broadcast against the rows after it: k - 1 contiguous adds."""
    k, tokens = cols.shape
    if out is None:
        out = np.empty((k * (k - 1) // 2, tokens), dtype=cols.dtype)
    scale = cols.dtype.type(num_experts)
    row = 0
    for i in range(k - 1):
        np.add((cols[i] * scale)[None], cols[i + 1:], out=out[row:row + k - 1 - i])
        row += k - 1 - i
    return out


def _most_frequent_pair(pair_keys: np.ndarray, num_experts: int) -> tuple[int, int, int] | None:
    """(a, b, tokens picking both) of the most frequent pair a < b among one layer's `_pair_keys`
    (the smallest pair among ties), or None if no token picks two experts."""
    keys = pair_keys.ravel()
    if num_experts <= MAX_DENSE_EXPERTS:
        ordered = np.bincount(keys, minlength=num_experts * num_experts).reshape(num_experts, num_experts)
        both = ordered + ordered.T
        np.fill_diagonal(both, 0)  # zero already when a token's ids are distinct, as validated traces' are
        best = int(np.argmax(both))  # row-major: the first maximum has a < b
        a, b = divmod(best, num_experts)
        count = int(both[a, b])
    else:
        lo, hi = np.divmod(keys.astype(np.int64), num_experts)
        distinct = lo != hi
        lo, hi = lo[distinct], hi[distinct]
        pairs, counts = np.unique(np.minimum(lo, hi) * num_experts + np.maximum(lo, hi), return_counts=True)
        if not counts.size:
            return None
        best = int(np.argmax(counts))  # sorted keys: the first maximum is the smallest pair
        a, b = divmod(int(pairs[best]), num_experts)
        count = int(counts[best])
    return (a, b, count) if count > 0 else None


def _tokens_picking(ids: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """int64 `[layers]`: the tokens of `ids` int `[m, layers, k]` whose layer-l ids hold both experts
    of `pairs[l]` (int `[layers, 2]`; -1 for none: 0 tokens).

    One pass for all layers in the ids' own layout: each layer's pair, repeated at its k positions,
    is compared with every token's `[layers * k]` ids (a contiguous compare: no transpose), and the
    (token, layer) rows holding each expert are marked.
    """
    m, layers, k = ids.shape
    flat = ids.reshape(m, layers * k)
    holds = np.zeros((2, m * layers), dtype=bool)  # [expert of the pair, row token * layers + layer]
    for which, expert in enumerate(pairs.T):
        at = np.repeat(np.where(expert >= 0, expert, 0), k).astype(ids.dtype)  # -1: expert 0 (its count dropped)
        holds[which, np.flatnonzero(flat == at) // k] = True
    hits = (holds[0] & holds[1]).reshape(m, layers).sum(axis=0, dtype=np.int64)
    return np.where(pairs[:, 0] >= 0, hits, 0)


def _proportion(hits: int, drawn: int, population: int) -> tuple[float, float]:
    """(share, standard error) of a proportion from `drawn` tokens drawn without replacement from
    `population`: `hits / drawn`, and the binomial error with the finite-population correction (a
    count of 0 is given the error of a count of 1, not 0)."""
    share = hits / drawn
    spread = max(hits, 1) / drawn * (1 - share)
    correction = (population - drawn) / (population - 1) if population > 1 else 0.0
    return share, math.sqrt(spread / drawn * correction)
