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
python=${1:?usage: engine_overlay.sh ENGINE_PYTHON OVERLAY_DIR}
overlay=${2:?usage: engine_overlay.sh ENGINE_PYTHON OVERLAY_DIR}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$overlay"
overlay=$(cd "$overlay" && pwd)
cd "$overlay"  # not the checkout: its unmapped moe_place/ would shadow the overlay's
rm -rf "$overlay/moe_place"
mkdir "$overlay/moe_place"
for f in "$root"/moe_place/*; do ln -s "$f" "$overlay/moe_place/$(basename "$f")"; done
for p in solvers kernels traces; do ln -s "$root/$p" "$overlay/moe_place/$p"; done
# module -> the distributions that provide it (without their dependencies: the engine has numpy, protobuf)
missing=()
while read -r module dists; do
  PYTHONPATH="$overlay" "$python" -c "import $module" 2>/dev/null || missing+=($dists)
done <<'EOF'
networkx networkx
ortools ortools==9.15.6755 absl-py immutabledict
pandas pandas python-dateutil six tzdata
pytest pytest pluggy iniconfig
EOF
if ((${#missing[@]})); then
  "$python" -m pip install -q --no-deps --target "$overlay" "${missing[@]}"
fi
PYTHONPATH="$overlay" "$python" -c "import moe_place.engines.vllm, moe_place.engines.sglang, moe_place.online.replay; print('moe-place importable from', '$overlay')"
