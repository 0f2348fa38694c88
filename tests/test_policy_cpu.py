"""The policies' CPU price per call (`moe_place.online.policy_cpu`): fitted on the committed records' tuning
traces (the engines' own default code and the rule, timed one call at a time), the same on every run."""

import json
from pathlib import Path

import numpy as np
import pytest

from moe_place.errors import InputError
from moe_place.online.policy_cpu import COEFFICIENTS, POLICIES, PROTOCOLS, RECORDS, PolicyCpuPrice, fit, record_runs

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_committed_prices_are_the_fit_of_the_records_tuning_traces(protocol):
    runs = record_runs(json.loads((ROOT / RECORDS[protocol]).read_text()), protocol)
    assert {r["set"] for r in runs} == {"tuning", "evaluation"}
    for policy in POLICIES:
        tuning = [r for r in runs if r["policy"] == policy and r["set"] == "tuning"]
        assert np.allclose(fit(tuning), COEFFICIENTS[(protocol, policy)], rtol=1e-6, atol=1e-12)
        # the evaluation traces are never fitted on: a fit with them moves the prices
        assert not np.allclose(fit([r for r in runs if r["policy"] == policy]), COEFFICIENTS[(protocol, policy)],
                               rtol=1e-6, atol=1e-12)


def test_a_price_grows_with_the_call_and_repeats():
    price = PolicyCpuPrice("sglang")
    small = price.call_s("default", 8, 64, 72, 100)
    assert small > 0 and small == PolicyCpuPrice("sglang").call_s("default", 8, 64, 72, 100)
    assert price.call_s("default", 16, 64, 72, 100) > small
    assert price.call_s("default", 8, 256, 288, 100) > small
    # the rule folds every step of SGLang's per-pass window: a longer window costs it more
    assert price.call_s("moe-place", 8, 64, 72, 1000) > price.call_s("moe-place", 8, 64, 72, 10)


def test_unknown_protocols_and_policies_are_named():
    with pytest.raises(InputError, match="protocol"):
        PolicyCpuPrice("trtllm")
    with pytest.raises(InputError, match="policy"):
        PolicyCpuPrice("vllm").call_s("static", 8, 64, 72, 100)
