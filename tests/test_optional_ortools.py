"""The online path works without OR-Tools; what needs it says so in one line.

OR-Tools is the `solver` extra (pyproject.toml): `pip install moe-place` beside vLLM 0.33 or SGLang
0.5.23 must not pull it, since every OR-Tools release pins a protobuf older than the engines'.
Each check runs in a fresh interpreter where `import ortools` fails, as it does there.
"""

import subprocess
import sys
import textwrap

import pytest

BLOCK = "import sys; sys.modules['ortools'] = None  # as if OR-Tools were not installed\n"


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300)


def test_the_engine_path_runs_without_ortools():
    pytest.importorskip("torch")
    done = _run("""
        import numpy as np, torch
        from moe_place.cost.cluster import cluster_cost
        from moe_place.engines import vllm, sglang
        from moe_place.engines.config import EngineConfig
        from moe_place.eplb import rebalance_experts
        from moe_place.online.controller import EngineCadence, initial_map, make_controller
        from moe_place.online.policy import RebalanceRule
        from moe_place.online.replay import parse_synthetic, replay
        w = torch.rand(4, 32) * 1000
        phy2log, log2phy, logcnt = rebalance_experts(w, 40, 4, 2, 8)      # the drop-in, hierarchical
        vllm.POLICY_MODULES = ("no_such_vllm",)
        policy = vllm.make_policy(returns="phy2log", config=EngineConfig())
        start = torch.from_numpy(np.tile(np.arange(40) % 32, (4, 1)))
        assert policy.rebalance_experts(w, 40, 1, 1, 8, start).shape == (4, 40)
        hook = sglang.PaybackRebalance(EngineConfig(), current_map=lambda: start)
        assert hook(torch.rand(16, 4, 32) * 100, 40, 5, None, 1)[0].shape == (4, 40)
        counts, _ = parse_synthetic("drift:steps=300,layers=2,experts=16,tokens=512,seed=0")
        cost = cluster_cost(4, 1, "H100", "Qwen3-30B-A3B", migration="async")
        ours = make_controller("ours", EngineCadence.of("sglang", 100), 2, 16, rule=RebalanceRule(cost, 2, 16))
        replay(counts, ours, cost, initial_map(2, 16, 20, 4))
        print("ok", "ortools" in sys.modules and sys.modules["ortools"] is not None)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ok", "False"]


def test_what_needs_ortools_says_what_to_install(tmp_path):
    done = _run(f"""
        import sys
        from moe_place.cli.main import main
        sys.argv = ["moe-place", "replay", "--synthetic", "drift:steps=2,layers=1,experts=8,tokens=64",
                    "--controller", "static", "--no-progress"]
        assert main(sys.argv[1:]) == 0
        import numpy as np
        np.savez("{tmp_path}/t.npz", format_version=1, num_experts=8, top_k=1,
                 counts=np.array([[[600, 560, 120, 120, 20, 10, 10, 10]]]))
        sys.exit(main(["plan", "{tmp_path}/t.npz", "--gpus", "4", "--redundant", "4",
                       "--solver", "cpsat", "--out", "{tmp_path}/p.json"]))
    """)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "OR-Tools" in lines[0] and "moe-place[solver]" in lines[0]
