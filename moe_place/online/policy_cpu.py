"""What a policy call costs the CPU, priced from committed measurements, so that a replay's verdict repeats.

A replay charges a policy's CPU time where the engine waits for it (SGLang, vLLM's sync mode). Read from the
live clock, that time moves 20-36% between identical runs and decides close sweeps: `moe-place cadence` gave
three verdicts in three runs of one command. So the replay prices a call instead, from the calls the engines'
own code made in the committed replay records (`bench/results/replay_sglang.json`, `replay_vllm.json`:
`bench/bench_replay.py --default-policy engine --torch-threads 1`, one core of a 2-core AMD EPYC with
AVX-512): the default is what SGLang 0.5.23's and vLLM 0.33's own policy code cost there, not the numpy copy
of DeepSeek's algorithm the replay runs (which costs less). The clock is still read and reported.

Per call, for `L` layers of `E` experts on `P` slots with a window of `W` steps:

    t = a * L + b * L * P + c * L * E * W / 1000

fitted per protocol and policy by least squares on the relative error, each run weighted by the square
root of its calls, on the tuning traces only (`bench/fit_policy_cpu.py` prints the errors on both sets;
`tests/test_policy_cpu.py` refits the records and compares). A run's calls are priced within -57% to +76% of
what they measured (the spread of single runs), their sum over a set's runs within -15% to -2%.
The prices are those of that machine: a faster CPU pays both policies less, in proportion.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from moe_place.errors import InputError

__all__ = ["PolicyCpuPrice", "fit", "record_runs", "terms"]

PROTOCOLS = ("sglang", "vllm-sync", "vllm")
POLICIES = ("default", "moe-place")
RECORDS = {"sglang": "bench/results/replay_sglang.json", "vllm-sync": "bench/results/replay_vllm.json",
           "vllm": "bench/results/replay_vllm.json"}
MACHINE = "one core of a 2-core AMD EPYC with AVX-512, one torch thread"
# seconds per unit of each term, (a, b, c): `fit(...)` of the records above (the test refits and compares)
COEFFICIENTS = {
    ("sglang", "default"): (9.467879524e-05, 1.850768898e-06, 1.711181294e-06),
    ("sglang", "moe-place"): (2.212697612e-04, 1.335658344e-06, 5.728621719e-06),
    ("vllm-sync", "default"): (6.576478662e-05, 4.156112245e-06, 5.778962230e-08),
    ("vllm-sync", "moe-place"): (1.926649340e-04, 9.429568623e-07, 2.488581794e-07),
    ("vllm", "default"): (9.270350826e-05, 4.121532994e-06, 0.0),
    ("vllm", "moe-place"): (2.334917873e-04, 8.557419986e-07, 1.190752932e-07),
}


def terms(layers: int, experts: int, physical: int, window: int) -> np.ndarray:
    """float64 `[3]`: the model's terms of one call (module docstring)."""
    return np.array([layers, layers * physical, layers * experts * window * 1e-3], dtype=np.float64)


@dataclass(frozen=True)
class PolicyCpuPrice:
    """The CPU seconds a call of each policy costs under one engine protocol (`PROTOCOLS`)."""

    protocol: str

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise InputError("protocol", f"one of {', '.join(PROTOCOLS)}", self.protocol)

    def call_s(self, policy: str, layers: int, experts: int, physical: int, window: int) -> float:
        """Seconds of one call of `policy` ("default": the engine's own code; "moe-place": the rule)."""
        if policy not in POLICIES:
            raise InputError("policy", f"one of {', '.join(POLICIES)}", policy)
        return float(terms(layers, experts, physical, window) @ np.array(COEFFICIENTS[(self.protocol, policy)]))


def record_runs(record: dict, protocol: str) -> list[dict]:
    """The runs of a replay record that made calls, each with its traces' set (`tuning` or `evaluation`), its
    policy, its terms and its measured CPU seconds per call."""
    sets = {name: kind for kind, names in record.get("sets", {}).items() for name in names}
    out = []
    for trace in record["traces"]:
        if trace["name"] not in sets or protocol not in trace["protocols"]:
            continue
        spec = trace["spec"]
        layers = _spec_int(spec, "layers", 61)
        experts = _spec_int(spec, "experts", 256)
        for run in trace["protocols"][protocol]["runs"]:
            if run["calls"]:
                out.append({"set": sets[trace["name"]], "trace": trace["name"], "policy": run["policy"],
                            "interval": run["step_interval"], "calls": run["calls"], "cpu_s": run["policy_cpu_s"],
                            "terms": terms(layers, experts, trace["physical"], run["window"])})
    return out


def fit(runs: list[dict]) -> tuple[float, float, float]:
    """(a, b, c) of the runs' calls (module docstring), non-negative."""
    if not runs:
        raise InputError("runs", "at least one run with calls", "none")
    x = np.array([r["terms"] for r in runs])
    per_call = np.array([r["cpu_s"] / r["calls"] for r in runs])
    weight = np.sqrt([r["calls"] for r in runs])
    coefficients, *_ = np.linalg.lstsq(x / per_call[:, None] * weight[:, None], weight, rcond=None)
    return tuple(float(c) for c in np.maximum(coefficients, 0.0))


def _spec_int(spec: str, key: str, default: int) -> int:
    match = re.search(rf"\b{key}=(\d+)", spec)
    return int(match.group(1)) if match else default
