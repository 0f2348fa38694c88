"""`moe-place synth SPEC --out TRACE.npz`: save a synthetic routing trace (count level) to a file.

The same generator as `moe-place replay --synthetic SPEC`, written as an npz count trace that every
other command reads: `moe-place synth 'drift:steps=2000,seed=1' --out drift.npz`, then
`moe-place analyze drift.npz` or `moe-place plan drift.npz --gpus 8`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moe_place.cli.options import add_out_argument, trace_file

HELP = "save a synthetic routing trace (the drifting domain-mixture generator of replay) as an npz file"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="SPEC",
                        help="generator and parameters, e.g. 'drift:steps=2000,layers=8,experts=64,seed=0' or "
                             "'drift:preset=deepseek-r1,steps=200' (keys as for `replay --synthetic`)")
    add_out_argument(parser, trace_file, "TRACE.npz", "trace file to write: .npz (counts, our format), .csv or .json "
                     "(count files, moe_place.traces.text); the suffix picks the format", required=True)


def run(args: argparse.Namespace) -> int:
    from moe_place.online.replay import parse_synthetic
    from moe_place.traces.model import Trace, TraceMeta
    from moe_place.traces.npz import save_npz
    from moe_place.traces.text import save_csv, save_json

    counts, params = parse_synthetic(args.spec, "SPEC")
    meta = TraceMeta(num_experts=counts.shape[2], top_k=int(params["top_k"]), layer_ids=tuple(range(counts.shape[1])),
                     model="synthetic", source=f"synthetic:{args.spec}", dtype=str(counts.dtype))
    save = {".npz": save_npz, ".csv": save_csv, ".json": save_json}[Path(args.out).suffix.lower()]
    save(Trace(meta, counts=counts), args.out)
    print(f"wrote trace {args.out}: {counts.shape[0]} steps x {counts.shape[1]} layers x {counts.shape[2]} experts, "
          f"top-{params['top_k']}", file=sys.stderr)
    return 0
