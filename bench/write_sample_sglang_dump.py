"""Write an SGLang expert-distribution dump from a trace, to try the SGLang path without a server.

The dump is what SGLang's recorder writes with `torch.save` on `/dump_expert_distribution_record`
(`python/sglang/srt/eplb/expert_distribution.py`; the keys as `moe_place.traces.sglang` reads them):
- `--mode stat` (default): one file, rank 0's `{"rank": 0, "logical_count": int32 [steps, layers,
  experts], "average_utilization_rate_over_window": None}`, one row per step of the trace. SGLang's
  `--init-expert-location` takes this file as it is;
- `--mode per_token`: `{"records": [...], "last_physical_to_logical_map": int64 [layers, experts]}`,
  one record per step (`forward_pass_id`, `rank` 0, `gatherer_key` "primary", `topk_ids_of_layer`
  int32 `[layers, tokens, 8]`, the ids in the first k columns and -1 after them, as the recorder keeps
  8), and the trivial map (no redundant slots, so slot ids are expert ids). The recorder's token ids,
  positions and sequence lengths are not in a trace and are left out.
Layers are the trace's layers in order (the bundled Qwen3-30B-A3B trace holds all 48 decoder layers,
every one MoE, so SGLang's layer axis is the same).

    python bench/write_sample_sglang_dump.py --out dump.pt
    moe-place plan dump.pt --gpus 8 --redundant 8 --out p.json

Needs torch (`pip install torch`), as SGLang's own files do.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

from moe_place.errors import InputError
from moe_place.traces import Trace, load_trace

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "traces" / "data" / "qwen3-30b-a3b_prefill_topk.npz"
RECORDED_COLUMNS = 8  # SGLang's per-token recorder keeps 8 ids per token and layer


def stat_dump(trace: Trace) -> dict:
    """SGLang's `stat` dump of `trace`: its per-step counts as `logical_count`."""
    return {"rank": 0, "logical_count": torch.from_numpy(trace.step_counts().astype(np.int32)),
            "average_utilization_rate_over_window": None}


def per_token_dump(trace: Trace) -> dict:
    """SGLang's `per_token` dump of a token-level `trace`: one record per step, the trivial map."""
    if not trace.is_token_level:
        raise InputError("--mode per_token", "a token-level trace (per-token expert ids)", "a trace of counts")
    if trace.top_k > RECORDED_COLUMNS:
        raise InputError("--mode per_token", f"top_k <= {RECORDED_COLUMNS} (the columns SGLang records)", trace.top_k)
    records = []
    for step, ids in enumerate(trace.topk_ids):
        padded = np.full((trace.num_layers, ids.shape[0], RECORDED_COLUMNS), -1, dtype=np.int32)
        padded[:, :, :trace.top_k] = ids.transpose(1, 0, 2)
        records.append({"forward_pass_id": step, "rank": 0, "gatherer_key": "primary",
                        "topk_ids_of_layer": torch.from_numpy(padded)})
    trivial = np.tile(np.arange(trace.num_experts, dtype=np.int64), (trace.num_layers, 1))
    return {"records": records, "last_physical_to_logical_map": torch.from_numpy(trivial)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default=str(BUNDLED), help="trace to write (default: the bundled Qwen3-30B-A3B trace)")
    parser.add_argument("--mode", choices=("stat", "per_token"), default="stat", help="recorder mode (default stat)")
    parser.add_argument("--out", default="dump.pt", help="the .pt file to write (default dump.pt)")
    args = parser.parse_args(argv)
    try:
        trace = load_trace(args.trace)
        dump = stat_dump(trace) if args.mode == "stat" else per_token_dump(trace)
    except InputError as exc:
        print(f"write_sample_sglang_dump: error: {exc}", file=sys.stderr)
        return 2
    torch.save(dump, args.out)
    print(f"wrote SGLang {args.mode} dump {args.out}: {trace.num_steps} steps x {trace.num_layers} layers x "
          f"{trace.num_experts} experts, {trace.num_tokens:,} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
