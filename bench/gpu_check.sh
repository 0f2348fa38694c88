#!/usr/bin/env bash
# The GPU validation run of moe-place, in one script: under 5 minutes on one H100/H200.
#
#   bash bench/gpu_check.sh              # on a GPU machine, from the repository root
#   bash bench/gpu_check.sh --dry-run    # on a CPU: Triton interpreter, tiny sizes (about a minute)
#
# Steps: (1) make `moe_place` importable (offline `pip install -e .` if needed), (2) record the
# machine, (3) the grouped-GEMM and split kernel tests compiled for the GPU (skipped in a dry run), (4) the
# microbenchmarks (`bench/microbench.py all`, the per-batch split's kernels at EP8-EP144 among them), (5) the
# markdown report with plots (`moe-place report`).
# Writes bench/results/<tag>.json, <tag>.md (+ PNGs) and <tag>.log; the tag names the GPU and time.
# Environment: PYTHON (default: .venv/bin/python when present, else python3), RESULTS (default
# bench/results), BENCH_TIMEOUT seconds for the microbenchmarks (default 180); each kernel test file gets
# at most 100 s.
set -uo pipefail

cd "$(dirname "$0")/.."
DRY=""
for arg in "$@"; do
  case $arg in
    --dry-run) DRY="--dry-run" ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: error: unknown argument $arg (expected --dry-run)" >&2; exit 2 ;;
  esac
done
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
RESULTS=$(mkdir -p "${RESULTS:-bench/results}" && cd "${RESULTS:-bench/results}" && pwd) || exit 2
BENCH_TIMEOUT=${BENCH_TIMEOUT:-180}
started=$(date +%s)
step() { echo "== [$(( $(date +%s) - started ))s] $*" >&2; }

# 1. the package: installed offline if it is not importable yet; if pip cannot (no setuptools, no
#    network), a symlink overlay `moe_place/{kernels,solvers,traces}` on PYTHONPATH does the mapping,
#    and Python runs from that folder so the checkout's own moe_place/ does not shadow it
ROOT=$(pwd)
WORKDIR=$ROOT
py() { (cd "$WORKDIR" && "$PYTHON" "$@"); }
step "python: $PYTHON"
if [ -n "${GPU_CHECK_OVERLAY:-}" ] || ! "$PYTHON" -c "import moe_place.kernels" 2>/dev/null; then
  if [ -z "${GPU_CHECK_OVERLAY:-}" ] && "$PYTHON" -m pip install --no-deps --no-build-isolation --no-index -e . >&2; then
    step "installed moe-place (editable, offline, no dependencies)"
  else
    WORKDIR=$(mktemp -d)
    mkdir "$WORKDIR/moe_place"
    for f in "$ROOT"/moe_place/*; do ln -s "$f" "$WORKDIR/moe_place/"; done
    for d in kernels solvers traces; do ln -s "$ROOT/$d" "$WORKDIR/moe_place/$d"; done
    export PYTHONPATH="$WORKDIR${PYTHONPATH:+:$PYTHONPATH}"
    step "moe_place from a symlink overlay in $WORKDIR (no install)"
  fi
fi
py - <<'PY' >&2 || { echo "gpu_check.sh: error: numpy/torch/triton or moe_place.kernels missing" >&2; exit 2; }
import importlib
for name in ("numpy", "torch", "triton", "networkx", "matplotlib"):
    try:
        mod = importlib.import_module(name)
        print(f"   {name} {getattr(mod, '__version__', '?')}")
    except ImportError:
        print(f"   {name} MISSING" + ("" if name in ("networkx", "matplotlib") else " (required)"))
        if name not in ("networkx", "matplotlib"):
            raise
import moe_place.kernels.grouped_gemm  # noqa: F401  the package maps kernels/ into moe_place
PY

# 2. the machine
if [ -z "$DRY" ]; then
  if ! py -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check.sh: error: no CUDA GPU visible to torch (use --dry-run on a CPU)" >&2; exit 2
  fi
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.limit,driver_version --format=csv >&2 || true
  gpu=$(py -c "import torch; print(torch.cuda.get_device_name(0))" | tr -c 'A-Za-z0-9\n' '_' | tr -s '_')
else
  export TRITON_INTERPRET=1
  gpu="cpu_dry_run"
fi
tag="${gpu}_$(date -u +%Y%m%dT%H%M%SZ)"
log="$RESULTS/$tag.log"
status=0

# 3. kernel tests compiled for real (grouped GEMM bf16/fp8/fp32 and the @pytest.mark.gpu test; the split's
#    tri_ tests: solve and mapping exactly equal to their torch references); the gather/combine kernels are
#    checked against torch inside the dispatch benchmark, the split's at the benchmark's shapes too
if [ -z "$DRY" ]; then
  step "GPU kernel tests"
  (cd "$WORKDIR" && timeout 100 "$PYTHON" -m pytest -q -x --rootdir "$ROOT" -p no:cacheprovider \
    "$ROOT/tests/test_kernels_gemm.py") 2>&1 | tee -a "$log" >&2
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "gpu_check.sh: kernel tests failed (continuing to the benchmarks)" >&2; status=1; }
  (cd "$WORKDIR" && timeout 100 "$PYTHON" -m pytest -q -x --rootdir "$ROOT" -p no:cacheprovider -k tri_ \
    "$ROOT/tests/test_kernels_split.py") 2>&1 | tee -a "$log" >&2
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "gpu_check.sh: split kernel tests failed (continuing to the benchmarks)" >&2; status=1; }
fi

# 4. microbenchmarks
step "microbenchmarks -> $RESULTS/$tag.json"
timeout "$BENCH_TIMEOUT" "$PYTHON" "$ROOT/bench/microbench.py" all $DRY --output-json "$RESULTS/$tag.json" 2>&1 | tee -a "$log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "gpu_check.sh: error: microbenchmarks failed or timed out (see $log)" >&2; exit 1; }

# 5. report: markdown + PNGs next to the JSON
step "report -> $RESULTS/$tag.md"
report_dir=$(mktemp -d)
if py -m moe_place.cli.main report "$RESULTS/$tag.json" --out "$report_dir" > /dev/null 2>>"$log"; then
  for f in "$report_dir"/*.png; do [ -e "$f" ] && cp "$f" "$RESULTS/"; done
  cp "$report_dir/report.md" "$RESULTS/$tag.md"
else
  echo "gpu_check.sh: report with plots failed; writing markdown only" >&2
  py -m moe_place.cli.main report "$RESULTS/$tag.json" --out "$report_dir" --no-plots > /dev/null \
    && cp "$report_dir/report.md" "$RESULTS/$tag.md" || status=1
fi
rm -rf "$report_dir"
[ "$WORKDIR" = "$ROOT" ] || rm -rf "$WORKDIR"
step "done (status $status): $RESULTS/$tag.json $RESULTS/$tag.md"
exit $status
