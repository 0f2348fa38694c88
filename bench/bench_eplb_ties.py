"""The ties claim of docs/results/engines.md, re-measured: the planner's EPLB against vLLM 0.33's real `DefaultEplbPolicy` on tied loads.

Seeded cases of integer loads 0-3 per expert (most experts tie), 16-256 experts on 4-32 GPUs over 1-4 nodes,
hierarchical (groups a multiple of the nodes) and global, each called without and with the map in use
(`old_global_expert_indices`, a random valid map). Compared with vLLM's `phy2log`, exactly and as the same
set of experts on every GPU (order inside a GPU aside):
- `stable`: `moe_place.solvers.deepseek.eplb_rebalance` (ties to the lowest index), then
  `moe_place.placement.keep_unchanged_slots` when a map is given (what vLLM's `preserve_intragpu_slots` does);
- `numpy-order`: the same EPLB steps with numpy's default argsort as the order (`eplb_maps(...,
  descending_order=...)`), float32 arithmetic;
- `standin`: `bench/inengine/standins.py` `vllm_default_policy` (numpy's default argsort, float64 pack loads
  and replica ratios, as vLLM computes).
Needs vLLM (run it in vLLM's environment with moe-place on the path):

    PYTHONPATH=OVERLAY /path/to/vllm-venv/bin/python bench/bench_eplb_ties.py --cases 200 [--out ties.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

from moe_place.placement import keep_unchanged_slots
from moe_place.solvers.deepseek import eplb_maps, eplb_rebalance, plans_hierarchically

sys.path.insert(0, str(Path(__file__).resolve().parent))
from inengine import standins  # noqa: E402 - bench/inengine, the in-engine kit
from records import add_record_options, refuse_overwrite, write_record  # noqa: E402  (bench/ is not a package)

VARIANTS = ("stable", "numpy-order", "standin")


def tied_cases(count: int, seed: int):
    """(weight int [layers, E], num_replicas, num_groups, num_nodes, num_gpus, old map [layers, P])."""
    rng = np.random.default_rng(seed)
    for made in range(count):
        experts = int(rng.choice([16, 32, 64, 128, 256]))
        gpus = int(rng.choice([4, 8, 16, 32]))
        replicas = gpus * (-(-experts // gpus) + int(rng.integers(0, 3)))
        nodes = int(rng.choice([n for n in (1, 2, 4) if gpus % n == 0]))
        groups = 1
        if made % 2 == 0:  # hierarchical
            groups = int(rng.choice([g for g in (2, 4, 8) if experts % g == 0 and g % nodes == 0] or [nodes]))
        layers = int(rng.integers(1, 5))
        weight = rng.integers(0, 4, size=(layers, experts))
        old = np.stack([rng.permutation(np.arange(replicas) % experts) for _ in range(layers)])
        yield weight, replicas, groups, nodes, gpus, old


def variant_map(name: str, weight: np.ndarray, replicas: int, groups: int, nodes: int, gpus: int,
                old: np.ndarray | None) -> np.ndarray:
    if name == "standin":
        return standins.vllm_default_policy(torch.from_numpy(weight), replicas, groups, nodes, gpus,
                                            None if old is None else torch.from_numpy(old)).numpy()
    hierarchical = plans_hierarchically(groups, nodes)
    g, n = (groups, nodes) if hierarchical else (1, 1)
    if name == "stable":
        phy2log = eplb_rebalance(weight, replicas, g, n, gpus)
    else:
        phy2log = eplb_maps(weight, replicas, g, n, gpus, descending_order=lambda v: np.argsort(-v, axis=-1))[0]
    return phy2log if old is None else keep_unchanged_slots(phy2log, old, replicas // gpus)


def same_gpu_sets(a: np.ndarray, b: np.ndarray, slots_per_gpu: int) -> bool:
    return bool((np.sort(a.reshape(-1, slots_per_gpu), axis=1) == np.sort(b.reshape(-1, slots_per_gpu), axis=1)).all())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--seed", type=int, default=167)
    add_record_options(parser, committed=("bench/results/eplb_ties.json",))
    args = parser.parse_args(argv)
    refuse_overwrite(parser, args)
    try:
        import vllm
        from vllm.distributed.eplb.policy.default import DefaultEplbPolicy
    except ImportError:
        print("bench_eplb_ties: vllm: not importable in this Python (run it in vLLM's environment)", file=sys.stderr)
        return 2
    tally = {(v, with_old): [0, 0] for v in VARIANTS for with_old in (False, True)}
    cases = 0
    for weight, replicas, groups, nodes, gpus, old in tied_cases(args.cases, args.seed):
        cases += 1
        for with_old in (False, True):
            given = old if with_old else None
            ref = DefaultEplbPolicy.rebalance_experts(torch.from_numpy(weight), replicas, groups, nodes, gpus,
                                                      None if given is None else torch.from_numpy(given)).numpy()
            for name in VARIANTS:
                ours = variant_map(name, weight, replicas, groups, nodes, gpus, given)
                tally[(name, with_old)][0] += bool(np.array_equal(ours, ref))
                tally[(name, with_old)][1] += same_gpu_sets(ours, ref, replicas // gpus)
    print(f"{cases} tied cases against vLLM {vllm.__version__} DefaultEplbPolicy (numpy {np.__version__}, "
          f"torch {torch.__version__})")
    print(f"{'variant':<14}{'map in use':<12}{'exact':>8}{'same GPU sets':>15}")
    for (name, with_old), (exact, sets) in tally.items():
        print(f"{name:<14}{'given' if with_old else 'none':<12}{exact:>8}{sets:>15}")
    if args.output_json:
        write_record(args.output_json, {"cases": cases, "seed": args.seed, "vllm": vllm.__version__,
                                     "numpy": np.__version__, "torch": torch.__version__,
                                     "results": [{"variant": n, "map_in_use": w, "exact": e, "same_gpu_sets": s}
                                                 for (n, w), (e, s) in tally.items()]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
