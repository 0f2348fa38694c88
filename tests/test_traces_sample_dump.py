"""bench/write_sample_sglang_dump.py: the bundled trace written as SGLang's dump reads back exactly, and plans."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moe_place.cli.main import main
from moe_place.traces import load_trace

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "write_sample_sglang_dump.py"
BUNDLED = ROOT / "traces" / "data" / "qwen3-30b-a3b_prefill_topk.npz"


def _write(tmp_path, mode):
    out = tmp_path / f"{mode}.pt"
    run = subprocess.run([sys.executable, str(SCRIPT), "--mode", mode, "--out", str(out)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"wrote SGLang {mode} dump {out}: 3 steps x 48 layers x 128 experts")
    return out


def test_stat_dump_reads_back_the_bundled_counts_and_plans(tmp_path, capsys):
    dump = _write(tmp_path, "stat")
    bundled, trace = load_trace(BUNDLED), load_trace(dump)
    assert trace.meta.source == "sglang-stat:stat.pt" and trace.meta.layer_ids == tuple(range(48))
    np.testing.assert_array_equal(trace.step_counts(), bundled.step_counts())
    out = tmp_path / "p.json"
    assert main(["plan", str(dump), "--gpus", "8", "--redundant", "8", "--out", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert (plan["num_gpus"], plan["num_logical_experts"], plan["num_physical_experts"]) == (8, 128, 136)


def test_per_token_dump_reads_back_the_bundled_ids(tmp_path):
    bundled, trace = load_trace(BUNDLED), load_trace(_write(tmp_path, "per_token"))
    assert trace.is_token_level and trace.step_names == ("pass0", "pass1", "pass2")
    for mine, theirs in zip(trace.topk_ids, bundled.topk_ids):
        np.testing.assert_array_equal(mine, theirs)
