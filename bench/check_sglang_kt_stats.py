"""Check an `moe-place offload --stats-out` file against kt-kernel's own selection (the installed package).

sglang-kt's `frequency` strategy loads the stats file with `torch.load`, sums `logical_count` over
dim 0 as float32 and calls kt-kernel's `generate_gpu_experts_masks(activation_freq, total)`; this
script does the same with the installed kt-kernel and compares the mask with the plan's resident
experts (`--out` file), then does it for 50 random planned sets (ties, counts above 2^24, dense
rows) through `moe_place.engines.sglang_kt.planned_stats`. Run it in a venv that has kt-kernel
(it needs torch; kt-kernel 0.7.2 pins torch 2.9.1, and imports with 2.13 too):

    python -m venv /tmp/kt && . /tmp/kt/bin/activate && pip install torch==2.13.0 numpy safetensors gguf pyyaml \\
        typer rich httpx packaging && pip install --no-deps kt-kernel==0.7.2
    python bench/check_sglang_kt_stats.py stats.pt offload.json      # exit 0 when every selection matches
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's moe_place, without installing it
from moe_place.engines.sglang_kt import gpu_experts_ratio, planned_stats  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import missed_targets  # noqa: E402  (bench/ is not a package)


def total_from_flags(flags: list[str], num_layers: int, num_experts: int) -> int:
    """The GPU expert count sglang-kt derives from the flags (all trace layers are MoE layers)."""
    if "--kt-num-gpu-experts" in flags:
        return int(flags[flags.index("--kt-num-gpu-experts") + 1]) * num_layers
    return int(num_layers * num_experts * float(flags[flags.index("--kt-gpu-experts-ratio") + 1]))


def main(stats_path: str, plan_path: str) -> int:
    try:  # lazy: optional packages, so that --help runs without them
        import torch
        from kt_kernel import __version__ as kt_version
        from kt_kernel import generate_gpu_experts_masks
    except ImportError as exc:
        print(f"check_sglang_kt_stats.py: error: needs {exc.name} installed (the venv in this script's docstring)",
              file=sys.stderr)
        return 2

    plan = json.loads(Path(plan_path).read_text())
    counts = torch.load(stats_path, map_location="cpu", weights_only=True)["logical_count"]
    freq = counts.sum(dim=0).float()
    layer_ids = [int(layer) for layer in plan["resident_experts"]]
    total = total_from_flags(plan["sglang_kt"]["flags"], len(layer_ids), freq.shape[1])
    mask = generate_gpu_experts_masks(freq, total)
    want = torch.zeros_like(mask)
    for layer, experts in plan["resident_experts"].items():
        want[int(layer), experts] = True
    planned_ok = bool(torch.equal(mask, want))
    print(f"kt-kernel {kt_version}, torch {torch.__version__}; stats {tuple(counts.shape)} {counts.dtype}; "
          f"{total} GPU experts from the flags, {int(want.sum())} planned; same set: {planned_ok}")
    rng = np.random.default_rng(0)
    matches = 0
    for case in range(50):
        layers, experts = int(rng.integers(1, 60)), int(rng.integers(2, 257))
        k = int(rng.integers(1, layers * experts + 1))
        resident = np.zeros(layers * experts, bool)
        resident[rng.permutation(layers * experts)[:k]] = True
        resident = resident.reshape(layers, experts)
        trace_counts = rng.integers(0, [10, 1000, 10**12][case % 3], (layers, experts))
        dense = int(rng.integers(0, 3))
        stats = planned_stats(resident, trace_counts, tuple(range(dense, dense + layers)))
        chosen = int(layers * experts * float(gpu_experts_ratio(k, layers, experts)))
        got = generate_gpu_experts_masks(torch.from_numpy(stats).sum(dim=0).float(), chosen)[dense:].numpy()
        matches += bool((got == resident).all()) and chosen == k
    print(f"random planned sets that kt-kernel selects exactly: {matches}/50")
    missed = ([] if planned_ok else [f"kt-kernel's GPU experts from the flags are not the plan's {int(want.sum())}"]) + \
        ([] if matches == 50 else [f"kt-kernel selects {matches}/50 random planned sets exactly, not 50/50"])
    return missed_targets("check_sglang_kt_stats", missed)


USAGE = "usage: python bench/check_sglang_kt_stats.py STATS.pt OFFLOAD.json"

if __name__ == "__main__":
    if sys.argv[1:] in (["-h"], ["--help"]):
        print(USAGE + "\n\n" + __doc__)
        sys.exit(0)
    if len(sys.argv) != 3:
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
