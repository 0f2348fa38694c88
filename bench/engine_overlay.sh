#!/usr/bin/env bash
# Make this checkout of moe-place importable in an engine's Python without installing anything into it:
#
#   bash bench/engine_overlay.sh /path/to/vllm-venv/bin/python /tmp/overlay-vllm
#   PYTHONPATH=/tmp/overlay-vllm /path/to/vllm-venv/bin/python bench/bench_engines.py --engine vllm
#
# OVERLAY/moe_place is a tree of symlinks to this checkout laid out as pip installs it (moe_place.solvers ->
# solvers/, moe_place.kernels -> kernels/, moe_place.traces -> traces/; edits show at once). Packages that
# moe-place needs and the engine's environment lacks (OR-Tools and its own needs, networkx; pytest for
# `python -P -m pytest tests/test_engines_inengine.py`) are put into OVERLAY with `pip install --target
# --no-deps`, so the engine's packages stay as they are (protobuf included: OR-Tools runs on the engine's).
set -euo pipefail
usage="usage: bash bench/engine_overlay.sh [--dry-run] ENGINE_PYTHON OVERLAY_DIR
  links this checkout into OVERLAY_DIR/moe_place (the installed layout) and installs there, with
  pip --target --no-deps, what moe-place needs and ENGINE_PYTHON lacks; then run the engine's Python with
  PYTHONPATH=OVERLAY_DIR.
  --dry-run  say what would be linked and installed; change nothing"
dry=0
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then echo "$usage"; exit 0; fi
if [[ "${1:-}" == "--dry-run" ]]; then dry=1; shift; fi
if (($# != 2)); then echo "$usage" >&2; exit 2; fi
python=$1
overlay=$2
root=$(cd "$(dirname "$0")/.." && pwd)
if ((dry)); then
  echo "would link $root/moe_place/* and $root/{solvers,kernels,traces} into $overlay/moe_place"
else
  mkdir -p "$overlay"
  overlay=$(cd "$overlay" && pwd)
  rm -rf "$overlay/moe_place"
  mkdir "$overlay/moe_place"
  for f in "$root"/moe_place/*; do ln -s "$f" "$overlay/moe_place/$(basename "$f")"; done
  for p in solvers kernels traces; do ln -s "$root/$p" "$overlay/moe_place/$p"; done
fi
cd /  # not the checkout: its unmapped moe_place/ would shadow the overlay's
# module, then the distributions that provide it (without their dependencies: the engine has numpy, protobuf)
needs=("networkx networkx"
       "ortools ortools==9.15.6755 absl-py immutabledict"
       "pandas pandas python-dateutil six tzdata"
       "pytest pytest pluggy iniconfig")
missing=()
for line in "${needs[@]}"; do
  read -r module dists <<< "$line"
  PYTHONPATH="$overlay" "$python" -c "import $module" 2>/dev/null || read -r -a add <<< "$dists"
  if [[ -n "${add[*]:-}" ]]; then missing+=("${add[@]}"); add=(); fi
done
if ((dry)); then
  echo "would install into $overlay: ${missing[*]:-nothing}"
  exit 0
fi
if ((${#missing[@]})); then
  "$python" -m pip install -q --no-deps --target "$overlay" "${missing[@]}"
fi
PYTHONPATH="$overlay" "$python" -c "import moe_place.engines.vllm, moe_place.engines.sglang, moe_place.online.replay; print('moe-place importable from', '$overlay')"
