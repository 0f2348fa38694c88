"""The in-engine records (`bench/results/engines_{vllm,sglang}.json`) say what they measured, and go stale.

Each record names the commit it ran and holds a digest of every file moe-place's policy is made of inside
the engines (`bench/inengine/harness.py` `RULE_FILES`). A record made before one of those files changed no
longer measures the policy the checkout has: the staleness test fails until it is measured again with the
command the record names (bench/bench_engines.py, in the engine's environment: see its docstring).
"""

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECORDS = {"vllm": ROOT / "bench" / "results" / "engines_vllm.json",
           "sglang": ROOT / "bench" / "results" / "engines_sglang.json"}


from bench_modules import load  # noqa: E402 - tests/, beside this file

def _harness():
    pytest.importorskip("torch")
    return load("inengine.harness")


@pytest.mark.parametrize("engine", sorted(RECORDS))
def test_the_record_names_its_commit_and_the_rules_files(engine):
    harness = _harness()
    record = json.loads(RECORDS[engine].read_text())
    assert re.fullmatch(r"[0-9a-f]{40}", record.get("moe_place_commit") or ""), "no commit in the record"
    assert record.get("rule_files_committed") is True, "measured with uncommitted changes to the rule's files"
    assert set(record["rule_sources"]["files"]) == set(harness.RULE_FILES)
    assert record["versions"][engine] == {"vllm": "0.33.0", "sglang": "0.5.23"}[engine]


@pytest.mark.parametrize("engine", sorted(RECORDS))
def test_the_record_measured_the_rule_this_checkout_has(engine):
    harness = _harness()
    record = json.loads(RECORDS[engine].read_text())
    recorded = record.get("rule_sources", {}).get("files", {})
    now = harness.rule_sources()["files"]
    changed = sorted(path for path in now if recorded.get(path) != now[path])
    assert not changed, (f"{RECORDS[engine].relative_to(ROOT)} was measured at {record.get('moe_place_commit')}; "
                         f"since then these files of the policy changed: {changed}. Measure it again: "
                         f"{' '.join(record.get('command', ['bench/bench_engines.py']))} (bench/bench_engines.py "
                         "docstring: in the engine's environment with the overlay)")


def test_the_digest_sees_a_changed_file(tmp_path):
    harness = _harness()
    for path in harness.RULE_FILES:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / path, tmp_path / path)
    same = harness.rule_sources(tmp_path)
    assert same == harness.rule_sources()
    with open(tmp_path / "moe_place/online/policy.py", "a") as handle:
        handle.write("\n# a change\n")
    changed = harness.rule_sources(tmp_path)
    assert changed["sha256"] != same["sha256"]
    assert [p for p in changed["files"] if changed["files"][p] != same["files"][p]] == ["moe_place/online/policy.py"]


def test_the_rule_files_hold_every_file_that_runs_when_the_engines_call_the_policy():
    # every file of the checkout whose functions run while the stand-in engines install and call moe-place's
    # policy (a global and a hierarchical size, both engines) must be in RULE_FILES
    harness = _harness()
    ran = set()
    root = str(ROOT) + os.sep

    def profile(frame, event, *_):
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(root):
            ran.add(os.path.relpath(name, ROOT))

    sizes = (harness.Size("t", 32, 8, 8, 1, 2, None, 512, 4, "Qwen3-30B-A3B"),
             harness.Size("t-hier", 64, 8, 8, 2, 2, 8, 512, 4, "DeepSeek-V3"))
    for size in sizes:
        workload = harness.skewed_workload(size, "standin-vllm", 400, 3, 1, seed=0)
        for engine in ("standin-vllm", "standin-sglang"):
            sys.setprofile(profile)
            try:
                harness.run_engine(engine, "moe-place", size, workload.counts, dict(step_interval=400, window=200))
            finally:
                sys.setprofile(None)
    ours = {path for path in ran if not path.startswith(("bench" + os.sep, "tests" + os.sep, ".venv"))}
    assert "moe_place/online/policy.py" in ours and "moe_place/engines/sglang.py" in ours
    assert not ours - set(harness.RULE_FILES), sorted(ours - set(harness.RULE_FILES))
    assert all((ROOT / path).exists() for path in harness.RULE_FILES)
