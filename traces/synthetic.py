"""Synthetic routing traces: seeded, deterministic (numpy Generator), token or count level.

Model. A routing *profile* is, per layer, the probability `q[e]` that a token picks expert e
(its inclusion probability): `0 <= q[e] <= 1` and `sum(q) = top_k`. Profiles come from expert
*weights* `w` (`[layers, experts]`, rows sum to 1) by `inclusion_probabilities(w, top_k)`:
`q = top_k * w`, capped at 1 with the excess spread over the uncapped experts.
- token level (`sample_token_ids`): each token picks exactly top_k distinct experts with
  inclusion probabilities exactly `q` (systematic sampling over a random expert order per token);
- count level (`sample_counts`): the dispatches of `tokens` tokens are multinomial with
  `tokens * top_k` trials and probabilities `q / top_k`. Same mean as the token level; the
  variance is slightly higher (distinctness within a token is not modelled). This is the fast
  path: 58 layers x 256 experts x thousands of tokens per step in well under a millisecond.

Weights: log-normal (`w ~ exp(sigma * N(0,1))`, `lognormal_weights`, and per data domain,
`domain_weights`). Over steps: drifting hot spots (each hot expert keeps its place for a geometric
number of steps with mean `persistence`), and a mixture of domain profiles whose mixing weights
drift (a random walk of the mixture logits): which experts are hot depends on the data.
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from moe_place.errors import InputError
from moe_place.traces.model import Trace, TraceMeta

__all__ = ["coactivation_trace", "deepseek_r1_like", "domain_mixture", "domain_mixture_counts",
           "domain_mixture_trace", "domain_weights", "drifting_hot_spots", "generate", "inclusion_probabilities",
           "lognormal_weights", "sample_counts", "sample_token_ids"]

ProfileSteps = Callable[[np.random.Generator], Iterator[np.ndarray]]


# ---------------------------------------------------------------------- weights [layers, experts]
def lognormal_weights(num_layers: int, num_experts: int, sigma: float | np.ndarray,
                      rng: np.random.Generator) -> np.ndarray:
    """float64 `[layers, experts]`: `w ~ exp(sigma_layer * N(0, 1))`; sigma scalar or `[layers]`."""
    sigma = np.broadcast_to(np.asarray(sigma, dtype=np.float64), (num_layers,))
    return _normalise(np.exp(sigma[:, None] * rng.standard_normal((num_layers, num_experts))))


def inclusion_probabilities(weights: np.ndarray, top_k: int) -> np.ndarray:
    """float64 `[..., experts]`: `top_k * w` capped at 1, the excess spread proportionally; rows sum to top_k."""
    w = _normalise(np.asarray(weights, dtype=np.float64))
    _check(1 <= top_k <= w.shape[-1], "top_k", f"in [1, {w.shape[-1]}]", top_k)
    q = top_k * w
    for _ in range(top_k + 1):  # each round caps at least one more expert per row, or stops
        over = q > 1
        if not over.any():
            break
        capped = np.where(over, 1.0, q)
        free = np.where(capped < 1, capped, 0.0)
        room = top_k - np.where(capped >= 1, 1.0, 0.0).sum(axis=-1, keepdims=True)
        q = np.where(capped >= 1, 1.0, free * room / np.maximum(free.sum(axis=-1, keepdims=True), 1e-300))
    return np.minimum(q, 1.0)


# ---------------------------------------------------------------------- sampling
def sample_token_ids(probs: np.ndarray, num_tokens: int, rng: np.random.Generator,
                     chunk_tokens: int = 256) -> np.ndarray:
    """int16/int32 `[tokens, layers, k]`: k distinct experts per token, inclusion probabilities `probs`.

    probs: `[layers, experts]` from `inclusion_probabilities` (rows sum to k, entries <= 1).
    Systematic sampling: lay the experts out in a random order per token-layer on [0, k) with
    lengths q; the k points u, u+1, ..., u+k-1 (u uniform in [0, 1)) each hit a different expert.
    """
    num_layers, num_experts = probs.shape
    k = int(round(float(probs[0].sum())))
    dtype = np.int16 if num_experts <= np.iinfo(np.int16).max else np.int32
    out = np.empty((num_tokens, num_layers, k), dtype=dtype)
    for start in range(0, num_tokens, chunk_tokens):
        n = min(chunk_tokens, num_tokens - start)
        order = rng.permuted(np.broadcast_to(np.arange(num_experts), (n, num_layers, num_experts)), axis=2)
        edges = np.cumsum(np.take_along_axis(np.broadcast_to(probs, order.shape), order, axis=2), axis=2)
        edges *= k / edges[..., -1:]  # exact total k despite rounding
        u = rng.random((n, num_layers, 1))
        hits = np.diff(np.floor(edges - u), axis=2, prepend=np.floor(-u)) > 0
        chosen = order[hits].reshape(n, num_layers, k)
        out[start:start + n] = chosen
    return out


def sample_counts(probs: np.ndarray, num_tokens: int, rng: np.random.Generator) -> np.ndarray:
    """int64 `[layers, experts]`: dispatches of `num_tokens` tokens, multinomial with probabilities probs/k."""
    k = probs.sum(axis=-1, keepdims=True)
    return rng.multinomial(int(num_tokens) * int(round(float(k.reshape(-1)[0]))), probs / k).astype(np.int64)


# ---------------------------------------------------------------------- profiles over steps
def drifting_hot_spots(num_layers: int, num_experts: int, num_hot: int, hot_share: float,
                       persistence: float) -> ProfileSteps:
    """`num_hot` hot experts per layer share `hot_share`; each moves to a random expert with
    probability 1/persistence per step (so a hot spot lasts `persistence` steps on average)."""
    _check(persistence >= 1, "persistence", "a number of steps >= 1", persistence)
    _check(0 < num_hot < num_experts, "num_hot", f"in [1, {num_experts})", num_hot)
    _check(0 < hot_share < 1, "hot_share", "in (0, 1)", hot_share)

    def steps(rng: np.random.Generator) -> Iterator[np.ndarray]:
        hot = np.stack([rng.choice(num_experts, num_hot, replace=False) for _ in range(num_layers)])
        cold = (1 - hot_share) / (num_experts - num_hot)
        while True:
            w = np.full((num_layers, num_experts), cold)
            np.put_along_axis(w, hot, 0.0, axis=1)
            np.add.at(w, (np.arange(num_layers)[:, None], hot), hot_share / num_hot)
            yield _normalise(w)
            moves = rng.random(hot.shape) < 1.0 / persistence
            hot = np.where(moves, rng.integers(0, num_experts, hot.shape), hot)
    return steps


def domain_mixture(domain_weights: np.ndarray, drift: float, concentration: float = 1.0) -> ProfileSteps:
    """Mixture of `domain_weights` `[domains, layers, experts]` with drifting mixing weights.

    The mixture logits start from N(0, concentration) and take a N(0, drift) random-walk step per
    step; step weights are `softmax(logits) @ domain_weights`.
    """
    num_domains = domain_weights.shape[0]

    def steps(rng: np.random.Generator) -> Iterator[np.ndarray]:
        logits = concentration * rng.standard_normal(num_domains)
        while True:
            mix = np.exp(logits - logits.max())
            yield np.tensordot(mix / mix.sum(), domain_weights, axes=1)
            logits = logits + drift * rng.standard_normal(num_domains)
    return steps


# ---------------------------------------------------------------------- generators
def generate(profile: ProfileSteps, num_steps: int, tokens_per_step: int, top_k: int, seed: int,
             token_level: bool, model: str = "synthetic", source: str = "synthetic") -> Trace:
    """A Trace of `num_steps` steps drawn from `profile` (token or count level)."""
    _check(num_steps >= 1, "num_steps", "an integer >= 1", num_steps)
    _check(tokens_per_step >= 1, "tokens_per_step", "an integer >= 1", tokens_per_step)
    rng = np.random.default_rng(seed)
    steps = profile(rng)
    draws = []
    for _ in range(num_steps):
        probs = inclusion_probabilities(next(steps), top_k)
        draws.append(sample_token_ids(probs, tokens_per_step, rng) if token_level
                     else sample_counts(probs, tokens_per_step, rng))
    num_layers, num_experts = probs.shape
    meta = TraceMeta(num_experts=num_experts, top_k=top_k, layer_ids=tuple(range(num_layers)), model=model,
                     source=f"{source} seed={seed}", dtype=str(draws[0].dtype))
    if token_level:
        return Trace(meta, topk_ids=tuple(draws))
    return Trace(meta, counts=np.stack(draws))


def domain_weights(num_domains: int, num_layers: int, num_experts: int, skew: float | tuple[float, float],
                   rng: np.random.Generator, hot_factor: tuple[float, float] | None = None) -> np.ndarray:
    """float64 `[domains, layers, experts]`: independent log-normal weights per domain.

    skew: the log-normal sigma; a pair (lo, hi) draws one sigma per layer uniformly in [lo, hi]
    (shared by the domains, so some layers are more skewed than others).
    hot_factor: (lo, hi) or None. If given, each domain has one hot expert per layer (a random
    one) whose weight is `f / experts`, f drawn per layer log-uniformly in [lo, hi] (f times the
    mean weight; the other experts share the rest in their log-normal proportions).
    """
    lo, hi = (skew, skew) if np.isscalar(skew) else skew
    _check(0 <= lo <= hi, "skew", "sigma >= 0 (or a pair lo <= hi)", skew)
    sigma = rng.uniform(lo, hi, num_layers)
    weights = np.stack([lognormal_weights(num_layers, num_experts, sigma, rng) for _ in range(num_domains)])
    if hot_factor is not None:
        f_lo, f_hi = hot_factor
        _check(1 <= f_lo <= f_hi < num_experts, "hot_factor", f"1 <= lo <= hi < {num_experts}", hot_factor)
        factor = np.exp(rng.uniform(np.log(f_lo), np.log(f_hi), num_layers))
        for d in range(num_domains):
            hot = rng.integers(0, num_experts, num_layers)
            rows = np.arange(num_layers)
            weights[d, rows, hot] = 0.0
            weights[d] *= ((1 - factor / num_experts) / weights[d].sum(axis=1))[:, None]
            weights[d, rows, hot] = factor / num_experts
    return weights


def domain_mixture_counts(num_steps: int, num_layers: int, num_experts: int, top_k: int, tokens_per_step: int,
                          num_domains: int = 4, skew: float | tuple[float, float] = 1.0, drift: float = 0.3,
                          concentration: float = 1.0, shared: float = 0.0,
                          hot_factor: tuple[float, float] | None = None, seed: int = 0) -> np.ndarray:
    """int64 `[steps, layers, experts]`: dispatches of a drifting mixture of data domains.

    num_domains: how many data domains (each has its own hot experts per layer).
    skew: log-normal sigma of each domain's expert weights (or a (lo, hi) range across layers).
    drift: std of the per-step random walk of the mixture logits (0: a fixed mix).
    concentration: std of the initial mixture logits (0: an even mix).
    shared: fraction of each domain's weight taken from one profile common to all domains
        (experts hot for every input), in [0, 1).
    hot_factor: (lo, hi) or None: each profile gets one hot expert per layer at f x the mean
        weight, f log-uniform in [lo, hi] per layer (see `domain_weights`).
    tokens_per_step: tokens routed per step (each gives top_k dispatches per layer).
    The count-level sampler (multinomial) is fast enough for 58 layers x 256 experts x
    thousands of steps; same seed, same counts.
    """
    return np.array(domain_mixture_trace(num_steps, tokens_per_step, num_layers, num_experts, top_k, num_domains, skew,
                                         drift, concentration, shared, hot_factor, seed, token_level=False).counts)


def domain_mixture_trace(num_steps: int, tokens_per_step: int, num_layers: int, num_experts: int, top_k: int,
                         num_domains: int = 4, skew: float | tuple[float, float] = 1.0, drift: float = 0.3,
                         concentration: float = 1.0, shared: float = 0.0,
                         hot_factor: tuple[float, float] | None = None, seed: int = 0,
                         token_level: bool = True, model: str = "synthetic") -> Trace:
    """A Trace from the domain mixture (see `domain_mixture_counts` for the parameters)."""
    _check(num_domains >= 1, "num_domains", "an integer >= 1", num_domains)
    _check(0 <= shared < 1, "shared", "in [0, 1)", shared)
    both = domain_weights(num_domains + 1, num_layers, num_experts, skew, np.random.default_rng([seed, 2]), hot_factor)
    weights = (1 - shared) * both[1:] + shared * both[:1]  # each domain's share of the profile common to all
    return generate(domain_mixture(weights, drift, concentration), num_steps, tokens_per_step, top_k, seed,
                    token_level, model=model, source=f"synthetic:domain-mixture d={num_domains} drift={drift}")


# ---------------------------------------------------------------------- co-activation (experts that fire together)
def coactivation_trace(num_steps: int, tokens_per_step: int, num_layers: int, num_experts: int, top_k: int,
                       num_clusters: int, cohesion: float | np.ndarray, topic_spread: float = 1.0,
                       topic_persistence: float = 8.0, expert_skew: float = 0.5, expert_persistence: float = 8.0,
                       seed: int = 0) -> tuple[Trace, np.ndarray]:
    """(Trace, int64 `[layers, experts]` cluster of each expert): routing with a known co-activation structure.

    Each layer's experts form `num_clusters` clusters of `E / num_clusters` (a random partition per
    layer, scrambled ids). Each token has a topic, one of the clusters, the same at every layer
    (its data's topic), drawn from the topic popularity of its step. At a layer of cohesion `c`,
    the token's k distinct experts are drawn without replacement (Gumbel top-k) from
    `c * [e in its topic's cluster] * w_e / w(cluster) + (1 - c) * w_e / w(all)`: with `c = 1` all
    inside its cluster, with `c = 0` no co-activation at all. Drift, stationary: the topic logits
    are Gaussian with standard deviation `topic_spread` at every step, each step's correlated with
    the previous one's by `exp(-1 / topic_persistence)` (an AR(1) process: which cluster is hot
    changes over about `topic_persistence` steps, around a fixed law); the expert log-weights
    `log w` likewise with `expert_skew` and `expert_persistence` (which expert of a cluster is hot).
    cohesion: a share in [0, 1], scalar or `[layers]`. Same seed, same trace and clusters.
    The best node split is known: the clusters, whole, `num_clusters / N` per node.
    """
    _check(num_steps >= 1, "num_steps", "an integer >= 1", num_steps)
    _check(tokens_per_step >= 1, "tokens_per_step", "an integer >= 1", tokens_per_step)
    _check(num_clusters >= 1 and num_experts % num_clusters == 0, "num_clusters",
           f"a divisor of the {num_experts} experts", num_clusters)
    _check(1 <= top_k <= num_experts // num_clusters, "top_k", f"in [1, {num_experts // num_clusters}] (a cluster's "
           "experts)", top_k)
    _check(topic_persistence > 0 and expert_persistence > 0, "persistence", "a number of steps > 0",
           (topic_persistence, expert_persistence))
    cohesion = np.broadcast_to(np.asarray(cohesion, dtype=np.float64), (num_layers,))
    _check(bool(((cohesion >= 0) & (cohesion <= 1)).all()), "cohesion", "shares in [0, 1]", cohesion.tolist())
    rng = np.random.default_rng([seed, 3])
    size = num_experts // num_clusters
    clusters = np.stack([rng.permutation(num_experts) // size for _ in range(num_layers)])   # [layers, E]
    member = clusters[:, None, :] == np.arange(num_clusters)[None, :, None]                 # [layers, C, E]
    topics = topic_spread * rng.standard_normal(num_clusters)
    log_w = expert_skew * rng.standard_normal((num_layers, num_experts))
    dtype = np.int16 if num_experts <= np.iinfo(np.int16).max else np.int32
    draws = []
    for _ in range(num_steps):
        w = np.exp(log_w - log_w.max(axis=1, keepdims=True))                               # [layers, E]
        inside = np.where(member, w[:, None, :], 0.0)
        inside /= inside.sum(axis=2, keepdims=True)                                        # [layers, C, E]
        probs = (cohesion[:, None, None] * inside
                 + (1 - cohesion[:, None, None]) * (w / w.sum(axis=1, keepdims=True))[:, None, :])
        popularity = np.exp(topics - topics.max())
        topic = rng.choice(num_clusters, tokens_per_step, p=popularity / popularity.sum())  # [tokens]
        keys = np.log(np.maximum(probs[:, topic, :], 1e-300)) + rng.gumbel(size=(num_layers, tokens_per_step,
                                                                                 num_experts))
        chosen = np.argpartition(-keys, top_k - 1, axis=2)[:, :, :top_k]                   # [layers, tokens, k]
        draws.append(chosen.transpose(1, 0, 2).astype(dtype))
        topics = _ar1_step(topics, topic_spread, topic_persistence, rng)
        log_w = _ar1_step(log_w, expert_skew, expert_persistence, rng)
    meta = TraceMeta(num_experts=num_experts, top_k=top_k, layer_ids=tuple(range(num_layers)), model="synthetic",
                     source=f"synthetic:coactivation clusters={num_clusters} seed={seed}", dtype=str(draws[0].dtype))
    return Trace(meta, topk_ids=tuple(draws)), clusters


# ---------------------------------------------------------------------- DeepSeek-R1 preset
# Calibrated against the published DeepSeek-R1 figures in traces/data/PROVENANCE.md (see
# tests/test_traces_synthetic.py::test_deepseek_r1_like_calibration for the tolerances).
DEEPSEEK_R1 = dict(num_layers=58, num_experts=256, top_k=8, num_domains=4, skew=(0.75, 1.05), drift=0.15,
                   concentration=1.0, shared=0.9, hot_factor=(9.0, 22.0))


def deepseek_r1_like(num_steps: int = 32, tokens_per_step: int = 4096, seed: int = 0,
                     token_level: bool = False, num_layers: int = DEEPSEEK_R1["num_layers"]) -> Trace:
    """DeepSeek-R1-like routing: 58 MoE layers, 256 experts, top-8, drifting domain mixture.

    Over a trace of the default size (seeds 0-2) it gives, against PROVENANCE.md's figures:
    busiest GPU / mean at EP 32, contiguous placement: 2.54-2.61 averaged over layers (published
    2.56), per layer 1.7-4.2 (published 1.46-3.46: our spread is somewhat wider); hottest expert /
    mean: median over layers 13-14 (published "about 12x"); top 32 of 256 experts: 31-48% of a
    layer's load (published 25-50%). Hot experts are partly shared across domains (90%) and partly
    domain-specific, and the domain mix drifts over steps.
    """
    p = DEEPSEEK_R1
    return domain_mixture_trace(num_steps, tokens_per_step, num_layers, p["num_experts"], p["top_k"],
                                num_domains=p["num_domains"], skew=p["skew"], drift=p["drift"],
                                concentration=p["concentration"], shared=p["shared"],
                                hot_factor=p["hot_factor"], seed=seed,
                                token_level=token_level, model="deepseek-r1-like (synthetic)")


# ---------------------------------------------------------------------- helpers
def _ar1_step(x: np.ndarray, spread: float, persistence: float, rng: np.random.Generator) -> np.ndarray:
    """One step of a stationary AR(1) process of standard deviation `spread` and correlation time `persistence`."""
    keep = np.exp(-1.0 / persistence)
    return keep * x + np.sqrt(1.0 - keep * keep) * spread * rng.standard_normal(x.shape)


def _normalise(w: np.ndarray) -> np.ndarray:
    return w / w.sum(axis=-1, keepdims=True)


def _check(ok: bool, name: str, expected: str, got) -> None:
    if not ok:
        raise InputError(name, expected, got)
