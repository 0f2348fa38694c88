"""Make `vllm_default_expected.npz` / `sglang_deepseek_expected.npz`: the engines' own default policies on
fixed inputs, for the stand-in tests (`tests/test_engines_inengine.py`), which need neither engine.

Run it once in an environment with the engine installed (it holds none of the engines' code; it calls them):

    PYTHONPATH=. /path/to/vllm-venv/bin/python tests/data/make_engine_default_expected.py --engine vllm
    PYTHONPATH=. /path/to/sglang-venv/bin/python tests/data/make_engine_default_expected.py --engine sglang

(`PYTHONPATH` must make `moe_place` importable as installed, e.g. a directory with the package-dir mapping of
pyproject.toml.) vLLM: `vllm.distributed.eplb.policy.default.DefaultEplbPolicy.rebalance_experts(weight,
num_replicas, num_groups, num_nodes, num_ranks, old_global_expert_indices)` -> `phy2log`, with and without the
map in use. SGLang: `sglang.srt.eplb.eplb_algorithms.deepseek.rebalance_experts(weight, num_replicas,
num_groups, num_nodes, num_gpus, enable_hierarchical)` -> `(phy2log, log2phy, logcnt)`.

Cases (seeded; a rerun with the same engine, numpy and torch writes the same file):
- random float32 loads (window sums up to 1e8), 1-4 layers, 16-256 experts, 4-32 GPUs, 1-4 nodes,
  hierarchical and global;
- tied integer loads (0-3 per expert: most experts tie), the same shapes;
- the harness sizes (`bench/engine_harness.py` SIZES) on skewed window sums.
vLLM orders equal loads by numpy's default `argsort` and SGLang by torch's sort, so the tie cases hold
where those sorts order ties as on the machine that made the file: `meta/argsort_probe` stores numpy's
default argsort of a fixed tied array, and `meta/torch_sort_probe` torch's, for the tests to compare.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).parent
OUT = {"vllm": HERE / "vllm_default_expected.npz", "sglang": HERE / "sglang_deepseek_expected.npz"}
PROBE = (np.arange(96) * 7 % 5).astype(np.float32)  # 96 values, 5 distinct: ties everywhere
HARNESS_SIZES = [(64, 8, 8, 1, 4, 1), (256, 16, 16, 2, 4, 1), (256, 32, 32, 4, 4, 1), (256, 32, 32, 4, 4, 8)]


def argsort_probe() -> np.ndarray:
    return np.argsort(-PROBE)


def torch_sort_probe() -> np.ndarray:
    return torch.from_numpy(PROBE).sort(descending=True).indices.numpy()


def cases(rng: np.random.Generator):
    """(name, weight [layers, E], (num_replicas, num_groups, num_nodes, num_gpus), old map or None)."""
    made = 0
    while made < 120:
        experts = int(rng.choice([16, 32, 64, 128, 256]))
        gpus = int(rng.choice([4, 8, 16, 32]))
        replicas = gpus * (-(-experts // gpus) + int(rng.integers(0, 3)))
        nodes = int(rng.choice([n for n in (1, 2, 4) if gpus % n == 0]))
        hierarchical = made % 2 == 0
        groups = int(rng.choice([g for g in (2, 4, 8) if experts % g == 0 and g % nodes == 0] or [nodes]))
        if not hierarchical:
            groups = 1  # global: 1 % nodes != 0, or one group on one node (the same plan)
        layers = int(rng.integers(1, 5))
        tied = made % 4 >= 2
        weight = (rng.integers(0, 4, size=(layers, experts)) if tied else
                  rng.random((layers, experts)) * rng.choice([1e3, 1e6, 1e8])).astype(np.float32)
        old = np.stack([rng.permutation(np.arange(replicas) % experts) for _ in range(layers)])
        yield f"{'ties' if tied else 'random'}{made}", weight, (replicas, groups, nodes, gpus), old
        made += 1
    for experts, redundant, gpus, nodes, layers, groups in HARNESS_SIZES:
        popularity = rng.dirichlet(np.full(experts, 0.3), size=layers)
        weight = np.round(popularity * 1000 * 2048 * 8).astype(np.float32)
        replicas = experts + redundant
        linear = np.tile(np.r_[np.arange(experts), np.arange(redundant) % experts], (layers, 1))
        yield f"harness-e{experts}-g{gpus}-n{nodes}-groups{groups}", weight, (replicas, groups, nodes, gpus), linear


def run_vllm(weight, args, old):
    from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

    replicas, groups, nodes, gpus = args
    fresh = DefaultEplbPolicy.rebalance_experts(torch.from_numpy(weight), replicas, groups, nodes, gpus)
    kept = DefaultEplbPolicy.rebalance_experts(torch.from_numpy(weight), replicas, groups, nodes, gpus,
                                               torch.from_numpy(old))
    return {"phy2log": fresh.numpy(), "phy2log_with_old": kept.numpy()}


def run_sglang(weight, args, old):
    from sglang.srt.eplb.eplb_algorithms.deepseek import rebalance_experts

    replicas, groups, nodes, gpus = args
    hierarchical = groups % nodes == 0
    phy2log, log2phy, logcnt = rebalance_experts(torch.from_numpy(weight), replicas, groups, nodes, gpus, hierarchical)
    return {"phy2log": phy2log.numpy(), "log2phy": log2phy.numpy(), "logcnt": logcnt.numpy()}


def engine_meta(engine: str) -> dict:
    if engine == "vllm":
        import vllm
        from vllm.distributed.eplb.policy import default as source

        return {"version": vllm.__version__, "source": inspect.getsourcefile(source)}
    import sglang
    from sglang.srt.eplb.eplb_algorithms import deepseek as source

    return {"version": sglang.__version__, "source": inspect.getsourcefile(source)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=sorted(OUT), required=True)
    parser.add_argument("--seed", type=int, default=21)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    run = run_vllm if args.engine == "vllm" else run_sglang
    arrays: dict[str, np.ndarray] = {}
    names = []
    for name, weight, sizes, old in cases(np.random.default_rng(args.seed)):
        arrays[f"{name}/weight"] = weight
        arrays[f"{name}/args"] = np.array(sizes, dtype=np.int64)
        arrays[f"{name}/old"] = old
        for key, value in run(weight, sizes, old).items():
            arrays[f"{name}/{key}"] = value
        names.append(name)
    meta = engine_meta(args.engine)
    arrays["meta/cases"] = np.array(names)
    arrays["meta/engine"] = np.array(args.engine)
    arrays["meta/engine_version"] = np.array(meta["version"])
    arrays["meta/source_sha256"] = np.array(hashlib.sha256(Path(meta["source"]).read_bytes()).hexdigest())
    arrays["meta/torch"] = np.array(torch.__version__)
    arrays["meta/numpy"] = np.array(np.__version__)
    arrays["meta/argsort_probe"] = argsort_probe()
    arrays["meta/torch_sort_probe"] = torch_sort_probe()
    out = args.out or OUT[args.engine]
    np.savez_compressed(out, **arrays)
    print(f"wrote {out}: {len(names)} cases from {args.engine} {meta['version']} (torch {torch.__version__}, "
          f"numpy {np.__version__})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
