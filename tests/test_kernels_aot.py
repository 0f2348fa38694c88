"""The kernels compile for Hopper (sm_90) on a CPU-only machine: Triton's full pipeline and bundled ptxas.

The interpreter checks results; this checks what only a GPU build shows: tensor-core instruction
selection (wgmma for BLOCK_M >= 64, mma.sync below), the cp.async software pipeline, shared memory
under the 227 KiB limit, no register spills.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # compiling the kernels for sm_90 takes 15-20 s on 2 cores

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_compile_for_hopper():
    triton = pytest.importorskip("triton")
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this triton wheel has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-m", "moe_place.kernels.aot", "--arch", "90", "--quick", "--format", "json"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout)
    gemms = [r for r in results if r["kernel"] == "grouped_gemm"]
    assert {r["config"]["dtype"] for r in gemms} == {"bf16", "fp8e4nv"}
    for r in gemms:
        assert r["shared_bytes"] <= 227 * 1024
        assert r["cp_async"] > 0, r  # loads are software-pipelined
        assert r["spill_bytes"] in (0, -1), r  # default_num_warps keeps the accumulators in registers
        if r["config"]["BLOCK_M"] >= 64:
            assert r["wgmma"] > 0, r  # Hopper warp-group MMA
        else:
            assert r["mma_sync"] > 0, r
    assert {r["kernel"] for r in results} == {"grouped_gemm", "gather_rows", "combine", "split_solve", "split_count",
                                              "split_scan", "split_map"}
    for r in results:
        if r["kernel"].startswith("split_"):   # the per-batch split keeps its state in registers: no spills
            assert r["spill_bytes"] in (0, -1) and r["shared_bytes"] <= 227 * 1024, r
