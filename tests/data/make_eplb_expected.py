"""Make `eplb_expected.npz`: DeepSeek EPLB's own outputs on fixed inputs, for the drop-in tests.

The tests compare `moe_place.eplb.rebalance_experts(..., solver="eplb")` with these outputs and
fetch nothing. This script runs the original `eplb.py` from a checkout that you name; it holds
none of its code:

    git clone https://github.com/deepseek-ai/EPLB /tmp/EPLB && git -C /tmp/EPLB checkout COMMIT
    python tests/data/make_eplb_expected.py --eplb /tmp/EPLB/eplb.py

The commit recorded is the checkout's `HEAD`, read with git, and the file must be that commit's
`eplb.py` unchanged (so the commit and the sha256 stored beside the outputs name the same file;
tests/test_engines_eplb_exact.py checks the pair against the commits of EPLB it knows). The
committed file comes from main's d52c72d5b2f2fb4c41afbf8eb21366820239913d (2025-03-24, "Fix
missing device for pphy2mlog tensor").

Cases (seeded, so a rerun with the same `eplb.py` and torch writes the same file):
- DeepSeek's README example (2 layers x 12 experts, 16 replicas, 4 groups, 2 nodes, 8 GPUs);
- forced co-location (`ones(1, 8)`, 10 replicas on 1 GPU);
- random float32 loads, 1-4 layers, 8-256 experts, hierarchical and global policies. They are
  tie-free where a tie could be broken differently by a different summation order: the group
  sums of step 1 are at least `MIN_GAP` apart relatively (replicas of one expert still tie in
  step 3, and the original's torch sort orders them; the drop-in sorts with torch too);
- integer loads with ties (small counts), where the order of equal loads is torch's sort's.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

MIN_GAP = 1e-5
OUT = Path(__file__).with_name("eplb_expected.npz")
README = ([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
           [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]], 16, 4, 2, 8)


def load_original(path: Path):
    spec = importlib.util.spec_from_file_location("deepseek_eplb_original", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tie_free(weight: np.ndarray, groups: int, hierarchical: bool) -> bool:
    """No two group sums (step 1) closer than MIN_GAP relatively, when groups are packed."""
    if not hierarchical or groups < 2:
        return True
    sums = np.sort(weight.astype(np.float64).reshape(weight.shape[0], groups, -1).sum(-1), axis=1)
    return bool((np.diff(sums, axis=1) > MIN_GAP * sums[:, 1:]).all())


def cases(rng: np.random.Generator):
    yield "readme", np.asarray(README[0], dtype=np.int64), README[1:]
    yield "colocated", np.ones((1, 8), dtype=np.float32), (10, 1, 1, 1)
    made = 0
    while made < 32:
        layers = int(rng.integers(1, 5))
        experts = int(rng.choice([8, 12, 16, 32, 64, 96, 128, 160, 256]))
        gpus = int(rng.choice([g for g in (1, 2, 4, 8, 16, 32) if experts % g == 0 or g <= experts]))
        nodes = int(rng.choice([n for n in (1, 2, 4) if gpus % n == 0]))
        groups = int(rng.choice([g for g in (1, 2, 4, 8) if experts % g == 0]))
        hierarchical = made % 2 == 0                   # alternate the policies
        if not hierarchical:
            groups = nodes + 1 if nodes > 1 else 3     # groups % nodes != 0: the global policy
            if nodes == 1:
                nodes, groups = 2, 3
        elif groups % nodes:
            groups = nodes
        slots_per_gpu = -(-experts // gpus) + int(rng.integers(0, 3))
        replicas = gpus * slots_per_gpu
        if hierarchical and experts % groups:
            continue
        weight = (rng.random((layers, experts)) * rng.choice([1.0, 100.0, 1e4])).astype(np.float32)
        if not tie_free(weight, groups, hierarchical):
            continue
        yield f"random{made}", weight, (replicas, groups, nodes, gpus)
        made += 1
    for k in range(6):
        experts, gpus = (16, 4) if k % 2 else (64, 8)
        weight = rng.integers(0, 4, size=(2, experts))    # many ties
        yield f"ties{k}", weight.astype(np.int64), (experts + gpus * (1 + k % 2), 1, 1, gpus)


def fail(message: str) -> None:
    """One line on stderr, exit 2 (bad input)."""
    print(f"make_eplb_expected: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def checkout_commit(path: Path) -> str:
    """The commit of the git checkout holding `path`, which must be that commit's file unchanged."""
    def git(*argv: str) -> str:
        done = subprocess.run(["git", "-C", str(path.resolve().parent), *argv], capture_output=True, text=True)
        if done.returncode:
            fail(f"--eplb {path}: expected a file in a git checkout of deepseek-ai/EPLB, got git {' '.join(argv)}: "
                 f"{done.stderr.strip()}")
        return done.stdout.strip()

    commit = git("rev-parse", "HEAD")
    if git("hash-object", path.name) != git("rev-parse", f"HEAD:{path.name}"):
        fail(f"--eplb {path}: expected {path.name} as commit {commit} has it, got a changed file")
    return commit


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eplb", type=Path, required=True, help="path of DeepSeek's eplb.py")
    parser.add_argument("--commit", help="the EPLB commit the file must come from (default: its checkout's HEAD)")
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    commit = checkout_commit(args.eplb)
    if args.commit is not None and args.commit != commit:
        fail(f"--commit: expected the checkout's HEAD {commit}, got {args.commit}")
    original = load_original(args.eplb)
    arrays: dict[str, np.ndarray] = {}
    names = []
    for name, weight, (replicas, groups, nodes, gpus) in cases(np.random.default_rng(args.seed)):
        phy2log, log2phy, logcnt = original.rebalance_experts(torch.from_numpy(weight), replicas, groups, nodes, gpus)
        arrays[f"{name}/weight"] = weight
        arrays[f"{name}/args"] = np.array([replicas, groups, nodes, gpus], dtype=np.int64)
        arrays[f"{name}/phy2log"] = phy2log.numpy()
        arrays[f"{name}/log2phy"] = log2phy.numpy()
        arrays[f"{name}/logcnt"] = logcnt.numpy()
        names.append(name)
    arrays["meta/cases"] = np.array(names)
    arrays["meta/eplb_commit"] = np.array(commit)
    arrays["meta/eplb_sha256"] = np.array(hashlib.sha256(args.eplb.read_bytes()).hexdigest())
    arrays["meta/torch"] = np.array(torch.__version__)
    np.savez_compressed(args.out, **arrays)
    print(f"wrote {args.out}: {len(names)} cases from eplb.py {commit} on torch {torch.__version__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
