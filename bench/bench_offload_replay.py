"""Online GPU-resident experts on drifting routing: payback swaps against sglang-kt's dynamic update.

Replays seeded drifting serving runs (`moe_place.online.offload.serving_run` over the drifting
generators of `moe_place.traces.synthetic`: hot spots that move after `persistence` steps on
average, or a drifting mixture of data domains) with decode batches and a prefill every
`--prefill-every` steps, under the policies of `moe_place.online.offload`: `static` (the plan made
on the warm-up steps), `sglang-kt dynamic` (after each full-GPU prefill pass, the batch's most
frequent experts) and `payback` (ours), all from the same warm-up plan, at the same GPU memory, with
the prefill threshold of that plan (`moe_place.cost.offload.prefill_threshold_tokens`). Also: the
plan made on the whole run (hindsight static: a reference that knows the future). Prints total
predicted time (serving + copies) per policy and writes JSON.

    python bench/bench_offload_replay.py [--steps 3000] [--output-json FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from moe_place.cost.hardware import builtin_catalog
from moe_place.cost.models import get_model
from moe_place.cost.offload import OffloadRates, prefill_threshold_tokens
from moe_place.online.offload import POLICIES, replay_offload, serving_run, warm_up_plan
from moe_place.traces.synthetic import domain_mixture, domain_weights, drifting_hot_spots

sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import add_record_options, refuse_overwrite, write_record  # noqa: E402  (bench/ is not a package)

CASES = {  # name: (profile of layers x experts, prefill tokens; None: --prefill-tokens)
    "hot spots, persistence 2000": (lambda L, E: drifting_hot_spots(L, E, 8, 0.5, 2000), None),
    "hot spots, persistence 300": (lambda L, E: drifting_hot_spots(L, E, 8, 0.5, 300), None),
    "hot spots, persistence 30": (lambda L, E: drifting_hot_spots(L, E, 8, 0.5, 30), None),
    "persistence 300, 2048-token prompts": (lambda L, E: drifting_hot_spots(L, E, 8, 0.5, 300), 2048),
    "domain mixture, drift 0.05": (lambda L, E: domain_mixture(domain_weights(4, L, E, 1.0, np.random.default_rng(7)),
                                                               drift=0.05, concentration=2.0), None),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--warm-up", type=int, default=200, help="steps the starting plan is made on (default 200)")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--prefill-tokens", type=int, default=16384)
    parser.add_argument("--prefill-every", type=int, default=100)
    parser.add_argument("--gpu-fraction", type=float, default=0.15, help="share of all experts on the GPU (default 0.15)")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--model", default="Qwen3-30B-A3B")
    parser.add_argument("--seed", type=int, default=0)
    add_record_options(parser)
    args = parser.parse_args(argv)
    refuse_overwrite(parser, args)
    model = get_model(args.model)
    catalog = builtin_catalog()
    gpu, cpu = catalog.gpu("H100"), catalog.cpu("Xeon-Platinum-8452Y")
    rates = OffloadRates.of(gpu, cpu, "amx", alpha_s=5e-6)
    layers, experts = args.layers, model.num_experts
    capacity = int(args.gpu_fraction * layers * experts)
    results = {"model": model.name, "layers": layers, "capacity": capacity, "steps": args.steps, "cases": {}}
    print(f"{model.name} shape, {layers} layers, {capacity} of {layers * experts} experts on an H100, 8452Y AMX; "
          f"{args.steps} steps: decode {args.decode_tokens} tokens, a prefill ({args.prefill_tokens} tokens unless "
          f"said) every {args.prefill_every}; plan on the first {args.warm_up}")
    print(f"{'case':<36} {'policy':<24} {'total s':>9} {'vs static':>10} {'link copies':>12} {'GPU copies':>11}")
    for name, (make, prefill) in CASES.items():
        prefill = args.prefill_tokens if prefill is None else prefill
        mix = [("decode", args.decode_tokens, 1 - 1 / args.prefill_every), ("prefill", prefill, 1 / args.prefill_every)]
        run = serving_run(make(layers, experts), args.steps, model.top_k, args.decode_tokens, prefill,
                          args.prefill_every, args.seed)
        start = warm_up_plan(run, args.warm_up, mix, model, rates, capacity)
        share = np.clip(run.counts[:args.warm_up].sum(axis=0) / run.tokens[:args.warm_up].sum(), 0, 1)
        threshold = prefill_threshold_tokens(share, start, model, rates)
        outcomes = [replay_offload(run, policy, start, model, rates, mix, threshold) for policy in POLICIES]
        hindsight = warm_up_plan(run, run.num_steps, mix, model, rates, capacity)
        outcomes.append(replay_offload(run, "static", hindsight, model, rates, mix, threshold))
        static = outcomes[0].total_s
        entry = {"threshold_tokens": threshold, "policies": {}}
        passes = threshold is not None and threshold <= prefill
        print(f"{name}: full-GPU prefill from {threshold} tokens"
              + ("" if passes else " (above the prefill size: no full-GPU pass, the dynamic update never runs)"))
        for label, outcome in zip(list(POLICIES) + ["hindsight static"], outcomes):
            entry["policies"][label] = outcome.to_json()
            print(f"{name:<36} {label:<24} {outcome.total_s:>9.3f} {outcome.total_s / static - 1:>+10.1%} "
                  f"{outcome.link_copies:>12} {outcome.gpu_copies:>11}")
        results["cases"][name] = entry
    if args.output_json:
        write_record(args.output_json, results)
        print(f"wrote {args.output_json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
