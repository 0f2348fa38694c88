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
- the harness sizes (`bench/inengine/harness.py` SIZES) on skewed window sums.
Equal loads (the tie cases, and some harness cases: rounded window sums, per-replica loads that
coincide) are ordered by the engines' unstable sorts, and that order is not the same on every CPU:
- vLLM sorts with numpy's default `argsort` (`policy/default.py` `balanced_packing`, the only sort
  whose order decides the map), and numpy dispatches it by CPU features: AVX-512 (x86-64-v4), AVX2
  (x86-64-v3) and the baseline each order equal keys their own way. So the file stores, per case, every
  `argsort` vLLM's `balanced_packing` ran (`{case}/sort{k}/keys_sha256`, a digest of what it sorted, and
  `{case}/sort{k}/order`, what it returned, where a row held equal keys), and the vLLM script runs once
  per feature set (`VARIANTS`, in child processes with `NPY_DISABLE_CPU_FEATURES`); a case whose map
  differs between feature sets is stored again per set (`{case}@x86-64-v3/...`, inputs those of `{case}`). The
  tests replay the recorded orders, so the comparison holds on any CPU (tests/test_engines_inengine.py).
- SGLang sorts with torch's `sort`, whose CPU order does not depend on the CPU features: the SGLang
  script checks that, running under each `ATEN_CPU_CAPABILITY` and requiring identical outputs, and
  stores `meta/torch_sort_probe` (torch's order of a fixed tied array) for the tests to compare.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).parent
OUT = {"vllm": HERE / "vllm_default_expected.npz", "sglang": HERE / "sglang_deepseek_expected.npz"}
PROBE = (np.arange(96) * 7 % 5).astype(np.float32)  # 96 values, 5 distinct: ties everywhere
HARNESS_SIZES = [(64, 8, 8, 1, 4, 1), (256, 16, 16, 2, 4, 1), (256, 32, 32, 4, 4, 1), (256, 32, 32, 4, 4, 8)]
# numpy's sort dispatch targets on x86-64, and the features to disable to reach each (the names of
# numpy 2.4 and of earlier releases: each ignores the other's). "native": this machine's own.
_V4 = "X86_V4 AVX512F AVX512CD AVX512_KNL AVX512_KNM AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL AVX512_SPR"
VARIANTS = {"native": None, "x86-64-v3": _V4, "x86-64-v2": _V4 + " X86_V3 AVX AVX2 FMA3 F16C"}
TORCH_CAPABILITIES = ("default", "avx2", "avx512")
WIDE_PROBE = (np.arange(1024) * 7 % 5).astype(np.float32)  # long enough for numpy's SIMD sorts


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


class SortRecorder:
    """numpy's `argsort` while vLLM's policy runs, keeping the calls made by `balanced_packing`."""

    def __init__(self):
        self.calls: list[tuple[np.ndarray, np.ndarray]] = []
        self._argsort = np.argsort

    def __enter__(self):
        def recording(values, *args, **kwargs):
            order = self._argsort(values, *args, **kwargs)
            if sys._getframe(1).f_code.co_name == "balanced_packing":
                self.calls.append((np.array(values), np.array(order)))
            return order

        np.argsort = recording
        return self

    def __exit__(self, *exc):
        np.argsort = self._argsort


def run_vllm(weight, args, old):
    from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

    replicas, groups, nodes, gpus = args
    with SortRecorder() as fresh_sorts:
        fresh = DefaultEplbPolicy.rebalance_experts(torch.from_numpy(weight), replicas, groups, nodes, gpus)
    with SortRecorder() as kept_sorts:
        kept = DefaultEplbPolicy.rebalance_experts(torch.from_numpy(weight), replicas, groups, nodes, gpus,
                                                   torch.from_numpy(old))
    same = len(fresh_sorts.calls) == len(kept_sorts.calls) and all(
        np.array_equal(a, c) and np.array_equal(b, d) for (a, b), (c, d) in zip(fresh_sorts.calls, kept_sorts.calls))
    assert same, "the map in use changed vLLM's sorts"   # it only reorders slots afterwards
    out = {"phy2log": fresh.numpy(), "phy2log_with_old": kept.numpy()}
    for k, (keys, order) in enumerate(fresh_sorts.calls):
        out[f"sort{k}/keys_sha256"] = np.array(keys_digest(keys))
        if has_ties(keys):   # without equal keys in a row the descending order is the same on every CPU
            out[f"sort{k}/order"] = order.astype(np.int16)   # item indices, fewer than 2**15
    return out


def has_ties(keys: np.ndarray) -> bool:
    """True when some row of `keys` holds two equal values (an unstable sort may then order them either way)."""
    ordered = np.sort(keys, axis=-1)
    return bool((ordered[..., 1:] == ordered[..., :-1]).any())


def keys_digest(keys: np.ndarray) -> str:
    """What was sorted, as a digest: its dtype, shape and bytes (tests/test_engines_inengine.py computes the same)."""
    keys = np.ascontiguousarray(keys)
    return hashlib.sha256(f"{keys.dtype.str}{keys.shape}".encode() + keys.tobytes()).hexdigest()


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


def run_cases(engine: str, seed: int) -> tuple[list[str], dict[str, np.ndarray]]:
    run = run_vllm if engine == "vllm" else run_sglang
    arrays: dict[str, np.ndarray] = {}
    names = []
    for name, weight, sizes, old in cases(np.random.default_rng(seed)):
        arrays[f"{name}/weight"] = weight
        arrays[f"{name}/args"] = np.array(sizes, dtype=np.int64)
        arrays[f"{name}/old"] = old
        for key, value in run(weight, sizes, old).items():
            arrays[f"{name}/{key}"] = value
        names.append(name)
    arrays["meta/wide_argsort_probe"] = np.argsort(-WIDE_PROBE)
    return names, arrays


def in_child(engine: str, seed: int, environ: dict) -> dict[str, np.ndarray]:
    """`run_cases` in a child process with `environ` added (CPU features are read at numpy's import)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "variant.npz"
        subprocess.run([sys.executable, __file__, "--engine", engine, "--seed", str(seed), "--variant-out", str(out)],
                       env={**os.environ, **environ}, check=True)
        with np.load(out) as data:
            return {key: data[key] for key in data.files}


def _outputs(arrays: dict, case: str) -> list[str]:
    return sorted(k for k in arrays if k.startswith(case + "/") and k.split("/", 1)[1] not in ("weight", "args", "old"))


def merge_variants(names: list[str], variants: dict[str, dict]) -> tuple[list[str], dict[str, np.ndarray]]:
    """The first variant's cases, plus `{case}@{variant}` for each other variant whose maps differ."""
    first, *others = variants
    arrays = {k: v for k, v in variants[first].items() if not k.startswith("meta/")}
    listed = list(names)
    for variant in others:
        got = variants[variant]
        for case in names:
            keys = _outputs(got, case)
            maps = [k for k in keys if "/sort" not in k]   # equal keys may sort otherwise and give the same map
            if maps == [k for k in _outputs(arrays, case) if "/sort" not in k] and all(
                    np.array_equal(got[k], arrays[k]) for k in maps):
                continue
            listed.append(f"{case}@{variant}")   # its inputs are the case's own
            for key in keys:
                arrays[f"{case}@{variant}/{key.split('/', 1)[1]}"] = got[key]
    return listed, arrays


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=sorted(OUT), required=True)
    parser.add_argument("--seed", type=int, default=21)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--variant-out", type=Path, help=argparse.SUPPRESS)  # a child: one feature set
    args = parser.parse_args()
    if args.variant_out:
        names, arrays = run_cases(args.engine, args.seed)
        np.savez_compressed(args.variant_out, **arrays, **{"meta/cases": np.array(names)})
        return 0
    if args.engine == "vllm":
        runs = {name: in_child("vllm", args.seed, {} if off is None else {"NPY_DISABLE_CPU_FEATURES": off})
                for name, off in VARIANTS.items()}
        probes = {name: run["meta/wide_argsort_probe"].tobytes() for name, run in runs.items()}
        if len(set(probes.values())) < len(probes):
            print("warning: some feature sets order ties alike on this machine (its CPU lacks a feature set, or "
                  f"numpy {np.__version__} dispatches otherwise): {sorted(probes)}", file=sys.stderr)
    else:
        runs = {cap: in_child("sglang", args.seed, {"ATEN_CPU_CAPABILITY": cap}) for cap in TORCH_CAPABILITIES}
        first = runs[TORCH_CAPABILITIES[0]]
        for cap, run in runs.items():
            differ = [k for k in first if k.startswith(("ties", "random", "harness")) and
                      not np.array_equal(first[k], run[k])]
            if differ:
                raise SystemExit(f"torch's sort orders ties otherwise under ATEN_CPU_CAPABILITY={cap}: {differ[:3]}")
        runs = {"native": first}
    names = [str(c) for c in next(iter(runs.values()))["meta/cases"]]
    listed, arrays = merge_variants(names, runs)
    meta = engine_meta(args.engine)
    arrays["meta/cases"] = np.array(listed)
    arrays["meta/variants"] = np.array(list(runs))
    arrays["meta/engine"] = np.array(args.engine)
    arrays["meta/engine_version"] = np.array(meta["version"])
    arrays["meta/source_sha256"] = np.array(hashlib.sha256(Path(meta["source"]).read_bytes()).hexdigest())
    arrays["meta/torch"] = np.array(torch.__version__)
    arrays["meta/numpy"] = np.array(np.__version__)
    arrays["meta/torch_sort_probe"] = torch_sort_probe()
    out = args.out or OUT[args.engine]
    np.savez_compressed(out, **arrays)
    print(f"wrote {out}: {len(names)} cases ({len(listed) - len(names)} more orders of equal loads from "
          f"{', '.join(list(runs)[1:]) or 'no other feature set'}) from {args.engine} {meta['version']} "
          f"(torch {torch.__version__}, numpy {np.__version__})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
